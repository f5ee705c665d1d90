// Correctness of every registered algorithm (and auto) against independent references:
// - exact: inputs are small integers, exact in every dtype; the expected value of each element
//   is a serial reduction over ranks computed in double / int64 and converted once, so the
//   comparison is bit-exact (see expected_bytes for why avg is exact too);
// - random floats: compared with MPI_Allreduce of float64 copies, within a bound derived below;
// - every rank checks its own output, that all ranks' outputs are bit-identical, that guard
//   elements after the output are untouched, and (out-of-place) that the input is unchanged.

#include <gmock/gmock.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/registry.h"
#include "collectives/select/auto_select.h"
#include "collectives/select/tuning_table.h"
#include "core/error.h"
#include "core/half.h"
#include "tests/mpi_test.h"
#include "topology/host.h"
#include "topology/topology.h"

namespace gradcomm::testing {
namespace {

constexpr std::size_t kGuardBytes = 64;
constexpr std::byte kGuard{0x5a};

std::vector<std::string> all_algorithms() {
  return collectives::host_algorithm_names();  // nccl: tests/collectives/test_gpu_host.cc,
                                               // tests/gpu/
}

// Small-integer inputs; element i of rank r depends on i only through i % period(op).
std::size_t period(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return 7;
    case ReduceOp::prod:
      return 5;
    case ReduceOp::min:
    case ReduceOp::max:
      return 11;
  }
  return 1;
}

std::int64_t input_value(ReduceOp op, int rank, std::size_t i) {
  static constexpr std::int64_t kProd[5] = {1, 2, -1, 1, -2};  // |product| <= 2^8: exact in bf16
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return static_cast<std::int64_t>((rank + i) % 7) - 3;
    case ReduceOp::prod:
      return kProd[(rank + i) % 5];
    case ReduceOp::min:
    case ReduceOp::max:
      return static_cast<std::int64_t>((rank * 7 + i * 3) % 11) - 5;
  }
  return 0;
}

void fill_input(void* buf, std::size_t count, DataType dtype, ReduceOp op, int rank) {
  const std::size_t m = std::min(period(op), count);
  for (std::size_t i = 0; i < m; ++i)
    store(dtype, buf, i, input_value(op, rank, i));
  repeat_pattern(buf, count, m, element_size(dtype));
}

// Expected bytes of element i for each residue i % period, by a serial reduction over ranks in
// int64 (exact). avg: integers truncate; floats take the exact quotient rounded once to the
// dtype. That equals what gradcomm computes (exact sum, one correctly rounded division in the
// dtype or in float32 then rounded to 16 bits) because rounding a quotient first to 53 or 24
// bits and then to 24 / 11 / 8 bits is innocuous (p' >= 2p + 2).
std::vector<std::byte> expected_bytes(DataType dtype, ReduceOp op, int n) {
  const std::size_t m = period(op);
  const std::size_t es = element_size(dtype);
  std::vector<std::byte> table(m * es);
  for (std::size_t res = 0; res < m; ++res) {
    std::int64_t acc = input_value(op, 0, res);
    for (int r = 1; r < n; ++r) {
      const std::int64_t v = input_value(op, r, res);
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg:
          acc += v;
          break;
        case ReduceOp::prod:
          acc *= v;
          break;
        case ReduceOp::min:
          acc = std::min(acc, v);
          break;
        case ReduceOp::max:
          acc = std::max(acc, v);
          break;
      }
    }
    double value = static_cast<double>(acc);
    if (op == ReduceOp::avg) {
      value = is_floating(dtype) ? static_cast<double>(acc) / n : static_cast<double>(acc / n);
    }
    store(dtype, table.data(), res, value);
  }
  return table;
}

// Runs one call on `send` and `recv` (room for count elements and kGuardBytes each; recv unused
// in place) and checks everything; returns without throwing so loops keep going.
void check_exact_on(Communicator& comm, const std::string& algorithm, DataType dtype, ReduceOp op,
                    std::size_t count, bool in_place, std::byte* send, std::byte* recv) {
  SCOPED_TRACE("algorithm=" + algorithm + " dtype=" + std::string(to_string(dtype)) +
               " op=" + std::string(to_string(op)) + " count=" + std::to_string(count) +
               (in_place ? " in-place" : " out-of-place") +
               " ranks=" + std::to_string(comm.size()));
  const std::size_t es = element_size(dtype);
  const std::size_t bytes = count * es;
  std::byte* out = in_place ? send : recv;
  fill_input(send, count, dtype, op, comm.rank());
  if (!in_place) std::fill(recv, recv + bytes, std::byte{0xcd});
  std::fill(out + bytes, out + bytes + kGuardBytes, kGuard);
  const std::uint64_t send_before = fingerprint(send, bytes);

  allreduce(comm, send, out, count, dtype, op, {.algorithm = algorithm});

  const std::vector<std::byte> table = expected_bytes(dtype, op, comm.size());
  const std::size_t m = period(op);
  std::size_t wrong = 0;
  std::size_t first_wrong = 0;
  for_each_block_unlike(out, count, table.data(), m, es, [&](std::size_t i0, std::size_t i1) {
    for (std::size_t i = i0; i < i1; ++i) {
      if (std::memcmp(out + i * es, table.data() + (i % m) * es, es) != 0) {
        if (wrong++ == 0) first_wrong = i;
      }
    }
  });
  EXPECT_EQ(wrong, 0u) << "first wrong element " << first_wrong << ": got "
                       << (wrong ? load(dtype, out, first_wrong) : 0.0) << ", expected "
                       << (wrong ? load(dtype, table.data(), first_wrong % m) : 0.0);
  EXPECT_TRUE(std::all_of(out + bytes, out + bytes + kGuardBytes, [](std::byte b) {
    return b == kGuard;
  })) << "guard bytes after the output were overwritten";
  if (!in_place) {
    EXPECT_EQ(fingerprint(send, bytes), send_before) << "the send buffer was modified";
  }
  EXPECT_TRUE(same_on_all_ranks(comm.mpi_comm(), fingerprint(out, bytes)))
      << "ranks ended with different bits";
}

void check_exact(Communicator& comm, const std::string& algorithm, DataType dtype, ReduceOp op,
                 std::size_t count, bool in_place, std::vector<std::byte>& send,
                 std::vector<std::byte>& recv) {
  const std::size_t bytes = count * element_size(dtype) + kGuardBytes;
  send.resize(std::max(send.size(), bytes));
  recv.resize(std::max(recv.size(), bytes));
  check_exact_on(comm, algorithm, dtype, op, count, in_place, send.data(), recv.data());
}

// Every count small_counts gives is at most this, but its last (1000003).
constexpr std::size_t kLargestSmallCount = 1000;

std::vector<std::size_t> small_counts(int n) {
  std::vector<std::size_t> counts = {0,
                                     1,
                                     2,
                                     7,
                                     static_cast<std::size_t>(n - 1),
                                     static_cast<std::size_t>(n),
                                     static_cast<std::size_t>(n + 1),
                                     1000003};
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

std::string param_name(const std::string& algorithm) {
  return algorithm;
}

// Large buffers run at the rank counts whose schedules differ: 2 (a power of two, a core each), 3
// (folded: not a power of two) and 8 (a power of two with several steps, 4 ranks per core); 4
// and 5 repeat 2's and 3's shapes at more cost. Across emulated hosts (the multihost tests) they
// run wherever the algorithm sends over the network, the links being the point there.
bool large_runs_here(const std::string& algorithm, std::string* why) {
  const int n = world().size();
  if (!topology::shares_one_host(world())) {
    if (algorithm == "ring" || algorithm == "hierarchical" || algorithm == "auto") return true;
    *why = "across hosts, ring, hierarchical and auto cover the large messages";
    return false;
  }
  if (n == 2 || n == 3 || n == 8) return true;
  *why = "large buffers run at 2, 3 and 8 ranks; " + std::to_string(n) +
         " ranks repeat their schedules";
  return false;
}

// Where large buffers run, which ops: every op at 2 ranks on one host (each op's kernels over
// many pieces); elsewhere sum, and avg, whose division some algorithms do at a chunk's owner and
// some at the end. min, max and prod reduce through the same schedule as sum with other kernels,
// which do not depend on the count: the small counts run them at every rank count (in the
// kernels' forms for 3 and more sources too), and 2 ranks over many pieces. At 3 and 8 ranks
// and across hosts the large count's min, max and prod cost 3/5 of its checks
// (about 20 s of test_allreduce at 8 ranks on 2 cores) and test nothing sum does not.
bool large_runs_for(ReduceOp op) {
  if (world().size() == 2 && topology::shares_one_host(world())) return true;
  return op == ReduceOp::sum || op == ReduceOp::avg;
}

// shm runs only when every rank shares one host (not across the emulated hosts of the multihost
// tests); elsewhere every rank must refuse the call, before any communication, saying why.
bool runs_here(Communicator& comm, const std::string& algorithm) {
  if (algorithm != "shm" || topology::shares_one_host(comm)) return true;
  std::vector<float> data(3, 1.0f);
  EXPECT_THAT(
      [&] {
        allreduce(comm, data.data(), data.data(), 3, DataType::float32, ReduceOp::sum,
                  {.algorithm = "shm"});
      },
      ::testing::ThrowsMessage<Unsupported>(::testing::HasSubstr("share this host")));
  return false;
}

// ---------------------------------------------------------------------------------------------
// Every algorithm x dtype x op x count x placement, exact.

class AllreduceExact : public MpiTestWithParam<std::tuple<std::string, DataType>> {};

TEST_P(AllreduceExact, EveryOpCountAndPlacement) {
  const auto& [algorithm, dtype] = GetParam();
  if (!runs_here(world(), algorithm)) GTEST_SKIP() << algorithm << " needs one host";
  // The million-element count (many rounds and pieces) where large buffers run: at 4 and 5 ranks
  // it repeated 2's and 3's schedules and took about half of the suite's time there.
  std::string why;
  const bool large = large_runs_here(algorithm, &why);
  std::vector<std::byte> send, recv;
  for (ReduceOp op : kAllReduceOps) {
    for (std::size_t count : small_counts(world().size())) {
      if (count > kLargestSmallCount && !(large && large_runs_for(op))) continue;
      for (bool in_place : {false, true}) {
        check_exact(world(), algorithm, dtype, op, count, in_place, send, recv);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AllreduceExact,
                         ::testing::Combine(::testing::ValuesIn(all_algorithms()),
                                            ::testing::ValuesIn(kAllDataTypes)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::string(to_string(std::get<1>(info.param)));
                         });

// Runs `check(send, recv, in_place_too)` with this rank's buffers, room for 1000003 elements of
// `es` bytes and the guard, at an odd element offset (not a cache line: slices start mid-line),
// in three placements: every rank registered (comm.allocate); odd ranks on private buffers (the
// ranks mix paths in one call); registered input with a private output and the reverse,
// alternating by rank (where in place is meaningless: in_place_too false).
template <class Check>
void for_each_placement(Communicator& comm, std::size_t es, Check check) {
  const int me = comm.rank();
  const std::size_t offset = 3 * es;
  const std::size_t room = 1000003 * es + kGuardBytes + offset;
  RegisteredBuffer a = comm.allocate(room), b = comm.allocate(room);
  std::vector<std::byte> pa(room), pb(room);
  enum Placement { all_registered, odd_ranks_private, in_xor_out };
  for (Placement placement : {all_registered, odd_ranks_private, in_xor_out}) {
    SCOPED_TRACE("placement " + std::to_string(placement));
    std::byte* send = a.data() + offset;
    std::byte* recv = b.data() + offset;
    if (placement == odd_ranks_private && me % 2 == 1) {
      send = pa.data() + offset;
      recv = pb.data() + offset;
    }
    if (placement == in_xor_out) (me % 2 == 0 ? recv : send) = pb.data() + offset;
    check(send, recv, placement != in_xor_out);
  }
}

// shm's matrix on registered buffers (Communicator::allocate): every dtype, op and count, in and
// out of place, at an odd element offset into the registered memory. Placements: every rank
// registered; odd ranks on private buffers (the ranks mix paths in one call); registered input
// with a private output, and the reverse, alternating by rank.
TEST_P(AllreduceExact, RegisteredBuffersAtOffsets) {
  const auto& [algorithm, dtype] = GetParam();
  if (algorithm != "shm") GTEST_SKIP() << "shm's registered paths";
  if (!topology::shares_one_host(world())) GTEST_SKIP() << "registered buffers live on one host";
  const int n = world().size();
  // 2 ranks (halves), 3 (slices not a power of two, an odd rank private), 5 (more ranks than
  // cores, two private ranks among five).
  if (n != 2 && n != 3 && n != 5) GTEST_SKIP() << "runs at 2, 3 and 5 ranks";
  for_each_placement(
      world(), element_size(dtype), [&](std::byte* send, std::byte* recv, bool in_place_too) {
        for (ReduceOp op : kAllReduceOps) {
          for (std::size_t count : small_counts(world().size())) {
            for (bool in_place : {false, true}) {
              if (in_place && !in_place_too) continue;
              check_exact_on(world(), algorithm, dtype, op, count, in_place, send, recv);
            }
          }
        }
      });
}

// ---------------------------------------------------------------------------------------------
// 16 Mi elements on a subset of dtypes and ops (the suite's time budget).

class AllreduceLarge : public MpiTestWithParam<std::string> {};

TEST_P(AllreduceLarge, SixteenMiElements) {
  std::string why;
  if (!large_runs_here(GetParam(), &why)) GTEST_SKIP() << why;
  if (!runs_here(world(), GetParam())) GTEST_SKIP() << GetParam() << " needs one host";
  // On one host the algorithms' own schedules are the point: MPI's own (mpi) runs at 2 ranks
  // only, and auto's pick (one of the others, each run here) at 2 ranks only; at 3 and 8 ranks
  // each adds 2.3-4 s and tests nothing the others do not.
  if (world().size() > 2 && topology::shares_one_host(world()) &&
      (GetParam() == "mpi" || GetParam() == "auto")) {
    GTEST_SKIP() << GetParam() << " runs its large buffers at 2 ranks on one host";
  }
  constexpr std::size_t kCount = std::size_t{16} << 20;
  std::vector<std::byte> send, recv;
  const std::tuple<DataType, ReduceOp> cases[] = {{DataType::float32, ReduceOp::sum},
                                                  {DataType::bfloat16, ReduceOp::avg},
                                                  {DataType::int64, ReduceOp::max}};
  const int n = world().size();
  const bool one_host = topology::shares_one_host(world());
  for (const auto& [dtype, op] : cases) {
    // On one host, at 8 ranks the schedule is the point: float32 sum, out of place (in place
    // differs only by the first copy, run at 2 and 3 ranks). The widest type (int64 max, 128 MiB
    // buffers) runs at 2 ranks; 3 ranks, whose count does not divide, run float32 and bfloat16.
    if (one_host && n == 8 && dtype != DataType::float32) continue;
    if (one_host && n == 3 && dtype == DataType::int64) continue;
    for (bool in_place : {false, true}) {
      if (one_host && n == 8 && in_place) continue;
      check_exact(world(), GetParam(), dtype, op, kCount, in_place, send, recv);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AllreduceLarge, ::testing::ValuesIn(all_algorithms()),
                         [](const auto& info) { return param_name(info.param); });

// ---------------------------------------------------------------------------------------------
// Different algorithms back to back on a large buffer, with no other MPI call between them. A
// rank that has finished a ring may still owe its peer the acknowledgement of a large message,
// which Open MPI sends only while that rank is inside MPI; the next call's waits outside MPI
// (shm's, the call check's shared board) must let it through. Before they did, a ring of 64 MiB
// in 128 segments per chunk followed by shm hung on 2 ranks every time.

class AllreduceBackToBack : public MpiTest {};

TEST_F(AllreduceBackToBack, EveryAlgorithmThenShmAndMpi) {
  const int n = world().size();
  std::string why;
  if (!large_runs_here("ring", &why)) GTEST_SKIP() << why;
  if (n == 8 && topology::shares_one_host(world())) {
    GTEST_SKIP() << "on one host at 2 and 3 ranks (the hang it guards against showed at 2)";
  }
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  constexpr std::size_t kCount = kBytes / sizeof(float);
  Config config;
  config.segment_bytes = std::max<std::size_t>(4096, kBytes / static_cast<std::size_t>(n) / 128);
  Communicator comm(MPI_COMM_WORLD, config);
  const bool shm = runs_here(comm, "shm");
  std::vector<std::string> calls;
  for (int round = 0; round < 2; ++round) {
    for (const std::string& algorithm : all_algorithms()) {
      if (algorithm == "shm" || algorithm == "mpi") continue;
      calls.push_back(algorithm);
      calls.push_back(shm ? "shm" : "mpi");
      calls.push_back(algorithm);
      calls.push_back("mpi");
    }
  }
  // Every element sums to n(n+1)/2, exact in float32. Outcomes are collected and reported after
  // the last call: no check may add an MPI call between two algorithms.
  std::vector<float> data(kCount);
  const float want = static_cast<float>(n * (n + 1) / 2);
  std::vector<std::string> wrong;
  for (const std::string& algorithm : calls) {
    std::fill(data.begin(), data.end(), static_cast<float>(comm.rank() + 1));
    allreduce(comm, data.data(), data.data(), kCount, DataType::float32, ReduceOp::sum,
              {.algorithm = algorithm});
    const auto bad = std::find_if(data.begin(), data.end(), [&](float v) { return v != want; });
    if (bad != data.end()) {
      wrong.push_back(algorithm + ": element " + std::to_string(bad - data.begin()) + " is " +
                      std::to_string(*bad));
    }
  }
  EXPECT_THAT(wrong, ::testing::IsEmpty()) << calls.size() << " calls";
}

// ---------------------------------------------------------------------------------------------
// Random floats against MPI_Allreduce on float64 copies.

class AllreduceRandom : public MpiTestWithParam<std::string> {};

TEST_P(AllreduceRandom, MatchesFloat64Reference) {
  Communicator& comm = world();
  if (!runs_here(comm, GetParam())) GTEST_SKIP() << GetParam() << " needs one host";
  const int n = comm.size();
  std::mt19937_64 rng(1234 + static_cast<unsigned>(comm.rank()));
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (DataType dtype :
       {DataType::float32, DataType::float64, DataType::float16, DataType::bfloat16}) {
    // Each of the n-1 reduction steps rounds once to the dtype (16-bit types accumulate in
    // float32 but are rounded back to 16 bits per step), adding at most u * |partial sum| <=
    // u * sum|x| per step, with u the unit roundoff; avg adds one more rounding. So |error| <=
    // n * u * sum_r |x_r| (+ a tiny absolute term for sums that cancel to ~0).
    const double u = dtype == DataType::float64   ? 0x1p-53
                     : dtype == DataType::float32 ? 0x1p-24
                     : dtype == DataType::float16 ? 0x1p-11
                                                  : 0x1p-8;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      for (std::size_t count : {std::size_t{1}, std::size_t{97}, std::size_t{65537}}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE("dtype=" + std::string(to_string(dtype)) +
                       " op=" + std::string(to_string(op)) + " count=" + std::to_string(count) +
                       (in_place ? " in-place" : ""));
          const std::size_t es = element_size(dtype);
          std::vector<std::byte> send(count * es), recv(count * es);
          std::vector<double> exact(count), magnitude(count), ref(count), abs_ref(count);
          for (std::size_t i = 0; i < count; ++i) {
            store(dtype, send.data(), i, uniform(rng));
            exact[i] = load(dtype, send.data(), i);  // the value as representable in dtype
            magnitude[i] = std::abs(exact[i]);
          }
          MPI_Allreduce(exact.data(), ref.data(), static_cast<int>(count), MPI_DOUBLE, MPI_SUM,
                        comm.mpi_comm());
          MPI_Allreduce(magnitude.data(), abs_ref.data(), static_cast<int>(count), MPI_DOUBLE,
                        MPI_SUM, comm.mpi_comm());
          std::byte* out = in_place ? send.data() : recv.data();
          allreduce(comm, send.data(), out, count, dtype, op, {.algorithm = GetParam()});
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < count; ++i) {
            const double scale = op == ReduceOp::avg ? 1.0 / n : 1.0;
            const double tolerance = (n + 1) * u * abs_ref[i] * scale + 1e-30;
            const double got = load(dtype, out, i);
            if (!(std::abs(got - ref[i] * scale) <= tolerance)) {
              if (wrong++ < 3) {
                ADD_FAILURE() << "element " << i << ": got " << got << ", reference "
                              << ref[i] * scale << ", tolerance " << tolerance;
              }
            }
          }
          EXPECT_EQ(wrong, 0u);
          EXPECT_TRUE(same_on_all_ranks(comm.mpi_comm(), fingerprint(out, count * es)));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AllreduceRandom, ::testing::ValuesIn(all_algorithms()),
                         [](const auto& info) { return param_name(info.param); });

// ---------------------------------------------------------------------------------------------
// The many-segment paths of the pipelined algorithms, through the Config test seam.

class AllreduceSegments : public MpiTestWithParam<std::string> {};

TEST_P(AllreduceSegments, TinySegmentsAndShallowPipelines) {
  if (!runs_here(world(), GetParam())) GTEST_SKIP() << GetParam() << " needs one host";
  for (int depth : {1, 2, 5}) {
    Config config;
    config.segment_bytes = 64;  // 16 float32 per segment: a 100-element call has many
    config.pipeline_depth = depth;
    Communicator comm(MPI_COMM_WORLD, config);
    std::vector<std::byte> send, recv;
    for (std::size_t count : {std::size_t{100}, std::size_t{1000}, std::size_t{4099}}) {
      for (DataType dtype : {DataType::float32, DataType::float16, DataType::int64}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          for (bool in_place : {false, true}) {
            check_exact(comm, GetParam(), dtype, op, count, in_place, send, recv);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AllreduceSegments, ::testing::ValuesIn(all_algorithms()),
                         [](const auto& info) { return param_name(info.param); });

// ---------------------------------------------------------------------------------------------
// Transfers between hosts in eager-sized pieces (collectives/p2p.h), on one machine through the
// Config test seam: every peer counts as remote, and a piece is 1 KiB (256 float32), so counts
// around a piece, a prime and a large count cut into hundreds of pieces, with the fold of
// halving_doubling on 3 and 5 ranks, hierarchical's owner exchanges on emulated nodes of 2, the
// reproducible mode, and the ring's segments cut to pieces (more receives posted ahead).

class AllreducePieces : public MpiTest {};

TEST_F(AllreducePieces, EverySizeAroundAPieceIsExact) {
  struct Form {
    std::string algorithm;
    int ranks_per_node;
    bool deterministic;
  };
  const Form forms[] = {{"halving_doubling", 0, false},
                        {"hierarchical", 2, false},
                        {"halving_doubling", 0, true},
                        {"ring", 0, false}};
  std::vector<std::byte> send, recv;
  for (const Form& form : forms) {
    Config config;
    config.tcp_piece_bytes = 1024;
    config.tcp_pieces_on_host = true;
    config.ranks_per_node = form.ranks_per_node;
    config.deterministic = form.deterministic;
    Communicator comm(MPI_COMM_WORLD, config);
    SCOPED_TRACE(std::string(form.deterministic ? "deterministic " : "") + form.algorithm);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256},
                              std::size_t{257}, std::size_t{1021}, std::size_t{100003}}) {
      for (DataType dtype : {DataType::float32, DataType::float64}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          for (bool in_place : {false, true}) {
            check_exact(comm, form.algorithm, dtype, op, count, in_place, send, recv);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sub-communicators (MPI_Comm_split): a prefix of k ranks for k = 3, 5, 7 and an even/odd split,
// so one 8-rank launch also covers 3, 4, 5 and 7 ranks.

class AllreduceSubcommunicators : public MpiTest {};

TEST_F(AllreduceSubcommunicators, PrefixesAndEvenOddSplit) {
  const int rank = world().rank();
  std::vector<std::pair<std::string, int>> splits = {{"even/odd", rank % 2}};
  for (int k : {3, 5, 7}) {
    if (k < world().size()) splits.push_back({"first " + std::to_string(k), rank < k ? 0 : 1});
  }
  for (const auto& [label, color] : splits) {
    SCOPED_TRACE("split " + label);
    MPI_Comm split = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, color, rank, &split);
    {
      Communicator comm(split);
      std::vector<std::byte> send, recv;
      for (const std::string& algorithm : all_algorithms()) {
        if (!runs_here(comm, algorithm)) continue;
        for (std::size_t count : {std::size_t{1}, std::size_t{8}, std::size_t{65537}}) {
          check_exact(comm, algorithm, DataType::float32, ReduceOp::sum, count, false, send, recv);
          check_exact(comm, algorithm, DataType::int32, ReduceOp::min, count, true, send, recv);
        }
      }
    }
    MPI_Comm_free(&split);
  }
}

// ---------------------------------------------------------------------------------------------
// Typed std::span overloads.

class AllreduceTyped : public MpiTest {};

TEST_F(AllreduceTyped, SpanOverloads) {
  const int n = world().size();
  std::vector<float> in(10, 1.5f), out(10, 0.0f);
  allreduce<float>(world(), std::span<const float>(in), std::span<float>(out), ReduceOp::sum);
  for (float v : out)
    EXPECT_EQ(v, 1.5f * n);
  std::vector<std::int64_t> values(5, world().rank());
  allreduce<std::int64_t>(world(), std::span<std::int64_t>(values), ReduceOp::max);
  for (std::int64_t v : values)
    EXPECT_EQ(v, n - 1);
}

}  // namespace
}  // namespace gradcomm::testing

namespace gradcomm::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// Hierarchical on emulated layouts: 8 = 2x4, 8 = 4x2, 6 = 2x3, 5 = 3+2, 4 = 1x4 and the DGX-1
// preset at 8, each on a sub-communicator of the needed size cut from the world; and on the
// discovered layout of the whole world (one node on one machine; real hosts under
// scripts/mpirun-hosts, the multihost tests).

struct Layout {
  const char* label;
  int ranks;           // 0: the whole world
  int ranks_per_node;  // 0 with the preset, or for the discovered layout
  const char* preset;
};
// "dgx1x2": two DGX-1 servers, the two-level schedule (quad -> server -> across servers); run
// by the np16 test entry.
constexpr Layout kLayouts[] = {{"8=2x4", 8, 4, ""},       {"8=4x2", 8, 2, ""},
                               {"6=2x3", 6, 3, ""},       {"5=3+2", 5, 3, ""},
                               {"4=1x4", 4, 4, ""},       {"dgx1", 8, 0, "dgx1"},
                               {"dgx1x2", 16, 0, "dgx1"}, {"discovered", 0, 0, ""}};
// Hierarchical's intra-group forms (Config::hierarchical_intra); on one machine every group
// shares the host, so "shm" runs through shared memory.
constexpr const char* kIntraForms[] = {"direct", "ring", "shm"};

// Runs `body` on a communicator of `layout.ranks` ranks with the layout's config, on the ranks
// that take part; returns false (nothing run) when the world is too small.
template <class Body>
bool with_layout(const Layout& layout, Body body, const char* intra = "auto") {
  const int ranks = layout.ranks > 0 ? layout.ranks : world().size();
  if (world().size() < ranks) return false;
  MPI_Comm split = MPI_COMM_NULL;
  const bool member = world().rank() < ranks;
  MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, world().rank(), &split);
  if (member) {
    Config config;
    config.ranks_per_node = layout.ranks_per_node;
    config.topology_preset = layout.preset;
    config.hierarchical_intra = intra;
    config.segment_bytes = std::size_t{1} << 30;  // one segment per step: messages == steps
    Communicator comm(split, config);
    body(comm);
    MPI_Comm_free(&split);
  }
  return true;
}

// Each fixed layout runs on a communicator of its own size, so it runs once, in the 8-rank launch
// (the 16-rank entry runs dgx1x2); the layout the launch discovers runs at every rank count.
class HierarchicalLayouts : public MpiTestWithParam<Layout> {
 protected:
  void SetUp() override {
    const Layout& layout = GetParam();
    if (layout.ranks > 0 && layout.ranks <= 8 && world().size() != 8) {
      GTEST_SKIP() << "fixed layouts run in the 8-rank launch";
    }
  }
};

TEST_P(HierarchicalLayouts, EveryDtypeOpCountAndPlacement) {
  const Layout& layout = GetParam();
  bool ran = false;
  for (const char* intra : kIntraForms) {
    SCOPED_TRACE(std::string("intra-group form ") + intra);
    ran = with_layout(
        layout,
        [&](Communicator& comm) {
          std::vector<std::byte> send, recv;
          for (DataType dtype : kAllDataTypes) {
            for (ReduceOp op : kAllReduceOps) {
              for (std::size_t count : small_counts(comm.size())) {
                if (count > 100000 && (dtype != DataType::float32 || op != ReduceOp::sum)) continue;
                for (bool in_place : {false, true}) {
                  check_exact(comm, "hierarchical", dtype, op, count, in_place, send, recv);
                }
              }
            }
          }
        },
        intra);
  }
  if (!ran) GTEST_SKIP() << "layout " << layout.label << " needs " << layout.ranks << " ranks";
}

// hierarchical's shm phases read registered inputs and write registered outputs where they lie
// (one round per phase when every member's are registered) and stage private ones: every
// placement is exact, in and out of place, with buffers at an odd element offset. Counts cover
// the one-round and the staged rounds (1000003 elements: columns of several rounds); uneven
// groups (5 = 3 + 2) give some ranks two columns.
TEST_P(HierarchicalLayouts, ShmPhasesOnRegisteredAndPrivateBuffers) {
  const Layout& layout = GetParam();
  if (layout.label != std::string("8=2x4") && layout.label != std::string("5=3+2")) {
    GTEST_SKIP() << "two layouts cover it";
  }
  const bool ran = with_layout(
      layout,
      [&](Communicator& comm) {
        for (DataType dtype : {DataType::float32, DataType::int64, DataType::bfloat16}) {
          for_each_placement(
              comm, element_size(dtype), [&](std::byte* send, std::byte* recv, bool in_place_too) {
                for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
                  for (std::size_t count :
                       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000003}}) {
                    for (bool in_place : {false, true}) {
                      if (in_place && !in_place_too) continue;
                      check_exact_on(comm, "hierarchical", dtype, op, count, in_place, send, recv);
                    }
                  }
                }
              });
        }
      },
      "shm");
  if (!ran) GTEST_SKIP() << "layout " << layout.label << " needs " << layout.ranks << " ranks";
}

// Bytes and messages sent inside and across groups equal the analytic values, for the flat ring
// and for hierarchical. Counts in elements of 4 bytes; the ring sends every chunk but the two
// after its own (one per phase): 2*S - chunk(r+1) - chunk(r+2).
std::size_t ring_sent(std::size_t count, std::size_t n, std::size_t index) {
  auto chunk = [&](std::size_t c) { return count / n + (c % n < count % n ? 1 : 0); };
  return 2 * count - chunk((index + 1) % n) - chunk((index + 2) % n);
}

// Segments the ring sends per step (each one message) for `count` floats over `ranks`: one, as
// the test's segments are 1 GiB, except where a link of the ring crosses real hosts: then as many
// pieces of Config::tcp_piece_bytes as the largest chunk needs (collectives/p2p.h).
std::size_t ring_segments(std::size_t count, std::size_t ranks, bool crosses_hosts,
                          std::size_t piece_bytes) {
  if (!crosses_hosts || piece_bytes == 0) return 1;
  const std::size_t chunk = (count + ranks - 1) / ranks;
  const std::size_t per_piece = piece_bytes / 4;
  return std::max<std::size_t>(1, (chunk + per_piece - 1) / per_piece);
}

// Whether a ring through `ranks` (in that order, cyclic) has a link between two real hosts.
bool ring_crosses_hosts(const std::vector<int>& ranks, const std::vector<int>& host_of_rank) {
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const int next = ranks[(i + 1) % ranks.size()];
    if (host_of_rank[static_cast<std::size_t>(ranks[i])] !=
        host_of_rank[static_cast<std::size_t>(next)]) {
      return true;
    }
  }
  return false;
}

TEST_P(HierarchicalLayouts, TrafficCountersMatchTheModel) {
  const Layout& layout = GetParam();
  const bool ran = with_layout(layout, [&](Communicator& comm) {
    const std::size_t count = std::size_t{1} << 22;  // 16 MiB: columns >= 4 MiB use the ring
    std::vector<float> data(count, 1.0f);
    const auto& topo = topology::topology_of(comm);
    const auto n = static_cast<std::size_t>(comm.size());
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto G = topo.groups.size();
    const int my_group = topo.group_of_rank[r];

    const std::size_t piece = comm.config().tcp_piece_bytes;
    std::vector<int> everyone(n);
    std::iota(everyone.begin(), everyone.end(), 0);
    const std::size_t K =
        ring_segments(count, n, ring_crosses_hosts(everyone, topo.host_of_rank), piece);

    // Flat ring: only ranks whose right neighbour is in another group send across.
    reset_traffic(comm);
    allreduce(comm, data.data(), data.data(), count, DataType::float32, ReduceOp::sum,
              {.algorithm = "ring"});
    TrafficReport t = traffic(comm);
    const bool boundary = topo.group_of_rank[(r + 1) % n] != my_group;
    const std::uint64_t ring_bytes = 4 * ring_sent(count, n, r);
    EXPECT_EQ(boundary ? t.inter_bytes : t.intra_bytes, ring_bytes);
    EXPECT_EQ(boundary ? t.intra_bytes : t.inter_bytes, 0u);
    EXPECT_EQ(boundary ? t.inter_messages : t.intra_messages, 2 * (n - 1) * K);

    if (G == 1) {  // one group (the discovered layout on one machine): hierarchical is the ring
      reset_traffic(comm);
      allreduce(comm, data.data(), data.data(), count, DataType::float32, ReduceOp::sum,
                {.algorithm = "hierarchical"});
      t = traffic(comm);
      EXPECT_EQ(t.intra_bytes, ring_bytes);
      EXPECT_EQ(t.inter_bytes, 0u);
      EXPECT_EQ(t.intra_messages, 2 * (n - 1) * K);
      return;
    }
    const auto& mine = topo.groups[static_cast<std::size_t>(my_group)];
    const std::size_t g = mine.size();
    const std::size_t local = std::find(mine.begin(), mine.end(), comm.rank()) - mine.begin();
    std::size_t P = 0;
    for (const auto& group : topo.groups)
      P = std::max(P, group.size());
    auto length = [&](std::size_t c) { return count / P + (c < count % P ? 1 : 0); };
    // Hierarchical, with every intra-group form: the same cross-group traffic (phase 2); inside
    // the group, direct and ring send each column once to its owner (phase 1) and owners'
    // columns to the others (phase 3: direct to every other member, ring every block but the
    // right neighbour's), shm sends nothing.
    // shm runs where the group shares a host (every layout on one machine; across the hosts of
    // scripts/mpirun-hosts only groups inside one host), else the direct form runs.
    MPI_Comm group_comm = MPI_COMM_NULL, host_comm = MPI_COMM_NULL;
    MPI_Comm_split(comm.mpi_comm(), my_group, comm.rank(), &group_comm);
    MPI_Comm_split_type(group_comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host_comm);
    int on_host = 0;
    MPI_Comm_size(host_comm, &on_host);
    int one_host = on_host == static_cast<int>(g) ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &one_host, 1, MPI_INT, MPI_MIN, group_comm);
    MPI_Comm_free(&host_comm);
    MPI_Comm_free(&group_comm);
    for (const char* intra : kIntraForms) {
      SCOPED_TRACE(std::string("intra-group form ") + intra);
      const std::string form = std::string(intra) == "shm" && !one_host ? "direct" : intra;
      Config config = comm.config();
      config.hierarchical_intra = intra;
      Communicator sub(comm.mpi_comm(), config);
      reset_traffic(sub);
      allreduce(sub, data.data(), data.data(), count, DataType::float32, ReduceOp::sum,
                {.algorithm = "hierarchical"});
      t = traffic(sub);
      std::uint64_t intra_bytes = 0, inter = 0, intra_messages = 0, inter_messages = 0;
      for (std::size_t c = 0; c < P; ++c) {
        const std::size_t owner = c % g;
        if (owner == local) {
          if (form == "direct") {
            intra_bytes += 4 * length(c) * (g - 1);
            intra_messages += g - 1;
          }
          if (topo.levels.size() == 1) {
            // Phase 2: ring over the G owners of column c; this rank's index is its group's.
            std::vector<int> owners;
            for (const auto& group : topo.groups)
              owners.push_back(group[c % group.size()]);
            inter += 4 * ring_sent(length(c), G, static_cast<std::size_t>(my_group));
            inter_messages +=
                2 * (G - 1) *
                ring_segments(length(c), G, ring_crosses_hosts(owners, topo.host_of_rank), piece);
          } else {
            // Two DGX-1 servers: the column's 4 owners (one per quad, all in other quads) pair
            // up inside each server, reduce-scatter the column (half to the partner), all-reduce
            // the half across servers (halving_doubling over 2: half of it each way), gather.
            const std::size_t half = length(c) / 2;
            if (form != "shm") {
              inter += 4 * 2 * half;  // the half to the partner, then this half back
              inter_messages += 2;
            }
            inter += 4 * half;  // across servers
            inter_messages += 2;
          }
        } else if (form != "shm") {
          intra_bytes += 4 * length(c);  // phase 1: to the column's owner
          intra_messages += 1;
        }
        if (form == "ring" && owner != (local + 1) % g) {  // phase 3 of the ring
          intra_bytes += 4 * length(c);
          intra_messages += 1;
        }
      }
      EXPECT_EQ(t.intra_bytes, intra_bytes);
      EXPECT_EQ(t.inter_bytes, inter);
      EXPECT_EQ(t.intra_messages, intra_messages);
      EXPECT_EQ(t.inter_messages, inter_messages);
      // Cross-group bytes cut by the group size against the ring's boundary ranks (even
      // layouts).
      if (n % G == 0 && G > 1 && g > 1) {
        EXPECT_LE(t.inter_bytes * g, ring_bytes + 4 * g * G);
      }
    }
  });
  if (!ran) GTEST_SKIP() << "layout " << layout.label << " needs " << layout.ranks << " ranks";
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchicalLayouts, ::testing::ValuesIn(kLayouts),
                         [](const auto& info) {
                           std::string name = info.param.label;
                           std::replace(name.begin(), name.end(), '=', '_');
                           std::replace(name.begin(), name.end(), '+', 'p');
                           return name;
                         });

}  // namespace
}  // namespace gradcomm::testing

namespace gradcomm::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// Reproducible mode: every algorithm returns exactly the bits of the serial reduction in rank
// order, computed here from all ranks' inputs with plain scalar arithmetic (16-bit types
// rounded after every step, as the mode promises).

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, float16_t> || std::is_same_v<T, bfloat16_t>) {
    return to_float(v);
  } else {
    return static_cast<double>(v);
  }
}

template <class T>
T combine(T a, T b, ReduceOp op) {
  auto apply = [op](auto x, auto y) -> decltype(x) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        return x + y;
      case ReduceOp::prod:
        return x * y;
      case ReduceOp::min:
        return y < x ? y : x;
      case ReduceOp::max:
        return x < y ? y : x;
    }
    return x;
  };
  if constexpr (std::is_same_v<T, float16_t>) {
    return to_float16(apply(to_float(a), to_float(b)));
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return to_bfloat16(apply(to_float(a), to_float(b)));
  } else {
    return apply(a, b);
  }
}

template <class T>
void check_reproducible(DataType dtype) {
  const int n = world().size();
  Config config;
  config.deterministic = true;
  Communicator comm(MPI_COMM_WORLD, config);
  std::mt19937 rng(99 + comm.rank());
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::prod, ReduceOp::max}) {
    for (std::size_t count : {std::size_t{1}, std::size_t{7}, static_cast<std::size_t>(n + 1),
                              std::size_t{1000}, std::size_t{65537}}) {
      std::vector<T> input(count);
      for (T& v : input) {
        const float x = uniform(rng);
        if constexpr (std::is_same_v<T, float16_t>) {
          v = to_float16(x);
        } else if constexpr (std::is_same_v<T, bfloat16_t>) {
          v = to_bfloat16(x);
        } else {
          v = static_cast<T>(x);
        }
      }
      std::vector<T> all(count * static_cast<std::size_t>(n));
      MPI_Allgather(input.data(), static_cast<int>(count * sizeof(T)), MPI_BYTE, all.data(),
                    static_cast<int>(count * sizeof(T)), MPI_BYTE, comm.mpi_comm());
      std::vector<T> expected(count);
      for (std::size_t i = 0; i < count; ++i) {
        T acc = all[i];
        for (int r = 1; r < n; ++r)
          acc = combine(acc, all[r * count + i], op);
        if (op == ReduceOp::avg) {
          if constexpr (std::is_same_v<T, float16_t>) {
            acc = to_float16(to_float(acc) / static_cast<float>(n));
          } else if constexpr (std::is_same_v<T, bfloat16_t>) {
            acc = to_bfloat16(to_float(acc) / static_cast<float>(n));
          } else {
            acc = acc / static_cast<T>(n);
          }
        }
        expected[i] = acc;
      }
      for (const std::string& algorithm : all_algorithms()) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(algorithm + " " + std::string(to_string(dtype)) + " " +
                       std::string(to_string(op)) + " count=" + std::to_string(count) +
                       (in_place ? " in-place" : ""));
          std::vector<T> out(count), work = input;
          T* dst = in_place ? work.data() : out.data();
          allreduce(comm, work.data(), dst, count, dtype, op, {.algorithm = algorithm});
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < count; ++i) {
            if (std::memcmp(&dst[i], &expected[i], sizeof(T)) != 0 && wrong++ == 0) {
              ADD_FAILURE() << "element " << i << ": " << as_double(dst[i]) << " vs serial "
                            << as_double(expected[i]);
            }
          }
          EXPECT_EQ(wrong, 0u);
        }
      }
    }
  }
}

class Reproducible : public MpiTest {};

TEST_F(Reproducible, Float32) {
  check_reproducible<float>(DataType::float32);
}
TEST_F(Reproducible, Float64) {
  check_reproducible<double>(DataType::float64);
}
TEST_F(Reproducible, Float16) {
  check_reproducible<float16_t>(DataType::float16);
}
TEST_F(Reproducible, BFloat16) {
  check_reproducible<bfloat16_t>(DataType::bfloat16);
}

}  // namespace
}  // namespace gradcomm::testing

namespace gradcomm::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// auto: a tuning table decides when it matches the layout; otherwise the cost model, which
// every rank evaluates identically.

collectives::AllreduceArgs args_of(std::size_t bytes) {
  return {nullptr, nullptr, bytes / 4, DataType::float32, ReduceOp::sum};
}

class AutoSelection : public MpiTest {};

TEST_F(AutoSelection, TuningTableDecidesWhenItMatches) {
  if (world().size() < 2) GTEST_SKIP() << "auto runs only with 2 or more ranks";
  const std::string path = "/tmp/gradcomm_test_tuning_" + std::to_string(getpid()) + ".json";
  collectives::TuningTable table;
  table.ranks = world().size();
  table.groups = static_cast<int>(topology::topology_of(world()).groups.size());
  table.rows = {{1000, "flat"}, {100000, "mpi"}, {SIZE_MAX, "ring"}};
  if (world().rank() == 0) {
    std::ofstream(path) << table.to_json();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Config config;
  config.tuning_file = path;
  Communicator comm(MPI_COMM_WORLD, config);
  EXPECT_EQ(collectives::select_allreduce_algorithm(args_of(8), comm), "flat");
  EXPECT_EQ(collectives::select_allreduce_algorithm(args_of(1000), comm), "flat");
  EXPECT_EQ(collectives::select_allreduce_algorithm(args_of(4096), comm), "mpi");
  EXPECT_EQ(collectives::select_allreduce_algorithm(args_of(1 << 24), comm), "ring");
  std::vector<std::byte> send, recv;
  for (std::size_t count : {std::size_t{3}, std::size_t{5000}, std::size_t{1000003}}) {
    check_exact(comm, "auto", DataType::float32, ReduceOp::sum, count, false, send, recv);
  }
  // A table for another rank count is ignored: the model decides (and never picks mpi, which it
  // has no model of, where the table would).
  table.ranks = world().size() + 1;
  if (world().rank() == 0) {
    std::ofstream(path) << table.to_json();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Communicator other(MPI_COMM_WORLD, config);
  EXPECT_NE(collectives::select_allreduce_algorithm(args_of(4096), other), "mpi");
  if (world().rank() == 0) std::remove(path.c_str());
}

// auto's decisions written out and adopted by another communicator give the same algorithm for
// every size the first one decided, and measuring stops there (auto_settled).
TEST_F(AutoSelection, DecisionsWrittenOutAndAdoptedDecideTheSame) {
  if (world().size() < 2) GTEST_SKIP() << "auto runs only with 2 or more ranks";
  Communicator first(MPI_COMM_WORLD);
  std::vector<float> buffer(std::size_t{1} << 18, 1.0f);
  const std::vector<std::size_t> counts = {1, 100, 5000, std::size_t{1} << 18};
  for (int round = 0; round < 3; ++round) {
    for (std::size_t count : counts) {
      allreduce(first, buffer.data(), buffer.data(), count, DataType::float32, ReduceOp::max);
    }
  }
  const collectives::TuningTable decided = collectives::auto_decisions(first);
  ASSERT_FALSE(decided.rows.empty());
  EXPECT_EQ(decided.ranks, world().size());
  const auto again = collectives::TuningTable::parse(decided.to_json(), "decisions");
  Communicator second(MPI_COMM_WORLD);
  collectives::use_auto_decisions(second, again);   // before its first auto call
  collectives::use_auto_decisions(first, decided);  // and on one that measured
  for (std::size_t count : counts) {
    const std::string expected(collectives::select_allreduce_algorithm(args_of(count * 4), first));
    EXPECT_EQ(collectives::select_allreduce_algorithm(args_of(count * 4), second), expected)
        << count;
    EXPECT_TRUE(collectives::auto_settled(args_of(count * 4), second));
    allreduce(second, buffer.data(), buffer.data(), count, DataType::float32, ReduceOp::max);
  }
  EXPECT_EQ(collectives::auto_decisions(second).to_json(), decided.to_json());
  // A table for another rank count is refused, naming both.
  collectives::TuningTable other = decided;
  other.ranks = world().size() + 1;
  EXPECT_THAT([&] { collectives::use_auto_decisions(second, other); },
              ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("decisions are for")));
}

// End to end: an algorithm that auto picks but that is slow here (its measured times scaled by
// 20 on every rank) is replaced within a few windows (a window lasts at least 1 ms and 4 calls,
// longer where the agreement is slow: across hosts), by the same algorithm on every rank, and
// every call's result stays exact. With GRADCOMM_AUTO_MEASURE=0 the pick stays.
TEST_F(AutoSelection, MeasuredPickThatIsSlowIsReplaced) {
  if (world().size() < 2) GTEST_SKIP() << "auto runs only with 2 or more ranks";
  constexpr std::size_t kCount = (1 << 20) / 4 + 3;  // ~1 MiB of float32
  int needed = 0;                                    // calls until the measured switch
  for (const bool measure : {true, false}) {
    SCOPED_TRACE(measure ? "GRADCOMM_AUTO_MEASURE=1" : "GRADCOMM_AUTO_MEASURE=0");
    Config config;
    config.auto_measure = measure;
    Communicator comm(MPI_COMM_WORLD, config);
    const std::string first(collectives::select_allreduce_algorithm(args_of(kCount * 4), comm));
    collectives::scale_auto_timing_for_testing(comm, first, 20.0);
    std::vector<std::byte> send, recv;
    std::string picks;
    std::string last = first;
    // The choice is the same on every rank, so every rank leaves the loop at the same call.
    const int limit = measure ? 2000 : std::max(40, 2 * needed);
    int call = 0;
    for (; call < limit && (!measure || last == first); ++call) {
      check_exact(comm, "auto", DataType::float32, ReduceOp::sum, kCount, call % 2 == 1, send,
                  recv);
      last = collectives::select_allreduce_algorithm(args_of(kCount * 4), comm);
      picks += last + " ";
    }
    if (measure) {
      needed = call;
      EXPECT_NE(last, first) << "after " << call << " calls";
    } else {
      EXPECT_EQ(last, first) << picks;
    }
    // Every rank made the same picks, call by call.
    const std::uint64_t mine = std::hash<std::string>{}(picks);
    std::uint64_t lo = mine, hi = mine;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(lo, hi) << "rank " << world().rank() << " picked " << picks;
  }
}

// Calls whose sizes differ between ranks, and calls that fail on one rank before they can run
// (its stand-in against the others' auto call), end in a MismatchError; auto must not count
// them on the ranks that began them, or those ranks' measuring windows end at other calls than
// the rest's, whose figures they then wait for in an MPI_Allreduce (a hang). Both in a size class
// that earlier calls set up and in one that the failed call set up; then thousands of calls
// through several windows, exact, with the same picks on every rank.
TEST_F(AutoSelection, MismatchedCallsLeaveEveryRanksMeasuringInStep) {
  if (world().size() < 2) GTEST_SKIP() << "auto runs only with 2 or more ranks";
  Config config;
  config.auto_measure = true;
  Communicator comm(MPI_COMM_WORLD, config);
  const int rank = comm.rank();
  // Small calls, which auto times one in several (a failed call that counted shifts which).
  constexpr std::size_t kCount = 16;   // 64 bytes
  constexpr std::size_t kFresh = 300;  // 1200 bytes: another size class, first met failing
  std::vector<std::byte> send, recv;
  for (int call = 0; call < 7; ++call) {
    check_exact(comm, "auto", DataType::float32, ReduceOp::sum, kCount, false, send, recv);
  }
  std::vector<float> data(kFresh + 4, 1.0f);
  const AllreduceOptions automatic{.algorithm = "auto"};
  // Calls that agree between the mismatches: right after one, a call compares before it starts
  // (its algorithm is set up afresh), where auto has not counted it yet.
  auto agree = [&] {
    for (int call = 0; call < 3; ++call) {
      check_exact(comm, "auto", DataType::float32, ReduceOp::sum, kCount, false, send, recv);
    }
  };
  for (int round = 0; round < 3; ++round) {
    for (const std::size_t count : {kCount, kFresh}) {
      // Another size on the last rank (the same size class).
      const std::size_t mine = rank == comm.size() - 1 ? count + 4 : count;
      EXPECT_THROW(allreduce(comm, data.data(), data.data(), mine, DataType::float32, ReduceOp::sum,
                             automatic),
                   MismatchError);
      agree();
      // Refused on rank 0 (null data): its stand-in meets the others' call.
      if (rank == 0) {
        EXPECT_THROW(allreduce(comm, nullptr, data.data(), count, DataType::float32, ReduceOp::sum,
                               automatic),
                     InvalidArgument);
      } else {
        EXPECT_THROW(allreduce(comm, data.data(), data.data(), count, DataType::float32,
                               ReduceOp::sum, automatic),
                     MismatchError);
      }
      agree();
    }
  }
  std::string picks;
  for (int call = 0; call < 4000; ++call) {  // a window of 64 B calls spans ~2000 calls here
    const std::size_t count = call % 4 == 3 ? kFresh : kCount;
    check_exact(comm, "auto", DataType::float32, ReduceOp::sum, count, call % 2 == 1, send, recv);
    picks += std::string(collectives::select_allreduce_algorithm(args_of(count * 4), comm)) + " ";
  }
  const std::uint64_t hash = std::hash<std::string>{}(picks);
  std::uint64_t lo = hash, hi = hash;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "rank " << rank << " picked " << picks;
}

// auto_settled (gradcomm-bench times auto once it holds): false before a size's first window
// ends and while a duel is under way, then true, at the same call on every rank; true at once
// when auto does not measure.
TEST_F(AutoSelection, SettlesAfterExploringAtTheSameCallOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "auto runs only with 2 or more ranks";
  constexpr std::size_t kCount = (1 << 16) / 4 + 1;  // ~64 KiB of float32
  for (const bool measure : {true, false}) {
    SCOPED_TRACE(measure ? "GRADCOMM_AUTO_MEASURE=1" : "GRADCOMM_AUTO_MEASURE=0");
    Config config;
    config.auto_measure = measure;
    Communicator comm(MPI_COMM_WORLD, config);
    const collectives::AllreduceArgs args = args_of(kCount * 4);
    const std::string first(collectives::select_allreduce_algorithm(args, comm));
    if (!measure) {
      EXPECT_TRUE(collectives::auto_settled(args, comm));
      continue;
    }
    EXPECT_FALSE(collectives::auto_settled(args, comm)) << "before any window";
    // The first pick measures 1000 times slower than it is: auto must duel and replace it.
    // (At 20 times, a challenger timed while other jobs loaded the 2 cores, or with more ranks
    // than cores, could measure slower still, and auto then rightly kept the first pick.)
    collectives::scale_auto_timing_for_testing(comm, first, 1000.0);
    std::vector<float> data(kCount);
    int calls = 0;
    for (; calls < 20000 && !collectives::auto_settled(args, comm); ++calls) {
      std::fill(data.begin(), data.end(), 1.0f);
      allreduce(comm, data.data(), data.data(), kCount, DataType::float32, ReduceOp::sum,
                {.algorithm = "auto"});
    }
    EXPECT_TRUE(collectives::auto_settled(args, comm)) << "after " << calls << " calls";
    EXPECT_NE(collectives::select_allreduce_algorithm(args, comm), first);
    EXPECT_THAT(data, ::testing::Each(static_cast<float>(world().size())));
    int range[2] = {calls, -calls};
    MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    EXPECT_EQ(range[0], -range[1]) << "rank " << world().rank() << " settled after " << calls;
  }
}

}  // namespace
}  // namespace gradcomm::testing
