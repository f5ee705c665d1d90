// The shared-memory algorithm's own cases: registered buffers (every placement, mixed across
// ranks, every algorithm), the rank-order result, disagreeing calls, the size check of
// Communicator::allocate, packer and fusion buffers in registered memory, and no segment file left
// in /dev/shm while mapped or after. (The shared dtype/op/count matrix runs shm with every other
// algorithm in test_allreduce.)

#include <dirent.h>
#include <gmock/gmock.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"
#include "tests/mpi_test.h"

namespace gradcomm::testing {
namespace {

using ::testing::HasSubstr;

// Rank r's input element i: small integers, so float sums are exact in any order.
float input(int rank, std::size_t i) {
  return static_cast<float>((static_cast<std::size_t>(rank) * 7 + i * 13) % 97) - 48.0f;
}

float expected_sum(int ranks, std::size_t i) {
  float sum = 0;
  for (int r = 0; r < ranks; ++r)
    sum += input(r, i);
  return sum;
}

// Counts on both paths: empty, tiny, primes, not divisible by the rank count, either side of each
// latency-path limit (1 KiB, 2 KiB on Intel, 8 KiB with ranks sharing CPUs: 256, 512, 2048
// floats), one round of the staged path and a bit more (128 KiB on 2 ranks of an Intel CPU,
// 256 KiB elsewhere: 32768 and 65536 floats), many rounds, and (for the streaming copy-out) more
// than 4 MiB.
const std::vector<std::size_t> kCounts = {0,     1,     2,     3,      7,       256,    257,  509,
                                          512,   513,   2048,  2049,   4093,    4096,   4097, 32768,
                                          32769, 65536, 65537, 196613, 1000003, 1 << 20};

// This job's segment files ("gradcomm-<creator's pid>-<serial>"): ctest runs other jobs beside
// this one, whose segments come and go meanwhile.
std::set<std::string> segment_files(Communicator& comm) {
  long mine = static_cast<long>(getpid());
  std::vector<long> pids(static_cast<std::size_t>(comm.size()));
  MPI_Allgather(&mine, 1, MPI_LONG, pids.data(), 1, MPI_LONG, comm.mpi_comm());
  std::set<std::string> names;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(dir)) {
      for (long pid : pids) {
        const std::string prefix = "gradcomm-" + std::to_string(pid) + "-";
        if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0)
          names.insert(entry->d_name);
      }
    }
    closedir(dir);
  }
  return names;
}

// Whether /dev/shm has room for `bytes` more (agreed across ranks): container runtimes often give
// it only 64 MiB, and allocate() then fails with a clear error, which is not what these cases test.
bool room_in_dev_shm(Communicator& comm, std::size_t bytes) {
  struct statvfs fs {};
  int room = statvfs("/dev/shm", &fs) == 0 && fs.f_bavail * fs.f_frsize >= 2 * bytes ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &room, 1, MPI_INT, MPI_MIN, comm.mpi_comm());
  return room != 0;
}

class Shm : public MpiTest {};

// Registered send and/or recv, in and out of place, and ranks that mix registered and private
// buffers in the same call; the result must be the serial sum, the same bits everywhere.
TEST_F(Shm, RegisteredBuffersEveryPlacement) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  const std::size_t largest = kCounts.back();
  if (!room_in_dev_shm(comm, 2 * largest * sizeof(float) * static_cast<std::size_t>(n))) {
    GTEST_SKIP() << "/dev/shm is too small for " << n << " x 2 x " << largest * sizeof(float)
                 << " bytes";
  }
  RegisteredBuffer a = comm.allocate(largest * sizeof(float));
  RegisteredBuffer b = comm.allocate(largest * sizeof(float));
  std::vector<float> priv_in(largest), priv_out(largest);
  enum Placement { reg_in_place, reg_to_private, private_to_reg, mixed_in_place };
  for (Placement placement : {reg_in_place, reg_to_private, private_to_reg, mixed_in_place}) {
    for (std::size_t count : kCounts) {
      float* in = a.as<float>();
      float* out = in;
      if (placement == reg_to_private) out = priv_out.data();
      if (placement == private_to_reg) {
        in = priv_in.data();
        out = b.as<float>();
      }
      if (placement == mixed_in_place && me % 2 == 1) in = out = priv_in.data();
      for (std::size_t i = 0; i < count; ++i)
        in[i] = input(me, i);
      allreduce(comm, in, out, count, DataType::float32, ReduceOp::sum, {.algorithm = "shm"});
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < count; ++i)
        wrong += out[i] != expected_sum(n, i);
      EXPECT_EQ(wrong, 0u) << "placement " << placement << ", count " << count;
      EXPECT_TRUE(same_on_all_ranks(comm.mpi_comm(), fingerprint(out, count * sizeof(float))));
    }
  }
}

// Every algorithm takes registered buffers as plain memory.
TEST_F(Shm, EveryAlgorithmAcceptsRegisteredBuffers) {
  Communicator& comm = world();
  const std::size_t count = 100003;
  if (!room_in_dev_shm(comm, count * sizeof(double) * static_cast<std::size_t>(comm.size()))) {
    GTEST_SKIP() << "/dev/shm is too small";
  }
  RegisteredBuffer buffer = comm.allocate(count * sizeof(double));
  for (const std::string& algorithm : collectives::host_algorithm_names()) {
    double* data = buffer.as<double>();
    for (std::size_t i = 0; i < count; ++i)
      data[i] = input(comm.rank(), i);
    allreduce(comm, data, data, count, DataType::float64, ReduceOp::avg, {.algorithm = algorithm});
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i)
      wrong += std::abs(data[i] - static_cast<double>(expected_sum(comm.size(), i)) / comm.size()) >
               1e-12;
    EXPECT_EQ(wrong, 0u) << algorithm;
  }
}

// shm reduces every element in rank order, so it returns the bits of the serial reduction.
TEST_F(Shm, BitsOfTheSerialRankOrderReduction) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  for (std::size_t count : {std::size_t{5}, std::size_t{3001}, std::size_t{300007}}) {
    auto value = [](int r, std::size_t i) {
      return static_cast<float>(
          1.0 / (1.0 + static_cast<double>(r) * 3.1 + static_cast<double>(i % 1013) * 0.37));
    };
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i)
      data[i] = value(me, i);
    allreduce(comm, data.data(), data.data(), count, DataType::float32, ReduceOp::sum,
              {.algorithm = "shm"});
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      float serial = value(0, i);
      for (int r = 1; r < n; ++r)
        serial += value(r, i);
      wrong += std::memcmp(&serial, &data[i], sizeof serial) != 0;
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
}

// Calls back to back whose buffers switch between registered and private from one call to the
// next, differently on each rank (a seeded draw per call and rank), over sizes on both paths and
// across the staged rounds: every call gives the bits of the serial rank-order sum.
TEST_F(Shm, SwitchingBetweenRegisteredAndPrivateBackToBack) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  auto value = [](int r, std::size_t i) {
    return static_cast<float>(
        1.0 / (1.0 + static_cast<double>(r) * 2.3 + static_cast<double>(i % 997) * 0.41));
  };
  const std::size_t largest = 600011;  // 2.4 MB: ten staged rounds (19 of half a slot on Intel)
  RegisteredBuffer reg_in = comm.allocate(largest * sizeof(float));
  RegisteredBuffer reg_out = comm.allocate(largest * sizeof(float));
  std::vector<float> priv_in(largest), priv_out(largest), serial(largest);
  const std::size_t counts[] = {3, 4000, 65537, 200003, 131072, largest};
  for (int call = 0; call < 40; ++call) {
    const std::size_t count = counts[static_cast<std::size_t>(call) % std::size(counts)];
    const unsigned draw = static_cast<unsigned>(call * 7 + me * 3 + call * me) % 5;
    float* in = draw & 1 ? reg_in.as<float>() : priv_in.data();
    float* out = draw & 2 ? reg_out.as<float>() : priv_out.data();
    if (draw == 4) out = in;  // in place
    for (std::size_t i = 0; i < count; ++i) {
      in[i] = value(me, i + static_cast<std::size_t>(call));
      serial[i] = value(0, i + static_cast<std::size_t>(call));
      for (int r = 1; r < n; ++r)
        serial[i] += value(r, i + static_cast<std::size_t>(call));
    }
    allreduce(comm, in, out, count, DataType::float32, ReduceOp::sum, {.algorithm = "shm"});
    EXPECT_EQ(std::memcmp(out, serial.data(), count * sizeof(float)), 0)
        << "call " << call << ", count " << count << ", draw " << draw;
  }
}

// Ranks that disagree on the count (or dtype, or op) get an error on every rank, naming both
// calls, instead of reading past a buffer; the next call works.
TEST_F(Shm, DisagreeingCallsFailOnEveryRank) {
  Communicator& comm = world();
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  // 256 / 257 and 512 / 513: either side of the latency path's limit where ranks have CPUs of
  // their own (1 KiB, 2 KiB on Intel), so that the ranks take different paths there;
  // 524287 / 524288: a count either side of 2 MiB.
  for (std::size_t base : {std::size_t{10}, std::size_t{256}, std::size_t{512}, std::size_t{200000},
                           std::size_t{524287}}) {
    const std::size_t count = base + (comm.rank() == comm.size() - 1 ? 1 : 0);
    std::vector<float> data(count, 1.0f);
    try {
      allreduce(comm, data.data(), data.data(), count, DataType::float32, ReduceOp::sum,
                {.algorithm = "shm"});
      ADD_FAILURE() << "no error for disagreeing counts";
    } catch (const MismatchError& e) {
      EXPECT_THAT(e.what(), HasSubstr("ranks disagree on the"));
      EXPECT_THAT(e.what(), HasSubstr(std::to_string(base) + " x float32 sum"));
      EXPECT_THAT(e.what(), HasSubstr(std::to_string(base + 1) + " x float32 sum"));
    }
  }
  std::vector<int> v(1000, 1);
  try {
    allreduce(comm, v.data(), v.data(), v.size(), DataType::int32,
              comm.rank() == 0 ? ReduceOp::max : ReduceOp::sum, {.algorithm = "shm"});
    ADD_FAILURE() << "no error for disagreeing ops";
  } catch (const MismatchError& e) {
    EXPECT_THAT(e.what(), HasSubstr("int32 max"));
  }
  std::fill(v.begin(), v.end(), 1);
  allreduce(comm, v.data(), v.data(), v.size(), DataType::int32, ReduceOp::sum,
            {.algorithm = "shm"});
  EXPECT_EQ(v[999], comm.size());
}

TEST_F(Shm, AllocateChecksSizesAcrossRanks) {
  Communicator& comm = world();
  EXPECT_FALSE(comm.allocate(0));
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  try {
    (void)comm.allocate(comm.rank() == 0 ? 4096 : 8192);
    ADD_FAILURE() << "no error for different sizes";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("allocate"));
    EXPECT_THAT(e.what(), HasSubstr("4096 to 8192 bytes"));
  }
  // A size whose segment (every rank's slice, rounded up) would wrap: refused on every rank,
  // not a mapping of the wrapped size with slices outside it.
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2 + (std::size_t{2} << 20);
  try {
    (void)comm.allocate(huge);
    ADD_FAILURE() << "no error for " << huge << " bytes on " << comm.size() << " ranks";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("allocate"));
    EXPECT_THAT(e.what(), HasSubstr("do not fit in one address space"));
  }
  RegisteredBuffer ok = comm.allocate(64);
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok.size(), 64u);
  EXPECT_EQ(ok.as<float>()[0], 0.0f);  // fresh registered memory reads as zeros
}

// Nothing under /dev/shm while segments are mapped (they are unlinked once every rank maps
// them), and nothing after they are released.
TEST_F(Shm, NoSegmentFileOutlivesTheMapping) {
  Communicator& comm = world();
  const std::set<std::string> before = segment_files(comm);
  MPI_Barrier(comm.mpi_comm());
  {
    Communicator fresh(comm.mpi_comm());
    RegisteredBuffer buffer = fresh.allocate(1 << 20);
    std::vector<float> data(1 << 18, 1.0f);
    allreduce(fresh, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum,
              {.algorithm = "shm"});
    EXPECT_EQ(data[0], static_cast<float>(comm.size()));
    MPI_Barrier(comm.mpi_comm());
    for (const std::string& name : segment_files(comm))
      EXPECT_TRUE(before.count(name)) << "/dev/shm/" << name << " exists while mapped";
  }
  MPI_Barrier(comm.mpi_comm());
  for (const std::string& name : segment_files(comm))
    EXPECT_TRUE(before.count(name)) << "/dev/shm/" << name << " left behind";
}

// The packer's buffers in registered memory: pack, all-reduce in place with shm (no copy-in),
// unpack; and grouped_allreduce, whose fused buffers are registered on one host.
TEST_F(Shm, RegisteredPackerAndFusion) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  std::vector<std::vector<float>> tensors = {std::vector<float>(70001), std::vector<float>(3),
                                             std::vector<float>(129), std::vector<float>(40000)};
  std::vector<packing::TensorDesc> descs;
  for (auto& t : tensors)
    descs.push_back({t.data(), t.size(), DataType::float32});
  auto fill = [&] {
    for (auto& t : tensors) {
      for (std::size_t i = 0; i < t.size(); ++i)
        t[i] = input(me, i);
    }
  };
  auto check = [&](const char* what) {
    std::size_t wrong = 0;
    for (auto& t : tensors) {
      for (std::size_t i = 0; i < t.size(); ++i)
        wrong += t[i] != expected_sum(n, i);
    }
    EXPECT_EQ(wrong, 0u) << what;
  };
  packing::GradientPacker packer(descs, {.num_split = 4, .registered_on = &comm});
  ASSERT_FALSE(packer.declined()) << packer.decline_reason();
  fill();
  packer.pack();
  for (const auto& p : packer.packed()) {
    allreduce(comm, p.data, p.data, p.count, p.dtype, ReduceOp::sum, {.algorithm = "shm"});
  }
  packer.unpack();
  check("packer");

  for (const char* algorithm : {"shm", "auto", "ring"}) {
    fill();
    grouped_allreduce(comm, descs, ReduceOp::sum,
                      {.algorithm = algorithm, .fusion_threshold = std::size_t{1} << 20});
    check(algorithm);
  }
}

}  // namespace
}  // namespace gradcomm::testing
