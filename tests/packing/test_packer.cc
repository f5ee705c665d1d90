// GradientPacker, the fusion planner and the workload parser, without MPI.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>

#include "core/error.h"
#include "packing/fusion_planner.h"
#include "packing/gradient_packer.h"
#include "tests/workloads.h"

namespace gradcomm::testing {
namespace {

using packing::FusionOptions;
using packing::GradientPacker;
using packing::TensorDesc;
using ::testing::HasSubstr;

void fill_random(std::vector<std::byte>& bytes, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::byte>(rng());
}

// Packs, checks the packed buffers are the concatenation per dtype, wipes the tensors, unpacks,
// and checks every byte of the arena (tensors and the gaps between them) is back.
void round_trip(std::span<const TensorDesc> tensors, std::vector<std::byte>& arena,
                packing::PackerOptions options = {}) {
  fill_random(arena, 42);
  const std::vector<std::byte> original = arena;
  GradientPacker packer(tensors, options);
  ASSERT_FALSE(packer.declined()) << packer.decline_reason();
  packer.pack();
  for (const auto& p : packer.packed()) {
    const std::size_t es = element_size(p.dtype);
    ASSERT_EQ(p.chunks.size(), static_cast<std::size_t>(options.num_split));
    std::size_t expected_offset = 0;
    for (const auto& chunk : p.chunks) {
      EXPECT_EQ(chunk.offset, expected_offset);
      expected_offset += chunk.count;
    }
    EXPECT_EQ(expected_offset, p.count);
    EXPECT_LE(p.chunks.front().count, p.chunks.back().count);  // the last takes the remainder
    for (std::size_t k = 0; k < p.tensors.size(); ++k) {
      const TensorDesc& t = tensors[p.tensors[k]];
      ASSERT_EQ(std::memcmp(p.data + p.offsets[k] * es, t.data, t.bytes()), 0) << p.tensors[k];
    }
  }
  for (const TensorDesc& t : tensors) {
    if (t.count) std::memset(t.data, 0, t.bytes());
  }
  packer.unpack();
  EXPECT_TRUE(arena == original) << "round trip is not bit-exact";
}

class PackerWorkload : public ::testing::TestWithParam<std::string> {};

TEST_P(PackerWorkload, RoundTripIsBitExact) {
  const packing::Workload w = load_named_workload(GetParam());
  std::vector<std::byte> arena;
  const auto tensors = lay_out(w, DataType::float32, arena);
  round_trip(tensors, arena);
}

INSTANTIATE_TEST_SUITE_P(Workloads, PackerWorkload, ::testing::ValuesIn(kWorkloads),
                         [](const auto& info) { return info.param; });

TEST(Packer, MixedDtypesZeroSizeAndUnevenSplits) {
  std::vector<std::byte> arena(1 << 20);
  std::byte* p = arena.data();
  // float32 10007 (prime), int64 9001, float16 0 (empty), bfloat16 20011, float32 3.
  std::vector<TensorDesc> tensors = {{p, 10007, DataType::float32},
                                     {p + 40100, 9001, DataType::int64},
                                     {p + 112200, 0, DataType::float16},
                                     {p + 112300, 20011, DataType::bfloat16},
                                     {p + 152400, 3, DataType::float32}};
  round_trip(tensors, arena, {.num_split = 7, .min_chunk_elements = 16});
  GradientPacker packer(tensors, {.num_split = 7, .min_chunk_elements = 16});
  // One buffer per dtype, in order of first appearance; the empty float16 tensor makes none.
  ASSERT_EQ(packer.packed().size(), 3u);
  EXPECT_EQ(packer.packed()[0].dtype, DataType::float32);
  EXPECT_EQ(packer.packed()[0].count, 10010u);
  EXPECT_EQ(packer.packed()[2].dtype, DataType::bfloat16);
  EXPECT_EQ(packer.packed()[0].chunks.back().count, 10010u - 6 * (10010u / 7));
}

TEST(Packer, SingleTensor) {
  std::vector<std::byte> arena(4 * 100003);
  std::vector<TensorDesc> tensors = {{arena.data(), 100003, DataType::float32}};
  round_trip(tensors, arena);
}

TEST(Packer, DeclinesWithAReason) {
  GradientPacker empty(std::span<const TensorDesc>{});
  EXPECT_TRUE(empty.declined());
  EXPECT_THAT(empty.decline_reason(), HasSubstr("no tensors"));
  std::vector<float> small(8 * 1024 - 1);
  std::vector<TensorDesc> tensors = {{small.data(), small.size(), DataType::float32}};
  GradientPacker packer(tensors);
  EXPECT_TRUE(packer.declined());
  EXPECT_THAT(packer.decline_reason(),
              HasSubstr("8 chunks would have 1023 elements each, fewer than the minimum 1024"));
  EXPECT_THROW(packer.pack(), InvalidArgument);
}

TEST(Packer, RejectsBadTensors) {
  std::vector<float> buf(100);
  const std::vector<TensorDesc> null_data = {{nullptr, 5, DataType::float32}};
  EXPECT_THAT([&] { GradientPacker p(null_data); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("tensor 0: data is null")));
  const std::vector<TensorDesc> overlap = {{buf.data(), 50, DataType::float32},
                                           {buf.data() + 10, 5, DataType::float32}};
  EXPECT_THAT(
      [&] { GradientPacker p(overlap); },
      ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("tensor 0: memory overlaps tensor 1")));
  EXPECT_THAT([&] { GradientPacker p(overlap, {.num_split = 0}); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("overlaps")));
}

// ---------------------------------------------------------------------------------------------

std::vector<TensorDesc> sized(const std::vector<std::size_t>& counts, DataType dtype) {
  static std::vector<std::byte> arena(1 << 24);
  std::vector<TensorDesc> tensors;
  std::size_t offset = 0;
  for (std::size_t c : counts) {
    tensors.push_back({arena.data() + offset, c, dtype});
    offset += c * element_size(dtype);
  }
  return tensors;
}

void expect_every_tensor_once(const packing::FusionPlan& plan, std::span<const TensorDesc> ts) {
  std::multiset<std::size_t> seen;
  for (const auto& b : plan.buckets) {
    std::size_t count = 0;
    for (std::size_t i : b.tensors) {
      seen.insert(i);
      count += ts[i].count;
      EXPECT_EQ(ts[i].dtype, b.dtype);
    }
    EXPECT_EQ(count, b.count);
  }
  for (std::size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(seen.count(i), ts[i].count ? 1u : 0u) << i;
  }
}

TEST(FusionPlanner, ThresholdsBoundBucketsAndBigTensorsStandAlone) {
  const auto tensors = sized({100, 300, 0, 5000, 20, 20, 1000}, DataType::float32);
  for (std::size_t threshold : {0u, 400u, 1200u, 4096u, 1u << 20}) {
    SCOPED_TRACE(threshold);
    const auto plan = packing::plan_fusion(tensors, {.threshold_bytes = threshold});
    expect_every_tensor_once(plan, tensors);
    for (const auto& b : plan.buckets) {
      if (!b.in_place()) {
        EXPECT_LE(b.bytes(), threshold);
      }
      if (b.bytes() > threshold) {
        EXPECT_TRUE(b.in_place());
      }
    }
  }
  // Threshold 0: one bucket per non-empty tensor, in reverse registration order.
  const auto none = packing::plan_fusion(tensors, {.threshold_bytes = 0});
  ASSERT_EQ(none.buckets.size(), 6u);
  EXPECT_EQ(none.buckets.front().tensors.front(), 6u);
  // Everything fits: one bucket.
  const auto all = packing::plan_fusion(tensors, {.threshold_bytes = 1 << 20});
  ASSERT_EQ(all.buckets.size(), 1u);
  EXPECT_EQ(all.max_fused_bytes, 4u * 6440);
  // 1200 bytes (300 floats): reverse order 1000,20,20,5000,_,300,100 -> [1000] [20,20] [5000]
  // [300] ... 100 joins 300? 300+100 = 400 floats = 1600 bytes > 1200: no.
  const auto mid = packing::plan_fusion(tensors, {.threshold_bytes = 1200});
  std::vector<std::vector<std::size_t>> groups;
  for (const auto& b : mid.buckets)
    groups.push_back(b.tensors);
  EXPECT_EQ(groups, (std::vector<std::vector<std::size_t>>{{6}, {5, 4}, {3}, {1}, {0}}));
}

TEST(FusionPlanner, DtypesNeverMixAndOrderIsHonoured) {
  std::vector<TensorDesc> tensors = sized({10, 10, 10}, DataType::float32);
  const auto ints = sized({10, 10}, DataType::int64);
  tensors.insert(tensors.begin() + 1, ints.begin(), ints.end());  // f32 i64 i64 f32 f32
  const std::vector<std::size_t> order = {0, 1, 2, 3, 4};
  const auto plan = packing::plan_fusion(tensors, {.threshold_bytes = 1 << 20, .order = order});
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].tensors, (std::vector<std::size_t>{0, 3, 4}));
  EXPECT_EQ(plan.buckets[1].tensors, (std::vector<std::size_t>{1, 2}));
  const std::vector<std::size_t> bad = {0, 1, 1, 3, 4};
  EXPECT_THROW(packing::plan_fusion(tensors, {.threshold_bytes = 64, .order = bad}),
               InvalidArgument);
}

TEST(FusionPlanner, HashIsDeterministicAndSensitive) {
  const auto a = sized({100, 200, 300}, DataType::float32);
  const auto b = sized({100, 201, 300}, DataType::float32);
  const auto h = [](std::span<const TensorDesc> t, std::size_t threshold) {
    return packing::plan_fusion(t, {.threshold_bytes = threshold}).hash;
  };
  EXPECT_EQ(h(a, 1024), h(a, 1024));
  EXPECT_NE(h(a, 1024), h(b, 1024));
  EXPECT_NE(h(a, 1024), h(a, 2048));
}

// ---------------------------------------------------------------------------------------------

TEST(Workloads, LoadWithTheirDocumentedSizes) {
  struct Expect {
    const char* name;
    std::size_t tensors, elements;
  };
  for (const Expect& e : {Expect{"resnet50", 161, 25557032}, Expect{"mobilenet_v2", 158, 3504872},
                          Expect{"bert_base", 199, 109482240}, Expect{"vgg16", 32, 138357544}}) {
    const packing::Workload w = load_named_workload(e.name);
    EXPECT_EQ(w.tensors.size(), e.tensors) << e.name;
    EXPECT_EQ(w.total_elements(), e.elements) << e.name;
    EXPECT_EQ(w.dtype, DataType::float32);
    EXPECT_FALSE(w.source.empty());
  }
}

TEST(Workloads, MalformedInputIsAClearError) {
  const std::pair<const char*, const char*> cases[] = {
      {"{", "invalid JSON"},
      {"[]", "top level must be an object"},
      {R"({"tensors": []})", "missing field 'model'"},
      {R"({"model": "m"})", "missing array field 'tensors'"},
      {R"({"model": "m", "tensors": [{"shape": [2, -1]}]})", "tensors[0].shape"},
      {R"({"model": "m", "dtype": "float8", "tensors": []})", "unknown dtype 'float8'"},
      {R"({"model": "m", "num_tensors": 2, "tensors": [{"shape": [3]}]})",
       "'num_tensors' disagrees"},
      {R"({"model": "m", "tensors": [{"shape": [4294967296, 4294967296, 4294967296]}]})",
       "overflows"},
      // Found by fuzz_workload: a number too large for a double is a JSON error, not a crash.
      {R"({"model": "m", "tensors": [{"shape": [1e400]}]})", "number overflow"},
  };
  for (const auto& [text, message] : cases) {
    EXPECT_THAT([&] { packing::parse_workload(text, "case.json"); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr(message)))
        << text;
  }
  EXPECT_THAT([] { packing::load_workload("/nonexistent/w.json"); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("cannot open")));
}

}  // namespace
}  // namespace gradcomm::testing
