// Non-blocking collectives (iallreduce, igrouped_allreduce, ibroadcast) and the Reducer:
// - every request's result is bit-identical to the blocking call's on the same input with the
//   same algorithm (auto with measuring off, so it picks alike), and identical on every rank;
//   exact inputs also match a serial sum;
// - many requests in flight, two communicators at once (submitted in opposite orders on
//   alternate ranks), waits in another order than submission, a request destroyed unwaited, a
//   request never polled, a blocking call behind requests;
// - errors: bad input at submission, a mismatch between ranks from wait() on every rank;
// - the Reducer: bucket plans, rebuild from rank 0's order, uneven and mixed-dtype tensors,
//   results equal to blocking all-reduces of the same buckets; an iteration that fails on one
//   rank (or on every rank alike) fails on every rank, and the next one is exact.

#include <gmock/gmock.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/progress_engine.h"
#include "packing/grouped_allreduce.h"
#include "packing/reducer.h"
#include "tests/mpi_test.h"

namespace gradcomm::testing {
namespace {

using packing::Reducer;
using packing::ReducerBucket;
using packing::ReducerOptions;
using packing::TensorDesc;

class NonBlocking : public MpiTest {};
class NonBlockingAlgorithm : public MpiTestWithParam<std::string> {};

// Random floats (different on every rank and call): bit-identity with the blocking call is the
// point, not exactness.
std::vector<float> random_input(std::size_t count, int rank, unsigned salt) {
  std::mt19937 rng(1234u + static_cast<unsigned>(rank) * 7919u + salt);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v)
    x = dist(rng);
  return v;
}

bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Sizes where algorithms split differently: empty, one, below the rank count, primes, a count
// that no rank count divides, and one past a power of two large enough to take every path.
constexpr std::size_t kSizes[] = {0, 1, 3, 1009, 65537, (std::size_t{1} << 19) + 3};

TEST_P(NonBlockingAlgorithm, EqualsBlockingBitForBit) {
  const std::string algorithm = GetParam();
  // auto's learner may switch a size's algorithm between any two calls (a duel, a re-check), and
  // two algorithms round random floats differently. With measuring off the model alone picks, so
  // the three calls of a size get the same algorithm, as the comparison needs.
  Config model_only;
  model_only.auto_measure = false;
  std::unique_ptr<Communicator> own;
  if (algorithm == "auto") own = std::make_unique<Communicator>(MPI_COMM_WORLD, model_only);
  Communicator& comm = own ? *own : world();
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    for (std::size_t count : kSizes) {
      const unsigned salt = static_cast<unsigned>(count) + 31u * static_cast<unsigned>(op);
      const std::vector<float> input = random_input(count, comm.rank(), salt);
      std::vector<float> blocking(count), nonblocking(count), in_place = input;
      allreduce(comm, input.data(), blocking.data(), count, DataType::float32, op,
                {.algorithm = algorithm});
      Request out = iallreduce(comm, input.data(), nonblocking.data(), count, DataType::float32, op,
                               {.algorithm = algorithm});
      Request in = iallreduce(comm, in_place.data(), in_place.data(), count, DataType::float32, op,
                              {.algorithm = algorithm});
      out.wait();
      in.wait();
      EXPECT_FALSE(out.active());
      EXPECT_TRUE(bits_equal(blocking, nonblocking))
          << algorithm << " op " << static_cast<int>(op) << " count " << count;
      EXPECT_TRUE(bits_equal(blocking, in_place))
          << algorithm << " in place, op " << static_cast<int>(op) << " count " << count;
      EXPECT_TRUE(same_on_all_ranks(comm.mpi_comm(),
                                    fingerprint(nonblocking.data(), count * sizeof(float))));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, NonBlockingAlgorithm,
                         ::testing::ValuesIn(collectives::host_algorithm_names()),
                         [](const auto& info) { return info.param; });

// Small integers: every order of summation gives the same float, so the serial sum is exact.
TEST_F(NonBlocking, ManyRequestsInFlightMatchTheSerialSum) {
  Communicator& comm = world();
  const int n = comm.size();
  constexpr int kRequests = 48;
  std::vector<std::vector<float>> buffers;
  std::vector<Request> requests;
  for (int k = 0; k < kRequests; ++k) {
    const std::size_t count = 1 + static_cast<std::size_t>(k) * 977 % 20011;
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i)
      v[i] = static_cast<float>((comm.rank() + k + static_cast<int>(i % 13)) % 9);
    buffers.push_back(std::move(v));
  }
  for (int k = 0; k < kRequests; ++k) {
    std::vector<float>& v = buffers[static_cast<std::size_t>(k)];
    requests.push_back(iallreduce(comm, v.data(), v.data(), v.size(), DataType::float32,
                                  ReduceOp::sum, {.algorithm = k % 2 ? "ring" : "auto"}));
  }
  Request::wait_all(requests);
  for (int k = 0; k < kRequests; ++k) {
    const std::vector<float>& v = buffers[static_cast<std::size_t>(k)];
    for (std::size_t i = 0; i < v.size(); ++i) {
      float expected = 0;
      for (int r = 0; r < n; ++r)
        expected += static_cast<float>((r + k + static_cast<int>(i % 13)) % 9);
      ASSERT_EQ(v[i], expected) << "request " << k << " element " << i;
    }
  }
}

// The engine polls for Config::engine_poll_us before it sleeps. Requests submitted back to back
// (inside a 50 us or 20 ms window), after a 2 ms pause (past a 50 us window: the engine asleep,
// woken) and with no window at all each give the serial sum, and each communicator is destroyed
// while its engine polls. Whether a given submission skipped the wake, and how soon a destroyed
// engine stops polling, are timing, measured by gradcomm-nonblocking-bench, not asserted here.
TEST_F(NonBlocking, SubmissionsDuringAndAfterTheEnginesPollFinish) {
  for (int poll_us : {0, 50, 20000}) {
    SCOPED_TRACE("engine_poll_us " + std::to_string(poll_us));
    Config config;
    config.engine_poll_us = poll_us;
    Communicator comm(MPI_COMM_WORLD, config);
    const int n = comm.size();
    std::vector<float> v(1009);
    for (int k = 0; k < 6; ++k) {
      // Back to back (inside any window), then after a pause longer than 50 us.
      if (k == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::fill(v.begin(), v.end(), static_cast<float>(comm.rank() + k));
      iallreduce(comm, v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum).wait();
      const float expected = static_cast<float>(n * (n - 1) / 2 + n * k);
      ASSERT_EQ(std::count(v.begin(), v.end(), expected), static_cast<long>(v.size()))
          << "call " << k;
    }
  }
}

// One engine per communicator: ranks that submit on two communicators in opposite orders still
// finish (one engine for both would run A before B on some ranks and B before A on others).
TEST_F(NonBlocking, TwoCommunicatorsSubmittedInOppositeOrders) {
  Communicator& comm = world();
  Communicator a(comm.mpi_comm());
  Communicator b(comm.mpi_comm());
  const int n = comm.size();
  std::vector<double> x(40000, comm.rank() + 1.0), y(30011, 2.0 * comm.rank());
  Request rx, ry;
  if (comm.rank() % 2 == 0) {
    rx = iallreduce(a, x.data(), x.data(), x.size(), DataType::float64, ReduceOp::sum,
                    {.algorithm = "ring"});
    ry = iallreduce(b, y.data(), y.data(), y.size(), DataType::float64, ReduceOp::sum,
                    {.algorithm = "ring"});
  } else {
    ry = iallreduce(b, y.data(), y.data(), y.size(), DataType::float64, ReduceOp::sum,
                    {.algorithm = "ring"});
    rx = iallreduce(a, x.data(), x.data(), x.size(), DataType::float64, ReduceOp::sum,
                    {.algorithm = "ring"});
  }
  ry.wait();
  rx.wait();
  EXPECT_EQ(x.back(), n * (n + 1) / 2.0);
  EXPECT_EQ(y.front(), 2.0 * (n * (n - 1) / 2.0));
}

TEST_F(NonBlocking, WaitedInAnotherOrderThanSubmitted) {
  Communicator& comm = world();
  const int n = comm.size();
  std::vector<std::vector<std::int64_t>> buffers;
  std::vector<Request> requests;
  for (int k = 0; k < 8; ++k)
    buffers.emplace_back(static_cast<std::size_t>(1000 * k + 1), comm.rank() + k);
  for (auto& v : buffers) {
    requests.push_back(
        iallreduce(comm, v.data(), v.data(), v.size(), DataType::int64, ReduceOp::sum));
  }
  for (int k = 7; k >= 0; --k) {
    requests[static_cast<std::size_t>(k)].wait();
    const std::int64_t expected = n * (n - 1) / 2 + static_cast<std::int64_t>(n) * k;
    EXPECT_EQ(buffers[static_cast<std::size_t>(k)].back(), expected) << "request " << k;
  }
}

TEST_F(NonBlocking, DestroyingAnUnfinishedRequestWaitsForIt) {
  Communicator& comm = world();
  std::vector<float> v(1 << 18, 1.0f);
  {
    Request r = iallreduce(comm, v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum,
                           {.algorithm = "ring"});
  }  // the destructor waits: the buffer holds the result afterwards
  EXPECT_EQ(v.front(), static_cast<float>(comm.size()));
  EXPECT_EQ(v.back(), static_cast<float>(comm.size()));
  // Assigning over an unfinished request waits for the old one too.
  std::vector<float> w(1 << 16, 2.0f);
  Request r = iallreduce(comm, v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum);
  r = iallreduce(comm, w.data(), w.data(), w.size(), DataType::float32, ReduceOp::sum);
  EXPECT_EQ(v.back(), static_cast<float>(comm.size() * comm.size()));
  r.wait();
  EXPECT_EQ(w.back(), 2.0f * static_cast<float>(comm.size()));
}

// test() is one atomic load: no MPI call, no progress made by the caller. The request finishes
// while the caller sleeps.
TEST_F(NonBlocking, ARequestNeverPolledCompletesWhileTheCallerSleeps) {
  Communicator& comm = world();
  std::vector<float> v(1 << 17, 3.0f);
  Request r = iallreduce(comm, v.data(), v.data(), v.size(), DataType::float32, ReduceOp::sum,
                         {.algorithm = "ring"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool done = false;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    done = r.test();
  }
  ASSERT_TRUE(done) << "the request did not finish within 60 s of sleep";
  EXPECT_EQ(v.back(), 3.0f * static_cast<float>(comm.size()));
}

TEST_F(NonBlocking, BlockingCallsQueueBehindRequests) {
  Communicator& comm = world();
  const int n = comm.size();
  std::vector<double> v(100003, 1.0);
  Request r = iallreduce(comm, v.data(), v.data(), v.size(), DataType::float64, ReduceOp::sum,
                         {.algorithm = "ring"});
  // Runs after the request: it reads the request's result.
  allreduce(comm, v.data(), v.data(), v.size(), DataType::float64, ReduceOp::sum,
            {.algorithm = "ring"});
  r.wait();  // finished before the blocking call began
  EXPECT_EQ(v.back(), static_cast<double>(n) * n);
}

// A blocking call that other threads may submit around (the torch backend's): run_exclusive
// starts after the requests before it, and no request starts while it runs, not even one
// submitted meanwhile; drain() inside it returns at once instead of waiting for that request.
TEST_F(NonBlocking, RunExclusiveHoldsOffRequestsSubmittedMeanwhile) {
  Communicator& comm = world();
  std::vector<double> v(1009, 1.0);
  Request before = iallreduce(comm, v.data(), v.data(), v.size(), DataType::float64, ReduceOp::sum,
                              {.algorithm = "ring"});
  ProgressEngine& engine = comm.engine();
  std::atomic<bool> ran{false};
  auto meanwhile = std::make_shared<detail::RequestState>();
  meanwhile->call = "test";
  meanwhile->work = [&] { ran.store(true); };
  engine.run_exclusive([&] {
    EXPECT_FALSE(engine.busy());  // the request before it has run
    EXPECT_EQ(v.back(), static_cast<double>(comm.size()));
    std::thread other([&] { engine.submit(meanwhile); });
    other.join();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    engine.drain();  // at once
    EXPECT_FALSE(ran.load());
    // A blocking call inside it runs (its settle() returns at once too).
    allreduce(comm, v.data(), v.data(), v.size(), DataType::float64, ReduceOp::sum,
              {.algorithm = "ring"});
  });
  engine.drain();
  EXPECT_TRUE(ran.load());
  before.wait();
  EXPECT_EQ(v.back(), static_cast<double>(comm.size()) * comm.size());
}

TEST_F(NonBlocking, GroupedAndBroadcastEqualTheirBlockingForms) {
  Communicator& comm = world();
  std::vector<float> a = random_input(5003, comm.rank(), 1), b = random_input(17, comm.rank(), 2);
  std::vector<double> c(1000, comm.rank() * 0.5);
  std::vector<float> a2 = a, b2 = b;
  std::vector<double> c2 = c;
  std::vector<TensorDesc> blocking = {{a.data(), a.size(), DataType::float32},
                                      {b.data(), b.size(), DataType::float32},
                                      {c.data(), c.size(), DataType::float64}};
  std::vector<TensorDesc> nonblocking = {{a2.data(), a2.size(), DataType::float32},
                                         {b2.data(), b2.size(), DataType::float32},
                                         {c2.data(), c2.size(), DataType::float64}};
  grouped_allreduce(comm, blocking, ReduceOp::avg, {.algorithm = "ring"});
  Request g = igrouped_allreduce(comm, nonblocking, ReduceOp::avg, {.algorithm = "ring"});
  nonblocking.clear();  // the request keeps its own copy of the list
  g.wait();
  EXPECT_TRUE(bits_equal(a, a2));
  EXPECT_TRUE(bits_equal(b, b2));
  EXPECT_EQ(std::memcmp(c.data(), c2.data(), c.size() * sizeof(double)), 0);

  const int root = comm.size() - 1;
  std::vector<std::int32_t> x(70001, comm.rank() == root ? 42 : -1);
  Request bc = ibroadcast(comm, x.data(), x.size(), DataType::int32, root);
  bc.wait();
  EXPECT_EQ(x.front(), 42);
  EXPECT_EQ(x.back(), 42);
}

TEST_F(NonBlocking, BadInputIsRejectedAtSubmission) {
  Communicator& comm = world();
  const std::uint64_t before = comm.engine().submitted();
  std::vector<float> v(8);
  EXPECT_THROW(iallreduce(comm, nullptr, v.data(), 8, DataType::float32, ReduceOp::sum),
               InvalidArgument);
  EXPECT_THROW(iallreduce(comm, v.data(), v.data(), 8, DataType::float32, ReduceOp::sum,
                          {.algorithm = "no-such-algorithm"}),
               InvalidArgument);
  EXPECT_THROW(iallreduce(comm, v.data(), v.data() + 1, 7, DataType::float32, ReduceOp::sum),
               InvalidArgument);
  EXPECT_THROW(ibroadcast(comm, v.data(), v.size(), DataType::float32, comm.size()),
               InvalidArgument);
  std::vector<TensorDesc> overlapping = {{v.data(), 8, DataType::float32},
                                         {v.data() + 4, 4, DataType::float32}};
  EXPECT_THROW(igrouped_allreduce(comm, overlapping, ReduceOp::sum), InvalidArgument);
  try {
    iallreduce(comm, nullptr, v.data(), 8, DataType::float32, ReduceOp::sum);
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("iallreduce("));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("sendbuf is null"));
  }
  // Nothing of the refused calls was submitted; with other ranks to keep in step, each queued
  // only its stand-in in the call check (collectives::KeepInStep), which they all agree on.
  const bool stand_ins = comm.size() > 1 && comm.config().check != CheckMode::off;
  EXPECT_EQ(comm.engine().submitted(), before + (stand_ins ? 6 : 0));
  std::vector<int> after(3, 1);  // the communicator works after them, on every rank
  allreduce(comm, after.data(), after.data(), after.size(), DataType::int32, ReduceOp::sum);
  EXPECT_EQ(after[0], comm.size());
}

// Rank 0 reduces one element more than the others: every rank's wait() throws, and the
// communicator works afterwards.
TEST_F(NonBlocking, AMismatchSurfacesFromWaitOnEveryRank) {
  Communicator& comm = world();
  if (comm.size() == 1 || comm.config().check == CheckMode::off) GTEST_SKIP();
  std::vector<float> v(1001, 1.0f);
  const std::size_t count = comm.rank() == 0 ? 1001 : 1000;
  Request r = iallreduce(comm, v.data(), v.data(), count, DataType::float32, ReduceOp::sum,
                         {.algorithm = "ring"});
  bool threw = false;
  try {
    r.wait();
  } catch (const MismatchError& e) {
    threw = true;
    EXPECT_THAT(e.what(), ::testing::HasSubstr("1001"));
  }
  EXPECT_TRUE(threw);
  std::vector<float> w(64, 1.0f);
  iallreduce(comm, w.data(), w.data(), w.size(), DataType::float32, ReduceOp::sum).wait();
  EXPECT_EQ(w.back(), static_cast<float>(comm.size()));
}

// ---- The Reducer ----

std::vector<TensorDesc> descs(std::vector<std::vector<float>>& tensors) {
  std::vector<TensorDesc> out;
  for (auto& t : tensors)
    out.push_back({t.data(), t.size(), DataType::float32});
  return out;
}

TEST_F(NonBlocking, ReducerPlansBucketsLikeDdp) {
  // Sizes in bytes: 400 KiB, 400 KiB, 400 KiB, 4 KiB, 2 MiB (float32), reverse order expected.
  std::vector<float> t0(102400), t1(102400), t2(102400), t3(1024), t4(524288);
  std::vector<double> d0(10), d1(131072);
  std::vector<TensorDesc> tensors = {
      {t0.data(), t0.size(), DataType::float32}, {t1.data(), t1.size(), DataType::float32},
      {d0.data(), d0.size(), DataType::float64}, {t2.data(), t2.size(), DataType::float32},
      {t3.data(), t3.size(), DataType::float32}, {d1.data(), d1.size(), DataType::float64},
      {t4.data(), t4.size(), DataType::float32}};
  ReducerOptions o;
  o.first_bucket_bytes = 1 << 20;
  o.bucket_cap_bytes = 3 << 20;
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.rbegin(), order.rend(), std::size_t{0});
  const std::vector<ReducerBucket> plan = packing::plan_reducer_buckets(tensors, order, o);
  // float32 in order 6, 4, 3, 1, 0: {6} closes the first (2 MiB >= 1 MiB); {4, 3, 1, 0} stays
  // under 3 MiB. float64: {5} (1 MiB >= 1 MiB), then {2}. By first expected tensor: 6, 5, 4.., 2.
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_THAT(plan[0].tensors, ::testing::ElementsAre(6));
  EXPECT_THAT(plan[1].tensors, ::testing::ElementsAre(5));
  EXPECT_THAT(plan[2].tensors, ::testing::ElementsAre(4, 3, 1, 0));
  EXPECT_THAT(plan[3].tensors, ::testing::ElementsAre(2));
  EXPECT_EQ(plan[2].dtype, DataType::float32);
  EXPECT_EQ(plan[3].dtype, DataType::float64);
  EXPECT_THAT(plan[2].offsets, ::testing::ElementsAre(0, 1024, 1024 + 102400, 1024 + 204800));
  for (const ReducerBucket& b : plan)
    EXPECT_EQ(b.byte_offset % 64, 0u);
  EXPECT_EQ(plan[1].byte_offset, 2u << 20);

  // Explicit groups (Horovod's): {0, 2, 4} and {6, 1}; 3 and 5 stand alone. Group {0, 2, 4} holds
  // two dtypes, so it gives two buckets; caps no longer close buckets. By first expected tensor
  // (order 6, 5, 4, 3, 2, 1, 0): {6, 1}, {5}, {4, 0}, {3}, {2}.
  o.groups = {{0, 2, 4}, {6, 1}};
  const std::vector<ReducerBucket> grouped = packing::plan_reducer_buckets(tensors, order, o);
  ASSERT_EQ(grouped.size(), 5u);
  EXPECT_THAT(grouped[0].tensors, ::testing::ElementsAre(6, 1));
  EXPECT_THAT(grouped[1].tensors, ::testing::ElementsAre(5));
  EXPECT_THAT(grouped[2].tensors, ::testing::ElementsAre(4, 0));
  EXPECT_THAT(grouped[3].tensors, ::testing::ElementsAre(3));
  EXPECT_THAT(grouped[4].tensors, ::testing::ElementsAre(2));
  EXPECT_EQ(grouped[4].dtype, DataType::float64);
  // A tensor in two groups, or out of range, is refused before any communication.
  o.groups = {{0, 1}, {1}};
  EXPECT_THROW(Reducer(world(), tensors, o), InvalidArgument);
  o.groups = {{7}};
  EXPECT_THROW(Reducer(world(), tensors, o), InvalidArgument);
}

// Uneven float32 and float64 tensors (one empty), marked in rank-dependent orders; three
// iterations, each compared bit for bit with blocking all-reduces of the same buckets (packed by
// hand). Iteration 0 reduces small integers and is also checked against the serial sum; the
// others reduce random floats. Rank 0 marks forward, so the rebuilt buckets follow that order.
TEST_F(NonBlocking, ReducerEqualsBlockingAllreducesOfItsBuckets) {
  Communicator& comm = world();
  const int n = comm.size();
  const std::size_t counts[] = {7, 1009, 0, 65537, 3, 20011, 4099};
  const std::size_t m = std::size(counts);
  std::vector<std::vector<double>> storage;  // float64 storage; float32 tensors use half of it
  std::vector<TensorDesc> tensors;
  for (std::size_t k = 0; k < m; ++k) {
    storage.emplace_back(counts[k]);
    const DataType dtype = k % 3 == 1 ? DataType::float64 : DataType::float32;
    tensors.push_back({storage.back().data(), counts[k], dtype});
  }
  ReducerOptions o;
  o.first_bucket_bytes = 4096;
  o.bucket_cap_bytes = 100000;
  o.op = ReduceOp::sum;
  o.algorithm = "ring";
  Reducer reducer(comm, tensors, o);
  EXPECT_GT(reducer.buckets().size(), 2u);
  auto set = [](const TensorDesc& t, std::size_t i, double v) {
    if (t.dtype == DataType::float64) {
      static_cast<double*>(t.data)[i] = v;
    } else {
      static_cast<float*>(t.data)[i] = static_cast<float>(v);
    }
  };
  auto get = [](const TensorDesc& t, std::size_t i) {
    return t.dtype == DataType::float64 ? static_cast<double*>(t.data)[i]
                                        : static_cast<double>(static_cast<float*>(t.data)[i]);
  };
  for (int iteration = 0; iteration < 3; ++iteration) {
    auto exact = [&](int rank, std::size_t k, std::size_t i) {
      return static_cast<double>((rank * 3 + static_cast<int>(k) + static_cast<int>(i % 11)) % 10);
    };
    std::mt19937 values(static_cast<unsigned>(comm.rank() * 131 + iteration));
    std::uniform_real_distribution<double> dist(-1, 1);
    for (std::size_t k = 0; k < m; ++k) {
      for (std::size_t i = 0; i < counts[k]; ++i)
        set(tensors[k], i, iteration == 0 ? exact(comm.rank(), k, i) : dist(values));
    }
    // The reference: this iteration's buckets packed by hand and reduced by the blocking call.
    std::vector<std::vector<std::byte>> reference;
    for (const ReducerBucket& b : reducer.buckets()) {
      const std::size_t es = element_size(b.dtype);
      std::vector<std::byte> packed(b.count * es);
      for (std::size_t j = 0; j < b.tensors.size(); ++j) {
        const TensorDesc& t = tensors[b.tensors[j]];
        if (t.count) std::memcpy(packed.data() + b.offsets[j] * es, t.data, t.count * es);
      }
      allreduce(comm, packed.data(), packed.data(), b.count, b.dtype, ReduceOp::sum,
                {.algorithm = "ring"});
      reference.push_back(std::move(packed));
    }
    const std::vector<ReducerBucket> used(reducer.buckets().begin(), reducer.buckets().end());
    std::vector<std::size_t> order(m);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::mt19937 shuffle(static_cast<unsigned>(comm.rank() * 31 + iteration));
    if (comm.rank() != 0) std::shuffle(order.begin(), order.end(), shuffle);
    for (std::size_t k : order)
      reducer.mark_ready(k);
    reducer.finish();
    for (std::size_t b = 0; b < used.size(); ++b) {
      const std::size_t es = element_size(used[b].dtype);
      for (std::size_t j = 0; j < used[b].tensors.size(); ++j) {
        const TensorDesc& t = tensors[used[b].tensors[j]];
        if (t.count == 0) continue;
        EXPECT_EQ(std::memcmp(t.data, reference[b].data() + used[b].offsets[j] * es, t.count * es),
                  0)
            << "iteration " << iteration << " tensor " << used[b].tensors[j];
      }
    }
    if (iteration == 0) {
      for (std::size_t k = 0; k < m; ++k) {
        for (std::size_t i = 0; i < counts[k]; ++i) {
          double expected = 0;
          for (int r = 0; r < n; ++r)
            expected += exact(r, k, i);
          ASSERT_EQ(get(tensors[k], i), expected) << "tensor " << k << " element " << i;
        }
      }
      EXPECT_TRUE(reducer.rebuilt());
      // The rebuilt plan is rank 0's order (forward) planned afresh.
      std::vector<std::size_t> forward(m);
      std::iota(forward.begin(), forward.end(), std::size_t{0});
      const auto expected = packing::plan_reducer_buckets(tensors, forward, o);
      ASSERT_EQ(reducer.buckets().size(), expected.size());
      for (std::size_t b = 0; b < expected.size(); ++b)
        EXPECT_EQ(reducer.buckets()[b].tensors, expected[b].tensors);
    }
    for (std::size_t k = 0; k < m; ++k) {
      EXPECT_TRUE(
          same_on_all_ranks(comm.mpi_comm(), fingerprint(tensors[k].data, tensors[k].bytes())));
    }
  }
  EXPECT_EQ(reducer.iterations(), 3u);
}

// Gradients produced straight into the buckets (bucket_view) are not copied, and results land
// there; unmarked tensors are reduced as they are at finish(); bad marks are refused and fail
// the iteration (on every rank alike here: each rank gets its own error, not a mismatch).
TEST_F(NonBlocking, ReducerBucketViewsUnmarkedTensorsAndBadMarks) {
  Communicator& comm = world();
  const int n = comm.size();
  std::vector<float> a(3000, 1.0f), b(5000, 2.0f), c(11, 3.0f);
  std::vector<std::vector<float>> all = {a, b, c};
  std::vector<TensorDesc> tensors = descs(all);
  ReducerOptions o;
  o.first_bucket_bytes = 8192;
  Reducer reducer(comm, tensors, o);
  auto* view = static_cast<float*>(reducer.bucket_view(1));
  std::fill(view, view + 5000, static_cast<float>(comm.rank()));
  reducer.mark_ready(1, view);
  reducer.mark_ready(2);
  reducer.finish();  // tensor 0 was never marked: reduced as it is
  const float mean_rank = static_cast<float>(n - 1) / 2.0f;
  EXPECT_EQ(view[4999], mean_rank);
  EXPECT_EQ(all[1][0], 2.0f);  // not written: this iteration's gradient lived in the view
  EXPECT_EQ(all[0][2999], 1.0f);
  EXPECT_EQ(all[2][10], 3.0f);

  for (int bad = 0; bad < 3; ++bad) {
    reducer.mark_ready(1);
    if (bad == 0) {
      EXPECT_THROW(reducer.mark_ready(1), InvalidArgument);
    } else if (bad == 1) {
      EXPECT_THROW(reducer.mark_ready(3), InvalidArgument);
    } else {
      EXPECT_THROW(reducer.mark_ready(0, nullptr), InvalidArgument);
    }
    EXPECT_THAT([&] { reducer.finish(); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    ::testing::HasSubstr("this rank's iteration failed (Reducer::mark_ready")));
    EXPECT_EQ(all[0][2999], 1.0f);  // nothing written back
  }
  all[0].assign(3000, static_cast<float>(comm.rank()));
  reducer.finish();  // the next iteration starts clean
  EXPECT_EQ(all[0][2999], mean_rank);
}

// One rank's iteration fails part way (fail_iteration, or a mark refused there only), with and
// without overlap, after some buckets were launched: every other rank gets a MismatchError
// naming it within seconds (never a wait for the watchdog, never a sum without its gradients),
// the failed rank its own error; no tensor is written back on any rank; the next iteration is
// exact everywhere, and the reducer plans its buckets again after it (the failed iteration did
// not count).
TEST_F(NonBlocking, ReducerIterationFailedOnOneRankFailsOnEveryRank) {
  Communicator& comm = world();
  const int n = comm.size();
  const int bad = n - 1;
  const std::size_t counts[] = {4099, 1, 2003, 0, 1031, 65537, 7};
  const std::size_t m = std::size(counts);
  for (const bool overlap : {true, false}) {
    for (const bool refused : {false, true}) {
      std::vector<std::vector<float>> all;
      for (const std::size_t c : counts)
        all.emplace_back(c, 0.0f);
      std::vector<TensorDesc> tensors = descs(all);
      ReducerOptions o;
      o.first_bucket_bytes = 4096;
      o.bucket_cap_bytes = 8192;
      o.op = ReduceOp::sum;
      o.overlap = overlap;
      Reducer reducer(comm, tensors, o);
      ASSERT_GE(reducer.buckets().size(), 3u);
      auto fill = [&](int iteration) {
        for (std::size_t k = 0; k < m; ++k) {
          for (std::size_t i = 0; i < counts[k]; ++i)
            all[k][i] = static_cast<float>((comm.rank() + iteration + k + i % 7) % 5);
        }
      };
      fill(0);
      const auto started = std::chrono::steady_clock::now();
      const std::vector<std::size_t> order = [&] {  // backward's order: the last tensor first
        std::vector<std::size_t> v(m);
        std::iota(v.rbegin(), v.rend(), std::size_t{0});
        return v;
      }();
      std::string error;
      try {
        for (std::size_t j = 0; j < m; ++j) {
          if (comm.rank() == bad && n > 1 && j == m / 2) {
            if (refused) {
              EXPECT_THROW(reducer.mark_ready(order[0]), InvalidArgument);  // marked twice
            } else {
              reducer.fail_iteration("gradient 3 refused by the test");
            }
          }
          reducer.mark_ready(order[j]);
        }
        reducer.finish();
      } catch (const MismatchError& e) {
        error = std::string("mismatch: ") + e.what();
      } catch (const InvalidArgument& e) {
        error = std::string("own: ") + e.what();
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      SCOPED_TRACE("overlap " + std::to_string(overlap) + " refused " + std::to_string(refused));
      EXPECT_LT(seconds, 10.0);
      if (n == 1) {
        EXPECT_EQ(error, "");
      } else if (comm.rank() == bad) {
        EXPECT_THAT(error, ::testing::HasSubstr("own: "));
        EXPECT_THAT(error, ::testing::HasSubstr(refused ? "already marked ready"
                                                        : "gradient 3 refused by the test"));
      } else {
        EXPECT_THAT(error, ::testing::HasSubstr("mismatch: "));
        EXPECT_THAT(error, ::testing::HasSubstr("failed on rank " + std::to_string(bad)));
        for (std::size_t k = 0; k < m; ++k) {  // nothing written back: each holds its input
          for (std::size_t i = 0; i < counts[k]; ++i) {
            ASSERT_EQ(all[k][i], static_cast<float>((comm.rank() + k + i % 7) % 5)) << k;
          }
        }
      }
      EXPECT_EQ(reducer.iterations(), n == 1 ? 1u : 0u);
      // The next iteration, exact on every rank.
      fill(1);
      for (const std::size_t k : order)
        reducer.mark_ready(k);
      reducer.finish();
      for (std::size_t k = 0; k < m; ++k) {
        for (std::size_t i = 0; i < counts[k]; ++i) {
          float expected = 0;
          for (int r = 0; r < n; ++r)
            expected += static_cast<float>((r + 1 + k + i % 7) % 5);
          ASSERT_EQ(all[k][i], expected) << "tensor " << k << " element " << i;
        }
      }
      EXPECT_TRUE(reducer.rebuilt());  // after the first iteration that completed
    }
  }
}

// Every rank's iteration fails alike: the stand-ins agree, so each rank has only its own error
// (no MismatchError), and the ranks stay in step.
TEST_F(NonBlocking, ReducerIterationFailedOnEveryRankAlike) {
  Communicator& comm = world();
  const int n = comm.size();
  std::vector<std::vector<float>> all = {std::vector<float>(3001, 1.0f),
                                         std::vector<float>(5003, 1.0f)};
  std::vector<TensorDesc> tensors = descs(all);
  ReducerOptions o;
  o.first_bucket_bytes = 4096;
  o.bucket_cap_bytes = 4096;
  Reducer reducer(comm, tensors, o);
  reducer.mark_ready(1);
  reducer.fail_iteration("every rank");
  EXPECT_THAT([&] { reducer.finish(); },
              ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("every rank")));
  reducer.finish();
  EXPECT_EQ(all[0][3000], static_cast<float>(1));  // the average of ones
  EXPECT_EQ(all[1][0], static_cast<float>(1));
  (void)n;
}

TEST_F(NonBlocking, ReducerRejectsBadOptionsBeforeCommunicating) {
  Communicator& comm = world();
  std::vector<float> a(10);
  std::vector<TensorDesc> tensors = {{a.data(), a.size(), DataType::float32}};
  ReducerOptions o;
  o.order = {1};
  EXPECT_THROW(Reducer(comm, tensors, o), InvalidArgument);
  o.order = {};
  o.algorithm = "nope";
  EXPECT_THROW(Reducer(comm, tensors, o), InvalidArgument);
  o.algorithm = {};
  o.bucket_cap_bytes = 0;
  EXPECT_THROW(Reducer(comm, tensors, o), InvalidArgument);
}

}  // namespace
}  // namespace gradcomm::testing
