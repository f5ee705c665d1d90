// auto: the cost model's choice per call size, refined by measuring (select/learner.h), or a
// tuning table's (select/tuning_table.h). See auto_select.h and docs/selection.md.

#include "collectives/select/auto_select.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "collectives/registry.h"
#include "collectives/select/calibration.h"
#include "collectives/select/cost_model.h"
#include "collectives/select/learner.h"
#include "collectives/select/tuning_table.h"
#include "collectives/shm/segment.h"
#include "core/error.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

std::string milliseconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g ms", seconds * 1e3);
  return text;
}

// What auto knows about one communicator, set up on its first auto call.
// Decisions adopted (use_auto_decisions) before the communicator's first auto call.
class AdoptedDecisions : public Attachment {
 public:
  explicit AdoptedDecisions(Communicator&) {}
  std::optional<TuningTable> table;
};

class AutoState : public Attachment {
 public:
  AutoState(Communicator& comm, const CallContext& call) {
    const topology::Topology& topo = topology::topology_of(comm);
    groups = static_cast<int>(topo.groups.size());
    for (const auto& g : topo.groups)
      group_size = std::max(group_size, static_cast<int>(g.size()));
    const Config& config = comm.config();
    // The table: rank 0 reads it, everyone parses rank 0's text.
    std::string text;
    bool have_file = !config.tuning_file.empty();
    if (have_file && comm.rank() == 0) {
      std::ifstream in(config.tuning_file);
      std::ostringstream content;
      content << in.rdbuf();
      text = in ? content.str() : std::string();
    }
    if (have_file) {
      text = broadcast_string(comm, text);
      if (text.empty()) {
        throw InvalidArgument(error_message(
            "auto", comm.rank(), "cannot read GRADCOMM_TUNING_FILE '" + config.tuning_file + "'"));
      }
      TuningTable parsed = TuningTable::parse(text, config.tuning_file);
      if (parsed.ranks == comm.size() && parsed.groups == groups) {
        table = std::move(parsed);
      } else {
        comm.log(LogLevel::info, "auto: tuning table " + config.tuning_file + " is for " +
                                     std::to_string(parsed.ranks) + " ranks in " +
                                     std::to_string(parsed.groups) +
                                     " groups; using the cost model");
      }
    }
    if (AdoptedDecisions* adopted = comm.find_attachment<AdoptedDecisions>()) {
      if (adopted->table) {
        table = std::move(adopted->table);
        this->adopted = true;
      }
    }
    measuring = config.auto_measure && !table;
    if (config.calibrate) model = calibrate(comm, topo);
    model.one_host = shm_available(comm);
    set_placement(comm, topo, model);
    if (config.calibrate) {
      // Probing times the algorithms themselves; in the reproducible mode they all run the same
      // schedule, and with a table the model is not used.
      if (!table && !config.deterministic && model.crowded) {
        corrections = probe_algorithms(comm, model, groups, group_size, call);
        if (comm.log_enabled(LogLevel::debug)) {
          const std::size_t probes = corrections.log_factor.size() /
                                     std::max<std::size_t>(1, corrections.algorithms.size());
          comm.log(LogLevel::debug,
                   "auto: more ranks than hardware threads on one machine; timed " +
                       std::to_string(probes) + " probe size(s) up to " +
                       std::to_string(probes ? kProbeBytes[probes - 1] : 0) + " bytes");
        }
      }
    }
    if (comm.log_enabled(LogLevel::debug)) {
      comm.log(LogLevel::debug,
               "auto: model intra alpha " + std::to_string(model.intra.alpha * 1e6) + " us, " +
                   std::to_string(1e-9 / model.intra.beta) + " GB/s; inter alpha " +
                   std::to_string(model.inter.alpha * 1e6) + " us, " +
                   std::to_string(1e-9 / model.inter.beta) + " GB/s; reduce " +
                   std::to_string(1e-9 / model.gamma) + " GB/s; shm flag round " +
                   std::to_string(model.flag_alpha * 1e6) + " us" +
                   (config.calibrate ? " (calibrated)" : " (defaults)"));
    }
  }

  // The model's prediction for `algorithm`, scaled by the probes when there are any.
  std::optional<double> predict(std::string_view algorithm, std::size_t bytes, int ranks) const {
    const AllreduceAlgorithm* prototype = find_prototype(algorithm);
    if (prototype == nullptr) return std::nullopt;
    const auto p = prototype->predicted_seconds(model, {bytes, ranks, groups, group_size});
    if (!p) return p;
    return corrections.apply(algorithm, bytes, *p);
  }

  // The modelled algorithms' predictions for `bytes`, in the registry's order.
  void predictions(std::size_t bytes, int ranks, std::vector<std::string_view>& names,
                   std::vector<double>& seconds) const {
    names.clear();
    seconds.clear();
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      if (const auto p = predict(entry.name, bytes, ranks)) {
        names.push_back(entry.name);
        seconds.push_back(*p);
      }
    }
  }

  // One size class of measured choices: sizes [2^(b-1), 2^b) bytes for b = bit_width(bytes).
  struct SizeClass {
    bool set_up = false;
    std::optional<MeasuredChoice> choice;  // empty: the model decides alone (see size_class)
    std::string_view pending;              // the algorithm of the timed call under way
    std::size_t last_bytes = 0;            // the prediction of last_name for last_bytes
    std::string_view last_name;
    double last_predicted = 0;
    // What a window's end costs: the model's two 8-byte calls at first, then what the ends
    // measured (the slowest rank's, averaged: on oversubscribed cores the agreement waits for
    // every rank to be scheduled, 10x the model's figure)
    double decision = 0;
    double last_end = 0;  // this rank's seconds in the previous window's end
    // begin_auto_call's, for cancel_auto_call: whether that call set the class up, and where
    // the choice's counting stood before it.
    bool set_up_by_call = false;
    MeasuredChoice::Mark mark;
  };

  std::optional<TuningTable> table;
  bool adopted = false;  // the table came from use_auto_decisions
  CostModel model;
  Corrections corrections;
  int groups = 1;
  int group_size = 1;
  bool measuring = false;  // Config::auto_measure, and the model decides
  std::string_view last;   // the model's or table's latest choice, made for last_bytes
  std::size_t last_bytes = 0;
  std::unordered_map<std::size_t, std::string_view> decisions;  // bytes -> registry name (table)
  std::array<SizeClass, 65> classes;                            // by bit_width(bytes) (model)
  std::vector<std::pair<std::string_view, double>> test_scale;
};

// The communicator's auto state, set up (collectively) by its first auto call, `call`.
AutoState& state_of(Communicator& comm, const CallContext& call) {
  if (AutoState* state = comm.find_attachment<AutoState>()) return *state;
  return comm.attach(std::make_unique<AutoState>(comm, call));
}

}  // namespace

std::optional<double> predicted_allreduce_seconds(Communicator& comm, std::string_view algorithm,
                                                  std::size_t bytes) {
  comm.settle();
  return state_of(comm, CallContext{}).predict(algorithm, bytes, comm.size());
}

namespace {

std::string explain(const AutoState& state, std::size_t bytes, int ranks,
                    const MeasuredChoice* measured) {
  std::vector<std::string_view> names;
  std::vector<double> predicted;
  state.predictions(bytes, ranks, names, predicted);
  std::string why;
  if (measured != nullptr) {
    for (std::size_t i = 0; i < measured->names().size(); ++i) {
      if (!measured->measured(i)) continue;
      const auto at = std::find(names.begin(), names.end(), measured->names()[i]);
      const double p = predicted[static_cast<std::size_t>(at - names.begin())];
      why += (why.empty() ? "measured " : ", ") + std::string(measured->names()[i]) + " " +
             milliseconds(measured->expected(i, p));
    }
    if (!why.empty()) why += "; ";
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    why +=
        (i == 0 ? "predicted " : ", ") + std::string(names[i]) + " " + milliseconds(predicted[i]);
  }
  return why;
}

// The size class of `bytes`, set up on its first call: measured when more than one algorithm is
// modelled.
AutoState::SizeClass& size_class(AutoState& state, Communicator& comm, std::size_t bytes) {
  AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
  if (c.set_up) return c;
  c.set_up = true;
  std::vector<std::string_view> names;
  std::vector<double> predicted;
  state.predictions(bytes, comm.size(), names, predicted);
  if (names.size() < 2) return c;
  std::vector<std::string_view> unused;
  std::vector<double> small;
  state.predictions(8, comm.size(), unused, small);
  c.decision = 2 * *std::min_element(small.begin(), small.end());
  const WindowShape shape =
      window_shape(*std::min_element(predicted.begin(), predicted.end()), c.decision);
  c.choice.emplace(std::move(names), predicted, shape.stride, shape.window, shape.duel,
                   shape.challenger_calls);
  return c;
}

}  // namespace

std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm) {
  AutoState& state = state_of(comm, args.call);
  const std::size_t bytes = args.count * args.element_bytes();
  if (state.measuring) {
    AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
    if (!c.set_up && size_class(state, comm, bytes).choice && comm.log_enabled(LogLevel::debug)) {
      comm.log(LogLevel::debug,
               "auto: " + std::string(c.choice->choice()) + " for " + std::to_string(bytes) +
                   " bytes on " + std::to_string(comm.size()) + " ranks (" +
                   explain(state, bytes, comm.size(), nullptr) + "); measuring it");
    }
    if (c.choice) return c.choice->choice();
  }
  // Decisions are cached per size: this runs on every auto call, and small calls take ~1 us.
  if (bytes == state.last_bytes && !state.last.empty()) return state.last;
  if (const auto hit = state.decisions.find(bytes); hit != state.decisions.end()) {
    state.last_bytes = bytes;
    return state.last = hit->second;
  }
  std::string_view choice;
  if (state.table) {
    const auto& rows = state.table->rows;
    const auto it = std::find_if(rows.begin(), rows.end(),
                                 [&](const TuningTable::Row& r) { return bytes <= r.max_bytes; });
    const std::string& name = (it == rows.end() ? rows.back() : *it).algorithm;
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      if (entry.name == name) choice = entry.name;
    }
  } else {
    double best = 0;
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      const auto predicted = state.predict(entry.name, bytes, comm.size());
      if (predicted && (choice.empty() || *predicted < best)) {
        best = *predicted;
        choice = entry.name;
      }
    }
  }
  if (state.decisions.size() >= 4096) state.decisions.clear();
  state.decisions.emplace(bytes, choice);
  if (state.last != choice && comm.log_enabled(LogLevel::debug)) {
    const std::string why = state.table
                                ? (state.adopted ? std::string("adopted decisions")
                                                 : "tuning table " + comm.config().tuning_file)
                                : explain(state, bytes, comm.size(), nullptr);
    comm.log(LogLevel::debug, "auto: " + std::string(choice) + " for " + std::to_string(bytes) +
                                  " bytes on " + std::to_string(comm.size()) + " ranks (" + why +
                                  ")");
  }
  state.last = choice;
  state.last_bytes = bytes;
  return choice;
}

std::string_view begin_auto_call(const AllreduceArgs& args, Communicator& comm, bool& timed) {
  timed = false;
  AutoState& state = state_of(comm, args.call);
  if (state.measuring) {
    const std::size_t bytes = args.count * args.element_bytes();
    AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
    const bool was_set_up = c.set_up;
    if (!c.set_up) select_allreduce_algorithm(args, comm);  // sets it up
    c.set_up_by_call = !was_set_up;
    if (c.choice) {
      c.mark = c.choice->mark();
      const MeasuredChoice::Pick pick = c.choice->pick();
      timed = pick.timed;
      c.pending = pick.algorithm;
      return pick.algorithm;
    }
  }
  return select_allreduce_algorithm(args, comm);
}

void cancel_auto_call(const AllreduceArgs& args, Communicator& comm) {
  AutoState* state = comm.find_attachment<AutoState>();
  if (state == nullptr || !state->measuring) return;
  AutoState::SizeClass& c = state->classes[std::bit_width(args.count * args.element_bytes())];
  if (c.set_up_by_call) {
    c = AutoState::SizeClass{};  // set up again by the class's next call, alike on every rank
  } else if (c.choice) {
    c.choice->rewind(c.mark);
  }
}

void end_auto_call(const AllreduceArgs& args, Communicator& comm, double seconds) {
  AutoState& state = state_of(comm, args.call);
  const std::size_t bytes = args.count * args.element_bytes();
  AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
  const std::string_view algorithm = c.pending;
  for (const auto& [name, factor] : state.test_scale) {
    if (name == algorithm) seconds *= factor;
  }
  if (c.last_bytes != bytes || c.last_name != algorithm) {
    c.last_bytes = bytes;
    c.last_name = algorithm;
    c.last_predicted = state.predict(algorithm, bytes, comm.size()).value_or(1.0);
  }
  if (!c.choice->record(seconds / c.last_predicted)) return;
  // The window's figures: every rank's median of each algorithm's timed calls, the slowest
  // rank's (every rank then holds the same numbers), and what the previous window's end cost the
  // slowest rank (so every rank sizes the next windows alike). A rank whose peers made another
  // call must not wait here for them: the call's comparison first.
  const auto end_started = std::chrono::steady_clock::now();
  args.call.require_check();
  const std::array<double, 2> mine = c.choice->figures();
  std::array<double, 3> figures = {mine[0], mine[1], c.last_end};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, figures.data(), 3, MPI_DOUBLE, MPI_MAX, comm.mpi_comm()),
            "auto: MPI_Allreduce", comm.rank());
  c.last_end =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - end_started).count();
  if (figures[2] > 0) c.decision = (c.decision + figures[2]) / 2;
  const std::array<double, 2> agreed = {figures[0], figures[1]};
  std::vector<std::string_view> names;
  std::vector<double> all;
  state.predictions(bytes, comm.size(), names, all);
  std::vector<double> predicted;
  for (std::string_view name : c.choice->names()) {
    predicted.push_back(
        all[static_cast<std::size_t>(std::find(names.begin(), names.end(), name) - names.begin())]);
  }
  const bool changed = c.choice->decide(agreed, predicted);
  // The next windows are shaped by what the choice measured, not by the model's prediction
  // (which is off by up to 4x for short calls here).
  const WindowShape shape = window_shape(c.choice->expected_choice(predicted), c.decision);
  c.choice->reshape(shape.stride, shape.window, shape.duel, shape.challenger_calls);
  if ((changed || c.choice->dueling()) && comm.log_enabled(LogLevel::debug)) {
    const std::string what = changed ? std::string(c.choice->choice()) + " now"
                                     : "measuring " + std::string(c.choice->challenger()) +
                                           " against " + std::string(c.choice->choice());
    comm.log(LogLevel::debug, "auto: " + what + " for " + std::to_string(bytes) + " bytes on " +
                                  std::to_string(comm.size()) + " ranks (" +
                                  explain(state, bytes, comm.size(), &*c.choice) + ")");
  }
}

bool auto_settled(const AllreduceArgs& args, Communicator& comm) {
  // One rank and reproducible mode never reach the selection.
  if (comm.size() == 1 || comm.config().deterministic) return true;
  AutoState& state = state_of(comm, args.call);
  if (!state.measuring) return true;
  const AutoState::SizeClass& c = state.classes[std::bit_width(args.count * args.element_bytes())];
  if (!c.set_up) return false;
  return !c.choice || c.choice->settled();
}

void scale_auto_timing_for_testing(Communicator& comm, std::string_view algorithm, double factor) {
  comm.settle();
  AutoState& state = state_of(comm, CallContext{});
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.name == algorithm) state.test_scale.emplace_back(entry.name, factor);
  }
}

}  // namespace gradcomm::collectives

namespace gradcomm::collectives {

TuningTable auto_decisions(Communicator& comm) {
  comm.settle();  // requests in flight may still be deciding
  TuningTable out;
  out.ranks = comm.size();
  AutoState* state = comm.find_attachment<AutoState>();
  if (state == nullptr) {
    AdoptedDecisions* adopted = comm.find_attachment<AdoptedDecisions>();
    if (adopted != nullptr && adopted->table) return *adopted->table;
    return out;  // auto never ran here: no decisions
  }
  out.groups = state->groups;
  if (state->table) return *state->table;
  // Measured size classes decide for their whole class, [2^(b-1), 2^b); the model's decisions
  // were made per size. The table's rule (the first row whose max_bytes >= the size) gives back
  // exactly these for every size seen, and the next row's for sizes never seen.
  for (std::size_t b = 0; b < state->classes.size(); ++b) {
    const AutoState::SizeClass& c = state->classes[b];
    if (!c.set_up || !c.choice) continue;
    const std::size_t top = b >= 64 ? SIZE_MAX : (std::size_t{1} << b) - 1;
    out.rows.push_back({top, std::string(c.choice->choice())});
  }
  for (const auto& [bytes, name] : state->decisions)
    out.rows.push_back({bytes, std::string(name)});
  std::stable_sort(out.rows.begin(), out.rows.end(),
                   [](const TuningTable::Row& a, const TuningTable::Row& b) {
                     return a.max_bytes < b.max_bytes;
                   });
  return out;
}

void use_auto_decisions(Communicator& comm, const TuningTable& table) {
  comm.settle();
  if (table.rows.empty()) return;
  if (table.ranks != comm.size()) {
    throw InvalidArgument(error_message("use_auto_decisions", comm.rank(),
                                        "the decisions are for " + std::to_string(table.ranks) +
                                            " ranks, this communicator has " +
                                            std::to_string(comm.size())));
  }
  for (const TuningTable::Row& row : table.rows) {
    if (find_prototype(row.algorithm) == nullptr) {
      throw InvalidArgument(error_message("use_auto_decisions", comm.rank(),
                                          "unknown algorithm '" + row.algorithm + "'"));
    }
  }
  AutoState* state = comm.find_attachment<AutoState>();
  if (state == nullptr) {
    comm.attachment<AdoptedDecisions>().table = table;
    return;
  }
  state->table = table;
  state->adopted = true;
  state->measuring = false;
  state->decisions.clear();
  state->last = {};
  state->last_bytes = 0;
}

}  // namespace gradcomm::collectives
