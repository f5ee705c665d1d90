// The C ABI's non-blocking calls on GPU buffers (libgradcomm.so, as a C user links it):
// gradcomm_iallreduce with and without a cudaStream_t, gradcomm_ibroadcast, test/wait/free, and
// bad input refused at submission. Device memory comes from the GPU module itself (dlopen'ed, as
// the library loads it), so this test links neither CUDA nor gradcomm's static libraries. Skipped,
// with the reason, where the module or a device is missing. Run at 1, 2 and 4 ranks.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/c/gradcomm.h"
#include "core/gpu_runtime.h"

namespace {

gradcomm_comm g_comm = nullptr;
int g_rank = 0, g_size = 1;

// The GPU module's runtime, for device memory and streams: nullptr with `why` where none.
gradcomm::gpu::Runtime* device_runtime(std::string* why) {
  static gradcomm::gpu::Runtime* runtime = nullptr;
  static std::string reason;
  static bool done = false;
  if (!done) {
    done = true;
    const char* path = std::getenv("GRADCOMM_NCCL_MODULE");
    if (!path || !*path) path = GRADCOMM_TEST_NCCL_MODULE;
    void* handle = *path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (!handle) {
      reason = std::string("cannot load the GPU module '") + path + "'" +
               (*path ? std::string(": ") + dlerror() : std::string());
    } else if (auto create = reinterpret_cast<gradcomm_gpu_module_fn>(
                   dlsym(handle, GRADCOMM_GPU_MODULE_SYMBOL));
               !create) {
      reason = "the GPU module has no " GRADCOMM_GPU_MODULE_SYMBOL;
    } else {
      char buffer[512] = {};
      runtime = create(gradcomm::gpu::kRuntimeAbiVersion, buffer, sizeof(buffer));
      if (!runtime) reason = buffer;
    }
    if (runtime) {
      const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
      runtime->set_device((local ? std::atoi(local) : 0) % runtime->device_count());
    }
  }
  *why = reason;
  return runtime;
}

#define REQUIRE_GPU()                                        \
  std::string why_no_gpu;                                    \
  gradcomm::gpu::Runtime* gpu = device_runtime(&why_no_gpu); \
  if (!gpu) GTEST_SKIP() << "no GPU: " << why_no_gpu;        \
  (void)gpu

struct DeviceBuffer {
  DeviceBuffer(gradcomm::gpu::Runtime* runtime, std::size_t bytes)
      : runtime(runtime), data(runtime->device_alloc(bytes > 16 ? bytes : 16)) {}
  ~DeviceBuffer() { runtime->device_free(data); }
  gradcomm::gpu::Runtime* runtime;
  void* data;
};

float value(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((rank * 3 + i) % 11) - 5);
}

float sum_over_ranks(std::size_t i) {
  float s = 0;
  for (int r = 0; r < g_size; ++r)
    s += value(r, i);
  return s;
}

// Polls with gradcomm_request_test (never blocks), sleeping between polls, then frees.
gradcomm_status poll_until_done(gradcomm_request request) {
  int done = 0;
  gradcomm_status status = GRADCOMM_SUCCESS;
  while (!done) {
    status = gradcomm_request_test(request, &done);
    if (status != GRADCOMM_SUCCESS) break;
    if (!done) usleep(100);
  }
  EXPECT_EQ(gradcomm_request_free(request), GRADCOMM_SUCCESS);
  return status;
}

TEST(CAbiGpu, IallreduceOrdersDeviceWorkOnTheGivenStream) {
  REQUIRE_GPU();
  void* stream = gpu->stream_create();
  for (std::size_t count :
       {std::size_t{1}, std::size_t{7}, std::size_t{65537}, (std::size_t{1} << 21) + 3}) {
    for (bool in_place : {true, false}) {
      for (bool with_stream : {true, false}) {
        const std::size_t bytes = count * sizeof(float);
        std::vector<float> host(count);
        for (std::size_t i = 0; i < count; ++i)
          host[i] = value(g_rank, i);
        DeviceBuffer send(gpu, bytes), recv(gpu, bytes);
        gpu->copy_async(send.data, host.data(), bytes, nullptr);
        gpu->stream_synchronize(nullptr);
        void* out = in_place ? send.data : recv.data;
        gradcomm_request request = nullptr;
        ASSERT_EQ(gradcomm_iallreduce(g_comm, send.data, out, count, GRADCOMM_FLOAT32, GRADCOMM_SUM,
                                      with_stream ? "nccl" : "auto", with_stream ? stream : nullptr,
                                      &request),
                  GRADCOMM_SUCCESS)
            << gradcomm_last_error();
        ASSERT_EQ(poll_until_done(request), GRADCOMM_SUCCESS) << gradcomm_last_error();
        // Finished means the stream has passed the all-reduce: no synchronisation needed.
        gpu->copy_async(host.data(), out, bytes, nullptr);
        gpu->stream_synchronize(nullptr);
        long long wrong = 0;
        for (std::size_t i = 0; i < count; ++i)
          wrong += host[i] != sum_over_ranks(i);
        EXPECT_EQ(wrong, 0) << "count " << count << " in place " << in_place << " stream "
                            << with_stream;
      }
    }
  }
  gpu->stream_destroy(stream);
}

TEST(CAbiGpu, FreeingAnUnfinishedDeviceRequestWaitsForIt) {
  REQUIRE_GPU();
  const std::size_t count = (std::size_t{1} << 22) + 1;
  std::vector<float> host(count, 2.0f);
  DeviceBuffer data(gpu, count * sizeof(float));
  gpu->copy_async(data.data, host.data(), count * sizeof(float), nullptr);
  gpu->stream_synchronize(nullptr);
  gradcomm_request request = nullptr;
  ASSERT_EQ(gradcomm_iallreduce(g_comm, data.data, data.data, count, GRADCOMM_FLOAT32, GRADCOMM_AVG,
                                "nccl", nullptr, &request),
            GRADCOMM_SUCCESS)
      << gradcomm_last_error();
  ASSERT_EQ(gradcomm_request_free(request), GRADCOMM_SUCCESS);
  gpu->copy_async(host.data(), data.data, count * sizeof(float), nullptr);
  gpu->stream_synchronize(nullptr);
  long long wrong = 0;
  for (float v : host)
    wrong += v != 2.0f;
  EXPECT_EQ(wrong, 0);
}

TEST(CAbiGpu, BadInputIsRefusedAtSubmissionAndNothingRuns) {
  REQUIRE_GPU();
  DeviceBuffer data(gpu, 64 * sizeof(float));
  gradcomm_request request = nullptr;
  // A host algorithm cannot read GPU memory: refused here, on every rank, before any traffic.
  EXPECT_EQ(gradcomm_iallreduce(g_comm, data.data, data.data, 64, GRADCOMM_FLOAT32, GRADCOMM_SUM,
                                "ring", nullptr, &request),
            GRADCOMM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gradcomm_last_error()).find("device"), std::string::npos)
      << gradcomm_last_error();
  EXPECT_EQ(request, nullptr);
  // Host memory given to nccl.
  std::vector<float> host(64, 1.0f);
  EXPECT_EQ(gradcomm_iallreduce(g_comm, host.data(), host.data(), 64, GRADCOMM_FLOAT32,
                                GRADCOMM_SUM, "nccl", nullptr, &request),
            GRADCOMM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(request, nullptr);
  // Nothing was submitted: the next collective pairs up across ranks.
  ASSERT_EQ(gradcomm_iallreduce(g_comm, host.data(), host.data(), 64, GRADCOMM_FLOAT32,
                                GRADCOMM_SUM, nullptr, nullptr, &request),
            GRADCOMM_SUCCESS);
  EXPECT_EQ(gradcomm_request_wait(request), GRADCOMM_SUCCESS) << gradcomm_last_error();
  EXPECT_EQ(gradcomm_request_free(request), GRADCOMM_SUCCESS);
  EXPECT_EQ(host[63], static_cast<float>(g_size));
}

TEST(CAbiGpu, IbroadcastOfADeviceBuffer) {
  REQUIRE_GPU();
  const std::size_t count = 100003;
  const int root = g_size - 1;
  std::vector<std::int64_t> host(count);
  for (std::size_t i = 0; i < count; ++i)
    host[i] = static_cast<std::int64_t>(i) * (g_rank + 1);
  DeviceBuffer data(gpu, count * sizeof(std::int64_t));
  gpu->copy_async(data.data, host.data(), count * sizeof(std::int64_t), nullptr);
  gpu->stream_synchronize(nullptr);
  gradcomm_request request = nullptr;
  ASSERT_EQ(gradcomm_ibroadcast(g_comm, data.data, count, GRADCOMM_INT64, root, &request),
            GRADCOMM_SUCCESS)
      << gradcomm_last_error();
  ASSERT_EQ(gradcomm_request_wait(request), GRADCOMM_SUCCESS) << gradcomm_last_error();
  EXPECT_EQ(gradcomm_request_free(request), GRADCOMM_SUCCESS);
  gpu->copy_async(host.data(), data.data, count * sizeof(std::int64_t), nullptr);
  gpu->stream_synchronize(nullptr);
  long long wrong = 0;
  for (std::size_t i = 0; i < count; ++i)
    wrong += host[i] != static_cast<std::int64_t>(i) * (root + 1);
  EXPECT_EQ(wrong, 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (gradcomm_init(&argc, &argv) != GRADCOMM_SUCCESS) {
    std::fprintf(stderr, "gradcomm_init: %s\n", gradcomm_last_error());
    return 1;
  }
  // Ranks that share one GPU: NCCL refuses two ranks on one device of one host, so each rank
  // names its own host and NCCL connects them over its socket transport (as test_gpu does).
  if (const char* rank = std::getenv("OMPI_COMM_WORLD_RANK")) {
    setenv("NCCL_HOSTID", (std::string("gradcomm-test-c-rank-") + rank).c_str(), 0);
  }
  testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  if (gradcomm_comm_create_world(&g_comm) == GRADCOMM_SUCCESS &&
      gradcomm_comm_rank(g_comm, &g_rank) == GRADCOMM_SUCCESS &&
      gradcomm_comm_size(g_comm, &g_size) == GRADCOMM_SUCCESS) {
    rc = RUN_ALL_TESTS();
    if (gradcomm_comm_free(g_comm) != GRADCOMM_SUCCESS) rc = 1;
  } else {
    std::fprintf(stderr, "gradcomm_comm_create_world: %s\n", gradcomm_last_error());
  }
  gradcomm_finalize();
  return rc;
}
