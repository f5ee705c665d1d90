// reduce_scatter against a serial reference computed on every rank (dtypes, ops, counts from 0
// to many of shm's rounds, every path: shm, the all-reduce of other algorithms, reproducible
// mode), against the same block of an all-reduce bit for bit (shm: both reduce in rank order),
// calls interleaved with shm all-reduces (the segment's slots and rounds shared), ranks that
// disagree, and bad input.

#include <gmock/gmock.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/reduce_scatter.h"
#include "core/error.h"
#include "tests/mpi_test.h"

namespace gradcomm::testing {
namespace {

using ::testing::HasSubstr;

// Rank r's input element i: small integers (1-3 for products), exact in every dtype and order.
double input(int rank, std::size_t i, ReduceOp op) {
  if (op == ReduceOp::prod)
    return static_cast<double>(1 + (static_cast<std::size_t>(rank) + i) % 3);
  return static_cast<double>((static_cast<std::size_t>(rank) * 7 + i * 13) % 97) - 48.0;
}

double reference(int ranks, std::size_t i, ReduceOp op) {
  double v = input(0, i, op);
  for (int r = 1; r < ranks; ++r) {
    const double x = input(r, i, op);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        v += x;
        break;
      case ReduceOp::prod:
        v *= x;
        break;
      case ReduceOp::min:
        v = std::min(v, x);
        break;
      case ReduceOp::max:
        v = std::max(v, x);
        break;
    }
  }
  return op == ReduceOp::avg ? v / ranks : v;
}

// Counts: empty, tiny, primes, and more than one of shm's rounds per block (a round stages 256 KiB
// per rank, or 1 MiB where ranks share CPUs, split among the blocks).
const std::vector<std::size_t> kCounts = {0, 1, 2, 7, 4093, 65537, 300007};

struct Case {
  std::string algorithm;
  DataType dtype;
  ReduceOp op;
};

// Runs every count of `c` on `comm`; every rank checks its own block.
void check_counts(Communicator& comm, const Case& c) {
  const int n = comm.size(), me = comm.rank();
  const std::size_t es = element_size(c.dtype);
  for (std::size_t count : kCounts) {
    const std::size_t total = count * static_cast<std::size_t>(n);
    std::vector<std::byte> send(total * es), recv(count * es + 1);
    for (std::size_t i = 0; i < total; ++i)
      store(c.dtype, send.data(), i, input(me, i, c.op));
    reduce_scatter(comm, send.data(), recv.data(), count, c.dtype, c.op,
                   {.algorithm = c.algorithm});
    std::size_t wrong = 0, first_wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t at = static_cast<std::size_t>(me) * count + i;
      double want = reference(n, at, c.op);
      if (c.op == ReduceOp::avg && !is_floating(c.dtype)) want = std::trunc(want);
      double got = load(c.dtype, recv.data(), i);
      const double tolerance = c.op == ReduceOp::avg ? 1e-2 : 0;
      if (std::fabs(got - want) > tolerance) {
        if (wrong++ == 0) first_wrong = i;
      }
    }
    EXPECT_EQ(wrong, 0u) << c.algorithm << " " << to_string(c.dtype) << " " << to_string(c.op)
                         << " count " << count << ", first at " << first_wrong;
  }
}

class ReduceScatter : public MpiTest {};

TEST_F(ReduceScatter, MatchesTheSerialReferenceOnEveryPath) {
  const std::vector<Case> cases = {
      {"auto", DataType::float32, ReduceOp::sum}, {"shm", DataType::float32, ReduceOp::avg},
      {"shm", DataType::float64, ReduceOp::max},  {"auto", DataType::int32, ReduceOp::min},
      {"auto", DataType::int64, ReduceOp::prod},  {"auto", DataType::bfloat16, ReduceOp::sum},
      {"ring", DataType::float32, ReduceOp::sum}, {"mpi", DataType::int32, ReduceOp::avg},
  };
  for (const Case& c : cases)
    check_counts(world(), c);
}

TEST_F(ReduceScatter, ReproducibleModeGivesTheSameBlocks) {
  Config config = world().config();
  config.deterministic = true;
  Communicator comm(MPI_COMM_WORLD, config);
  check_counts(comm, {"auto", DataType::float32, ReduceOp::sum});
  check_counts(comm, {"auto", DataType::float16, ReduceOp::avg});
}

// shm reduces each element in rank order in both calls: the block is the all-reduce's, bit for
// bit, with values whose sums round. Interleaved with all-reduces of both shm paths, so that the
// calls share the segment's rounds and slots.
TEST_F(ReduceScatter, ShmBlocksAreTheAllreducesBitForBit) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  std::mt19937 gen(static_cast<unsigned>(17 + me));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int step = 0; step < 6; ++step) {
    for (std::size_t count : {std::size_t{3}, std::size_t{70001}, std::size_t{263000}}) {
      const std::size_t total = count * static_cast<std::size_t>(n);
      std::vector<float> send(total), all(total), block(count);
      for (float& v : send)
        v = dist(gen);
      const ReduceOp op = step % 2 ? ReduceOp::avg : ReduceOp::sum;
      reduce_scatter(comm, send.data(), block.data(), count, DataType::float32, op,
                     {.algorithm = "shm"});
      std::vector<float> small(step + 1, 1.0f);  // a latency-path call between
      allreduce(comm, small.data(), small.data(), small.size(), DataType::float32, ReduceOp::sum,
                {.algorithm = "shm"});
      EXPECT_EQ(small[0], static_cast<float>(n));
      allreduce(comm, send.data(), all.data(), total, DataType::float32, op, {.algorithm = "shm"});
      EXPECT_EQ(std::memcmp(block.data(), all.data() + static_cast<std::size_t>(me) * count,
                            count * sizeof(float)),
                0)
          << "step " << step << ", count " << count;
    }
  }
}

// A reduce-scatter against an all-reduce of the whole buffer, or against one of another count
// or op: an error on every rank, naming the calls; the next call works.
TEST_F(ReduceScatter, RanksThatDisagreeFailOnEveryRank) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool odd = me == n - 1;
  for (std::size_t count : {std::size_t{5}, std::size_t{100003}}) {
    const std::size_t total = count * static_cast<std::size_t>(n);
    std::vector<float> send(total, 1.0f), recv(total);
    try {
      if (odd) {
        allreduce(comm, send.data(), recv.data(), total, DataType::float32, ReduceOp::sum,
                  {.algorithm = "shm"});
      } else {
        reduce_scatter(comm, send.data(), recv.data(), count, DataType::float32, ReduceOp::sum,
                       {.algorithm = "shm"});
      }
      ADD_FAILURE() << "no error for a reduce-scatter against an all-reduce, count " << count;
    } catch (const MismatchError& e) {
      EXPECT_THAT(e.what(), HasSubstr("ranks disagree"));
    }
    try {
      reduce_scatter(comm, send.data(), recv.data(), count - (odd ? 1 : 0), DataType::float32,
                     odd ? ReduceOp::max : ReduceOp::sum);
      ADD_FAILURE() << "no error for other counts and ops";
    } catch (const MismatchError& e) {
      EXPECT_THAT(e.what(), HasSubstr("reduce_scatter #"));
      EXPECT_THAT(e.what(), HasSubstr(std::to_string(count) + " x float32 sum"));
    }
  }
  std::vector<float> send(static_cast<std::size_t>(n) * 9, 2.0f), recv(9);
  reduce_scatter(comm, send.data(), recv.data(), 9, DataType::float32, ReduceOp::sum);
  EXPECT_EQ(recv[8], 2.0f * static_cast<float>(n));
}

TEST_F(ReduceScatter, BadInputFailsBeforeAnyCommunication) {
  Communicator& comm = world();
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<float> send(n * 4, 1.0f), recv(4);
  auto expect_invalid = [&](auto call, const std::string& text) {
    try {
      call();
      ADD_FAILURE() << "no error: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("reduce_scatter(auto): rank"));
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_invalid(
      [&] {
        reduce_scatter(comm, send.data(), send.data() + 2, 4, DataType::float32, ReduceOp::sum);
      },
      "overlaps sendbuf");
  expect_invalid(
      [&] { reduce_scatter(comm, nullptr, recv.data(), 4, DataType::float32, ReduceOp::sum); },
      "sendbuf is null");
  expect_invalid(
      [&] {
        reduce_scatter(comm, send.data(), recv.data(), 4, static_cast<DataType>(99), ReduceOp::sum);
      },
      "invalid dtype");
  expect_invalid(
      [&] {
        reduce_scatter(comm, send.data(), recv.data(), SIZE_MAX / 2, DataType::float32,
                       ReduceOp::sum);
      },
      "overflows");
  reduce_scatter(comm, send.data(), recv.data(), 4, DataType::float32, ReduceOp::sum);
  EXPECT_EQ(recv[3], static_cast<float>(n));  // still usable
}

}  // namespace
}  // namespace gradcomm::testing
