#pragma once

// Byte-level point-to-point helpers shared by the algorithms. MPI counts are int: messages larger
// than kMaxMessageBytes are split into pieces, identically on both sides. Towards a rank on
// another host, the transfers of any size (send_recv_bytes, send_bytes, recv_bytes and the
// *_pieces helpers, not isend_bytes / irecv_bytes) go as pieces of Config::tcp_piece_bytes,
// every receive posted before the sends: under the MPI library's eager limit, no piece waits for
// a clear-to-send that the peer's own outgoing data delays
// (docs/algorithms.md#messages-between-hosts). The ring, which sends isend_bytes segments, cuts
// them no larger than ring_piece_bytes.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "collectives/check/call_context.h"
#include "core/communicator.h"

namespace gradcomm::collectives {

inline constexpr std::size_t kMaxMessageBytes = std::size_t{1} << 30;

// Tags, one per algorithm, so a trace shows which algorithm a message belongs to.
enum Tag : int {
  kTagFlat = 101,
  kTagRing = 102,
  kTagHalvingDoubling = 103,
  kTagHierarchical = 104,
};

// Bytes and messages a rank sent inside its hierarchical group (node) and across groups, counted
// by the helpers below for gradcomm's own algorithms (not for MPI_Allreduce's internals). A
// transfer cut into pieces (isend_pieces, the *_bytes helpers) counts as one message.
struct TrafficCounters {
  std::uint64_t intra_bytes = 0;
  std::uint64_t inter_bytes = 0;
  std::uint64_t intra_messages = 0;
  std::uint64_t inter_messages = 0;
};

// Per-communicator classification of destinations and the counters it adds to. By default the
// groups and hosts come from the communicator's topology (discovered on first use, collectively)
// and the counters are its own; a sub-communicator created by an algorithm shares its parent's.
class Traffic : public Attachment {
 public:
  explicit Traffic(Communicator& comm);
  Traffic(std::shared_ptr<TrafficCounters> counters, std::vector<int> group_of_rank,
          std::vector<int> host_of_rank);
  void count(int self, int dest, std::size_t bytes);
  // Whether `peer` runs on another host than `self` (the real hosts, whatever layout is
  // emulated): messages between them go over the network.
  bool remote(int self, int peer) const {
    return host_of_rank_[static_cast<std::size_t>(self)] !=
           host_of_rank_[static_cast<std::size_t>(peer)];
  }
  TrafficCounters& counters() { return *counters_; }
  std::shared_ptr<TrafficCounters> shared_counters() const { return counters_; }

 private:
  std::shared_ptr<TrafficCounters> counters_;
  std::vector<int> group_of_rank_;
  std::vector<int> host_of_rank_;
};

// Who sends or waits: `name` names the caller in errors ("allreduce(ring)"); `context` is the
// call's (its tags' salt, and the comparison of fingerprints that waits poll: a peer that made
// a different call never sends what is awaited, and the comparison says so).
struct Caller {
  std::string_view name;
  const CallContext& context;
};

// Non-blocking send/receive of at most kMaxMessageBytes.
MPI_Request isend_bytes(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                        const Caller& call);
MPI_Request irecv_bytes(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                        const Caller& call);
void wait(MPI_Request& request, const Caller& call);
void wait_all(std::size_t n, MPI_Request* requests, const Caller& call);

// Blocking exchange of any size (split into pieces when large).
void send_recv_bytes(const void* send, std::size_t send_bytes, int dest, void* recv,
                     std::size_t recv_bytes, int source, int tag, Communicator& comm,
                     const Caller& call);
void send_bytes(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                const Caller& call);
void recv_bytes(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                const Caller& call);

// The largest message the ring (rank i to i + 1 mod n) should send: Config::tcp_piece_bytes
// where any of its links crosses hosts (as for the pieces above), else kMaxMessageBytes. The same
// on every rank; collective on a communicator's first use, as any transfer is (its topology).
std::size_t ring_piece_bytes(Communicator& comm);

// Non-blocking transfers of any size, split into pieces of at most kMaxMessageBytes, or of
// Config::tcp_piece_bytes towards another host (both sides split identically); the requests are
// appended to `requests`.
void isend_pieces(const void* buf, std::size_t bytes, int dest, int tag, Communicator& comm,
                  const Caller& call, std::vector<MPI_Request>& requests);
void irecv_pieces(void* buf, std::size_t bytes, int source, int tag, Communicator& comm,
                  const Caller& call, std::vector<MPI_Request>& requests);

}  // namespace gradcomm::collectives
