#pragma once

#include <array>
#include <cstddef>
#include <string>

namespace gradcomm::collectives {

// How one rank writes the segment in calls of 4 MiB and more (Config::shm_stores; smaller ones
// keep plain stores, their data still cached when peers read it): the all-reduce's slots and
// results, and the slots and published columns of hierarchical's phases, each chosen apart. A plain
// store first reads its line, and a line that a peer's core read a round ago must then come from
// that core. On this 2-core VM that costs little in some periods and 4-6x the copy in others, as
// the host moves the two virtual CPUs between shared and separate caches: a 32 MiB call on 2 ranks
// takes 6 ms or 22 ms, switching within a run. Non-temporal stores never read the line but leave
// the data in memory, where peers read it more slowly than from a shared cache: 8.5 ms in both
// periods. "auto" times its calls (per byte, per size class: sizes within a factor of 2) both ways
// and keeps the cheaper: after three calls each way, alternating (a new size class starts from the
// nearest class measured both ways instead), one call in probe_after() goes the
// other way (8 calls after a switch, doubling to 64 while the choice holds; at once again when a
// probe came out kMargin times cheaper), and the choice switches when the other way's median of
// its last three calls is kMargin times cheaper. Each
// rank chooses for itself (every write is fenced before the counter that publishes it, so results
// do not depend on the choice); all ranks time the same calls, so they rarely differ.
class ShmStores {
 public:
  static constexpr int kFirstProbe = 8, kLastProbe = 64;
  static constexpr double kMargin = 1.2;

  // mode: "auto", "cached" or "streamed".
  explicit ShmStores(const std::string& mode);
  // Whether the next call of `bytes` streams its stores (counts the call).
  bool next_call_streams(std::size_t bytes);
  // A call of `bytes` took `seconds` with streamed stores or not; true when the choice changed.
  bool record(std::size_t bytes, bool streamed, double seconds);
  // The current choice at `bytes` (auto: not counting probes).
  bool streaming(std::size_t bytes) const;
  // Median seconds per byte of the last three calls each way at `bytes` (0: none yet).
  double cost(std::size_t bytes, bool streamed) const;
  int probe_after(std::size_t bytes) const { return classes_[size_class(bytes)].probe_after; }

 private:
  struct Class {
    bool streaming = false;
    int since_probe = 0, probe_after = kFirstProbe;
    std::array<std::array<double, 3>, 2> samples{};  // per way, the last three
    std::array<long, 2> counts{};
    double cost(bool streamed) const;
  };
  static std::size_t size_class(std::size_t bytes);
  int fixed_;  // -1: auto; 0: cached; 1: streamed
  std::array<Class, 65> classes_{};
};

}  // namespace gradcomm::collectives
