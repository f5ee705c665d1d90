#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "collectives/allreduce_algorithm.h"
#include "collectives/select/tuning_table.h"

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
// GRADCOMM_AUTO_MEASURE; see MeasuredChoice in select/learner.h): this returns the current choice
// for the call's size class. At debug level it logs each new choice and why. Asking is not a call:
// it changes nothing (gradcomm-bench's picks column).
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
// The auto call begun last ended in a MismatchError (the ranks' calls differed: another size,
// or a call that failed on some rank before it could run): undoes what begin_auto_call and
// end_auto_call counted for it, and a size class it set up, so that every rank's measuring
// windows stay in step (a rank whose window ends agrees its figures with the others in an
// MPI_Allreduce, which would otherwise wait for ranks that end theirs at another call).
void cancel_auto_call(const AllreduceArgs& args, Communicator& comm);

// True when auto has finished exploring calls like `args`: its choice for their size class has
// been measured (at least one window decided) and no duel is under way (MeasuredChoice::settled),
// or auto does not measure them (one rank, one candidate,
// GRADCOMM_AUTO_MEASURE=0, a tuning table, reproducible mode). The same on every rank. For
// gradcomm-bench, which times auto in its steady state (and reports what exploring cost).
bool auto_settled(const AllreduceArgs& args, Communicator& comm);

// auto's decisions so far as a tuning table (select/tuning_table.h): the measured choice of every
// size class it has seen, the model's choice for every size it decided by model, or the table it
// uses. No rows where auto never ran on `comm`. The same on every rank where auto measured
// (its decisions are agreed); a model's calibration is rank 0's, broadcast.
TuningTable auto_decisions(Communicator& comm);

// From now on auto decides on `comm` by `table` (as a tuning file would; no measuring): with the
// table auto_decisions gave, later calls run the algorithms they would have run had measuring
// stopped there. So a checkpointed run and its resumed continuation make the same choices, and
// end bit-identical. Every rank must pass the same table. Throws InvalidArgument for a table of
// another rank count or with an unknown algorithm; an empty table changes nothing.
void use_auto_decisions(Communicator& comm, const TuningTable& table);

// Tests only: auto's measured times of `algorithm` on this rank are multiplied by `factor` (a
// model that is wrong about it, on demand). Call on every rank alike.
void scale_auto_timing_for_testing(Communicator& comm, std::string_view algorithm, double factor);

// The cost model's predicted seconds for `algorithm` on `bytes` (as auto sees it: calibrated,
// scaled by the probes where there are any); nullopt for algorithms it has no model of (mpi,
// nccl, auto). Collective on a communicator's first use of auto. For gradcomm-bench's model_us.
std::optional<double> predicted_allreduce_seconds(Communicator& comm, std::string_view algorithm,
                                                  std::size_t bytes);

}  // namespace gradcomm::collectives
