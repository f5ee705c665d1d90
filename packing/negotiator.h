#pragma once

// Negotiation by name, as Horovod does it (docs/design.md, "Negotiation"). Each rank submits
// named operations in whatever order its program makes them; a background thread runs cycles in
// which every rank tells every other what it has submitted since the last cycle. An operation
// runs once every rank has submitted its name, in the same order on every rank, all-reduces of
// one dtype and op that became ready together fused into one grouped all-reduce. It runs on a
// communicator of its own, so it never meets the parent communicator's in-order calls.
//
// What the cycles also give:
// - ranks that submit one name with different signatures (kind, dtype, shape, root) get an error
//   for that operation on every rank;
// - when every rank is blocked waiting on operations that cannot run (a name only some ranks
//   submit), every pending operation fails on every rank with a report of who submitted what;
// - a rank that waits past GRADCOMM_TIMEOUT for a name another rank never submits is reported by
//   the stall watchdog, which names that rank;
// - join: a rank that has joined stands in for the all-reduces (with the op's neutral value),
//   allgathers (with no rows), broadcasts and barriers of the others until every rank has joined.

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm {

enum class NegotiatedKind : std::uint8_t {
  allreduce = 1,  // `data` in place: `count` elements of `dtype`, reduced with `op`
  broadcast = 2,  // `data` in place: `count` bytes from `root`
  allgather = 3,  // this rank's `count` bytes at `data`; the result holds every rank's
  alltoall = 4,   // this rank sends splits[j] bytes to rank j, consecutive at `data`
  barrier = 5,
  join = 6,  // this rank has no more data: it stands in for the others' operations
  // `data`: this rank's `count` elements of `dtype` (read, never written), reduced with `op`
  // across the ranks (scaled as an allreduce's); the result holds this rank's share, the
  // splits[rank] elements after the shares of the ranks before it (Horovod's reducescatter)
  reducescatter = 7,
  // this rank's call of this name failed before it could be submitted (`signature`: why): the
  // other ranks' calls of the name fail at once, naming it, where they would wait for it
  failed = 8,
};

struct NegotiatedCall {
  std::string name;
  NegotiatedKind kind = NegotiatedKind::allreduce;
  // What every rank must agree on under this name, in words ("allreduce float32 [3, 4] sum"):
  // ranks whose signatures differ get an error naming both.
  std::string signature;
  void* data = nullptr;
  std::size_t count = 0;
  DataType dtype = DataType::float32;
  ReduceOp op = ReduceOp::sum;
  int root = -1;
  // allreduce: this rank's tensor is multiplied by `prescale` before the reduction and by
  // `postscale` after it, on the negotiation thread, with Horovod's arithmetic (float32 and
  // float16 in float32 with the factor rounded to float, float64 in double, integers in double
  // truncated toward zero; bfloat16 as float16).
  double prescale = 1.0, postscale = 1.0;
  std::string algorithm;             // allreduce: empty for Config::algorithm
  std::size_t fusion_threshold = 0;  // allreduce: bucket bytes, 0 for Config::fusion_threshold
  // allreduce: `data` is in GPU memory. Such calls are reduced through gradcomm's GPU path
  // (NCCL) on a stream of the negotiator's, after `ready_event` (a cudaEvent_t the caller recorded
  // after the work that writes `data`, or null) has completed; the state is done once the result
  // is in `data`. Their scale factors must be 1 (the caller scales on its stream). Ranks must agree
  // on it under one name, and it is part of the fusion key.
  bool device = false;
  void* ready_event = nullptr;
  // device: the CUDA device `data` is on; join: where this rank stands in for GPU all-reduces
  // (Horovod's join(device); -1: the device of its last GPU all-reduce)
  int gpu = -1;
  // broadcast: the receivers do not know the size; the root's `count` decides, and the bytes
  // land in the result (the root's stay at `data`).
  bool sized_by_root = false;
  std::vector<std::uint64_t> splits;  // alltoall (bytes); reducescatter (each rank's elements)
};

// One submitted operation: filled in by the negotiation thread, then `done` is set.
struct NegotiatedState {
  NegotiatedCall call;
  std::exception_ptr error;
  std::vector<std::byte> result;      // allgather, alltoall, broadcast sized by the root
  std::vector<std::uint64_t> counts;  // bytes that came from each rank into `result`
  int last_joined = -1;               // join: the last rank to join
  std::atomic<bool> done{false};
  // Application threads blocked in wait() on it, counted in the negotiator's blocked_ until
  // finish() takes them out (-1 from then on).
  std::atomic<int> blocked{0};
  // Steady seconds of the last test() that found it pending: a thread that polls it (Horovod's
  // poll() in a loop) waits for it as much as one inside wait().
  std::atomic<double> polled_at{0};
};

class Negotiator {
 public:
  // Collective over `parent` (every rank, in the same order as the parent's other calls):
  // duplicates its MPI communicator for the cycles and for the operations, and starts the thread.
  explicit Negotiator(Communicator& parent);
  // close(), then joins the thread.
  ~Negotiator();
  Negotiator(const Negotiator&) = delete;
  Negotiator& operator=(const Negotiator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Queues `call` for the next cycle. Throws InvalidArgument when its name is already in flight
  // on this rank, for a broadcast root or alltoall splits that do not fit the ranks, or when the
  // negotiator is closed; the buffers must stay valid and untouched
  // until the state is done.
  std::shared_ptr<NegotiatedState> submit(NegotiatedCall call);
  // Blocks (without spinning) until the operation is done; rethrows its error.
  void wait(NegotiatedState& state);
  // True once done; rethrows its error then. Never blocks. A thread that keeps testing a pending
  // state counts as waiting for it in the watchdog's record while it does.
  static bool test(NegotiatedState& state);

  // Collective: stops taking operations, and returns once every rank has closed. Operations still
  // pending then fail. Safe to call more than once.
  void close();

 private:
  struct Offer;  // one rank's submission of a name, as the cycle carries it
  struct Entry;  // one name, as every rank sees it
  static const Offer& first_offer(const Entry& entry);
  void loop() noexcept;
  bool cycle();  // false once every rank has closed
  // Waits for an idle cycle's header with sleeps growing to the idle interval, until it completes
  // or a submission (or close()) wakes this thread.
  void wait_idle(MPI_Request& request);
  void run_ready(std::vector<Entry*>& ready);
  void run_one(Entry& entry, NegotiatedState* mine);
  void run_allreduces(const std::vector<Entry*>& group);
  void run_device_allreduces(const std::vector<Entry*>& group);
  void fail_everything(const std::string& why);
  void finish(NegotiatedState& state, std::exception_ptr error);
  void note_wait(bool waiting_on_pending);
  std::string who_submitted(const Entry& entry) const;
  std::vector<bool> joined_ranks() const;  // ranks whose join is pending

  const int rank_, size_;
  std::unique_ptr<Communicator> data_;  // the operations run here
  MPI_Comm control_ = MPI_COMM_NULL;    // the cycles run here

  std::mutex mutex_;                                     // guards the fields up to `waiters_`
  std::condition_variable wake_;                         // a submission, or close()
  std::deque<std::shared_ptr<NegotiatedState>> outbox_;  // submitted, not yet offered
  std::map<std::string, std::shared_ptr<NegotiatedState>> in_flight_;  // by name
  bool closing_ = false;
  double last_progress_ = 0;     // steady seconds of the last submission or completion
  std::atomic<int> waiters_{0};  // application threads inside wait()
  bool polling_ = false;         // the cycle's thread: a pending operation was tested lately
  // Those of them whose operation has not finished yet (finish() takes a state's out before it
  // wakes them): while above zero, no computation of this process wants the cores, and the
  // negotiation thread waits as an application thread would (ForegroundWhileWaited).
  std::atomic<int> blocked_{0};

  // The negotiation thread's own state.
  std::map<std::string, std::unique_ptr<Entry>> table_;  // the same on every rank
  std::uint64_t offers_seen_ = 0;                        // orders the table's entries
  std::uint64_t cycles_ = 0;
  int quiet_cycles_ = 0;            // consecutive cycles in which nothing happened
  bool recording_ = false;          // a wait is on the watchdog's recorder
  std::vector<std::byte> scratch_;  // joined ranks' stand-in buffers
  std::vector<std::byte> whole_;    // a reducescatter of uneven shares: the whole reduction
  struct DeviceBuffers;             // the GPU all-reduces' stream and buffers
  std::unique_ptr<DeviceBuffers> device_;
  std::atomic<int> last_gpu_{-1};    // the device of this rank's last GPU all-reduce submitted
  std::vector<std::byte> out_, in_;  // a cycle's offers: this rank's, every rank's
  std::vector<std::uint64_t> headers_;
  std::vector<int> sizes_, displs_;
  std::thread thread_;
};

}  // namespace gradcomm
