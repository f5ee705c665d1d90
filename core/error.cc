#include "core/error.h"

#include <mpi.h>

namespace gradcomm {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid argument";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::comm_error:
      return "communication error";
    case ErrorCode::internal:
      return "internal error";
    case ErrorCode::mismatch:
      return "collective mismatch";
  }
  return "unknown error";
}

std::string error_message(std::string_view call, int rank, std::string_view detail) {
  std::string message(call);
  if (rank >= 0) message += ": rank " + std::to_string(rank);
  message += ": ";
  message += detail;
  return message;
}

void check_mpi(int rc, std::string_view call, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  std::string detail = "failed with MPI error " + std::to_string(rc);
  if (length > 0) detail += " (" + std::string(text, static_cast<size_t>(length)) + ")";
  throw CommError(error_message(call, rank, detail));
}

}  // namespace gradcomm
