#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include "core/request.h"

namespace gradcomm {

// The thread that runs a communicator's non-blocking calls, one at a time, in submission order
// (docs/design.md, "Threads"). One per communicator, started by its first non-blocking call: a
// per-process thread would run calls of different communicators in one global order, and two
// ranks that submit on two communicators in different orders would then wait for each other
// forever. Idle, it first polls for a while (poll_us), then sleeps on a condition variable.
class ProgressEngine final : public detail::RequestRunner {
 public:
  // `poll_us`: how long the engine polls for a next request (yielding the core to any runnable
  // thread each time) before it sleeps (Config::engine_poll_us). A request submitted meanwhile
  // is taken without a wake-up, which costs the submitter a futex wake and, in a VM, an
  // interprocessor interrupt (7-15 us here, against 0.2-1 us).
  explicit ProgressEngine(int poll_us = 0);
  // Runs what was submitted to the end, then stops the thread.
  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  // Queues `state->work`; the engine runs it after everything submitted before.
  void submit(std::shared_ptr<detail::RequestState> state);
  // True while something submitted has not finished (one atomic load).
  bool busy() const { return pending_.load(std::memory_order_acquire) > 0; }
  // How many requests were ever submitted.
  std::uint64_t submitted() const { return submitted_.load(std::memory_order_relaxed); }
  // Blocks until nothing submitted is queued or running. On the engine's own thread (a request
  // whose work makes a nested call) it returns at once.
  void drain();
  bool on_engine_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Runs `fn` on the calling thread after everything submitted before it has run, with no
  // request starting until it returns: a blocking call of a communicator that other threads
  // may submit to meanwhile (the torch.distributed backend, whose calls come from autograd's
  // threads as well as the application's). drain() on this thread returns at once inside it.
  // On the engine's own thread `fn` runs at once. `fn` must not wait for a submitted request.
  void run_exclusive(const std::function<void()>& fn);
  // Runs `target` on the calling thread if it is still queued and the engine is running
  // nothing: with it, the requests queued before it, in order. The thread about to wait for a
  // request it just submitted then takes it itself, instead of waking the engine's thread and
  // waiting for the hand-over (a futex wake, and the time until that thread gets a core: 5-35 us
  // on 2 cores). Returns whether it ran `target`; false (nothing run) when the engine has it, or
  // already ran it. The requests run as they would on the engine (their future's callbacks
  // included), and calls they make on this engine run inside them (in_request()).
  bool run_here(const detail::RequestState* target) override;
  // True on the engine's thread, and on a thread inside run_here: a call made there runs at once,
  // as queued it would wait behind the request that made it.
  bool in_request() const;

 private:
  void loop();
  // Runs a request taken from the queue (running_ set), then clears running_ and marks it done.
  void execute(std::shared_ptr<detail::RequestState> state);

  std::mutex exclusive_;  // held by the engine while a request runs, and by run_exclusive
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<detail::RequestState>> queue_;
  bool stopping_ = false;
  bool idle_ = false;  // the thread sleeps on wake_ (guarded by mutex_); not while it polls
  // A request has left the queue and not finished, on the engine or in run_here (guarded by
  // mutex_): nothing else leaves the queue meanwhile, so requests run one at a time, in order.
  bool running_ = false;
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::uint64_t> submitted_{0};
  const int poll_us_;
  std::atomic<bool> stop_polling_{false};  // set by the destructor
  std::thread thread_;
};

// True on a progress engine's thread. Waits there give the cores to the application, which
// computes while its requests run: they poll with growing sleeps instead of spinning, and the
// library's blocking MPI calls on its data paths become non-blocking calls polled that way. On
// the caller's thread waits are unchanged.
bool on_progress_thread();

// The calling thread's short sleeps (BackgroundPause, timed condition waits) last what they ask
// for: 1 us of timer slack instead of Linux's default 50, which made a 2 us sleep last 52 (for
// the progress engine's and the negotiation thread's waits; docs/results/torch.md, "The
// negotiation's latency").
void sleep_precisely();

// For the life of this object, the engine's waits on this thread count as the caller's (spin,
// then yield) whenever *waiters is above zero: the application thread that submitted the running
// request is blocked waiting for it, so no computation wants the cores the waits would give
// back. The torch.distributed backend counts the threads in a Work's wait() this way.
class ForegroundWhileWaited {
 public:
  explicit ForegroundWhileWaited(const std::atomic<int>* waiters);
  ~ForegroundWhileWaited();
  ForegroundWhileWaited(const ForegroundWhileWaited&) = delete;
  ForegroundWhileWaited& operator=(const ForegroundWhileWaited&) = delete;

 private:
  const std::atomic<int>* previous_;
};

// Marks the calling thread as a progress thread for the life of the object (on_progress_thread()
// is then true there): for a background thread of gradcomm's that is not a ProgressEngine's, the
// negotiation thread (packing/negotiator.h).
class ProgressThreadScope {
 public:
  ProgressThreadScope();
  ~ProgressThreadScope();
  ProgressThreadScope(const ProgressThreadScope&) = delete;
  ProgressThreadScope& operator=(const ProgressThreadScope&) = delete;

 private:
  bool previous_;
};

// Waits until every progress engine of the process has run what was submitted to it: what
// gradcomm::finalize and the start of MPI_Finalize do, so no request calls MPI after it.
void drain_all_engines();

// The sleeps of one wait loop on a progress thread: a few yields, then sleeps that start at a
// few microseconds and grow to kMaxPauseMicroseconds (Open MPI moves TCP transfers only inside
// MPI calls, so the cap bounds how long a socket can sit idle).
class BackgroundPause {
 public:
  static constexpr long kMaxPauseMicroseconds = 200;
  static constexpr long kFirstSleepNanoseconds = 2000;
  static constexpr long kYields = 8;  // polls that yield before the first sleep
  explicit BackgroundPause(long max_pause_us = kMaxPauseMicroseconds)
      : max_sleep_ns_(std::max(max_pause_us * 1000, kFirstSleepNanoseconds)) {}
  // Resumes where an earlier wait left off: no yields, the first sleep `sleep_ns` (at least
  // kFirstSleepNanoseconds, at most the cap).
  static BackgroundPause resuming_at(long sleep_ns, long max_pause_us = kMaxPauseMicroseconds);
  void pause();
  // The last sleep taken, 0 while there was none (only yields, or no pause at all).
  long last_sleep_ns() const { return last_sleep_ns_; }

 private:
  long max_sleep_ns_;
  long polls_ = 0;
  long sleep_ns_ = kFirstSleepNanoseconds;
  long last_sleep_ns_ = 0;
};

// MPI_Waitall, except on a progress thread: MPI_Testall with BackgroundPause between polls
// (sleeps up to `max_pause_us`), and `between` (if given) after every poll that found the
// requests unfinished (what else the wait must watch; it may throw). There, a wait that follows
// the thread's previous one within a millisecond (the pieces of one transfer, each paced by the
// network) starts at half the sleep that one ended at, rather than polling up from microseconds
// again. Returns the MPI error code.
int wait_all_mpi(int count, MPI_Request* requests, const std::function<void()>& between = {},
                 long max_pause_us = BackgroundPause::kMaxPauseMicroseconds);

}  // namespace gradcomm
