#include "collectives/select/tuning_table.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "collectives/registry.h"
#include "core/error.h"

namespace gradcomm::collectives {

TuningTable TuningTable::from_fastest(
    int ranks, int groups, const std::vector<std::pair<std::size_t, std::string>>& fastest) {
  TuningTable table;
  table.ranks = ranks;
  table.groups = groups;
  for (std::size_t i = 0; i < fastest.size(); ++i) {
    const std::size_t limit =
        i + 1 < fastest.size()
            ? static_cast<std::size_t>(std::sqrt(static_cast<double>(fastest[i].first) *
                                                 static_cast<double>(fastest[i + 1].first)))
            : std::numeric_limits<std::size_t>::max();
    if (!table.rows.empty() && table.rows.back().algorithm == fastest[i].second) {
      table.rows.back().max_bytes = limit;
    } else {
      table.rows.push_back({limit, fastest[i].second});
    }
  }
  return table;
}

void TuningTable::save(const std::string& path) const {
  std::ofstream out(path);
  out << to_json();
  out.flush();
  if (!out) {
    throw InvalidArgument(error_message("tuning table", -1, "cannot write '" + path + "'"));
  }
}

TuningTable TuningTable::load(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream content;
  content << in.rdbuf();
  if (!in) throw InvalidArgument(error_message("tuning table", -1, "cannot read '" + path + "'"));
  return parse(content.str(), path);
}

std::string TuningTable::to_json() const {
  nlohmann::json doc;
  doc["version"] = 1;
  doc["ranks"] = ranks;
  doc["groups"] = groups;
  doc["rows"] = nlohmann::json::array();
  for (const Row& row : rows) {
    doc["rows"].push_back({{"max_bytes", row.max_bytes}, {"algorithm", row.algorithm}});
  }
  return doc.dump(2) + "\n";
}

TuningTable TuningTable::parse(const std::string& text, const std::string& origin) {
  auto bad = [&](const std::string& detail) {
    throw InvalidArgument(error_message("tuning table", -1, origin + ": " + detail));
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("invalid JSON: ") + e.what());
  }
  if (!doc.is_object()) bad("the top level must be an object {\"version\": 1, ...}");
  const auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer() || *version != 1) {
    bad("expected \"version\": 1");
  }
  // Integers only: a float or an out-of-range value is an error, not silently converted.
  auto rank_count = [&](const char* key) {
    const auto it = doc.find(key);
    if (it == doc.end()) bad(std::string("missing field '") + key + "'");
    if (!it->is_number_unsigned() || it->get<std::uint64_t>() < 1 ||
        it->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
      bad(std::string("field '") + key + "' must be an integer from 1 to " +
          std::to_string(std::numeric_limits<int>::max()));
    }
    return static_cast<int>(it->get<std::uint64_t>());
  };
  TuningTable table;
  table.ranks = rank_count("ranks");
  table.groups = rank_count("groups");
  const auto rows = doc.find("rows");
  if (rows == doc.end() || !rows->is_array()) bad("missing array field 'rows'");
  for (std::size_t i = 0; i < rows->size(); ++i) {
    const nlohmann::json& row = (*rows)[i];
    std::string where = "rows[";
    where.append(std::to_string(i)).push_back(']');
    if (!row.is_object())
      bad(where + " must be an object {\"max_bytes\": ..., \"algorithm\": ...}");
    const auto max_bytes = row.find("max_bytes");
    if (max_bytes == row.end() || !max_bytes->is_number_unsigned()) {
      bad(where + ".max_bytes must be a non-negative integer");
    }
    const auto algorithm = row.find("algorithm");
    if (algorithm == row.end() || !algorithm->is_string()) {
      bad(where + ".algorithm must be a string");
    }
    table.rows.push_back({max_bytes->get<std::size_t>(), algorithm->get<std::string>()});
  }
  if (table.rows.empty()) bad("no rows");
  for (const Row& row : table.rows) {
    if (row.algorithm == "auto" || !is_algorithm_name(row.algorithm)) {
      bad("unknown algorithm '" + row.algorithm + "'; valid: " + algorithm_names_joined());
    }
  }
  return table;
}

}  // namespace gradcomm::collectives
