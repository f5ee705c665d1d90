// libgradcomm_mpi.so: MPI_Allreduce and MPI_Iallreduce through gradcomm, under an unmodified MPI
// program (docs/mpi-preload.md).
//
// The library defines MPI_Allreduce, MPI_Iallreduce, MPI_Init, MPI_Init_thread and
// MPI_Finalize. A call it takes runs on gradcomm's Communicator for the user's communicator (a
// private duplicate, so tags never meet the application's), made on first use and cached on the
// communicator with an attribute whose delete callback frees it (when the user frees the
// communicator, or at MPI_Finalize). A call it does not take goes to PMPI_* unchanged.
//
// gradcomm's own MPI calls must reach MPI, never these definitions: the library is linked with
// -Wl,--wrap for each name defined here, which turns the references in gradcomm's objects into
// references to the __wrap_* functions at the end of this file (they call PMPI_*). Definitions
// are not renamed, so the application still finds MPI_Allreduce here.

#include "bindings/mpi/gradcomm_mpi.h"

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
#include <thread>
#include <vector>

#include "collectives/allreduce.h"
#include "core/communicator.h"
#include "core/config.h"
#include "core/error.h"
#include "core/progress_engine.h"

namespace {

using gradcomm::DataType;
using gradcomm::ReduceOp;

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
  std::size_t min_bytes = 0;  // config.mpi_min_bytes (GRADCOMM_MPI_MIN_BYTES)
  bool log = false;           // config.mpi_log (GRADCOMM_MPI_LOG)
  bool thread_multiple = false;
  int keyval = MPI_KEYVAL_INVALID;
  std::vector<TypeEntry> types;
  std::string error;  // a GRADCOMM_* variable that is invalid: every taken call fails with it
};

Settings g_settings;
std::atomic<bool> g_ready{false};  // settings read, MPI initialized and not finalizing
std::mutex g_setup_mutex;
bool g_setup_done = false;  // guarded by g_setup_mutex; once per process (not again after finalize)

int delete_state(MPI_Comm, int, void* value, void*);

void add_type(MPI_Datatype type, DataType dtype) {
  if (type == MPI_DATATYPE_NULL) return;  // an optional type this MPI does not have
  int size = 0;
  if (PMPI_Type_size(type, &size) != MPI_SUCCESS) return;
  if (static_cast<std::size_t>(size) != gradcomm::element_size(dtype)) return;
  g_settings.types.push_back({type, dtype});
}

void setup() {
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
    PMPI_Query_thread(&level);
    s.thread_multiple = level >= MPI_THREAD_MULTIPLE;
    PMPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_state, &s.keyval, nullptr);
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

// --- Errors: the communicator's error handler decides ------------------------------------------

std::mutex g_error_mutex;

// An MPI error code of `error_class` whose MPI_Error_string is `message` (a code per class, its
// string replaced by the latest message); the class itself where MPI cannot add codes.
int error_code(int error_class, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  static int codes[4] = {-1, -1, -1, -1};
  const int classes[4] = {MPI_ERR_ARG, MPI_ERR_UNSUPPORTED_OPERATION, MPI_ERR_OTHER,
                          MPI_ERR_INTERN};
  int slot = 0;
  while (slot < 3 && classes[slot] != error_class)
    ++slot;
  if (codes[slot] < 0 && PMPI_Add_error_code(error_class, &codes[slot]) != MPI_SUCCESS) {
    codes[slot] = error_class;
  }
  if (codes[slot] != error_class) {
    std::string text = message.substr(0, MPI_MAX_ERROR_STRING - 1);
    PMPI_Add_error_string(codes[slot], text.data());
  }
  return codes[slot];
}

int error_class_of(const std::exception_ptr& error, std::string* message) {
  try {
    std::rethrow_exception(error);
  } catch (const gradcomm::Error& e) {
    *message = e.what();
    switch (e.code()) {
      case gradcomm::ErrorCode::invalid_argument:
        return MPI_ERR_ARG;
      case gradcomm::ErrorCode::unsupported:
        return MPI_ERR_UNSUPPORTED_OPERATION;
      case gradcomm::ErrorCode::internal:
        return MPI_ERR_INTERN;
      default:
        return MPI_ERR_OTHER;
    }
  } catch (const std::exception& e) {
    *message = e.what();
  } catch (...) {
    *message = "an unknown exception";
  }
  return MPI_ERR_INTERN;
}

// Hands a failed call to `comm`'s error handler: MPI_ERRORS_ARE_FATAL prints gradcomm's message
// and aborts; MPI_ERRORS_RETURN returns the code (MPI_Error_string gives the message); a user
// handler is called with it. Returns the code.
int raise(MPI_Comm comm, const char* call, const std::exception_ptr& error) {
  std::string detail;
  const int error_class = error_class_of(error, &detail);
  const std::string message = std::string(call) + " (gradcomm): " + detail;
  const int code = error_code(error_class, message);
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  PMPI_Comm_get_errhandler(comm, &handler);
  if (handler == MPI_ERRORS_ARE_FATAL) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    PMPI_Abort(comm, error_class);
  } else if (handler != MPI_ERRORS_RETURN && handler != MPI_ERRHANDLER_NULL) {
    PMPI_Comm_call_errhandler(comm, code);
  }
  if (handler != MPI_ERRHANDLER_NULL) PMPI_Errhandler_free(&handler);
  return code;
}

// --- Per-communicator state ---------------------------------------------------------------------

// gradcomm's Communicator for one user communicator. Built on the first call taken on it: by a
// blocking call in the caller's thread (every rank is in that call), by a non-blocking one on a
// thread of its own, since MPI_Iallreduce must return before the other ranks have called it.
struct CommState {
  explicit CommState(MPI_Comm c) : user(c) {}
  ~CommState() {
    if (builder.joinable()) builder.join();
  }

  MPI_Comm user;
  std::mutex mutex;
  std::condition_variable built_cv;
  std::unique_ptr<gradcomm::Communicator> comm;
  bool building = false;
  // Non-blocking calls made while the builder runs; it submits them, in order, once built.
  std::vector<std::function<void(gradcomm::Communicator*, const std::exception_ptr&)>> waiting;
  std::thread builder;
};

// A marker for "an intercommunicator" (so MPI_Comm_test_inter runs once per communicator).
char g_intercomm_marker;

std::mutex g_states_mutex;
std::vector<CommState*> g_states;  // in creation order, for MPI_Finalize

int delete_state(MPI_Comm, int, void* value, void*) {
  if (value == &g_intercomm_marker || value == nullptr) return MPI_SUCCESS;
  auto* state = static_cast<CommState*>(value);
  {
    std::lock_guard<std::mutex> lock(g_states_mutex);
    g_states.erase(std::remove(g_states.begin(), g_states.end(), state), g_states.end());
  }
  delete state;  // drains its requests, then frees the duplicate
  return MPI_SUCCESS;
}

// The state of `comm`, made empty on first use; null for an intercommunicator.
CommState* state_of(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  PMPI_Comm_get_attr(comm, g_settings.keyval, &value, &found);
  if (found) return value == &g_intercomm_marker ? nullptr : static_cast<CommState*>(value);
  int inter = 0;
  PMPI_Comm_test_inter(comm, &inter);
  if (inter) {
    PMPI_Comm_set_attr(comm, g_settings.keyval, &g_intercomm_marker);
    return nullptr;
  }
  auto* state = new CommState(comm);
  PMPI_Comm_set_attr(comm, g_settings.keyval, state);
  std::lock_guard<std::mutex> lock(g_states_mutex);
  g_states.push_back(state);
  return state;
}

std::unique_ptr<gradcomm::Communicator> build(MPI_Comm comm) {
  if (!g_settings.error.empty()) throw gradcomm::InvalidArgument(g_settings.error);
  return std::make_unique<gradcomm::Communicator>(comm, g_settings.config);
}

// The built Communicator, building it here if nobody has (throws what building threw).
gradcomm::Communicator& built(CommState& state) {
  std::unique_lock<std::mutex> lock(state.mutex);
  state.built_cv.wait(lock, [&] { return !state.building; });
  if (!state.comm) state.comm = build(state.user);
  return *state.comm;
}

// --- MPI_Iallreduce as a generalized request ----------------------------------------------------

struct PendingCall {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Comm user = MPI_COMM_NULL;
  int code = MPI_SUCCESS;
};

int query_call(void* extra, MPI_Status* status) {
  const auto* call = static_cast<PendingCall*>(extra);
  PMPI_Status_set_elements(status, MPI_BYTE, 0);
  PMPI_Status_set_cancelled(status, 0);
  status->MPI_SOURCE = MPI_UNDEFINED;
  status->MPI_TAG = MPI_UNDEFINED;
  status->MPI_ERROR = call->code;
  return call->code;
}

int free_call(void* extra) {
  delete static_cast<PendingCall*>(extra);
  return MPI_SUCCESS;
}

int cancel_call(void*, int) {
  return MPI_SUCCESS;  // a collective cannot be cancelled (MPI-3.1 5.12): it runs to the end
}

// Ends `call` with `error` (null: success): MPI_Wait then returns, and the user's error handler
// (if it is not MPI_ERRORS_RETURN) has seen the error. Nothing touches `call` afterwards: MPI
// may free it as soon as it is complete.
void complete(PendingCall* call, const std::exception_ptr& error) {
  if (error) call->code = raise(call->user, "MPI_Iallreduce", error);
  PMPI_Grequest_complete(call->request);
}

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
    complete(call, error);
  };
  comm.engine().submit(std::move(finish));
}

int start_nonblocking(CommState& state, const CallArgs& a, MPI_Comm user, MPI_Request* request) {
  auto* call = new PendingCall;
  call->user = user;
  const int rc = PMPI_Grequest_start(query_call, free_call, cancel_call, call, &call->request);
  if (rc != MPI_SUCCESS) {
    delete call;
    return rc;
  }
  *request = call->request;
  std::unique_lock<std::mutex> lock(state.mutex);
  if (state.comm && !state.building) {
    try {
      launch(*state.comm, a, call);
    } catch (...) {  // rejected on this rank before anything was submitted
      lock.unlock();
      const std::exception_ptr error = std::current_exception();
      PMPI_Grequest_complete(call->request);
      PMPI_Request_free(request);
      return raise(user, "MPI_Iallreduce", error);
    }
    return MPI_SUCCESS;
  }
  state.waiting.push_back([a, call](gradcomm::Communicator* comm, const std::exception_ptr& error) {
    if (!comm) return complete(call, error);
    try {
      launch(*comm, a, call);
    } catch (...) {
      complete(call, std::current_exception());
    }
  });
  if (!state.building) {
    state.building = true;
    if (state.builder.joinable()) state.builder.join();
    state.builder = std::thread([&state] {
      std::unique_ptr<gradcomm::Communicator> comm;
      std::exception_ptr error;
      try {
        comm = build(state.user);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> guard(state.mutex);
      state.comm = std::move(comm);
      for (auto& submit : state.waiting)
        submit(state.comm.get(), error);
      state.waiting.clear();
      state.building = false;
      state.built_cv.notify_all();
    });
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
  *state = state_of(comm);
  if (!*state) {
    count_passed(GRADCOMM_MPI_INTERCOMM, bytes);
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
  setup();
  if (!g_settings.error.empty()) {
    std::fprintf(stderr, "%s\n", g_settings.error.c_str());
    std::fflush(stderr);
    PMPI_Abort(MPI_COMM_WORLD, 1);
  }
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
  if (g_ready.exchange(false)) {
    // Newest first; each delete runs delete_state, which drains the communicator's requests.
    for (;;) {
      CommState* state = nullptr;
      {
        std::lock_guard<std::mutex> lock(g_states_mutex);
        if (g_states.empty()) break;
        state = g_states.back();
      }
      MPI_Comm user = state->user;
      if (PMPI_Comm_delete_attr(user, g_settings.keyval) != MPI_SUCCESS) {
        delete_state(user, g_settings.keyval, state, nullptr);  // the attribute was gone
      }
    }
    if (g_settings.log) print_log();
    PMPI_Comm_free_keyval(&g_settings.keyval);
  }
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
  CallArgs args{};
  CommState* state = nullptr;
  if (!take(count, datatype, op, comm, true, &args, &state)) {
    return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
  }
  args.send = sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf;
  args.recv = recvbuf;
  return start_nonblocking(*state, args, comm, request);
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

}  // extern "C"
