// libgradcomm_mpi.so: MPI_Allreduce and MPI_Iallreduce through gradcomm, under an unmodified MPI
// program (docs/mpi-preload.md).
//
// The library defines MPI_Allreduce, MPI_Iallreduce, MPI_Init, MPI_Init_thread, MPI_Finalize
// and MPI_Request_free (for its own requests still in flight: pending_call.h). A call it takes runs
// on gradcomm's Communicator for the user's communicator (a private duplicate, so tags never meet
// the application's), made on first use and cached on the communicator with an attribute whose
// delete callback frees it (when the user frees the communicator, or at MPI_Finalize). A call it
// does not take goes to PMPI_* unchanged.
//
// gradcomm's own MPI calls must reach MPI, never these definitions: the library is linked with
// -Wl,--wrap for each name defined here, which turns the references in gradcomm's objects into
// references to the __wrap_* functions at the end of this file (they call PMPI_*). Definitions
// are not renamed, so the application still finds MPI_Allreduce here.

#include "bindings/mpi/gradcomm_mpi.h"

#include "bindings/mpi/errors.h"
#include "bindings/mpi/pending_call.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "collectives/allreduce.h"
#include "core/communicator.h"
#include "core/config.h"
#include "core/error.h"
#include "core/internal_name.h"
#include "core/progress_engine.h"

namespace {

using gradcomm::DataType;
using gradcomm::ReduceOp;
using gradcomm::mpi_preload::abort_with;
using gradcomm::mpi_preload::PendingCall;
using gradcomm::mpi_preload::raise;

// --- Counters -----------------------------------------------------------------------------------

struct Counters {
  std::atomic<unsigned long long> taken_calls{0}, taken_nonblocking{0}, taken_bytes{0};
  std::atomic<unsigned long long> passed_calls{0}, passed_bytes{0};
  std::atomic<unsigned long long> passed_by_reason[GRADCOMM_MPI_REASONS] = {};
};
Counters g_counters;

void count_taken(std::size_t bytes, bool nonblocking) {
  g_counters.taken_calls.fetch_add(1, std::memory_order_relaxed);
  if (nonblocking) g_counters.taken_nonblocking.fetch_add(1, std::memory_order_relaxed);
  g_counters.taken_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void count_passed(gradcomm_mpi_reason reason, std::size_t bytes) {
  g_counters.passed_calls.fetch_add(1, std::memory_order_relaxed);
  g_counters.passed_bytes.fetch_add(bytes, std::memory_order_relaxed);
  g_counters.passed_by_reason[reason].fetch_add(1, std::memory_order_relaxed);
}

const char* reason_name(int reason) {
  switch (reason) {
    case GRADCOMM_MPI_BELOW_THRESHOLD:
      return "below GRADCOMM_MPI_MIN_BYTES";
    case GRADCOMM_MPI_DATATYPE:
      return "datatype not taken";
    case GRADCOMM_MPI_OP:
      return "op not taken";
    case GRADCOMM_MPI_INTERCOMM:
      return "intercommunicator";
    case GRADCOMM_MPI_THREAD_LEVEL:
      return "MPI_Iallreduce below MPI_THREAD_MULTIPLE";
    case GRADCOMM_MPI_INVALID:
      return "invalid arguments left to MPI";
    case GRADCOMM_MPI_NOT_READY:
      return "MPI not initialized or finalizing";
    case GRADCOMM_MPI_NOT_SET_UP:
      return "MPI_Iallreduce before the communicator's first taken MPI_Allreduce";
    case GRADCOMM_MPI_INTERNAL:
      return "another gradcomm's communicator";
    default:
      return "unknown";
  }
}

// --- Settings, read once after MPI is initialized ------------------------------------------------

// The MPI datatypes taken and the gradcomm type each is exactly (same size, same arithmetic).
struct TypeEntry {
  MPI_Datatype type;
  DataType dtype;
};

struct Settings {
  gradcomm::Config config;
  std::size_t min_bytes = 0;     // config.mpi_min_bytes (GRADCOMM_MPI_MIN_BYTES)
  bool log = false;              // config.mpi_log (GRADCOMM_MPI_LOG)
  bool thread_multiple = false;  // every rank runs at MPI_THREAD_MULTIPLE
  int keyval = MPI_KEYVAL_INVALID;
  // A duplicate of MPI_COMM_WORLD made inside MPI_Init, where every rank is: MPI_COMM_WORLD's
  // gradcomm Communicator is built from it, on a thread of its own when the first call taken on
  // MPI_COMM_WORLD is MPI_Iallreduce. Null if MPI was initialized around this library.
  MPI_Comm world = MPI_COMM_NULL;
  std::vector<TypeEntry> types;
  std::string error;  // a GRADCOMM_* variable that is invalid: every taken call fails with it
};

Settings g_settings;
std::atomic<bool> g_ready{false};  // settings read, MPI initialized and not finalizing
std::mutex g_setup_mutex;
bool g_setup_done = false;  // guarded by g_setup_mutex; once per process (not again after finalize)

int delete_state(MPI_Comm, int, void* value, void*);
int at_finalize(MPI_Comm, int, void*, void*);

void add_type(MPI_Datatype type, DataType dtype) {
  if (type == MPI_DATATYPE_NULL) return;  // an optional type this MPI does not have
  int size = 0;
  if (PMPI_Type_size(type, &size) != MPI_SUCCESS) return;
  if (static_cast<std::size_t>(size) != gradcomm::element_size(dtype)) return;
  g_settings.types.push_back({type, dtype});
}

// Inside MPI_Init (every rank is there): duplicates MPI_COMM_WORLD, and makes the settings that
// decide whether a call is taken the same on every rank (a call taken on one rank and passed
// through on another would never match): the largest threshold, and MPI_Iallreduce taken only if
// every rank runs at MPI_THREAD_MULTIPLE.
void agree_across_ranks() {
  Settings& s = g_settings;
  MPI_Comm world = MPI_COMM_NULL;
  if (PMPI_Comm_dup(MPI_COMM_WORLD, &world) != MPI_SUCCESS) return;
  long long mine[2] = {static_cast<long long>(s.min_bytes), s.thread_multiple ? 0 : 1};
  long long all[2] = {0, 0};
  if (PMPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN) != MPI_SUCCESS ||
      PMPI_Allreduce(mine, all, 2, MPI_LONG_LONG, MPI_MAX, world) != MPI_SUCCESS) {
    PMPI_Comm_free(&world);
    return;
  }
  s.min_bytes = static_cast<std::size_t>(all[0]);
  s.thread_multiple = all[1] == 0;
  s.world = world;
}

void setup(bool in_init = false) {
  std::lock_guard<std::mutex> lock(g_setup_mutex);
  if (g_setup_done) return;
  int initialized = 0, finalized = 0;
  PMPI_Initialized(&initialized);
  PMPI_Finalized(&finalized);
  if (!initialized || finalized) return;  // tried again at the next call
  g_setup_done = true;
  {
    Settings& s = g_settings;
    s.min_bytes = s.config.mpi_min_bytes;  // the default, if the environment is invalid
    try {
      s.config = gradcomm::Config::from_environment();
      s.min_bytes = s.config.mpi_min_bytes;
      s.log = s.config.mpi_log;
    } catch (const std::exception& e) {
      s.error = e.what();
    }
    int level = MPI_THREAD_SINGLE;
    s.thread_multiple = PMPI_Query_thread(&level) == MPI_SUCCESS && level >= MPI_THREAD_MULTIPLE;
    if (PMPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_state, &s.keyval, nullptr) !=
        MPI_SUCCESS) {
      return;  // no per-communicator state: every call passes through (not ready)
    }
    // Freed at MPI_Finalize even where it is not called through this library (Fortran's binding
    // calls PMPI_Finalize): MPI deletes MPI_COMM_SELF's attributes first thing (MPI-3.1 8.7.1).
    int finalize_key = MPI_KEYVAL_INVALID;
    if (PMPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, at_finalize, &finalize_key, nullptr) ==
        MPI_SUCCESS) {
      PMPI_Comm_set_attr(MPI_COMM_SELF, finalize_key, nullptr);
      PMPI_Comm_free_keyval(&finalize_key);
    }
    // Checked by size: MPI_LONG is taken only where it is 64-bit, and so on.
    add_type(MPI_FLOAT, DataType::float32);
    add_type(MPI_DOUBLE, DataType::float64);
    add_type(MPI_INT, DataType::int32);
    add_type(MPI_INT32_T, DataType::int32);
    add_type(MPI_INT64_T, DataType::int64);
    add_type(MPI_LONG, DataType::int64);
    add_type(MPI_LONG, DataType::int32);
    add_type(MPI_LONG_LONG, DataType::int64);
    add_type(MPI_AINT, DataType::int64);
    // Not MPI_OFFSET: Open MPI 4.1 takes its minimum and maximum as unsigned (min(-5, 3) is 3),
    // so it passes through and results stay MPI's.
    add_type(MPI_COUNT, DataType::int64);
    add_type(MPI_REAL4, DataType::float32);
    add_type(MPI_REAL8, DataType::float64);
    add_type(MPI_INTEGER4, DataType::int32);
    add_type(MPI_INTEGER8, DataType::int64);
    if (in_init) agree_across_ranks();
  }
  g_ready.store(true, std::memory_order_release);
}

bool ready() {
  if (g_ready.load(std::memory_order_acquire)) return true;
  setup();
  return g_ready.load(std::memory_order_acquire);
}

const TypeEntry* find_type(MPI_Datatype type) {
  for (const TypeEntry& entry : g_settings.types) {
    if (entry.type == type) return &entry;
  }
  return nullptr;
}

bool find_op(MPI_Op op, ReduceOp* out) {
  if (op == MPI_SUM) {
    *out = ReduceOp::sum;
  } else if (op == MPI_PROD) {
    *out = ReduceOp::prod;
  } else if (op == MPI_MIN) {
    *out = ReduceOp::min;
  } else if (op == MPI_MAX) {
    *out = ReduceOp::max;
  } else {
    return false;
  }
  return true;
}

// --- Per-communicator state ---------------------------------------------------------------------

// gradcomm's Communicator for one user communicator, built on the first call taken on it. Building
// is collective, and must not run concurrently with the application's own collectives on the
// user's communicator (unordered across ranks). So:
// - a blocking MPI_Allreduce builds it in the caller's thread, where every rank is in the call;
// - MPI_COMM_WORLD's is built from a duplicate made in MPI_Init, and when the first call taken on
//   it is MPI_Iallreduce, on a thread of its own (that call returns before the other ranks have
//   made it); calls made meanwhile queue behind the build, in order;
// - a one-rank communicator's is built in the caller's thread (no peer to wait for);
// - on any other communicator, MPI_Iallreduce passes through until an MPI_Allreduce taken on it
//   has built it. (MPI_Comm_idup in the caller's thread would order the duplicate, but Open MPI
//   4.1 can hang when other collectives on the communicator overlap an MPI_Comm_idup.)
struct CommState {
  CommState(MPI_Comm c, bool world, bool alone) : user(c), is_world(world), single(alone) {}
  ~CommState() {
    if (builder.joinable()) builder.join();
  }

  MPI_Comm user;
  bool is_world;  // MPI_COMM_WORLD, with a duplicate from MPI_Init to build from
  bool single;    // one rank
  std::mutex mutex;
  std::condition_variable built_cv;
  std::unique_ptr<gradcomm::Communicator> comm;
  std::exception_ptr failed;  // what building threw: every later call fails with it
  bool building = false;
  // Non-blocking calls made while the builder runs; it submits them, in order, once built.
  std::vector<std::function<void(gradcomm::Communicator*, const std::exception_ptr&)>> waiting;
  std::thread builder;
};

// Markers for "an intercommunicator" and "another gradcomm's communicator" (so each communicator
// is looked at once).
char g_intercomm_marker;
char g_internal_marker;

std::mutex g_states_mutex;
std::vector<CommState*> g_states;  // in creation order, for MPI_Finalize

int delete_state(MPI_Comm, int, void* value, void*) {
  if (value == &g_intercomm_marker || value == &g_internal_marker || value == nullptr) {
    return MPI_SUCCESS;
  }
  auto* state = static_cast<CommState*>(value);
  {
    std::lock_guard<std::mutex> lock(g_states_mutex);
    g_states.erase(std::remove(g_states.begin(), g_states.end(), state), g_states.end());
  }
  delete state;  // drains its requests, then frees the duplicate
  return MPI_SUCCESS;
}

// The state of `comm`, made empty on first use. Null, with the reason, when calls on `comm` pass
// through: an intercommunicator, another gradcomm's communicator, or one MPI cannot answer for
// (MPI then reports the problem).
CommState* state_of(MPI_Comm comm, gradcomm_mpi_reason* reason) {
  void* value = nullptr;
  int found = 0;
  if (PMPI_Comm_get_attr(comm, g_settings.keyval, &value, &found) != MPI_SUCCESS) {
    *reason = GRADCOMM_MPI_INVALID;
    return nullptr;
  }
  if (found) {
    if (value == &g_intercomm_marker) *reason = GRADCOMM_MPI_INTERCOMM;
    if (value == &g_internal_marker) *reason = GRADCOMM_MPI_INTERNAL;
    return value == &g_intercomm_marker || value == &g_internal_marker
               ? nullptr
               : static_cast<CommState*>(value);
  }
  int inter = 0, size = 0, name_length = 0;
  char name[MPI_MAX_OBJECT_NAME] = {};
  if (PMPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS ||
      PMPI_Comm_get_name(comm, name, &name_length) != MPI_SUCCESS ||
      (!inter && PMPI_Comm_size(comm, &size) != MPI_SUCCESS)) {
    *reason = GRADCOMM_MPI_INVALID;
    return nullptr;
  }
  void* marker = nullptr;
  if (inter) {
    marker = &g_intercomm_marker;
    *reason = GRADCOMM_MPI_INTERCOMM;
  } else if (std::string_view(name, static_cast<std::size_t>(name_length)) ==
             gradcomm::kInternalCommName) {
    marker = &g_internal_marker;
    *reason = GRADCOMM_MPI_INTERNAL;
  }
  if (marker) {
    PMPI_Comm_set_attr(comm, g_settings.keyval, marker);  // if it fails, asked again next time
    return nullptr;
  }
  auto state = std::make_unique<CommState>(
      comm, comm == MPI_COMM_WORLD && g_settings.world != MPI_COMM_NULL, size == 1);
  if (PMPI_Comm_set_attr(comm, g_settings.keyval, state.get()) != MPI_SUCCESS) {
    *reason = GRADCOMM_MPI_INVALID;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_states_mutex);
  g_states.push_back(state.get());
  return state.release();
}

std::unique_ptr<gradcomm::Communicator> build(const CommState& state) {
  if (!g_settings.error.empty()) throw gradcomm::InvalidArgument(g_settings.error);
  return std::make_unique<gradcomm::Communicator>(state.is_world ? g_settings.world : state.user,
                                                  g_settings.config);
}

// Builds `state`'s Communicator in the calling thread if nobody has (state.mutex held); a failure
// is kept, so that every later call on the communicator fails with it rather than building again
// on some ranks only.
void build_here(CommState& state) {
  if (state.comm) return;
  if (state.failed) std::rethrow_exception(state.failed);
  try {
    state.comm = build(state);
  } catch (...) {
    state.failed = std::current_exception();
    throw;
  }
}

// The built Communicator for a blocking call, building it here if nobody has (throws what
// building threw).
gradcomm::Communicator& built(CommState& state) {
  std::unique_lock<std::mutex> lock(state.mutex);
  state.built_cv.wait(lock, [&] { return !state.building; });
  build_here(state);
  return *state.comm;
}

// Whether MPI_Iallreduce is taken on `state`'s communicator now (the same answer on every rank:
// it changes only at a blocking call taken on the communicator, or never).
bool nonblocking_ready(CommState& state) {
  if (state.is_world || state.single) return true;
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.comm != nullptr || state.failed != nullptr;
}

// --- MPI_Iallreduce on gradcomm's progress engine ---------------------------------------------

struct CallArgs {
  const void* send;
  void* recv;
  std::size_t count;
  DataType dtype;
  ReduceOp op;
};

// Submits the all-reduce and, behind it on the same progress engine, the completion of `call`.
void launch(gradcomm::Communicator& comm, const CallArgs& a, PendingCall* call) {
  auto request = std::make_shared<gradcomm::Request>(
      gradcomm::iallreduce(comm, a.send, a.recv, a.count, a.dtype, a.op));
  auto finish = std::make_shared<gradcomm::detail::RequestState>();
  finish->call = "MPI_Iallreduce completion";
  finish->work = [request, call] {
    std::exception_ptr error;
    try {
      request->wait();  // already finished: the engine runs its queue in order
    } catch (...) {
      error = std::current_exception();
    }
    call->complete(error);
  };
  comm.engine().submit(std::move(finish));
}

// MPI_COMM_WORLD's builder: builds from the duplicate made in MPI_Init, then submits the calls
// that queued meanwhile, in order, without holding the lock (calls made while it submits queue
// behind them).
void run_builder(CommState& state) {
  std::unique_ptr<gradcomm::Communicator> comm;
  std::exception_ptr error;
  try {
    comm = build(state);
  } catch (...) {
    error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(state.mutex);
  state.comm = std::move(comm);
  state.failed = error;
  gradcomm::Communicator* built_comm = state.comm.get();
  while (!state.waiting.empty()) {
    auto batch = std::move(state.waiting);
    state.waiting.clear();
    lock.unlock();
    for (auto& submit : batch)
      submit(built_comm, error);
    lock.lock();
  }
  state.building = false;
  state.built_cv.notify_all();
}

int start_nonblocking(CommState& state, const CallArgs& a, MPI_Comm user, MPI_Request* request) {
  PendingCall* call = nullptr;
  try {
    call = PendingCall::start();
  } catch (...) {
    return raise(user, "MPI_Iallreduce", std::current_exception());
  }
  std::unique_lock<std::mutex> lock(state.mutex);
  if (!state.building && (state.comm || state.failed || state.single)) {
    try {
      build_here(state);  // a one-rank communicator: nobody to wait for
      launch(*state.comm, a, call);
    } catch (...) {  // rejected on this rank before anything was submitted
      lock.unlock();
      const std::exception_ptr error = std::current_exception();
      call->discard();
      return raise(user, "MPI_Iallreduce", error);
    }
    *request = call->request();
    return MPI_SUCCESS;
  }
  // MPI_COMM_WORLD, being built (or about to be): the call queues behind the build.
  *request = call->request();
  state.waiting.push_back([a, call](gradcomm::Communicator* comm, const std::exception_ptr& error) {
    if (!comm) return call->complete(error);
    try {
      launch(*comm, a, call);
    } catch (...) {
      call->complete(std::current_exception());
    }
  });
  if (!state.building) {
    state.building = true;
    if (state.builder.joinable()) state.builder.join();  // finished: building was false
    try {
      state.builder = std::thread(run_builder, std::ref(state));
    } catch (...) {  // no thread: the communicator cannot be built; its calls end with that
      state.failed = std::current_exception();
      state.building = false;
      for (auto& submit : state.waiting)
        submit(nullptr, state.failed);
      state.waiting.clear();
      state.built_cv.notify_all();
    }
  }
  return MPI_SUCCESS;
}

// --- The decision ---------------------------------------------------------------------------

// Whether gradcomm takes the call; if not, counts why. Fills dtype/op/bytes when it does.
bool take(int count, MPI_Datatype datatype, MPI_Op op, MPI_Comm comm, bool nonblocking,
          CallArgs* args, CommState** state) {
  if (!ready()) {
    count_passed(GRADCOMM_MPI_NOT_READY, 0);
    return false;
  }
  if (count < 0 || comm == MPI_COMM_NULL || datatype == MPI_DATATYPE_NULL || op == MPI_OP_NULL) {
    count_passed(GRADCOMM_MPI_INVALID, 0);
    return false;
  }
  const TypeEntry* type = find_type(datatype);
  if (!type) {
    int size = 0;
    PMPI_Type_size(datatype, &size);
    count_passed(GRADCOMM_MPI_DATATYPE,
                 size > 0 ? static_cast<std::size_t>(size) * static_cast<std::size_t>(count) : 0);
    return false;
  }
  const std::size_t bytes = static_cast<std::size_t>(count) * gradcomm::element_size(type->dtype);
  if (bytes < g_settings.min_bytes) {
    count_passed(GRADCOMM_MPI_BELOW_THRESHOLD, bytes);
    return false;
  }
  ReduceOp reduce_op{};
  if (!find_op(op, &reduce_op)) {
    count_passed(GRADCOMM_MPI_OP, bytes);
    return false;
  }
  if (nonblocking && !g_settings.thread_multiple) {
    count_passed(GRADCOMM_MPI_THREAD_LEVEL, bytes);
    return false;
  }
  gradcomm_mpi_reason reason = GRADCOMM_MPI_INVALID;
  *state = state_of(comm, &reason);
  if (!*state) {
    count_passed(reason, bytes);
    return false;
  }
  if (nonblocking && !nonblocking_ready(**state)) {
    count_passed(GRADCOMM_MPI_NOT_SET_UP, bytes);
    return false;
  }
  args->count = static_cast<std::size_t>(count);
  args->dtype = type->dtype;
  args->op = reduce_op;
  count_taken(bytes, nonblocking);
  return true;
}

void print_log() {
  int rank = 0;
  PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const Counters& c = g_counters;
  std::string reasons;
  for (int r = 0; r < GRADCOMM_MPI_REASONS; ++r) {
    const unsigned long long n = c.passed_by_reason[r].load();
    if (n == 0) continue;
    if (!reasons.empty()) reasons.append(", ");
    reasons.append(std::to_string(n)).append(" ").append(reason_name(r));
  }
  std::fprintf(stderr,
               "[gradcomm-mpi rank %d] took %llu calls (%llu non-blocking), %llu bytes; passed "
               "%llu calls, %llu bytes to MPI%s%s (GRADCOMM_MPI_MIN_BYTES=%zu)\n",
               rank, c.taken_calls.load(), c.taken_nonblocking.load(), c.taken_bytes.load(),
               c.passed_calls.load(), c.passed_bytes.load(), reasons.empty() ? "" : ": ",
               reasons.c_str(), g_settings.min_bytes);
  std::fflush(stderr);
}

// After PMPI_Init*: read the settings; an invalid GRADCOMM_* variable ends the job here, naming it.
void after_init() {
  setup(true);
  if (!g_settings.error.empty()) abort_with(MPI_COMM_WORLD, 1, g_settings.error);
}

// Frees every communicator's state, newest first (each delete drains the communicator's
// requests), prints the log, and stops taking calls. From MPI_Finalize, or from MPI_COMM_SELF's
// attribute when MPI_Finalize did not come through this library; once.
void shut_down() {
  if (!g_ready.exchange(false)) return;
  for (;;) {
    CommState* state = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_states_mutex);
      if (g_states.empty()) break;
      state = g_states.back();
    }
    MPI_Comm user = state->user;
    if (PMPI_Comm_delete_attr(user, g_settings.keyval) != MPI_SUCCESS) {
      void* value = nullptr;
      int found = 0;
      if (PMPI_Comm_get_attr(user, g_settings.keyval, &value, &found) == MPI_SUCCESS && found) {
        // Still attached: MPI deletes it with the communicator. Only forget it here.
        std::lock_guard<std::mutex> lock(g_states_mutex);
        g_states.erase(std::remove(g_states.begin(), g_states.end(), state), g_states.end());
      } else {
        delete_state(user, g_settings.keyval, state, nullptr);  // the attribute was gone
      }
    }
  }
  if (g_settings.log) print_log();
  if (g_settings.world != MPI_COMM_NULL) PMPI_Comm_free(&g_settings.world);
  PMPI_Comm_free_keyval(&g_settings.keyval);
}

int at_finalize(MPI_Comm, int, void*, void*) {
  shut_down();
  return MPI_SUCCESS;
}

}  // namespace

extern "C" {

int MPI_Init(int* argc, char*** argv) {
  const int rc = PMPI_Init(argc, argv);
  if (rc == MPI_SUCCESS) after_init();
  return rc;
}

// The thread level is the application's: the library asks for nothing more (MPI_THREAD_MULTIPLE
// costs Open MPI's small calls ~0.1 us each), and provided is what MPI gave.
int MPI_Init_thread(int* argc, char*** argv, int required, int* provided) {
  const int rc = PMPI_Init_thread(argc, argv, required, provided);
  if (rc == MPI_SUCCESS) after_init();
  return rc;
}

int MPI_Finalize(void) {
  shut_down();
  return PMPI_Finalize();
}

int MPI_Allreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype, MPI_Op op,
                  MPI_Comm comm) {
  CallArgs args{};
  CommState* state = nullptr;
  if (!take(count, datatype, op, comm, false, &args, &state)) {
    return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
  }
  args.send = sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf;
  args.recv = recvbuf;
  try {
    gradcomm::Communicator& c = built(*state);
    gradcomm::allreduce(c, args.send, args.recv, args.count, args.dtype, args.op);
  } catch (...) {
    return raise(comm, "MPI_Allreduce", std::current_exception());
  }
  return MPI_SUCCESS;
}

int MPI_Iallreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype, MPI_Op op,
                   MPI_Comm comm, MPI_Request* request) {
  // Open MPI 4.1 does not check this one (it writes through the pointer): an error here instead.
  if (request == nullptr && comm != MPI_COMM_NULL && ready()) {
    return raise(comm, "MPI_Iallreduce",
                 std::make_exception_ptr(gradcomm::InvalidArgument("request is a null pointer")));
  }
  CallArgs args{};
  CommState* state = nullptr;
  if (!take(count, datatype, op, comm, true, &args, &state)) {
    return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
  }
  args.send = sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf;
  args.recv = recvbuf;
  // Null buffers are found here, at the call, even when the call would queue behind
  // MPI_COMM_WORLD's build (gradcomm's own checks run when it is submitted).
  if (args.count > 0 && (args.send == nullptr || args.recv == nullptr)) {
    const std::string which = args.send == nullptr ? "sendbuf" : "recvbuf";
    return raise(comm, "MPI_Iallreduce",
                 std::make_exception_ptr(gradcomm::InvalidArgument(which + " is null with count " +
                                                                   std::to_string(args.count))));
  }
  return start_nonblocking(*state, args, comm, request);
}

int MPI_Request_free(MPI_Request* request) {
  if (request && PendingCall::free_if_pending(*request)) {
    *request = MPI_REQUEST_NULL;
    return MPI_SUCCESS;
  }
  return PMPI_Request_free(request);
}

int gradcomm_mpi_get_stats(gradcomm_mpi_stats* stats) {
  if (!stats) return -1;
  const Counters& c = g_counters;
  stats->taken_calls = c.taken_calls.load();
  stats->taken_nonblocking_calls = c.taken_nonblocking.load();
  stats->taken_bytes = c.taken_bytes.load();
  stats->passed_calls = c.passed_calls.load();
  stats->passed_bytes = c.passed_bytes.load();
  for (int r = 0; r < GRADCOMM_MPI_REASONS; ++r)
    stats->passed_by_reason[r] = c.passed_by_reason[r].load();
  stats->min_bytes = g_settings.min_bytes;
  return 0;
}

const char* gradcomm_mpi_reason_name(int reason) {
  return reason_name(reason);
}

int gradcomm_mpi_error_strings(void) {
  return gradcomm::mpi_preload::codes_carry_strings() ? 1 : 0;
}

// gradcomm's own calls (see the top of the file): straight to MPI.
int __wrap_MPI_Allreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype,
                         MPI_Op op, MPI_Comm comm) {
  return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
}
int __wrap_MPI_Iallreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype,
                          MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
}
int __wrap_MPI_Init(int* argc, char*** argv) {
  return PMPI_Init(argc, argv);
}
int __wrap_MPI_Init_thread(int* argc, char*** argv, int required, int* provided) {
  return PMPI_Init_thread(argc, argv, required, provided);
}
int __wrap_MPI_Finalize(void) {
  return PMPI_Finalize();
}
int __wrap_MPI_Request_free(MPI_Request* request) {
  return PMPI_Request_free(request);
}

}  // extern "C"
