// Core pieces without MPI: 16-bit float conversions against independent references, and the
// reduction kernels against a scalar reference, for every dtype and op, on unaligned ranges.

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/data_type.h"
#include "core/half.h"
#include "core/progress_engine.h"
#include "core/reduce_kernels.h"
#include "core/request.h"
#include "core/watchdog.h"

namespace gradcomm {
namespace {

TEST(Half, EveryFloat16RoundTripsThroughFloat32) {
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = half_bits_to_float(h);
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (nan) {
      // NaNs stay NaN, quieted, with their payload (what the F16C instructions do too).
      EXPECT_TRUE(std::isnan(f)) << bits;
      EXPECT_EQ(float_to_half_bits(f), h | 0x0200) << std::hex << bits;
      continue;
    }
    // GCC's _Float16 (libgcc's conversions) is the independent reference.
    const _Float16 reference = std::bit_cast<_Float16>(h);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(f),
              std::bit_cast<std::uint32_t>(static_cast<float>(reference)))
        << std::hex << bits;
    EXPECT_EQ(float_to_half_bits(f), h) << std::hex << bits;
  }
}

TEST(Half, Float32ToFloat16RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::vector<float> samples = {0.0f,
                                -0.0f,
                                65504.0f,
                                65519.99f,
                                65520.0f,
                                1e-8f,
                                5.96e-8f,
                                2.98e-8f,
                                2.9802322e-8f,
                                INFINITY,
                                -INFINITY,
                                1.0f + 0x1p-11f,
                                1.0f + 0x1p-11f + 0x1p-20f,
                                6.1035156e-05f};
  for (int i = 0; i < 200000; ++i)
    samples.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  for (float f : samples) {
    if (std::isnan(f)) {
      EXPECT_EQ(float_to_half_bits(f) & 0x7e00, 0x7e00);
      continue;
    }
    const _Float16 reference = static_cast<_Float16>(f);
    EXPECT_EQ(float_to_half_bits(f), std::bit_cast<std::uint16_t>(reference)) << f;
  }
}

// bfloat16 reference: pick the nearer of the two neighbours by exact double arithmetic.
std::uint16_t bfloat16_reference(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t down = static_cast<std::uint16_t>(bits >> 16);
  const std::uint16_t up = static_cast<std::uint16_t>(down + 1);
  const double d_down = std::abs(static_cast<double>(f) - bfloat16_bits_to_float(down));
  const double d_up = std::abs(static_cast<double>(f) - bfloat16_bits_to_float(up));
  if ((bits & 0xffff) == 0) return down;
  if (d_down < d_up) return down;
  if (d_up < d_down) return up;
  return (down & 1) ? up : down;
}

TEST(BFloat16, RoundsToNearestEven) {
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bfloat16_bits_to_float(float_to_bfloat16_bits(f))));
      continue;
    }
    if (std::isinf(bfloat16_bits_to_float(
            static_cast<std::uint16_t>((std::bit_cast<std::uint32_t>(f) >> 16) + 1))))
      continue;  // the upper neighbour is infinity: checked separately below
    EXPECT_EQ(float_to_bfloat16_bits(f), bfloat16_reference(f)) << f;
  }
  EXPECT_EQ(float_to_bfloat16_bits(std::bit_cast<float>(0x7f7fffffu)), 0x7f80);  // rounds to inf
  EXPECT_EQ(float_to_bfloat16_bits(1.0f), 0x3f80);
}

// Scalar reference of one element.
double apply(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return a + b;
    case ReduceOp::prod:
      return a * b;
    case ReduceOp::min:
      return std::min(a, b);
    case ReduceOp::max:
      return std::max(a, b);
  }
  return 0;
}

template <class T>
void check_kernel(DataType dtype) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> small(-20, 20);
  for (ReduceOp op : kAllReduceOps) {
    for (std::size_t n : {0, 1, 3, 17, 64, 1001}) {
      for (std::size_t offset : {0, 1, 3}) {
        SCOPED_TRACE(std::string(to_string(dtype)) + " " + std::string(to_string(op)) +
                     " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        std::vector<T> a(n + offset), b(n + offset), out(n + offset);
        std::vector<double> da(n), db(n);
        for (std::size_t i = 0; i < n; ++i) {
          da[i] = small(rng);
          db[i] = small(rng);
          if constexpr (std::is_same_v<T, float16_t>) {
            a[i + offset] = to_float16(static_cast<float>(da[i]));
            b[i + offset] = to_float16(static_cast<float>(db[i]));
          } else if constexpr (std::is_same_v<T, bfloat16_t>) {
            a[i + offset] = to_bfloat16(static_cast<float>(da[i]));
            b[i + offset] = to_bfloat16(static_cast<float>(db[i]));
          } else {
            a[i + offset] = static_cast<T>(da[i]);
            b[i + offset] = static_cast<T>(db[i]);
          }
        }
        auto value = [](T v) -> double {
          if constexpr (std::is_same_v<T, float16_t> || std::is_same_v<T, bfloat16_t>) {
            return to_float(v);
          } else {
            return static_cast<double>(v);
          }
        };
        // Three-operand form, then the accumulating form on a copy.
        reduce_to(out.data() + offset, a.data() + offset, b.data() + offset, n, dtype, op);
        std::vector<T> acc = a;
        reduce_into(acc.data() + offset, b.data() + offset, n, dtype, op);
        for (std::size_t i = 0; i < n; ++i) {
          // |values| <= 400: exact in every dtype (bfloat16 rounds above 256: compare rounded).
          double expected = apply(op, da[i], db[i]);
          if constexpr (std::is_same_v<T, bfloat16_t>) {
            expected = to_float(to_bfloat16(static_cast<float>(expected)));
          }
          ASSERT_EQ(value(out[i + offset]), expected) << i;
          ASSERT_EQ(value(acc[i + offset]), expected) << i;
        }
        divide_by(acc.data() + offset, n, dtype, 3);
        for (std::size_t i = 0; i < n; ++i) {
          const double before = value(out[i + offset]);
          double expected;
          if constexpr (std::is_integral_v<T>) {
            expected = static_cast<double>(static_cast<T>(before) / 3);
          } else if constexpr (std::is_same_v<T, float16_t>) {
            expected = to_float(to_float16(static_cast<float>(before) / 3.0f));
          } else if constexpr (std::is_same_v<T, bfloat16_t>) {
            expected = to_float(to_bfloat16(static_cast<float>(before) / 3.0f));
          } else {
            expected = static_cast<double>(static_cast<T>(before) / static_cast<T>(3));
          }
          ASSERT_EQ(value(acc[i + offset]), expected) << i;
        }
      }
    }
  }
}

TEST(ReduceKernels, Float32) {
  check_kernel<float>(DataType::float32);
}
TEST(ReduceKernels, Float64) {
  check_kernel<double>(DataType::float64);
}
TEST(ReduceKernels, Float16) {
  check_kernel<float16_t>(DataType::float16);
}
TEST(ReduceKernels, BFloat16) {
  check_kernel<bfloat16_t>(DataType::bfloat16);
}
TEST(ReduceKernels, Int32) {
  check_kernel<std::int32_t>(DataType::int32);
}
TEST(ReduceKernels, Int64) {
  check_kernel<std::int64_t>(DataType::int64);
}

TEST(ReduceKernels, IntegerOverflowWraps) {
  std::int32_t a = INT32_MAX;
  const std::int32_t b = 1;
  reduce_into(&a, &b, 1, DataType::int32, ReduceOp::sum);
  EXPECT_EQ(a, INT32_MIN);
}

TEST(DataTypes, NamesSizesAndParsing) {
  for (DataType dtype : kAllDataTypes) {
    EXPECT_EQ(parse_data_type(to_string(dtype)), dtype);
    EXPECT_TRUE(is_valid(dtype));
  }
  EXPECT_EQ(element_size(DataType::bfloat16), 2u);
  EXPECT_EQ(element_size(DataType::int64), 8u);
  EXPECT_FALSE(is_valid(static_cast<DataType>(17)));
  EXPECT_EQ(to_string(static_cast<DataType>(17)), "invalid");
  EXPECT_FALSE(parse_data_type("float8").has_value());
  for (ReduceOp op : kAllReduceOps)
    EXPECT_EQ(parse_reduce_op(to_string(op)), op);
  EXPECT_FALSE(is_valid(static_cast<ReduceOp>(9)));
}

// The sleeps of a wait on a progress thread: yields first, then sleeps from 2 us growing by half
// each time up to the cap; a wait resumed from an earlier one's pace sleeps at once.
TEST(BackgroundPause, YieldsThenSleepsGrowingToTheCap) {
  BackgroundPause pause(/*max_pause_us=*/10);
  for (long i = 0; i < BackgroundPause::kYields; ++i) {
    pause.pause();
    EXPECT_EQ(pause.last_sleep_ns(), 0);
  }
  const long expected[] = {2000, 3000, 4500, 6750, 10000, 10000};
  for (long ns : expected) {
    pause.pause();
    EXPECT_EQ(pause.last_sleep_ns(), ns);
  }
  BackgroundPause resumed = BackgroundPause::resuming_at(50'000, /*max_pause_us=*/20);
  resumed.pause();
  EXPECT_EQ(resumed.last_sleep_ns(), 20'000);  // no yields; clamped to the cap
  BackgroundPause low = BackgroundPause::resuming_at(10);
  low.pause();
  EXPECT_EQ(low.last_sleep_ns(), BackgroundPause::kFirstSleepNanoseconds);
}

// A request waited for while still queued behind nothing running runs on the waiting thread
// (ProgressEngine::run_here). Two threads submit and wait at once, the engine's thread taking
// some requests and the waiters others: each request runs once, never two at a time, each
// thread's in its submission order; calls made inside one find themselves in_request().
TEST(ProgressEngine, WaitersRunQueuedRequestsThemselvesOneAtATimeInOrder) {
  ProgressEngine engine(/*poll_us=*/0);
  constexpr int kPerThread = 2000;
  std::atomic<int> inside{0}, overlaps{0}, outside_request{0}, on_waiter{0};
  std::vector<int> last(2, -1), out_of_order(2, 0);
  auto submitter = [&](int who) {
    for (int i = 0; i < kPerThread; ++i) {
      auto state = std::make_shared<detail::RequestState>();
      state->call = "test";
      const auto waiter = std::this_thread::get_id();
      state->work = [&, who, i, waiter] {
        if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
        if (!engine.in_request()) outside_request.fetch_add(1);
        if (std::this_thread::get_id() == waiter) on_waiter.fetch_add(1);
        if (i != last[who] + 1) ++out_of_order[who];
        last[who] = i;
        inside.fetch_sub(1);
      };
      engine.submit(state);
      Request(state).wait();
    }
  };
  std::thread a(submitter, 0), b(submitter, 1);
  a.join();
  b.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(outside_request.load(), 0);
  EXPECT_EQ(last, (std::vector<int>{kPerThread - 1, kPerThread - 1}));
  EXPECT_EQ(out_of_order, (std::vector<int>{0, 0}));
  // The engine sleeps between requests (poll_us 0): a waiter is on a core when it submits, the
  // woken engine is not, so waiters take most; one of 4000 is all this asserts.
  EXPECT_GT(on_waiter.load(), 0);
  EXPECT_FALSE(engine.busy());
}

// run_here takes nothing while the engine runs a request, nor a request already done; the
// requests behind a running one run on the engine, in order.
TEST(ProgressEngine, RunHereLeavesWhatTheEngineHas) {
  ProgressEngine engine;
  std::atomic<bool> release{false}, first_started{false};
  std::vector<int> order;
  auto first = std::make_shared<detail::RequestState>();
  first->work = [&] {
    first_started.store(true);
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    order.push_back(1);
  };
  auto second = std::make_shared<detail::RequestState>();
  second->work = [&] { order.push_back(2); };
  engine.submit(first);
  engine.submit(second);
  while (!first_started.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(engine.run_here(second.get()));  // behind the running one: left to the engine
  EXPECT_FALSE(engine.run_here(first.get()));   // running
  release.store(true);
  Request(second).wait();
  EXPECT_TRUE(first->done.load());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_FALSE(engine.run_here(second.get()));  // done
  EXPECT_FALSE(engine.in_request());
}

// The flight recorder is written by the calling thread with no lock and read by the watchdog
// thread: every read sees one consistent state. Each record's payload repeats its number, and the
// dump lists consecutive numbers from the newest down; a read torn by a write breaks either.
std::string describe_numbered(const watchdog::Record& r) {
  std::uint64_t copy = 0;
  std::memcpy(&copy, r.payload.data(), sizeof copy);
  return "call " + std::to_string(r.sequence) + " " + std::to_string(copy);
}

TEST(WatchdogRecorder, ReadsWhileCallsRunSeeOneStateEach) {
  watchdog::Recorder recorder(0, 1, 300, "GRADCOMM_TIMEOUT=300 s", 1, {});
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> written{0};
  std::thread writer([&] {
    for (std::uint64_t k = 1; !stop.load(); ++k) {
      watchdog::Record r;
      r.sequence = k;
      r.describe = describe_numbered;
      std::memcpy(r.payload.data(), &k, sizeof k);
      recorder.begin(r);
      recorder.end(k % 3 != 0);
      written.store(k);
    }
  });
  int reads = 0, torn = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < deadline || written.load() < 1000) {
    std::istringstream lines(recorder.dump());
    std::string line;
    std::uint64_t previous = 0;
    while (std::getline(lines, line)) {
      const std::size_t at = line.find("call ");
      if (at == std::string::npos) continue;
      std::uint64_t number = 0, copy = 0;
      std::istringstream(line.substr(at + 5)) >> number >> copy;
      torn += number != copy || (previous != 0 && number + 1 != previous);
      previous = number;
    }
    std::string call;
    double seconds = 0;
    if (recorder.running(&call, &seconds)) {
      std::uint64_t number = 0, copy = 0;
      std::istringstream(call.substr(5)) >> number >> copy;
      torn += number != copy;
    }
    ++reads;
  }
  stop.store(true);
  writer.join();
  EXPECT_EQ(torn, 0) << "of " << reads << " reads, " << written.load() << " calls written";
  EXPECT_GT(written.load(), 1000u);
}

}  // namespace
}  // namespace gradcomm
