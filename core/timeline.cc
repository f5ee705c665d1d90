#include "core/timeline.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "core/error.h"

namespace gradcomm::timeline {
namespace {

constexpr std::size_t kFlushBytes = std::size_t{1} << 20;

std::atomic<bool> g_enabled{false};

struct State {
  std::mutex mutex;
  std::FILE* file = nullptr;
  std::string path;
  std::string buffer;
  bool first = true;
  int rank = 0;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};

State& state() {
  static State* s = new State;  // never destroyed: events may come from atexit handlers
  return *s;
}

std::atomic<int> g_next_thread{1};

int thread_id() {
  thread_local const int id = g_next_thread.fetch_add(1);
  return id;
}

void flush_locked(State& s) {
  if (s.file && !s.buffer.empty()) {
    std::fwrite(s.buffer.data(), 1, s.buffer.size(), s.file);
    std::fflush(s.file);
  }
  s.buffer.clear();
}

void stop_locked(State& s) {
  if (!s.file) return;
  g_enabled.store(false, std::memory_order_relaxed);
  s.buffer += "\n]\n";
  flush_locked(s);
  std::fclose(s.file);
  s.file = nullptr;
  s.path.clear();
}

// Appends one event; `body` holds its members after name, cat and ph.
void append(std::string_view name, std::string_view cat, char ph, std::string_view rest) {
  State& s = state();
  const int tid = thread_id();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.file) return;
  std::string& b = s.buffer;
  b += s.first ? "\n" : ",\n";
  s.first = false;
  b += "{\"name\":\"";
  b += name;
  b += "\",\"cat\":\"";
  b += cat;
  b += "\",\"ph\":\"";
  b += ph;
  b += "\",\"pid\":";
  b += std::to_string(s.rank);
  b += ",\"tid\":";
  b += std::to_string(tid);
  b += rest;
  b += "}";
  if (b.size() >= kFlushBytes) flush_locked(s);
}

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", v);
  return text;
}

std::string file_for(const std::string& path, int rank) {
  std::string tag = ".rank";
  tag += std::to_string(rank);
  constexpr std::string_view kJson = ".json";
  if (path.size() > kJson.size() &&
      path.compare(path.size() - kJson.size(), kJson.size(), kJson) == 0) {
    return path.substr(0, path.size() - kJson.size()) + tag + std::string(kJson);
  }
  return path + tag + ".json";
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
    s.first = true;
    s.buffer.assign(1, '[');
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
    if (path && *path) start(path, rank);
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
  // Built by appending: GCC 12 warns (falsely, -Wrestrict) on "literal" + std::string.
  std::string rest = ",\"ts\":";
  rest += number(start_us);
  rest += ",\"dur\":";
  rest += number(dur_us);
  if (!args.empty()) {
    rest += ",\"args\":{";
    rest += args;
    rest += "}";
  }
  append(name, cat, 'X', rest);
}

void async_span(std::string_view name, std::string_view cat, std::uint64_t id, double start_us,
                double end_us, std::string_view args) {
  if (!enabled()) return;
  for (const bool begin : {true, false}) {
    std::string rest = ",\"ts\":";
    rest += number(begin ? start_us : end_us);
    rest += ",\"id\":";
    rest += std::to_string(id);
    if (begin && !args.empty()) {
      rest += ",\"args\":{";
      rest += args;
      rest += "}";
    }
    append(name, cat, begin ? 'b' : 'e', rest);
  }
}

void instant(std::string_view name, std::string_view cat, std::string_view args) {
  if (!enabled()) return;
  std::string rest = ",\"ts\":";
  rest += number(now_us());
  rest += ",\"s\":\"t\"";
  if (!args.empty()) {
    rest += ",\"args\":{";
    rest += args;
    rest += "}";
  }
  append(name, cat, 'i', rest);
}

void name_thread(std::string_view name) {
  if (!enabled()) return;
  std::string rest = ",\"args\":{\"name\":\"";
  rest += name;
  rest += "\"}";
  append("thread_name", "__metadata", 'M', rest);
}

}  // namespace gradcomm::timeline
