// Google Benchmark of the reduction kernels against memcpy of the same bytes: reduce_into reads
// two arrays and writes one (3 streams), memcpy reads one and writes one (2 streams), so at
// memory-bound sizes the kernel's bytes/s (counted as 3 streams) should approach memcpy's.

#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "core/reduce_kernels.h"

namespace {

using gradcomm::DataType;
using gradcomm::ReduceOp;

void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  for (auto _ : state) {
    std::memcpy(a.data(), b.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes * 2));
}

void BM_ReduceInto(benchmark::State& state, DataType dtype, ReduceOp op) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / gradcomm::element_size(dtype);
  std::vector<std::byte> a(bytes, std::byte{0}), b(bytes, std::byte{0});
  for (auto _ : state) {
    gradcomm::reduce_into(a.data(), b.data(), n, dtype, op);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes * 3));
}

constexpr int64_t kSmall = 32 << 10;  // L1/L2 resident
constexpr int64_t kLarge = 64 << 20;  // memory bound

BENCHMARK(BM_Memcpy)->Arg(kSmall)->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, float32_sum, DataType::float32, ReduceOp::sum)
    ->Arg(kSmall)
    ->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, float64_sum, DataType::float64, ReduceOp::sum)
    ->Arg(kSmall)
    ->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, float16_sum, DataType::float16, ReduceOp::sum)
    ->Arg(kSmall)
    ->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, bfloat16_sum, DataType::bfloat16, ReduceOp::sum)
    ->Arg(kSmall)
    ->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, int32_sum, DataType::int32, ReduceOp::sum)
    ->Arg(kSmall)
    ->Arg(kLarge);
BENCHMARK_CAPTURE(BM_ReduceInto, float32_max, DataType::float32, ReduceOp::max)
    ->Arg(kSmall)
    ->Arg(kLarge);

}  // namespace

BENCHMARK_MAIN();
