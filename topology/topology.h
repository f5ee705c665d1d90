#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/communicator.h"

namespace gradcomm::topology {

// What hwloc sees on this rank's host.
struct Hardware {
  struct Cache {
    int level;          // 1, 2, 3
    int count;          // instances (data and unified caches)
    std::size_t bytes;  // size of one instance
  };
  struct Gpu {
    std::string pci_bus_id;  // "0000:3b:00.0"
    std::string name;        // hwloc's PCI name, if any
    int numa_node;           // OS index of the closest NUMA node, -1 if unknown
  };
  int packages = 0;
  int numa_nodes = 0;
  int cores = 0;
  int hardware_threads = 0;
  std::vector<Cache> caches;
  std::vector<Gpu> gpus;  // NVIDIA GPUs: PCI vendor 0x10de, class display/3D
};

// The layout all ranks of a communicator agree on: which ranks share a node, and the groups the
// hierarchical all-reduce uses (nodes; or with the DGX-1 preset, the two fully connected quads
// of each 8-GPU server).
struct Topology {
  int rank = 0;
  int size = 1;
  std::vector<int> node_of_rank;         // node index of every rank
  std::vector<std::vector<int>> nodes;   // ranks of every node, ascending
  std::vector<int> host_of_rank;         // real host of every rank, whatever layout is emulated
  std::vector<int> group_of_rank;        // hierarchical group of every rank
  std::vector<std::vector<int>> groups;  // ranks of every group, ascending
  std::string source;                    // "discovered", "GRADCOMM_RANKS_PER_NODE=4", "dgx1"
  Hardware hardware;                     // this rank's host
  // The hierarchical all-reduce's levels, innermost first: the group of every rank at each.
  // One level (group_of_rank) but with the DGX-1 preset on more than one server: quads, then
  // servers (quad -> server -> across servers).
  std::vector<std::vector<int>> levels;

  int node() const { return node_of_rank[static_cast<std::size_t>(rank)]; }
  int local_rank() const;  // index of this rank inside its node
  int local_size() const {
    return static_cast<int>(nodes[static_cast<std::size_t>(node())].size());
  }
  // This rank's hierarchical group, its members, and this rank's index among them.
  int group() const { return group_of_rank[static_cast<std::size_t>(rank)]; }
  const std::vector<int>& my_group() const { return groups[static_cast<std::size_t>(group())]; }
  int group_local_rank() const;
};

// The ranks of every index in `index_of_rank` (rank r has index index_of_rank[r]), ascending; an
// index no rank has gives an empty list.
std::vector<std::vector<int>> members(const std::vector<int>& index_of_rank);

// Discovers the layout of `comm` (collective). Nodes come from MPI_Comm_split_type(SHARED), or
// from the emulation Config::ranks_per_node (every k consecutive ranks form a node; the last may
// be smaller), or from the preset Config::topology_preset == "dgx1" (8 ranks per server, groups
// = quads 0-3 and 4-7). Settings that differ across ranks throw InvalidArgument naming the
// variable. Applies Config::bind (hwloc) and logs the binding at debug level.
Topology discover(Communicator& comm);

// The communicator's topology, discovered on first use (collective then) and cached.
const Topology& topology_of(Communicator& comm);

// Hardware of this host (hwloc). Throws CommError if hwloc fails.
Hardware discover_hardware();

// Human-readable and JSON renderings (for gradcomm-topo).
std::string describe(const Topology& topology);
std::string to_json(const Topology& topology, const std::vector<std::string>& hosts);

}  // namespace gradcomm::topology
