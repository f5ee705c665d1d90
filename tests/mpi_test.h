#pragma once

// Shared harness of the MPI test binaries: a world communicator and a fixture whose TearDown
// makes every rank agree on the outcome (a test that failed on any rank fails on all of them).

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/communicator.h"
#include "core/data_type.h"

namespace gradcomm::testing {

// The communicator over MPI_COMM_WORLD that the tests share.
Communicator& world();

// 64-bit FNV-1a of a byte range; equal on all ranks iff (practically) the bytes are equal.
std::uint64_t fingerprint(const void* data, std::size_t bytes);

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
