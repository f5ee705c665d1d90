#include "core/request.h"

#include <cstdio>
#include <utility>

#include "core/timeline.h"

namespace gradcomm {

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    finish_or_log();
    state_ = std::move(other.state_);
  }
  return *this;
}

Request::~Request() {
  finish_or_log();
}

void Request::finish_or_log() noexcept {
  if (!state_) return;
  state_->done.wait(false, std::memory_order_acquire);
  if (state_->error) {
    try {
      std::rethrow_exception(state_->error);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gradcomm: %s was destroyed unwaited and failed: %s\n",
                   state_->call.c_str(), e.what());
    } catch (...) {
      std::fprintf(stderr, "gradcomm: %s was destroyed unwaited and failed\n",
                   state_->call.c_str());
    }
  }
  state_.reset();
}

bool Request::test() {
  if (!state_) return true;
  if (!state_->done.load(std::memory_order_acquire)) return false;
  const std::exception_ptr error = std::exchange(state_->error, nullptr);
  state_.reset();
  if (error) std::rethrow_exception(error);
  return true;
}

void Request::wait() {
  if (!state_) return;
  timeline::Span span("wait", "request");
  if (span.on()) span.args("\"call\":\"" + state_->call + "\"");
  // Still queued behind nothing running: this thread runs it, rather than wait for the engine's.
  if (state_->runner && !state_->done.load(std::memory_order_acquire))
    state_->runner->run_here(state_.get());
  state_->done.wait(false, std::memory_order_acquire);
  const std::exception_ptr error = std::exchange(state_->error, nullptr);
  state_.reset();
  if (error) std::rethrow_exception(error);
}

void Request::wait_all(std::span<Request> requests) {
  std::exception_ptr first;
  for (Request& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace gradcomm
