// GPU tests against the real module (CUDA + NCCL): run where cudaGetDeviceCount reports a device,
// skipped with the reason everywhere else. Run at 1, 2 and 4 ranks. When ranks outnumber the
// visible devices (one test GPU), each rank gets its own NCCL_HOSTID so NCCL treats the ranks as
// separate hosts and connects them over its socket transport, instead of refusing two ranks on
// one device; the data path is the same ncclAllReduce.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/broadcast.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/half.h"
#include "packing/gradient_packer.h"
#include "tests/mpi_test.h"
#include "topology/topology.h"

namespace gradcomm {
namespace {

using testing::load;
using testing::MpiTest;
using testing::store;

// Skips unless a device is usable; picks this rank's device once.
gpu::Runtime* gpu_or_skip(std::string* why) {
  static gpu::Runtime* runtime = nullptr;
  static std::string reason;
  static bool done = false;
  if (!done) {
    done = true;
    runtime = gpu::runtime(&reason);
    if (runtime) {
      Communicator& world = testing::world();
      const int local = topology::topology_of(world).local_rank();
      const int local_size = topology::topology_of(world).local_size();
      if (runtime->device_count() < local_size) {
        const std::string host_id = "gradcomm-test-rank-" + std::to_string(world.rank());
        setenv("NCCL_HOSTID", host_id.c_str(), 0);
      }
      runtime->set_device(gpu::pick_device(*runtime, world.config().device, local));
    }
  }
  *why = reason;
  return runtime;
}

#define REQUIRE_GPU()                                 \
  std::string why_no_gpu;                             \
  gpu::Runtime* gpu = gpu_or_skip(&why_no_gpu);       \
  if (!gpu) GTEST_SKIP() << "no GPU: " << why_no_gpu; \
  (void)gpu

double value(ReduceOp op, int rank, std::size_t i) {
  if (op == ReduceOp::prod) return ((rank + i) % 3 == 0) ? -1.0 : 1.0;
  return static_cast<double>(static_cast<long long>((rank * 5 + i) % 13) - 6);
}

double reference(ReduceOp op, DataType dtype, int n, std::size_t i) {
  double acc = value(op, 0, i);
  for (int r = 1; r < n; ++r) {
    const double v = value(op, r, i);
    if (op == ReduceOp::sum || op == ReduceOp::avg) acc += v;
    if (op == ReduceOp::prod) acc *= v;
    if (op == ReduceOp::min) acc = std::min(acc, v);
    if (op == ReduceOp::max) acc = std::max(acc, v);
  }
  if (op == ReduceOp::avg) acc = is_floating(dtype) ? acc / n : std::trunc(acc / n);
  return acc;
}

struct DeviceBuffer {
  DeviceBuffer(gpu::Runtime* runtime, std::size_t bytes)
      : runtime(runtime), data(runtime->device_alloc(std::max<std::size_t>(bytes, 16))) {}
  ~DeviceBuffer() { runtime->device_free(data); }
  gpu::Runtime* runtime;
  void* data;
};

// Fills, reduces with `options`, reads back and counts wrong elements on this rank.
long long run_and_count_wrong(gpu::Runtime* gpu, Communicator& comm, DataType dtype, ReduceOp op,
                              std::size_t count, bool in_place, const AllreduceOptions& options) {
  const std::size_t bytes = count * element_size(dtype);
  std::vector<std::byte> host(std::max<std::size_t>(bytes, 1));
  for (std::size_t i = 0; i < count; ++i)
    store(dtype, host.data(), i, value(op, comm.rank(), i));
  DeviceBuffer send(gpu, bytes), recv(gpu, bytes);
  gpu->copy_async(send.data, host.data(), bytes, nullptr);
  gpu->stream_synchronize(nullptr);
  void* out = in_place ? send.data : recv.data;
  allreduce(comm, send.data, out, count, dtype, op, options);
  if (options.asynchronous) gpu->stream_synchronize(options.stream);
  gpu->copy_async(host.data(), out, bytes, nullptr);
  gpu->stream_synchronize(nullptr);
  long long wrong = 0;
  // NCCL's float avg multiplies by 1/n before summing: allow its rounding; all else is exact.
  const bool approximate = op == ReduceOp::avg && is_floating(dtype);
  const double tolerance = dtype == DataType::float16 || dtype == DataType::bfloat16 ? 2e-2 : 1e-5;
  for (std::size_t i = 0; i < count; ++i) {
    const double want = reference(op, dtype, comm.size(), i);
    const double got = load(dtype, host.data(), i);
    const bool ok = approximate ? std::abs(got - want) <= tolerance * std::max(1.0, std::abs(want))
                                : got == want;
    if (!ok && wrong++ < 3) {
      ADD_FAILURE() << to_string(dtype) << " " << to_string(op) << " count " << count << " [" << i
                    << "]: got " << got << " want " << want;
    }
  }
  return wrong;
}

constexpr std::size_t kCounts[] = {1, 2, 7, 1031, 65536, (std::size_t{1} << 20) + 3};

TEST_F(MpiTest, NcclMatchesTheHostReferenceForEveryDtypeOpAndCount) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  for (DataType dtype : kAllDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      for (std::size_t count : kCounts) {
        for (bool in_place : {false, true}) {
          EXPECT_EQ(
              run_and_count_wrong(gpu, comm, dtype, op, count, in_place, {.algorithm = "nccl"}), 0);
        }
      }
    }
  }
}

TEST_F(MpiTest, AutoPicksNcclForDeviceBuffersAndStreamsWork) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  void* stream = gpu->stream_create();
  for (std::size_t count : kCounts) {
    EXPECT_EQ(run_and_count_wrong(gpu, comm, DataType::float32, ReduceOp::sum, count, false, {}),
              0);
    EXPECT_EQ(run_and_count_wrong(gpu, comm, DataType::float32, ReduceOp::sum, count, true,
                                  {.stream = stream, .asynchronous = true}),
              0);
  }
  gpu->stream_destroy(stream);
}

// A request on device buffers wraps the stream: it finishes once the stream has passed the
// all-reduce, its result equals the blocking call's bit for bit, and several may be in flight.
TEST_F(MpiTest, IallreduceOnDeviceBuffersEqualsTheBlockingCall) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  void* stream = gpu->stream_create();
  for (std::size_t count : kCounts) {
    const std::size_t bytes = count * sizeof(float);
    std::vector<float> host(count);
    for (std::size_t i = 0; i < count; ++i)
      host[i] = static_cast<float>(value(ReduceOp::sum, comm.rank(), i)) * 0.37f;
    DeviceBuffer a(gpu, bytes), b(gpu, bytes);
    gpu->copy_async(a.data, host.data(), bytes, nullptr);
    gpu->copy_async(b.data, host.data(), bytes, nullptr);
    gpu->stream_synchronize(nullptr);
    allreduce(comm, a.data, a.data, count, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
    Request r = iallreduce(comm, b.data, b.data, count, DataType::float32, ReduceOp::sum,
                           {.algorithm = "nccl", .stream = stream});
    r.wait();  // no stream synchronisation needed after it
    std::vector<float> want(count), got(count);
    gpu->copy_async(want.data(), a.data, bytes, nullptr);
    gpu->copy_async(got.data(), b.data, bytes, nullptr);
    gpu->stream_synchronize(nullptr);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), bytes), 0) << "count " << count;
  }
  gpu->stream_destroy(stream);
}

// Device requests on two streams, host requests between them on the same communicator, all in
// flight at once and waited on in the reverse order: each equals its blocking call bit for bit.
TEST_F(MpiTest, ManyDeviceAndHostRequestsInFlightFinishInAnyWaitOrder) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  void* streams[2] = {gpu->stream_create(), gpu->stream_create()};
  struct Case {
    std::size_t count;
    std::unique_ptr<DeviceBuffer> device, reference;
    std::vector<float> host, host_reference;
  };
  std::vector<Case> cases;
  for (std::size_t count : kCounts) {
    Case c{count,
           std::make_unique<DeviceBuffer>(gpu, count * sizeof(float)),
           std::make_unique<DeviceBuffer>(gpu, count * sizeof(float)),
           {},
           {}};
    c.host.resize(count);
    for (std::size_t i = 0; i < count; ++i)
      c.host[i] = static_cast<float>(value(ReduceOp::sum, comm.rank(), i + count)) * 0.29f;
    c.host_reference = c.host;
    gpu->copy_async(c.device->data, c.host.data(), count * sizeof(float), nullptr);
    gpu->copy_async(c.reference->data, c.host.data(), count * sizeof(float), nullptr);
    cases.push_back(std::move(c));
  }
  gpu->stream_synchronize(nullptr);
  for (Case& c : cases) {  // the blocking references
    allreduce(comm, c.reference->data, c.reference->data, c.count, DataType::float32, ReduceOp::sum,
              {.algorithm = "nccl"});
    allreduce(comm, c.host_reference.data(), c.host_reference.data(), c.count, DataType::float32,
              ReduceOp::sum, {.algorithm = "ring"});
  }
  std::vector<Request> requests;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    Case& c = cases[k];
    requests.push_back(
        iallreduce(comm, c.device->data, c.device->data, c.count, DataType::float32, ReduceOp::sum,
                   {.algorithm = k % 2 ? "nccl" : "auto", .stream = streams[k % 2]}));
    requests.push_back(iallreduce(comm, c.host.data(), c.host.data(), c.count, DataType::float32,
                                  ReduceOp::sum, {.algorithm = "ring"}));
  }
  for (auto r = requests.rbegin(); r != requests.rend(); ++r)
    r->wait();
  for (Case& c : cases) {
    const std::size_t bytes = c.count * sizeof(float);
    std::vector<float> want(c.count), got(c.count);
    gpu->copy_async(want.data(), c.reference->data, bytes, nullptr);
    gpu->copy_async(got.data(), c.device->data, bytes, nullptr);
    gpu->stream_synchronize(nullptr);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), bytes), 0) << "device, count " << c.count;
    EXPECT_EQ(std::memcmp(c.host_reference.data(), c.host.data(), bytes), 0)
        << "host, count " << c.count;
  }
  for (void* s : streams)
    gpu->stream_destroy(s);
}

// Dropping a request that has not finished waits for it: the buffer holds the sum afterwards.
TEST_F(MpiTest, DestroyingAnUnfinishedDeviceRequestWaitsForIt) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  void* stream = gpu->stream_create();
  const std::size_t count = (std::size_t{1} << 22) + 5;
  std::vector<float> host(count, static_cast<float>(comm.rank() + 1));
  DeviceBuffer data(gpu, count * sizeof(float));
  gpu->copy_async(data.data, host.data(), count * sizeof(float), nullptr);
  gpu->stream_synchronize(nullptr);
  {
    Request r = iallreduce(comm, data.data, data.data, count, DataType::float32, ReduceOp::sum,
                           {.algorithm = "nccl", .stream = stream});
  }  // destroyed unfinished (most likely): it must wait, not leak or crash
  gpu->copy_async(host.data(), data.data, count * sizeof(float), nullptr);
  gpu->stream_synchronize(nullptr);
  const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  long long wrong = 0;
  for (float v : host)
    wrong += v != want;
  EXPECT_EQ(wrong, 0);
  gpu->stream_destroy(stream);
}

// broadcast and ibroadcast take device buffers (staged through pinned host memory), also when
// only some ranks' buffers are on the GPU; pieces beyond the staging buffer's 64 MiB too.
TEST_F(MpiTest, BroadcastOfDeviceBuffersEqualsTheRootsData) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  for (std::size_t count :
       {std::size_t{0}, std::size_t{1}, std::size_t{1031}, (std::size_t{1} << 24) + 7}) {
    for (int root : {0, comm.size() - 1}) {
      for (bool non_blocking : {false, true}) {
        const std::size_t bytes = count * sizeof(std::int32_t);
        std::vector<std::int32_t> host(count);
        for (std::size_t i = 0; i < count; ++i)
          host[i] = static_cast<std::int32_t>(i * 7 + 1000 * comm.rank() + root);
        // Odd ranks keep theirs in host memory: each rank's buffer lives where it likes.
        const bool on_device = comm.rank() % 2 == 0;
        DeviceBuffer device(gpu, bytes);
        void* buffer = on_device ? device.data : static_cast<void*>(host.data());
        if (on_device) {
          gpu->copy_async(device.data, host.data(), bytes, nullptr);
          gpu->stream_synchronize(nullptr);
        }
        if (non_blocking) {
          ibroadcast(comm, buffer, count, DataType::int32, root).wait();
        } else {
          broadcast(comm, buffer, count, DataType::int32, root);
        }
        if (on_device) {
          gpu->copy_async(host.data(), device.data, bytes, nullptr);
          gpu->stream_synchronize(nullptr);
        }
        long long wrong = 0;
        for (std::size_t i = 0; i < count; ++i)
          wrong += host[i] != static_cast<std::int32_t>(i * 7 + 1000 * root + root);
        EXPECT_EQ(wrong, 0) << "count " << count << " root " << root << " non-blocking "
                            << non_blocking;
      }
    }
  }
}

TEST_F(MpiTest, GpuHierarchicalMatchesTheHostReference) {
  REQUIRE_GPU();
  for (int ranks_per_node : {1, 2}) {
    for (const char* inter : {"nccl", "mpi"}) {
      Config config = Config::from_environment();
      config.ranks_per_node = ranks_per_node;
      config.gpu_inter_node = inter;
      Communicator comm(MPI_COMM_WORLD, config);
      for (DataType dtype : {DataType::float32, DataType::int32, DataType::bfloat16}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          for (std::size_t count : kCounts) {
            EXPECT_EQ(run_and_count_wrong(gpu, comm, dtype, op, count, count % 2 == 0,
                                          {.algorithm = "hierarchical"}),
                      0)
                << "ranks_per_node " << ranks_per_node << " inter " << inter;
          }
        }
      }
    }
  }
}

TEST_F(MpiTest, NcclCommunicatorIsCreatedOnceAndFreedWithTheCommunicator) {
  REQUIRE_GPU();
  const collectives::NcclCommCounts before = collectives::nccl_comm_counts();
  {
    Communicator comm(MPI_COMM_WORLD);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(run_and_count_wrong(gpu, comm, DataType::float32, ReduceOp::sum, 1000, false,
                                    {.algorithm = "nccl"}),
                0);
    }
    const long created = collectives::nccl_comm_counts().created - before.created;
    EXPECT_EQ(created, comm.size() > 1 ? 1 : 0);
  }
  const collectives::NcclCommCounts after = collectives::nccl_comm_counts();
  EXPECT_EQ(after.destroyed - before.destroyed, after.created - before.created);
  EXPECT_EQ(after.aborted, before.aborted);
}

TEST_F(MpiTest, PointerKindsAreCheckedWithRealMemory) {
  REQUIRE_GPU();
  Communicator comm(MPI_COMM_WORLD);
  DeviceBuffer device(gpu, 256 * sizeof(float));
  EXPECT_EQ(gpu->classify(device.data).kind, gpu::MemoryKind::device);
  EXPECT_THROW(allreduce(comm, device.data, device.data, 256, DataType::float32, ReduceOp::sum,
                         {.algorithm = "ring"}),
               InvalidArgument);
  std::vector<float> host(256, 1.0f);
  EXPECT_EQ(gpu->classify(host.data()).kind, gpu::MemoryKind::host);
  EXPECT_THROW(allreduce(comm, host.data(), host.data(), 256, DataType::float32, ReduceOp::sum,
                         {.algorithm = "nccl"}),
               InvalidArgument);
  void* pinned = gpu->host_alloc_pinned(256 * sizeof(float));
  EXPECT_EQ(gpu->classify(pinned).kind, gpu::MemoryKind::host);
  EXPECT_THROW(
      allreduce(comm, pinned, pinned, 256, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"}),
      InvalidArgument);
  // Pinned host memory is host memory: the host algorithms take it.
  std::memset(pinned, 0, 256 * sizeof(float));
  allreduce(comm, pinned, pinned, 256, DataType::float32, ReduceOp::sum);
  gpu->host_free_pinned(pinned);
}

TEST_F(MpiTest, DevicePackerRoundTripsWithBothCopyMethods) {
  REQUIRE_GPU();
  // Odd sizes and float16 tensors: unaligned copies too.
  const std::vector<std::pair<std::size_t, DataType>> shapes = {
      {64, DataType::float32},      {3, DataType::float16},  {147456, DataType::float32},
      {1000003, DataType::float32}, {17, DataType::float16}, {2048, DataType::float32},
      {513, DataType::float16},     {1, DataType::float32},  {65537, DataType::float16}};
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<packing::TensorDesc> tensors;
  std::vector<std::vector<std::byte>> originals;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    const std::size_t bytes = shapes[t].first * element_size(shapes[t].second);
    buffers.push_back(std::make_unique<DeviceBuffer>(gpu, bytes));
    std::vector<std::byte> host(bytes);
    for (std::size_t b = 0; b < bytes; ++b)
      host[b] = static_cast<std::byte>((b * 31 + t * 7) & 0xff);
    gpu->copy_async(buffers.back()->data, host.data(), bytes, nullptr);
    originals.push_back(std::move(host));
    tensors.push_back({buffers.back()->data, shapes[t].first, shapes[t].second});
  }
  gpu->stream_synchronize(nullptr);
  for (gpu::CopyMethod method : {gpu::CopyMethod::kernel, gpu::CopyMethod::memcpy}) {
    packing::GradientPacker packer(
        tensors, {.num_split = 2, .min_chunk_elements = 1, .copy_method = method});
    ASSERT_TRUE(packer.on_device());
    packer.pack();
    for (auto& b : buffers) {  // clobber the tensors, then restore them from the packed copy
      std::vector<std::byte> zeros(64, std::byte{0});
      gpu->copy_async(b->data, zeros.data(), 1, nullptr);
    }
    packer.unpack();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      std::vector<std::byte> back(originals[t].size());
      gpu->copy_async(back.data(), tensors[t].data, back.size(), nullptr);
      gpu->stream_synchronize(nullptr);
      ASSERT_EQ(back, originals[t]) << "tensor " << t;
    }
    // The packed buffer holds the tensors back to back, per dtype.
    for (const auto& p : packer.packed()) {
      const std::size_t es = element_size(p.dtype);
      for (std::size_t k = 0; k < p.tensors.size(); ++k) {
        const auto& original = originals[p.tensors[k]];
        std::vector<std::byte> slice(original.size());
        gpu->copy_async(slice.data(), p.data + p.offsets[k] * es, slice.size(), nullptr);
        gpu->stream_synchronize(nullptr);
        ASSERT_EQ(slice, original);
      }
    }
  }
}

// A rank that never joins: the others give up after GRADCOMM_TIMEOUT, abort their NCCL
// communicator and throw CommError naming the timeout, instead of hanging. With the call check
// on (the default), the check's fingerprint wait notices first and the watchdog reports which
// rank never arrived and ends the job (exit code 70), as for host buffers; with it off, as here,
// the NCCL wait's own deadline is what stops the call. `stalled` makes the call rank 0 never
// makes (on 1024 floats of device memory).
void expect_missing_rank_times_out(gpu::Runtime* gpu,
                                   const std::function<void(Communicator&, void*)>& stalled) {
  Config config = Config::from_environment();
  config.timeout_seconds = 3;
  config.check = CheckMode::off;
  auto comm = std::make_unique<Communicator>(MPI_COMM_WORLD, config);
  if (comm->size() == 1) GTEST_SKIP() << "needs two ranks";
  EXPECT_EQ(run_and_count_wrong(gpu, *comm, DataType::float32, ReduceOp::sum, 1024, true,
                                {.algorithm = "nccl"}),
            0);  // the NCCL communicator exists on every rank
  const collectives::NcclCommCounts before = collectives::nccl_comm_counts();
  if (comm->rank() != 0) {
    DeviceBuffer data(gpu, 1024 * sizeof(float));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      stalled(*comm, data.data);
      ADD_FAILURE() << "no error";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("GRADCOMM_TIMEOUT=3"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 2.5);
    EXPECT_LT(waited, 30.0);
    EXPECT_EQ(collectives::nccl_comm_counts().aborted - before.aborted, 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  comm.reset();  // rank 0's communicator, whose peers are gone, is freed within a bounded time
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(MpiTest, AMissingRankTimesOutAndAbortsTheNcclCommunicator) {
  REQUIRE_GPU();
  expect_missing_rank_times_out(gpu, [](Communicator& comm, void* data) {
    allreduce(comm, data, data, 1024, DataType::float32, ReduceOp::sum, {.algorithm = "nccl"});
  });
}

// The same through a request on a stream: wait() throws the timeout on every rank that
// submitted, and nothing hangs.
TEST_F(MpiTest, ARequestWhosePeerNeverSubmitsTimesOutFromWait) {
  REQUIRE_GPU();
  void* stream = gpu->stream_create();
  expect_missing_rank_times_out(gpu, [stream](Communicator& comm, void* data) {
    iallreduce(comm, data, data, 1024, DataType::float32, ReduceOp::sum,
               {.algorithm = "nccl", .stream = stream})
        .wait();
  });
  gpu->stream_destroy(stream);
}

}  // namespace
}  // namespace gradcomm
