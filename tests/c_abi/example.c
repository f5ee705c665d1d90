/* A C11 program using only gradcomm.h, built with plain gcc against the installed tree and run
 * under mpirun: all-reduce (every algorithm, exact check), grouped all-reduce, broadcast, the
 * packer, byte counters, and rejected input (status, message, still usable afterwards). With
 * GRADCOMM_TEST_MPI it also wraps MPI_COMM_WORLD through its Fortran handle. Prints "c abi: ok"
 * on rank 0 and exits 0 when every rank passed. */
#define _POSIX_C_SOURCE 200809L /* setenv */
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

  /* Reduce-scatter: block r of the sum on rank r, on both of its paths (an all-reduce with the
   * default algorithm, shm's reduce-scatter with "shm" from 512 KiB of input). */
  {
    const size_t counts[2] = {3, 262147};
    for (int c = 0; c < 2; ++c) {
      const size_t n = counts[c];
      float* in = malloc(sizeof(float) * n * (size_t)size);
      float* out = malloc(sizeof(float) * n);
      CHECK(in != NULL && out != NULL);
      for (size_t i = 0; i < n * (size_t)size; ++i)
        in[i] = (float)(my_rank + (int)(i % 5));
      CHECK(gradcomm_reduce_scatter(comm, in, out, n, GRADCOMM_FLOAT32, GRADCOMM_SUM,
                                    c == 1 ? "shm" : NULL) == GRADCOMM_SUCCESS);
      for (size_t i = 0; i < n; ++i) {
        const size_t at = (size_t)my_rank * n + i;
        CHECK(out[i] == (float)(size * (size - 1) / 2 + size * (int)(at % 5)));
      }
      free(in);
      free(out);
    }
  }

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

  /* Every entry point, more bad input: each returns INVALID_ARGUMENT with a message naming the
   * problem, before any communication (every rank makes the same bad calls). */
#define REJECTS(call, text)                               \
  do {                                                    \
    CHECK((call) == GRADCOMM_ERROR_INVALID_ARGUMENT);     \
    CHECK(strstr(gradcomm_last_error(), (text)) != NULL); \
  } while (0)
  REJECTS(gradcomm_allreduce(comm, x, NULL, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
          "recvbuf is null");
  REJECTS(gradcomm_allreduce(comm, x, x + 1, 8, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
          "overlap partially");
  REJECTS(gradcomm_reduce_scatter(comm, x, x, 1, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
          "overlaps sendbuf");
  REJECTS(gradcomm_reduce_scatter(NULL, x, y, 1, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
          "comm is NULL");
  CHECK(gradcomm_allreduce(comm, NULL, NULL, 0, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
        GRADCOMM_SUCCESS); /* nothing to reduce: NULL is fine */
  REJECTS(gradcomm_comm_create_world(NULL), "out is NULL");
  REJECTS(gradcomm_comm_size(comm, NULL), "size is NULL");
  REJECTS(gradcomm_comm_size(NULL, &size), "comm is NULL");
  REJECTS(gradcomm_traffic(NULL, NULL, NULL, NULL, NULL), "comm is NULL");
  REJECTS(gradcomm_reset_traffic(NULL), "comm is NULL");
  REJECTS(gradcomm_broadcast(NULL, x, 4, GRADCOMM_FLOAT32, 0), "comm is NULL");
  REJECTS(gradcomm_broadcast(comm, x, 4, GRADCOMM_FLOAT32, -1), "root -1 is outside");
  REJECTS(gradcomm_broadcast(comm, NULL, 4, GRADCOMM_FLOAT32, 0), "buffer is null");
  REJECTS(gradcomm_broadcast(comm, x, 4, (gradcomm_dtype)42, 0), "invalid dtype 42");
  REJECTS(gradcomm_broadcast(comm, x, (size_t)-1, GRADCOMM_FLOAT32, 0), "overflows size_t");
  {
    void* two[] = {x, y};
    void* with_null[] = {x, NULL};
    void* overlapping[] = {x, x + 2};
    size_t four[] = {4, 4};
    size_t huge[] = {4, (size_t)-1};
    gradcomm_dtype f32[] = {GRADCOMM_FLOAT32, GRADCOMM_FLOAT32};
    gradcomm_dtype bad[] = {GRADCOMM_FLOAT32, (gradcomm_dtype)42};
    REJECTS(gradcomm_grouped_allreduce(NULL, two, four, f32, 2, GRADCOMM_SUM, NULL, 0),
            "comm is NULL");
    REJECTS(gradcomm_grouped_allreduce(comm, NULL, four, f32, 2, GRADCOMM_SUM, NULL, 0),
            "buffers is NULL");
    REJECTS(gradcomm_grouped_allreduce(comm, two, NULL, f32, 2, GRADCOMM_SUM, NULL, 0),
            "counts is NULL");
    REJECTS(gradcomm_grouped_allreduce(comm, with_null, four, f32, 2, GRADCOMM_SUM, NULL, 0),
            "tensor 1: data is null");
    REJECTS(gradcomm_grouped_allreduce(comm, overlapping, four, f32, 2, GRADCOMM_SUM, NULL, 0),
            "overlaps tensor");
    REJECTS(gradcomm_grouped_allreduce(comm, two, four, bad, 2, GRADCOMM_SUM, NULL, 0),
            "tensor 1: invalid dtype 42");
    REJECTS(gradcomm_grouped_allreduce(comm, two, huge, f32, 2, GRADCOMM_SUM, NULL, 0),
            "overflows size_t");
    REJECTS(gradcomm_grouped_allreduce(comm, two, four, f32, 2, (gradcomm_op)9, NULL, 0),
            "invalid reduce op 9");
    REJECTS(gradcomm_grouped_allreduce(comm, two, four, f32, 2, GRADCOMM_SUM, "nope", 0),
            "unknown algorithm 'nope'");
    REJECTS(gradcomm_grouped_allreduce(comm, two, four, f32, 0, GRADCOMM_SUM, "nope", 0),
            "unknown algorithm 'nope'");
    REJECTS(gradcomm_grouped_allreduce(comm, two, four, f32, (size_t)-1, GRADCOMM_SUM, NULL, 0),
            "is too large");
    /* Bad input on one rank only: that rank's error is its own; the others' call fails at once,
     * naming it, and every rank's next call meets the others' next. */
    if (size > 1) {
      const int last = my_rank == size - 1;
      const gradcomm_status s =
          gradcomm_grouped_allreduce(comm, last ? NULL : two, four, f32, 2, GRADCOMM_SUM, NULL, 0);
      CHECK(s == (last ? GRADCOMM_ERROR_INVALID_ARGUMENT : GRADCOMM_ERROR_MISMATCH));
      CHECK(strstr(gradcomm_last_error(), last ? "buffers is NULL" : "before it could run") !=
            NULL);
      float v[3] = {1.0f, 1.0f, 1.0f};
      CHECK(gradcomm_allreduce(comm, v, v, 3, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
            GRADCOMM_SUCCESS);
      CHECK(v[0] == (float)size && v[2] == (float)size);
    }
    gradcomm_packer p = NULL;
    REJECTS(gradcomm_packer_create(two, four, f32, 2, -1, &p, NULL), "num_split -1 is negative");
    REJECTS(gradcomm_packer_create(two, four, f32, (size_t)-1, 0, &p, NULL), "is too large");
    REJECTS(gradcomm_packer_create(overlapping, four, f32, 2, 0, &p, NULL), "overlaps tensor");
    REJECTS(gradcomm_packer_create(two, four, f32, 2, 0, NULL, NULL), "out is NULL");
    /* Tiny tensors: the packer declines, and using it says why. */
    int declined_small = 0;
    CHECK(gradcomm_packer_create(two, four, f32, 2, 0, &p, &declined_small) == GRADCOMM_SUCCESS);
    CHECK(declined_small == 1);
    REJECTS(gradcomm_packer_pack(p), "declined");
    REJECTS(gradcomm_packer_buffer_count(p, NULL), "count is NULL");
    CHECK(gradcomm_packer_free(p) == GRADCOMM_SUCCESS);
    /* A freed handle is an error, not a use after free; NULL frees nothing. */
    REJECTS(gradcomm_packer_free(p), "is not live");
    REJECTS(gradcomm_packer_pack(p), "is not a live packer");
    CHECK(gradcomm_packer_free(NULL) == GRADCOMM_SUCCESS);
    gradcomm_comm spare = NULL;
    /* A packer handle is not a communicator, nor the other way round. */
    gradcomm_packer other = NULL;
    CHECK(gradcomm_packer_create(two, four, f32, 2, 0, &other, NULL) == GRADCOMM_SUCCESS);
    REJECTS(gradcomm_comm_size((gradcomm_comm)(void*)other, &size), "is not a live communicator");
    REJECTS(gradcomm_comm_free((gradcomm_comm)(void*)other), "is not live");
    CHECK(gradcomm_packer_free(other) == GRADCOMM_SUCCESS);
    CHECK(gradcomm_comm_create_world(&spare) == GRADCOMM_SUCCESS);
    CHECK(gradcomm_comm_free(spare) == GRADCOMM_SUCCESS);
    REJECTS(gradcomm_comm_free(spare), "is not live");
    REJECTS(gradcomm_allreduce(spare, x, y, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
            "is not a live communicator");
    REJECTS(gradcomm_comm_rank(spare, &my_rank), "is not a live communicator");
    CHECK(gradcomm_comm_free(NULL) == GRADCOMM_SUCCESS);
    /* Fortran handles: negative, too large for MPI_Fint, or naming no communicator (Open MPI
     * would abort the job inside MPI_Comm_dup). */
    REJECTS(gradcomm_comm_create_from_fortran(-1, &spare), "names no communicator");
    REJECTS(gradcomm_comm_create_from_fortran((int64_t)1 << 40, &spare), "is not an MPI_Fint");
    REJECTS(gradcomm_comm_create_from_fortran(123456, &spare), "names no communicator");
    CHECK(spare == NULL);
#ifdef GRADCOMM_TEST_MPI
    REJECTS(gradcomm_comm_create_from_fortran((int64_t)MPI_Comm_c2f(MPI_COMM_NULL), &spare),
            "MPI_COMM_NULL");
#endif
    /* An invalid variable names itself and its valid values. */
    setenv("GRADCOMM_CHECK", "sometimes", 1);
    REJECTS(gradcomm_comm_create_world(&spare), "GRADCOMM_CHECK");
    unsetenv("GRADCOMM_CHECK");
  }
  CHECK(gradcomm_comm_rank(comm, &my_rank) == GRADCOMM_SUCCESS); /* still usable */

  /* Non-blocking: several requests in flight, tested and waited out of order, a grouped start,
   * a broadcast, rejected input, and a request freed unwaited (the free waits for it). */
  {
    enum { kReqs = 4, kLen = 100003 };
    float* bufs[kReqs];
    gradcomm_request reqs[kReqs];
    for (int k = 0; k < kReqs; ++k) {
      bufs[k] = malloc(kLen * sizeof(float));
      for (int i = 0; i < kLen; ++i)
        bufs[k][i] = (float)(my_rank + k);
      CHECK(gradcomm_iallreduce(comm, bufs[k], bufs[k], kLen, GRADCOMM_FLOAT32, GRADCOMM_SUM,
                                k % 2 ? "ring" : NULL, NULL, &reqs[k]) == GRADCOMM_SUCCESS);
    }
    int done = 0;
    while (!done)
      CHECK(gradcomm_request_test(reqs[kReqs - 1], &done) == GRADCOMM_SUCCESS);
    for (int k = kReqs - 1; k >= 0; --k) {
      CHECK(gradcomm_request_wait(reqs[k]) == GRADCOMM_SUCCESS);
      CHECK(gradcomm_request_wait(reqs[k]) == GRADCOMM_SUCCESS); /* again: finished */
      CHECK(bufs[k][kLen - 1] == (float)(size * (size - 1) / 2 + size * k));
      CHECK(gradcomm_request_free(reqs[k]) == GRADCOMM_SUCCESS);
    }
    REJECTS(gradcomm_request_wait(reqs[0]), "is not a live request");
    REJECTS(gradcomm_iallreduce(comm, NULL, bufs[0], 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL, NULL,
                                &reqs[0]),
            "sendbuf is null");
    REJECTS(gradcomm_iallreduce(comm, bufs[0], bufs[0], 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL,
                                NULL, NULL),
            "request is NULL");
    void* pair[] = {bufs[0], bufs[1]};
    size_t lens[] = {kLen, 7};
    gradcomm_dtype types[] = {GRADCOMM_FLOAT32, GRADCOMM_FLOAT32};
    for (int i = 0; i < kLen; ++i)
      bufs[0][i] = 1.0f;
    for (int i = 0; i < 7; ++i)
      bufs[1][i] = (float)my_rank;
    gradcomm_request g = NULL;
    CHECK(gradcomm_grouped_allreduce_start(comm, pair, lens, types, 2, GRADCOMM_AVG, NULL, 0, &g) ==
          GRADCOMM_SUCCESS);
    CHECK(gradcomm_request_wait(g) == GRADCOMM_SUCCESS);
    CHECK(gradcomm_request_free(g) == GRADCOMM_SUCCESS);
    CHECK(bufs[0][kLen - 1] == 1.0f);
    CHECK(bufs[1][6] == (float)(size - 1) / 2.0f);
    for (int i = 0; i < kLen; ++i)
      bufs[2][i] = my_rank == 0 ? 5.0f : 0.0f;
    gradcomm_request bc = NULL;
    CHECK(gradcomm_ibroadcast(comm, bufs[2], kLen, GRADCOMM_FLOAT32, 0, &bc) == GRADCOMM_SUCCESS);
    CHECK(gradcomm_request_free(bc) == GRADCOMM_SUCCESS); /* waits */
    CHECK(bufs[2][kLen - 1] == 5.0f);
    CHECK(gradcomm_request_free(NULL) == GRADCOMM_SUCCESS);
    for (int k = 0; k < kReqs; ++k)
      free(bufs[k]);
  }

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

  free(t0);
  free(t1);
  /* Agree on the outcome: every rank learns whether any rank failed. */
  int64_t failed = failures;
  gradcomm_allreduce(comm, &failed, &failed, 1, GRADCOMM_INT64, GRADCOMM_SUM, NULL);
  /* After MPI_Finalize: a collective on a communicator still alive is an error, not an MPI
   * abort; freeing it releases the memory; a new one cannot be made. */
  gradcomm_comm late = NULL;
  CHECK(gradcomm_comm_create_world(&late) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_allreduce(late, x, y, 1000, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL) ==
        GRADCOMM_SUCCESS);
  CHECK(gradcomm_comm_free(comm) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_finalize() == GRADCOMM_SUCCESS);
  REJECTS(gradcomm_allreduce(late, x, y, 4, GRADCOMM_FLOAT32, GRADCOMM_SUM, NULL),
          "MPI has been finalized");
  REJECTS(gradcomm_broadcast(late, x, 4, GRADCOMM_FLOAT32, 0), "MPI has been finalized");
  {
    void* one[] = {x};
    size_t four_elements[] = {4};
    gradcomm_dtype f32_only[] = {GRADCOMM_FLOAT32};
    REJECTS(
        gradcomm_grouped_allreduce(late, one, four_elements, f32_only, 1, GRADCOMM_SUM, NULL, 0),
        "MPI has been finalized");
    uint64_t bytes = 0;
    REJECTS(gradcomm_traffic(late, &bytes, NULL, NULL, NULL), "MPI has been finalized");
  }
  CHECK(gradcomm_comm_rank(late, &my_rank) == GRADCOMM_SUCCESS);
  CHECK(gradcomm_comm_free(late) == GRADCOMM_SUCCESS);
  REJECTS(gradcomm_comm_create_world(&late), "not initialized");
  free(x);
  free(y);
  if (my_rank == 0) printf("c abi: %s (%d ranks)\n", failed == 0 ? "ok" : "FAILED", size);
  return failed == 0 && failures == 0 ? 0 : 1;
}
