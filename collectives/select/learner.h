#pragma once

// auto's online learner: the measured refinement of the cost model's choice, per size class, as
// pure logic (no MPI: the caller agrees the figures across ranks). Its constants and why each
// has its value: docs/selection.md.

#include <array>
#include <cstddef>
#include <string_view>
#include <vector>

namespace gradcomm::collectives {

// The shape of a size class's measuring windows: one call in `stride` is timed; a solo window
// has `window` timed calls, a duel `duel`, of which `challenger_calls` are the challenger's.
struct WindowShape {
  int stride, window, duel, challenger_calls;
};

// The windows of a size class whose choice takes `call` seconds (the model's prediction until
// measured, then the measurement) where a window's end costs about `decision` seconds. A window
// ends in a decision that costs a few small collectives (the call check, the agreement: 3-5 us on
// 2 ranks here): windows of at least kWindowSeconds and 200 times the decision keep it below
// ~0.5%. Calls shorter than kTimedFromSeconds are timed one in `stride`, and so are calls of which
// a window would time more than kMaxTimed (a median of 64 is as good, and the clock reads cost
// less); a window has at least 4 timed calls, a duel 4 - 8 of the challenger.
WindowShape window_shape(double call, double decision);

// Calls shorter than this are timed one in several (two clock reads are ~40 ns).
inline constexpr double kTimedFromSeconds = 5e-6;
inline constexpr double kWindowSeconds = 1e-3;  // the shortest measuring window
inline constexpr int kMaxTimed = 64;            // timed calls a window needs at most

// The measured refinement of one size class's choice (sizes [2^(b-1), 2^b)), as pure logic. For
// every call the caller asks pick() which algorithm to run and whether to time it (every call, or
// one in `stride` where calls are so short that two clock reads would show); it passes a timed
// call's seconds over the model's prediction to record(), and when that ends a window it agrees
// figures() across ranks (every rank's median of each algorithm's timed calls in the window, the
// slowest rank's figure) and passes them to decide(); every rank then holds the same state.
// Windows are solo (the choice only) or duels: a challenger runs 4 - 8 timed calls in a row in the
// middle of the window (and the untimed calls before each of them), the choice the rest, so that
// both see the same machine (its speed drifts by 2x within minutes here: one algorithm timed long
// after another would compare the drift), and a slow challenger costs little (few calls,
// together).
// Optimism under uncertainty: an algorithm never measured is expected to take what the model
// says, a measured one what the model says times its measured ratio. When some other algorithm is
// expected to beat the choice (never measured and predicted faster than the choice measured, or
// measured faster earlier), the next window is a duel with it, and the winner by more than 2%
// stays. An algorithm never measured whose prediction is within 2x of the choice's expectation,
// or of its prediction where the choice measured faster than predicted, is tried once in a duel
// as well (the model can be that wrong about one algorithm, and off by one factor for all). So a
// model that is right costs one solo window and a duel per close runner-up, and one that is wrong
// about its pick (the machine's state changed: both ranks moved onto one core, a cache domain
// split) is corrected after a duel per algorithm that could beat it. The runner-up is challenged
// again now and then, so that a choice that became wrong later is found: once the re-check's
// expected cost (its calls times how much slower it is expected to be) is 3% of the solo time
// credited to it since the last one, so a near tie is re-checked every few windows and an algorithm
// expected 2x slower once the choice ran 33 times the re-check's calls; each re-check that confirms
// the choice doubles that wait, up to 8x, until a switch. A duel is decided by its one window; a
// switch a transient caused is undone by the re-checks: an algorithm whose best window measured
// faster than the choice's best is re-checked too, whatever it is expected to cost now (a transient
// may have made it look 10x slow, beyond the 2x reach of the runner-up's re-checks), from an
// account of its own unless it is the runner-up. Each solo window's time is credited once, half to
// each account while both have a target (so a near tie is then re-checked half as often), so that
// the re-checks together stay within the 3%.
//
// The constants are LearnerTuning's defaults. bench/learner_replay replays measured traces
// through variants of them: the trials and the re-checks pay for themselves there, and two
// mechanisms that did not (a confirming duel after each switch, more windows for close duels) were
// removed (docs/selection.md, "What each mechanism buys").
struct LearnerTuning {
  double margin = 0.98;  // a challenger must be this much faster
  // Runner-ups expected more than this much slower are not challenged, unless their best window
  // measured faster than the choice's best (recheck_once_faster).
  double recheck_factor = 2.0;
  // The runner-up is re-checked once the duel's expected cost beyond the choice is at most
  // recheck_budget of the solo time credited to its account since its last re-check, and
  // min_recheck solo windows apart (recheck_budget 0: never); so is an algorithm once faster,
  // from an account of its own (each window's solo time is credited half to each while both have
  // a target).
  double recheck_budget = 0.03;
  int min_recheck = 2;
  // Each re-check that leaves the choice as it was doubles the wait for the next (its budget
  // divided, its minimum of solo windows multiplied), up to this factor; a switch resets it
  // (1: no backoff). A settled near tie then costs ~recheck_budget / backoff.
  int max_recheck_backoff = 8;
  bool try_untried = true;          // try once each never-measured algorithm predicted within 2x
  bool recheck_once_faster = true;  // re-check an algorithm whose best beat the choice's best
};

class MeasuredChoice {
 public:
  // `names` in the registry's order, `predicted` seconds for each at the first call's size. One
  // call in `stride` is timed; a solo window has `window` timed calls, a duel `duel`, of which
  // `challenger_calls` in the middle are the challenger's.
  MeasuredChoice(std::vector<std::string_view> names, const std::vector<double>& predicted,
                 int stride, int window, int duel, int challenger_calls,
                 const LearnerTuning& tuning = {});

  struct Pick {
    std::string_view algorithm;
    bool timed;
  };
  // Where the counting stands (before a pick): rewind(mark) undoes the picks and records made
  // since, for a call that failed on some ranks only (a MismatchError), so that every rank's
  // windows stay in phase. A window decided since (agreed by every rank) stays.
  struct Mark {
    int until_timed = 0;
    int timed = 0;
    int windows = 0;
    std::size_t samples[2] = {0, 0};
  };
  Mark mark() const {
    return {until_timed_, timed_, windows_, {samples_[0].size(), samples_[1].size()}};
  }
  void rewind(const Mark& m) {
    if (windows_ != m.windows) return;
    until_timed_ = m.until_timed;
    timed_ = m.timed;
    for (std::size_t slot = 0; slot < 2; ++slot) {
      if (samples_[slot].size() > m.samples[slot]) samples_[slot].resize(m.samples[slot]);
    }
  }
  // The next call's algorithm and whether to time it; counts the call. The untimed calls after
  // a timed one run what the next timed call runs, so that every timed call follows calls of its
  // own algorithm (stride > 1): a challenger's lone call among the choice's measured what
  // switching costs, not what the challenger costs in steady use (shm at 2 KiB on 2 ranks: 3.7
  // us after halving_doubling's calls, 1.5 us after its own).
  Pick pick() {
    if (until_timed_ > 0) {
      --until_timed_;
      return {names_[challenger_turn() ? challenger_ : choice_], false};
    }
    until_timed_ = stride_ - 1;
    return {names_[challenger_turn() ? challenger_ : choice_], true};
  }
  // The timed call just picked took `ratio` times its prediction on this rank; true when it
  // completed the window.
  bool record(double ratio);
  // This rank's figures of the window: the median ratio of the choice's timed calls and of the
  // challenger's (0 in a solo window).
  std::array<double, 2> figures();
  // The window ended with these agreed figures; `predicted` holds every candidate's prediction
  // at the size of the window's last call. Picks the next window; true when the choice changed.
  bool decide(const std::array<double, 2>& agreed, const std::vector<double>& predicted);
  // The windows from the next one on: as in the constructor (the caller sizes them by what the
  // choice measured).
  void reshape(int stride, int window, int duel, int challenger_calls) {
    stride_ = stride;
    window_ = window;
    duel_ = duel;
    challenger_calls_ = challenger_calls;
  }

  // The best measured so far (the model's pick before any measurement).
  std::string_view choice() const { return names_[choice_]; }
  bool dueling() const { return challenger_ != choice_; }
  int windows() const { return windows_; }  // decided so far
  // A window has decided and no duel is under way: what a steady state looks like.
  bool settled() const { return windows_ > 0 && !dueling(); }
  std::string_view challenger() const { return names_[challenger_]; }
  const std::vector<std::string_view>& names() const { return names_; }
  bool measured(std::size_t i) const { return ratio_[i] > 0; }
  // The expected seconds of candidate i, given the model's `predicted` for it at some size.
  double expected(std::size_t i, double predicted) const {
    return measured(i) ? predicted * ratio_[i] : predicted;
  }
  double expected_choice(const std::vector<double>& predicted) const {
    return expected(choice_, predicted[choice_]);
  }

 private:
  bool challenger_turn() const {
    const int first = (duel_ - challenger_calls_) / 2;
    return dueling() && timed_ >= first && timed_ < first + challenger_calls_;
  }

  LearnerTuning tuning_;
  std::vector<std::string_view> names_;
  std::vector<double> ratio_;       // measured / predicted (0: never measured)
  std::vector<double> best_ratio_;  // the lowest of each algorithm's figures (0: never measured)
  std::size_t choice_ = 0;
  std::size_t challenger_ = 0;  // == choice_ in a solo window
  int stride_, window_, duel_, challenger_calls_;
  int until_timed_ = 0;                         // calls before the next timed one
  int timed_ = 0;                               // timed calls in the current window
  int windows_ = 0;                             // windows decided
  std::array<std::vector<double>, 2> samples_;  // of the choice and the challenger, this window
  // What pays for one kind of re-check: the runner-up's, or that of an algorithm once faster.
  struct Account {
    int since = 0;       // solo windows since its last re-check (or switch)
    double seconds = 0;  // and about how long they ran
    int backoff = 1;     // its wait multiplier (max_recheck_backoff at most)
  };
  std::array<Account, 2> accounts_;  // [0]: the runner-up's, [1]: the once-faster algorithm's
  int rechecking_ = -1;  // the account of the re-check under way (-1: none; see accounts_)
};

}  // namespace gradcomm::collectives
