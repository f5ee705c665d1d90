#pragma once

// The timeline: a Chrome trace file per rank (GRADCOMM_TIMELINE=path; Perfetto and
// chrome://tracing open it) of what gradcomm does and when: requests submitted, queued and waited
// for, buckets packed and unpacked, every all-reduce with its algorithm and bytes, and the
// trainer's forward, backward and optimizer steps. Rank r writes `path` with ".rank<r>" put
// before a ".json" ending (or appended with ".json"). Off, each event point costs one relaxed
// atomic load. Events are buffered and written when the buffer fills, at stop() and at exit.

#include <cstdint>
#include <string>
#include <string_view>

namespace gradcomm::timeline {

// True while a timeline is being written.
bool enabled();

// Starts writing (replacing a timeline already open) for `rank`; the file is `path` as above.
// Throws InvalidArgument naming the file when it cannot be created.
void start(const std::string& path, int rank);
// Starts from GRADCOMM_TIMELINE, once per process, if it is set (the first Communicator calls
// this with its world rank).
void start_from_environment(int rank);
// Writes what is buffered, closes the JSON array and the file. Safe to call when not enabled.
void stop();
// The file being written ("" when not enabled).
std::string path();

// Microseconds on the trace's clock (steady, since the timeline started).
double now_us();

// A complete event ("X") on this thread: `name` from `start_us` for `dur_us`, category `cat`;
// `args` is a JSON object's members without braces ("\"bytes\": 4096") or empty.
void complete(std::string_view name, std::string_view cat, double start_us, double dur_us,
              std::string_view args = {});
// An async span ("b" then "e", with `id`): for intervals that do not nest on one thread, such as
// a request's time in the queue. Viewers draw them on a track of their own.
void async_span(std::string_view name, std::string_view cat, std::uint64_t id, double start_us,
                double end_us, std::string_view args = {});
// An instant event ("i") on this thread.
void instant(std::string_view name, std::string_view cat, std::string_view args = {});
// Names this thread in the trace ("caller", "progress engine").
void name_thread(std::string_view name);

// A span on this thread from construction to destruction, recorded only when the timeline was
// enabled at construction.
class Span {
 public:
  Span(std::string_view name, std::string_view cat)
      : on_(enabled()), name_(name), cat_(cat), start_(on_ ? now_us() : 0) {}
  ~Span() {
    if (on_) complete(name_, cat_, start_, now_us() - start_, args_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  bool on() const { return on_; }
  // Sets the span's arguments (only worth building when on()).
  void args(std::string a) { args_ = std::move(a); }

 private:
  bool on_;
  std::string_view name_, cat_;
  double start_;
  std::string args_;
};

}  // namespace gradcomm::timeline
