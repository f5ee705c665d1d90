#pragma once

// auto's decision table: written by `gradcomm-bench --tune` (from measured sweeps) or by auto
// itself (its decisions, for reproducible runs), read from Config::tuning_file
// (GRADCOMM_TUNING_FILE). JSON: {"version": 1, "ranks": R, "groups": G, "rows": [{"max_bytes":
// B, "algorithm": "name"}, ...]}.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace gradcomm::collectives {

// A decision table: the first row whose max_bytes >= the call's bytes names the algorithm.
struct TuningTable {
  struct Row {
    std::size_t max_bytes;
    std::string algorithm;
  };
  int ranks = 0;
  int groups = 0;
  std::vector<Row> rows;

  // The table of a size sweep: `fastest` holds (bytes, fastest algorithm) in increasing size;
  // each measured size decides up to the geometric midpoint to the next one, and equal
  // neighbours merge into one row.
  static TuningTable from_fastest(int ranks, int groups,
                                  const std::vector<std::pair<std::size_t, std::string>>& fastest);

  std::string to_json() const;
  // Writes to_json() to `path`; throws InvalidArgument naming it when it cannot.
  void save(const std::string& path) const;
  // Reads and parses `path` (InvalidArgument naming it when unreadable or malformed).
  static TuningTable load(const std::string& path);
  // Throws InvalidArgument naming `origin` for malformed text or unknown algorithm names.
  static TuningTable parse(const std::string& text, const std::string& origin);
};

}  // namespace gradcomm::collectives
