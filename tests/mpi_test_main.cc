// The GoogleTest main of every MPI test binary: initializes MPI through gradcomm::init, runs the
// tests on every rank, prints from rank 0 only (other ranks print their failures, prefixed with
// their rank), and exits non-zero on every rank if any rank failed.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "core/half.h"
#include "tests/mpi_test.h"

namespace gradcomm::testing {
namespace {

std::unique_ptr<Communicator> g_world;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// Printer for ranks other than 0: silent except for failures.
class FailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", world_rank(),
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }
};

}  // namespace

Communicator& world() {
  return *g_world;
}

// FNV-1a's step on 8-byte words in four independent lanes, each word's high bits shifted down
// into the lane, then the lanes, the tail's bytes and the length folded into one and mixed.
// Byte by byte (one multiply's latency a byte) a 64 MiB buffer took 0.1-0.2 s, most of what a
// large check cost after the call. Every step is a bijection of the lane's state, so one changed
// word always changes the result.
std::uint64_t fingerprint(const void* data, std::size_t bytes) {
  constexpr std::uint64_t kBasis = 1469598103934665603ull;
  constexpr std::uint64_t kPrime = 1099511628211ull;
  std::uint64_t lane[4] = {kBasis, kBasis ^ 1, kBasis ^ 2, kBasis ^ 3};
  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (std::size_t k = 0; k < 4; ++k) {
      std::uint64_t word = 0;
      std::memcpy(&word, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ word ^ (word >> 32)) * kPrime;
    }
  }
  std::uint64_t hash = kBasis ^ bytes;
  for (const std::uint64_t l : lane)
    hash = (hash ^ l ^ (l >> 29)) * kPrime;
  for (; i < bytes; ++i)
    hash = (hash ^ p[i]) * kPrime;
  hash ^= hash >> 33;  // the final mix of MurmurHash3: every bit reaches the low ones
  hash *= 0xff51afd7ed558ccdull;
  hash ^= hash >> 33;
  return hash;
}

void repeat_pattern(void* data, std::size_t count, std::size_t period, std::size_t element_bytes) {
  if (period == 0) return;  // nothing to repeat (count 0)
  auto* bytes = static_cast<std::byte*>(data);
  for (std::size_t filled = period; filled < count; filled *= 2) {
    std::memcpy(bytes + filled * element_bytes, bytes,
                std::min(filled, count - filled) * element_bytes);
  }
}

bool same_on_all_ranks(MPI_Comm comm, std::uint64_t value) {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  MPI_Allreduce(&value, &lo, 1, MPI_UINT64_T, MPI_MIN, comm);
  MPI_Allreduce(&value, &hi, 1, MPI_UINT64_T, MPI_MAX, comm);
  return lo == hi;
}

void MpiTest::TearDown() {
  int local = HasFailure() ? 1 : 0;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> failed(static_cast<std::size_t>(size));
  MPI_Allgather(&local, 1, MPI_INT, failed.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::string ranks;
  for (int r = 0; r < size; ++r) {
    if (failed[static_cast<std::size_t>(r)])
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!ranks.empty() && !local) ADD_FAILURE() << "failed on rank(s) " << ranks;
}

void store(DataType dtype, void* buf, std::size_t i, double v) {
  switch (dtype) {
    case DataType::float32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      return;
    case DataType::float64:
      static_cast<double*>(buf)[i] = v;
      return;
    case DataType::float16:
      static_cast<float16_t*>(buf)[i] = to_float16(static_cast<float>(v));
      return;
    case DataType::bfloat16:
      static_cast<bfloat16_t*>(buf)[i] = to_bfloat16(static_cast<float>(v));
      return;
    case DataType::int32:
      static_cast<std::int32_t*>(buf)[i] = static_cast<std::int32_t>(v);
      return;
    case DataType::int64:
      static_cast<std::int64_t*>(buf)[i] = static_cast<std::int64_t>(v);
      return;
  }
}

double load(DataType dtype, const void* buf, std::size_t i) {
  switch (dtype) {
    case DataType::float32:
      return static_cast<const float*>(buf)[i];
    case DataType::float64:
      return static_cast<const double*>(buf)[i];
    case DataType::float16:
      return to_float(static_cast<const float16_t*>(buf)[i]);
    case DataType::bfloat16:
      return to_float(static_cast<const bfloat16_t*>(buf)[i]);
    case DataType::int32:
      return static_cast<const std::int32_t*>(buf)[i];
    case DataType::int64:
      return static_cast<double>(static_cast<const std::int64_t*>(buf)[i]);
  }
  return 0;
}

}  // namespace gradcomm::testing

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = gradcomm::testing::world_rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new gradcomm::testing::FailurePrinter);
  }
  int failed = 0;
  {
    gradcomm::testing::g_world = std::make_unique<gradcomm::Communicator>(MPI_COMM_WORLD);
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    gradcomm::testing::g_world.reset();
  }
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  gradcomm::finalize();
  return any_failed;
}
