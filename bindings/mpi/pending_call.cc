#include "bindings/mpi/pending_call.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "bindings/mpi/errors.h"
#include "core/error.h"

namespace gradcomm::mpi_preload {
namespace {

// The calls in flight by handle, and whether the application has freed each one's request.
std::mutex g_pending_mutex;
std::unordered_map<MPI_Request, bool>& pending() {
  static std::unordered_map<MPI_Request, bool> calls;
  return calls;
}

}  // namespace

PendingCall* PendingCall::start() {
  auto* call = new PendingCall;
  const int rc = PMPI_Grequest_start(query, free, cancel, call, &call->request_);
  if (rc != MPI_SUCCESS) {
    delete call;
    throw gradcomm::Error(gradcomm::ErrorCode::internal,
                          "MPI_Grequest_start failed (MPI error " + std::to_string(rc) + ")");
  }
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  pending()[call->request_] = false;
  return call;
}

void PendingCall::complete(const std::exception_ptr& error) {
  if (error) {
    int error_class = MPI_ERR_OTHER;
    std::string message;
    code_ = code_of("MPI_Iallreduce", error, &error_class, &message);
  }
  MPI_Request handle = request_;
  bool freed = false;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    auto it = pending().find(handle);
    if (it != pending().end()) {
      freed = it->second;
      pending().erase(it);
    }
  }
  PMPI_Grequest_complete(handle);
  if (freed) PMPI_Request_free(&handle);  // deletes this call (free)
}

void PendingCall::discard() {
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    pending().erase(request_);
  }
  // A copy of the handle: freeing the request deletes this call, and MPI then writes
  // MPI_REQUEST_NULL through the pointer it was given.
  MPI_Request handle = request_;
  PMPI_Grequest_complete(handle);
  PMPI_Request_free(&handle);
}

bool PendingCall::free_if_pending(MPI_Request request) {
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  auto it = pending().find(request);
  if (it == pending().end()) return false;
  it->second = true;
  return true;
}

int PendingCall::query(void* extra, MPI_Status* status) {
  const auto* call = static_cast<PendingCall*>(extra);
  PMPI_Status_set_elements(status, MPI_BYTE, 0);
  PMPI_Status_set_cancelled(status, 0);
  status->MPI_SOURCE = MPI_UNDEFINED;
  status->MPI_TAG = MPI_UNDEFINED;
  status->MPI_ERROR = call->code_;
  return call->code_;
}

int PendingCall::free(void* extra) {
  delete static_cast<PendingCall*>(extra);
  return MPI_SUCCESS;
}

int PendingCall::cancel(void*, int) {
  return MPI_SUCCESS;  // a collective cannot be cancelled (MPI-3.1 5.12): it runs to the end
}

}  // namespace gradcomm::mpi_preload
