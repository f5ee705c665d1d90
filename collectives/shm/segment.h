#pragma once

// The shared-memory segment of one communicator whose ranks share a host, and this rank's view
// of it: what `shm`'s all-reduce (allreduce_shm.h) and hierarchical's shared-memory phases
// (owner_exchange_shm.h) read and write.
//
// Protocol. Rounds are numbered 1, 2, ... per communicator, the same on every rank (an all-reduce
// is one round on the latency path and where every rank's buffers are registered, else ceil(bytes /
// round size) rounds, the round ShmState::allreduce_round(): kShmRoundBytes
// (kShmRoundIntelPairBytes on 2 ranks of an Intel CPU), or kShmStageSlots times kShmRoundBytes
// where `spin` is 0 (`spin` and small_own_cpu are the same on every rank); hierarchical's phases
// likewise per phase, in rounds of kShmRoundBytes). Every rank owns three
// monotonic counters in the segment, each holding the last round it finished a stage of: `copied`
// (its input of that round is readable), `reduced` (its part of the round's result is written),
// `drained` (it has copied the round out, or on the latency path reduced it). Small slots, packets
// and descriptors come in two halves used by odd and even rounds; round r reuses round r - 2's half
// without waiting, because every round ends only once every peer has begun it (so no peer still
// reads round r - 2's). Stage slots come in kShmStageSlots: round r stores into slot r %
// kShmStageSlots once the last readers of round r - kShmStageSlots are done (the all-reduce: this
// rank drained that round, which waited for every reducer of it; hierarchical's phases: every rank
// drained it). An all-reduce round that takes all the slots stores only once this rank has
// drained every earlier round, so no reader of any of them is left.
//
// A call's descriptor (count, dtype, op, path, where a registered input and output lie) is
// written with the first round's input and read by every rank once that round's `copied` counters
// are up; ranks then all see the same descriptors and decide the same way, including to fail.

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/allreduce_algorithm.h"
#include "core/shared_memory.h"

namespace gradcomm::collectives {

// Names shm in errors.
inline constexpr std::string_view kShmCall = "allreduce(shm)";
// The latency path's slot per rank and round: the most it can carry. A staged round carries
// kShmRoundBytes per rank (and a round of hierarchical's phases at most that of all columns
// together).
inline constexpr std::size_t kShmSmallBytes = std::size_t{16} << 10;
// Where the all-reduce takes its latency path (one flag round, every rank reading every input
// whole): up to 8 KiB where ranks share CPUs, and every flag round may cost a context switch.
// Where each rank has a CPU of its own the staged path's two flag rounds cost less than reading
// the peers' inputs whole from somewhat above 1 KiB, and where depends on the CPU
// (docs/results/shm.md, "The latency path's limit", "The latency path on Intel Xeon" and "The
// staged path proves the call"):
// - AMD EPYC, 2 ranks: 1 KiB. At 4 KiB 0.77 against 0.95 us, 8 KiB 0.96 against 1.66; at 2 KiB
//   even in the VM's fast spells and 1.46-1.58 against 1.84-1.89 us in its slow ones (measured
//   before either path's changes of 2026-12-06 below; not measured since);
// - Intel Xeon, 2 ranks: 2 KiB. With the staged path proving the call from its packets and the
//   latency path prefetching its next slot (both 2026-12-06), the latency path at 2 KiB takes
//   0.81-0.86 of the staged path's time (0.82-0.89 against 1.00-1.08 us, private and registered,
//   back to back and in the cycle); at 4 KiB the staged path is ahead.
// `crowded` and `own_cpu` must be the same on every rank of the segment (ShmState agrees them:
// `spin`, `small_own_cpu`).
inline constexpr std::size_t kShmSmallCrowdedBytes = std::size_t{8} << 10;
inline constexpr std::size_t kShmSmallOwnCpuBytes = std::size_t{1} << 10;
inline constexpr std::size_t kShmSmallOwnCpuIntelBytes = std::size_t{2} << 10;
constexpr std::size_t shm_small_limit(bool crowded, std::size_t own_cpu) {
  return crowded ? kShmSmallCrowdedBytes : own_cpu;
}
static_assert(kShmSmallCrowdedBytes <= kShmSmallBytes && kShmSmallOwnCpuBytes <= kShmSmallBytes &&
              kShmSmallOwnCpuIntelBytes <= kShmSmallBytes);
// shm_allreduce_round_bytes tells an Intel CPU by its agreed latency limit.
static_assert(kShmSmallOwnCpuIntelBytes != kShmSmallOwnCpuBytes);
// This rank's CPU's limit where ranks have CPUs of their own: kShmSmallOwnCpuIntelBytes on an
// Intel x86 CPU (cpuid's vendor), else kShmSmallOwnCpuBytes. Ranks take the smallest of theirs.
std::size_t shm_small_own_cpu_bytes_here();
inline constexpr std::size_t kShmRoundBytes = std::size_t{256} << 10;
inline constexpr std::size_t kShmStageSlots = 4;
inline constexpr std::size_t kShmLine = 64;
// A staged round's bytes per rank: one stage slot, or all of them where ranks share CPUs.
constexpr std::size_t shm_round_bytes(bool crowded) {
  return crowded ? kShmRoundBytes * kShmStageSlots : kShmRoundBytes;
}
// The all-reduce's staged round on 2 ranks of an Intel CPU with a CPU each: half a slot. There a
// private call's send, receive and stage memory outgrow the L2 (2 MiB per core on the Xeon
// measured), and half rounds took 0.87-0.98 of the time at 512 KiB-16 MiB (medians of 4
// launches; out of place and in place, back to back and in the cycle), 64 MiB 0.96-1.01, 64-256
// KiB 0.93-1.00 (docs/results/shm.md, "Half rounds on Intel Xeon"). On AMD EPYC they lost (the
// same page, "The lead-in"); more ranks than 2 were not measured on Intel.
inline constexpr std::size_t kShmRoundIntelPairBytes = kShmRoundBytes / 2;
// The all-reduce's staged round: shm_round_bytes where ranks share CPUs, else from the agreed
// latency limit (`small_own_cpu`: kShmSmallOwnCpuIntelBytes where every rank's CPU is Intel's)
// and the ranks. ShmState and auto's model (AllreduceShm::predicted_seconds) both take it here.
constexpr std::size_t shm_allreduce_round_bytes(bool crowded, std::size_t small_own_cpu,
                                                int ranks) {
  if (crowded) return shm_round_bytes(true);
  return small_own_cpu == kShmSmallOwnCpuIntelBytes && ranks == 2 ? kShmRoundIntelPairBytes
                                                                  : kShmRoundBytes;
}

using ShmCounter = std::atomic<std::uint64_t>;
static_assert(ShmCounter::is_always_lock_free, "counters must work across processes");

// small and staged: the all-reduce's two paths; columns: hierarchical's intra-group phases;
// scatter: the reduce-scatter (reduce_scatter_shm.cc); gather: the all-gather (allgather_shm.cc).
enum class ShmPath : std::uint32_t { small = 1, staged = 2, columns = 3, scatter = 4, gather = 5 };

// ShmDescriptor::registered's bits.
inline constexpr std::uint32_t kShmInputRegistered = 1, kShmOutputRegistered = 2;

struct ShmDescriptor {
  std::uint64_t count;
  std::uint32_t dtype, op, path, registered;  // registered: kShm*Registered bits
  std::uint64_t segment, offset;              // of a registered input
  std::uint64_t out_segment, out_offset;      // of a registered output
  std::uint64_t sequence;                     // the call's fingerprint beyond count, dtype and op
  std::int32_t algorithm;  // (GRADCOMM_CHECK: compared here instead of by a message)
  std::uint32_t in_call;   // 1 when made inside a front-door call (sequence is valid)
};

// A latency-path call in one cache line: its fingerprint, its data when it fits in `data`, and
// the round as the flag, written last (release). A peer that waits on `round` gets everything
// the call needs to compare and reduce in that one line transfer.
// The latency path's counts fit 32 bits (at most kShmSmallBytes), and the sequence is compared
// by its low 32 bits (calls that far apart never meet in one round); half the line is data.
inline constexpr std::size_t kShmInlineBytes = 32;
struct alignas(kShmLine) SmallPacket {
  ShmCounter round{0};
  std::uint64_t fingerprint = 0;  // CallContext::fingerprint(): the whole call, hashed
  std::uint32_t count = 0;
  std::uint32_t sequence = 0;
  std::int16_t algorithm = -1;
  std::uint8_t dtype = 0, op = 0, path = 0, in_call = 0;
  alignas(16) std::byte data[kShmInlineBytes] = {};
};
static_assert(sizeof(SmallPacket) == kShmLine, "one cache line");

// One rank's part of the control block; every counter on its own cache line.
struct RankControl {
  alignas(kShmLine) ShmCounter copied{0};
  alignas(kShmLine) ShmCounter reduced{0};
  alignas(kShmLine) ShmCounter drained{0};
  alignas(kShmLine) std::int64_t pid = 0;
  std::atomic<int> cpu{-1};  // the CPU the rank last waited on (spin only where it differs)
  ShmDescriptor descriptor[2] = {};
  SmallPacket packet[2];  // by round parity, as the descriptors
};

// Where every rank's registered buffers lie in this process (nullptr where not registered).
struct ShmPeers {
  std::vector<const std::byte*> inputs;
  std::vector<std::byte*> outputs;
};

inline std::size_t align_up(std::size_t value, std::size_t to) {
  return (value + to - 1) / to * to;
}

// The segment of one communicator and this rank's view of it, built on first use (collective).
class ShmState : public Attachment {
 public:
  explicit ShmState(Communicator& comm);
  // A call abandoned by a mismatch leaves counters mid-protocol: map a fresh segment then.
  bool survives_mismatch() const override { return false; }

  RankControl& control(int j) const { return reinterpret_cast<RankControl*>(segment.data())[j]; }
  std::byte* small_slot(int j, std::uint64_t round) const {
    return segment.data() + small_offset +
           (static_cast<std::size_t>(j) * 2 + round % 2) * kShmSmallBytes;
  }
  std::byte* stage(int j, std::uint64_t round) const {
    return segment.data() + stage_offset +
           (static_cast<std::size_t>(j) * kShmStageSlots + round % kShmStageSlots) * kShmRoundBytes;
  }

  // Waits until every other rank's `which` counter reaches `target`. Spins briefly, then yields,
  // letting MPI progress and polling the call's check (`call`) now and then; checks that the
  // awaited rank is still alive (CommError when it exited).
  void wait_all(ShmCounter RankControl::*which, std::uint64_t target, const char* stage_name,
                const CallContext& call) const;
  // The same for one counter of rank j.
  void wait_for(int j, const ShmCounter& counter, std::uint64_t target, const char* stage_name,
                const CallContext& call) const;

  int rank, size;
  MPI_Comm mpi;             // the communicator's (progress only)
  std::string unavailable;  // why shm cannot run here; empty when it can
  bool unavailable_is_message = false;
  SharedSegment segment;
  std::size_t control_bytes = 0, small_offset = 0, stage_offset = 0;
  std::vector<pid_t> pids;
  long spin = 0;
  // The latency path's limit where ranks have CPUs of their own: the smallest rank's
  // shm_small_own_cpu_bytes_here().
  std::size_t small_own_cpu = kShmSmallOwnCpuBytes;
  std::size_t small_limit() const { return shm_small_limit(spin == 0, small_own_cpu); }
  // The all-reduce's staged round (shm_allreduce_round_bytes).
  std::size_t allreduce_round() const {
    return shm_allreduce_round_bytes(spin == 0, small_own_cpu, size);
  }
  std::uint64_t round = 0;  // the last round this rank started
  // The all-reduce's per-call scratch, one entry per rank (no allocation per call): its sources
  // and targets, the descriptors agree_on_call reads, and where registered buffers lie.
  std::vector<const std::byte*> sources;
  std::vector<std::byte*> targets;
  std::vector<ShmDescriptor> descriptors;
  ShmPeers peers;
};

// The communicator's shm state; throws Unsupported (why) where shm cannot run.
ShmState& usable_state(Communicator& group);

// This rank's packet of round `first`, filled with the call of `args` on `path`: all but the
// round, which the caller stores last (it is the flag). A peer on the latency path compares it
// (the count only there: a staged path's count is in the descriptor).
SmallPacket& fill_packet(ShmState& s, std::uint64_t first, const AllreduceArgs& args, ShmPath path);

// The end of this rank's round r of a staged call whose peers only read its slot (the
// reduce-scatter, the all-gather), once it has read its peers' round r: marks it `reduced`, and
// unless `last` stages the next round (`stage_next`) and marks it `copied`. The next round goes
// into the next slot while the peers may still read this one: every peer has staged round r,
// so it has read round r - 1 and before, and slot r + 1 was last used by round r + 1 -
// kShmStageSlots. Where a round takes every slot (spin 0), or at the call's end, this rank first
// waits until every peer is done with round r.
template <class StageNext>
void end_read_round(ShmState& s, std::uint64_t r, bool last, StageNext&& stage_next,
                    const char* stage_name, const CallContext& call) {
  RankControl& mine = s.control(s.rank);
  const bool whole = s.spin == 0;
  mine.reduced.store(r, std::memory_order_release);
  if (!last && !whole) {
    stage_next();
    mine.copied.store(r + 1, std::memory_order_release);
  } else {
    s.wait_all(&RankControl::reduced, r, stage_name, call);
  }
  mine.drained.store(r, std::memory_order_release);
  if (!last && whole) {
    stage_next();
    mine.copied.store(r + 1, std::memory_order_release);
  }
}

// The descriptor of this rank's call: its fingerprint (args.call), where a registered input and
// a registered output lie.
ShmDescriptor descriptor_of(const AllreduceArgs& args, ShmPath path,
                            const std::optional<RegisteredLocation>& input,
                            const std::optional<RegisteredLocation>& output = std::nullopt);

// Once every rank's `copied` counter has reached `first` (the call's first round), every rank
// reads the same descriptors and decides the same way: returns where each rank's registered
// buffers lie here, or, when the ranks disagree, leaves the counters where every rank expects
// them and throws on every rank.
ShmPeers agree_on_call(ShmState& s, std::uint64_t first, const CallContext& call);
// The same into `peers` (the all-reduce's s.peers: no allocation per call); returns it.
const ShmPeers& agree_on_call(ShmState& s, std::uint64_t first, const CallContext& call,
                              ShmPeers& peers);

// result = sources[0] op sources[1] op ... in rank order, over `n` elements of args.dtype with
// args.op (at least two sources); avg divides by `ranks` at the end.
void reduce_sources(std::byte* result, const std::vector<const std::byte*>& sources, std::size_t n,
                    const AllreduceArgs& args, int ranks);

// True on every rank when shm can run on `comm`: more than one rank, all on one host, and its
// segment could be created (collective on first use, which creates the segment; cached).
bool shm_available(Communicator& comm);

// Tells shm that `sub` runs beside other ranks of this machine (`ranks` in all, counting its
// own): with more ranks than cores its waits yield at once instead of spinning first. Call before
// the first shm use of `sub`.
void share_machine_with(Communicator& sub, int ranks);

}  // namespace gradcomm::collectives
