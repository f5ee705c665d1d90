#include "core/communicator.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/internal_name.h"
#include "core/node_comm.h"
#include "core/timeline.h"

namespace gradcomm {
namespace {

// Whether this process's MPI was initialized by gradcomm::init (and so is ours to finalize).
bool g_initialized_by_us = false;

// Set when MPI_Finalize begins: MPI deletes MPI_COMM_SELF's attributes first thing in
// MPI_Finalize, calling this (MPI-3.1 section 8.7.1).
std::atomic<bool> g_mpi_finalized{false};

int on_finalize(MPI_Comm, int, void*, void*) {
  // MPI is still whole here (MPI-3.1 8.7.1): let requests in flight finish before it goes.
  drain_all_engines();
  g_mpi_finalized.store(true, std::memory_order_relaxed);
  return MPI_SUCCESS;
}

// Installs on_finalize once per process (MPI must be initialized).
void watch_finalize() {
  static std::once_flag once;
  std::call_once(once, [] {
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, on_finalize, &key, nullptr) == MPI_SUCCESS) {
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
      MPI_Comm_free_keyval(&key);  // released once the attribute is deleted (at MPI_Finalize)
    }
  });
}

// MPI_Comm_test_inter on a handle that may be invalid: false instead of MPI's default abort.
// MPICH's handles are integers, so MPI_Comm_f2c of an unknown index is a handle no check above
// can tell from a real one; the error is raised on MPI_COMM_WORLD's handler (MPI_COMM_SELF's
// under MPI 4 sessions), which returns it for the duration of this call.
bool test_inter(MPI_Comm comm, int* inter) {
  MPI_Errhandler world_handler = MPI_ERRHANDLER_NULL, self_handler = MPI_ERRHANDLER_NULL;
  check_mpi(MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_handler),
            "Communicator: MPI_Comm_get_errhandler");
  check_mpi(MPI_Comm_get_errhandler(MPI_COMM_SELF, &self_handler),
            "Communicator: MPI_Comm_get_errhandler");
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
            "Communicator: MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN),
            "Communicator: MPI_Comm_set_errhandler");
  const int rc = MPI_Comm_test_inter(comm, inter);
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, world_handler),
            "Communicator: MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_SELF, self_handler),
            "Communicator: MPI_Comm_set_errhandler");
  check_mpi(MPI_Errhandler_free(&world_handler), "Communicator: MPI_Errhandler_free");
  check_mpi(MPI_Errhandler_free(&self_handler), "Communicator: MPI_Errhandler_free");
  return rc == MPI_SUCCESS;
}

// The settings every rank of a communicator must share, each as the variable that sets it and
// its value as text: ranks that differ in one take different paths through the same call (or
// compare calls differently) and would wait for each other until the watchdog ends the job, or
// meet messages of another shape. Others (GRADCOMM_TIMEOUT, the log level, polling, binding,
// the device) may differ; GRADCOMM_HIERARCHICAL_INTRA and GRADCOMM_TCP_PIECE_BYTES are compared
// where they are used, and the MPI preload agrees GRADCOMM_MPI_MIN_BYTES itself (the largest).
constexpr std::size_t kSettingBytes = 48;
struct SharedSetting {
  const char* variable;
  std::string value;
};

std::vector<SharedSetting> shared_settings(const Config& c) {
  return {
      {"GRADCOMM_CHECK", std::string(to_string(c.check))},
      {"GRADCOMM_ALGORITHM", c.algorithm},
      {"GRADCOMM_DETERMINISTIC", c.deterministic ? "1" : "0"},
      {"GRADCOMM_SEGMENT_BYTES", std::to_string(c.segment_bytes)},
      {"GRADCOMM_PIPELINE_DEPTH", std::to_string(c.pipeline_depth)},
      {"GRADCOMM_FUSION_THRESHOLD", std::to_string(c.fusion_threshold)},
      {"GRADCOMM_CALIBRATE", c.calibrate ? "1" : "0"},
      {"GRADCOMM_AUTO_MEASURE", c.auto_measure ? "1" : "0"},
      {"GRADCOMM_GPU_INTER_NODE", c.gpu_inter_node},
      {"GRADCOMM_NCCL_BLOCKING", c.nccl_blocking ? "1" : "0"},
  };
}
}  // namespace

bool mpi_finalized() {
  return g_mpi_finalized.load(std::memory_order_relaxed);
}

void require_mpi_alive(std::string_view call, int rank) {
  if (mpi_finalized()) {
    throw InvalidArgument(error_message(std::string(call), rank,
                                        "MPI has been finalized: no collective can run after it"));
  }
}

void require_thread_multiple(std::string_view call, int rank) {
  static std::atomic<int> known{-1};  // the level cannot change once MPI is initialized
  int level = known.load(std::memory_order_relaxed);
  if (level < 0) {
    check_mpi(MPI_Query_thread(&level), std::string(call) + ": MPI_Query_thread", rank);
    known.store(level, std::memory_order_relaxed);
  }
  if (level >= MPI_THREAD_MULTIPLE) return;
  const char* names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
  const std::string name = level >= MPI_THREAD_SINGLE && level <= MPI_THREAD_SERIALIZED
                               ? names[level - MPI_THREAD_SINGLE]
                               : "level " + std::to_string(level);
  throw Unsupported(error_message(
      call, rank,
      "MPI was initialized at " + name +
          ", but non-blocking calls run on a progress thread that calls MPI while the "
          "application's threads may too: initialize MPI with MPI_Init_thread(..., "
          "MPI_THREAD_MULTIPLE, ...), or let gradcomm::init() do it, or use the blocking calls"));
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  if (mpi_ready()) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::abort();  // MPI finalized (the program's exit), or MPI_Abort returned
}

bool mpi_ready() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void init(int* argc, char*** argv) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "init: MPI_Initialized");
  if (initialized) return;
  int finalized = 0;
  check_mpi(MPI_Finalized(&finalized), "init: MPI_Finalized");
  if (finalized) {
    throw InvalidArgument(error_message("init", -1, "MPI was already finalized in this process"));
  }
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "init: MPI_Init_thread");
  g_initialized_by_us = true;
}

void finalize() {
  if (!g_initialized_by_us || !mpi_ready()) return;
  g_initialized_by_us = false;
  drain_all_engines();
  check_mpi(MPI_Finalize(), "finalize: MPI_Finalize");
}

bool is_communicator(MPI_Comm comm, int* inter) {
  int scratch = 0;
  // Open MPI's MPI_Comm_f2c gives a null handle (not MPI_COMM_NULL) for an unknown index.
  return comm != MPI_COMM_NULL && comm != MPI_Comm{} &&
         test_inter(comm, inter != nullptr ? inter : &scratch);
}

Communicator::Communicator(MPI_Comm comm, Config config) : config_(std::move(config)) {
  config_.validate();
  if (!mpi_ready()) {
    throw InvalidArgument(
        error_message("Communicator", -1, "MPI is not initialized (call gradcomm::init() first)"));
  }
  int inter = 0;
  if (!is_communicator(comm, &inter)) {
    throw InvalidArgument(
        error_message("Communicator", -1, "the MPI communicator is MPI_COMM_NULL or invalid"));
  }
  if (inter) {
    throw InvalidArgument(
        error_message("Communicator", -1,
                      "the MPI communicator is an intercommunicator; gradcomm reduces over "
                      "intracommunicators (MPI_Intercomm_merge first)"));
  }
  watch_finalize();
  check_mpi(MPI_Comm_dup(comm, &comm_), "Communicator: MPI_Comm_dup");
  // Errors on our communicator come back as return codes that check_mpi turns into exceptions.
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Communicator: set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "Communicator: MPI_Comm_rank");
  name_internal(comm_);
  check_mpi(MPI_Comm_size(comm_, &size_), "Communicator: MPI_Comm_size");
  int world_rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "Communicator: MPI_Comm_rank");
  timeline::start_from_environment(world_rank);
  if (config_.watchdog) {
    // One exchange for two things. The settings that must agree (shared_settings), compared on
    // every rank alike: an error naming the first that differs, before any call. And the
    // watchdog: ranks may differ in their timeout (GRADCOMM_TIMEOUT, or a front end's own such
    // as torch's), and the endpoint exchange is collective, so every rank takes part when any
    // rank wants one. One that wants none offers no endpoint and keeps no recorder.
    const std::vector<SharedSetting> settings = shared_settings(config_);
    const std::size_t entry = 1 + settings.size() * kSettingBytes;  // wanted, then the values
    std::vector<char> mine(entry, '\0');
    const int wanted = config_.timeout_seconds > 0 ? 1 : 0;
    mine[0] = static_cast<char>(wanted);
    for (std::size_t i = 0; i < settings.size(); ++i) {
      settings[i].value.copy(&mine[1 + i * kSettingBytes], kSettingBytes - 1);
    }
    std::vector<char> all(entry * static_cast<std::size_t>(size_));
    check_mpi(MPI_Allgather(mine.data(), static_cast<int>(entry), MPI_CHAR, all.data(),
                            static_cast<int>(entry), MPI_CHAR, comm_),
              "Communicator: MPI_Allgather of the settings", rank_);
    int any = 0;
    for (int r = 0; r < size_; ++r)
      any |= all[static_cast<std::size_t>(r) * entry];
    for (std::size_t i = 0; i < settings.size(); ++i) {
      const auto value_of = [&](int r) {
        return std::string(&all[static_cast<std::size_t>(r) * entry + 1 + i * kSettingBytes]);
      };
      for (int r = 1; r < size_; ++r) {
        if (value_of(r) == value_of(0)) continue;
        MPI_Comm_free(&comm_);
        throw InvalidArgument(error_message(
            "Communicator", rank_,
            std::string(settings[i].variable) + " differs across ranks: '" + value_of(0) +
                "' on rank 0, '" + value_of(r) + "' on rank " + std::to_string(r) +
                "; set it identically for every rank (mpirun -x " + settings[i].variable +
                "=...)"));
      }
    }
    if (any) start_watchdog(wanted != 0);
  }
}

void Communicator::start_watchdog(bool wanted) {
  // Every rank's endpoint, and rank 0's name for this communicator, so that rank 0 can ask every
  // rank for its recorder even when that rank is busy outside gradcomm.
  struct Entry {
    watchdog::Endpoint endpoint;
    std::uint64_t id;
  };
  static std::atomic<std::uint64_t> created{0};  // communicators may be built on two threads
  Entry mine{
      wanted ? watchdog::local_endpoint() : watchdog::Endpoint{},
      (static_cast<std::uint64_t>(::getpid()) << 32) ^ (++created << 20) ^
          static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())};
  std::vector<Entry> all(static_cast<std::size_t>(size_));
  check_mpi(
      MPI_Allgather(&mine, sizeof(Entry), MPI_BYTE, all.data(), sizeof(Entry), MPI_BYTE, comm_),
      "Communicator: MPI_Allgather of the watchdog endpoints", rank_);
  if (!wanted) return;
  std::vector<watchdog::Endpoint> peers;
  for (const Entry& e : all)
    peers.push_back(e.endpoint);
  recorder_ = std::make_shared<watchdog::Recorder>(
      rank_, size_, config_.timeout_seconds, config_.timeout_text(), all[0].id, std::move(peers));
  watchdog::watch(recorder_);
}

void Communicator::renew_after_mismatch() {
  MPI_Comm fresh = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm_, &fresh), "Communicator: MPI_Comm_dup after a mismatch", rank_);
  check_mpi(MPI_Comm_set_errhandler(fresh, MPI_ERRORS_RETURN), "Communicator: set_errhandler");
  name_internal(fresh);
  MPI_Comm_free(&comm_);  // freed by MPI once the abandoned requests are gone
  comm_ = fresh;
}

void Communicator::drop_after_mismatch() {
  for (std::unique_ptr<Attachment>& attachment : attachments_) {
    if (attachment && !attachment->survives_mismatch()) attachment.reset();
  }
}

void drive_mpi_progress(MPI_Comm comm) {
  // An unmatched probe runs Open MPI's progress engine once (errors are left to the next real
  // call: this one only helps).
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, MPI_STATUS_IGNORE);
}

std::size_t Communicator::next_attachment_slot() {
  static std::atomic<std::size_t> next{0};
  return next.fetch_add(1);
}

ProgressEngine& Communicator::engine() {
  if (!engine_) engine_ = std::make_unique<ProgressEngine>(config_.engine_poll_us);
  return *engine_;
}

Communicator::~Communicator() {
  if (engine_) engine_->drain();  // requests still use this communicator (and read engine_)
  engine_.reset();
  recorder_.reset();
  attachments_.clear();  // they may hold MPI objects derived from comm_
  if (comm_ != MPI_COMM_NULL && mpi_ready()) MPI_Comm_free(&comm_);
}

std::byte* Communicator::scratch(std::size_t bytes, int slot) {
  AlignedBuffer& buffer = scratch_[slot];
  if (bytes > buffer.size() || buffer.data() == nullptr) buffer = AlignedBuffer(bytes);
  return buffer.data();
}

RegisteredBuffer Communicator::allocate(std::size_t bytes) {
  settle();
  require_mpi_alive("allocate", rank_);
  unsigned long long range[2] = {bytes, ~static_cast<unsigned long long>(bytes)};  // max, min
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm_),
            "allocate: MPI_Allreduce", rank_);
  const unsigned long long largest = range[0], smallest = ~range[1];
  if (largest != smallest) {
    throw InvalidArgument(
        error_message("allocate", rank_,
                      "ranks asked for different sizes (" + std::to_string(smallest) + " to " +
                          std::to_string(largest) + " bytes, this rank " + std::to_string(bytes) +
                          "); every rank must allocate the same size"));
  }
  if (bytes == 0) return {};
  // The segment holds every rank of the host's slice, each rounded up to 2 MiB at most: a size
  // whose total would wrap is refused alike on every rank (the same size, the same group).
  if (bytes > (std::numeric_limits<std::size_t>::max() - (std::size_t{2} << 20)) /
                  static_cast<std::size_t>(size_)) {
    throw InvalidArgument(error_message("allocate", rank_,
                                        std::to_string(bytes) + " bytes on each of " +
                                            std::to_string(size_) +
                                            " ranks do not fit in one address space"));
  }
  const NodeComm node(comm_, rank_, "allocate");
  return detail::allocate_registered(node.get(), bytes, "allocate");
}

void Communicator::log(LogLevel level, std::string_view message) const {
  if (!log_enabled(level)) return;
  const std::string name(to_string(level));
  std::fprintf(stderr, "[gradcomm rank %d] %s: %.*s\n", rank_, name.c_str(),
               static_cast<int>(message.size()), message.data());
}

}  // namespace gradcomm
