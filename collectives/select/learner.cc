#include "collectives/select/learner.h"

#include <algorithm>
#include <cmath>

namespace gradcomm::collectives {

WindowShape window_shape(double call, double decision) {
  const double seconds = std::max(kWindowSeconds, 200 * decision);
  const int calls = static_cast<int>(std::clamp(std::ceil(seconds / call), 4.0, 8192.0));
  const double by_time = std::ceil(kTimedFromSeconds / call);
  const double by_count = std::ceil(static_cast<double>(calls) / kMaxTimed);
  const int stride = static_cast<int>(std::clamp(std::max(by_time, by_count), 1.0, 256.0));
  const int window = std::max(4, (calls + stride - 1) / stride);  // timed calls
  const int challenger_calls = std::clamp(window / 4, 4, 8);
  return {stride, window, std::max(window, 2 * challenger_calls), challenger_calls};
}

MeasuredChoice::MeasuredChoice(std::vector<std::string_view> names,
                               const std::vector<double>& predicted, int stride, int window,
                               int duel, int challenger_calls, const LearnerTuning& tuning)
    : tuning_(tuning),
      names_(std::move(names)),
      ratio_(names_.size(), 0.0),
      best_ratio_(names_.size(), 0.0),
      stride_(stride),
      window_(window),
      duel_(duel),
      challenger_calls_(challenger_calls) {
  choice_ = static_cast<std::size_t>(std::min_element(predicted.begin(), predicted.end()) -
                                     predicted.begin());
  challenger_ = choice_;
}

bool MeasuredChoice::record(double ratio) {
  samples_[challenger_turn() ? 1 : 0].push_back(ratio);
  ++timed_;
  return timed_ >= (dueling() ? duel_ : window_);
}

std::array<double, 2> MeasuredChoice::figures() {
  std::array<double, 2> medians{};
  for (std::size_t slot = 0; slot < 2; ++slot) {
    std::vector<double>& v = samples_[slot];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    const std::size_t half = v.size() / 2;
    medians[slot] = v.size() % 2 == 1 ? v[half] : (v[half - 1] + v[half]) / 2;
  }
  return medians;
}

bool MeasuredChoice::decide(const std::array<double, 2>& agreed,
                            const std::vector<double>& predicted) {
  const std::size_t before = choice_;
  const bool was_duel = dueling();
  ++windows_;
  timed_ = 0;
  samples_[0].clear();
  samples_[1].clear();
  // An algorithm's figure, and the best of its figures.
  auto note = [&](std::size_t i, double figure) {
    ratio_[i] = std::max(figure, 1e-12);
    best_ratio_[i] = best_ratio_[i] > 0 ? std::min(best_ratio_[i], ratio_[i]) : ratio_[i];
  };
  note(choice_, agreed[0]);
  if (was_duel) {
    note(challenger_, agreed[1]);
    const double mine = expected(choice_, predicted[choice_]);
    const double theirs = expected(challenger_, predicted[challenger_]);
    if (theirs < tuning_.margin * mine) {
      choice_ = challenger_;
      accounts_ = {};
    } else if (rechecking_ >= 0) {  // the re-check confirmed the choice: wait longer for the next
      int& backoff = accounts_[static_cast<std::size_t>(rechecking_)].backoff;
      backoff = std::min(2 * backoff, std::max(1, tuning_.max_recheck_backoff));
    }
  }
  rechecking_ = -1;
  challenger_ = choice_;
  // The strongest other: the lowest expectation (never measured: the model's prediction).
  const double mine = expected(choice_, predicted[choice_]);
  std::size_t other = choice_;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (i != choice_ &&
        (other == choice_ || expected(i, predicted[i]) < expected(other, predicted[other]))) {
      other = i;
    }
  }
  // The most promising algorithm never measured here whose prediction is within
  // recheck_factor of the choice: the model is off by up to 2x for single algorithms on this
  // machine (shm on 4 ranks sharing 2 cores at 2 MiB), and the re-checks below only ever look at
  // the strongest other, so each such algorithm is tried once. Within recheck_factor of the
  // choice's measured time or of its prediction, whichever is larger: a model off by one factor
  // for every algorithm (a link's latency calibrated 30x too high) makes the choice measure far
  // below its prediction, and the others' bare predictions would then never come within reach.
  std::size_t untried = choice_;
  const double reach = tuning_.recheck_factor * std::max(mine, predicted[choice_]);
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (tuning_.try_untried && i != choice_ && !measured(i) && predicted[i] <= reach &&
        (untried == choice_ || predicted[i] < predicted[untried])) {
      untried = i;
    }
  }
  if (other != choice_) {
    const double theirs = expected(other, predicted[other]);
    if (theirs < tuning_.margin * mine) {
      challenger_ = other;  // expected to win: find out
    } else if (untried != choice_) {
      challenger_ = untried;  // not expected to win, but never measured: try it once
    } else if (!was_duel) {
      // Re-check the runner-up once what the duel would cost beyond the choice (its calls, the
      // untimed ones between its timed ones included, times the expected difference) is within
      // recheck_budget of the solo time credited to its account since its last re-check: a near
      // tie is re-checked every few windows, so a change of the machine's state that turns it is
      // found soon; one expected twice as slow rarely. Re-checks that keep confirming the choice
      // back off (max_recheck_backoff), so that a settled near tie costs less.
      // An algorithm whose best window measured faster than the choice's best (by the margin) is
      // re-checked too, whatever it is expected to cost now: its later figures may come from
      // windows a transient spoiled (ranks that share a CPU for a while make shm's flag waits 10x
      // slower, and a re-check may fall inside the same spell), and without this it might never be
      // measured again (more than recheck_factor slower, or behind a near tie that the re-checks
      // keep confirming). Where it is not the runner-up it has an account of its own (its wait
      // grows with how slow it is expected to be, so it must not hold the near tie's re-checks
      // back). Each solo window's time is credited once: half to each account while both have a
      // target, else all to the one that has (the runner-up's where neither has), so the
      // re-checks together stay within recheck_budget of the solo time. Only measurements count:
      // trusting the model's prediction too (an algorithm a transient spoiled from its first
      // window) cost 0.2-0.5% in replays where nothing was spoiled, re-checking for good an
      // algorithm the model is optimistic about.
      auto best_ever = [&](std::size_t i) { return predicted[i] * best_ratio_[i]; };
      std::size_t faster = choice_;  // the fastest best window, if faster than the choice's
      for (std::size_t i = 0; tuning_.recheck_once_faster && i < names_.size(); ++i) {
        if (i != choice_ && i != other && measured(i) &&
            best_ever(i) < tuning_.margin * best_ever(choice_) &&
            (faster == choice_ || best_ever(i) < best_ever(faster))) {
          faster = i;
        }
      }
      const bool other_faster = tuning_.recheck_once_faster && measured(other) &&
                                best_ever(other) < tuning_.margin * best_ever(choice_);
      const std::size_t targets[2] = {
          theirs <= tuning_.recheck_factor * mine || other_faster ? other : choice_, faster};
      const double solo = static_cast<double>(window_) * stride_ * mine;
      const double to_faster = faster == choice_ ? 0.0 : targets[0] == choice_ ? 1.0 : 0.5;
      accounts_[0].seconds += (1 - to_faster) * solo;
      accounts_[1].seconds += to_faster * solo;
      for (Account& a : accounts_)
        ++a.since;
      for (std::size_t k : {std::size_t{1}, std::size_t{0}}) {  // the once-faster one first
        const std::size_t target = targets[k];
        Account& a = accounts_[k];
        if (target == choice_ || tuning_.recheck_budget <= 0 ||
            a.since < tuning_.min_recheck * a.backoff) {
          continue;
        }
        const double difference = expected(target, predicted[target]) - mine;
        if (a.seconds * tuning_.recheck_budget >=
            static_cast<double>(a.backoff) * challenger_calls_ * stride_ * difference) {
          a.since = 0;
          a.seconds = 0;
          challenger_ = target;
          rechecking_ = static_cast<int>(k);
          break;
        }
      }
    }
  }
  return choice_ != before;
}

}  // namespace gradcomm::collectives
