#pragma once

// The parameters of auto's alpha-beta-gamma cost model (Thakur, Rabenseifner and Gropp 2005):
// time = alpha + bytes * beta per message, bytes * gamma per reduction. Each algorithm owns its
// formula (AllreduceAlgorithm::predicted_seconds); these are the machine's figures it plugs in,
// from defaults or from a short calibration (select/calibration.h).

#include <cstddef>

namespace gradcomm::collectives {

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
  // Config::hierarchical_intra auto or shm); whether a machine runs more ranks than it has
  // hardware threads (auto then probes the algorithms' times before trusting the model).
  bool group_shm = false;
  bool crowded = false;
  // shm's latency-path limit where ranks have CPUs of their own (the smallest rank's
  // shm_small_own_cpu_bytes_here(), agreed by set_placement).
  std::size_t shm_small_own_cpu = std::size_t{1} << 10;

  // The link of an algorithm that does not know groups: as slow as its worst link.
  Link worst_link(int groups) const { return groups > 1 ? inter : intra; }
  // A group's ranks share its link to the other groups (one NIC per node, which the calibration
  // measures with one stream): when `streams` of them cross at once, each gets 1/streams of it.
  Link shared_inter(int streams) const {
    Link l = inter;
    l.beta *= streams > 1 ? streams : 1;
    return l;
  }
};

// One call as the model sees it: `bytes` on `ranks` ranks in `groups` groups of (at most)
// `group_size` ranks, placed group by group.
struct CostQuery {
  std::size_t bytes;
  int ranks;
  int groups = 1;
  int group_size = 1;
};

}  // namespace gradcomm::collectives
