// Topology: discovery agrees with hwloc-ls, emulated layouts give the expected nodes and groups,
// bad or inconsistent settings give errors naming the variable.

#include <gmock/gmock.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

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

TEST_F(Topology, DiscoveredLayoutIsOneNodeHere) {
  const auto& t = topology::topology_of(world());
  EXPECT_EQ(t.source, "discovered");
  ASSERT_EQ(t.nodes.size(), 1u);  // every rank of this test runs on one machine
  EXPECT_EQ(t.local_size(), world().size());
  EXPECT_EQ(t.local_rank(), world().rank());
  EXPECT_EQ(t.groups, t.nodes);
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
  Config config;
  config.ranks_per_node = world().rank() == 1 ? 3 : 2;
  Communicator comm(MPI_COMM_WORLD, config);
  EXPECT_THAT([&] { topology::topology_of(comm); },
              ::testing::ThrowsMessage<InvalidArgument>(
                  HasSubstr("GRADCOMM_RANKS_PER_NODE differs across ranks")));
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
