// Consistency checks (GRADCOMM_CHECK): ranks that disagree on a call's count, dtype, op,
// algorithm, root or kind get MismatchError on every rank (no hang, no corrupted output), with a
// message naming the differing field and the ranks; the communicator stays usable and later
// calls are exact. Every host algorithm, in default and full mode. (With GRADCOMM_CHECK=off the
// watchdog catches what would hang: watchdog_test.sh.)

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/allgather.h"
#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "packing/grouped_allreduce.h"
#include "tests/mpi_test.h"

namespace gradcomm {
namespace {

using ::testing::HasSubstr;
using testing::world;

struct Case {
  CheckMode mode;
  std::string algorithm;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(to_string(info.param.mode)) + "_" + info.param.algorithm;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (CheckMode mode : {CheckMode::normal, CheckMode::full}) {
    for (const std::string& name : collectives::host_algorithm_names())
      cases.push_back({mode, name});
  }
  return cases;
}

class Consistency : public testing::MpiTestWithParam<Case> {
 protected:
  Config config() const {
    Config c;
    c.check = GetParam().mode;
    return c;
  }
  AllreduceOptions options() const { return {.algorithm = GetParam().algorithm}; }
};

// Whether this algorithm can run here at all (shm needs one host, ...).
bool odd_rank() {
  return world().rank() == world().size() - 1;
}

// sum of (r + 1) over ranks, for an exact check after a mismatch.
float expected_sum(int ranks) {
  return static_cast<float>(ranks * (ranks + 1) / 2);
}

void expect_exact(Communicator& comm, const AllreduceOptions& options, std::size_t count) {
  std::vector<float> data(count, static_cast<float>(comm.rank() + 1));
  allreduce(comm, data.data(), data.data(), count, DataType::float32, ReduceOp::sum, options);
  for (std::size_t i = 0; i < count; ++i)
    ASSERT_EQ(data[i], expected_sum(comm.size())) << "element " << i;
}

TEST_P(Consistency, MismatchedCountDtypeOpAndAlgorithmThrowOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, config());
  const AllreduceOptions opts = options();
  expect_exact(comm, opts, 1000);  // first use: compared before it runs
  for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{300001}}) {
    std::vector<float> data(count + 1, 1.0f);
    const std::size_t mine = odd_rank() ? count + 1 : count;
    EXPECT_THAT(
        [&] {
          allreduce(comm, data.data(), data.data(), mine, DataType::float32, ReduceOp::sum, opts);
        },
        ::testing::ThrowsMessage<MismatchError>(HasSubstr("(count differ)")))
        << "count " << count;
    expect_exact(comm, opts, count);
  }
  std::vector<double> wide(100, 1.0);
  EXPECT_THAT(
      [&] {
        allreduce(comm, wide.data(), wide.data(), 100,
                  odd_rank() ? DataType::float64 : DataType::int64, ReduceOp::sum, opts);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("(dtype differ)")));
  expect_exact(comm, opts, 100);
  std::vector<float> data(100, 1.0f);
  EXPECT_THAT(
      [&] {
        allreduce(comm, data.data(), data.data(), 100, DataType::float32,
                  odd_rank() ? ReduceOp::max : ReduceOp::sum, opts);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("(op differ)")));
  expect_exact(comm, opts, 100);
  // An empty call against a non-empty one.
  EXPECT_THAT(
      [&] {
        allreduce(comm, data.data(), data.data(), odd_rank() ? 0 : 100, DataType::float32,
                  ReduceOp::sum, opts);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("(count differ)")));
  expect_exact(comm, opts, 100);
}

TEST_P(Consistency, MessageNamesTheRanksAndBothCalls) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, config());
  expect_exact(comm, options(), 10);
  std::vector<float> data(100, 1.0f);
  const int last = comm.size() - 1;
  const std::string others = comm.size() == 2 ? "rank 0" : "ranks 0";
  try {
    allreduce(comm, data.data(), data.data(), odd_rank() ? 99 : 100, DataType::float32,
              ReduceOp::sum, options());
    ADD_FAILURE() << "no MismatchError";
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("rank " + std::to_string(comm.rank()) + ": ranks disagree"));
    EXPECT_THAT(what, HasSubstr(others));
    // (auto's calibration makes calls of its own: the sequence number is not known here)
    EXPECT_THAT(what, ::testing::MatchesRegex(".*called allreduce #[0-9]+: 100 x float32 sum.*"));
    EXPECT_THAT(what, ::testing::MatchesRegex(".*rank " + std::to_string(last) +
                                              " called allreduce #[0-9]+: 99 x float32 sum.*"));
  }
}

// A rank that makes another kind of call, or passes another algorithm.
TEST_P(Consistency, DifferentCallOrderThrowsOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, config());
  expect_exact(comm, options(), 10);
  std::vector<float> data(64, 1.0f);
  auto reduce = [&] {
    allreduce(comm, data.data(), data.data(), 64, DataType::float32, ReduceOp::sum, options());
  };
  auto bcast = [&] { broadcast(comm, data.data(), 64, DataType::float32, 0); };
  EXPECT_THAT([&] { odd_rank() ? bcast() : reduce(); },
              ::testing::ThrowsMessage<MismatchError>(HasSubstr("kind of call")));
  EXPECT_THAT([&] { odd_rank() ? reduce() : bcast(); },
              ::testing::ThrowsMessage<MismatchError>(HasSubstr("kind of call")));
  // Broadcast roots, and allgatherv counts.
  EXPECT_THAT([&] { broadcast(comm, data.data(), 64, DataType::float32, odd_rank() ? 1 : 0); },
              ::testing::ThrowsMessage<MismatchError>(HasSubstr("root differ")));
  // The same bytes as another dtype (float32 and int32 of one count).
  EXPECT_THAT(
      [&] {
        broadcast(comm, data.data(), 64, odd_rank() ? DataType::int32 : DataType::float32, 0);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("256 bytes of int32")));
  std::vector<std::size_t> counts(static_cast<std::size_t>(comm.size()), 2);
  if (odd_rank()) counts[0] = 3;
  std::vector<float> gathered(static_cast<std::size_t>(comm.size()) * 3);
  EXPECT_THAT(
      [&] {
        allgatherv(comm, data.data(), counts[static_cast<std::size_t>(comm.rank())],
                   gathered.data(), counts, DataType::float32);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("differ")));
  expect_exact(comm, options(), 1000);
}

TEST_P(Consistency, DifferentAlgorithmsThrowOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, config());
  expect_exact(comm, options(), 10);
  std::vector<float> data(1000, 1.0f);
  const std::string other = GetParam().algorithm == "ring" ? "flat" : "ring";
  const AllreduceOptions mine = odd_rank() ? AllreduceOptions{.algorithm = other} : options();
  EXPECT_THAT(
      [&] {
        allreduce(comm, data.data(), data.data(), 1000, DataType::float32, ReduceOp::sum, mine);
      },
      ::testing::ThrowsMessage<MismatchError>(HasSubstr("(algorithm differ)")));
  expect_exact(comm, options(), 1000);
}

INSTANTIATE_TEST_SUITE_P(Modes, Consistency, ::testing::ValuesIn(all_cases()), case_name);

TEST(ConsistencyModes, OffComparesNothingAndStillWorks) {
  Config c;
  c.check = CheckMode::off;
  Communicator comm(MPI_COMM_WORLD, c);
  expect_exact(comm, {.algorithm = "ring"}, 1001);
  expect_exact(comm, {}, 7);
}

// Ranks whose timeouts differ (GRADCOMM_TIMEOUT=0 on one, a front end's own on the others):
// the communicator is made (the watchdog's endpoint exchange is collective whatever a rank's
// timeout), a rank without one keeps no recorder, and calls run.
TEST(ConsistencyModes, RanksWithAndWithoutATimeoutMakeOneCommunicator) {
  Config c;
  c.timeout_seconds = world().rank() == 0 ? 0 : 60;
  Communicator comm(MPI_COMM_WORLD, c);
  EXPECT_EQ(comm.recorder() == nullptr, world().rank() == 0);
  expect_exact(comm, {}, 1003);
}

TEST(ConsistencyModes, GroupedTensorListsAreComparedInEveryMode) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (CheckMode mode : {CheckMode::off, CheckMode::normal, CheckMode::full}) {
    Config c;
    c.check = mode;
    Communicator comm(MPI_COMM_WORLD, c);
    std::vector<float> buf(300, 1.0f);
    const std::size_t odd = comm.rank() == 1 ? 99 : 100;
    const std::vector<packing::TensorDesc> tensors = {{buf.data(), 100, DataType::float32},
                                                      {buf.data() + 100, odd, DataType::float32}};
    EXPECT_THAT([&] { grouped_allreduce(comm, tensors, ReduceOp::sum); },
                ::testing::ThrowsMessage<MismatchError>(
                    HasSubstr("tensor 1 is 100 x float32 on rank 0 but 99 x float32 on rank 1")))
        << to_string(mode);
  }
}

// shm's packets carry the call's whole fingerprint, one cache line per rank in every call's first
// round (the latency path's flag; the staged path's, private or registered, read once the round's
// input is up), so with the board the check posts nothing and reads no peer's post when the lines
// agree.
void expect_exact_in(Communicator& comm, float* data, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    data[i] = static_cast<float>(comm.rank() + 1);
  allreduce(comm, data, data, count, DataType::float32, ReduceOp::sum, {.algorithm = "shm"});
  const int n = comm.size();
  for (std::size_t i = 0; i < count; ++i)
    ASSERT_EQ(data[i], static_cast<float>(n * (n + 1) / 2)) << "element " << i << " of " << count;
}

TEST(ConsistencyModes, ShmPacketsProveTheCallOrReportTheDifference) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD);
  const AllreduceOptions shm{.algorithm = "shm"};
  expect_exact(comm, shm, 8);
  // 4: the latency path; 3001 (12 KB, a prime): the staged path on every CPU, private and
  // registered (one round, nothing staged); 300007 (1.2 MB, a prime): private, several staged
  // rounds (256 KiB, or 1 MiB where ranks share CPUs), whose packets' halves are reused.
  constexpr std::size_t kLargest = 300007;
  RegisteredBuffer registered = comm.allocate(kLargest * sizeof(float));
  std::vector<float> priv(kLargest);
  for (std::size_t count : {std::size_t{4}, std::size_t{3001}, kLargest}) {
    for (float* buffer : {priv.data(), reinterpret_cast<float*>(registered.data())}) {
      SCOPED_TRACE(std::to_string(count) + (buffer == priv.data() ? " private" : " registered"));
      // A late rank: the others' waits post their fingerprints meanwhile; every rank still proves
      // the call from the lines and none waits for a post the late one never made.
      // With auto too, whose timed calls complete the check again at the end of a window.
      for (int late = 0; late < comm.size(); ++late) {
        if (comm.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        expect_exact_in(comm, buffer, count);
        if (comm.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        expect_exact(comm, {}, 6);
      }
      // Lines that agree on the buffers, sequence and algorithm of another kind of call: only
      // the fingerprints differ, and the board's comparison reports it on every rank before
      // anything is written.
      std::fill(buffer, buffer + count, 1.0f);
      collectives::CallInfo info;
      info.sequence = comm.next_sequence();
      info.kind = odd_rank() ? collectives::CallKind::broadcast : collectives::CallKind::allreduce;
      info.count = count;
      info.dtype = static_cast<int>(DataType::float32);
      info.op = static_cast<int>(ReduceOp::sum);
      info.algorithm = collectives::algorithm_index("shm");
      info.algorithm_name = collectives::algorithm_name_at(info.algorithm);
      auto call = [&] {
        collectives::CallScope scope(comm, info, "allreduce(shm)");
        scope.start("shm", /*polls_check=*/true, /*proves_call=*/true);
        collectives::AllreduceArgs args{buffer,        buffer,       count, DataType::float32,
                                        ReduceOp::sum, info.sequence};
        args.call = scope.context();
        comm.attachment<collectives::AlgorithmCache>().find("shm")->run(args, comm);
        scope.finish(buffer, sizeof(float) * count);
      };
      EXPECT_THAT(call, ::testing::ThrowsMessage<MismatchError>(HasSubstr("kind of call")));
      EXPECT_EQ(std::vector<float>(buffer, buffer + count), std::vector<float>(count, 1.0f))
          << "reported before the reduction wrote anything";
      expect_exact_in(comm, buffer, count);
      expect_exact(comm, shm, 1000);
      expect_exact(comm, shm, 3);
    }
  }
}

TEST(ConsistencyModes, InvalidVariableNamesTheValidValues) {
  setenv("GRADCOMM_CHECK", "paranoid", 1);
  EXPECT_THAT([] { Config::from_environment(); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  HasSubstr("GRADCOMM_CHECK='paranoid' is invalid: expected one of off, default, "
                            "full")));
  setenv("GRADCOMM_CHECK", "full", 1);
  EXPECT_EQ(Config::from_environment().check, CheckMode::full);
  unsetenv("GRADCOMM_CHECK");
  EXPECT_EQ(Config::from_environment().check, CheckMode::normal);
}

}  // namespace
}  // namespace gradcomm
