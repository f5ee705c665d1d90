#pragma once

// Byte-level point-to-point helpers shared by the algorithms. MPI counts are int: messages larger
// than kMaxMessageBytes are split into pieces, identically on both sides.

#include <mpi.h>

#include <cstddef>
#include <string_view>

namespace gradcomm::collectives {

inline constexpr std::size_t kMaxMessageBytes = std::size_t{1} << 30;

// Tags, one per algorithm, so a trace shows which algorithm a message belongs to.
enum Tag : int { kTagFlat = 101, kTagRing = 102, kTagHalvingDoubling = 103 };

// Non-blocking send/receive of at most kMaxMessageBytes. `call` names the caller in errors.
MPI_Request isend_bytes(const void* buf, std::size_t bytes, int dest, int tag, MPI_Comm comm,
                        std::string_view call);
MPI_Request irecv_bytes(void* buf, std::size_t bytes, int source, int tag, MPI_Comm comm,
                        std::string_view call);
void wait(MPI_Request& request, std::string_view call);
void wait_all(std::size_t n, MPI_Request* requests, std::string_view call);

// Blocking exchange of any size (split into pieces when large).
void send_recv_bytes(const void* send, std::size_t send_bytes, int dest, void* recv,
                     std::size_t recv_bytes, int source, int tag, MPI_Comm comm,
                     std::string_view call);
void send_bytes(const void* buf, std::size_t bytes, int dest, int tag, MPI_Comm comm,
                std::string_view call);
void recv_bytes(void* buf, std::size_t bytes, int source, int tag, MPI_Comm comm,
                std::string_view call);

}  // namespace gradcomm::collectives
