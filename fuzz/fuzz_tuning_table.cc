// Fuzz target: the tuning-table parser behind GRADCOMM_TUNING_FILE
// (collectives/select/tuning_table.h). Properties: TuningTable::parse either returns a table or
// throws InvalidArgument; a table it returns names only registered algorithms, has rows and
// positive rank and group counts, and survives to_json() -> parse() unchanged.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "collectives/registry.h"
#include "collectives/select/tuning_table.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using gradcomm::collectives::TuningTable;
  const std::string text(reinterpret_cast<const char*>(data), size);
  TuningTable table;
  try {
    table = TuningTable::parse(text, "fuzz input");
  } catch (const gradcomm::InvalidArgument&) {
    return 0;
  }
  if (table.ranks < 1 || table.groups < 1 || table.rows.empty()) std::abort();
  for (const TuningTable::Row& row : table.rows) {
    if (row.algorithm == "auto" || !gradcomm::collectives::is_algorithm_name(row.algorithm)) {
      std::abort();
    }
  }
  const TuningTable again = TuningTable::parse(table.to_json(), "round trip");
  if (again.ranks != table.ranks || again.groups != table.groups ||
      again.rows.size() != table.rows.size()) {
    std::abort();
  }
  for (std::size_t i = 0; i < table.rows.size(); ++i) {
    if (again.rows[i].max_bytes != table.rows[i].max_bytes ||
        again.rows[i].algorithm != table.rows[i].algorithm) {
      std::abort();
    }
  }
  return 0;
}
