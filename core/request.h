#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>

namespace gradcomm {

namespace detail {

struct RequestState;

// What runs requests (the progress engine): run_here runs `state` on the calling thread where it
// is still queued behind nothing running, and says whether it did (ProgressEngine::run_here).
class RequestRunner {
 public:
  virtual bool run_here(const RequestState* state) = 0;

 protected:
  ~RequestRunner() = default;
};

// One non-blocking call: the work a progress engine runs, then its outcome. The engine stores the
// error (if any) before it sets `done`; `done` is waited on with C++20 atomic waits (a futex: no
// core is burnt while the caller waits).
struct RequestState {
  std::function<void()> work;  // released by the engine once run
  std::string call;            // "iallreduce(ring)": names the call in logs and the timeline
  double submitted_us = 0;     // on the timeline's clock, when it is enabled
  std::uint64_t id = 0;        // names its events on the timeline
  std::exception_ptr error;
  std::atomic<bool> done{false};
  // The engine it was submitted to (set by ProgressEngine::submit): a waiter may run it itself
  // while it is still queued (RequestRunner::run_here).
  RequestRunner* runner = nullptr;
};

}  // namespace detail

// The handle of a non-blocking collective (iallreduce, igrouped_allreduce, ibroadcast). Move-
// only. The call runs on its communicator's progress engine in submission order whether or not
// the request is ever tested; the buffers it was given must stay valid and untouched until it
// has finished.
//
// Errors come out the way the blocking calls throw them: input that is wrong on this rank is
// rejected when the call is submitted; what can only be known while it runs (ranks that
// disagree, a failed MPI call) is rethrown by wait() or test(). A request that finished is empty
// afterwards (like MPI_REQUEST_NULL): waiting on it again returns at once.
class Request {
 public:
  Request() = default;  // empty: already finished
  explicit Request(std::shared_ptr<detail::RequestState> state) : state_(std::move(state)) {}
  Request(Request&&) noexcept = default;
  // Assigning over an unfinished request first waits for it (as its destructor would).
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  // Waits for an unfinished request: the call's buffers are in use until it ends, so neither
  // leaking it nor returning early is safe. An error it ended with is written to stderr, since a
  // destructor cannot throw it.
  ~Request();

  // False once the request has finished and been waited for (or was never submitted).
  bool active() const { return state_ != nullptr; }
  // True when the call has finished (then the request is empty); rethrows its error. Never
  // blocks.
  bool test();
  // Blocks until the call has finished, without spinning; rethrows its error.
  void wait();
  // Waits for every request; rethrows the first error (in span order) once all have finished.
  static void wait_all(std::span<Request> requests);

 private:
  void finish_or_log() noexcept;
  std::shared_ptr<detail::RequestState> state_;
};

}  // namespace gradcomm
