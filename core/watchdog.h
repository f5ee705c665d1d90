#pragma once

// Stall watchdog. Every communicator built by a user (not the sub-communicators gradcomm makes
// for itself) keeps a flight recorder of its last collectives. A per-process thread wakes twice a
// second; when a collective has been running longer than GRADCOMM_TIMEOUT, the communicator's
// rank 0 gathers every rank's recorder over a side channel (one TCP listener per process, served
// by the same thread, so a rank busy outside gradcomm still answers), prints one merged report
// that names the ranks that never arrived, and aborts the job with MPI_Abort. A rank other than
// 0 that times out asks rank 0 to do this, and does it itself when rank 0 does not. The abort is
// bounded: a process still alive 10 s after MPI_Abort exits with _exit.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gradcomm::watchdog {

// What the recorder keeps of one call. Opaque to core: the layer that records calls (the call
// check, collectives/check) stores its own fingerprint in `payload` and gives `describe`, which
// turns a record into one line ("allreduce #41: 1000 x float32 sum, algorithm ring").
struct Record {
  static constexpr std::size_t kPayloadBytes = 64;
  std::uint64_t sequence = 0;
  double grace_seconds = 0;  // added to the timeout (GPU calls: the NCCL path times out first)
  std::string (*describe)(const Record&) = nullptr;
  alignas(8) std::array<std::byte, kPayloadBytes> payload{};
};

// How to reach one rank's watchdog thread.
struct Endpoint {
  std::array<std::uint32_t, 4> ipv4{};  // network byte order, 0 = none
  std::uint16_t port = 0;               // 0: no listener (the rank cannot be asked)
  std::int32_t pid = 0;
  std::array<char, 64> host{};
};

// The flight recorder of one communicator: its last kDepth calls and, while one runs, when it
// started. begin/update/end are called by the thread making the calls (one at a time: calls on a
// communicator never overlap); the watchdog thread reads. The writer takes no lock and reads a
// coarse clock (a millisecond-scale tick: timeouts are whole seconds), since it runs in every
// call: the mutex and the two precise clock reads it replaced were a fifth of an 8-byte shm
// all-reduce's time on 2 ranks (docs/results/shm.md, "A call's own overhead").
class Recorder {
 public:
  static constexpr int kDepth = 8;

  // `timeout_text` names the timeout and what set it in reports ("GRADCOMM_TIMEOUT=300 s").
  Recorder(int rank, int size, int timeout_seconds, std::string timeout_text, std::uint64_t id,
           std::vector<Endpoint> peers);

  void begin(const Record& call);
  // Rewrites the running call's record (what it waits for changed), keeping when it started.
  void update(const Record& call);
  void end(bool ok);

  // This rank's lines for the merged report (newest call first).
  std::string dump() const;
  // The running call's description when it has run past the timeout (plus its grace).
  bool overdue(std::string* call, double* seconds) const;
  // The running call's description and how long it has run, when one runs.
  bool running(std::string* call, double* seconds) const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int timeout_seconds() const { return timeout_; }
  const std::string& timeout_text() const { return timeout_text_; }
  std::uint64_t id() const { return id_; }
  const std::vector<Endpoint>& peers() const { return peers_; }

 private:
  enum class State : std::uint8_t { running, completed, failed };
  struct Entry {
    Record call;
    State state = State::completed;
    double started = 0, finished = 0;  // coarse monotonic seconds (clock_seconds)
  };
  // An entry as words, each read and written atomically, so that a read racing the writer is no
  // data race; version_ tells the reader to read again.
  static constexpr std::size_t kEntryWords = (sizeof(Entry) + 7) / 8;
  using EntryWords = std::array<std::atomic<std::uint64_t>, kEntryWords>;
  struct Snapshot {
    std::array<Entry, kDepth> entries{};
    std::uint64_t calls = 0;
    bool running = false;
    const Entry& newest() const { return entries[(calls - 1) % kDepth]; }
  };

  // The writer's side of the sequence lock: `write` runs between an odd and an even version.
  template <class Write>
  void write(Write&& body);
  void store(std::size_t slot, const Entry& e);
  Entry load(std::size_t slot) const;
  // A consistent copy: of every entry (all) or of the newest only.
  Snapshot snapshot(bool all) const;

  const int rank_, size_, timeout_;
  const std::string timeout_text_;
  const std::uint64_t id_;
  const std::vector<Endpoint> peers_;
  std::atomic<std::uint64_t> version_{0};  // odd while the writer writes
  std::array<EntryWords, kDepth> entries_{};
  std::atomic<std::uint64_t> calls_{0};  // entries written so far
  std::atomic<bool> running_{false};
  Entry last_;  // the writer's copy of the newest entry (only the writer touches it)
};

// This process's endpoint (starts the watchdog thread and its listener on first use). When no
// listener can be opened the port is 0 and the report says so for this rank.
Endpoint local_endpoint();

// Registers a recorder with the watchdog thread (which keeps it until the returned handle and
// every other owner drop it).
void watch(const std::shared_ptr<Recorder>& recorder);

}  // namespace gradcomm::watchdog
