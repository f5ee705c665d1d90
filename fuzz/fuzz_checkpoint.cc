// Fuzz target: the checkpoint reader (trainer/checkpoint.h), which reads files from disk that may
// be truncated, corrupt or hostile. Properties: decode_checkpoint either returns a state or throws
// InvalidArgument (never crashes, never allocates more than the input can describe), and a state
// it returns encodes back to exactly the input bytes (the format has one encoding); a state read
// from an older version encodes to the current one, which reads back to the same encoding.
//
// A random input almost never carries a valid checksum, so each input is decoded twice: as is, and
// as the payload of a header and checksum made valid around it, which lets the fuzzer explore the
// payload parser.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "core/error.h"
#include "trainer/checkpoint.h"

namespace {

using gradcomm::trainer::CheckpointState;

// 64-bit FNV-1a, written out here independently of the reader's.
std::uint64_t fnv1a(const std::byte* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<std::uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

void decode_and_check(std::span<const std::byte> bytes) {
  CheckpointState state;
  try {
    state = gradcomm::trainer::decode_checkpoint(bytes, "fuzz input");
  } catch (const gradcomm::InvalidArgument&) {
    return;
  }
  const std::vector<std::byte> again = gradcomm::trainer::encode_checkpoint(state);
  std::uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, sizeof version);  // decoded: the header is there
  if (version != gradcomm::trainer::kCheckpointVersion) {
    const std::vector<std::byte> twice = gradcomm::trainer::encode_checkpoint(
        gradcomm::trainer::decode_checkpoint(again, "re-encoded fuzz input"));
    if (twice != again) std::abort();  // the upgrade does not round-trip
    return;
  }
  if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), bytes.size()) != 0) {
    std::abort();  // decoded, but does not encode back to the same bytes
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  decode_and_check({bytes, size});

  // "GRADCKPT" | u32 version | u32 0 | u64 payload bytes | payload (the input) | u64 checksum
  std::vector<std::byte> sealed;
  auto append = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    sealed.insert(sealed.end(), b, b + n);
  };
  const std::uint32_t version = gradcomm::trainer::kCheckpointVersion, reserved = 0;
  const std::uint64_t payload = size;
  append("GRADCKPT", 8);
  append(&version, sizeof version);
  append(&reserved, sizeof reserved);
  append(&payload, sizeof payload);
  append(data, size);
  const std::uint64_t sum = fnv1a(sealed.data(), sealed.size());
  append(&sum, sizeof sum);
  decode_and_check(sealed);
  return 0;
}
