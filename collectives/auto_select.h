#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// The policy behind algorithm "auto": the registered algorithm to use for this call. Every rank
// picks the same one: the inputs are the call's size, the rank count, the layout, and a tuning
// table or model parameters that rank 0 reads or measures and broadcasts (on the first call,
// which is therefore collective, as every all-reduce is). Sources, in order:
//   1. a tuning table (Config::tuning_file, GRADCOMM_TUNING_FILE) written by
//      `gradcomm-bench --tune`, used when its rank count and group count match;
//   2. an alpha-beta-gamma cost model (Thakur, Rabenseifner and Gropp 2005) with intra- and
//      inter-group link parameters from a short calibration (Config::calibrate) or defaults.
// With the model (no table), auto then checks its picks by measuring them (Config::auto_measure,
// GRADCOMM_AUTO_MEASURE; see MeasuredChoice): this returns the current choice for the call's size
// class. At debug level it logs each new choice and why. Asking is not a call: it changes nothing
// (gradcomm-bench's picks column).
std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm);

// The front door's: the algorithm of this auto call (select_allreduce_algorithm's, or a
// challenger that auto is measuring against it), counted as one call of its size class. When it
// sets `timed`, the caller times the algorithm's run and passes the seconds to end_auto_call.
// grouped_allreduce's buckets are calls like any other.
std::string_view begin_auto_call(const AllreduceArgs& args, Communicator& comm, bool& timed);
// After a timed call. At the end of a measuring window it completes the call's comparison
// (GRADCOMM_CHECK) and agrees the window's figures across ranks with one MPI_Allreduce of 24
// bytes, then decides the next window (collective; the same decision on every rank).
void end_auto_call(const AllreduceArgs& args, Communicator& comm, double seconds);

// True when auto has finished exploring calls like `args`: its choice for their size class has
// been measured (at least one window decided), no duel is under way and a switch has been
// confirmed (MeasuredChoice::settled), or auto does not measure them (one rank, one candidate,
// GRADCOMM_AUTO_MEASURE=0, a tuning table, reproducible mode). The same on every rank. For
// gradcomm-bench, which times auto in its steady state (and reports what exploring cost).
bool auto_settled(const AllreduceArgs& args, Communicator& comm);

// Tests only: auto's measured times of `algorithm` on this rank are multiplied by `factor` (a
// model that is wrong about it, on demand). Call on every rank alike.
void scale_auto_timing_for_testing(Communicator& comm, std::string_view algorithm, double factor);

// The measured refinement of one size class's choice (sizes [2^(b-1), 2^b)), as pure logic. For
// every call the caller asks pick() which algorithm to run and whether to time it (every call, or
// one in `stride` where calls are so short that two clock reads would show); it passes a timed
// call's seconds over the model's prediction to record(), and when that ends a window it agrees
// figures() across ranks (every rank's median of each algorithm's timed calls in the window, the
// slowest rank's figure) and passes them to decide(); every rank then holds the same state.
// Windows are solo (the choice only) or duels: a challenger runs 4 - 8 timed calls in a row in the
// middle of the window, the choice the rest, so that both see the same machine (its speed drifts
// by 2x within minutes here: one algorithm timed long after another would compare the drift), and
// a slow challenger costs little (few calls, together).
// Optimism under uncertainty: an algorithm never measured is expected to take what the model
// says, a measured one what the model says times its measured ratio. When some other algorithm is
// expected to beat the choice (never measured and predicted faster than the choice measured, or
// measured faster earlier), the next window is a duel with it, and the winner by more than 2%
// stays. An algorithm never measured whose prediction is within 2x of the choice's expectation
// is tried once in a duel as well (the model can be that wrong about one algorithm). So a model
// that is right costs one solo window and a duel per close runner-up, and one that is wrong about
// its pick (the machine's state changed: both ranks moved onto one core, a cache domain split) is
// corrected after a duel per algorithm that could beat it. The runner-up is challenged again now
// and then, so that a choice that became wrong later is found: once the re-check's expected cost
// (its calls times how much slower it is expected to be) is 3% of the solo time since the last
// one, so a near tie is re-checked every few windows and an algorithm expected 2x slower once
// the choice ran 33 times the re-check's 4 - 8 calls. A switch, decided by 4 - 8 calls of the
// challenger, is confirmed by a duel with the old choice 2 solo windows later: a transient (the
// host moving a virtual CPU) that made one duel lie is undone within a few windows. A duel too
// close to call (within 15%) from its 4 - 8 challenger calls runs another window, up to three,
// judged on their mean.
class MeasuredChoice {
 public:
  static constexpr double kMargin = 0.98;        // a challenger must be this much faster
  static constexpr double kRecheckFactor = 2.0;  // runner-ups expected slower are not challenged
  // The runner-up is re-checked once the duel's expected cost beyond the choice is at most
  // kRecheckBudget of the solo time since the last re-check, and kMinRecheck solo windows apart.
  static constexpr double kRecheckBudget = 0.03;
  static constexpr int kMinRecheck = 2;
  static constexpr int kConfirmAfter = 2;  // solo windows from a switch to its confirming duel
  // A duel whose two expectations lie within kClose of each other goes on for another window, up
  // to kMaxDuelWindows, and is decided on the mean of its windows' figures.
  static constexpr double kClose = 1.15;
  static constexpr int kMaxDuelWindows = 3;

  // `names` in the registry's order, `predicted` seconds for each at the first call's size. One
  // call in `stride` is timed; a solo window has `window` timed calls, a duel `duel`, of which
  // `challenger_calls` in the middle are the challenger's.
  MeasuredChoice(std::vector<std::string_view> names, const std::vector<double>& predicted,
                 int stride, int window, int duel, int challenger_calls);

  struct Pick {
    std::string_view algorithm;
    bool timed;
  };
  // The next call's algorithm and whether to time it; counts the call.
  Pick pick() {
    if (until_timed_ > 0) {
      --until_timed_;
      return {names_[choice_], false};
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
  // A window has decided, no duel is under way, and the choice has won a duel since it last
  // changed (or nothing is close enough to challenge it): what a steady state looks like.
  bool settled() const { return windows_ > 0 && !dueling() && confirmed_; }
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

  std::vector<std::string_view> names_;
  std::vector<double> ratio_;  // measured / predicted (0: never measured)
  std::size_t choice_ = 0;
  std::size_t challenger_ = 0;  // == choice_ in a solo window
  int stride_, window_, duel_, challenger_calls_;
  int until_timed_ = 0;                         // calls before the next timed one
  int timed_ = 0;                               // timed calls in the current window
  int windows_ = 0;                             // windows decided
  std::array<std::vector<double>, 2> samples_;  // of the choice and the challenger, this window
  bool rechecking_ = false;                     // the duel re-checks the runner-up
  bool trying_ = false;                         // the duel tries an algorithm never measured
  std::array<double, 2> pooled_{};              // the current contest's figures, summed
  int duel_windows_ = 0;                        // its duel windows so far
  bool confirmed_ = true;    // the choice beat the runner-up in a duel since it last changed
  int since_recheck_ = 0;    // solo windows since the last re-check (or switch)
  double solo_seconds_ = 0;  // and about how long they ran
};

// The cost model's predicted seconds for `algorithm` on `bytes` (as auto sees it: calibrated,
// scaled by the probes where there are any); nullopt for algorithms it has no model of (mpi,
// nccl, auto). Collective on a communicator's first use of auto. For gradcomm-bench's model_us.
std::optional<double> predicted_allreduce_seconds(Communicator& comm, std::string_view algorithm,
                                                  std::size_t bytes);

// A decision table: the first row whose max_bytes >= the call's bytes names the algorithm.
struct TuningTable {
  struct Row {
    std::size_t max_bytes;
    std::string algorithm;
  };
  int ranks = 0;
  int groups = 0;
  std::vector<Row> rows;

  std::string to_json() const;
  // Throws InvalidArgument naming `origin` for malformed text or unknown algorithm names.
  static TuningTable parse(const std::string& text, const std::string& origin);
};

// Link and reduction parameters of the cost model: time = alpha + bytes * beta per message,
// bytes * gamma per reduction.
struct CostModel {
  struct Link {
    double alpha;  // seconds per message
    double beta;   // seconds per byte
  };
  Link intra{2e-6, 1.0 / 3e9};
  Link inter{5e-6, 1.0 / 1.25e9};  // default: a 10 Gb/s network
  double gamma = 1.0 / 10e9;       // seconds per byte reduced
  double copy_beta = 1.0 / 10e9;   // seconds per byte copied in memory (shm's copy-in and out)
  double flag_alpha = 0.5e-6;      // seconds per flag round through shared memory
  bool one_host = false;           // every rank on one host: shm can run
  // Hierarchical may run its intra-group phases through shm (every group on one host, and
  // Config::hierarchical_intra auto or shm), and whether a machine runs more ranks than it has
  // hardware threads (which of the forms auto picks depends on it).
  bool group_shm = false;
  bool crowded = false;

  // Predicted seconds of `algorithm` for `bytes` on `ranks` ranks in groups of `group_size`
  // (`groups` of them); nullopt for algorithms it has no model of (mpi).
  std::optional<double> predict(std::string_view algorithm, std::size_t bytes, int ranks,
                                int groups, int group_size) const;
};

}  // namespace gradcomm::collectives
