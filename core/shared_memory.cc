#include "core/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "core/error.h"

namespace gradcomm {
namespace {

constexpr std::size_t kNameBytes = 64;

std::string errno_text(const char* what, int error) {
  return std::string(what) + ": " + std::strerror(error);
}

// Maps `name` (created when `create`), `bytes` long. Returns the address or sets `error`.
std::byte* map_segment(const char* name, std::size_t bytes, bool create, std::string& error) {
  const int flags = create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR;
  int fd = shm_open(name, flags, 0600);
  if (fd < 0 && create && errno == EEXIST) {  // left by an earlier process with our pid
    shm_unlink(name);
    fd = shm_open(name, flags, 0600);
  }
  if (fd < 0) {
    error = errno_text("shm_open", errno);
    return nullptr;
  }
  void* address = MAP_FAILED;
  if (create) {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      error = errno_text("ftruncate", errno);
    } else if (const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0) {
      error = errno_text("posix_fallocate", rc) + " (is /dev/shm large enough for " +
              std::to_string(bytes) + " bytes?)";
    }
  }
  if (error.empty()) {
    address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) error = errno_text("mmap", errno);
  }
  close(fd);
  return address == MAP_FAILED ? nullptr : static_cast<std::byte*>(address);
}

// The registered segments this process maps.
struct Registration {
  std::uint64_t id;  // registry key (the RegisteredBuffer's)
  std::uint64_t segment;
  std::byte* base;  // the whole segment, every rank's slice
  std::size_t bytes;
  std::byte* mine;  // this rank's slice
  std::size_t mine_bytes;
  std::vector<pid_t> mappers;  // sorted
  SharedSegment storage;
};

std::mutex g_registry_mutex;
std::vector<Registration>& registry() {
  static std::vector<Registration> entries;
  return entries;
}
// registry().size(), written under the mutex: a lookup where nothing is registered (private
// buffers only) takes no lock, about 3% of a 4 KiB shm call (docs/results/shm.md).
std::atomic<std::size_t> g_registered{0};
std::atomic<std::uint64_t> g_next_id{1};

}  // namespace

SharedSegment::SharedSegment(MPI_Comm node, std::size_t bytes, std::string_view call) {
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(node, &rank), std::string(call) + ": MPI_Comm_rank");
  check_mpi(MPI_Comm_size(node, &size), std::string(call) + ": MPI_Comm_size", rank);
  static std::atomic<unsigned> counter{0};
  char name[kNameBytes] = {};
  std::uint64_t id = 0;
  std::string error;
  if (rank == 0) {
    const unsigned serial = counter.fetch_add(1);
    std::snprintf(name, sizeof name, "/gradcomm-%ld-%u", static_cast<long>(getpid()), serial);
    id = (static_cast<std::uint64_t>(getpid()) << 32) | serial;
    base_ = map_segment(name, bytes, true, error);
    if (!error.empty()) name[0] = '\0';  // tells the others not to try
  }
  check_mpi(MPI_Bcast(name, static_cast<int>(kNameBytes), MPI_CHAR, 0, node),
            std::string(call) + ": MPI_Bcast", rank);
  check_mpi(MPI_Bcast(&id, 1, MPI_UINT64_T, 0, node), std::string(call) + ": MPI_Bcast", rank);
  if (rank != 0 && name[0] != '\0') base_ = map_segment(name, bytes, false, error);
  // Everyone has tried to map it: unlink now, whatever happened.
  int failed = base_ == nullptr ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, node),
            std::string(call) + ": MPI_Allreduce", rank);
  if (rank == 0 && name[0] != '\0') shm_unlink(name);
  if (failed) {
    if (base_ != nullptr) munmap(base_, bytes);
    base_ = nullptr;
    const std::string detail =
        error.empty()
            ? "another rank on this host could not map the shared segment"
            : "cannot create a shared segment of " + std::to_string(bytes) + " bytes: " + error;
    throw CommError(error_message(call, rank, detail));
  }
  bytes_ = bytes;
  id_ = id;
}

SharedSegment::~SharedSegment() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      id_(std::exchange(other.id_, 0)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) munmap(base_, bytes_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

RegisteredBuffer::~RegisteredBuffer() {
  if (id_ == 0) return;
  std::lock_guard lock(g_registry_mutex);
  auto& entries = registry();
  std::erase_if(entries, [&](const Registration& r) { return r.id == id_; });
  g_registered.store(entries.size(), std::memory_order_release);
}

RegisteredBuffer::RegisteredBuffer(RegisteredBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      id_(std::exchange(other.id_, 0)) {}

RegisteredBuffer& RegisteredBuffer::operator=(RegisteredBuffer&& other) noexcept {
  if (this != &other) {
    RegisteredBuffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

std::optional<RegisteredLocation> find_registered(const void* p, std::size_t bytes,
                                                  const std::vector<pid_t>& readers) {
  // A buffer registered on another thread is passed here only after its registration returned.
  if (g_registered.load(std::memory_order_acquire) == 0) return std::nullopt;
  const auto* address = static_cast<const std::byte*>(p);
  std::lock_guard lock(g_registry_mutex);
  for (const Registration& r : registry()) {
    if (address < r.base || address + bytes > r.base + r.bytes || address + bytes < address) {
      continue;
    }
    for (pid_t reader : readers) {
      if (!std::binary_search(r.mappers.begin(), r.mappers.end(), reader)) return std::nullopt;
    }
    return RegisteredLocation{r.segment, static_cast<std::size_t>(address - r.base)};
  }
  return std::nullopt;
}

std::byte* registered_address(const RegisteredLocation& location) {
  std::lock_guard lock(g_registry_mutex);
  for (const Registration& r : registry()) {
    if (r.segment == location.segment && location.offset <= r.bytes)
      return r.base + location.offset;
  }
  return nullptr;
}

namespace detail {

RegisteredBuffer allocate_registered(MPI_Comm node, std::size_t bytes, std::string_view call) {
  RegisteredBuffer buffer;
  if (bytes == 0) return buffer;
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(node, &rank), std::string(call) + ": MPI_Comm_rank");
  check_mpi(MPI_Comm_size(node, &size), std::string(call) + ": MPI_Comm_size", rank);
  // Each rank's slice starts on its own page; from kSliceAlignFromBytes on, 2 MiB apart: on AMD
  // EPYC, 2 ranks' in-place shm calls on a 64 MiB + 4 KiB registration took 65-82 us at 1 MiB
  // where the same on 64 or 66 MiB took 27-38 (96 MiB + 4 KiB: 44-48 us; up to 46 MiB + 4 KiB no
  // difference; docs/results/shm.md). The padding costs under 2 MiB a rank (3% at 64 MiB).
  constexpr std::size_t kSliceAlignFromBytes = std::size_t{32} << 20;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t align = bytes >= kSliceAlignFromBytes ? std::size_t{2} << 20 : page;
  const std::size_t stride = (bytes + align - 1) / align * align;
  SharedSegment segment(node, stride * static_cast<std::size_t>(size), call);
  std::vector<pid_t> mappers(static_cast<std::size_t>(size));
  const pid_t me = getpid();
  static_assert(sizeof(pid_t) == sizeof(int));
  check_mpi(MPI_Allgather(&me, 1, MPI_INT, mappers.data(), 1, MPI_INT, node),
            std::string(call) + ": MPI_Allgather", rank);
  std::sort(mappers.begin(), mappers.end());

  std::byte* base = segment.data();
  buffer.data_ = base + stride * static_cast<std::size_t>(rank);
  buffer.size_ = bytes;
  buffer.id_ = g_next_id.fetch_add(1);
  std::lock_guard lock(g_registry_mutex);
  registry().push_back(Registration{buffer.id_, segment.id(), base, segment.size(), buffer.data_,
                                    bytes, std::move(mappers), std::move(segment)});
  g_registered.store(registry().size(), std::memory_order_release);
  return buffer;
}

}  // namespace detail
}  // namespace gradcomm
