#include "collectives/p2p.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/progress_engine.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

std::string what(const Caller& call, const char* mpi_call) {
  return std::string(call.name) + ": " + mpi_call;
}

int checked_count(std::size_t bytes, const Caller& call, const Communicator& comm) {
  if (bytes > kMaxMessageBytes) {
    throw Error(ErrorCode::internal,
                error_message(call.name, comm.rank(),
                              "message of " + std::to_string(bytes) + " bytes exceeds the " +
                                  std::to_string(kMaxMessageBytes) + "-byte piece limit"));
  }
  return static_cast<int>(bytes);
}

// Calls f(offset, length) for consecutive pieces of at most `piece` bytes covering `bytes`; at
// least once, so an empty transfer is still one (empty) message that pairs up.
template <class F>
void for_each_piece(std::size_t bytes, std::size_t piece, F f) {
  std::size_t offset = 0;
  do {
    const std::size_t n = std::min(piece, bytes - offset);
    f(offset, n);
    offset += n;
  } while (offset < bytes);
}

void count(Communicator& comm, int dest, std::size_t bytes) {
  comm.attachment<Traffic>().count(comm.rank(), dest, bytes);
}

MPI_Request isend_uncounted(const void* buf, std::size_t bytes, int dest, int tag,
                            Communicator& comm, const Caller& call) {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Isend(buf, checked_count(bytes, call, comm), MPI_BYTE, dest, call.context.tag(tag),
                      comm.mpi_comm(), &request),
            what(call, "MPI_Isend"), comm.rank());
  return request;
}

// The requests of one transfer in pieces, kept so that a call allocates nothing once warm.
struct PieceRequests : Attachment {
  explicit PieceRequests(Communicator&) {}
  std::vector<MPI_Request> requests;
};

// Posts one transfer's pieces through `post` into the communicator's request list (reused, so a
// warm call allocates nothing), then waits for them all.
template <class Post>
void post_and_wait(Communicator& comm, const Caller& call, Post post) {
  std::vector<MPI_Request>& requests = comm.attachment<PieceRequests>().requests;
  requests.clear();
  post(requests);
  wait_all(requests.size(), requests.data(), call);
}

// Whether messages between ranks a and b go as pieces: they run on different hosts, or the test
// seam counts every other rank as remote.
bool cut_into_pieces(const Config& config, const Traffic& traffic, int a, int b) {
  return config.tcp_pieces_on_host ? a != b : traffic.remote(a, b);
}

// The largest message towards (or from) `peer`: Config::tcp_piece_bytes where the peer is on
// another host, else kMaxMessageBytes. Both ends of a transfer compute the same.
std::size_t piece_bytes(Communicator& comm, int peer) {
  const Config& config = comm.config();
  if (config.tcp_piece_bytes == 0) return kMaxMessageBytes;
  return cut_into_pieces(config, comm.attachment<Traffic>(), comm.rank(), peer)
             ? config.tcp_piece_bytes
             : kMaxMessageBytes;
}

}  // namespace

Traffic::Traffic(Communicator& comm)
    : counters_(std::make_shared<TrafficCounters>()),
      group_of_rank_(topology::topology_of(comm).group_of_rank),
      host_of_rank_(topology::topology_of(comm).host_of_rank) {}

Traffic::Traffic(std::shared_ptr<TrafficCounters> counters, std::vector<int> group_of_rank,
                 std::vector<int> host_of_rank)
    : counters_(std::move(counters)),
      group_of_rank_(std::move(group_of_rank)),
      host_of_rank_(std::move(host_of_rank)) {}

void Traffic::count(int self, int dest, std::size_t bytes) {
  const bool inter = group_of_rank_[static_cast<std::size_t>(self)] !=
                     group_of_rank_[static_cast<std::size_t>(dest)];
  (inter ? counters_->inter_bytes : counters_->intra_bytes) += bytes;
  ++(inter ? counters_->inter_messages : counters_->intra_messages);
}

std::size_t ring_piece_bytes(Communicator& comm) {
  // First, on every rank: the topology's discovery is collective and checks that the setting
  // is the same everywhere.
  const Traffic& traffic = comm.attachment<Traffic>();
  const Config& config = comm.config();
  const int n = comm.size();
  if (config.tcp_piece_bytes == 0 || n < 2) return kMaxMessageBytes;
  for (int i = 0; i < n; ++i) {
    if (cut_into_pieces(config, traffic, i, (i + 1) % n)) return config.tcp_piece_bytes;
  }
  return kMaxMessageBytes;
}

MPI_Request isend_bytes(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                        const Caller& call) {
  MPI_Request request = isend_uncounted(buf, bytes, dest, tag, comm, call);
  count(comm, dest, bytes);
  return request;
}

MPI_Request irecv_bytes(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                        const Caller& call) {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Irecv(buf, checked_count(bytes, call, comm), MPI_BYTE, source,
                      call.context.tag(tag), comm.mpi_comm(), &request),
            what(call, "MPI_Irecv"), comm.rank());
  return request;
}

void isend_pieces(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                  const Caller& call, std::vector<MPI_Request>& requests) {
  const auto* p = static_cast<const std::byte*>(buf);
  for_each_piece(bytes, piece_bytes(comm, dest), [&](std::size_t offset, std::size_t n) {
    requests.push_back(isend_uncounted(p + offset, n, dest, tag, comm, call));
  });
  count(comm, dest, bytes);  // one transfer, however it is cut
}

void irecv_pieces(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                  const Caller& call, std::vector<MPI_Request>& requests) {
  auto* p = static_cast<std::byte*>(buf);
  for_each_piece(bytes, piece_bytes(comm, source), [&](std::size_t offset, std::size_t n) {
    requests.push_back(irecv_bytes(p + offset, n, source, tag, comm, call));
  });
}

void wait(MPI_Request& request, const Caller& call) {
  wait_all(1, &request, call);
}

void wait_all(std::size_t n, MPI_Request* requests, const Caller& call) {
  // While the call's consistency check is in flight, poll it with the transfers: a peer that
  // made a different call will never send what is awaited, and the check says so. On a progress
  // thread with sleeps between the polls, as every wait there: across hosts the comparison can
  // be in flight for most of a call, and polling it flat out took a third of a core from the
  // application (docs/results/torch.md, "Two threads that polled too often").
  if (on_progress_thread()) {
    const int rc = wait_all_mpi(static_cast<int>(n), requests, [&call] {
      if (call.context.check_pending()) call.context.poll_check();
    });
    return check_mpi(rc, what(call, "MPI_Waitall"));
  }
  while (call.context.check_pending()) {
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(n), requests, &done, MPI_STATUSES_IGNORE),
              what(call, "MPI_Testall"));
    if (done) return;
    call.context.poll_check();
  }
  check_mpi(wait_all_mpi(static_cast<int>(n), requests), what(call, "MPI_Waitall"));
}

void send_recv_bytes(const void* send, std::size_t send_bytes, int dest, void* recv,
                     std::size_t recv_bytes, int source, int tag, Communicator& comm,
                     const Caller& call) {
  const auto* s = static_cast<const std::byte*>(send);
  auto* r = static_cast<std::byte*>(recv);
  // Across hosts, and wherever the two directions have different peers (whose pieces must
  // match their own receives and sends): every receive posted, then every send (p2p.h).
  if (dest != source || piece_bytes(comm, dest) < kMaxMessageBytes) {
    return post_and_wait(comm, call, [&](std::vector<MPI_Request>& requests) {
      irecv_pieces(r, recv_bytes, source, tag, comm, call, requests);
      isend_pieces(s, send_bytes, dest, tag, comm, call, requests);
    });
  }
  std::size_t offset = 0;
  // At least one round, so that two empty windows still pair up (cheap, and keeps it simple).
  do {
    const std::size_t ns =
        send_bytes > offset ? std::min(kMaxMessageBytes, send_bytes - offset) : 0;
    const std::size_t nr =
        recv_bytes > offset ? std::min(kMaxMessageBytes, recv_bytes - offset) : 0;
    // On a progress thread the waits sleep between polls (wait_all_mpi): no blocking MPI call.
    if (call.context.check_pending() || on_progress_thread()) {
      MPI_Request pair[2] = {irecv_bytes(r + (nr ? offset : 0), nr, source, tag, comm, call),
                             isend_uncounted(s + (ns ? offset : 0), ns, dest, tag, comm, call)};
      wait_all(2, pair, call);
    } else {
      check_mpi(
          MPI_Sendrecv(s + (ns ? offset : 0), static_cast<int>(ns), MPI_BYTE, dest,
                       call.context.tag(tag), r + (nr ? offset : 0), static_cast<int>(nr), MPI_BYTE,
                       source, call.context.tag(tag), comm.mpi_comm(), MPI_STATUS_IGNORE),
          what(call, "MPI_Sendrecv"), comm.rank());
    }
    offset += kMaxMessageBytes;
  } while (offset < std::max(send_bytes, recv_bytes));
  count(comm, dest, send_bytes);  // one transfer, however it is cut
}

void send_bytes(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                const Caller& call) {
  const auto* p = static_cast<const std::byte*>(buf);
  if (piece_bytes(comm, dest) < kMaxMessageBytes) {
    return post_and_wait(comm, call, [&](std::vector<MPI_Request>& requests) {
      isend_pieces(p, bytes, dest, tag, comm, call, requests);
    });
  }
  for_each_piece(bytes, kMaxMessageBytes, [&](std::size_t offset, std::size_t n) {
    if (call.context.check_pending() || on_progress_thread()) {
      MPI_Request request = isend_uncounted(p + offset, n, dest, tag, comm, call);
      return wait(request, call);
    }
    check_mpi(MPI_Send(p + offset, static_cast<int>(n), MPI_BYTE, dest, call.context.tag(tag),
                       comm.mpi_comm()),
              what(call, "MPI_Send"), comm.rank());
  });
  count(comm, dest, bytes);  // one transfer, however it is cut
}

void recv_bytes(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                const Caller& call) {
  auto* p = static_cast<std::byte*>(buf);
  if (piece_bytes(comm, source) < kMaxMessageBytes) {
    return post_and_wait(comm, call, [&](std::vector<MPI_Request>& requests) {
      irecv_pieces(p, bytes, source, tag, comm, call, requests);
    });
  }
  for_each_piece(bytes, kMaxMessageBytes, [&](std::size_t offset, std::size_t n) {
    if (call.context.check_pending() || on_progress_thread()) {
      MPI_Request request = irecv_bytes(p + offset, n, source, tag, comm, call);
      return wait(request, call);
    }
    check_mpi(MPI_Recv(p + offset, static_cast<int>(n), MPI_BYTE, source, call.context.tag(tag),
                       comm.mpi_comm(), MPI_STATUS_IGNORE),
              what(call, "MPI_Recv"), comm.rank());
  });
}

}  // namespace gradcomm::collectives
