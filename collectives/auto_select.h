#pragma once

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
// At debug level it logs each new choice and why.
std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm);

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
