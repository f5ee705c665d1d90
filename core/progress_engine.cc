#include "core/progress_engine.h"

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>

#include "core/timeline.h"

namespace gradcomm {
namespace {

thread_local bool t_progress_thread = false;
// The engine whose run_exclusive this thread is inside, if any.
thread_local const ProgressEngine* t_exclusive_of = nullptr;
// The engine whose requests this thread runs in run_here, if any.
thread_local const ProgressEngine* t_running_of = nullptr;

// Every live engine, for drain_all_engines.
std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex;  // never destroyed: used until the process ends
  return *m;
}
std::set<ProgressEngine*>& registry() {
  static auto* engines = new std::set<ProgressEngine*>;
  return *engines;
}

}  // namespace

void drain_all_engines() {
  // Engines are created and destroyed by the threads that own their communicators, not by
  // requests, so holding the lock while draining cannot block a request.
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (ProgressEngine* engine : registry())
    engine->drain();
}

namespace {
// The waiters of the request the engine runs on this thread (ForegroundWhileWaited).
thread_local const std::atomic<int>* t_waiters = nullptr;
}  // namespace

bool on_progress_thread() {
  return t_progress_thread && !(t_waiters && t_waiters->load(std::memory_order_relaxed) > 0);
}

void sleep_precisely() {
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
}

ForegroundWhileWaited::ForegroundWhileWaited(const std::atomic<int>* waiters)
    : previous_(t_waiters) {
  t_waiters = waiters;
}

ForegroundWhileWaited::~ForegroundWhileWaited() {
  t_waiters = previous_;
}

ProgressThreadScope::ProgressThreadScope() : previous_(t_progress_thread) {
  t_progress_thread = true;
}

ProgressThreadScope::~ProgressThreadScope() {
  t_progress_thread = previous_;
}

ProgressEngine::ProgressEngine(int poll_us) : poll_us_(poll_us) {
  thread_ = std::thread([this] { loop(); });
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(this);
}

ProgressEngine::~ProgressEngine() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_polling_.store(true, std::memory_order_release);  // a poll under way ends now
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void ProgressEngine::submit(std::shared_ptr<detail::RequestState> state) {
  if (timeline::enabled()) {
    static std::atomic<std::uint64_t> next_id{1};
    state->id = next_id.fetch_add(1, std::memory_order_relaxed);
    state->submitted_us = timeline::now_us();
    timeline::instant("submit", "request",
                      "\"call\":\"" + state->call + "\",\"request\":" + std::to_string(state->id));
  }
  state->runner = this;
  pending_.fetch_add(1, std::memory_order_acq_rel);
  submitted_.fetch_add(1, std::memory_order_relaxed);
  bool idle = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(state));
    idle = idle_;
  }
  // A busy engine takes the next request without being woken: no system call then.
  if (idle) wake_.notify_one();
}

bool ProgressEngine::in_request() const {
  return on_engine_thread() || t_running_of == this;
}

bool ProgressEngine::run_here(const detail::RequestState* target) {
  if (in_request() || t_exclusive_of == this) return false;  // (nothing queued may run inside)
  for (;;) {
    std::shared_ptr<detail::RequestState> state;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (running_ || std::none_of(queue_.begin(), queue_.end(),
                                   [&](const auto& queued) { return queued.get() == target; })) {
        return false;
      }
      state = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    const bool last = state.get() == target;
    // Restores what was there: a request of another engine may be waiting in here.
    struct Inside {
      explicit Inside(const ProgressEngine* e) : previous(t_running_of) { t_running_of = e; }
      ~Inside() { t_running_of = previous; }
      const ProgressEngine* previous;
    } inside(this);
    execute(std::move(state));
    if (last) return true;
  }
}

void ProgressEngine::run_exclusive(const std::function<void()>& fn) {
  if (in_request() || t_exclusive_of == this) {
    fn();
    return;
  }
  drain();
  // A request submitted by another thread since drain() may run first; none starts after this.
  std::lock_guard<std::mutex> hold(exclusive_);
  struct Inside {
    explicit Inside(const ProgressEngine* e) : previous(t_exclusive_of) { t_exclusive_of = e; }
    ~Inside() { t_exclusive_of = previous; }
    const ProgressEngine* previous;
  } inside(this);
  fn();
}

void ProgressEngine::drain() {
  if (in_request() || t_exclusive_of == this) return;
  for (std::size_t n = pending_.load(std::memory_order_acquire); n > 0;
       n = pending_.load(std::memory_order_acquire)) {
    pending_.wait(n, std::memory_order_acquire);
  }
}

void ProgressEngine::loop() {
  t_progress_thread = true;
  pthread_setname_np(pthread_self(), "gradcomm-prog");
  sleep_precisely();
  for (;;) {
    std::shared_ptr<detail::RequestState> state;
    // Poll before sleeping (poll_us_). sched_yield gives the core to any runnable thread on this
    // CPU at once, so the poll mostly takes time nothing else wants. A submission during it finds
    // idle_ false and skips the wake; the queue is checked again under the lock below, so none is
    // missed either way. Shutdown ends a poll at once (stop_polling_).
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(poll_us_);
    while (pending_.load(std::memory_order_acquire) == 0 &&
           !stop_polling_.load(std::memory_order_acquire) &&
           std::chrono::steady_clock::now() < until) {
      sched_yield();
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      idle_ = true;
      // Not while a thread runs requests in run_here: the next one waits for it to finish.
      wake_.wait(lock, [this] { return !running_ && (stopping_ || !queue_.empty()); });
      idle_ = false;
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      state = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    execute(std::move(state));
  }
}

void ProgressEngine::execute(std::shared_ptr<detail::RequestState> state) {
  if (timeline::enabled()) {
    thread_local bool named = false;
    if (!named && on_engine_thread()) {
      timeline::name_thread("progress engine");
      named = true;
    }
    timeline::async_span(
        "queued", "request", state->id, state->submitted_us, timeline::now_us(),
        "\"call\":\"" + state->call + "\",\"request\":" + std::to_string(state->id));
  }
  try {
    std::lock_guard<std::mutex> hold(exclusive_);
    state->work();
  } catch (...) {
    state->error = std::current_exception();
  }
  state->work = nullptr;  // what it captured goes now, not when the request is freed
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    // Run in run_here: the engine's thread may be asleep with requests queued behind this one
    // (or a stop waiting for it).
    wake = !on_engine_thread() && idle_ && (stopping_ || !queue_.empty());
  }
  if (wake) wake_.notify_one();
  // The communicator is free before the request says it is done: a blocking call made right
  // after wait() then finds nothing in flight (settle()'s one load), instead of draining.
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_all();
  state->done.store(true, std::memory_order_release);
  state->done.notify_all();
}

BackgroundPause BackgroundPause::resuming_at(long sleep_ns, long max_pause_us) {
  BackgroundPause pause(max_pause_us);
  pause.polls_ = kYields;
  pause.sleep_ns_ = std::clamp(sleep_ns, kFirstSleepNanoseconds, pause.max_sleep_ns_);
  return pause;
}

void BackgroundPause::pause() {
  if (++polls_ <= kYields) {
    sched_yield();
    return;
  }
  timespec ts{0, sleep_ns_};
  nanosleep(&ts, nullptr);
  last_sleep_ns_ = sleep_ns_;
  sleep_ns_ = std::min(sleep_ns_ + sleep_ns_ / 2, max_sleep_ns_);
}

namespace {

// How this thread's last wait_all_mpi ended (wait_all_mpi carries its pace to the next one).
// Across hosts a ring moves 64 KB pieces, half a millisecond each at 1 Gbit/s: polling up from
// 2 us on every piece took about 20 MPI_Testall calls and sleeps each, a third of a core beside
// a DDP step's backward pass (docs/results/torch.md, "Two threads that polled too often").
thread_local long t_mpi_wait_sleep_ns = 0;
thread_local std::chrono::steady_clock::time_point t_mpi_wait_end;
constexpr auto kMpiWaitCarry = std::chrono::milliseconds(1);

}  // namespace

int wait_all_mpi(int count, MPI_Request* requests, const std::function<void()>& between,
                 long max_pause_us) {
  if (!on_progress_thread()) return MPI_Waitall(count, requests, MPI_STATUSES_IGNORE);
  const auto start = std::chrono::steady_clock::now();
  const bool carry = t_mpi_wait_sleep_ns > 0 && start - t_mpi_wait_end < kMpiWaitCarry;
  BackgroundPause pause = carry
                              ? BackgroundPause::resuming_at(t_mpi_wait_sleep_ns / 2, max_pause_us)
                              : BackgroundPause(max_pause_us);
  for (;;) {
    int done = 0;
    const int rc = MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS || done) {
      // The sleep this wait ended at; one that needed none halves the carried pace.
      t_mpi_wait_sleep_ns =
          pause.last_sleep_ns() > 0 ? pause.last_sleep_ns() : (carry ? t_mpi_wait_sleep_ns / 2 : 0);
      if (t_mpi_wait_sleep_ns < BackgroundPause::kFirstSleepNanoseconds) t_mpi_wait_sleep_ns = 0;
      t_mpi_wait_end = std::chrono::steady_clock::now();
      return rc;
    }
    if (between) between();
    pause.pause();
  }
}

}  // namespace gradcomm
