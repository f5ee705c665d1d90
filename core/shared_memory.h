#pragma once

// Shared memory between the ranks of one node: POSIX segments mapped by every rank, and the
// registered buffers users allocate in them (Communicator::allocate).

#include <mpi.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace gradcomm {

// A POSIX shared-memory segment mapped by every rank of a communicator whose ranks share one
// host. The file under /dev/shm exists only while the ranks map it: it is unlinked as soon as
// every rank has, so nothing is left behind when a process dies later. Space is reserved up front
// (posix_fallocate), so a full /dev/shm is a clear error at creation, never a SIGBUS on first
// touch. The memory starts zeroed.
class SharedSegment {
 public:
  SharedSegment() = default;
  // Collective over `node`, whose ranks must all be on this host; every rank passes the same
  // `bytes` (> 0). Throws CommError naming `call` on every rank when any rank fails.
  SharedSegment(MPI_Comm node, std::size_t bytes, std::string_view call);
  ~SharedSegment();
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  std::byte* data() const { return base_; }
  std::size_t size() const { return bytes_; }
  // A number every rank of the segment agrees on, unique on this host while it lives.
  std::uint64_t id() const { return id_; }

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint64_t id_ = 0;
};

class RegisteredBuffer;
namespace detail {
// Creates a registered buffer of `bytes` per rank over `node` (Communicator::allocate).
RegisteredBuffer allocate_registered(MPI_Comm node, std::size_t bytes, std::string_view call);
}  // namespace detail

// Memory from Communicator::allocate: this rank's slice of a segment that every rank of the
// communicator on this host maps, so algorithms that run inside a node (shm) read peers' data in
// place instead of copying it in first. Use it as a plain pointer; the memory is released when the
// handle is destroyed (no communication).
class RegisteredBuffer {
 public:
  RegisteredBuffer() = default;
  ~RegisteredBuffer();
  RegisteredBuffer(RegisteredBuffer&& other) noexcept;
  RegisteredBuffer& operator=(RegisteredBuffer&& other) noexcept;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend RegisteredBuffer detail::allocate_registered(MPI_Comm, std::size_t, std::string_view);
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint64_t id_ = 0;  // registry key, 0 when empty
};

// Where a registered buffer lies: the segment id and the byte offset from the segment's start.
// Every process that maps the segment turns it back into its own address with registered_address.
struct RegisteredLocation {
  std::uint64_t segment = 0;
  std::size_t offset = 0;
};

// The registered segment holding all of [p, p + bytes) when every process in `readers` (pids)
// maps it; nullopt otherwise.
std::optional<RegisteredLocation> find_registered(const void* p, std::size_t bytes,
                                                  const std::vector<pid_t>& readers);
// This process's address of `location`, or nullptr when it does not map that segment.
std::byte* registered_address(const RegisteredLocation& location);

}  // namespace gradcomm
