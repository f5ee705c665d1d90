#include "packing/workload.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace gradcomm::packing {
namespace {

[[noreturn]] void bad(const std::string& origin, const std::string& detail) {
  throw InvalidArgument(error_message("load_workload", -1, origin + ": " + detail));
}

}  // namespace

std::size_t Workload::total_elements() const {
  std::size_t total = 0;
  for (const Tensor& t : tensors)
    total += t.count;
  return total;
}

Workload parse_workload(const std::string& text, const std::string& origin) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, out_of_range (1e400), ...
    bad(origin, std::string("invalid JSON: ") + e.what());
  }
  if (!doc.is_object()) bad(origin, "the top level must be an object");
  Workload w;
  auto string_field = [&](const char* key, std::string& out, bool required) {
    if (!doc.contains(key)) {
      if (required) bad(origin, std::string("missing field '") + key + "'");
      return;
    }
    if (!doc[key].is_string()) bad(origin, std::string("field '") + key + "' must be a string");
    out = doc[key].get<std::string>();
  };
  string_field("model", w.model, true);
  string_field("source", w.source, false);
  std::string dtype = "float32";
  string_field("dtype", dtype, false);
  const auto parsed = parse_data_type(dtype);
  if (!parsed) bad(origin, "unknown dtype '" + dtype + "'");
  w.dtype = *parsed;
  if (!doc.contains("tensors") || !doc["tensors"].is_array()) {
    bad(origin, "missing array field 'tensors'");
  }
  std::size_t total = 0;
  for (std::size_t i = 0; i < doc["tensors"].size(); ++i) {
    const nlohmann::json& entry = doc["tensors"][i];
    const std::string where = "tensors[" + std::to_string(i) + "]";
    if (!entry.is_object()) bad(origin, where + " must be an object");
    Workload::Tensor t;
    if (entry.contains("name")) {
      if (!entry["name"].is_string()) bad(origin, where + ".name must be a string");
      t.name = entry["name"].get<std::string>();
    }
    if (!entry.contains("shape") || !entry["shape"].is_array()) {
      bad(origin, where + ".shape must be an array");
    }
    for (const nlohmann::json& dim : entry["shape"]) {
      if (!dim.is_number_integer() || dim.get<std::int64_t>() < 0) {
        bad(origin, where + ".shape must hold non-negative integers");
      }
      const auto d = static_cast<std::size_t>(dim.get<std::int64_t>());
      if (d != 0 && t.count > std::numeric_limits<std::size_t>::max() / d) {
        bad(origin, where + ".shape overflows the element count");
      }
      t.count *= d;
      t.shape.push_back(static_cast<std::int64_t>(d));
    }
    if (total > std::numeric_limits<std::size_t>::max() - t.count) {
      bad(origin, "the total element count overflows");
    }
    total += t.count;
    w.tensors.push_back(std::move(t));
  }
  auto check_total = [&](const char* key, std::size_t actual) {
    if (!doc.contains(key)) return;
    if (!doc[key].is_number_unsigned() || doc[key].get<std::size_t>() != actual) {
      bad(origin, std::string("field '") + key + "' disagrees with the tensor list (" +
                      std::to_string(actual) + ")");
    }
  };
  check_total("num_tensors", w.tensors.size());
  check_total("num_elements", total);
  return w;
}

Workload load_workload(const std::string& path) {
  std::ifstream in(path);
  if (!in) bad(path, "cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_workload(text.str(), path);
}

}  // namespace gradcomm::packing
