// Shared-memory all-reduce inside one host (see allreduce_shm.h for the two paths).
//
// Protocol. Rounds are numbered 1, 2, ... per communicator, the same on every rank (a call is one
// round on the latency path, ceil(bytes / kChunkBytes) rounds on the staged path). Every rank
// owns three monotonic counters in the segment, each holding the last round it finished a stage
// of: `copied` (its input of that round is readable), `reduced` (its part of the round's result
// is written), `drained` (it has copied the round out, or on the latency path reduced it). Slots,
// results and descriptors come in two halves used by odd and even rounds. Before round r writes a
// half, the rank waits until every rank has drained round r - 2, the last user of that half.
//
// A call's descriptor (count, dtype, op, path, where a registered input lies) is written with the
// first round's input and read by every rank once that round's `copied` counters are up; ranks
// then all see the same descriptors and decide the same way, including to fail.

#include "collectives/allreduce_shm.h"

#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "collectives/consistency.h"
#include "collectives/owner_exchange.h"
#include "collectives/p2p.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "core/shared_memory.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kCall = "allreduce(shm)";
constexpr std::size_t kSmallBytes = kShmSmallBytes;  // latency path up to this
constexpr std::size_t kChunkBytes = kShmChunkBytes;  // staged round, per rank
constexpr std::size_t kLine = 64;
// From this size on, the copy-out bypasses the cache: the output cannot stay cached anyway, and
// not reading it before overwriting saves a third of the copy's memory traffic (64 MiB on 2 ranks
// here: 12 ms instead of 14-19 ms; at 1 MiB the cached copy is as fast and leaves the output
// where the caller reads it next).
constexpr std::size_t kStreamFromBytes = std::size_t{4} << 20;

using Counter = std::atomic<std::uint64_t>;
static_assert(Counter::is_always_lock_free, "counters must work across processes");

// small and staged: the all-reduce's two paths; columns: hierarchical's intra-group phases.
enum class Path : std::uint32_t { small = 1, staged = 2, columns = 3 };

struct Descriptor {
  std::uint64_t count;
  std::uint32_t dtype, op, path, registered;
  std::uint64_t segment, offset;  // of a registered input
  std::uint64_t sequence;         // the call's fingerprint beyond count, dtype and op
  std::int32_t algorithm;         // (GRADCOMM_CHECK: compared here instead of by a message)
  std::uint32_t in_call;          // 1 when made inside a front-door call (sequence is valid)
};

// One rank's part of the control block; every counter on its own cache line.
struct RankControl {
  alignas(kLine) Counter copied{0};
  alignas(kLine) Counter reduced{0};
  alignas(kLine) Counter drained{0};
  alignas(kLine) std::int64_t pid = 0;
  std::atomic<int> cpu{-1};  // the CPU the rank last waited on (spin only where it differs)
  Descriptor descriptor[2] = {};
};

std::size_t align_up(std::size_t value, std::size_t to) {
  return (value + to - 1) / to * to;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// How many ranks of the communicator share this rank's host (collective on first use).
class HostCheck : public Attachment {
 public:
  explicit HostCheck(Communicator& comm) {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm.mpi_comm(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL,
                                  &node),
              "allreduce(shm): MPI_Comm_split_type", comm.rank());
    MPI_Comm_size(node, &on_host);
    MPI_Comm_free(&node);
    // Ranks under the same running kernel (boot id) share its CPUs even when MPI sees separate
    // nodes: the emulated hosts of scripts/hosts, containers. One allgather of 8 bytes.
    std::uint64_t mine = 0;
    std::ifstream id("/proc/sys/kernel/random/boot_id");
    std::string text;
    if (std::getline(id, text) && !text.empty()) mine = std::hash<std::string>{}(text) | 1;
    std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
    check_mpi(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm.mpi_comm()),
              "allreduce(shm): MPI_Allgather", comm.rank());
    on_machine = mine == 0 ? on_host : static_cast<int>(std::count(all.begin(), all.end(), mine));
  }
  int on_host = 1;
  int on_machine = 1;  // >= on_host
};

// How many ranks run on this machine as far as the spin-or-yield choice goes: set by an
// algorithm that runs shm on a sub-communicator of a larger one (0: the sub-communicator's own).
class MachineRanks : public Attachment {
 public:
  explicit MachineRanks(Communicator&) {}
  int ranks = 0;
};

// The segment of one communicator and this rank's view of it, built on first use.
class ShmState : public Attachment {
 public:
  explicit ShmState(Communicator& comm)
      : rank(comm.rank()),
        size(comm.size()),
        mpi(comm.mpi_comm()),
        stores(comm.config().shm_stores),
        scatter_stores(comm.config().shm_stores),
        gather_stores(comm.config().shm_stores) {
    const HostCheck& host = comm.attachment<HostCheck>();
    if (host.on_host != size) {
      unavailable = "only " + std::to_string(host.on_host) + " of the " + std::to_string(size) +
                    " ranks share this host; shm works inside one node (use hierarchical, which "
                    "runs shm inside each node)";
      return;
    }
    const auto n = static_cast<std::size_t>(size);
    control_bytes = align_up(n * sizeof(RankControl), 4096);
    small_offset = control_bytes;
    stage_offset = small_offset + n * 2 * kSmallBytes;
    result_offset = stage_offset + n * 2 * kChunkBytes;
    try {
      segment = SharedSegment(comm.mpi_comm(), result_offset + 2 * kChunkBytes, kCall);
    } catch (const CommError& e) {  // thrown on every rank alike (e.g. /dev/shm is full)
      unavailable = e.what();       // already names the call, the rank and the reason
      unavailable_is_message = true;
      return;
    }
    new (&control(rank)) RankControl();
    control(rank).pid = getpid();
    check_mpi(MPI_Barrier(comm.mpi_comm()), "allreduce(shm): MPI_Barrier", rank);
    for (int j = 0; j < size; ++j)
      pids.push_back(static_cast<pid_t>(control(j).pid));
    // Oversubscribed (counting the ranks of an enclosing communicator, whose others may be busy
    // elsewhere: hierarchical's groups): yield at once instead of spinning.
    const int busy = std::max(size, comm.attachment<MachineRanks>().ranks);
    spin = busy <= usable_cores() ? 2000 : 0;
  }

  RankControl& control(int j) const { return reinterpret_cast<RankControl*>(segment.data())[j]; }
  std::byte* small_slot(int j, std::uint64_t round) const {
    return segment.data() + small_offset +
           (static_cast<std::size_t>(j) * 2 + round % 2) * kSmallBytes;
  }
  std::byte* stage(int j, std::uint64_t round) const {
    return segment.data() + stage_offset +
           (static_cast<std::size_t>(j) * 2 + round % 2) * kChunkBytes;
  }
  std::byte* result(std::uint64_t round) const {
    return segment.data() + result_offset + (round % 2) * kChunkBytes;
  }

  // Waits until every other rank's `which` counter reaches `target`. Spins briefly, then yields;
  // checks now and then that the awaited rank is still alive.
  void wait_all(Counter RankControl::*which, std::uint64_t target, const char* stage_name) const {
    const int here = spin > 0 ? sched_getcpu() : -1;
    if (spin > 0) control(rank).cpu.store(here, std::memory_order_relaxed);
    for (int j = 0; j < size; ++j) {
      if (j == rank) continue;
      const Counter& counter = control(j).*which;
      if (counter.load(std::memory_order_acquire) >= target) continue;
      // Spinning helps only while the awaited rank runs on another CPU; on this one (the
      // scheduler put both here) it would burn the time the other needs: yield at once.
      const long spins = control(j).cpu.load(std::memory_order_relaxed) == here ? 0 : spin;
      long polls = 0;
      auto started = std::chrono::steady_clock::time_point{};
      while (counter.load(std::memory_order_acquire) < target) {
        if (++polls <= spins) {
          _mm_pause();
          continue;
        }
        sched_yield();
        // A peer still in MPI (finishing a ring) may need this rank's progress to get here.
        if (polls % 16 == 0) drive_mpi_progress(mpi);
        if (polls % 64 == 0) poll_check();  // a peer that made another call never arrives
        if (polls % 4096 != 0) continue;
        const auto now = std::chrono::steady_clock::now();
        if (started == std::chrono::steady_clock::time_point{}) started = now;
        if (now - started > std::chrono::seconds(1) &&
            kill(pids[static_cast<std::size_t>(j)], 0) != 0 && errno == ESRCH) {
          throw CommError(error_message(kCall, rank,
                                        "rank " + std::to_string(j) + " (pid " +
                                            std::to_string(pids[static_cast<std::size_t>(j)]) +
                                            ") exited while this rank waited for it to finish '" +
                                            stage_name + "' of round " + std::to_string(target)));
        }
      }
    }
  }

  int rank, size;
  MPI_Comm mpi;             // the communicator's (progress only)
  std::string unavailable;  // why shm cannot run here; empty when it can
  bool unavailable_is_message = false;
  SharedSegment segment;
  std::size_t control_bytes = 0, small_offset = 0, stage_offset = 0, result_offset = 0;
  std::vector<pid_t> pids;
  long spin = 0;
  std::uint64_t round = 0;  // the last round this rank started
  // The stores of the all-reduce and of hierarchical's two intra-group phases, chosen apart (their
  // mixes of segment writes differ).
  ShmStores stores, scatter_stores, gather_stores;
  std::vector<std::byte> scratch;  // a streamed result's part, reduced here first
};

// The communicator's shm state; throws Unsupported (why) where shm cannot run.
ShmState& usable_state(Communicator& group) {
  ShmState& s = group.attachment<ShmState>();
  if (!s.unavailable.empty()) {
    throw Unsupported(s.unavailable_is_message ? s.unavailable
                                               : error_message(kCall, group.rank(), s.unavailable));
  }
  return s;
}

// memcpy with non-temporal stores: for outputs too large to stay in cache, it saves reading each
// destination line from memory before overwriting it, a third of the traffic of a copy.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  const std::size_t body = bytes / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, bytes - body);
}

// A copy into the segment, streamed or plain (ShmStores); the caller fences streamed copies
// before the release that publishes them.
void copy_to_segment(std::byte* dst, const std::byte* src, std::size_t bytes, bool streamed) {
  if (streamed) {
    stream_copy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

std::string microseconds_per_mib(double seconds_per_byte) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f us", seconds_per_byte * 1048576.0 * 1e6);
  return text;
}

std::string describe(const Descriptor& d) {
  return std::to_string(d.count) + " x " + std::string(to_string(static_cast<DataType>(d.dtype))) +
         " " + std::string(to_string(static_cast<ReduceOp>(d.op)));
}

// result = src[0] op src[1] op ... in rank order, over `n` elements; avg divides at the end.
void reduce_sources(std::byte* result, const std::vector<const std::byte*>& sources, std::size_t n,
                    const AllreduceArgs& args, int ranks) {
  if (n == 0) return;
  const ReduceOp op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  reduce_to(result, sources[0], sources[1], n, args.dtype, op);
  for (std::size_t j = 2; j < sources.size(); ++j)
    reduce_into(result, sources[j], n, args.dtype, op);
  if (args.op == ReduceOp::avg) divide_by(result, n, args.dtype, ranks);
}

Descriptor descriptor_of(const AllreduceArgs& args, Path path,
                         const std::optional<RegisteredLocation>& registered) {
  const watchdog::CallInfo* call = current_call();
  return Descriptor{args.count,
                    static_cast<std::uint32_t>(args.dtype),
                    static_cast<std::uint32_t>(args.op),
                    static_cast<std::uint32_t>(path),
                    registered ? 1u : 0u,
                    registered ? registered->segment : 0,
                    registered ? registered->offset : 0,
                    call ? call->sequence : 0,
                    call ? call->algorithm : -1,
                    call ? 1u : 0u};
}

// Once every rank's `copied` counter has reached `first` (the call's first round), every rank
// reads the same descriptors and decides the same way: returns where each rank's registered
// input lies here (nullptr where it is not registered), or, when the ranks disagree, leaves the
// counters where every rank expects them and throws on every rank.
std::vector<const std::byte*> agree_on_call(ShmState& s, std::uint64_t first) {
  const int n = s.size, me = s.rank;
  const watchdog::CallInfo* call = current_call();
  std::vector<Descriptor> calls(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j)
    calls[static_cast<std::size_t>(j)] = s.control(j).descriptor[first % 2];
  std::vector<const std::byte*> inputs(static_cast<std::size_t>(n), nullptr);
  std::string problem;
  bool mismatch = false;
  for (int j = 0; j < n && problem.empty(); ++j) {
    const Descriptor& d = calls[static_cast<std::size_t>(j)];
    const Descriptor& d0 = calls[0];
    if (d.count != d0.count || d.dtype != d0.dtype || d.op != d0.op || d.path != d0.path ||
        (d.in_call && d0.in_call && (d.sequence != d0.sequence || d.algorithm != d0.algorithm))) {
      mismatch = true;
      if (!d.in_call || !d0.in_call) {
        problem = "ranks disagree on the call: rank 0 has " + describe(d0) + ", rank " +
                  std::to_string(j) + " has " + describe(d);
        continue;
      }
      std::vector<watchdog::CallInfo> infos;
      for (const Descriptor& e : calls) {
        watchdog::CallInfo info = call ? *call : watchdog::CallInfo{};
        info.sequence = e.sequence;
        info.count = e.count;
        info.dtype = static_cast<int>(e.dtype);
        info.op = static_cast<int>(e.op);
        info.algorithm = e.algorithm;
        infos.push_back(info);
      }
      problem = describe_mismatch(infos);
    } else if (d.registered) {
      inputs[static_cast<std::size_t>(j)] = registered_address({d.segment, d.offset});
      if (inputs[static_cast<std::size_t>(j)] == nullptr) {
        problem = "rank " + std::to_string(j) + "'s registered buffer is not mapped here";
      }
    }
  }
  if (!problem.empty()) {
    RankControl& mine = s.control(me);
    mine.reduced.store(first, std::memory_order_release);
    mine.drained.store(first, std::memory_order_release);
    s.round = first;
    if (mismatch) {
      // The call's own comparison (GRADCOMM_CHECK) sees the difference too: complete it, so that
      // every rank leaves through the same path (it renews the communicator on every rank).
      require_check();
      throw MismatchError(error_message(kCall, me, problem));
    }
    throw InvalidArgument(error_message(kCall, me, problem));
  }
  return inputs;
}

}  // namespace

ShmStores::ShmStores(const std::string& mode)
    : fixed_(mode == "cached"     ? 0
             : mode == "streamed" ? 1
                                  : -1) {}

std::size_t ShmStores::size_class(std::size_t bytes) {
  return static_cast<std::size_t>(std::bit_width(bytes));
}

bool ShmStores::next_call_streams(std::size_t bytes) {
  if (fixed_ >= 0) return fixed_ == 1;
  const std::size_t k = size_class(bytes);
  Class& c = classes_[k];
  if (c.counts[0] == 0 && c.counts[1] == 0) {
    // A new size starts from the nearest one measured both ways: the cost per byte of either way
    // moves little from 4 MiB up (0.18 and 0.25 ms per MiB at 4, 16 and 64 MiB here), the ratio
    // between them, which the machine's state sets, not at all.
    for (std::size_t d = 1; d < classes_.size(); ++d) {
      const Class* near = nullptr;
      if (k >= d && classes_[k - d].counts[0] >= 3 && classes_[k - d].counts[1] >= 3) {
        near = &classes_[k - d];
      } else if (k + d < classes_.size() && classes_[k + d].counts[0] >= 3 &&
                 classes_[k + d].counts[1] >= 3) {
        near = &classes_[k + d];
      }
      if (near) {
        c = *near;
        c.since_probe = 0;
        break;
      }
    }
  }
  // Three calls each way first, alternating (the first pays for the segment's fresh pages).
  if (c.counts[0] < 3 || c.counts[1] < 3) return c.counts[1] < c.counts[0];
  if (++c.since_probe >= c.probe_after) {
    c.since_probe = 0;
    return !c.streaming;
  }
  return c.streaming;
}

bool ShmStores::streaming(std::size_t bytes) const {
  return fixed_ >= 0 ? fixed_ == 1 : classes_[size_class(bytes)].streaming;
}

double ShmStores::cost(std::size_t bytes, bool streamed) const {
  return classes_[size_class(bytes)].cost(streamed);
}

double ShmStores::Class::cost(bool streamed) const {
  const long count = counts[streamed ? 1 : 0];
  const std::array<double, 3>& v = samples[streamed ? 1 : 0];
  if (count == 0) return 0;
  if (count == 1) return v[0];
  if (count == 2) return (v[0] + v[1]) / 2;
  return std::max(std::min(v[0], v[1]), std::min(std::max(v[0], v[1]), v[2]));
}

bool ShmStores::record(std::size_t bytes, bool streamed, double seconds) {
  if (fixed_ >= 0 || bytes == 0) return false;
  Class& c = classes_[size_class(bytes)];
  const int way = streamed ? 1 : 0;
  c.samples[way][static_cast<std::size_t>(c.counts[way]++ % 3)] =
      seconds / static_cast<double>(bytes);
  if (c.counts[0] < 3 || c.counts[1] < 3) return false;
  if (c.cost(!c.streaming) * kMargin < c.cost(c.streaming)) {
    c.streaming = !c.streaming;
    c.since_probe = 0;
    c.probe_after = kFirstProbe;
    return true;
  }
  if (streamed != c.streaming) {
    if (seconds / static_cast<double>(bytes) * kMargin < c.cost(c.streaming)) {
      c.since_probe = c.probe_after;  // promising, but one call: the next call confirms
    } else {
      c.probe_after = std::min(2 * c.probe_after, kLastProbe);
    }
  }
  return false;
}

namespace {

// Records a large call's time with `stores` and logs a change of their choice (debug level).
void record_stores(ShmStores& stores, const char* phase, std::size_t bytes, bool streamed,
                   std::chrono::steady_clock::time_point started, Communicator& comm) {
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
  if (stores.record(bytes, streamed, took.count()) && comm.log_enabled(LogLevel::debug)) {
    comm.log(
        LogLevel::debug,
        std::string(kCall)
                .append(phase)
                .append(": rank ")
                .append(std::to_string(comm.rank()))
                .append(stores.streaming(bytes) ? " now writes the segment with non-temporal stores"
                                                : " now writes the segment with plain stores") +
            " (median per MiB of the last three calls: plain " +
            microseconds_per_mib(stores.cost(bytes, false)) + ", streamed " +
            microseconds_per_mib(stores.cost(bytes, true)) + ")");
  }
}

}  // namespace

bool shm_available(Communicator& comm) {
  return comm.size() > 1 && comm.attachment<ShmState>().unavailable.empty();
}

void forget_shm_state(Communicator& comm) {
  comm.detach<ShmState>();
}

int ranks_on_this_host(Communicator& comm) {
  return comm.attachment<HostCheck>().on_host;
}

int ranks_on_this_machine(Communicator& comm) {
  return comm.attachment<HostCheck>().on_machine;
}

bool machine_oversubscribed(Communicator& comm) {
  const int threads = std::max(1, topology::topology_of(comm).hardware.hardware_threads);
  int crowded = ranks_on_this_machine(comm) > threads ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &crowded, 1, MPI_INT, MPI_MAX, comm.mpi_comm()),
            "allreduce(shm): MPI_Allreduce", comm.rank());
  return crowded != 0;
}

bool shares_one_host(Communicator& comm) {
  return ranks_on_this_host(comm) == comm.size();
}

void AllreduceShm::run(const AllreduceArgs& args, Communicator& comm) {
  ShmState& s = usable_state(comm);
  const int n = s.size, me = s.rank;
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const Path path = bytes <= kSmallBytes ? Path::small : Path::staged;
  const std::size_t round_elements = kChunkBytes / es;
  const std::uint64_t rounds =
      path == Path::small ? 1 : (args.count + round_elements - 1) / round_elements;
  const std::optional<RegisteredLocation> registered =
      path == Path::staged ? find_registered(args.send, bytes, s.pids) : std::nullopt;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);

  const auto started = std::chrono::steady_clock::now();
  // Round `first`: gate, descriptor, first input.
  const std::uint64_t first = s.round + 1;
  s.wait_all(&RankControl::drained, first < 2 ? 0 : first - 2, "drain");
  mine.descriptor[first % 2] = descriptor_of(args, path, registered);
  // From kStreamFromBytes on, the segment's stores follow Config::shm_stores (ShmStores); below,
  // where a round's data is still in cache when peers read it, streamed stores cost 2-2.5x
  // (1 MiB on 2 ranks) and plain ones are kept.
  const bool large = bytes >= kStreamFromBytes;
  const bool streams = large && !registered && s.stores.next_call_streams(bytes);
  auto copy_in = [&](std::uint64_t k) {  // the k-th round of this call
    if (registered) return;
    const std::size_t e0 = k * round_elements;
    const std::size_t m = std::min(round_elements, args.count - e0);
    copy_to_segment(s.stage(me, first + k), send + e0 * es, m * es, streams);
    if (streams) _mm_sfence();  // before the release that publishes the slot
  };
  if (path == Path::small) {
    std::memcpy(s.small_slot(me, first), send, bytes);
  } else {
    copy_in(0);
  }
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in");
  const std::vector<const std::byte*> inputs = agree_on_call(s, first);

  std::vector<const std::byte*> sources(static_cast<std::size_t>(n));
  if (path == Path::small) {
    for (int j = 0; j < n; ++j)
      sources[static_cast<std::size_t>(j)] = s.small_slot(j, first);
    reduce_sources(recv, sources, args.count, args, n);
    mine.reduced.store(first, std::memory_order_release);
    mine.drained.store(first, std::memory_order_release);
    s.round = first;
    return;
  }

  // Staged rounds: my part of every round is [p0, p1) of the round's elements, 64-byte aligned.
  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t r = first + k;
    const std::size_t e0 = k * round_elements;
    const std::size_t m = std::min(round_elements, args.count - e0);
    if (k > 0) s.wait_all(&RankControl::copied, r, "copy-in");
    const std::size_t part = align_up((m + n - 1) / n, kLine / es);
    const std::size_t p0 = std::min(m, part * static_cast<std::size_t>(me));
    const std::size_t p1 = std::min(m, p0 + part);
    for (int j = 0; j < n; ++j) {
      const std::byte* input = inputs[static_cast<std::size_t>(j)];
      sources[static_cast<std::size_t>(j)] = (input ? input + e0 * es : s.stage(j, r)) + p0 * es;
    }
    if (streams && p1 > p0) {
      if (s.scratch.size() < kChunkBytes) s.scratch.resize(kChunkBytes);
      reduce_sources(s.scratch.data(), sources, p1 - p0, args, n);
      stream_copy(s.result(r) + p0 * es, s.scratch.data(), (p1 - p0) * es);
      _mm_sfence();
    } else {
      reduce_sources(s.result(r) + p0 * es, sources, p1 - p0, args, n);
    }
    mine.reduced.store(r, std::memory_order_release);
    if (k + 1 < rounds) {  // the next round's copy-in overlaps the peers' reductions
      s.wait_all(&RankControl::drained, r - 1, "drain");
      copy_in(k + 1);
      mine.copied.store(r + 1, std::memory_order_release);
    }
    s.wait_all(&RankControl::reduced, r, "reduce");
    if (large) {
      stream_copy(recv + e0 * es, s.result(r), m * es);
      _mm_sfence();  // non-temporal stores are not ordered by the release below
    } else {
      std::memcpy(recv + e0 * es, s.result(r), m * es);
    }
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + rounds - 1;
  if (large && !registered) record_stores(s.stores, "", bytes, streams, started, comm);
}

// Hierarchical's intra-group phases. Rounds carry one sub-piece of every column: `q` elements
// of each (a multiple of a cache line, the P sub-pieces together at most one staged round),
// at offset c * q of a rank's stage slot (reduce-scatter) or of the round's result
// (all-gather). Column c of round k is [k * q, (k + 1) * q) of the column, cut at its length.
namespace {

struct ColumnRounds {
  ColumnRounds(const ColumnLayout& layout, std::size_t es) {
    const std::size_t line = std::max<std::size_t>(1, kLine / es);
    const std::size_t per_column = kChunkBytes / es / layout.columns;
    q = std::max<std::size_t>(1, per_column >= line ? per_column / line * line : per_column);
    const std::size_t longest = layout.column(0).length;
    rounds = std::max<std::uint64_t>(1, (longest + q - 1) / q);
  }
  // Elements of column `c` (of `length`) in round k, and where they start in the column.
  std::size_t start(std::uint64_t k) const { return static_cast<std::size_t>(k) * q; }
  std::size_t length(std::size_t column_length, std::uint64_t k) const {
    return column_length > start(k) ? std::min(q, column_length - start(k)) : 0;
  }
  std::size_t q = 1;
  std::uint64_t rounds = 1;
};

}  // namespace

void share_machine_with(Communicator& sub, int ranks) {
  sub.attachment<MachineRanks>().ranks = ranks;
}

bool shm_columns_fit(std::size_t columns, std::size_t element_bytes) {
  return columns * element_bytes <= kChunkBytes;
}

void shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                  const ColumnLayout& layout, Communicator& group) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  const ColumnRounds plan(layout, es);
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  std::vector<const std::byte*> sources(static_cast<std::size_t>(s.size));
  // The owner reads its own contribution from its input, not a copy, unless the output overwrites
  // it before it is read: in place, as the third or later operand of the chain.
  const bool own_from_input = !args.in_place() || me < 2;
  // Stores into the slots as in the all-reduce (ShmStores), from 4 MiB.
  const std::size_t bytes = args.count * es;
  const auto started = std::chrono::steady_clock::now();
  const bool streams = bytes >= kStreamFromBytes && s.scatter_stores.next_call_streams(bytes);
  const std::uint64_t first = s.round + 1;
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    // My slot's half was last read by round r - 2's owners.
    s.wait_all(&RankControl::drained, r < 2 ? 0 : r - 2, "drain");
    if (k == 0) mine.descriptor[first % 2] = descriptor_of(args, Path::columns, std::nullopt);
    std::byte* slot = s.stage(me, r);
    for (std::size_t c = 0; c < layout.columns; ++c) {
      if (layout.owner(c) == me && own_from_input) continue;  // read where it lies
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      copy_to_segment(slot + c * plan.q * es, send + (col.offset + plan.start(k)) * es, m * es,
                      streams);
    }
    if (streams) _mm_sfence();  // before the release that publishes the slot
    mine.copied.store(r, std::memory_order_release);
    s.wait_all(&RankControl::copied, r, "copy-in");
    if (k == 0) agree_on_call(s, first);
    // The owner reduces its columns from every member's slot, in member order, into its output.
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      if (m == 0) continue;
      std::byte* out = recv + (col.offset + plan.start(k)) * es;
      for (int j = 0; j < s.size; ++j) {
        sources[static_cast<std::size_t>(j)] = j == me && own_from_input
                                                   ? send + (col.offset + plan.start(k)) * es
                                                   : s.stage(j, r) + c * plan.q * es;
      }
      reduce_to(out, sources[0], sources[1], m, args.dtype, op);
      for (std::size_t j = 2; j < sources.size(); ++j)
        reduce_into(out, sources[j], m, args.dtype, op);
    }
    mine.reduced.store(r, std::memory_order_release);
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
  if (bytes >= kStreamFromBytes) {
    record_stores(s.scatter_stores, " reduce-scatter", bytes, streams, started, group);
  }
}

void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  const ColumnRounds plan(layout, es);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  // Stores into the published result as in the all-reduce (ShmStores), from 4 MiB.
  const std::size_t bytes = args.count * es;
  const auto started = std::chrono::steady_clock::now();
  const bool streams = bytes >= kStreamFromBytes && s.gather_stores.next_call_streams(bytes);
  const std::uint64_t first = s.round + 1;
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    // The result half was last read by every rank in round r - 2.
    s.wait_all(&RankControl::drained, r < 2 ? 0 : r - 2, "drain");
    std::byte* result = s.result(r);
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      copy_to_segment(result + c * plan.q * es, recv + (col.offset + plan.start(k)) * es, m * es,
                      streams);
    }
    if (streams) _mm_sfence();  // before the releases that publish the result
    mine.copied.store(r, std::memory_order_release);
    mine.reduced.store(r, std::memory_order_release);
    s.wait_all(&RankControl::reduced, r, "publish");
    for (std::size_t c = 0; c < layout.columns; ++c) {
      if (layout.owner(c) == layout.member) continue;
      const auto col = layout.column(c);
      std::memcpy(recv + (col.offset + plan.start(k)) * es, result + c * plan.q * es,
                  plan.length(col.length, k) * es);
    }
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
  if (bytes >= kStreamFromBytes) {
    record_stores(s.gather_stores, " all-gather", bytes, streams, started, group);
  }
}

}  // namespace gradcomm::collectives
