#include "core/watchdog.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <mpi.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <sstream>
#include <thread>
#include <type_traits>

namespace gradcomm::watchdog {
namespace {

constexpr int kAbortCode = 70;                  // the job's exit status after a watchdog abort
constexpr double kCoordinatorWaitSeconds = 15;  // a non-zero rank's wait for rank 0's report
constexpr int kConnectMillis = 2000, kReplyMillis = 3000;
constexpr const char* kElsewhere = "    meanwhile running ";  // a dump's line of another call

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string seconds_text(double s) {
  char text[32];
  if (s < 1e-3) {
    std::snprintf(text, sizeof text, "%.0f us", s * 1e6);
  } else if (s < 1) {
    std::snprintf(text, sizeof text, "%.1f ms", s * 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.1f s", s);
  }
  return text;
}

// Writes all of `text` (best effort: the peer may be gone).
void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;
    done += static_cast<std::size_t>(n);
  }
}

// Reads until EOF, `limit` bytes, a newline when `line`, or `millis` have passed.
std::string read_all(int fd, int millis, std::size_t limit = 1 << 16, bool line = false) {
  std::string text;
  const double deadline = now_seconds() + millis / 1000.0;
  char buffer[4096];
  while (text.size() < limit) {
    const int left = static_cast<int>((deadline - now_seconds()) * 1000);
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) break;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
    if (line && text.find('\n') != std::string::npos) break;
  }
  return text;
}

// Reads one request line (the requests are short).
std::string read_line(int fd, int millis) {
  std::string text = read_all(fd, millis, 256, true);
  const std::size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

int connect_to(std::uint32_t ipv4, std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = ipv4;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    if (errno != EINPROGRESS) {
      ::close(fd);
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t length = sizeof error;
    if (::poll(&p, 1, kConnectMillis) != 1 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) {
      ::close(fd);
      return -1;
    }
  }
  return fd;
}

std::string host_of(const Endpoint& e) {
  return std::string(e.host.data(), strnlen(e.host.data(), e.host.size()));
}

// Sends `request` to `peer` and returns its answer; nullopt-like empty + ok=false on failure.
bool ask(const Endpoint& peer, const std::string& request, std::string* answer) {
  if (peer.port == 0) return false;
  std::vector<std::uint32_t> addresses;
  char here[64] = {};
  ::gethostname(here, sizeof here - 1);
  if (host_of(peer) == here) addresses.push_back(htonl(INADDR_LOOPBACK));
  for (std::uint32_t a : peer.ipv4)
    if (a != 0) addresses.push_back(a);
  for (std::uint32_t a : addresses) {
    const int fd = connect_to(a, peer.port);
    if (fd < 0) continue;
    write_all(fd, request);
    if (answer) *answer = read_all(fd, kReplyMillis);
    ::close(fd);
    return true;
  }
  return false;
}

// "0-2,5" for {0, 1, 2, 5}.
std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1)
      ++j;
    if (!text.empty()) text.push_back(',');
    text.append(std::to_string(ranks[i]));
    if (j > i) {
      text.push_back(j == i + 1 ? ',' : '-');
      text.append(std::to_string(ranks[j]));
    }
    i = j + 1;
  }
  return text;
}

[[noreturn]] void abort_job() {
  std::fflush(stderr);
  std::thread([] {  // MPI_Abort is bounded: whatever happens, the process ends
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(kAbortCode);
  })
      .detach();
  MPI_Abort(MPI_COMM_WORLD, kAbortCode);
  std::this_thread::sleep_for(std::chrono::seconds(20));
  std::_Exit(kAbortCode);
}

// The process's watchdog: one listener, one thread, every registered recorder.
class Service {
 public:
  static Service& instance() {
    static Service* service = new Service();  // never destroyed: the thread outlives main
    return *service;
  }

  Endpoint endpoint() const { return endpoint_; }

  void watch(const std::shared_ptr<Recorder>& recorder) {
    std::lock_guard lock(mutex_);
    // A weak_ptr keeps its recorder's memory (one allocation with the count): drop the expired
    // ones here too, not only on the thread's next round, so a program that makes and frees
    // communicators quickly holds memory for the live ones only.
    std::erase_if(recorders_, [](const std::weak_ptr<Recorder>& w) { return w.expired(); });
    recorders_.push_back(recorder);
  }

 private:
  Service() {
    endpoint_.pid = static_cast<std::int32_t>(::getpid());
    ::gethostname(endpoint_.host.data(), endpoint_.host.size() - 1);
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t length = sizeof address;
    if (listener_ >= 0 && ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) == 0 &&
        ::listen(listener_, 64) == 0 &&
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
      endpoint_.port = ntohs(address.sin_port);
    } else if (listener_ >= 0) {
      ::close(listener_);
      listener_ = -1;
    }
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) == 0) {
      std::size_t n = 0;
      for (ifaddrs* i = list; i && n < endpoint_.ipv4.size(); i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
            (i->ifa_flags & IFF_LOOPBACK)) {
          continue;
        }
        endpoint_.ipv4[n++] = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
      }
      ::freeifaddrs(list);
    }
    std::thread([this] { run(); }).detach();
  }

  void run() {
    double abort_at = 0;  // a non-zero rank waiting for rank 0's report
    for (;;) {
      pollfd p{listener_, POLLIN, 0};
      const int ready = ::poll(&p, listener_ >= 0 ? 1 : 0, 500);
      if (ready > 0) {
        const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          serve(fd);
          ::close(fd);
        }
      }
      if (abort_at > 0 && now_seconds() > abort_at) {
        std::fprintf(stderr,
                     "[gradcomm] watchdog: rank 0 did not report within %.0f s; this rank's "
                     "recent calls:\n%s",
                     kCoordinatorWaitSeconds, stalled_->dump().c_str());
        abort_job();
      }
      if (abort_at > 0) continue;
      // Overdue calls, and stall notices from other ranks for communicators this rank leads.
      std::vector<std::shared_ptr<Recorder>> live;
      {
        std::lock_guard lock(mutex_);
        std::erase_if(recorders_, [](const std::weak_ptr<Recorder>& w) { return w.expired(); });
        for (const auto& w : recorders_)
          if (auto r = w.lock()) live.push_back(std::move(r));
      }
      for (const auto& recorder : live) {
        std::string call;
        double seconds = 0;
        const auto notice = notices_.find(recorder->id());
        if (recorder->rank() == 0 && notice != notices_.end()) {
          // (Its timeout may differ from this rank's: its own message names it.)
          coordinate(*recorder, "rank " + notice->second + " timed out");
        }
        if (!recorder->overdue(&call, &seconds)) continue;
        const std::string what = call + " has not completed on rank " +
                                 std::to_string(recorder->rank()) + " after " +
                                 seconds_text(seconds) + " (" + recorder->timeout_text() + ")";
        if (recorder->rank() == 0) coordinate(*recorder, what);
        std::fprintf(stderr, "[gradcomm rank %d] watchdog: %s; asking rank 0 for the report\n",
                     recorder->rank(), what.c_str());
        std::fflush(stderr);
        const std::string notice_line = "STALL " + std::to_string(recorder->id()) + " " +
                                        std::to_string(recorder->rank()) + "\n";
        if (!ask(recorder->peers()[0], notice_line, nullptr)) {
          std::fprintf(stderr, "[gradcomm rank %d] watchdog: rank 0 cannot be reached\n",
                       recorder->rank());
          coordinate(*recorder, what);
        }
        stalled_ = recorder;
        abort_at = now_seconds() + kCoordinatorWaitSeconds;
        break;
      }
    }
  }

  void serve(int fd) {
    const std::string line = read_line(fd, 1000);
    std::istringstream in(line);
    std::string verb;
    std::uint64_t id = 0;
    in >> verb >> id;
    if (verb == "STALL") {
      std::string rank;
      in >> rank;
      notices_.emplace(id, rank);
      return;
    }
    if (verb != "DUMP") return;
    std::shared_ptr<Recorder> found;
    {
      std::lock_guard lock(mutex_);
      for (const auto& w : recorders_) {
        auto r = w.lock();
        if (r && r->id() == id) found = std::move(r);
      }
    }
    write_all(fd, found ? dump(*found) : "state none\n  (communicator already destroyed)\n");
  }

  // A recorder's lines for the report, and the calls this process runs on its other
  // communicators meanwhile: a rank that waits on another communicator is not idle.
  std::string dump(const Recorder& recorder) {
    std::string text = recorder.dump();
    std::lock_guard lock(mutex_);
    for (const auto& w : recorders_) {
      const auto other = w.lock();
      std::string call;
      double seconds = 0;
      if (!other || other.get() == &recorder || !other->running(&call, &seconds)) continue;
      text += std::string(kElsewhere) + call + " on another communicator of " +
              std::to_string(other->size()) + " ranks (for " + seconds_text(seconds) + ")\n";
    }
    return text;
  }

  // Rank 0 of the communicator: gathers every rank's recorder, prints one report, aborts.
  [[noreturn]] void coordinate(const Recorder& recorder, const std::string& what) {
    std::fprintf(stderr, "[gradcomm rank 0] watchdog: %s; collecting every rank's recent calls\n",
                 what.c_str());
    std::fflush(stderr);
    const int n = recorder.size();
    std::vector<std::string> dumps(static_cast<std::size_t>(n));
    std::vector<bool> answered(static_cast<std::size_t>(n), false);
    const std::string request = "DUMP " + std::to_string(recorder.id()) + "\n";
    for (int j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (j == recorder.rank()) {
        dumps[u] = dump(recorder);
        answered[u] = true;
      } else {
        answered[u] = ask(recorder.peers()[u], request, &dumps[u]) && !dumps[u].empty();
      }
    }
    // Newest call of every rank, from each dump's first line ("state <sequence> <running>") and
    // its "running" line; ranks inside a call are grouped by what the call is.
    std::map<std::string, std::vector<int>> running_in;  // call description -> ranks inside it
    std::vector<int> silent, idle;
    std::map<int, std::string> idle_newest;
    std::uint64_t highest = 0;
    for (int j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (!answered[u]) {
        silent.push_back(j);
        continue;
      }
      std::istringstream first(dumps[u].substr(0, dumps[u].find('\n')));
      std::string word, sequence;
      int running = 0;
      first >> word >> sequence >> running;
      if (running) {
        highest = std::max<std::uint64_t>(highest, std::stoull(sequence));
        const std::string marker = "running   ";
        const std::size_t at = dumps[u].find(marker);
        std::string call =
            at == std::string::npos ? "call #" + sequence : dumps[u].substr(at + marker.size());
        call = call.substr(0, call.find(" (for "));
        running_in[call].push_back(j);
      } else {
        idle.push_back(j);
        idle_newest[j] = sequence;
      }
    }
    std::string report = "[gradcomm] watchdog report: communicator of " + std::to_string(n) +
                         " ranks, newest call first\n";
    for (int j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      const Endpoint& e = recorder.peers()[u];
      report += "  rank " + std::to_string(j) + " (host " + host_of(e) + ", pid " +
                std::to_string(e.pid) + "):\n";
      if (!answered[u]) {
        report += "    no answer: the process is gone, or its watchdog cannot be reached\n";
        continue;
      }
      const std::size_t body = dumps[u].find('\n');
      report += body == std::string::npos ? "" : dumps[u].substr(body + 1);
    }
    std::string verdict;
    for (const auto& [call, ranks] : running_in) {
      verdict.append(ranks.size() == 1 ? "  rank " : "  ranks ");
      verdict.append(rank_list(ranks));
      verdict.append(ranks.size() == 1 ? " waits inside " : " wait inside ");
      verdict.append(call);
      verdict.push_back('\n');
    }
    bool elsewhere = false;
    for (int j : idle) {
      const std::string& text = dumps[static_cast<std::size_t>(j)];
      const std::string newest = idle_newest[j] == "-" ? "none" : "#" + idle_newest[j];
      // A rank inside a call on another communicator: that call (the first such), without its
      // "(for ...)".
      if (const std::size_t at = text.find(kElsewhere); at != std::string::npos) {
        const std::size_t from = at + std::string_view(kElsewhere).size();
        const std::size_t to = text.find(" (for ", from);
        verdict += "  rank " + std::to_string(j) + " is in no collective of this communicator " +
                   "(newest call: " + newest + "): it waits inside " +
                   text.substr(from, to - from) + "\n";
        elsewhere = true;
        continue;
      }
      verdict +=
          "  rank " + std::to_string(j) + " is not in any collective (newest call: " + newest +
          ")" +
          (running_in.empty() ? "" : " - it never arrived at call #" + std::to_string(highest)) +
          "\n";
    }
    if (!silent.empty()) verdict += "  ranks " + rank_list(silent) + " did not answer\n";
    if (elsewhere && !running_in.empty()) {
      verdict +=
          "  the ranks wait in calls on different communicators: they disagree on which "
          "communicator the call is on\n";
    }
    if (running_in.size() > 1) {
      verdict +=
          "  the waiting ranks are in different calls: the ranks disagree on the order of "
          "collectives\n";
    }
    report += "[gradcomm] verdict:\n" + verdict + "[gradcomm] aborting the job (exit code " +
              std::to_string(kAbortCode) + ")\n";
    std::fputs(report.c_str(), stderr);
    abort_job();
  }

  int listener_ = -1;
  Endpoint endpoint_;
  std::mutex mutex_;
  std::vector<std::weak_ptr<Recorder>> recorders_;
  std::map<std::uint64_t, std::string> notices_;  // communicator id -> rank that timed out
  std::shared_ptr<Recorder> stalled_;
};

}  // namespace

Recorder::Recorder(int rank, int size, int timeout_seconds, std::string timeout_text,
                   std::uint64_t id, std::vector<Endpoint> peers)
    : rank_(rank),
      size_(size),
      timeout_(timeout_seconds),
      timeout_text_(std::move(timeout_text)),
      id_(id),
      peers_(std::move(peers)) {}

namespace {

// The recorder's clock: CLOCK_MONOTONIC_COARSE (a read costs a quarter of a precise one; its
// tick, 1-4 ms, is far below any timeout).
double clock_seconds() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double clock_tick() {
  static const double tick = [] {
    timespec t{};
    clock_getres(CLOCK_MONOTONIC_COARSE, &t);
    return std::max(1e-9, static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9);
  }();
  return tick;
}

// A duration read on the recorder's clock: below its tick it says so.
std::string duration_text(double s) {
  return s < clock_tick() ? "under " + seconds_text(clock_tick()) : seconds_text(s);
}

}  // namespace

static_assert(std::is_trivially_copyable_v<Record>, "entries are copied as words");

template <class Write>
void Recorder::write(Write&& body) {
  const std::uint64_t v = version_.load(std::memory_order_relaxed);
  version_.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // the odd version before any word
  body();
  version_.store(v + 2, std::memory_order_release);
}

void Recorder::store(std::size_t slot, const Entry& e) {
  std::array<std::uint64_t, kEntryWords> words{};
  std::memcpy(words.data(), &e, sizeof e);
  for (std::size_t i = 0; i < kEntryWords; ++i)
    entries_[slot][i].store(words[i], std::memory_order_relaxed);
}

Recorder::Entry Recorder::load(std::size_t slot) const {
  std::array<std::uint64_t, kEntryWords> words{};
  for (std::size_t i = 0; i < kEntryWords; ++i)
    words[i] = entries_[slot][i].load(std::memory_order_relaxed);
  Entry e;
  std::memcpy(static_cast<void*>(&e), words.data(), sizeof e);  // (trivially copyable)
  return e;
}

Recorder::Snapshot Recorder::snapshot(bool all) const {
  for (;;) {
    const std::uint64_t v = version_.load(std::memory_order_acquire);
    if (v % 2 == 0) {
      Snapshot s;
      s.calls = calls_.load(std::memory_order_relaxed);
      s.running = running_.load(std::memory_order_relaxed);
      for (std::uint64_t i = 0; i < std::min<std::uint64_t>(s.calls, all ? kDepth : 1); ++i) {
        const std::size_t slot = (s.calls - 1 - i) % kDepth;
        s.entries[slot] = load(slot);
      }
      std::atomic_thread_fence(std::memory_order_acquire);  // every word before the re-read
      if (version_.load(std::memory_order_relaxed) == v) return s;
    }
    std::this_thread::yield();  // the writer is inside a write (a few stores)
  }
}

void Recorder::begin(const Record& call) {
  const double t = clock_seconds();
  write([&] {
    const std::uint64_t calls = calls_.load(std::memory_order_relaxed);
    last_ = Entry{call, State::running, t, 0};
    store(calls % kDepth, last_);
    calls_.store(calls + 1, std::memory_order_relaxed);
    running_.store(true, std::memory_order_relaxed);
  });
}

void Recorder::update(const Record& call) {
  const std::uint64_t calls = calls_.load(std::memory_order_relaxed);
  if (!running_.load(std::memory_order_relaxed) || calls == 0) return;
  write([&] {
    last_.call = call;
    store((calls - 1) % kDepth, last_);
  });
}

void Recorder::end(bool ok) {
  const std::uint64_t calls = calls_.load(std::memory_order_relaxed);
  if (!running_.load(std::memory_order_relaxed) || calls == 0) return;
  const double t = clock_seconds();
  write([&] {
    last_.state = ok ? State::completed : State::failed;
    last_.finished = t;
    store((calls - 1) % kDepth, last_);
    running_.store(false, std::memory_order_relaxed);
  });
}

std::string Recorder::dump() const {
  const Snapshot s = snapshot(true);
  const double t = clock_seconds();
  if (s.calls == 0) return "state - 0\n    no collective called yet\n";
  const Entry& newest = s.newest();
  std::string text = "state " + std::to_string(newest.call.sequence) + " " +
                     (newest.state == State::running ? "1" : "0") + "\n";
  const std::uint64_t shown = std::min<std::uint64_t>(s.calls, kDepth);
  for (std::uint64_t i = 0; i < shown; ++i) {
    const Entry& e = s.entries[(s.calls - 1 - i) % kDepth];
    const std::string call =
        e.call.describe ? e.call.describe(e.call) : "call #" + std::to_string(e.call.sequence);
    switch (e.state) {
      case State::running:
        text += "    running   " + call + " (for " + duration_text(t - e.started) + ")\n";
        break;
      case State::completed:
      case State::failed:
        text += std::string(e.state == State::completed ? "    completed " : "    failed    ") +
                call + " (took " + duration_text(e.finished - e.started) + ", ended " +
                duration_text(t - e.finished) + " ago)\n";
        break;
    }
  }
  return text;
}

bool Recorder::running(std::string* call, double* seconds) const {
  const Snapshot s = snapshot(false);
  if (!s.running) return false;
  const Entry& e = s.newest();
  *call = e.call.describe ? e.call.describe(e.call) : "call #" + std::to_string(e.call.sequence);
  *seconds = clock_seconds() - e.started;
  return true;
}

bool Recorder::overdue(std::string* call, double* seconds) const {
  if (timeout_ <= 0) return false;
  const Snapshot s = snapshot(false);
  if (!s.running) return false;
  const Entry& e = s.newest();
  const double limit = timeout_ + e.call.grace_seconds;
  const double t = clock_seconds();
  if (t - e.started < limit) return false;
  *call = e.call.describe ? e.call.describe(e.call) : "call #" + std::to_string(e.call.sequence);
  *seconds = t - e.started;
  return true;
}

Endpoint local_endpoint() {
  return Service::instance().endpoint();
}

void watch(const std::shared_ptr<Recorder>& recorder) {
  Service::instance().watch(recorder);
}

}  // namespace gradcomm::watchdog
