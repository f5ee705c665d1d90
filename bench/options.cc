#include "bench/bench.h"

namespace gradcomm::bench {

// "hierarchical/shm" (also /direct, /ring): hierarchical with that intra-group form
// (Config::hierarchical_intra). Each runs on a communicator of its own so the forms interleave.
std::string base_algorithm(const std::string& name) {
  return name.substr(0, name.find('/'));
}

std::map<std::string, std::unique_ptr<Communicator>>& variant_comms() {
  static std::map<std::string, std::unique_ptr<Communicator>> comms;
  return comms;
}

const char kUsage[] =
    "usage: mpirun -np N gradcomm-bench [options]\n"
    "  -b, --minbytes SIZE   smallest message (default 8; K/M/G suffixes)\n"
    "  -e, --maxbytes SIZE   largest message (default 64M)\n"
    "  -f, --stepfactor F    size multiplier between rows (default 2)\n"
    "  -a, --algorithms L    comma-separated names (default ring,halving_doubling,flat,auto);\n"
    "                        hierarchical/direct, /ring, /shm: hierarchical with that\n"
    "                        intra-group form (GRADCOMM_HIERARCHICAL_INTRA);\n"
    "                        MPI_Allreduce ('mpi') is always measured as the baseline\n"
    "  -d, --datatype T      float32 float64 float16 bfloat16 int32 int64 (default float32)\n"
    "  -o, --op OP           sum avg min max prod (default sum)\n"
    "  -n, --iters N         timed rounds per size and algorithm (default 20)\n"
    "  -w, --warmup N        untimed calls first (default 5)\n"
    "  --explore S           auto: after the warm-up, untimed calls until it has settled at\n"
    "                        the size (no duel between algorithms under way), at most S\n"
    "                        seconds (default 2; 0 times auto's exploration too)\n"
    "  -c, --check 0|1       check results against an MPI float64 reference (default 1)\n"
    "      --inplace         in-place calls (send == recv)\n"
    "      --csv | --json    machine-readable output on rank 0's stdout\n"
    "      --list            print the registered algorithm names, one per line, with why an\n"
    "                        algorithm cannot run here (nccl without a GPU)\n"
    "      --device cpu|gpu  where the buffers live (default cpu). gpu: cudaMalloc'ed buffers on\n"
    "                        the device pick_device gives (GRADCOMM_DEVICE), algorithms nccl and\n"
    "                        hierarchical by default, and nccl (not MPI) as the baseline; a batch\n"
    "                        of calls is enqueued asynchronously and synchronised once, as\n"
    "                        nccl-tests does\n"
    "      --workload W      per-step time of all-reducing a model's gradients (W: resnet50,\n"
    "                        mobilenet_v2, bert_base, vgg16, or a path to a workload file):\n"
    "                        one MPI_Allreduce per tensor, grouped_allreduce, one MPI_Allreduce\n"
    "                        of a pre-concatenated buffer, and pack+unpack against memcpy\n"
    "      --fusion-threshold B  bucket size for --workload (default GRADCOMM_FUSION_THRESHOLD)\n"
    "      --registered      send/recv buffers in registered memory (comm.allocate), for every\n"
    "                        algorithm and MPI_Allreduce alike\n"
    "      --bound           before, during (after each round) and after each row, measure\n"
    "                        the machine's bound on busbw, the best of them (the library's\n"
    "                        reduction on each rank's own data, all ranks at once; with --cycle\n"
    "                        or private buffers also a cross-core read of lines another core\n"
    "                        just wrote) and report of_bound = busbw / bound and the machine\n"
    "                        state the probe saw\n"
    "      --cycle           time a training step's use of the buffers: before each call every\n"
    "                        rank rewrites its input, after it reads the result; reports the\n"
    "                        call's time and the whole cycle's (back-to-back calls overstate\n"
    "                        what a step sees)\n"
    "      --default-malloc  leave glibc's malloc as it is; by default mmap and trimming are off\n"
    "                        so MPI_Allreduce reuses its temporary buffers (a fair baseline)\n"
    "      --no-baseline     do not measure MPI_Allreduce (vs_mpi is 0): the algorithms alone,\n"
    "                        as a program that calls only them sees them (MPI's calls between\n"
    "                        rounds change the caches the next round starts from)\n"
    "      --no-lead-in      no untimed call of the same algorithm before each round's timed\n"
    "                        calls (then the first timed call follows another algorithm's\n"
    "                        round, as before this option)\n"
    "      --tune FILE       sweep every registered algorithm (and MPI_Allreduce) and write the\n"
    "                        fastest per size as a decision table for auto\n"
    "                        (GRADCOMM_TUNING_FILE=FILE)\n";

[[noreturn]] void usage_error(const std::string& message) {
  throw gradcomm::InvalidArgument("gradcomm-bench: " + message + "\n" + kUsage);
}

std::size_t parse_size(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k")
    scale = 1 << 10;
  else if (suffix == "M" || suffix == "m")
    scale = 1 << 20;
  else if (suffix == "G" || suffix == "g")
    scale = 1 << 30;
  else if (!suffix.empty())
    usage_error("bad size '" + text + "'");
  if (end == text.c_str() || value < 0) usage_error("bad size '" + text + "'");
  return static_cast<std::size_t>(value * scale);
}

int parse_int(const std::string& text, int lo) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (*end != '\0' || end == text.c_str() || value < lo) usage_error("bad number '" + text + "'");
  return static_cast<int>(value);
}

double parse_double(const std::string& text, double lo) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (*end != '\0' || end == text.c_str() || !(value >= lo))
    usage_error("bad number '" + text + "'");
  return value;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ',');) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// Returns nullopt when the program should exit successfully (--help, --list).
std::optional<Options> parse(int argc, char** argv, int rank) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-b" || arg == "--minbytes")
      o.min_bytes = parse_size(value());
    else if (arg == "-e" || arg == "--maxbytes")
      o.max_bytes = parse_size(value());
    else if (arg == "-f" || arg == "--stepfactor")
      o.factor = std::strtod(value().c_str(), nullptr);
    else if (arg == "-a" || arg == "--algorithms") {
      o.algorithms = split_list(value());
      o.algorithms_given = true;
    } else if (arg == "--device") {
      const std::string where = value();
      if (where != "cpu" && where != "gpu") usage_error("--device takes cpu or gpu");
      o.gpu = where == "gpu";
    } else if (arg == "-n" || arg == "--iters")
      o.iters = parse_int(value(), 1);
    else if (arg == "-w" || arg == "--warmup")
      o.warmup = parse_int(value(), 0);
    else if (arg == "--explore")
      o.explore_seconds = parse_double(value(), 0);
    else if (arg == "-c" || arg == "--check")
      o.check = parse_int(value(), 0) != 0;
    else if (arg == "--inplace")
      o.in_place = true;
    else if (arg == "--workload")
      o.workload = value();
    else if (arg == "--tune")
      o.tune_file = value();
    else if (arg == "--fusion-threshold")
      o.fusion_threshold = parse_size(value());
    else if (arg == "--registered")
      o.registered = true;
    else if (arg == "--bound" || arg == "--stream")
      o.bound = true;
    else if (arg == "--cycle")
      o.cycle = true;
    else if (arg == "--default-malloc")
      o.default_malloc = true;
    else if (arg == "--no-baseline")
      o.no_baseline = true;
    else if (arg == "--no-lead-in")
      o.lead_in = false;
    else if (arg == "--csv")
      o.format = Options::Format::csv;
    else if (arg == "--json")
      o.format = Options::Format::json;
    else if (arg == "-d" || arg == "--datatype") {
      const std::string name = value();
      const auto dtype = gradcomm::parse_data_type(name);
      if (!dtype) usage_error("unknown datatype '" + name + "'");
      o.dtype = *dtype;
    } else if (arg == "-o" || arg == "--op") {
      const std::string name = value();
      const auto op = gradcomm::parse_reduce_op(name);
      if (!op) usage_error("unknown op '" + name + "'");
      o.op = *op;
    } else if (arg == "--list") {
      if (rank == 0) {
        for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
          const std::string why_not =
              entry.name == "nccl" ? gradcomm::collectives::nccl_unavailable_reason() : "";
          std::printf("%-18.*s %s%.*s\n", static_cast<int>(entry.name.size()), entry.name.data(),
                      why_not.empty() ? "" : ("unavailable: " + why_not + "  -- ").c_str(),
                      static_cast<int>(entry.summary.size()), entry.summary.data());
        }
      }
      return std::nullopt;
    } else if (arg == "-h" || arg == "--help") {
      if (rank == 0) std::printf("%s", kUsage);
      return std::nullopt;
    } else {
      usage_error("unknown option '" + arg + "'");
    }
  }
  if (o.factor <= 1) usage_error("--stepfactor must be > 1");
  if (o.min_bytes > o.max_bytes) usage_error("--minbytes is larger than --maxbytes");
  for (const std::string& name : o.algorithms) {
    const std::string form =
        name.find('/') == std::string::npos ? "" : name.substr(name.find('/') + 1);
    if (base_algorithm(name) == "hierarchical" && !form.empty()) {
      if (form != "direct" && form != "ring" && form != "shm")
        usage_error("unknown intra-group form in '" + name + "'; valid: direct, ring, shm");
    } else if (!gradcomm::collectives::is_algorithm_name(name)) {
      usage_error("unknown algorithm '" + name +
                  "'; valid: " + gradcomm::collectives::algorithm_names_joined());
    }
  }
  if (!o.tune_file.empty()) {  // every registered algorithm competes
    o.algorithms.clear();
    for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
      if (entry.prototype->capabilities().host_buffers) o.algorithms.emplace_back(entry.name);
    }
  }
  if (o.gpu) {
    if (!o.tune_file.empty() || o.registered || o.bound || o.cycle || !o.workload.empty())
      usage_error(
          "--device gpu does not combine with --tune, --registered, --bound, --cycle, "
          "--workload");
    if (!o.algorithms_given) o.algorithms = {"hierarchical", "auto"};
  }
  // The baseline is measured (unless --no-baseline), listed last: MPI_Allreduce for host buffers,
  // NCCL for device buffers (MPI here is not CUDA-aware).
  const std::string baseline = o.gpu ? "nccl" : "mpi";
  if (o.no_baseline) {
    if (o.gpu || !o.tune_file.empty() || !o.workload.empty())
      usage_error("--no-baseline does not combine with --device gpu, --tune or --workload");
    return o;
  }
  o.algorithms.erase(std::remove(o.algorithms.begin(), o.algorithms.end(), baseline),
                     o.algorithms.end());
  o.algorithms.push_back(baseline);
  return o;
}

}  // namespace gradcomm::bench
