#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "collectives/allreduce_algorithm.h"
#include "collectives/owner_exchange.h"

namespace gradcomm::collectives {

// Intra-node all-reduce through shared memory, for communicators whose ranks all share one
// host. Ranks read each other's data from a segment every rank maps, synchronised by counters in
// that segment (acquire/release; waits spin briefly, then yield the core). Two paths:
//   - latency path (<= 16 KiB): each rank copies its input into its slot, raises one counter, and
//     every rank reduces all slots in rank order straight into its output: one flag round;
//   - staged path: the buffer goes in rounds of 256 KiB per rank; each rank copies a round into
//     its slot, reduces its 1/n of the round from all slots (rank order) into a shared result,
//     and copies the whole round out, the next round's copy-in overlapping the wait for peers.
//     The working set stays cache-resident, so memory sees about one read of the input and one
//     write of the output per rank. A registered input (Communicator::allocate) skips the
//     copy-in: peers read it in place.
// Each part is reduced by one rank, in rank order, so every rank ends with the same bits (those
// of the serial reduction). Ranks that disagree on count, dtype or op get an error on every rank
// instead of reading past a buffer. A peer that exits while others wait is detected (its pid),
// and the waiters throw CommError instead of hanging.
// The latency path's limit and the staged path's round size (bytes per rank), for the cost model.
inline constexpr std::size_t kShmSmallBytes = std::size_t{16} << 10;
inline constexpr std::size_t kShmChunkBytes = std::size_t{256} << 10;

// How one rank writes the segment in calls of 4 MiB and more (Config::shm_stores; smaller ones
// keep plain stores, their data still cached when peers read it): the all-reduce's slots and
// results, and the slots and published columns of hierarchical's phases, each chosen apart. A plain
// store first reads its line, and a line that a peer's core read a round ago must then come from
// that core. On this 2-core VM that costs little in some periods and 4-6x the copy in others, as
// the host moves the two virtual CPUs between shared and separate caches: a 32 MiB call on 2 ranks
// takes 6 ms or 22 ms, switching within a run. Non-temporal stores never read the line but leave
// the data in memory, where peers read it more slowly than from a shared cache: 8.5 ms in both
// periods. "auto" times its calls (per byte, per size class: sizes within a factor of 2) both ways
// and keeps the cheaper: after three calls each way, alternating (a new size class starts from the
// nearest class measured both ways instead), one call in probe_after() goes the
// other way (8 calls after a switch, doubling to 64 while the choice holds; at once again when a
// probe came out kMargin times cheaper), and the choice switches when the other way's median of
// its last three calls is kMargin times cheaper. Each
// rank chooses for itself (every write is fenced before the counter that publishes it, so results
// do not depend on the choice); all ranks time the same calls, so they rarely differ.
class ShmStores {
 public:
  static constexpr int kFirstProbe = 8, kLastProbe = 64;
  static constexpr double kMargin = 1.2;

  // mode: "auto", "cached" or "streamed".
  explicit ShmStores(const std::string& mode);
  // Whether the next call of `bytes` streams its stores (counts the call).
  bool next_call_streams(std::size_t bytes);
  // A call of `bytes` took `seconds` with streamed stores or not; true when the choice changed.
  bool record(std::size_t bytes, bool streamed, double seconds);
  // The current choice at `bytes` (auto: not counting probes).
  bool streaming(std::size_t bytes) const;
  // Median seconds per byte of the last three calls each way at `bytes` (0: none yet).
  double cost(std::size_t bytes, bool streamed) const;
  int probe_after(std::size_t bytes) const { return classes_[size_class(bytes)].probe_after; }

 private:
  struct Class {
    bool streaming = false;
    int since_probe = 0, probe_after = kFirstProbe;
    std::array<std::array<double, 3>, 2> samples{};  // per way, the last three
    std::array<long, 2> counts{};
    double cost(bool streamed) const;
  };
  static std::size_t size_class(std::size_t bytes);
  int fixed_;  // -1: auto; 0: cached; 1: streamed
  std::array<Class, 65> classes_{};
};

class AllreduceShm : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "shm"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

// True on every rank when shm can run on `comm`: more than one rank, all on one host, and its
// segment could be created (collective on first use, which creates the segment; cached).
bool shm_available(Communicator& comm);

// Drops this rank's view of the communicator's segment. Called on every rank together after a
// mismatch ended a call, possibly half-way through shm's protocol: the next shm call builds a
// fresh segment, so no rank waits on counters the others abandoned.
void forget_shm_state(Communicator& comm);

// How many ranks of `comm` share this rank's host (MPI_Comm_split_type; collective on first
// use, cached on the communicator).
int ranks_on_this_host(Communicator& comm);

// How many ranks of `comm` run under this rank's kernel (same boot id), which share its CPUs:
// ranks_on_this_host on real clusters, more on hosts emulated in namespaces or containers of one
// machine. Same caching.
int ranks_on_this_machine(Communicator& comm);

// True on every rank when some machine runs more of `comm`'s ranks than it has hardware threads
// (ranks_on_this_machine against hwloc's count; collective).
bool machine_oversubscribed(Communicator& comm);

// True on every rank when all ranks of `comm` share one host (collective on first use; cached).
bool shares_one_host(Communicator& comm);

// Hierarchical's intra-group phases through the group's segment (group: a communicator whose
// ranks share this host, shm_available). Same contract as reduce_scatter_to_owners and
// allgather_from_owners (owner_exchange.h), without messages: rounds carry a cache-sized
// sub-piece of every column; in the reduce-scatter each rank copies its round into its slot and
// each column's owner reduces the members' slots, in member order, straight into its output; in
// the all-gather owners publish their columns and every rank copies the others' out. Ranks that
// disagree on the call fail together, as in shm's all-reduce.
void shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                  const ColumnLayout& layout, Communicator& group);
void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group);
// Tells shm that `sub` runs beside other ranks of this machine (`ranks` in all, counting its
// own): with more ranks than cores its waits yield at once instead of spinning first. Call before
// the first shm use of `sub`.
void share_machine_with(Communicator& sub, int ranks);
// True when a round can carry one element of each of `columns` columns.
bool shm_columns_fit(std::size_t columns, std::size_t element_bytes);

}  // namespace gradcomm::collectives
