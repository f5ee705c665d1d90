#pragma once
// libgradcomm_mpi.so's errors: gradcomm's exceptions as MPI error codes whose MPI_Error_string
// is gradcomm's message, raised through the communicator's error handler.

#include <mpi.h>

#include <exception>
#include <string>

namespace gradcomm::mpi_preload {

// The MPI error code for `error` in `call`; sets its predefined class and gradcomm's message.
int code_of(const char* call, const std::exception_ptr& error, int* error_class,
            std::string* message);

// Prints `message` on stderr and aborts the job through PMPI_Abort(comm, error_class), after a
// pause that lets the launcher forward the message.
[[noreturn]] void abort_with(MPI_Comm comm, int error_class, const std::string& message);

// Hands a failed call to `comm`'s error handler, in the calling thread: MPI_ERRORS_ARE_FATAL
// prints gradcomm's message and aborts; MPI_ERRORS_RETURN returns the code (MPI_Error_string
// gives the message); a user handler is called with it. Returns the code.
int raise(MPI_Comm comm, const char* call, const std::exception_ptr& error);

// Whether this MPI gives a code added to a predefined class (MPI_Add_error_code) the string
// added for it. MPICH 4.0 does not: such codes lack its dynamic-code bit and read as one of
// MPICH's own messages. There a failed call returns the predefined class itself and gradcomm's
// message goes to standard error, once per message. Probed once, after MPI_Init.
bool codes_carry_strings();

}  // namespace gradcomm::mpi_preload
