#include "bindings/mpi/errors.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/error.h"

namespace gradcomm::mpi_preload {
namespace {

std::mutex g_error_mutex;

// Adds a code to MPI_ERR_OTHER with a probe string and reads both back (g_error_mutex held).
bool probe_codes_carry_strings() {
  constexpr const char* kProbe = "gradcomm: error string probe";
  int code = MPI_ERR_OTHER;
  if (PMPI_Add_error_code(MPI_ERR_OTHER, &code) != MPI_SUCCESS) return false;
  if (PMPI_Add_error_string(code, kProbe) != MPI_SUCCESS) return false;
  char text[MPI_MAX_ERROR_STRING] = "";
  int length = 0, error_class = -1;
  if (PMPI_Error_string(code, text, &length) != MPI_SUCCESS) return false;
  if (PMPI_Error_class(code, &error_class) != MPI_SUCCESS) return false;
  return error_class == MPI_ERR_OTHER && std::strcmp(text, kProbe) == 0;
}

bool carry_strings_locked() {
  static const bool carry = probe_codes_carry_strings();
  return carry;
}

// An MPI error code of `error_class` whose MPI_Error_string is `message`. Each message gets a code
// of its own (MPI_Add_error_code), so a code the application keeps still says what went wrong;
// past kCodesPerClass messages of one class, the least recently used code of the class takes
// the new message. The class itself where MPI cannot add codes, or where its added codes lose
// their strings (then the message goes to standard error, once).
int error_code(int error_class, const std::string& message) {
  constexpr std::size_t kCodesPerClass = 16;
  struct Code {
    int error_class;
    int code;
    std::string text;
    unsigned long long used;
  };
  static std::vector<Code> codes;
  static std::set<std::string> printed;
  static unsigned long long clock = 0;
  const std::string text = message.substr(0, MPI_MAX_ERROR_STRING - 1);
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (!carry_strings_locked()) {
    if (printed.size() < 1000 && printed.insert(message).second) {
      std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(stderr);
    }
    return error_class;
  }
  ++clock;
  Code* oldest = nullptr;
  std::size_t of_class = 0;
  for (Code& c : codes) {
    if (c.error_class != error_class) continue;
    if (c.text == text) {
      c.used = clock;
      return c.code;
    }
    ++of_class;
    if (!oldest || c.used < oldest->used) oldest = &c;
  }
  if (of_class < kCodesPerClass) {
    int code = error_class;
    if (PMPI_Add_error_code(error_class, &code) != MPI_SUCCESS) return error_class;
    codes.push_back({error_class, code, std::string(), 0});
    oldest = &codes.back();
  }
  if (PMPI_Add_error_string(oldest->code, text.c_str()) != MPI_SUCCESS) return error_class;
  oldest->text = text;
  oldest->used = clock;
  return oldest->code;
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

}  // namespace

bool codes_carry_strings() {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  return carry_strings_locked();
}

int code_of(const char* call, const std::exception_ptr& error, int* error_class,
            std::string* message) {
  std::string detail;
  *error_class = error_class_of(error, &detail);
  *message = std::string(call) + " (gradcomm): " + detail;
  return error_code(*error_class, *message);
}

[[noreturn]] void abort_with(MPI_Comm comm, int error_class, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // MPICH's launcher (Hydra) can end the job on the abort before it has forwarded what the rank
  // wrote: then nobody sees why (1 launch in 15-30 here). A moment's pause lets it read the pipe.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  PMPI_Abort(comm, error_class);
  std::abort();  // PMPI_Abort does not return
}

int raise(MPI_Comm comm, const char* call, const std::exception_ptr& error) {
  int error_class = MPI_ERR_OTHER;
  std::string message;
  const int code = code_of(call, error, &error_class, &message);
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  PMPI_Comm_get_errhandler(comm, &handler);
  if (handler == MPI_ERRORS_ARE_FATAL) {
    abort_with(comm, error_class, message);
  } else if (handler != MPI_ERRORS_RETURN && handler != MPI_ERRHANDLER_NULL) {
    PMPI_Comm_call_errhandler(comm, code);
  }
  if (handler != MPI_ERRHANDLER_NULL) PMPI_Errhandler_free(&handler);
  return code;
}

}  // namespace gradcomm::mpi_preload
