// shm's choice of plain or streamed stores (collectives/shm/store_choice.h), as pure logic.

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <tuple>
#include <utility>

#include "collectives/shm/store_choice.h"

namespace gradcomm::testing {
namespace {

// auto's choice of stores, fed with call times: it keeps the cheaper way, follows a change of
// the machine's state within a few calls each way, and keeps size classes apart; fixed ways
// never change.
TEST(ShmStoresChoice, KeepsTheCheaperWayAndFollowsAChange) {
  using collectives::ShmStores;
  const std::size_t bytes = std::size_t{8} << 20;
  ShmStores stores("auto");
  // Runs `calls` calls where a call costs `cached` or `streamed` seconds; returns how many
  // streamed, and the call at which the choice last changed (-1: never).
  auto run = [&](double cached, double streamed, int calls) {
    int streamed_calls = 0, changed = -1;
    for (int c = 0; c < calls; ++c) {
      const bool streams = stores.next_call_streams(bytes);
      streamed_calls += streams ? 1 : 0;
      if (stores.record(bytes, streams, streams ? streamed : cached)) changed = c;
    }
    return std::pair{streamed_calls, changed};
  };
  // Cores behind one cache: plain stores are cheaper.
  auto [streamed_calls, changed] = run(1.0, 1.4, 100);
  EXPECT_FALSE(stores.streaming(bytes));
  EXPECT_EQ(changed, -1);
  EXPECT_LE(streamed_calls, 3 + 100 / ShmStores::kFirstProbe);  // three to start, then probes
  EXPECT_EQ(stores.probe_after(bytes), ShmStores::kLastProbe);  // probes that lose grow rarer
  // Cores apart: plain stores cost 3.5x; two calls move the median.
  std::tie(streamed_calls, changed) = run(3.5, 1.4, 20);
  EXPECT_TRUE(stores.streaming(bytes));
  EXPECT_EQ(changed, 1);
  // Back: the next probe of plain stores, at most probe_after() calls away, is confirmed by the
  // call after it.
  const int probe_after = stores.probe_after(bytes);
  std::tie(streamed_calls, changed) = run(1.0, 1.4, 40);
  EXPECT_FALSE(stores.streaming(bytes));
  EXPECT_GE(changed, 1);
  EXPECT_LE(changed, probe_after);
  // Another size class starts from the nearest one measured both ways (its choice, its costs);
  // with none measured, it alternates.
  const std::size_t other = std::size_t{64} << 20;
  std::tie(streamed_calls, changed) = run(3.5, 1.4, 20);  // streamed here now
  ASSERT_TRUE(stores.streaming(bytes));
  EXPECT_TRUE(stores.next_call_streams(other));
  EXPECT_DOUBLE_EQ(stores.cost(other, true), stores.cost(bytes, true));
  ShmStores fresh("auto");
  EXPECT_FALSE(fresh.next_call_streams(other));
  fresh.record(other, false, 1.0);
  EXPECT_TRUE(fresh.next_call_streams(other));
  EXPECT_DOUBLE_EQ(fresh.cost(other, false), 1.0 / static_cast<double>(other));
  // Fixed ways never change and never probe.
  for (const char* way : {"cached", "streamed"}) {
    ShmStores fixed(way);
    for (int c = 0; c < 50; ++c) {
      const bool streams = fixed.next_call_streams(bytes);
      EXPECT_EQ(streams, std::string(way) == "streamed");
      EXPECT_FALSE(fixed.record(bytes, streams, streams ? 9.0 : 9.0 * (c % 3)));
    }
  }
}

}  // namespace
}  // namespace gradcomm::testing
