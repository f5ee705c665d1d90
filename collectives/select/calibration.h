#pragma once

// What auto measures of the machine on a communicator's first auto call (collective): the cost
// model's link and reduction parameters (calibrate), the placement facts that pick hierarchical's
// intra-group form (set_placement), and on hosts with more ranks than hardware threads, measured
// corrections to the model's predictions (probe_algorithms).

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/check/call_context.h"
#include "collectives/select/cost_model.h"
#include "core/communicator.h"
#include "topology/topology.h"

namespace gradcomm::collectives {

// Measures the links and the reduction rate on rank 0 and its peers; every rank gets rank 0's
// values, so every rank's model is the same. Well under a second (a few ms here).
CostModel calibrate(Communicator& comm, const topology::Topology& topo);

// Sets CostModel::group_shm and crowded, agreed by every rank.
void set_placement(Communicator& comm, const topology::Topology& topo, CostModel& model);

// Measured corrections to the model, for hosts with more ranks than hardware threads. The
// alpha-beta-gamma model gets each algorithm's cost right while every rank has a core (auto is
// within 1.10x of the best on 2 ranks here), but not the scheduler's part when ranks share
// cores: an algorithm whose every step needs a descheduled partner (halving_doubling) then loses
// to one whose senders need not wait for each other (flat) by 1.3-1.6x at 512 B - 32 KiB on 4
// ranks over 2 cores, where the model calls them even. So on such hosts every modelled
// algorithm is timed at a few sizes on first use (interleaved rounds, median, slowest rank), and
// predictions are scaled by measured / predicted, interpolated in log(size) between the probes.
// Elsewhere the probes would only add their noise to a model that is right.
inline constexpr std::size_t kProbeBytes[] = {8, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 8 << 20};
inline constexpr int kProbeRounds = 5;
inline constexpr double kProbeWindow = 300e-6;  // seconds per timed batch: well above barrier skew
inline constexpr double kProbeBudget = 0.3;     // seconds for all probes

struct Corrections {
  std::vector<std::string_view> algorithms;
  std::vector<double> log_factor;  // [probe][algorithm]
  std::vector<double> last_extra;  // [algorithm]: measured - predicted seconds at the last probe
  bool complete = false;           // every probe size was timed (not stopped by the budget)

  // The prediction scaled by measured / predicted, interpolated in log(size) between probes.
  // Past the last probe: the same factor when every probe ran (the largest is 8 MiB); when the
  // budget stopped them early (slow links), the last probe's excess as a fixed per-call cost,
  // so that at sizes no probe reached the link model decides, not a factor measured where
  // latency dominated.
  double apply(std::string_view algorithm, std::size_t bytes, double predicted) const;
};

// Calls in one timed batch of a probe: enough back to back to fill kProbeWindow (1 - 256), by
// the longer of the model's `predicted` seconds and `warm`, a timed warm-up call (the slowest
// rank's; 0: none). The probes run where the model is unreliable: MPICH's waits spin at
// MPI_THREAD_SINGLE, so with 3 ranks on 2 cores an 8-byte call of an MPI algorithm took 5 ms
// where the model said 1 us, and batches sized by the model (256 calls) made the first auto call
// take 17-28 s.
int probe_batch_calls(double predicted, double warm);

// Times every modelled algorithm at the probe sizes (interleaved rounds, median, slowest rank),
// within kProbeBudget; `call` is the auto call being served (its check is complete).
Corrections probe_algorithms(Communicator& comm, const CostModel& model, int groups, int group_size,
                             const CallContext& call);

// Rank 0's `text` on every rank.
std::string broadcast_string(Communicator& comm, std::string text);

}  // namespace gradcomm::collectives
