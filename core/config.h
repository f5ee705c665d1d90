#pragma once

#include <cstddef>
#include <string>

namespace gradcomm {

enum class LogLevel : int { error = 0, warn = 1, info = 2, debug = 3, trace = 4 };

// How much the ranks compare their calls (GRADCOMM_CHECK).
enum class CheckMode : int { off = 0, normal = 1, full = 2 };

// Every knob of a communicator. Read from the environment once (from_environment), then passed
// explicitly. Read elsewhere, once per process: GRADCOMM_NCCL_MODULE (core/gpu_runtime) and
// GRADCOMM_TIMELINE, GRADCOMM_TIMELINE_COPIES (core/timeline); docs/design.md lists the Python
// package's.
struct Config {
  // GRADCOMM_ALGORITHM: the algorithm used when a call names none ("auto" picks per call).
  std::string algorithm = "auto";
  // GRADCOMM_LOG_LEVEL: error, warn, info, debug or trace. Logs go to stderr.
  LogLevel log_level = LogLevel::warn;
  // GRADCOMM_SEGMENT_BYTES: the unit in flight of the pipelined algorithms (ring, flat; the ring
  // cuts it to tcp_piece_bytes where a link crosses hosts). Small values are a test seam: 64
  // makes a 100-element call take the many-segment path.
  std::size_t segment_bytes = std::size_t{256} << 10;
  // GRADCOMM_TCP_PIECE_BYTES: the transfers of collectives/p2p.h's *_bytes and *_pieces helpers
  // (halving_doubling, the owner exchanges) to a rank on another host go as pieces of at most
  // this many bytes, every receive posted first, and a ring with a link between hosts sends
  // segments of at most this size; 0 sends whole messages, else 1 KiB - 1 GiB. The
  // default stays under Open MPI's 64 KiB TCP eager limit (header included), so no piece waits
  // for a clear-to-send. Must be the same on every rank (checked).
  std::size_t tcp_piece_bytes = 64000;
  // Test seam (no variable): every other rank counts as on another host for the pieces above,
  // so that one machine runs their path.
  bool tcp_pieces_on_host = false;
  // GRADCOMM_PIPELINE_DEPTH: how many segments a pipelined algorithm keeps in flight (the ring
  // with pieces between hosts posts a chunk's pieces more).
  int pipeline_depth = 4;
  // GRADCOMM_FUSION_THRESHOLD: the largest fusion bucket of grouped_allreduce, in bytes; 0
  // disables fusion (every tensor reduced on its own, in place). Tensors above it are reduced in
  // place. 2 MiB won on the ResNet-50 and MobileNetV2 workloads at 2 and 4 ranks (README): on
  // one node, copying into a fused buffer costs about as much as reducing it, so big tensors
  // are better left in place than fused (Horovod's 64 MiB and DDP's 25 MiB target networks).
  std::size_t fusion_threshold = std::size_t{2} << 20;
  // GRADCOMM_TUNING_FILE: a decision table written by `gradcomm-bench --tune` for `auto`.
  std::string tuning_file;
  // GRADCOMM_CALIBRATE: 1 measures links and reduction speed for auto's cost model on its first
  // use (a few ms); 0 uses defaults.
  bool calibrate = true;
  // GRADCOMM_AUTO_MEASURE: 1 lets auto check the cost model's pick by timing its calls: per size
  // class it measures the pick and any algorithm the model expects to be close, agrees the times
  // across ranks, and keeps the fastest, re-measuring the runner-up now and then; 0 keeps the
  // model's picks (the same algorithm for the same call in every run).
  bool auto_measure = true;
  // GRADCOMM_DETERMINISTIC: 1 makes every algorithm return exactly the bits of the serial
  // reduction in rank order ((x0 op x1) op x2 ...), reproducible for a given rank count.
  bool deterministic = false;
  // GRADCOMM_RANKS_PER_NODE: 0 discovers nodes; k > 0 emulates nodes of k consecutive ranks
  // (the last node takes the remainder: 5 ranks with k = 3 are 3 + 2).
  int ranks_per_node = 0;
  // GRADCOMM_TOPOLOGY: "" (discover) or "dgx1": servers of 8 ranks, each two quads (0-3, 4-7).
  std::string topology_preset;
  // GRADCOMM_HIERARCHICAL_INTRA: how hierarchical reduce-scatters and all-gathers inside a group:
  // "direct" (one round of messages to and from each column's owner), "ring" (g - 1 steps
  // between neighbours), "shm" (through the group's shared-memory segment; needs the group on
  // one host, else direct) or "auto" (by size and placement, the same in every group).
  std::string hierarchical_intra = "auto";
  // GRADCOMM_BIND: "none", "core" (each rank to its share of the node's cores) or "numa".
  std::string bind = "none";
  // GRADCOMM_TIMEOUT: seconds a collective may run. Past it, the stall watchdog prints one
  // report of every rank's recent calls on rank 0 and aborts the job; a GPU collective aborts its
  // NCCL communicator and fails first. 0 disables both (waits forever).
  int timeout_seconds = 300;
  // Not a variable: what set timeout_seconds, as the timeout messages name it (a front end that
  // takes its own timeout, as torch.distributed's init_process_group does, says so here).
  std::string timeout_setting = "GRADCOMM_TIMEOUT";
  // GRADCOMM_ENGINE_POLL_US: microseconds the progress engine polls for a next request (yielding
  // its core each time) before it sleeps. A submission meanwhile costs 0.2-1 us instead of a
  // wake-up (7-15 us on a VM). 0 sleeps at once: on a machine running more ranks than cores, the
  // polls compete with the ranks' own yielding waits (docs/results/overlap.md).
  int engine_poll_us = 50;
  // GRADCOMM_CHECK: "default" (normal) compares every call's fingerprint (sequence number, kind,
  // count, dtype, op, algorithm, root) across ranks while the call runs; "full" compares before
  // the call starts and, after an all-reduce, a hash of every rank's output; "off" compares
  // nothing. A mismatch throws MismatchError on every rank.
  CheckMode check = CheckMode::normal;
  // Not a variable: false for the sub-communicators gradcomm builds for itself, which have no
  // flight recorder and no watchdog of their own (their calls are part of a user's call).
  bool watchdog = true;
  // GRADCOMM_DEVICE: the CUDA device of this rank (-1: local rank modulo the devices it sees).
  int device = -1;
  // GRADCOMM_GPU_INTER_NODE: how the GPU hierarchical all-reduce crosses nodes: "nccl" (an NCCL
  // communicator of the ranks holding the same shard) or "mpi" (shards staged through pinned
  // host memory and reduced by gradcomm's host algorithms).
  std::string gpu_inter_node = "nccl";
  // GRADCOMM_NCCL_BLOCKING: 1 (the default, as torch's NCCL backend) makes NCCL communicators
  // blocking: each NCCL call returns once its work is enqueued, and a peer missing from a
  // communicator's creation or first connection holds the call until the stall watchdog ends
  // the job. 0 makes them non-blocking: creation and calls are polled, and such a peer makes the
  // call throw CommError after GRADCOMM_TIMEOUT; NCCL 2.19 and later then start a thread for
  // every call (tens of microseconds each).
  bool nccl_blocking = true;
  // libgradcomm_mpi.so only (docs/mpi-preload.md). GRADCOMM_MPI_MIN_BYTES: the smallest
  // MPI_Allreduce it runs through gradcomm (below it Open MPI's own call is as fast on one host).
  // GRADCOMM_MPI_LOG: 1 prints, per rank at MPI_Finalize, what it took and passed through, and why.
  std::size_t mpi_min_bytes = 4096;
  bool mpi_log = false;

  // Reads the variables above; a variable that is set but invalid throws InvalidArgument naming
  // the variable, its value and the valid values. Unset variables keep the defaults.
  static Config from_environment();

  // "GRADCOMM_TIMEOUT=300 s": the timeout and what set it, for messages.
  std::string timeout_text() const {
    return timeout_setting + "=" + std::to_string(timeout_seconds) + " s";
  }

  // This config for a sub-communicator gradcomm builds for itself (no watchdog of its own).
  Config for_sub_communicator() const {
    Config sub = *this;
    sub.watchdog = false;
    return sub;
  }

  // Throws InvalidArgument naming the field when a value is out of range (segment_bytes
  // 16 B - 1 GiB, tcp_piece_bytes 0 or 1 KiB - 1 GiB, pipeline_depth 1 - 64, a known log level,
  // a non-empty algorithm name).
  // Communicator checks every Config it is given.
  void validate() const;
};

std::string_view to_string(LogLevel level);
std::string_view to_string(CheckMode mode);

}  // namespace gradcomm
