// auto's pure logic, without MPI: the tuning table's parser, the cost model's formulas (each
// algorithm's predicted_seconds) and the measured learner against simulated timings.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/registry.h"
#include "collectives/select/calibration.h"
#include "collectives/select/cost_model.h"
#include "collectives/select/learner.h"
#include "collectives/select/tuning_table.h"
#include "core/error.h"

namespace gradcomm::testing {
namespace {

TEST(Selection, MalformedTablesAreErrors) {
  auto error_of = [](const std::string& text) -> std::string {
    try {
      collectives::TuningTable::parse(text, "t.json");
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no error";
  };
  using ::testing::HasSubstr;
  EXPECT_THAT(error_of("{"), HasSubstr("t.json: invalid JSON"));
  EXPECT_THAT(error_of("[]"), HasSubstr("the top level must be an object"));
  EXPECT_THAT(error_of(R"({"version": 2})"), HasSubstr("expected \"version\": 1"));
  const std::string rows = R"(, "rows": [{"max_bytes": 8, "algorithm": "ring"}]})";
  EXPECT_THAT(error_of(R"({"version": 1, "groups": 1)" + rows), HasSubstr("missing field 'ranks'"));
  // Out of range or not an integer: an error, never silently converted.
  EXPECT_THAT(error_of(R"({"version": 1, "ranks": 4294967298, "groups": 1)" + rows),
              HasSubstr("field 'ranks' must be an integer from 1 to 2147483647"));
  EXPECT_THAT(error_of(R"({"version": 1, "ranks": 2.5, "groups": 1)" + rows),
              HasSubstr("field 'ranks' must be an integer"));
  EXPECT_THAT(error_of(R"({"version": 1, "ranks": 2, "groups": 0)" + rows),
              HasSubstr("field 'groups' must be an integer"));
  EXPECT_THAT(error_of(R"({"version": 1, "ranks": 2, "groups": 1})"),
              HasSubstr("missing array field 'rows'"));
  EXPECT_THAT(error_of(R"({"version": 1, "ranks": 2, "groups": 1, "rows": []})"),
              HasSubstr("no rows"));
  EXPECT_THAT(
      error_of(
          R"({"version": 1, "ranks": 2, "groups": 1, "rows": [{"max_bytes": -8, "algorithm": "ring"}]})"),
      HasSubstr("rows[0].max_bytes must be a non-negative integer"));
  EXPECT_THAT(
      error_of(
          R"({"version": 1, "ranks": 2, "groups": 1, "rows": [{"max_bytes": 8, "algorithm": 3}]})"),
      HasSubstr("rows[0].algorithm must be a string"));
  // What to_json writes parses back to the same table.
  collectives::TuningTable table;
  table.ranks = 3;
  table.groups = 1;
  table.rows = {{4096, "halving_doubling"}, {std::size_t{1} << 40, "ring"}};
  const auto again = collectives::TuningTable::parse(table.to_json(), "t.json");
  EXPECT_EQ(again.ranks, 3);
  EXPECT_EQ(again.groups, 1);
  ASSERT_EQ(again.rows.size(), 2u);
  EXPECT_EQ(again.rows[1].max_bytes, std::size_t{1} << 40);
  EXPECT_EQ(again.rows[1].algorithm, "ring");
  EXPECT_THAT(
      [] {
        collectives::TuningTable::parse(
            R"({"version": 1, "ranks": 2, "groups": 1, "rows": [{"max_bytes": 8, "algorithm": "tree"}]})",
            "t.json");
      },
      ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("unknown algorithm 'tree'")));
}

TEST(Selection, CostModelPrefersFewStepsSmallAndFewBytesLarge) {
  const collectives::CostModel model;  // defaults
  auto predict = [&](std::string_view a, std::size_t bytes, int n, int groups, int g) {
    return collectives::find_prototype(a)->predicted_seconds(model, {bytes, n, groups, g});
  };
  auto t = [&](std::string_view a, std::size_t bytes, int n, int groups, int g) {
    return *predict(a, bytes, n, groups, g);
  };
  EXPECT_LT(t("halving_doubling", 8, 8, 1, 8), t("ring", 8, 8, 1, 8));
  EXPECT_LT(t("ring", 64 << 20, 8, 1, 8), t("flat", 64 << 20, 8, 1, 8));
  // Across two slow-linked groups, hierarchical beats the flat ring at 1 MiB (the README table).
  EXPECT_LT(t("hierarchical", 1 << 20, 16, 2, 8), t("ring", 1 << 20, 16, 2, 8));
  EXPECT_FALSE(predict("mpi", 8, 2, 1, 2).has_value());
  // Over one group hierarchical is the ring: no candidate of its own.
  EXPECT_FALSE(predict("hierarchical", 8, 4, 1, 4).has_value());
}

// shm's model counts the staged rounds a call runs: a stage slot each where every rank has a CPU
// of its own, all kShmStageSlots slots at once where ranks share CPUs.
TEST(Selection, ShmModelCountsTheRoundsTheCallRuns) {
  collectives::CostModel own;
  own.one_host = true;
  collectives::CostModel crowded = own;
  crowded.crowded = true;
  const collectives::AllreduceAlgorithm* shm = collectives::find_prototype("shm");
  auto t = [&](const collectives::CostModel& m, std::size_t bytes) {
    return *shm->predicted_seconds(m, {bytes, 2});
  };
  // 4 MiB: 16 rounds of 256 KiB against 4 of 1 MiB, two flag rounds each (every rank's copy-in,
  // then every rank's reduction).
  EXPECT_NEAR(t(own, 4 << 20) - t(crowded, 4 << 20), 2 * 12 * own.flag_alpha, 1e-12);
  // 1 MiB + 1: 5 rounds against 2.
  EXPECT_NEAR(t(own, (1 << 20) + 1) - t(crowded, (1 << 20) + 1), 2 * 3 * own.flag_alpha, 1e-12);
  EXPECT_EQ(t(own, 200 << 10), t(crowded, 200 << 10));  // one round either way
}

// The measured refinement, as pure logic: `truth` is every algorithm's real time; the model's
// predictions are 1, 2, 3. Runs `calls` calls and returns how many each algorithm ran.
std::vector<int> simulate(collectives::MeasuredChoice& m, const std::vector<double>& predicted,
                          const std::function<double(std::size_t)>& truth, int calls) {
  std::vector<int> ran(m.names().size(), 0);
  for (int i = 0; i < calls; ++i) {
    const collectives::MeasuredChoice::Pick pick = m.pick();
    const std::size_t a = static_cast<std::size_t>(
        std::find(m.names().begin(), m.names().end(), pick.algorithm) - m.names().begin());
    ++ran[a];
    if (pick.timed && m.record(truth(a) / predicted[a])) m.decide(m.figures(), predicted);
  }
  return ran;
}

// A probe's batch fills its window by the longer of the model's estimate and the timed warm-up
// call, so a model that is far too optimistic (MPICH's spinning waits with more ranks than cores:
// 5 ms calls predicted at 1 us) costs a call per batch, not 256.
TEST(Selection, ProbeBatchesAreSizedByTheWarmUpCall) {
  using collectives::kProbeWindow;
  using collectives::probe_batch_calls;
  EXPECT_EQ(probe_batch_calls(1e-6, 0), 256);      // the model alone, as before
  EXPECT_EQ(probe_batch_calls(1e-6, 1e-6), 256);   // the model right
  EXPECT_EQ(probe_batch_calls(1e-6, 5e-3), 1);     // the model 5000x too optimistic
  EXPECT_EQ(probe_batch_calls(1e-6, 50e-6), 6);    // 300 us / 50 us
  EXPECT_EQ(probe_batch_calls(100e-6, 10e-6), 3);  // the longer of the two
  EXPECT_EQ(probe_batch_calls(kProbeWindow * 3, 0), 1);
  EXPECT_EQ(probe_batch_calls(1e-9, 1e-9), 256);  // at most 256
}

TEST(Selection, MeasuringARightModelCostsOnlyRechecks) {
  const std::vector<double> predicted = {1, 2, 3};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  EXPECT_EQ(m.choice(), "a");
  // Each algorithm as fast as the model says: "a" stays; "b" (within 2x) is tried once after
  // the first window, then re-checked (4 of its calls, 1 s each beyond a's) once a has run 4 / 3%
  // = 133 s since the last, every 34 solo windows; "c" never runs.
  const std::vector<int> ran = simulate(
      m, predicted, [&](std::size_t a) { return predicted[a]; }, 4 * 400);
  EXPECT_EQ(m.choice(), "a");
  EXPECT_EQ(ran[2], 0);
  EXPECT_GT(ran[1], 4);
  // What the re-checks cost beyond "a" stays within the budget of a's time (plus the trial).
  EXPECT_LE((ran[1] - 4) * (2 - 1), collectives::LearnerTuning{}.recheck_budget * ran[0] + 4);
  // A near tie ("b" 1% slower than "a") is re-checked every few windows instead, less often
  // as the re-checks keep confirming "a" (their wait doubles up to 8 times: every 16 windows).
  collectives::MeasuredChoice tie({"a", "b"}, {1, 1.01}, 1, 4, 8, 4);
  const std::vector<int> tie_ran = simulate(
      tie, {1, 1.01}, [&](std::size_t a) { return a == 0 ? 1.0 : 1.01; }, 4 * 400);
  EXPECT_EQ(tie.choice(), "a");
  EXPECT_GE(tie_ran[1], 4 * 400 / 16 / 2) << "re-checked at least every 16 windows or so";
  EXPECT_LE(tie_ran[1], 4 * 400 / 8) << "backed off";
  collectives::LearnerTuning no_backoff;
  no_backoff.max_recheck_backoff = 1;
  collectives::MeasuredChoice eager({"a", "b"}, {1, 1.01}, 1, 4, 8, 4, no_backoff);
  const std::vector<int> eager_ran = simulate(
      eager, {1, 1.01}, [&](std::size_t a) { return a == 0 ? 1.0 : 1.01; }, 4 * 400);
  EXPECT_GE(eager_ran[1], 4 * 400 / 20) << "without backoff: about every 3 windows";
  EXPECT_LT(tie_ran[1], eager_ran[1] / 2);
}

TEST(Selection, MeasuringAWrongModelSwitchesAfterADuel) {
  const std::vector<double> predicted = {1, 2, 3};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  // "a" really takes 5: after its first window (4 calls) it duels "b" (predicted 2 < 5; 8
  // calls, 4 of each), which wins. "c" (predicted 3 > b's 2) is not expected to win.
  const std::vector<double> truth = {5, 2, 6};
  std::vector<int> ran = simulate(
      m, predicted, [&](std::size_t a) { return truth[a]; }, 12);
  EXPECT_EQ(m.choice(), "b");
  EXPECT_EQ(ran[0], 8);
  EXPECT_EQ(ran[1], 4);
  // Re-checks: the runner-up "c" (predicted 3, within 2x of b's 2) once, measured at 6; then
  // nothing is within 2x of "b", and nothing ever measured faster than it: only "b" runs.
  ran = simulate(
      m, predicted, [&](std::size_t a) { return truth[a]; }, 400);
  EXPECT_EQ(m.choice(), "b");
  EXPECT_EQ(ran[0], 0);
  EXPECT_EQ(ran[2], 4);
}

// A model off by one factor for every algorithm (a latency calibrated 10x too high): the choice
// measures far below its prediction, and an algorithm the model puts within 2x of the choice is
// still tried once (against the choice's prediction, not only its measured time) and wins.
TEST(Selection, AModelSlowForEveryAlgorithmStillTriesTheOthers) {
  const std::vector<double> predicted = {1, 1.5, 4};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  const std::vector<double> truth = {0.1, 0.05, 0.4};  // the model's times / 10, and "b" faster
  std::vector<int> ran = simulate(
      m, predicted, [&](std::size_t a) { return truth[a]; }, 4 + 8);
  EXPECT_EQ(m.choice(), "b") << "b (predicted 1.5, within 2x of a's 1) tried after one window";
  EXPECT_EQ(ran[1], 4);
  // "c" (predicted 4: beyond 2x of both b's prediction and its measured time) is never tried.
  ran = simulate(
      m, predicted, [&](std::size_t a) { return truth[a]; }, 400);
  EXPECT_EQ(m.choice(), "b");
  EXPECT_EQ(ran[2], 0);
}

TEST(Selection, MeasuringFollowsAMachineThatChanges) {
  const std::vector<double> predicted = {1, 2, 3};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  double a_time = 1;  // "a" slows to 3 for a while, then recovers; "b" always takes 2
  auto truth = [&](std::size_t i) { return i == 0 ? a_time : predicted[i]; };
  simulate(m, predicted, truth, 100);
  EXPECT_EQ(m.choice(), "a");
  a_time = 3;  // the next solo window sees it; "b" (measured at 2 in a re-check) wins the duel
  simulate(m, predicted, truth, 12);
  EXPECT_EQ(m.choice(), "b");
  a_time = 1;  // found by a re-check of the runner-up "a" (measured 3: 1 s a call beyond b's 2,
               // 4 calls, paid for once "b" has run 4 / 3% = 133 s, 17 windows of 4 calls)
  simulate(m, predicted, truth, 17 * 4 + 8 + 8 + 8);
  EXPECT_EQ(m.choice(), "a");
}

// A switch decided by a transient (one duel that lied) is undone by the re-checks, and settled()
// holds between duels.
TEST(Selection, ATransientSwitchIsUndoneByARecheck) {
  const std::vector<double> predicted = {1, 2, 3};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  double a_time = 1;
  auto truth = [&](std::size_t i) { return i == 0 ? a_time : predicted[i]; };
  // Calls until the choice is `name`, at most `limit`.
  auto calls_until = [&](std::string_view name, int limit) {
    int calls = 0;
    for (; m.choice() != name && calls < limit; ++calls)
      simulate(m, predicted, truth, 1);
    return calls;
  };
  simulate(m, predicted, truth, 200);
  ASSERT_EQ(m.choice(), "a");
  EXPECT_TRUE(m.settled() || m.dueling());
  a_time = 3;  // a transient: a solo window sees "a" slow, and the duel that follows picks "b"
  EXPECT_LE(calls_until("b", 100), 4 + 4 + 8);  // (the rest of a window, one window, the duel)
  a_time = 1;  // over: "c" (never measured, within 2x of "b") is tried once, and the re-check of
               // "a" once paid for (17 solo windows of "b") brings it back
  EXPECT_LE(calls_until("a", 200), 8 + 17 * 4 + 8 + 8);
  // A switch that holds: "a" slows for good; "b" wins, and the re-checks of "a" confirm it.
  a_time = 3;
  simulate(m, predicted, truth, 400);
  EXPECT_EQ(m.choice(), "b");
  EXPECT_TRUE(m.settled() || m.dueling());
}

// A switch that a long transient decided (the choice measured 10x slow in the window and the duel
// that dethroned it: unbound ranks that shared a CPU for a while, where shm's flag waits cost a
// context switch each) is undone too. The dethroned choice then looks more than recheck_factor
// slower than the new one, and a near tie ("c") stands between them, so the re-checks of the
// runner-up alone would never measure it again. It once measured faster than "b" does, so it stays
// a re-check's target, on the budget, taking turns with "c".
TEST(Selection, ASwitchALongTransientDecidedIsUndoneToo) {
  const std::vector<double> predicted = {1, 1.2, 1.5};
  collectives::MeasuredChoice m({"a", "b", "c"}, predicted, 1, 4, 8, 4);
  double a_time = 1;
  auto truth = [&](std::size_t i) { return i == 0 ? a_time : predicted[i]; };
  simulate(m, predicted, truth, 400);
  ASSERT_EQ(m.choice(), "a");
  a_time = 10;
  for (int calls = 0; m.choice() != "b" && calls < 100; ++calls)
    simulate(m, predicted, truth, 1);
  ASSERT_EQ(m.choice(), "b");
  a_time = 1;  // over
  // The re-check of "a" costs 4 calls of 8.8 s beyond b's, from its own account, credited half of
  // each solo window (c's re-checks get the other half): paid once b's solo windows ran
  // 35.2 / 1.5% = 2347 s, 489 windows of 4 calls; c's 5 re-checks between them and a's own
  // duel take 8 calls each.
  int calls = 0;
  for (; m.choice() != "a" && calls < 4000; ++calls)
    simulate(m, predicted, truth, 1);
  EXPECT_EQ(m.choice(), "a") << "still on b after " << calls << " calls";
  EXPECT_LE(calls, 4 * 489 + 8 * 6);
  // Where "a" stays slow, its re-checks confirm "b", taking turns with the near tie "c", and
  // what they cost beyond b's calls stays within the 3% budget of b's time.
  a_time = 10;
  for (int i = 0; m.choice() != "b" && i < 100; ++i)
    simulate(m, predicted, truth, 1);
  ASSERT_EQ(m.choice(), "b");
  const std::vector<int> ran = simulate(m, predicted, truth, 4 * 2000);
  EXPECT_EQ(m.choice(), "b");
  EXPECT_GT(ran[0], 0);
  EXPECT_GT(ran[2], 0);
  EXPECT_LE(ran[0] * (10 - 1.2) + ran[2] * (1.5 - 1.2), 0.03 * ran[1] * 1.2);
  // The near tie's re-checks are not held back behind a's long waits: "c" (4 calls 0.3 s slower,
  // half of each window's credit, backing off to 8x) is re-checked every 134 solo windows (135
  // where a's re-check takes the window first).
  EXPECT_GE(ran[2], 4 * (2000 / 134 - 1)) << "c ran " << ran[2] << ", a " << ran[0];
}

// A duel is decided by its one window: the challenger wins by more than 2% or the choice stays.
TEST(Selection, ADuelIsDecidedByItsWindow) {
  const std::vector<double> predicted = {1, 1.1};
  collectives::MeasuredChoice m({"a", "b"}, predicted, 1, 4, 8, 4);
  double b_time = 1.1;
  auto truth = [&](std::size_t i) { return i == 0 ? 1.0 : b_time; };
  simulate(m, predicted, truth, 4);  // the first window: "b" (within 2x) is tried next
  ASSERT_TRUE(m.dueling());
  simulate(m, predicted, truth, 8);
  EXPECT_EQ(m.choice(), "a") << "1.1 against 1.0";
  EXPECT_FALSE(m.dueling());
  EXPECT_TRUE(m.settled());
  // Later, "b" becomes 20% faster: the re-check of the near tie finds it.
  b_time = 0.8;
  simulate(m, predicted, truth, 4 * 20);
  EXPECT_EQ(m.choice(), "b");
}

TEST(Selection, ShortCallsAreTimedOneInStride) {
  const std::vector<double> predicted = {1, 2};
  // One call in 12 timed; solo windows of 10 timed calls; duels of 12, the challenger's the
  // middle 4 (timed calls 4 - 7).
  collectives::MeasuredChoice m({"a", "b"}, predicted, 12, 10, 12, 4);
  int timed = 0;
  for (int i = 0; i < 120; ++i) {
    const collectives::MeasuredChoice::Pick pick = m.pick();
    EXPECT_EQ(pick.algorithm, "a");
    EXPECT_EQ(pick.timed, i % 12 == 0);
    if (pick.timed) {
      ++timed;
      // "a" takes 3x its prediction: "b" (predicted 2) is expected faster
      EXPECT_EQ(m.record(3.0), timed == 10);
    }
  }
  m.decide(m.figures(), predicted);
  ASSERT_TRUE(m.dueling());
  // The challenger runs its 4 timed calls and the 11 untimed calls before each: every timed
  // call follows calls of its own algorithm (a lone call after another algorithm's measures the
  // switch).
  int challenger = 0;
  bool previous_b = false;
  for (int i = 0; i < 144; ++i) {
    const collectives::MeasuredChoice::Pick pick = m.pick();
    const bool b = pick.algorithm == "b";
    challenger += b;
    if (pick.timed) {
      EXPECT_EQ(b, previous_b) << i;
      EXPECT_EQ(b, i >= 48 && i < 96) << i;  // timed calls 4 - 7
    }
    previous_b = b;
    if (pick.timed && m.record(b ? 1.0 : 3.0)) {
      EXPECT_EQ(i, 132);  // the 12th timed call
    }
  }
  EXPECT_EQ(challenger, 4 * 12);
  m.decide(m.figures(), predicted);
  EXPECT_EQ(m.choice(), "b");
  // Reshaped (by what "b" measured): one call in 3 timed, windows of 5 timed calls.
  m.reshape(3, 5, 8, 4);
  for (int i = 0; i < 15; ++i) {
    const collectives::MeasuredChoice::Pick pick = m.pick();
    EXPECT_EQ(pick.algorithm, "b");
    EXPECT_EQ(pick.timed, i % 3 == 0) << i;
    if (pick.timed) {
      EXPECT_EQ(m.record(1.0), i == 12) << i;
    }
  }
}

// gradcomm-bench --tune's table: each size decides up to the geometric midpoint to the next,
// equal neighbours merge, the last row covers every larger size.
TEST(Selection, TableFromASweepsFastestAlgorithms) {
  const auto table = collectives::TuningTable::from_fastest(
      4, 1, {{8, "halving_doubling"}, {32, "halving_doubling"}, {128, "shm"}, {512, "ring"}});
  EXPECT_EQ(table.ranks, 4);
  ASSERT_EQ(table.rows.size(), 3u);
  EXPECT_EQ(table.rows[0].max_bytes, 64u);  // sqrt(32 * 128)
  EXPECT_EQ(table.rows[0].algorithm, "halving_doubling");
  EXPECT_EQ(table.rows[1].max_bytes, 256u);
  EXPECT_EQ(table.rows[1].algorithm, "shm");
  EXPECT_EQ(table.rows[2].max_bytes, SIZE_MAX);
  const std::string path = ::testing::TempDir() + "/gradcomm_table.json";
  table.save(path);
  const auto back = collectives::TuningTable::load(path);
  EXPECT_EQ(back.to_json(), table.to_json());
  EXPECT_THROW(collectives::TuningTable::load(path + ".missing"), InvalidArgument);
}

}  // namespace
}  // namespace gradcomm::testing
