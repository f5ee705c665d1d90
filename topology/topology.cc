#include "topology/topology.h"

#include <hwloc.h>

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "core/node_comm.h"

namespace gradcomm::topology {
namespace {

constexpr int kDgx1ServerRanks = 8;
constexpr int kDgx1QuadRanks = 4;
constexpr unsigned kNvidiaVendor = 0x10de;

// RAII hwloc topology with I/O devices (for GPUs).
class Hwloc {
 public:
  Hwloc() {
    if (hwloc_topology_init(&topo_) != 0) fail("hwloc_topology_init");
    hwloc_topology_set_io_types_filter(topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(topo_) != 0) fail("hwloc_topology_load");
  }
  ~Hwloc() { hwloc_topology_destroy(topo_); }
  Hwloc(const Hwloc&) = delete;
  Hwloc& operator=(const Hwloc&) = delete;
  hwloc_topology_t get() const { return topo_; }
  int count(hwloc_obj_type_t type) const {
    return std::max(0, hwloc_get_nbobjs_by_type(topo_, type));
  }

 private:
  [[noreturn]] static void fail(const char* call) {
    throw CommError(error_message("topology", -1, std::string(call) + " failed"));
  }
  hwloc_topology_t topo_ = nullptr;
};

// This machine's topology, loaded once per process: a load reads sysfs for about 16 ms on a
// 2-vCPU VM (45 the first time), which every communicator's first call paid (each torch new_group,
// each test's communicator). Read-only after the load, which hwloc allows from any thread at once;
// never freed, as threads may read it until the process exits.
const Hwloc& machine() {
  static const Hwloc* const loaded = new Hwloc();
  return *loaded;
}

Hardware read_hardware(const Hwloc& hw) {
  Hardware h;
  h.packages = hw.count(HWLOC_OBJ_PACKAGE);
  h.numa_nodes = hw.count(HWLOC_OBJ_NUMANODE);
  h.cores = hw.count(HWLOC_OBJ_CORE);
  h.hardware_threads = hw.count(HWLOC_OBJ_PU);
  const hwloc_obj_type_t caches[] = {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L3CACHE};
  for (int level = 1; level <= 3; ++level) {
    const hwloc_obj_type_t type = caches[level - 1];
    const int count = hw.count(type);
    if (count == 0) continue;
    const hwloc_obj_t first = hwloc_get_obj_by_type(hw.get(), type, 0);
    h.caches.push_back({level, count, static_cast<std::size_t>(first->attr->cache.size)});
  }
  for (hwloc_obj_t pci = hwloc_get_next_pcidev(hw.get(), nullptr); pci != nullptr;
       pci = hwloc_get_next_pcidev(hw.get(), pci)) {
    const auto& attr = pci->attr->pcidev;
    const unsigned base_class = attr.class_id >> 8;  // 0x03: display controllers (VGA, 3D)
    if (attr.vendor_id != kNvidiaVendor || base_class != 0x03) continue;
    char bus_id[32];
    std::snprintf(bus_id, sizeof bus_id, "%04x:%02x:%02x.%01x", attr.domain, attr.bus, attr.dev,
                  attr.func);
    int numa = -1;
    const hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(hw.get(), pci);
    if (parent != nullptr && parent->nodeset != nullptr && !hwloc_bitmap_iszero(parent->nodeset)) {
      numa = hwloc_bitmap_first(parent->nodeset);
    }
    h.gpus.push_back({bus_id, pci->name ? pci->name : "", numa});
  }
  return h;
}

// Binds this process to its share of the node's cores or NUMA nodes; returns a description.
std::string bind(const Hwloc& hw, const std::string& mode, int local_rank, int local_size) {
  const hwloc_obj_type_t type = mode == "numa" ? HWLOC_OBJ_NUMANODE : HWLOC_OBJ_CORE;
  const int units = hw.count(type);
  if (units == 0) return "nothing to bind to";
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  // Rank i of L gets units [i*U/L, (i+1)*U/L); with more ranks than units, unit i % U.
  const int first = units >= local_size ? local_rank * units / local_size : local_rank % units;
  const int last = units >= local_size ? (local_rank + 1) * units / local_size : first + 1;
  for (int u = first; u < last; ++u) {
    const hwloc_obj_t obj = hwloc_get_obj_by_type(hw.get(), type, static_cast<unsigned>(u));
    hwloc_bitmap_or(set, set, obj->cpuset);
  }
  char* text = nullptr;
  hwloc_bitmap_asprintf(&text, set);
  const int rc = hwloc_set_cpubind(hw.get(), set, HWLOC_CPUBIND_PROCESS);
  std::string result = std::string(mode) + " " + std::to_string(first) + "-" +
                       std::to_string(last - 1) + " (cpuset " + (text ? text : "?") + ")" +
                       (rc == 0 ? "" : ": hwloc_set_cpubind failed, not bound");
  std::free(text);
  hwloc_bitmap_free(set);
  return result;
}

void check_same_on_all_ranks(Communicator& comm, long long value, const char* variable) {
  long long lo = value;
  long long hi = value;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_LONG_LONG, MPI_MIN, comm.mpi_comm()),
            "topology: MPI_Allreduce", comm.rank());
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_LONG_LONG, MPI_MAX, comm.mpi_comm()),
            "topology: MPI_Allreduce", comm.rank());
  if (lo != hi) {
    throw InvalidArgument(
        error_message("topology", comm.rank(),
                      std::string(variable) + " differs across ranks (values from " +
                          std::to_string(lo) + " to " + std::to_string(hi) + " here " +
                          std::to_string(value) + "); set it identically for every rank"));
  }
}

// Node index of every rank from shared-memory domains, numbered by their lowest rank.
std::vector<int> discover_nodes(Communicator& comm) {
  const NodeComm node(comm.mpi_comm(), comm.rank(), "topology");
  // The lowest world rank of each node names it; nodes are numbered in that order.
  int leader = comm.rank();
  check_mpi(MPI_Bcast(&leader, 1, MPI_INT, 0, node.get()), "topology: MPI_Bcast", comm.rank());
  std::vector<int> leader_of(static_cast<std::size_t>(comm.size()));
  check_mpi(MPI_Allgather(&leader, 1, MPI_INT, leader_of.data(), 1, MPI_INT, comm.mpi_comm()),
            "topology: MPI_Allgather", comm.rank());
  std::vector<int> leaders = leader_of;
  std::sort(leaders.begin(), leaders.end());
  leaders.erase(std::unique(leaders.begin(), leaders.end()), leaders.end());
  std::vector<int> node_of(leader_of.size());
  for (std::size_t r = 0; r < leader_of.size(); ++r) {
    node_of[r] = static_cast<int>(std::lower_bound(leaders.begin(), leaders.end(), leader_of[r]) -
                                  leaders.begin());
  }
  return node_of;
}

std::string size_text(std::size_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1u << 10)) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

std::string joined(const std::vector<int>& values, const char* separator) {
  std::string text;
  for (int v : values) {
    if (!text.empty()) text += separator;
    text += std::to_string(v);
  }
  return text;
}

std::string ranks_text(const std::vector<int>& ranks) {
  return joined(ranks, " ");
}

class TopologyCache : public Attachment {
 public:
  explicit TopologyCache(Communicator& comm) : topology(discover(comm)) {}
  Topology topology;
};

}  // namespace

std::vector<std::vector<int>> members(const std::vector<int>& index_of_rank) {
  std::vector<std::vector<int>> result;
  for (std::size_t r = 0; r < index_of_rank.size(); ++r) {
    const auto i = static_cast<std::size_t>(index_of_rank[r]);
    if (result.size() <= i) result.resize(i + 1);
    result[i].push_back(static_cast<int>(r));
  }
  return result;
}

int Topology::local_rank() const {
  const auto& mine = nodes[static_cast<std::size_t>(node())];
  return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

int Topology::group_local_rank() const {
  const auto& mine = my_group();
  return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

Hardware discover_hardware() {
  return read_hardware(machine());
}

Topology discover(Communicator& comm) {
  const Config& config = comm.config();
  check_same_on_all_ranks(comm, config.ranks_per_node, "GRADCOMM_RANKS_PER_NODE");
  check_same_on_all_ranks(comm, config.topology_preset.empty() ? 0 : 1, "GRADCOMM_TOPOLOGY");
  // Both ends of a transfer between hosts cut it alike (collectives/p2p.h).
  check_same_on_all_ranks(comm, static_cast<long long>(config.tcp_piece_bytes),
                          "GRADCOMM_TCP_PIECE_BYTES");
  Topology t;
  t.rank = comm.rank();
  t.size = comm.size();
  const auto n = static_cast<std::size_t>(t.size);
  t.node_of_rank.resize(n);
  t.group_of_rank.resize(n);
  if (config.topology_preset == "dgx1") {
    for (std::size_t r = 0; r < n; ++r) {
      t.node_of_rank[r] = static_cast<int>(r) / kDgx1ServerRanks;
      t.group_of_rank[r] = static_cast<int>(r) / kDgx1QuadRanks;
    }
    t.source = "dgx1";
  } else {
    if (config.ranks_per_node > 0) {
      for (std::size_t r = 0; r < n; ++r) {
        t.node_of_rank[r] = static_cast<int>(r) / config.ranks_per_node;
      }
      t.source = "GRADCOMM_RANKS_PER_NODE=" + std::to_string(config.ranks_per_node);
    } else {
      t.node_of_rank = discover_nodes(comm);
      t.source = "discovered";
    }
    t.group_of_rank = t.node_of_rank;
  }
  // The real hosts: the node split itself, or where nodes are emulated, discovered apart.
  const bool emulated = config.ranks_per_node > 0 || !config.topology_preset.empty();
  t.host_of_rank = emulated ? discover_nodes(comm) : t.node_of_rank;
  t.nodes = members(t.node_of_rank);
  t.groups = members(t.group_of_rank);
  t.levels = {t.group_of_rank};
  if (config.topology_preset == "dgx1" && t.nodes.size() > 1) t.levels.push_back(t.node_of_rank);

  const Hwloc& hw = machine();
  t.hardware = read_hardware(hw);
  if (config.bind != "none") {
    // Bind within the real host (shared-memory domain), whatever layout is emulated.
    const std::vector<int>& host = t.host_of_rank;
    const auto on_host = members(host)[static_cast<std::size_t>(host[n > 0 ? t.rank : 0])];
    const int local =
        static_cast<int>(std::find(on_host.begin(), on_host.end(), t.rank) - on_host.begin());
    const std::string bound = bind(hw, config.bind, local, static_cast<int>(on_host.size()));
    comm.log(LogLevel::debug, "bound to " + bound);
  }
  if (comm.rank() == 0 && comm.log_enabled(LogLevel::debug)) {
    comm.log(LogLevel::debug, describe(t));
  }
  return t;
}

const Topology& topology_of(Communicator& comm) {
  comm.settle();  // requests in flight use the attachments (and may be building this one)
  return comm.attachment<TopologyCache>().topology;
}

std::string describe(const Topology& t) {
  std::ostringstream out;
  out << "gradcomm topology: " << t.size << " ranks, " << t.nodes.size() << " node"
      << (t.nodes.size() == 1 ? "" : "s") << " (" << t.source << "), " << t.groups.size()
      << " hierarchical group" << (t.groups.size() == 1 ? "" : "s") << "\n";
  for (std::size_t i = 0; i < t.nodes.size(); ++i) {
    out << "  node " << i << ": ranks " << ranks_text(t.nodes[i]) << "\n";
  }
  out << "  groups:";
  for (const auto& g : t.groups)
    out << " [" << ranks_text(g) << "]";
  if (t.levels.size() > 1) {
    out << "\n  hierarchical levels: " << t.levels.size() << " (groups, then nodes)";
  }
  const Hardware& h = t.hardware;
  out << "\n  hardware (rank " << t.rank << "'s host): " << h.packages << " package(s), "
      << h.numa_nodes << " NUMA node(s), " << h.cores << " cores, " << h.hardware_threads
      << " hardware threads; caches:";
  for (const auto& c : h.caches)
    out << " L" << c.level << " " << size_text(c.bytes) << " x" << c.count;
  out << "; NVIDIA GPUs: ";
  if (h.gpus.empty()) out << "none";
  for (const auto& g : h.gpus)
    out << g.pci_bus_id << " (NUMA " << g.numa_node << ") ";
  out << "\n";
  return out.str();
}

std::string to_json(const Topology& t, const std::vector<std::string>& hosts) {
  auto list = [](const std::vector<int>& v) {
    std::string text = "[";
    text += joined(v, ", ");
    text += "]";
    return text;
  };
  std::ostringstream out;
  out << "{\"ranks\": " << t.size << ", \"source\": \"" << t.source << "\", \"nodes\": [";
  for (std::size_t i = 0; i < t.nodes.size(); ++i)
    out << (i ? ", " : "") << list(t.nodes[i]);
  out << "], \"groups\": [";
  for (std::size_t i = 0; i < t.groups.size(); ++i)
    out << (i ? ", " : "") << list(t.groups[i]);
  out << "], \"hosts\": [";
  for (std::size_t i = 0; i < hosts.size(); ++i)
    out << (i ? ", " : "") << "\"" << hosts[i] << "\"";
  const Hardware& h = t.hardware;
  out << "], \"hardware\": {\"packages\": " << h.packages << ", \"numa_nodes\": " << h.numa_nodes
      << ", \"cores\": " << h.cores << ", \"hardware_threads\": " << h.hardware_threads
      << ", \"caches\": [";
  for (std::size_t i = 0; i < h.caches.size(); ++i) {
    out << (i ? ", " : "") << "{\"level\": " << h.caches[i].level
        << ", \"count\": " << h.caches[i].count << ", \"bytes\": " << h.caches[i].bytes << "}";
  }
  out << "], \"gpus\": [";
  for (std::size_t i = 0; i < h.gpus.size(); ++i) {
    out << (i ? ", " : "") << "{\"pci_bus_id\": \"" << h.gpus[i].pci_bus_id
        << "\", \"numa_node\": " << h.gpus[i].numa_node << "}";
  }
  out << "]}}\n";
  return out.str();
}

}  // namespace gradcomm::topology
