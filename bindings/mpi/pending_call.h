#pragma once
// A taken MPI_Iallreduce as MPI sees it: a generalized request (MPI_Grequest_start) that
// gradcomm's progress engine completes.

#include <mpi.h>

#include <exception>

namespace gradcomm::mpi_preload {

class PendingCall {
 public:
  // Starts the generalized request; throws gradcomm::Error where MPI cannot.
  static PendingCall* start();

  // The handle the application holds.
  MPI_Request request() const { return request_; }

  // Ends the call with `error` (null: success). Runs on gradcomm's threads, so it only records
  // the error's code: MPI_Wait (or MPI_Test, ...) returns it and raises it through the error
  // handler MPI uses for the request, in the application's thread. MPI may free the call as
  // soon as it is complete, so nothing may touch it afterwards.
  void complete(const std::exception_ptr& error);

  // The call was rejected before anything was submitted: completes and frees the request, which
  // the application never sees.
  void discard();

  // MPI_Request_free of a call still in flight: the request is freed once it completes, as
  // MPI-4.0 section 4.3 (Request_free) asks. MPICH 4.0 invalidates a generalized request's
  // handle at once, so its later MPI_Grequest_complete would abort. False where `request` is no
  // call of this library's still in flight (then the caller frees it through PMPI).
  static bool free_if_pending(MPI_Request request);

 private:
  PendingCall() = default;
  static int query(void* extra, MPI_Status* status);
  static int free(void* extra);
  static int cancel(void* extra, int complete);

  MPI_Request request_ = MPI_REQUEST_NULL;
  int code_ = MPI_SUCCESS;
};

}  // namespace gradcomm::mpi_preload
