// gradcomm-learner-replay: replays traces from gradcomm-learner-trace through auto's learner
// (MeasuredChoice) and variants of it with one mechanism taken out, and says what each would
// have cost (docs/selection.md, "What each mechanism buys"). No MPI: the same pure logic auto
// runs, fed the times the trace holds.
//
//   gradcomm-learner-replay trace.csv [more.csv ...]
//
// The k-th call of a replay costs what the trace's round k measured for the algorithm the learner
// picked (a round holds one call of every algorithm, under the same machine state), plus a
// window's end (the trace's `decision`) at every window the learner closes. So every variant
// meets the same machine. Each size is replayed from 8 starting rounds spread over its trace, each
// replay running through the whole trace once (wrapping round to its start); a row gives the
// median and range over those 8 of
//   total / (the fastest single algorithm's total over the same calls).
// The per-round best ("oracle") is the floor no learner reaches; "model" runs the model's pick
// throughout (auto without measuring).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/select/learner.h"

namespace {

using gradcomm::collectives::LearnerTuning;
using gradcomm::collectives::MeasuredChoice;
using gradcomm::collectives::window_shape;
using gradcomm::collectives::WindowShape;

struct Trace {
  std::string file;
  int ranks = 0;
  std::size_t bytes = 0;
  double decision = 0;
  std::vector<std::string> names;
  std::vector<double> predicted;
  std::vector<std::vector<double>> rounds;  // [round][algorithm]
};

// The file's traces, one per size: a "# predicted" line, then its rows
// (bytes,round,algorithm,seconds).
std::vector<Trace> read(const std::string& file) {
  std::ifstream in(file);
  if (!in) {
    std::fprintf(stderr, "gradcomm-learner-replay: cannot read %s\n", file.c_str());
    std::exit(2);
  }
  std::vector<Trace> traces;
  int ranks = 0;
  double decision = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# gradcomm-learner-trace: ", 0) == 0) {
      ranks = std::atoi(line.c_str() + 26);
    } else if (line.rfind("# decision ", 0) == 0) {
      decision = std::atof(line.c_str() + 11);
    } else if (line.rfind("# predicted ", 0) == 0) {
      Trace t;
      t.file = file;
      t.ranks = ranks;
      t.decision = decision;
      std::istringstream fields(line.substr(12));
      fields >> t.bytes;
      std::string item;
      while (fields >> item) {
        const std::size_t eq = item.find('=');
        t.names.push_back(item.substr(0, eq));
        t.predicted.push_back(std::atof(item.c_str() + eq + 1));
      }
      traces.push_back(std::move(t));
    } else if (!line.empty() && line[0] != '#' && line.rfind("bytes,", 0) != 0 && !traces.empty()) {
      Trace& t = traces.back();
      std::istringstream fields(line);
      std::string bytes, round, name, seconds;
      std::getline(fields, bytes, ',');
      std::getline(fields, round, ',');
      std::getline(fields, name, ',');
      std::getline(fields, seconds, ',');
      const std::size_t r = std::strtoull(round.c_str(), nullptr, 10);
      const auto at = std::find(t.names.begin(), t.names.end(), name);
      if (at == t.names.end()) continue;
      if (t.rounds.size() <= r) t.rounds.resize(r + 1, std::vector<double>(t.names.size(), 0));
      t.rounds[r][static_cast<std::size_t>(at - t.names.begin())] = std::atof(seconds.c_str());
    }
  }
  return traces;
}

// What `tuning`'s learner spends over the trace's rounds [start, start + n) (wrapping).
double replay(const Trace& t, std::size_t start, std::size_t n, const LearnerTuning& tuning) {
  std::vector<std::string_view> names(t.names.begin(), t.names.end());
  WindowShape shape =
      window_shape(*std::min_element(t.predicted.begin(), t.predicted.end()), t.decision);
  MeasuredChoice m(names, t.predicted, shape.stride, shape.window, shape.duel,
                   shape.challenger_calls, tuning);
  double total = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const auto& round = t.rounds[(start + k) % t.rounds.size()];
    const MeasuredChoice::Pick pick = m.pick();
    const std::size_t a = static_cast<std::size_t>(
        std::find(names.begin(), names.end(), pick.algorithm) - names.begin());
    total += round[a];
    if (pick.timed && m.record(round[a] / t.predicted[a])) {
      total += t.decision;
      m.decide(m.figures(), t.predicted);
      shape = window_shape(m.expected_choice(t.predicted), t.decision);
      m.reshape(shape.stride, shape.window, shape.duel, shape.challenger_calls);
    }
  }
  return total;
}

// The same calls under a fixed rule: `pick(round)` is the algorithm's index.
double fixed(const Trace& t, std::size_t start, std::size_t n,
             const std::function<std::size_t(const std::vector<double>&)>& pick) {
  double total = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const auto& round = t.rounds[(start + k) % t.rounds.size()];
    total += round[pick(round)];
  }
  return total;
}

struct Variant {
  const char* name;
  LearnerTuning tuning;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  v.push_back({"learner (as shipped)", LearnerTuning{}});
  LearnerTuning t;
  t.recheck_budget = 0;
  v.push_back({"- re-checks", t});
  t = LearnerTuning{};
  t.try_untried = false;
  v.push_back({"- trials", t});
  t = LearnerTuning{};
  t.max_recheck_backoff = 1;
  v.push_back({"- re-check backoff", t});
  t = LearnerTuning{};
  t.recheck_once_faster = false;
  v.push_back({"- once-faster re-check", t});
  return v;
}

void print_row(const char* name, std::vector<double> ratios) {
  std::sort(ratios.begin(), ratios.end());
  const std::size_t n = ratios.size();
  const double median = n % 2 ? ratios[n / 2] : (ratios[n / 2 - 1] + ratios[n / 2]) / 2;
  std::printf("  %-26s %7.4f  [%6.4f, %6.4f]\n", name, median, ratios.front(), ratios.back());
}

// One scenario over one trace: every variant's ratio to the fastest single algorithm, from
// kStarts starting rounds.
void evaluate(const Trace& t, const char* scenario) {
  constexpr std::size_t kStarts = 8;
  const std::size_t n = t.rounds.size();
  const std::size_t model = static_cast<std::size_t>(
      std::min_element(t.predicted.begin(), t.predicted.end()) - t.predicted.begin());
  const auto all = variants();
  std::vector<std::vector<double>> ratios(all.size() + 2);
  std::size_t best_single = 0;
  for (std::size_t s = 0; s < kStarts; ++s) {
    const std::size_t start = s * n / kStarts;
    double best = 0;
    for (std::size_t a = 0; a < t.names.size(); ++a) {
      const double total = fixed(t, start, n, [a](const std::vector<double>&) { return a; });
      if (a == 0 || total < best) {
        best = total;
        best_single = a;
      }
    }
    ratios[0].push_back(fixed(t, start, n,
                              [](const std::vector<double>& r) {
                                return static_cast<std::size_t>(
                                    std::min_element(r.begin(), r.end()) - r.begin());
                              }) /
                        best);
    ratios[1].push_back(fixed(t, start, n, [model](const std::vector<double>&) { return model; }) /
                        best);
    for (std::size_t v = 0; v < all.size(); ++v)
      ratios[v + 2].push_back(replay(t, start, n, all[v].tuning) / best);
  }
  std::printf("%s: %d ranks, %zu bytes, %zu rounds, %s; fastest single: %s; model picks %s\n",
              t.file.c_str(), t.ranks, t.bytes, n, scenario, t.names[best_single].c_str(),
              t.names[model].c_str());
  print_row("oracle (per-round best)", ratios[0]);
  print_row("model only", ratios[1]);
  for (std::size_t v = 0; v < all.size(); ++v)
    print_row(all[v].name, ratios[v + 2]);
}

// The algorithms by their total over the whole trace, fastest first.
std::vector<std::size_t> ranking(const Trace& t) {
  std::vector<double> totals(t.names.size(), 0);
  for (const auto& round : t.rounds)
    for (std::size_t a = 0; a < totals.size(); ++a)
      totals[a] += round[a];
  std::vector<std::size_t> order(totals.size());
  for (std::size_t a = 0; a < order.size(); ++a)
    order[a] = a;
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return totals[x] < totals[y]; });
  return order;
}

}  // namespace

// Scenarios, each over the same measured times:
// - as measured: the model's predictions as the trace recorded them;
// - model wrong (1.5x, 3x): the fastest algorithm predicted at 1.5x (within the trial factor) or
//   3x (beyond it) the lowest prediction of the others, so the model picks another;
// - model wrong (1.5x) and 10x slow: the same, and every prediction 10x (a link's latency
//   calibrated far too high, as Intel MPI's ping-pong once did on a 2-CPU Xeon: every algorithm
//   then measures far below its prediction);
// - state change: from the trace's middle on, the fastest and the second swap their times (the
//   machine changed under a settled choice);
// - transient: the fastest algorithm 10x slow over a 64th of the trace from its first quarter
//   on (unbound ranks sharing a CPU for a while: shm's flag waits then cost a context switch
//   each), then as measured again.
int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: gradcomm-learner-replay trace.csv [more.csv ...]\n");
    return 2;
  }
  for (int f = 1; f < argc; ++f) {
    for (const Trace& t : read(argv[f])) {
      if (t.rounds.size() < 16 || t.names.size() < 2) continue;
      evaluate(t, "as measured");
      const std::vector<std::size_t> order = ranking(t);
      double lowest_other = 0;
      for (std::size_t a = 0; a < t.names.size(); ++a) {
        if (a != order[0] && (lowest_other == 0 || t.predicted[a] < lowest_other)) {
          lowest_other = t.predicted[a];
        }
      }
      for (const double factor : {1.5, 3.0}) {
        Trace wrong = t;
        wrong.predicted[order[0]] = factor * lowest_other;
        evaluate(wrong, factor < 2 ? "model wrong (1.5x)" : "model wrong (3x)");
        if (factor < 2) {
          for (double& p : wrong.predicted)
            p *= 10;
          evaluate(wrong, "model wrong (1.5x) and 10x slow");
        }
      }
      Trace changed = t;
      for (std::size_t r = changed.rounds.size() / 2; r < changed.rounds.size(); ++r)
        std::swap(changed.rounds[r][order[0]], changed.rounds[r][order[1]]);
      evaluate(changed, "state change");
      Trace transient = t;
      const std::size_t from = transient.rounds.size() / 4;
      for (std::size_t r = from; r < from + transient.rounds.size() / 64; ++r)
        transient.rounds[r][order[0]] *= 10;
      evaluate(transient, "transient (fastest 10x slow for 1/64 of the trace)");
    }
  }
  return 0;
}
