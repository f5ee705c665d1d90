// The two halves of FSDP's step on the host: reduce_scatter and the all-gather
// (allgather_bytes), both through shm's segment on one host from 512 KiB.
// reduce_scatter against a serial reference computed on every rank (dtypes, ops, counts from 0
// to many of shm's rounds, every path: shm, the all-reduce of other algorithms, reproducible
// mode), against the same block of an all-reduce bit for bit (shm: both reduce in rank order),
// calls interleaved with shm all-reduces (the segment's slots and rounds shared), ranks that
// disagree, and bad input. The all-gather: every rank's blocks on every rank, on shm's path and
// MPI's, interleaved with the other shm calls, and ranks that disagree.

#include <gmock/gmock.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/exchange.h"
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

std::byte pattern(int rank, std::size_t i) {
  return static_cast<std::byte>((static_cast<std::size_t>(rank) * 31 + i * 7 + i / 251) & 0xff);
}

// Every rank's block on every rank, in rank order; `bytes` per rank.
void check_allgather(Communicator& comm, std::size_t bytes, const std::string& where) {
  const int n = comm.size(), me = comm.rank();
  std::vector<std::byte> send(bytes), recv(bytes * static_cast<std::size_t>(n) + 1);
  for (std::size_t i = 0; i < bytes; ++i)
    send[i] = pattern(me, i);
  recv.back() = std::byte{0x5a};
  allgather_bytes(comm, send.data(), recv.data(), bytes);
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < bytes; ++i)
      wrong += recv[static_cast<std::size_t>(r) * bytes + i] != pattern(r, i);
  }
  EXPECT_EQ(wrong, 0u) << where << ", " << bytes << " bytes per rank";
  EXPECT_EQ(recv.back(), std::byte{0x5a}) << "written past the output";
}

class Allgather : public MpiTest {};

// Both paths (shm's from 512 KiB of output with algorithm shm, in one round and in many, with
// odd sizes; MPI's below that and with auto), each followed by the other shm calls sharing the
// segment.
TEST_F(Allgather, EveryRanksBlocksOnEveryRankOnBothPaths) {
  Config config = world().config();
  config.algorithm = "shm";
  Communicator comm(MPI_COMM_WORLD, config);  // shm's all-gather from 512 KiB of output
  Communicator& mpi = world();                // auto: MPI_Allgather
  const int n = comm.size();
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{4093}, std::size_t{262147},
                            std::size_t{1000003}}) {
    check_allgather(comm, bytes, "shm");
    check_allgather(mpi, bytes, "auto");
    std::vector<float> send(static_cast<std::size_t>(n) * 140000, 1.0f), block(140000);
    reduce_scatter(comm, send.data(), block.data(), block.size(), DataType::float32, ReduceOp::sum);
    EXPECT_EQ(block[139999], static_cast<float>(n));
    allreduce(comm, send.data(), send.data(), send.size(), DataType::float32, ReduceOp::sum);
    EXPECT_EQ(send[0], static_cast<float>(n));
  }
}

// Many calls of one size on shm's paths (reduce-scatter and all-gather with algorithm shm):
// the segment's rounds and slots go round, each call's staging after the peers read the last;
// every call gives the right result on every rank, with a latency-path call in between.
TEST_F(Allgather, ShmPathsCallAfterCall) {
  Config config = world().config();
  config.algorithm = "shm";
  Communicator comm(MPI_COMM_WORLD, config);
  const int n = comm.size(), me = comm.rank();
  const std::size_t count = 200003;  // floats per block: 800 KB x ranks
  for (int call = 0; call < 10; ++call) {
    check_allgather(comm, count * 4, "call " + std::to_string(call));
    std::vector<float> send(count * static_cast<std::size_t>(n)), block(count);
    for (std::size_t i = 0; i < send.size(); ++i)
      send[i] = static_cast<float>((static_cast<std::size_t>(me) + i) % 7);
    reduce_scatter(comm, send.data(), block.data(), count, DataType::float32, ReduceOp::sum);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t at = static_cast<std::size_t>(me) * count + i;
      float want = 0;
      for (int r = 0; r < n; ++r)
        want += static_cast<float>((static_cast<std::size_t>(r) + at) % 7);
      wrong += block[i] != want;
    }
    EXPECT_EQ(wrong, 0u) << "reduce_scatter call " << call;
    std::vector<float> small(3, 1.0f);
    allreduce(comm, small.data(), small.data(), 3, DataType::float32, ReduceOp::sum);
    EXPECT_EQ(small[2], static_cast<float>(n));
  }
}

// An all-gather against a reduce-scatter of the same bytes, or of another size: an error on
// every rank; the next call works.
TEST_F(Allgather, RanksThatDisagreeFailOnEveryRank) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool odd = me == n - 1;
  const std::size_t bytes = 400000;
  std::vector<std::byte> send(bytes), recv(bytes * static_cast<std::size_t>(n));
  try {
    if (odd) {
      reduce_scatter(comm, send.data(), recv.data(), bytes / 4 / static_cast<std::size_t>(n),
                     DataType::float32, ReduceOp::sum);
    } else {
      allgather_bytes(comm, send.data(), recv.data(), bytes);
    }
    ADD_FAILURE() << "no error for an all-gather against a reduce-scatter";
  } catch (const MismatchError& e) {
    EXPECT_THAT(e.what(), HasSubstr("ranks disagree"));
  }
  try {
    allgather_bytes(comm, send.data(), recv.data(), bytes - (odd ? 8 : 0));
    ADD_FAILURE() << "no error for other sizes";
  } catch (const MismatchError& e) {
    EXPECT_THAT(e.what(), HasSubstr("allgather #"));
  }
  check_allgather(comm, bytes, "after the errors");
}

}  // namespace
}  // namespace gradcomm::testing
