#include "core/timeline.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <unistd.h>
#include <string>
#include <vector>

#include "core/error.h"

namespace gradcomm::timeline {
namespace {

// Each thread formats its events into a buffer of its own (its own lock, never contended but
// by stop()), so threads never wait for each other while they trace; a full buffer is written
// to the file under the file's lock.
constexpr std::size_t kFlushBytes = std::size_t{256} << 10;

std::atomic<bool> g_enabled{false};
// Bumped by every start(): a thread's buffer from an earlier timeline is dropped, not written.
std::atomic<std::uint64_t> g_generation{0};

struct ThreadBuffer {
  std::mutex mutex;
  std::string data;
  std::uint64_t generation = 0;
  int tid = 0;
};

struct State {
  std::mutex mutex;  // the file, the path and the list of buffers
  std::FILE* file = nullptr;
  std::string path;
  int rank = 0;
  std::vector<ThreadBuffer*> buffers;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};

State& state() {
  static State* s = new State;  // never destroyed: events may come from atexit handlers
  return *s;
}

std::atomic<int> g_next_thread{1};
std::atomic<int> g_rank{0};

// Writes `b`'s events (if they belong to the open timeline) and empties it. Needs both locks.
void write_locked(State& s, ThreadBuffer& b) {
  if (s.file && !b.data.empty() && b.generation == g_generation.load(std::memory_order_relaxed)) {
    std::fwrite(b.data.data(), 1, b.data.size(), s.file);
  }
  b.data.clear();
}

// This thread's buffer, registered with the state while the thread lives; at thread exit what
// is left is written.
struct Registered {
  ThreadBuffer buffer;
  Registered() {
    buffer.tid = g_next_thread.fetch_add(1);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.buffers.push_back(&buffer);
  }
  ~Registered() {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    {
      std::lock_guard<std::mutex> own(buffer.mutex);
      write_locked(s, buffer);
    }
    std::erase(s.buffers, &buffer);
  }
};

ThreadBuffer& my_buffer() {
  thread_local Registered registered;
  return registered.buffer;
}

void stop_locked(State& s) {
  if (!s.file) return;
  g_enabled.store(false, std::memory_order_relaxed);
  for (ThreadBuffer* b : s.buffers) {
    std::lock_guard<std::mutex> own(b->mutex);
    write_locked(s, *b);
  }
  std::fputs("\n]\n", s.file);
  std::fclose(s.file);
  s.file = nullptr;
  s.path.clear();
}

void append_number(std::string& b, double v) {
  char text[32];
  const int n = std::snprintf(text, sizeof text, "%.3f", v);
  b.append(text, static_cast<std::size_t>(n));
}

void append_int(std::string& b, long long v) {
  char text[24];
  const int n = std::snprintf(text, sizeof text, "%lld", v);
  b.append(text, static_cast<std::size_t>(n));
}

// Appends one event to this thread's buffer: name, cat, ph, pid, tid, then `fill` adds the rest
// (starting with a comma).
template <class Fill>
void append(std::string_view name, std::string_view cat, char ph, Fill fill) {
  ThreadBuffer& b = my_buffer();
  bool full = false;
  {
    std::lock_guard<std::mutex> own(b.mutex);
    const std::uint64_t generation = g_generation.load(std::memory_order_relaxed);
    if (b.generation != generation) {
      b.data.clear();
      b.generation = generation;
    }
    std::string& d = b.data;
    d.append(",\n{\"name\":\"").append(name).append("\",\"cat\":\"").append(cat);
    d.append("\",\"ph\":\"").push_back(ph);
    d.append("\",\"pid\":");
    append_int(d, g_rank.load(std::memory_order_relaxed));
    d.append(",\"tid\":");
    append_int(d, b.tid);
    fill(d);
    d.push_back('}');
    full = d.size() >= kFlushBytes;
  }
  if (full) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    std::lock_guard<std::mutex> own(b.mutex);
    write_locked(s, b);
  }
}

void append_args(std::string& d, std::string_view args) {
  if (args.empty()) return;
  d.append(",\"args\":{").append(args).push_back('}');
}

// `path` with "<tag><n>" before its ".json" (added where it has none). Built with append: GCC
// 12's -Wrestrict misfires on chains of operator+ here.
std::string tagged(const std::string& path, std::string_view tag, int n) {
  constexpr std::string_view kJson = ".json";
  std::string file = path;
  if (file.size() > kJson.size() &&
      file.compare(file.size() - kJson.size(), kJson.size(), kJson) == 0) {
    file.resize(file.size() - kJson.size());
  }
  file.append(tag).append(std::to_string(n)).append(kJson);
  return file;
}

std::string file_for(const std::string& path, int rank) {
  return tagged(path, ".rank", rank);
}

}  // namespace

bool enabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                   state().origin)
      .count();
}

void start(const std::string& path, int rank) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    stop_locked(s);
    const std::string file = file_for(path, rank);
    s.file = std::fopen(file.c_str(), "w");
    if (!s.file) {
      throw InvalidArgument(error_message(
          "timeline", rank,
          "cannot create the timeline file '" + file + "' (GRADCOMM_TIMELINE=" + path + ")"));
    }
    s.path = file;
    s.rank = rank;
    g_rank.store(rank, std::memory_order_relaxed);
    g_generation.fetch_add(1, std::memory_order_relaxed);
    // The first element, so that every event after it starts with a comma.
    std::fprintf(s.file,
                 "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,"
                 "\"args\":{\"name\":\"rank %d\"}}",
                 rank, rank);
    static std::once_flag at_exit;
    std::call_once(at_exit, [] { std::atexit([] { stop(); }); });
    g_enabled.store(true, std::memory_order_relaxed);
  }
  name_thread("caller");
}

void start_from_environment(int rank) {
  static std::once_flag once;
  std::call_once(once, [rank] {
    const char* path = std::getenv("GRADCOMM_TIMELINE");
    if (!path || !*path) return;
    // A process can hold two copies of gradcomm (Python's module and the torch backend, each
    // with its own static libraries), each with a timeline of its own: the second copy to start
    // one writes trace.2.rank<r>.json instead of overwriting the first's file. The copies share
    // the environment, where the first leaves "<pid>:<copies>" (a child process, whose pid
    // differs, starts afresh).
    const std::string mine = std::to_string(getpid());
    int copy = 1;
    if (const char* seen = std::getenv("GRADCOMM_TIMELINE_COPIES")) {
      const std::string text = seen;
      const auto colon = text.find(':');
      if (colon != std::string::npos && text.substr(0, colon) == mine)
        copy = std::atoi(text.c_str() + colon + 1) + 1;
    }
    std::string value = mine;
    value.append(":").append(std::to_string(copy));
    setenv("GRADCOMM_TIMELINE_COPIES", value.c_str(), 1);
    start(copy > 1 ? tagged(path, ".", copy) : std::string(path), rank);
  });
}

void stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  stop_locked(s);
}

std::string path() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.path;
}

void complete(std::string_view name, std::string_view cat, double start_us, double dur_us,
              std::string_view args) {
  if (!enabled()) return;
  append(name, cat, 'X', [&](std::string& d) {
    d.append(",\"ts\":");
    append_number(d, start_us);
    d.append(",\"dur\":");
    append_number(d, dur_us);
    append_args(d, args);
  });
}

void async_span(std::string_view name, std::string_view cat, std::uint64_t id, double start_us,
                double end_us, std::string_view args) {
  if (!enabled()) return;
  for (const bool begin : {true, false}) {
    append(name, cat, begin ? 'b' : 'e', [&](std::string& d) {
      d.append(",\"ts\":");
      append_number(d, begin ? start_us : end_us);
      d.append(",\"id\":");
      append_int(d, static_cast<long long>(id));
      if (begin) append_args(d, args);
    });
  }
}

void instant(std::string_view name, std::string_view cat, std::string_view args) {
  if (!enabled()) return;
  const double now = now_us();
  append(name, cat, 'i', [&](std::string& d) {
    d.append(",\"ts\":");
    append_number(d, now);
    d.append(",\"s\":\"t\"");
    append_args(d, args);
  });
}

void name_thread(std::string_view name) {
  if (!enabled()) return;
  append("thread_name", "__metadata", 'M',
         [&](std::string& d) { d.append(",\"args\":{\"name\":\"").append(name).append("\"}"); });
}

}  // namespace gradcomm::timeline
