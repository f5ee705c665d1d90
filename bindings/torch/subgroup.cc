#include "bindings/torch/subgroup.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace gradcomm::torch_backend {
namespace {

constexpr int kMembersTag = 0x6764;  // MPI_Comm_create_group's tag (process_group.cc) + 1

std::string list_text(const int* ranks, std::size_t n) {
  std::string text = "[";
  for (std::size_t i = 0; i < n; ++i)
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "]";
}

// Ends the receives still posted (a cancelled receive completes at once) and lets the sends go:
// a member that never receives them leaves them to MPI, which is what an error can do.
void abandon(std::vector<MPI_Request>& receives, std::vector<MPI_Request>& sends) {
  for (MPI_Request& r : receives) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
  }
  for (MPI_Request& s : sends) {
    if (s != MPI_REQUEST_NULL) MPI_Request_free(&s);
  }
}

// FNV-1a of torch's group name, as two ints at the head of a message.
std::uint64_t name_hash(const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name)
    h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

}  // namespace

void agree_on_members(const std::string& call, const std::vector<int>& members,
                      const std::string& group_name, int world_rank, int world_size,
                      int timeout_seconds, const std::string& timeout_text) {
  std::vector<int> peers;
  for (int r : members) {
    if (r != world_rank) peers.push_back(r);
  }
  if (peers.empty()) return;
  // A message: the name's hash (two ints), the list's length, its ranks.
  constexpr int kHead = 3;
  const int capacity = world_size + kHead;
  const std::uint64_t hash = name_hash(group_name);
  std::vector<int> mine{static_cast<int>(hash & 0xffffffffU), static_cast<int>(hash >> 32),
                        static_cast<int>(members.size())};
  mine.insert(mine.end(), members.begin(), members.end());
  std::vector<int> theirs(peers.size() * static_cast<std::size_t>(capacity));
  std::vector<MPI_Request> receives(peers.size(), MPI_REQUEST_NULL);
  std::vector<MPI_Request> sends(peers.size(), MPI_REQUEST_NULL);
  std::vector<bool> set_aside(peers.size(), false);  // a message under another name came
  const auto receive = [&](std::size_t i) {
    check_mpi(MPI_Irecv(&theirs[i * capacity], capacity, MPI_INT, peers[i], kMembersTag,
                        MPI_COMM_WORLD, &receives[i]),
              call + ": MPI_Irecv", world_rank);
  };
  try {
    for (std::size_t i = 0; i < peers.size(); ++i)
      receive(i);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      check_mpi(MPI_Isend(mine.data(), static_cast<int>(mine.size()), MPI_INT, peers[i],
                          kMembersTag, MPI_COMM_WORLD, &sends[i]),
                call + ": MPI_Isend", world_rank);
    }
    const auto started = std::chrono::steady_clock::now();
    std::size_t pending = peers.size();
    for (int polls = 0; pending > 0; ++polls) {
      for (std::size_t i = 0; i < peers.size(); ++i) {
        if (receives[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        check_mpi(MPI_Test(&receives[i], &done, MPI_STATUS_IGNORE), call + ": MPI_Test",
                  world_rank);
        if (!done) continue;
        const int* got = &theirs[i * capacity];
        if (got[0] != mine[0] || got[1] != mine[1]) {
          set_aside[i] = true;
          receive(i);
          continue;
        }
        --pending;
        const int* list = got + kHead;
        const int n = got[2];
        if (n != static_cast<int>(members.size()) ||
            !std::equal(members.begin(), members.end(), list)) {
          throw MismatchError(
              error_message(call, world_rank,
                            "the members disagree on the subgroup: this process (world rank " +
                                std::to_string(world_rank) + ") was given ranks " +
                                list_text(members.data(), members.size()) + ", world rank " +
                                std::to_string(peers[i]) + " was given " +
                                list_text(list, static_cast<std::size_t>(std::max(0, n))) +
                                ": every member must call new_group with the same ranks"));
        }
      }
      if (pending == 0) break;
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (timeout_seconds > 0 && waited > timeout_seconds) {
        std::string missing, elsewhere;
        for (std::size_t i = 0; i < peers.size(); ++i) {
          if (receives[i] == MPI_REQUEST_NULL) continue;
          missing += (missing.empty() ? "" : ", ") + std::to_string(peers[i]);
          if (set_aside[i]) elsewhere += (elsewhere.empty() ? "" : ", ") + std::to_string(peers[i]);
        }
        throw CommError(error_message(
            call, world_rank,
            "world rank(s) " + missing + " did not make the subgroup of ranks " +
                list_text(members.data(), members.size()) + " (torch's group '" + group_name +
                "') within " + std::to_string(timeout_seconds) + " s (" + timeout_text + ")" +
                (elsewhere.empty() ? ""
                                   : "; world rank(s) " + elsewhere +
                                         " sent the members of another new_group call") +
                ": every member must call new_group with the same ranks"));
      }
      // Spin briefly, then give the core away: members may share cores with each other.
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    // Every member has posted its receive from this one (it sent, so it posted first).
    check_mpi(MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE),
              call + ": MPI_Waitall", world_rank);
  } catch (...) {
    abandon(receives, sends);
    throw;
  }
}

}  // namespace gradcomm::torch_backend
