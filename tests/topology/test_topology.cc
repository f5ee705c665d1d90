// Topology: discovery agrees with hwloc-ls, emulated layouts give the expected nodes and groups,
// bad or inconsistent settings give errors naming the variable.

#include <gmock/gmock.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/mpi_test.h"
#include "topology/topology.h"

namespace gradcomm::testing {
namespace {

using ::testing::HasSubstr;

class Topology : public MpiTest {};

// Counts lines of `hwloc-ls --only TYPE` (the command-line tool, an independent reader).
int hwloc_ls_count(const char* type) {
  const std::string command = std::string("hwloc-ls --only ") + type + " 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  if (!pipe) return -1;
  int lines = 0;
  std::array<char, 512> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe.get()))
    ++lines;
  return lines;
}

TEST_F(Topology, HardwareAgreesWithHwlocLs) {
  const topology::Hardware h = topology::discover_hardware();
  EXPECT_EQ(h.cores, hwloc_ls_count("core"));
  EXPECT_EQ(h.numa_nodes, hwloc_ls_count("numanode"));
  EXPECT_EQ(h.packages, hwloc_ls_count("package"));
  EXPECT_EQ(h.hardware_threads, hwloc_ls_count("pu"));
  EXPECT_GT(h.cores, 0);
  EXPECT_TRUE(h.gpus.empty() || !h.gpus.front().pci_bus_id.empty());
}

// The discovered nodes are the ranks grouped by host name (MPI_Get_processor_name, an
// independent source), numbered by their lowest rank. One node when every rank runs on this
// machine; under scripts/mpirun-hosts (the multihost tests) GRADCOMM_TEST_EXPECTED_LAYOUT names
// the ranks per host the launcher was asked for ("2,2", "3,1"), and the nodes must match it.
TEST_F(Topology, DiscoveredLayoutMatchesHostNames) {
  const auto& t = topology::topology_of(world());
  EXPECT_EQ(t.source, "discovered");
  const int n = world().size();
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> names(static_cast<std::size_t>(n) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> hosts;
  std::vector<std::vector<int>> expected;
  for (int r = 0; r < n; ++r) {
    const std::string host(&names[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    const auto it = std::find(hosts.begin(), hosts.end(), host);
    if (it == hosts.end()) {
      hosts.push_back(host);
      expected.push_back({r});
    } else {
      expected[static_cast<std::size_t>(it - hosts.begin())].push_back(r);
    }
  }
  EXPECT_EQ(t.nodes, expected);
  EXPECT_EQ(t.groups, t.nodes);
  EXPECT_EQ(t.host_of_rank, t.node_of_rank);
  for (int r = 0; r < n; ++r) {
    const auto& node =
        t.nodes[static_cast<std::size_t>(t.node_of_rank[static_cast<std::size_t>(r)])];
    EXPECT_NE(std::find(node.begin(), node.end(), r), node.end()) << "rank " << r;
  }
  const auto& mine = t.nodes[static_cast<std::size_t>(t.node())];
  EXPECT_EQ(t.local_size(), static_cast<int>(mine.size()));
  EXPECT_EQ(mine[static_cast<std::size_t>(t.local_rank())], world().rank());
  std::string layout;
  for (const auto& node : t.nodes) {
    if (!layout.empty()) layout.push_back(',');
    layout.append(std::to_string(node.size()));
  }
  const char* wanted = std::getenv("GRADCOMM_TEST_EXPECTED_LAYOUT");
  EXPECT_EQ(layout, wanted ? std::string(wanted) : std::to_string(n))
      << "nodes seen on hosts " << ::testing::PrintToString(hosts);
}

TEST_F(Topology, EmulatedLayouts) {
  const int n = world().size();
  for (int k : {1, 2, 3, 4}) {
    Config config;
    config.ranks_per_node = k;
    Communicator comm(MPI_COMM_WORLD, config);
    const auto& t = topology::topology_of(comm);
    ASSERT_EQ(t.nodes.size(), static_cast<std::size_t>((n + k - 1) / k)) << k;
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(t.node_of_rank[r], r / k);
    EXPECT_EQ(t.nodes.back().size(), static_cast<std::size_t>(n - (n - 1) / k * k));  // remainder
    EXPECT_EQ(t.local_rank(), world().rank() % k);
    EXPECT_THAT(topology::describe(t), HasSubstr("GRADCOMM_RANKS_PER_NODE=" + std::to_string(k)));
    // The real hosts stay those of the machine: emulated nodes send no message over a network.
    EXPECT_EQ(t.host_of_rank, topology::topology_of(world()).node_of_rank) << k;
  }
  Config dgx;
  dgx.topology_preset = "dgx1";
  Communicator comm(MPI_COMM_WORLD, dgx);
  const auto& t = topology::topology_of(comm);
  EXPECT_EQ(t.nodes.size(), static_cast<std::size_t>((n + 7) / 8));
  EXPECT_EQ(t.groups.size(), static_cast<std::size_t>((n + 3) / 4));
  EXPECT_EQ(t.group_of_rank[static_cast<std::size_t>(world().rank())], world().rank() / 4);
  EXPECT_THAT(topology::to_json(t, {}), HasSubstr("\"source\": \"dgx1\""));
}

TEST_F(Topology, InconsistentSettingsNameTheVariable) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool odd = world().rank() == 1;
  Config per_node;
  per_node.ranks_per_node = odd ? 3 : 2;
  Config pieces;
  pieces.tcp_piece_bytes = odd ? 32000 : 64000;
  const std::pair<Config, const char*> cases[] = {{per_node, "GRADCOMM_RANKS_PER_NODE"},
                                                  {pieces, "GRADCOMM_TCP_PIECE_BYTES"}};
  for (const auto& [config, variable] : cases) {
    Communicator comm(MPI_COMM_WORLD, config);
    EXPECT_THAT([&] { topology::topology_of(comm); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    HasSubstr(std::string(variable) + " differs across ranks")));
  }
}

TEST_F(Topology, BadSettingsAreErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"GRADCOMM_RANKS_PER_NODE", "0"},   {"GRADCOMM_RANKS_PER_NODE", "-2"},
      {"GRADCOMM_RANKS_PER_NODE", "2.5"}, {"GRADCOMM_RANKS_PER_NODE", "four"},
      {"GRADCOMM_TOPOLOGY", "dgx2"},      {"GRADCOMM_BIND", "socket"}};
  for (const auto& [name, value] : cases) {
    setenv(name, value, 1);
    EXPECT_THAT([] { Config::from_environment(); },
                ::testing::ThrowsMessage<InvalidArgument>(
                    HasSubstr(std::string(name) + "='" + value + "' is invalid")));
    unsetenv(name);
  }
  Config config;
  config.ranks_per_node = -1;
  EXPECT_THROW(Communicator(MPI_COMM_WORLD, config), InvalidArgument);
}

}  // namespace
}  // namespace gradcomm::testing
