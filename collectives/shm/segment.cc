#include "collectives/shm/segment.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>

#include "collectives/check/consistency.h"
#include "core/cpu_relax.h"
#include "core/error.h"
#include "core/progress_engine.h"
#include "topology/host.h"

namespace gradcomm::collectives {
namespace {

// How many ranks run on this machine as far as the spin-or-yield choice goes: set by an
// algorithm that runs shm on a sub-communicator of a larger one (0: the sub-communicator's own).
class MachineRanks : public Attachment {
 public:
  explicit MachineRanks(Communicator&) {}
  int ranks = 0;
};

std::string describe_descriptor(const ShmDescriptor& d) {
  if (d.path == static_cast<std::uint32_t>(ShmPath::gather))
    return std::to_string(d.count) + " bytes (an all-gather)";
  return std::to_string(d.count) + " x " + std::string(to_string(static_cast<DataType>(d.dtype))) +
         " " + std::string(to_string(static_cast<ReduceOp>(d.op))) +
         (d.path == static_cast<std::uint32_t>(ShmPath::scatter) ? " (a reduce-scatter)" : "");
}

}  // namespace

std::size_t shm_small_own_cpu_bytes_here() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0) {
    char vendor[12];
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    if (std::memcmp(vendor, "GenuineIntel", 12) == 0) return kShmSmallOwnCpuIntelBytes;
  }
#endif
  return kShmSmallOwnCpuBytes;
}

ShmState::ShmState(Communicator& comm)
    : rank(comm.rank()), size(comm.size()), mpi(comm.mpi_comm()) {
  const int on_host = topology::ranks_on_this_host(comm);
  if (on_host != size) {
    unavailable = "only " + std::to_string(on_host) + " of the " + std::to_string(size) +
                  " ranks share this host; shm works inside one node (use hierarchical, which "
                  "runs shm inside each node)";
    return;
  }
  const auto n = static_cast<std::size_t>(size);
  sources.resize(n);
  targets.resize(n);
  descriptors.resize(n);
  control_bytes = align_up(n * sizeof(RankControl), 4096);
  small_offset = control_bytes;
  stage_offset = small_offset + n * 2 * kShmSmallBytes;
  try {
    segment = SharedSegment(comm.mpi_comm(), stage_offset + n * kShmStageSlots * kShmRoundBytes,
                            kShmCall);
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
  // elsewhere: hierarchical's groups): yield at once instead of spinning. The CPUs are those any
  // rank may run on: ranks bound to a core each (mpirun --bind-to core) see one in their own
  // affinity, but together have as many as there are ranks.
  // The same all-reduce agrees the latency path's limit and the staged round: the last word has a
  // rank's bit set where its CPU is not Intel's.
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<unsigned long> cpus(sizeof set / sizeof(unsigned long) + 1, 0);
  if (sched_getaffinity(0, sizeof set, &set) == 0) std::memcpy(cpus.data(), &set, sizeof set);
  cpus.back() = shm_small_own_cpu_bytes_here() == kShmSmallOwnCpuBytes ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, cpus.data(), static_cast<int>(cpus.size()),
                          MPI_UNSIGNED_LONG, MPI_BOR, comm.mpi_comm()),
            "allreduce(shm): MPI_Allreduce of the ranks' CPU sets", rank);
  std::memcpy(&set, cpus.data(), sizeof set);
  small_own_cpu = cpus.back() != 0 ? kShmSmallOwnCpuBytes : kShmSmallOwnCpuIntelBytes;
  const int cpus_of_ranks = std::max(topology::usable_cores(), CPU_COUNT(&set));
  const int busy = std::max(size, comm.attachment<MachineRanks>().ranks);
  // The same on every rank (from values every rank gathered alike): the all-reduce's round size
  // depends on it, and ranks with different round sizes would not meet.
  spin = busy <= cpus_of_ranks ? 2000 : 0;
}

void ShmState::wait_all(ShmCounter RankControl::*which, std::uint64_t target,
                        const char* stage_name, const CallContext& call) const {
  for (int j = 0; j < size; ++j) {
    if (j != rank) wait_for(j, control(j).*which, target, stage_name, call);
  }
}

void ShmState::wait_for(int j, const ShmCounter& counter, std::uint64_t target,
                        const char* stage_name, const CallContext& call) const {
  if (counter.load(std::memory_order_acquire) >= target) return;
  // Spinning helps only while the awaited rank runs on another CPU; on this one (the scheduler
  // put both here) it would burn the time the other needs: yield at once. The CPU is published
  // only when it changed (peers read that line while they wait).
  long spins = 0;
  const bool background = on_progress_thread();  // the application computes meanwhile
  BackgroundPause pause;
  if (spin > 0 && !background) {
    const int here = sched_getcpu();
    std::atomic<int>& mine = control(rank).cpu;
    if (mine.load(std::memory_order_relaxed) != here) mine.store(here, std::memory_order_relaxed);
    spins = control(j).cpu.load(std::memory_order_relaxed) == here ? 0 : spin;
  }
  long polls = 0;
  auto started = std::chrono::steady_clock::time_point{};
  while (counter.load(std::memory_order_acquire) < target) {
    if (++polls <= spins) {
      cpu_relax();
      continue;
    }
    if (background) {
      pause.pause();
    } else {
      sched_yield();
    }
    // A peer still in MPI (finishing a ring) may need this rank's progress to get here.
    // (Every poll on a progress thread: its polls are sleeps apart.)
    if (background || polls % 16 == 0) drive_mpi_progress(mpi);
    if (polls % 64 == 0) call.poll_check();  // a peer that made another call never arrives
    if (polls % 4096 != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    if (started == std::chrono::steady_clock::time_point{}) started = now;
    if (now - started > std::chrono::seconds(1) &&
        kill(pids[static_cast<std::size_t>(j)], 0) != 0 && errno == ESRCH) {
      throw CommError(error_message(kShmCall, rank,
                                    "rank " + std::to_string(j) + " (pid " +
                                        std::to_string(pids[static_cast<std::size_t>(j)]) +
                                        ") exited while this rank waited for it to finish '" +
                                        stage_name + "' of round " + std::to_string(target)));
    }
  }
}

ShmState& usable_state(Communicator& group) {
  ShmState& s = group.attachment<ShmState>();
  if (!s.unavailable.empty()) {
    throw Unsupported(s.unavailable_is_message
                          ? s.unavailable
                          : error_message(kShmCall, group.rank(), s.unavailable));
  }
  return s;
}

SmallPacket& fill_packet(ShmState& s, std::uint64_t first, const AllreduceArgs& args,
                         ShmPath path) {
  SmallPacket& packet = s.control(s.rank).packet[first % 2];
  const CallInfo* info = args.call.info();
  packet.count = static_cast<std::uint32_t>(args.count);
  packet.sequence = info ? static_cast<std::uint32_t>(info->sequence) : 0;
  packet.fingerprint = args.call.fingerprint();
  packet.dtype = static_cast<std::uint8_t>(args.dtype);
  packet.op = static_cast<std::uint8_t>(args.op);
  packet.path = static_cast<std::uint8_t>(path);
  packet.in_call = info ? 1u : 0u;
  packet.algorithm = static_cast<std::int16_t>(info ? info->algorithm : -1);
  return packet;
}

ShmDescriptor descriptor_of(const AllreduceArgs& args, ShmPath path,
                            const std::optional<RegisteredLocation>& input,
                            const std::optional<RegisteredLocation>& output) {
  const CallInfo* call = args.call.info();
  return ShmDescriptor{args.count,
                       static_cast<std::uint32_t>(args.dtype),
                       static_cast<std::uint32_t>(args.op),
                       static_cast<std::uint32_t>(path),
                       (input ? kShmInputRegistered : 0u) | (output ? kShmOutputRegistered : 0u),
                       input ? input->segment : 0,
                       input ? input->offset : 0,
                       output ? output->segment : 0,
                       output ? output->offset : 0,
                       call ? call->sequence : 0,
                       call ? call->algorithm : -1,
                       call ? 1u : 0u};
}

ShmPeers agree_on_call(ShmState& s, std::uint64_t first, const CallContext& context) {
  ShmPeers peers;
  agree_on_call(s, first, context, peers);
  return peers;
}

const ShmPeers& agree_on_call(ShmState& s, std::uint64_t first, const CallContext& context,
                              ShmPeers& peers) {
  const int n = s.size, me = s.rank;
  const CallInfo* call = context.info();
  std::vector<ShmDescriptor>& calls = s.descriptors;
  calls.resize(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j)
    calls[static_cast<std::size_t>(j)] = s.control(j).descriptor[first % 2];
  peers.inputs.assign(static_cast<std::size_t>(n), nullptr);
  peers.outputs.assign(static_cast<std::size_t>(n), nullptr);
  std::string problem;
  bool mismatch = false;
  for (int j = 0; j < n && problem.empty(); ++j) {
    const ShmDescriptor& d = calls[static_cast<std::size_t>(j)];
    const ShmDescriptor& d0 = calls[0];
    if (d.count != d0.count || d.dtype != d0.dtype || d.op != d0.op || d.path != d0.path ||
        (d.in_call && d0.in_call && (d.sequence != d0.sequence || d.algorithm != d0.algorithm))) {
      mismatch = true;
      if (!d.in_call || !d0.in_call) {
        problem = "ranks disagree on the call: rank 0 has " + describe_descriptor(d0) + ", rank " +
                  std::to_string(j) + " has " + describe_descriptor(d);
        continue;
      }
      std::vector<CallInfo> infos;
      for (const ShmDescriptor& e : calls) {
        CallInfo info = call ? *call : CallInfo{};
        info.sequence = e.sequence;
        info.count = e.count;
        info.dtype = static_cast<int>(e.dtype);
        info.op = static_cast<int>(e.op);
        info.algorithm = e.algorithm;
        infos.push_back(info);
      }
      problem = describe_mismatch(infos);
    } else {
      const auto jj = static_cast<std::size_t>(j);
      if (d.registered & kShmInputRegistered) {
        peers.inputs[jj] = registered_address({d.segment, d.offset});
        if (peers.inputs[jj] == nullptr)
          problem = "rank " + std::to_string(j) + "'s registered input";
      }
      if (d.registered & kShmOutputRegistered) {
        peers.outputs[jj] = registered_address({d.out_segment, d.out_offset});
        if (peers.outputs[jj] == nullptr)
          problem = "rank " + std::to_string(j) + "'s registered output";
      }
      if (!problem.empty()) problem += " is not mapped here";
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
      context.require_check();
      throw MismatchError(error_message(kShmCall, me, problem));
    }
    throw InvalidArgument(error_message(kShmCall, me, problem));
  }
  return peers;
}

bool shm_available(Communicator& comm) {
  return comm.size() > 1 && comm.attachment<ShmState>().unavailable.empty();
}

void share_machine_with(Communicator& sub, int ranks) {
  sub.attachment<MachineRanks>().ranks = ranks;
}

}  // namespace gradcomm::collectives
