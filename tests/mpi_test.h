#pragma once

// Shared harness of the MPI test binaries: a world communicator and a fixture whose TearDown
// makes every rank agree on the outcome (a test that failed on any rank fails on all of them).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/communicator.h"
#include "core/data_type.h"

namespace gradcomm::testing {

// The communicator over MPI_COMM_WORLD that the tests share.
Communicator& world();

// A 64-bit hash of a byte range (FNV-1a's step on words, four lanes); equal on all ranks iff
// (practically) the bytes are equal.
std::uint64_t fingerprint(const void* data, std::size_t bytes);

// Fills elements [period, count) of `data` (element_bytes each) with its first `period` elements
// repeated (period <= count): memcpy of whole periods, doubling. Stored element by element, a
// 16 Mi-element buffer took about 0.3 s to fill, far more than the call under test.
void repeat_pattern(void* data, std::size_t count, std::size_t period, std::size_t element_bytes);

// Calls check(i0, i1) for each block [i0, i1) of data's `count` elements that differs anywhere
// from `pattern` (period elements) repeated from element 0: every block is compared with memcmp
// against a tile of whole periods, and only a block that differs is left to `check`, element by
// element.
template <class Check>
void for_each_block_unlike(const void* data, std::size_t count, const void* pattern,
                           std::size_t period, std::size_t element_bytes, Check&& check) {
  if (count == 0) return;
  const std::size_t tile_elements =
      period * std::max<std::size_t>(1, (std::size_t{64} << 10) / (period * element_bytes));
  std::vector<std::byte> tile(tile_elements * element_bytes);
  std::memcpy(tile.data(), pattern, period * element_bytes);
  repeat_pattern(tile.data(), tile_elements, period, element_bytes);
  const auto* bytes = static_cast<const std::byte*>(data);
  for (std::size_t i0 = 0; i0 < count; i0 += tile_elements) {
    const std::size_t i1 = std::min(count, i0 + tile_elements);
    if (std::memcmp(bytes + i0 * element_bytes, tile.data(), (i1 - i0) * element_bytes) != 0) {
      check(i0, i1);
    }
  }
}

// Element i of a buffer of `dtype`, written from / read as a double (16-bit types rounded to
// nearest even).
void store(DataType dtype, void* buf, std::size_t i, double v);
double load(DataType dtype, const void* buf, std::size_t i);

// True when every rank of `comm` passed the same fingerprint.
bool same_on_all_ranks(MPI_Comm comm, std::uint64_t value);

class MpiTest : public ::testing::Test {
 protected:
  void TearDown() override;
};

template <class Param>
class MpiTestWithParam : public MpiTest, public ::testing::WithParamInterface<Param> {};

}  // namespace gradcomm::testing
