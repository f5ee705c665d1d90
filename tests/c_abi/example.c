/* A C11 program using only gradcomm.h, built with plain gcc against the installed tree and run
 * under mpirun: all-reduce (every algorithm, exact check), grouped all-reduce, broadcast, the
 * packer, byte counters, and rejected input (status, message, still usable afterwards). With
 * GRADCOMM_TEST_MPI it also wraps MPI_COMM_WORLD through its Fortran handle. Prints "c abi: ok"
 * on rank 0 and exits 0 when every rank passed. */
#include <gradcomm.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef GRADCOMM_TEST_MPI
#include <mpi.h>
#endif

static int failures = 0;
static int my_rank = 0;

#define CHECK(cond)                                                                             \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      fprintf(stderr, "rank %d: %s:%d: check failed: %s (last error: %s)\n", my_rank, __FILE__, \
              __LINE__, #cond, gradcomm_last_error());                                          \
      ++failures;                                                                               \
    }                                                                                           \
  } while (0)

int main(int argc, char** argv) {
  CHECK(gradcomm_init(&argc, &argv) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_version() == GRADCOMM_VERSION);
  gradcomm_comm comm = NULL;
#ifdef GRADCOMM_TEST_MPI
  CHECK(gradcomm_comm_create_from_fortran((int64_t)MPI_Comm_c2f(MPI_COMM_WORLD), &comm) ==
        GRADCOMM_SUCCESS);
#else
  CHECK(gradcomm_comm_create_world(&comm) == GRADCOMM_SUCCESS);
#endif
  int size = 0;
  CHECK(gradcomm_comm_rank(comm, &my_rank) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_comm_size(comm, &size) == GRADCOMM_SUCCESS);

  /* All-reduce: x[i] = rank + i % 7, so the sum is size * (size - 1) / 2 + size * (i % 7). */
  const char* algorithms[] = {NULL,   "auto",         "ring", "halving_doubling",
                              "flat", "hierarchical", "shm",  "mpi"};
  const size_t counts[] = {0, 1, 13, 1000003};
  const size_t n = 1000003;
  float* x = malloc(n * sizeof *x);
  float* y = malloc(n * sizeof *y);
  for (size_t a = 0; a < sizeof algorithms / sizeof *algorithms; ++a) {
    for (size_t c = 0; c < sizeof counts / sizeof *counts; ++c) {
      for (size_t i = 0; i < counts[c]; ++i)
        x[i] = (float)(my_rank + (int)(i % 7));
      CHECK(gradcomm_allreduce(comm, x, y, counts[c], GRADCOMM_FLOAT32, GRADCOMM_SUM,
                               algorithms[a]) == GRADCOMM_SUCCESS);
      size_t wrong = 0;
      for (size_t i = 0; i < counts[c]; ++i) {
        wrong += y[i] != (float)(size * (size - 1) / 2 + size * (int)(i % 7));
      }
      CHECK(wrong == 0);
    }
  }
  int64_t big = my_rank * 1000;
  CHECK(gradcomm_allreduce(comm, &big, &big, 1, GRADCOMM_INT64, GRADCOMM_MAX, "ring") ==
        GRADCOMM_SUCCESS);
  CHECK(big == (int64_t)(size - 1) * 1000);

  /* Rejected input: a status, a message naming the problem, no communication, still usable. */
  CHECK(gradcomm_allreduce(comm, x, y, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, "nope") ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "unknown algorithm 'nope'") != NULL);
  CHECK(gradcomm_allreduce(NULL, x, y, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "comm is NULL") != NULL);
  CHECK(gradcomm_allreduce(comm, NULL, y, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "sendbuf is null") != NULL);
  CHECK(gradcomm_allreduce(comm, x, y, 4, (gradcomm_dtype)42, GRADCOMM_SUM, NULL) ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "invalid dtype 42") != NULL);
  CHECK(gradcomm_allreduce(comm, x, y, 4, GRADCOMM_FLOAT32, (gradcomm_op)9, NULL) ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "invalid reduce op 9") != NULL);
  /* A negative count converted to size_t. */
  CHECK(gradcomm_allreduce(comm, x, y, (size_t)-1, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
        GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "overflows size_t") != NULL);
  CHECK(gradcomm_comm_rank(NULL, &my_rank) == GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(gradcomm_packer_pack(NULL) == GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "packer is NULL") != NULL);
  CHECK(gradcomm_broadcast(comm, x, 4, GRADCOMM_FLOAT32, size) == GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gradcomm_last_error(), "root") != NULL);
  CHECK(strcmp(gradcomm_error_string(GRADCOMM_ERROR_INVALID_ARGUMENT), "invalid argument") == 0);
  CHECK(gradcomm_comm_rank(comm, &my_rank) == GRADCOMM_SUCCESS);
  CHECK(strcmp(gradcomm_last_error(), "") == 0);

  /* Grouped all-reduce of mixed dtypes, average. */
  float a[5];
  double b[1000];
  int32_t d[3];
  for (int i = 0; i < 5; ++i)
    a[i] = (float)(2 * my_rank + i);
  for (int i = 0; i < 1000; ++i)
    b[i] = 4.0 * my_rank + i;
  for (int i = 0; i < 3; ++i)
    d[i] = 10 * my_rank;
  void* buffers[] = {a, b, d};
  size_t group_counts[] = {5, 1000, 3};
  gradcomm_dtype dtypes[] = {GRADCOMM_FLOAT32, GRADCOMM_FLOAT64, GRADCOMM_INT32};
  CHECK(gradcomm_grouped_allreduce(comm, buffers, group_counts, dtypes, 3, GRADCOMM_SUM, NULL,
                                   64) == GRADCOMM_SUCCESS);
  CHECK(a[4] == (float)(size * (size - 1) + 4 * size));
  CHECK(b[999] == 2.0 * size * (size - 1) + 999.0 * size);
  CHECK(d[2] == 5 * size * (size - 1));

  /* Broadcast from the last rank. */
  int64_t value[2] = {my_rank, -my_rank};
  CHECK(gradcomm_broadcast(comm, value, 2, GRADCOMM_INT64, size - 1) == GRADCOMM_SUCCESS);
  CHECK(value[0] == size - 1 && value[1] == -(size - 1));

  /* Packer round trip. */
  float* t0 = malloc(3000 * sizeof *t0);
  float* t1 = malloc(5000 * sizeof *t1);
  for (int i = 0; i < 3000; ++i)
    t0[i] = (float)i;
  for (int i = 0; i < 5000; ++i)
    t1[i] = (float)-i;
  void* tensors[] = {t0, t1};
  size_t tensor_counts[] = {3000, 5000};
  gradcomm_dtype tensor_dtypes[] = {GRADCOMM_FLOAT32, GRADCOMM_FLOAT32};
  gradcomm_packer packer = NULL;
  int declined = -1;
  CHECK(gradcomm_packer_create(tensors, tensor_counts, tensor_dtypes, 2, 4, &packer, &declined) ==
        GRADCOMM_SUCCESS);
  CHECK(declined == 0);
  size_t packed = 0;
  CHECK(gradcomm_packer_buffer_count(packer, &packed) == GRADCOMM_SUCCESS && packed == 1);
  void* data = NULL;
  size_t packed_count = 0;
  gradcomm_dtype packed_dtype = GRADCOMM_INT32;
  CHECK(gradcomm_packer_pack(packer) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_packer_buffer(packer, 0, &data, &packed_count, &packed_dtype) == GRADCOMM_SUCCESS);
  CHECK(packed_count == 8000 && packed_dtype == GRADCOMM_FLOAT32);
  CHECK(gradcomm_allreduce(comm, data, data, packed_count, packed_dtype, GRADCOMM_AVG, NULL) ==
        GRADCOMM_SUCCESS);
  memset(t0, 0, 3000 * sizeof *t0);
  CHECK(gradcomm_packer_unpack(packer) == GRADCOMM_SUCCESS);
  CHECK(t0[2999] == 2999.0f && t1[4999] == -4999.0f);
  CHECK(gradcomm_packer_buffer(packer, 1, &data, NULL, NULL) == GRADCOMM_ERROR_INVALID_ARGUMENT);
  CHECK(gradcomm_packer_free(packer) == GRADCOMM_SUCCESS);

  /* Byte counters. */
  CHECK(gradcomm_reset_traffic(comm) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_allreduce(comm, x, y, 1000, GRADCOMM_FLOAT32, GRADCOMM_SUM, "ring") ==
        GRADCOMM_SUCCESS);
  uint64_t intra = 0, inter = 0, messages = 0;
  CHECK(gradcomm_traffic(comm, &intra, &inter, &messages, NULL) == GRADCOMM_SUCCESS);
  /* ring sends 2(n-1) chunks of about 4000/n bytes (chunks differ by up to one element) */
  CHECK(size == 1 || intra + inter >= (uint64_t)(size - 1) * 4000u / (uint64_t)size);

  free(x);
  free(y);
  free(t0);
  free(t1);
  /* Agree on the outcome: every rank learns whether any rank failed. */
  int64_t failed = failures;
  gradcomm_allreduce(comm, &failed, &failed, 1, GRADCOMM_INT64, GRADCOMM_SUM, NULL);
  CHECK(gradcomm_comm_free(comm) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_finalize() == GRADCOMM_SUCCESS);
  if (my_rank == 0) printf("c abi: %s (%d ranks)\n", failed == 0 ? "ok" : "FAILED", size);
  return failed == 0 && failures == 0 ? 0 : 1;
}
