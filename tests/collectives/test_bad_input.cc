// Bad input is rejected with a clear error before any communication (so no rank hangs: every
// rank makes the same bad call and throws locally), and the communicator stays usable after.

#include <gmock/gmock.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "collectives/allgather.h"
#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/exchange.h"
#include "collectives/reduce_scatter.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "packing/grouped_allreduce.h"
#include "tests/mpi_test.h"

namespace gradcomm::testing {
namespace {

using ::testing::HasSubstr;

// Expects `f` to throw E whose message contains every string of `parts`.
template <class E, class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception thrown";
  } catch (const E& e) {
    for (const std::string& part : parts)
      EXPECT_THAT(e.what(), HasSubstr(part));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
  }
}

// After a rejected call, a good one still works on every rank.
void expect_usable(Communicator& comm) {
  std::vector<int> v(3, 1);
  allreduce(comm, v.data(), v.data(), v.size(), DataType::int32, ReduceOp::sum);
  EXPECT_EQ(v[0], comm.size());
}

class BadInput : public MpiTestWithParam<std::string> {};

TEST_P(BadInput, RejectedBeforeCommunication) {
  Communicator& comm = world();
  const AllreduceOptions options{.algorithm = GetParam()};
  const std::string rank = "rank " + std::to_string(comm.rank());
  std::vector<float> buf(16, 1.0f), out(16);

  expect_error<InvalidArgument>(
      [&] { allreduce(comm, nullptr, out.data(), 4, DataType::float32, ReduceOp::sum, options); },
      {"allreduce(" + GetParam() + ")", rank, "sendbuf is null with count 4"});
  expect_error<InvalidArgument>(
      [&] { allreduce(comm, buf.data(), nullptr, 4, DataType::float32, ReduceOp::sum, options); },
      {"recvbuf is null with count 4"});
  expect_error<InvalidArgument>(
      [&] {
        allreduce(comm, buf.data(), out.data(), 4, static_cast<DataType>(42), ReduceOp::sum,
                  options);
      },
      {"invalid dtype 42"});
  expect_error<InvalidArgument>(
      [&] {
        allreduce(comm, buf.data(), out.data(), 4, DataType::float32, static_cast<ReduceOp>(-1),
                  options);
      },
      {"invalid reduce op -1"});
  expect_error<InvalidArgument>(
      [&] {
        allreduce(comm, buf.data(), out.data(), std::numeric_limits<std::size_t>::max(),
                  DataType::float32, ReduceOp::sum, options);
      },
      {"count 18446744073709551615 x 4 bytes overflows size_t"});
  expect_error<InvalidArgument>(
      [&] {
        allreduce(comm, buf.data(), buf.data() + 1, 8, DataType::float32, ReduceOp::sum, options);
      },
      {"overlap partially", "4 bytes apart"});
  expect_error<InvalidArgument>(
      [&] {
        allreduce<float>(comm, std::span<const float>(buf), std::span<float>(out.data(), 3),
                         ReduceOp::sum, options);
      },
      {"send has 16 elements but recv has 3"});
  // Null buffers are fine with count 0, and the send buffer may then be anything.
  EXPECT_NO_THROW(allreduce(comm, nullptr, nullptr, 0, DataType::float32, ReduceOp::sum, options));
  expect_usable(comm);
}

INSTANTIATE_TEST_SUITE_P(Algorithms, BadInput, ::testing::ValuesIn(collectives::algorithm_names()),
                         [](const auto& info) { return info.param; });

class BadNames : public MpiTest {};

TEST_F(BadNames, UnknownAlgorithmListsValidNames) {
  std::vector<float> buf(4, 1.0f);
  expect_error<InvalidArgument>(
      [&] {
        allreduce(world(), buf.data(), buf.data(), 4, DataType::float32, ReduceOp::sum,
                  {.algorithm = "tree"});
      },
      {"unknown algorithm 'tree'",
       "valid names: auto, flat, ring, halving_doubling, hierarchical, shm, mpi"});
  // The same through the configured default (what GRADCOMM_ALGORITHM sets).
  Config config;
  config.algorithm = "bogus";
  Communicator comm(MPI_COMM_WORLD, config);
  expect_error<InvalidArgument>(
      [&] { allreduce(comm, buf.data(), buf.data(), 4, DataType::float32, ReduceOp::sum); },
      {"unknown algorithm 'bogus' (from GRADCOMM_ALGORITHM)"});
  expect_usable(world());
}

TEST_F(BadNames, InvalidEnvironmentNamesTheVariable) {
  struct Case {
    const char* name;
    const char* value;
    const char* expected;
  };
  const Case cases[] = {
      {"GRADCOMM_ALGORITHM", "", "GRADCOMM_ALGORITHM='' is invalid"},
      {"GRADCOMM_LOG_LEVEL", "loud", "one of error, warn, info, debug, trace"},
      {"GRADCOMM_SEGMENT_BYTES", "12abc", "GRADCOMM_SEGMENT_BYTES='12abc' is invalid"},
      {"GRADCOMM_SEGMENT_BYTES", "0", "an integer in [16, 1073741824]"},
      {"GRADCOMM_PIPELINE_DEPTH", "-3", "GRADCOMM_PIPELINE_DEPTH='-3'"},
      {"GRADCOMM_TCP_PIECE_BYTES", "-1", "GRADCOMM_TCP_PIECE_BYTES='-1' is invalid"},
      {"GRADCOMM_TCP_PIECE_BYTES", "2000000000", "an integer in [0, 1073741824]"},
      {"GRADCOMM_TCP_PIECE_BYTES", "100", "expected 0, or an integer in [1024, 1073741824]"},
      {"GRADCOMM_DETERMINISTIC", "yes", "GRADCOMM_DETERMINISTIC='yes' is invalid: expected 0 or 1"},
      {"GRADCOMM_FUSION_THRESHOLD", "-1", "GRADCOMM_FUSION_THRESHOLD='-1' is invalid"},
      {"GRADCOMM_CALIBRATE", "2", "GRADCOMM_CALIBRATE='2' is invalid: expected 0 or 1"},
      {"GRADCOMM_AUTO_MEASURE", "on", "GRADCOMM_AUTO_MEASURE='on' is invalid: expected 0 or 1"},
      {"GRADCOMM_RANKS_PER_NODE", "0", "GRADCOMM_RANKS_PER_NODE='0' is invalid"},
      {"GRADCOMM_RANKS_PER_NODE", "2.5", "GRADCOMM_RANKS_PER_NODE='2.5' is invalid"},
      {"GRADCOMM_TOPOLOGY", "dgx2", "GRADCOMM_TOPOLOGY='dgx2' is invalid: expected dgx1 or empty"},
      {"GRADCOMM_BIND", "socket",
       "GRADCOMM_BIND='socket' is invalid: expected one of none, core, numa"},
      {"GRADCOMM_TIMEOUT", "-5", "GRADCOMM_TIMEOUT='-5' is invalid"},
      {"GRADCOMM_TIMEOUT", "ten", "GRADCOMM_TIMEOUT='ten' is invalid"},
      {"GRADCOMM_CHECK", "sometimes", "expected one of off, default, full"},
      {"GRADCOMM_DEVICE", "-1", "GRADCOMM_DEVICE='-1' is invalid"},
      {"GRADCOMM_GPU_INTER_NODE", "tcp",
       "GRADCOMM_GPU_INTER_NODE='tcp' is invalid: expected nccl or mpi"},
      {"GRADCOMM_NCCL_BLOCKING", "yes", "GRADCOMM_NCCL_BLOCKING='yes' is invalid: expected 0 or 1"},
      {"GRADCOMM_HIERARCHICAL_INTRA", "nvlink",
       "GRADCOMM_HIERARCHICAL_INTRA='nvlink' is invalid: expected one of auto, direct, ring, shm"},
      {"GRADCOMM_SHM_STORES", "cached", "GRADCOMM_SHM_STORES was removed"},
      {"GRADCOMM_ENGINE_POLL_US", "fast", "GRADCOMM_ENGINE_POLL_US='fast' is invalid"},
      {"GRADCOMM_ENGINE_POLL_US", "1000001", "GRADCOMM_ENGINE_POLL_US='1000001' is invalid"},
      {"GRADCOMM_MPI_MIN_BYTES", "-1", "GRADCOMM_MPI_MIN_BYTES='-1' is invalid"},
      {"GRADCOMM_MPI_MIN_BYTES", "4k", "GRADCOMM_MPI_MIN_BYTES='4k' is invalid"},
      {"GRADCOMM_MPI_LOG", "yes", "GRADCOMM_MPI_LOG='yes' is invalid: expected 0 or 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    setenv(c.name, c.value, 1);
    expect_error<InvalidArgument>([] { Config::from_environment(); }, {c.expected});
    unsetenv(c.name);
  }
  EXPECT_EQ(Config::from_environment().mpi_min_bytes, 4096u);
  setenv("GRADCOMM_SEGMENT_BYTES", "4096", 1);
  setenv("GRADCOMM_LOG_LEVEL", "debug", 1);
  setenv("GRADCOMM_MPI_MIN_BYTES", "0", 1);
  setenv("GRADCOMM_MPI_LOG", "1", 1);
  const Config config = Config::from_environment();
  EXPECT_EQ(config.segment_bytes, 4096u);
  EXPECT_EQ(config.log_level, LogLevel::debug);
  EXPECT_EQ(config.mpi_min_bytes, 0u);
  EXPECT_TRUE(config.mpi_log);
  unsetenv("GRADCOMM_SEGMENT_BYTES");
  unsetenv("GRADCOMM_LOG_LEVEL");
  unsetenv("GRADCOMM_MPI_MIN_BYTES");
  unsetenv("GRADCOMM_MPI_LOG");
}

TEST_F(BadNames, OutOfRangeConfigInCode) {
  Config config;
  config.pipeline_depth = 0;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"Config", "pipeline_depth 0 is outside [1, 64]"});
  config = Config{};
  config.segment_bytes = 8;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"segment_bytes 8 is outside [16, 1073741824]"});
  config = Config{};
  config.tcp_piece_bytes = 100;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"tcp_piece_bytes 100 is outside {0} and [1024, 1073741824]"});
  config = Config{};
  config.engine_poll_us = -1;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"engine_poll_us -1 is outside [0, 1000000]"});
  expect_usable(world());
}

// Ranks that disagree on hierarchical's intra-group form would wait on different protocols:
// every rank gets an error naming the variable instead (at every hierarchical call), and the
// communicator stays usable by the other algorithms.
TEST_F(BadNames, HierarchicalIntraFormDiffersAcrossRanks) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  Config config;
  config.ranks_per_node = 1;
  config.hierarchical_intra = world().rank() == 1 ? "ring" : "direct";
  Communicator comm(MPI_COMM_WORLD, config);
  std::vector<float> data(64, 1.0f);
  expect_error<InvalidArgument>(
      [&] {
        allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum,
                  {.algorithm = "hierarchical"});
      },
      {"allreduce(hierarchical)", "GRADCOMM_HIERARCHICAL_INTRA", "differs across ranks"});
  // Other algorithms still work on it.
  allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum,
            {.algorithm = "ring"});
  EXPECT_EQ(data[0], static_cast<float>(comm.size()));
}

// Ranks whose settings differ where a call's path depends on them (the check's mode, the default
// algorithm, the segment, ...) would wait for each other until the watchdog ends the job: the
// communicator's creation fails on every rank instead, naming the variable and both values.
// Those that may differ (the timeout) do not stop it.
TEST_F(BadNames, SettingsThatMustAgreeDifferAcrossRanks) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const bool last = world().rank() == world().size() - 1;
  const std::string last_rank = "on rank " + std::to_string(world().size() - 1);
  Config config;
  config.check = last ? CheckMode::off : CheckMode::normal;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"Communicator", "GRADCOMM_CHECK differs across ranks",
                                 "'default' on rank 0", "'off' " + last_rank});
  config = Config{};
  config.algorithm = last ? "ring" : "shm";
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"GRADCOMM_ALGORITHM differs", "'ring' " + last_rank});
  config = Config{};
  config.segment_bytes = last ? 4096 : 8192;
  expect_error<InvalidArgument>([&] { Communicator comm(MPI_COMM_WORLD, config); },
                                {"GRADCOMM_SEGMENT_BYTES differs", "'4096' " + last_rank});
  config = Config{};
  config.timeout_seconds = last ? 0 : 60;
  Communicator comm(MPI_COMM_WORLD, config);
  std::vector<float> data(101, 1.0f);
  allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum);
  EXPECT_EQ(data[100], static_cast<float>(comm.size()));
  expect_usable(world());
}

TEST_F(BadNames, NullCommunicator) {
  expect_error<InvalidArgument>([] { Communicator comm(MPI_COMM_NULL); },
                                {"Communicator", "MPI_COMM_NULL"});
  // MPI_Comm_f2c of an unknown index (a null handle in Open MPI, an invalid integer handle in
  // MPICH): an error, not an MPI abort.
  expect_error<InvalidArgument>([] { Communicator comm(MPI_Comm_f2c(123456)); },
                                {"Communicator", "MPI_COMM_NULL or invalid"});
}

TEST_F(BadNames, IntercommunicatorIsRejected) {
  if (world().size() < 2) GTEST_SKIP() << "needs two groups";
  const int rank = world().rank();
  MPI_Comm half = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
  MPI_Intercomm_create(half, 0, MPI_COMM_WORLD, 1 - rank % 2, 7, &inter);
  expect_error<InvalidArgument>([&] { Communicator comm(inter); },
                                {"Communicator", "intercommunicator", "MPI_Intercomm_merge"});
  MPI_Comm_free(&inter);
  MPI_Comm_free(&half);
  expect_usable(world());
}

TEST_F(BadNames, BroadcastRejectsBadInputBeforeCommunication) {
  Communicator& comm = world();
  std::vector<float> buf(8, 1.0f);
  const std::string rank = "rank " + std::to_string(comm.rank());
  expect_error<InvalidArgument>([&] { broadcast(comm, buf.data(), 8, DataType::float32, -1); },
                                {"broadcast", rank, "root -1 is outside [0, "});
  expect_error<InvalidArgument>(
      [&] { broadcast(comm, buf.data(), 8, DataType::float32, comm.size()); },
      {"root " + std::to_string(comm.size()) + " is outside"});
  expect_error<InvalidArgument>([&] { broadcast(comm, nullptr, 8, DataType::float32, 0); },
                                {"buffer is null with 32 bytes"});
  expect_error<InvalidArgument>(
      [&] { broadcast(comm, buf.data(), 8, static_cast<DataType>(42), 0); }, {"invalid dtype 42"});
  expect_error<InvalidArgument>(
      [&] {
        broadcast(comm, buf.data(), std::numeric_limits<std::size_t>::max(), DataType::float32, 0);
      },
      {"overflows size_t"});
  broadcast(comm, nullptr, 0, DataType::float32, 0);  // nothing to send: null is fine
  expect_usable(comm);
}

// Bad input on one rank only: that rank raises its own error; the others, whose call it never
// makes, get a MismatchError naming it at once (before, they waited for it, or met its next call
// of the same shape in the failed call's place: a wrong result), and the next calls pair up.
class BadOnOneRank : public MpiTestWithParam<std::string> {};

TEST_P(BadOnOneRank, FailsOnEveryRankAndTheRanksStayInStep) {
  Communicator& comm = world();
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int bad = comm.size() - 1;
  const bool mine = comm.rank() == bad;
  const auto n = static_cast<std::size_t>(comm.size());
  const std::string what = GetParam();
  std::vector<float> buf(64, 1.0f), out(64 * n);
  const auto f32 = DataType::float32;
  auto run = [&] {
    if (what == "allreduce") {
      allreduce(comm, mine ? nullptr : buf.data(), out.data(), 16, f32, ReduceOp::sum);
    } else if (what == "iallreduce") {
      iallreduce(comm, buf.data(), mine ? nullptr : out.data(), 16, f32, ReduceOp::sum).wait();
    } else if (what == "broadcast") {
      broadcast(comm, buf.data(), 16, f32, mine ? -1 : 0);
    } else if (what == "ibroadcast") {
      ibroadcast(comm, buf.data(), 16, f32, mine ? comm.size() : 0).wait();
    } else if (what == "grouped_allreduce" || what == "igrouped_allreduce") {
      const packing::TensorDesc list[2] = {{buf.data(), 8, f32},
                                           {mine ? nullptr : buf.data() + 8, 8, f32}};
      if (what == "grouped_allreduce") {
        grouped_allreduce(comm, list, ReduceOp::sum);
      } else {
        igrouped_allreduce(comm, list, ReduceOp::sum).wait();
      }
    } else if (what == "reduce_scatter") {  // the bad rank's output overlaps its input
      reduce_scatter(comm, buf.data(), mine ? buf.data() + 1 : out.data(), 2, f32, ReduceOp::sum);
    } else if (what == "allgatherv") {  // the bad rank sends another count than counts says
      const std::vector<std::size_t> counts(n, 2);
      allgatherv(comm, buf.data(), mine ? 3 : 2, out.data(), counts, f32);
    } else if (what == "gather") {
      gather_bytes(comm, buf.data(), out.data(), 16, mine ? -1 : 0);
    } else if (what == "scatter") {
      scatter_bytes(comm, buf.data(), out.data(), 16, mine ? comm.size() : 0);
    } else if (what == "allgather") {
      allgather_bytes(comm, mine ? nullptr : buf.data(), out.data(), 16);
    } else if (what == "alltoall") {  // the bad rank's lists have one entry too many
      const std::vector<std::size_t> sizes(n + (mine ? 1 : 0), 4);
      alltoallv_bytes(comm, buf.data(), sizes, out.data(), sizes);
    }
  };
  if (mine) {
    expect_error<InvalidArgument>(run, {"rank " + std::to_string(bad)});
  } else {
    expect_error<MismatchError>(
        run, {"rank " + std::to_string(comm.rank()),
              "the call failed on rank " + std::to_string(bad) + " before it could run"});
  }
  // In step: each rank's next call meets the others' next call.
  std::vector<float> v(16, static_cast<float>(comm.rank() + 1));
  allreduce(comm, v.data(), v.data(), v.size(), f32, ReduceOp::sum);
  EXPECT_EQ(v[0], static_cast<float>(comm.size() * (comm.size() + 1) / 2));
  std::vector<int> w(5, comm.rank() == bad ? 3 : 0);
  broadcast(comm, w.data(), w.size(), DataType::int32, bad);
  EXPECT_EQ(w, std::vector<int>(5, 3));
}

INSTANTIATE_TEST_SUITE_P(FrontDoors, BadOnOneRank,
                         ::testing::Values("allreduce", "iallreduce", "broadcast", "ibroadcast",
                                           "grouped_allreduce", "igrouped_allreduce",
                                           "reduce_scatter", "allgatherv", "gather", "scatter",
                                           "allgather", "alltoall"));

class OneRankFails : public MpiTest {};

// A refused nonblocking call does not make its caller wait for the other ranks: its stand-in is
// queued on its communicator's engine. Rank `bad` is refused on `a`, then makes a call on `b`
// that the other ranks make before theirs on `a`: with a stand-in that waited there, every rank
// would wait for the others until the watchdog.
TEST_F(OneRankFails, ARefusedNonblockingCallDoesNotWaitForTheOthers) {
  Communicator& a = world();
  if (a.size() < 2) GTEST_SKIP() << "needs two ranks";
  Communicator b(MPI_COMM_WORLD);
  const int bad = a.size() - 1;
  std::vector<float> x(16, 1.0f), y(16, static_cast<float>(a.rank() + 1));
  const float sum = static_cast<float>(a.size() * (a.size() + 1) / 2);
  if (a.rank() == bad) {
    expect_error<InvalidArgument>(
        [&] { iallreduce(a, x.data(), nullptr, 16, DataType::float32, ReduceOp::sum); },
        {"recvbuf is null"});
    allreduce(b, y.data(), y.data(), 16, DataType::float32, ReduceOp::sum);
  } else {
    allreduce(b, y.data(), y.data(), 16, DataType::float32, ReduceOp::sum);
    expect_error<MismatchError>(
        [&] { iallreduce(a, x.data(), x.data(), 16, DataType::float32, ReduceOp::sum).wait(); },
        {"the call failed on rank " + std::to_string(bad) + " before it could run"});
  }
  EXPECT_EQ(y[0], sum);
  expect_usable(a);
  expect_usable(b);
}

// A call that fails on one rank after its CallScope began but before it was compared (a set-up
// that failed there only) is compared as a failed call: the others fail too, naming the rank.
TEST_F(OneRankFails, AfterItsScopeBeganBeforeItWasCompared) {
  Communicator& comm = world();
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int bad = comm.size() - 1;
  std::vector<float> x(16, 1.0f);
  if (comm.rank() == bad) {
    try {
      collectives::CallInfo info;
      info.sequence = comm.next_sequence();
      info.count = 16;
      info.dtype = static_cast<int>(DataType::float32);
      info.op = static_cast<int>(ReduceOp::sum);
      collectives::CallScope scope(comm, info, "allreduce");
      throw Unsupported("a set-up that fails on this rank only");
    } catch (const Unsupported&) {
    }
  } else {
    expect_error<MismatchError>(
        [&] { allreduce(comm, x.data(), x.data(), 16, DataType::float32, ReduceOp::sum); },
        {"the call failed on rank " + std::to_string(bad) + " before it could run", "allreduce #"});
  }
  expect_usable(comm);
}

}  // namespace
}  // namespace gradcomm::testing
