#include "core/config.h"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "core/error.h"

namespace gradcomm {
namespace {

constexpr std::string_view kLogLevels[] = {"error", "warn", "info", "debug", "trace"};
constexpr std::size_t kMinSegmentBytes = 16;
constexpr std::size_t kMaxSegmentBytes = std::size_t{1} << 30;
constexpr std::size_t kMinTcpPieceBytes = 1024;
constexpr int kMinPipelineDepth = 1;
constexpr int kMaxPipelineDepth = 64;

[[noreturn]] void bad_variable(std::string_view name, std::string_view value,
                               std::string_view expected) {
  throw InvalidArgument(error_message("Config::from_environment", -1,
                                      std::string(name) + "='" + std::string(value) +
                                          "' is invalid: expected " + std::string(expected)));
}

long long parse_integer(std::string_view name, std::string_view value, long long lo, long long hi) {
  long long parsed = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  const std::string range =
      "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (ec != std::errc() || end != value.data() + value.size() || parsed < lo || parsed > hi) {
    bad_variable(name, value, range);
  }
  return parsed;
}

}  // namespace

std::string_view to_string(LogLevel level) {
  const auto index = static_cast<std::size_t>(level);
  return index < std::size(kLogLevels) ? kLogLevels[index] : "invalid";
}

std::string_view to_string(CheckMode mode) {
  switch (mode) {
    case CheckMode::off:
      return "off";
    case CheckMode::normal:
      return "default";
    case CheckMode::full:
      return "full";
  }
  return "invalid";
}

Config Config::from_environment() {
  Config config;
  auto get = [](const char* name) -> const char* { return std::getenv(name); };

  if (const char* v = get("GRADCOMM_ALGORITHM")) {
    // The name is checked against the registry by the first collective that uses it (the
    // registry lives above core); an empty value is rejected here.
    if (*v == '\0') bad_variable("GRADCOMM_ALGORITHM", v, "an algorithm name (see --list)");
    config.algorithm = v;
  }
  if (const char* v = get("GRADCOMM_LOG_LEVEL")) {
    bool found = false;
    for (std::size_t i = 0; i < std::size(kLogLevels); ++i) {
      if (kLogLevels[i] == v) {
        config.log_level = static_cast<LogLevel>(i);
        found = true;
      }
    }
    if (!found) bad_variable("GRADCOMM_LOG_LEVEL", v, "one of error, warn, info, debug, trace");
  }
  if (const char* v = get("GRADCOMM_SEGMENT_BYTES")) {
    config.segment_bytes = static_cast<std::size_t>(
        parse_integer("GRADCOMM_SEGMENT_BYTES", v, static_cast<long long>(kMinSegmentBytes),
                      static_cast<long long>(kMaxSegmentBytes)));
  }
  if (const char* v = get("GRADCOMM_TCP_PIECE_BYTES")) {
    config.tcp_piece_bytes = static_cast<std::size_t>(
        parse_integer("GRADCOMM_TCP_PIECE_BYTES", v, 0, static_cast<long long>(kMaxSegmentBytes)));
    if (config.tcp_piece_bytes != 0 && config.tcp_piece_bytes < kMinTcpPieceBytes) {
      bad_variable("GRADCOMM_TCP_PIECE_BYTES", v, "0, or an integer in [1024, 1073741824]");
    }
  }
  if (const char* v = get("GRADCOMM_PIPELINE_DEPTH")) {
    config.pipeline_depth = static_cast<int>(
        parse_integer("GRADCOMM_PIPELINE_DEPTH", v, kMinPipelineDepth, kMaxPipelineDepth));
  }
  if (const char* v = get("GRADCOMM_FUSION_THRESHOLD")) {
    config.fusion_threshold =
        static_cast<std::size_t>(parse_integer("GRADCOMM_FUSION_THRESHOLD", v, 0, 1LL << 40));
  }
  if (const char* v = get("GRADCOMM_TUNING_FILE")) config.tuning_file = v;
  if (const char* v = get("GRADCOMM_CALIBRATE")) {
    const std::string value = v;
    if (value != "0" && value != "1") bad_variable("GRADCOMM_CALIBRATE", v, "0 or 1");
    config.calibrate = value == "1";
  }
  if (const char* v = get("GRADCOMM_AUTO_MEASURE")) {
    const std::string value = v;
    if (value != "0" && value != "1") bad_variable("GRADCOMM_AUTO_MEASURE", v, "0 or 1");
    config.auto_measure = value == "1";
  }
  if (const char* v = get("GRADCOMM_DETERMINISTIC")) {
    const std::string value = v;
    if (value != "0" && value != "1") bad_variable("GRADCOMM_DETERMINISTIC", v, "0 or 1");
    config.deterministic = value == "1";
  }
  if (const char* v = get("GRADCOMM_RANKS_PER_NODE")) {
    config.ranks_per_node =
        static_cast<int>(parse_integer("GRADCOMM_RANKS_PER_NODE", v, 1, 1 << 20));
  }
  if (const char* v = get("GRADCOMM_TOPOLOGY")) {
    const std::string value = v;
    if (value != "dgx1" && !value.empty()) bad_variable("GRADCOMM_TOPOLOGY", v, "dgx1 or empty");
    config.topology_preset = value;
  }
  if (const char* v = get("GRADCOMM_HIERARCHICAL_INTRA")) {
    const std::string value = v;
    if (value != "auto" && value != "direct" && value != "ring" && value != "shm") {
      bad_variable("GRADCOMM_HIERARCHICAL_INTRA", v, "one of auto, direct, ring, shm");
    }
    config.hierarchical_intra = value;
  }
  if (get("GRADCOMM_SHM_STORES")) {  // removed: say so rather than ignore it
    throw InvalidArgument(error_message(
        "Config::from_environment", -1,
        "GRADCOMM_SHM_STORES was removed: hierarchical's shared-memory phases always use plain "
        "stores, which measured fastest; unset it"));
  }
  if (const char* v = get("GRADCOMM_BIND")) {
    const std::string value = v;
    if (value != "none" && value != "core" && value != "numa") {
      bad_variable("GRADCOMM_BIND", v, "one of none, core, numa");
    }
    config.bind = value;
  }
  if (const char* v = get("GRADCOMM_ENGINE_POLL_US")) {
    config.engine_poll_us =
        static_cast<int>(parse_integer("GRADCOMM_ENGINE_POLL_US", v, 0, 1000000));
  }
  if (const char* v = get("GRADCOMM_TIMEOUT")) {
    config.timeout_seconds = static_cast<int>(parse_integer("GRADCOMM_TIMEOUT", v, 0, 1 << 30));
  }
  if (const char* v = get("GRADCOMM_CHECK")) {
    const std::string value = v;
    if (value == "off") {
      config.check = CheckMode::off;
    } else if (value == "default") {
      config.check = CheckMode::normal;
    } else if (value == "full") {
      config.check = CheckMode::full;
    } else {
      bad_variable("GRADCOMM_CHECK", v, "one of off, default, full");
    }
  }
  if (const char* v = get("GRADCOMM_DEVICE")) {
    config.device = static_cast<int>(parse_integer("GRADCOMM_DEVICE", v, 0, 1 << 16));
  }
  if (const char* v = get("GRADCOMM_GPU_INTER_NODE")) {
    const std::string value = v;
    if (value != "nccl" && value != "mpi")
      bad_variable("GRADCOMM_GPU_INTER_NODE", v, "nccl or mpi");
    config.gpu_inter_node = value;
  }
  if (const char* v = get("GRADCOMM_NCCL_BLOCKING")) {
    const std::string value = v;
    if (value != "0" && value != "1") bad_variable("GRADCOMM_NCCL_BLOCKING", v, "0 or 1");
    config.nccl_blocking = value == "1";
  }
  if (const char* v = get("GRADCOMM_MPI_MIN_BYTES")) {
    config.mpi_min_bytes =
        static_cast<std::size_t>(parse_integer("GRADCOMM_MPI_MIN_BYTES", v, 0, 1LL << 40));
  }
  if (const char* v = get("GRADCOMM_MPI_LOG")) {
    const std::string value = v;
    if (value != "0" && value != "1") bad_variable("GRADCOMM_MPI_LOG", v, "0 or 1");
    config.mpi_log = value == "1";
  }
  config.validate();
  return config;
}

void Config::validate() const {
  auto bad = [](const std::string& detail) {
    throw InvalidArgument(error_message("Config", -1, detail));
  };
  if (algorithm.empty()) bad("algorithm is empty");
  if (segment_bytes < kMinSegmentBytes || segment_bytes > kMaxSegmentBytes) {
    bad("segment_bytes " + std::to_string(segment_bytes) + " is outside [" +
        std::to_string(kMinSegmentBytes) + ", " + std::to_string(kMaxSegmentBytes) + "]");
  }
  if (tcp_piece_bytes != 0 &&
      (tcp_piece_bytes < kMinTcpPieceBytes || tcp_piece_bytes > kMaxSegmentBytes)) {
    bad("tcp_piece_bytes " + std::to_string(tcp_piece_bytes) + " is outside {0} and [" +
        std::to_string(kMinTcpPieceBytes) + ", " + std::to_string(kMaxSegmentBytes) + "]");
  }
  if (pipeline_depth < kMinPipelineDepth || pipeline_depth > kMaxPipelineDepth) {
    bad("pipeline_depth " + std::to_string(pipeline_depth) + " is outside [" +
        std::to_string(kMinPipelineDepth) + ", " + std::to_string(kMaxPipelineDepth) + "]");
  }
  if (ranks_per_node < 0) bad("ranks_per_node " + std::to_string(ranks_per_node) + " is negative");
  if (!topology_preset.empty() && topology_preset != "dgx1") {
    bad("topology_preset '" + topology_preset + "' is not dgx1");
  }
  if (hierarchical_intra != "auto" && hierarchical_intra != "direct" &&
      hierarchical_intra != "ring" && hierarchical_intra != "shm") {
    bad("hierarchical_intra '" + hierarchical_intra + "' is not auto, direct, ring or shm");
  }
  if (bind != "none" && bind != "core" && bind != "numa") bad("bind '" + bind + "' is invalid");
  if (timeout_seconds < 0)
    bad("timeout_seconds " + std::to_string(timeout_seconds) + " is negative");
  if (engine_poll_us < 0 || engine_poll_us > 1000000)
    bad("engine_poll_us " + std::to_string(engine_poll_us) + " is outside [0, 1000000]");
  if (device < -1) bad("device " + std::to_string(device) + " is below -1");
  if (gpu_inter_node != "nccl" && gpu_inter_node != "mpi") {
    bad("gpu_inter_node '" + gpu_inter_node + "' is not nccl or mpi");
  }
  if (to_string(check) == "invalid")
    bad("check " + std::to_string(static_cast<int>(check)) + " is invalid");
  if (to_string(log_level) == "invalid") {
    bad("log_level " + std::to_string(static_cast<int>(log_level)) + " is invalid");
  }
}

}  // namespace gradcomm
