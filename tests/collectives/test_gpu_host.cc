// The host side of the GPU path, on every machine: a fake gpu::Runtime stands in for the CUDA/NCCL
// module (its "device memory" is host memory it hands out and recognises, its NCCL is MPI), so
// pointer-kind validation, the ncclUniqueId broadcast, the NCCL communicator cache, timeouts and
// the GPU hierarchical schedule are exercised without a GPU. The real module is tested in
// tests/gpu/ where a device exists.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/allreduce_nccl.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"
#include "packing/negotiator.h"
#include "tests/mpi_test.h"

namespace gradcomm {
namespace {

using testing::MpiTest;
using testing::world;

MPI_Datatype mpi_type(DataType dtype) {
  switch (dtype) {
    case DataType::float32:
      return MPI_FLOAT;
    case DataType::float64:
      return MPI_DOUBLE;
    case DataType::int32:
      return MPI_INT32_T;
    case DataType::int64:
      return MPI_INT64_T;
    default:
      throw Unsupported("fake runtime: no MPI type for " + std::string(to_string(dtype)));
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::min:
      return MPI_MIN;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::prod:
      return MPI_PROD;
    default:
      return MPI_SUM;
  }
}

template <class T>
void divide(void* data, std::size_t count, int n) {
  T* p = static_cast<T*>(data);
  for (std::size_t i = 0; i < count; ++i)
    p[i] = static_cast<T>(p[i] / n);
}

void divide(void* data, std::size_t count, DataType dtype, int n) {
  if (dtype == DataType::float32) divide<float>(data, count, n);
  if (dtype == DataType::float64) divide<double>(data, count, n);
  if (dtype == DataType::int32) divide<std::int32_t>(data, count, n);
  if (dtype == DataType::int64) divide<std::int64_t>(data, count, n);
}

// NCCL stand-in: every communicator is an MPI communicator split from MPI_COMM_WORLD by a hash of
// its unique id (gradcomm creates its NCCL communicators on all world ranks at once).
struct FakeComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  gpu::UniqueId id{};
  int rank = 0, nranks = 0;
};

class FakeRuntime final : public gpu::Runtime {
 public:
  ~FakeRuntime() override {
    for (auto& [pointer, bytes] : allocations_)
      std::free(pointer);
  }
  std::string describe() override { return "fake"; }
  int device_count() override { return 1; }
  gpu::PointerInfo classify(const void* pointer) override {
    const auto* p = static_cast<const std::byte*>(pointer);
    for (const auto& [base, bytes] : allocations_) {
      const auto* b = static_cast<const std::byte*>(base);
      if (p >= b && p < b + bytes) return {gpu::MemoryKind::device, 0};
    }
    return {};
  }
  int current_device() override { return 0; }
  void set_device(int) override {}
  gpu::UniqueId unique_id() override {
    // Unique across ranks and calls, as NCCL's are (several group roots make ids at once).
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    gpu::UniqueId id{};
    const long long stamp[2] = {world_rank, ++ids_made_};
    std::memcpy(id.data(), stamp, sizeof stamp);
    return id;
  }
  gpu::GpuComm comm_init(int nranks, const gpu::UniqueId& id, int rank, bool blocking) override {
    last_blocking = blocking;
    auto* comm = new FakeComm;
    comm->id = id;
    comm->rank = rank;
    comm->nranks = nranks;
    const int color = static_cast<int>(testing::fingerprint(id.data(), id.size()) & 0x3fffffff);
    MPI_Comm_split(MPI_COMM_WORLD, color, rank, &comm->mpi);
    ++inits;
    ids.push_back(id);
    return comm;
  }
  void comm_destroy(gpu::GpuComm comm) override {
    auto* c = static_cast<FakeComm*>(comm);
    MPI_Comm_free(&c->mpi);
    delete c;
    ++destroys;
  }
  void comm_abort(gpu::GpuComm comm) override {
    ++aborts;
    comm_destroy(comm);
    --destroys;
  }
  gpu::CommState comm_state(gpu::GpuComm, std::string* error) override {
    if (!async_error.empty()) {
      *error = async_error;
      return gpu::CommState::failed;
    }
    return gpu::CommState::ready;
  }
  void allreduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                 int nranks, gpu::GpuComm comm, gpu::Stream) override {
    ++allreduces;
    auto* c = static_cast<FakeComm*>(comm);
    EXPECT_EQ(nranks, c->nranks);
    MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                  mpi_type(dtype), mpi_op(op), c->mpi);
    if (op == ReduceOp::avg) divide(recv, count, dtype, nranks);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, DataType dtype,
                      ReduceOp op, int nranks, gpu::GpuComm comm, gpu::Stream) override {
    ++reduce_scatters;
    auto* c = static_cast<FakeComm*>(comm);
    const std::size_t es = element_size(dtype);
    std::vector<std::byte> in(static_cast<const std::byte*>(send),
                              static_cast<const std::byte*>(send) + count_per_rank * es * nranks);
    MPI_Reduce_scatter_block(in.data(), recv, static_cast<int>(count_per_rank), mpi_type(dtype),
                             mpi_op(op), c->mpi);
    if (op == ReduceOp::avg) divide(recv, count_per_rank, dtype, nranks);
  }
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, DataType dtype,
                  gpu::GpuComm comm, gpu::Stream) override {
    auto* c = static_cast<FakeComm*>(comm);
    const std::size_t bytes = count_per_rank * element_size(dtype);
    std::vector<std::byte> mine(static_cast<const std::byte*>(send),
                                static_cast<const std::byte*>(send) + bytes);
    MPI_Allgather(mine.data(), static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes),
                  MPI_BYTE, c->mpi);
  }
  void group_start() override {}
  void group_end() override {}
  bool stream_done(gpu::Stream) override { return !stall; }
  bool event_done(void*) override { return !stall; }
  void stream_wait_event(gpu::Stream, void*) override {}
  void stream_synchronize(gpu::Stream) override {}
  gpu::Stream stream_create() override { return nullptr; }
  void stream_destroy(gpu::Stream) override {}
  void copy_async(void* dst, const void* src, std::size_t bytes, gpu::Stream) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void* batch_create(const gpu::CopyOp* ops, std::size_t n) override {
    return new std::vector<gpu::CopyOp>(ops, ops + n);
  }
  void batch_run(void* batch, gpu::CopyMethod, gpu::Stream) override {
    for (const gpu::CopyOp& op : *static_cast<std::vector<gpu::CopyOp>*>(batch))
      copy_async(op.dst, op.src, op.bytes, nullptr);
  }
  void batch_destroy(void* batch) override { delete static_cast<std::vector<gpu::CopyOp>*>(batch); }
  void* device_alloc(std::size_t bytes) override {
    void* p = std::malloc(std::max<std::size_t>(bytes, 1));
    allocations_[p] = bytes;
    return p;
  }
  void device_free(void* pointer) override {
    allocations_.erase(pointer);
    std::free(pointer);
  }
  void* host_alloc_pinned(std::size_t bytes) override { return std::malloc(bytes); }
  void host_free_pinned(void* pointer) override { std::free(pointer); }

  int inits = 0, destroys = 0, aborts = 0, allreduces = 0, reduce_scatters = 0;
  bool last_blocking = false;  // the last comm_init's config.blocking
  std::vector<gpu::UniqueId> ids;
  bool stall = false;
  std::string async_error;

 private:
  std::map<void*, std::size_t> allocations_;
  long long ids_made_ = 0;
};

class GpuHostTest : public MpiTest {
 protected:
  void SetUp() override { gpu::set_runtime_for_testing(&fake_); }
  void TearDown() override {
    gpu::set_runtime_for_testing(nullptr);
    MpiTest::TearDown();
  }
  // A "device" buffer of `count` floats from the fake.
  float* device_floats(std::size_t count) {
    return static_cast<float*>(fake_.device_alloc(count * sizeof(float)));
  }
  FakeRuntime fake_;
};

template <class T>
std::vector<T> expected_sum(std::size_t count, int ranks, int salt = 0) {
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    long long sum = 0;
    for (int r = 0; r < ranks; ++r)
      sum += static_cast<long long>((r * 7 + i * 3 + salt) % 11) - 5;
    out[i] = static_cast<T>(sum);
  }
  return out;
}

template <class T>
void fill(T* data, std::size_t count, int rank, int salt = 0) {
  for (std::size_t i = 0; i < count; ++i)
    data[i] = static_cast<T>(static_cast<long long>((rank * 7 + i * 3 + salt) % 11) - 5);
}

TEST_F(GpuHostTest, HostBuffersNeverReachNccl) {
  Communicator comm(MPI_COMM_WORLD);
  std::vector<float> data(1000);
  fill(data.data(), data.size(), comm.rank());
  for (std::string_view algorithm : {"auto", "ring", "hierarchical", "shm"}) {
    if (algorithm == "shm" && comm.size() == 1) continue;
    std::vector<float> out(data.size());
    try {
      allreduce(comm, data.data(), out.data(), data.size(), DataType::float32, ReduceOp::sum,
                {.algorithm = algorithm});
    } catch (const Unsupported&) {
      continue;  // shm without a shared host
    }
    EXPECT_EQ(out, expected_sum<float>(data.size(), comm.size())) << algorithm;
  }
  EXPECT_EQ(fake_.allreduces, 0);
  EXPECT_EQ(fake_.reduce_scatters, 0);
  EXPECT_EQ(fake_.inits, 0);
}

TEST_F(GpuHostTest, NcclRejectsHostBuffersBeforeAnyCommunication) {
  Communicator comm(MPI_COMM_WORLD);
  std::vector<float> data(16, 1.0f);
  try {
    allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum,
              {.algorithm = "nccl"});
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allreduce(nccl)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fake_.inits, 0);
  EXPECT_EQ(fake_.allreduces, 0);
}

TEST_F(GpuHostTest, HostAlgorithmsRejectDeviceBuffers) {
  Communicator comm(MPI_COMM_WORLD);
  float* device = device_floats(64);
  std::vector<float> host(64);
  for (std::string_view algorithm : {"ring", "flat", "halving_doubling", "shm", "mpi"}) {
    try {
      allreduce(comm, device, device, 64, DataType::float32, ReduceOp::sum,
                {.algorithm = algorithm});
      ADD_FAILURE() << algorithm << ": no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("reads buffers on the CPU"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("device memory of GPU 0"), std::string::npos)
          << e.what();
    }
  }
  // Mixed: a device send buffer and a host receive buffer.
  for (std::string_view algorithm : {"auto", "nccl"}) {
    try {
      allreduce(comm, device, host.data(), 64, DataType::float32, ReduceOp::sum,
                {.algorithm = algorithm});
      ADD_FAILURE() << algorithm << ": no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("both must be on the same GPU"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(fake_.inits, 0);
  EXPECT_EQ(fake_.allreduces, 0);
  // The process stays usable after rejected calls.
  allreduce(comm, host.data(), host.data(), 64, DataType::float32, ReduceOp::sum);
}

TEST_F(GpuHostTest, UniqueIdIsBroadcastAndTheCommunicatorCachedAndFreedOnce) {
  const collectives::NcclCommCounts before = collectives::nccl_comm_counts();
  {
    Communicator comm(MPI_COMM_WORLD);
    float* data = device_floats(100);
    for (int call = 0; call < 3; ++call) {
      fill(data, 100, comm.rank(), call);
      allreduce(comm, data, data, 100, DataType::float32, ReduceOp::sum);  // auto -> nccl
      EXPECT_EQ(std::vector<float>(data, data + 100), expected_sum<float>(100, comm.size(), call));
    }
    const int expected_inits = comm.size() > 1 ? 1 : 0;  // one rank needs no NCCL communicator
    EXPECT_EQ(fake_.inits, expected_inits);
    EXPECT_EQ(fake_.allreduces, comm.size() > 1 ? 3 : 0);
    if (comm.size() > 1) {
      // Every rank initialised with rank 0's id.
      ASSERT_EQ(fake_.ids.size(), 1u);
      EXPECT_TRUE(testing::same_on_all_ranks(
          MPI_COMM_WORLD, testing::fingerprint(fake_.ids[0].data(), fake_.ids[0].size())));
    }
    EXPECT_EQ(fake_.destroys, 0);
  }
  EXPECT_EQ(fake_.destroys, fake_.inits);  // freed with the communicator, once
  const collectives::NcclCommCounts after = collectives::nccl_comm_counts();
  EXPECT_EQ(after.created - before.created, fake_.inits);
  EXPECT_EQ(after.destroyed - before.destroyed, fake_.inits);
}

// GRADCOMM_NCCL_BLOCKING reaches ncclCommInitRankConfig's config.blocking: blocking by default.
TEST_F(GpuHostTest, NcclCommunicatorsAreBlockingUnlessConfiguredNot) {
  for (const bool blocking : {true, false}) {
    Config config = Config::from_environment();
    if (!blocking) config.nccl_blocking = false;
    Communicator comm(MPI_COMM_WORLD, config);
    if (comm.size() == 1) GTEST_SKIP() << "one rank makes no NCCL communicator";
    float* data = device_floats(5);
    fill(data, 5, comm.rank(), 0);
    allreduce(comm, data, data, 5, DataType::float32, ReduceOp::sum);
    EXPECT_EQ(std::vector<float>(data, data + 5), expected_sum<float>(5, comm.size(), 0));
    EXPECT_EQ(fake_.last_blocking, blocking);
  }
}

// The device all-gather and reduce-scatter (the torch backend's, FSDP's): serial references on
// every count, in place included; bad buffers refused before any communication; ranks in
// different calls get MismatchError on every rank instead of reaching NCCL.
TEST_F(GpuHostTest, DeviceAllGatherAndReduceScatterMatchTheSerialReference) {
  Communicator comm(MPI_COMM_WORLD);
  const int n = comm.size(), me = comm.rank();
  for (std::size_t count : {0ul, 1ul, 7ul, 1001ul}) {
    std::vector<std::int32_t> want(count * n);
    for (int r = 0; r < n; ++r)
      fill(want.data() + r * count, count, r, 3);
    auto* gathered = static_cast<std::int32_t*>(fake_.device_alloc(count * n * 4 + 4));
    auto* mine = static_cast<std::int32_t*>(fake_.device_alloc(count * 4 + 4));
    fill(mine, count, me, 3);
    collectives::nccl_allgather(comm, mine, gathered, count, DataType::int32, nullptr, false);
    EXPECT_EQ(std::vector<std::int32_t>(gathered, gathered + count * n), want) << count;
    std::fill(gathered, gathered + count * n, 0);  // in place: the input is this rank's slice
    fill(gathered + me * count, count, me, 3);
    collectives::nccl_allgather(comm, gathered + me * count, gathered, count, DataType::int32,
                                nullptr, false);
    EXPECT_EQ(std::vector<std::int32_t>(gathered, gathered + count * n), want) << count;

    float* full = device_floats(count * n + 1);
    float* part = device_floats(count + 1);
    fill(full, count * n, me, 5);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      collectives::nccl_reduce_scatter(comm, full, part, count, DataType::float32, op, nullptr,
                                       false);
      for (std::size_t i = 0; i < count; ++i) {
        float expect = op == ReduceOp::sum ? 0.0f : -1e30f;
        for (int r = 0; r < n; ++r) {
          float v = 0;
          fill(&v, 1, r, static_cast<int>(5 + 3 * (me * count + i)));  // element me*count+i
          expect = op == ReduceOp::sum ? expect + v : std::max(expect, v);
        }
        ASSERT_EQ(part[i], expect) << count << " " << i;
      }
    }
  }
  std::vector<float> host(4);
  float* dev = device_floats(4 * n);
  EXPECT_THROW(
      collectives::nccl_allgather(comm, host.data(), dev, 4, DataType::float32, nullptr, false),
      InvalidArgument);
  EXPECT_THROW(collectives::nccl_reduce_scatter(comm, dev, host.data(), 4, DataType::float32,
                                                ReduceOp::sum, nullptr, false),
               InvalidArgument);
  if (n > 1) {
    const int before = fake_.reduce_scatters;
    float* a = device_floats(4 * n);
    if (me == 0) {
      EXPECT_THROW(collectives::nccl_allgather(comm, a, a, 4, DataType::float32, nullptr, false),
                   MismatchError);
    } else {
      EXPECT_THROW(collectives::nccl_reduce_scatter(comm, a, a, 4, DataType::float32, ReduceOp::sum,
                                                    nullptr, false),
                   MismatchError);
    }
    EXPECT_EQ(fake_.reduce_scatters, before);  // nothing reached NCCL
    collectives::nccl_allgather(comm, a, a, 4, DataType::float32, nullptr, false);  // usable
  }
}

// A negotiated float32 sum of `count` elements at `data`, in (fake) GPU memory on device 0.
NegotiatedCall device_call(const std::string& name, float* data, std::size_t count) {
  NegotiatedCall call;
  call.name = name;
  call.kind = NegotiatedKind::allreduce;
  call.signature = "allreduce float32 [" + std::to_string(count) + "] sum";
  call.data = data;
  call.count = count;
  call.device = true;
  call.gpu = 0;
  return call;
}

// The negotiator's GPU all-reduces (gradcomm.torch's Horovod API on CUDA tensors): ranks submit
// the names in different orders; a 64-byte fusion threshold makes fused buckets and tensors
// reduced alone; a joined rank stands in with neutral values; ranks that disagree on whether a
// name's tensor is in GPU memory get MismatchError on every rank.
TEST_F(GpuHostTest, NegotiatedDeviceAllreducesMatchTheSerialSum) {
  Config config = Config::from_environment();
  config.fusion_threshold = 64;
  Communicator comm(MPI_COMM_WORLD, config);
  const int n = comm.size(), me = comm.rank();
  Negotiator negotiator(comm);
  const std::vector<std::size_t> counts{1, 7, 1001, 3, 0, 16, 2};
  std::vector<float*> data(counts.size());
  std::vector<std::shared_ptr<NegotiatedState>> states(counts.size());
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const std::size_t k = me % 2 ? counts.size() - 1 - i : i;  // odd ranks in reverse
    data[k] = device_floats(counts[k] + 1);
    fill(data[k], counts[k], me, static_cast<int>(k));
    states[k] = negotiator.submit(device_call("t" + std::to_string(k), data[k], counts[k]));
  }
  for (std::size_t k = 0; k < counts.size(); ++k) {
    negotiator.wait(*states[k]);
    EXPECT_EQ(std::vector<float>(data[k], data[k] + counts[k]),
              expected_sum<float>(counts[k], n, static_cast<int>(k)))
        << k;
  }
  if (n > 1) {
    NegotiatedCall join;
    join.name = "join";
    join.kind = NegotiatedKind::join;
    join.signature = "join";
    if (me == n - 1) {
      negotiator.wait(*negotiator.submit(join));
    } else {
      float* mine = device_floats(100);
      fill(mine, 100, me, 9);
      negotiator.wait(*negotiator.submit(device_call("after-join", mine, 100)));
      EXPECT_EQ(std::vector<float>(mine, mine + 100), expected_sum<float>(100, n - 1, 9));
      negotiator.wait(*negotiator.submit(join));
    }
    float* odd = device_floats(5);
    NegotiatedCall call = device_call("host-or-device", odd, 5);
    call.device = me == 0;
    auto state = negotiator.submit(call);
    EXPECT_THROW(negotiator.wait(*state), MismatchError);
  }
  NegotiatedCall scaled = device_call("scaled", device_floats(1), 1);
  scaled.postscale = 0.5;
  EXPECT_THROW(negotiator.submit(scaled), InvalidArgument);
  NegotiatedCall nowhere = device_call("nowhere", device_floats(1), 1);
  nowhere.gpu = -1;
  EXPECT_THROW(negotiator.submit(nowhere), InvalidArgument);
  negotiator.close();
}

// A rank that joins before it made any GPU all-reduce (hvd.join(device), a rank without data
// from the start) stands in on the device its join names.
TEST_F(GpuHostTest, AJoinNamingItsDeviceStandsInBeforeAnyGpuAllreduce) {
  Communicator comm(MPI_COMM_WORLD);
  const int n = comm.size(), me = comm.rank();
  if (n < 2) GTEST_SKIP() << "needs a rank that joins and one that does not";
  Negotiator negotiator(comm);
  NegotiatedCall join;
  join.name = "join";
  join.kind = NegotiatedKind::join;
  join.signature = "join";
  join.gpu = 0;
  if (me == n - 1) {
    negotiator.wait(*negotiator.submit(join));
  } else {
    for (std::size_t count : {1ul, 1009ul}) {
      float* mine = device_floats(count);
      fill(mine, count, me, 3);
      negotiator.wait(
          *negotiator.submit(device_call("bucket" + std::to_string(count), mine, count)));
      EXPECT_EQ(std::vector<float>(mine, mine + count), expected_sum<float>(count, n - 1, 3));
    }
    negotiator.wait(*negotiator.submit(join));
  }
  negotiator.close();
}

TEST_F(GpuHostTest, NcclMatchesTheSerialSumOnEveryCount) {
  Communicator comm(MPI_COMM_WORLD);
  for (std::size_t count : {0ul, 1ul, 2ul, 3ul, 7ul, 13ul, 1000ul, 65537ul}) {
    float* send = device_floats(std::max<std::size_t>(count, 1));
    float* recv = device_floats(std::max<std::size_t>(count, 1));
    fill(send, count, comm.rank());
    allreduce(comm, send, recv, count, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
    EXPECT_EQ(std::vector<float>(recv, recv + count), expected_sum<float>(count, comm.size()))
        << count;
  }
}

// The GPU hierarchical schedule on emulated nodes, both ways across nodes, every op.
class GpuHierarchicalTest : public GpuHostTest,
                            public ::testing::WithParamInterface<std::tuple<int, std::string>> {};

TEST_P(GpuHierarchicalTest, MatchesTheSerialReduction) {
  const auto [ranks_per_node, inter_node] = GetParam();
  Config config = Config::from_environment();
  config.ranks_per_node = ranks_per_node;
  config.gpu_inter_node = inter_node;
  Communicator comm(MPI_COMM_WORLD, config);
  const int n = comm.size();
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max}) {
    for (std::size_t count : {1ul, 2ul, 5ul, 17ul, 1001ul}) {
      // int32 (exact for every op, including avg's truncation) and float64.
      auto* data = static_cast<std::int32_t*>(fake_.device_alloc(count * sizeof(std::int32_t)));
      fill(data, count, comm.rank(), static_cast<int>(count));
      allreduce(comm, data, data, count, DataType::int32, op, {.algorithm = "hierarchical"});
      for (std::size_t i = 0; i < count; ++i) {
        long long sum = 0, lo = 1 << 30, hi = -(1 << 30);
        for (int r = 0; r < n; ++r) {
          const long long v = static_cast<long long>((r * 7 + i * 3 + count) % 11) - 5;
          sum += v;
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        const long long want = op == ReduceOp::sum   ? sum
                               : op == ReduceOp::avg ? sum / n
                               : op == ReduceOp::min ? lo
                                                     : hi;
        ASSERT_EQ(data[i], want) << to_string(op) << " count " << count << " element " << i;
      }
      fake_.device_free(data);
    }
  }
  // Cross-group work happened where there are several even groups.
  const bool even = n % ranks_per_node == 0 && n > ranks_per_node;
  if (even && ranks_per_node > 1) {
    EXPECT_GT(fake_.reduce_scatters, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuHierarchicalTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values("nccl", "mpi")));

TEST_F(GpuHostTest, AStalledStreamTimesOutAndAbortsInsteadOfHanging) {
  Config config = Config::from_environment();
  config.timeout_seconds = 1;
  Communicator comm(MPI_COMM_WORLD, config);
  if (comm.size() == 1) GTEST_SKIP() << "one rank needs no NCCL communicator";
  float* data = device_floats(8);
  fake_.stall = true;
  try {
    allreduce(comm, data, data, 8, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("GRADCOMM_TIMEOUT=1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fake_.aborts, 1);
  fake_.stall = false;
  try {  // the communicator stays failed, clearly
    allreduce(comm, data, data, 8, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("aborted earlier"), std::string::npos) << e.what();
  }
  // An asynchronous NCCL error on a fresh communicator is reported, not waited out.
  Communicator second(MPI_COMM_WORLD, config);
  fake_.async_error = "unhandled system error: simulated";
  try {
    allreduce(second, data, data, 8, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("simulated"), std::string::npos) << e.what();
  }
  fake_.async_error.clear();
}

TEST_F(GpuHostTest, AsynchronousCallsReturnBeforeTheStreamIsDone) {
  Communicator comm(MPI_COMM_WORLD);
  float* data = device_floats(32);
  fill(data, 32, comm.rank());
  fake_.stall = true;  // the stream never finishes: only an asynchronous call can return
  allreduce(comm, data, data, 32, DataType::float32, ReduceOp::sum,
            {.algorithm = "nccl", .asynchronous = true});
  fake_.stall = false;
  EXPECT_EQ(std::vector<float>(data, data + 32), expected_sum<float>(32, comm.size()));
}

TEST_F(GpuHostTest, PackerRoundTripsDeviceTensorsAndRejectsMixedPlaces) {
  std::vector<std::size_t> sizes = {1000, 3, 4096, 17, 2500};
  std::vector<packing::TensorDesc> tensors;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    float* t = device_floats(sizes[i]);
    for (std::size_t k = 0; k < sizes[i]; ++k)
      t[k] = static_cast<float>(i * 10000 + k);
    tensors.push_back({t, sizes[i], DataType::float32});
  }
  for (gpu::CopyMethod method : {gpu::CopyMethod::kernel, gpu::CopyMethod::memcpy}) {
    packing::GradientPacker packer(
        tensors, {.num_split = 4, .min_chunk_elements = 1, .copy_method = method});
    ASSERT_FALSE(packer.declined());
    EXPECT_TRUE(packer.on_device());
    packer.pack();
    const auto& p = packer.packed()[0];
    EXPECT_EQ(fake_.classify(p.data).kind, gpu::MemoryKind::device);
    EXPECT_EQ(p.data[0], static_cast<const std::byte*>(tensors[0].data)[0]);
    for (auto& t : tensors)
      std::memset(t.data, 0, t.bytes());
    packer.unpack();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const float* t = static_cast<const float*>(tensors[i].data);
      for (std::size_t k = 0; k < sizes[i]; ++k)
        ASSERT_EQ(t[k], static_cast<float>(i * 10000 + k)) << i << " " << k;
    }
  }
  std::vector<float> host(100);
  std::vector<packing::TensorDesc> mixed = {tensors[0], {host.data(), 100, DataType::float32}};
  EXPECT_THROW(packing::GradientPacker(mixed, {.num_split = 1, .min_chunk_elements = 1}),
               InvalidArgument);
  Communicator comm(MPI_COMM_WORLD);
  EXPECT_THROW(grouped_allreduce(comm, tensors, ReduceOp::sum), Unsupported);
}

TEST_F(MpiTest, WithoutAGpuNcclIsUnavailableWithTheReason) {
  std::string why;
  if (gpu::runtime(&why)) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(collectives::nccl_unavailable_reason(), why);
  Communicator comm(MPI_COMM_WORLD);
  std::vector<float> data(8, 1.0f);
  try {
    allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum,
              {.algorithm = "nccl"});
    ADD_FAILURE() << "no error";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("nccl is unavailable: " + why), std::string::npos)
        << e.what();
  }
  // Everything else works; auto never goes near the GPU path.
  allreduce(comm, data.data(), data.data(), data.size(), DataType::float32, ReduceOp::sum);
  EXPECT_EQ(data[0], static_cast<float>(comm.size()));
}

}  // namespace
}  // namespace gradcomm
