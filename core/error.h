#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace gradcomm {

// What went wrong, as a code the C ABI can return unchanged.
enum class ErrorCode : int {
  invalid_argument = 1,  // bad input caught before any communication
  unsupported = 2,       // valid input an algorithm or build cannot handle
  comm_error = 3,        // MPI (or another transport) reported a failure
  internal = 4,          // a bug in gradcomm
  mismatch = 5,          // the ranks disagree on a collective call (order, count, dtype, ...)
};

std::string_view error_code_name(ErrorCode code);

// The one exception type of gradcomm. what() names the call, the rank and the problem:
// "allreduce(ring): rank 3: count 18446744073709551615 x 4 bytes overflows size_t".
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& message)
      : Error(ErrorCode::invalid_argument, message) {}
};

class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& message) : Error(ErrorCode::unsupported, message) {}
};

class CommError : public Error {
 public:
  explicit CommError(const std::string& message) : Error(ErrorCode::comm_error, message) {}
};

// Thrown on every rank when the consistency check finds that ranks made different calls. The
// communicator stays usable: the abandoned call's messages can never match a later call.
class MismatchError : public Error {
 public:
  explicit MismatchError(const std::string& message) : Error(ErrorCode::mismatch, message) {}
};

// Builds the message every gradcomm error carries: "<call>: rank <rank>: <detail>".
// A negative rank (unknown, e.g. before MPI is initialized) is left out.
std::string error_message(std::string_view call, int rank, std::string_view detail);

// Throws CommError naming `call` and MPI's own explanation when `rc` is not MPI_SUCCESS.
void check_mpi(int rc, std::string_view call, int rank = -1);

}  // namespace gradcomm
