/* gradcomm: the stable C ABI (C11). No C++ or MPI types: a user's MPI communicator comes in as
 * its Fortran handle (MPI_Comm_c2f), so this header needs no mpi.h.
 *
 * Every call returns a gradcomm_status; GRADCOMM_SUCCESS is 0. On failure,
 * gradcomm_last_error() returns this thread's message for the last failed call, naming the call,
 * the rank and the problem. No C++ exception crosses this boundary. Collective calls must be
 * made by every rank of the communicator in the same order with matching arguments. */
#ifndef GRADCOMM_C_H_
#define GRADCOMM_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GRADCOMM_VERSION_MAJOR 0
#define GRADCOMM_VERSION_MINOR 1
#define GRADCOMM_VERSION_PATCH 0
/* major * 10000 + minor * 100 + patch */
#define GRADCOMM_VERSION \
  (GRADCOMM_VERSION_MAJOR * 10000 + GRADCOMM_VERSION_MINOR * 100 + GRADCOMM_VERSION_PATCH)

typedef enum gradcomm_status {
  GRADCOMM_SUCCESS = 0,
  GRADCOMM_ERROR_INVALID_ARGUMENT = 1, /* bad input, caught before any communication */
  GRADCOMM_ERROR_UNSUPPORTED = 2,      /* valid input this algorithm or build cannot handle */
  GRADCOMM_ERROR_COMM = 3,             /* MPI reported a failure */
  GRADCOMM_ERROR_INTERNAL = 4,         /* a bug in gradcomm, or an out-of-memory */
  GRADCOMM_ERROR_MISMATCH = 5          /* the ranks disagree on a call (GRADCOMM_CHECK) */
} gradcomm_status;

typedef enum gradcomm_dtype {
  GRADCOMM_FLOAT32 = 0,
  GRADCOMM_FLOAT64 = 1,
  GRADCOMM_FLOAT16 = 2,
  GRADCOMM_BFLOAT16 = 3,
  GRADCOMM_INT32 = 4,
  GRADCOMM_INT64 = 5
} gradcomm_dtype;

typedef enum gradcomm_op {
  GRADCOMM_SUM = 0,
  GRADCOMM_AVG = 1, /* sum / ranks; integers truncate toward zero */
  GRADCOMM_MIN = 2,
  GRADCOMM_MAX = 3,
  GRADCOMM_PROD = 4
} gradcomm_op;

typedef struct gradcomm_comm_s* gradcomm_comm;
typedef struct gradcomm_packer_s* gradcomm_packer;
typedef struct gradcomm_request_s* gradcomm_request;

/* The version this library was built as (GRADCOMM_VERSION of its header). */
int gradcomm_version(void);

/* Initializes MPI unless it already is (argc/argv may be NULL); finalize ends MPI only if init
 * started it. Both are safe to call more than once. */
gradcomm_status gradcomm_init(int* argc, char*** argv);
gradcomm_status gradcomm_finalize(void);

/* A communicator over MPI_COMM_WORLD, or over the user's communicator given by its Fortran
 * handle (MPI_Comm_c2f(comm)). Collective; configuration is read from GRADCOMM_* variables. */
gradcomm_status gradcomm_comm_create_world(gradcomm_comm* out);
gradcomm_status gradcomm_comm_create_from_fortran(int64_t mpi_fortran_handle, gradcomm_comm* out);
gradcomm_status gradcomm_comm_rank(gradcomm_comm comm, int* rank);
gradcomm_status gradcomm_comm_size(gradcomm_comm comm, int* size);
/* Frees the communicator (NULL is a no-op); call it before gradcomm_finalize. Every call given
 * a handle that was freed already (or never created) returns GRADCOMM_ERROR_INVALID_ARGUMENT
 * instead of touching freed memory; so does any collective after MPI was finalized. */
gradcomm_status gradcomm_comm_free(gradcomm_comm comm);

/* recv = op over all ranks of send (count elements); send == recv is in place. algorithm: a
 * registered name ("ring", "halving_doubling", ...), "auto", or NULL for GRADCOMM_ALGORITHM. */
gradcomm_status gradcomm_allreduce(gradcomm_comm comm, const void* send, void* recv, size_t count,
                                   gradcomm_dtype dtype, gradcomm_op op, const char* algorithm);

/* All-reduces n buffers in place, fused into buckets of at most fusion_threshold bytes
 * (0: GRADCOMM_FUSION_THRESHOLD). Every rank passes the same counts and dtypes in order. */
gradcomm_status gradcomm_grouped_allreduce(gradcomm_comm comm, void* const* buffers,
                                           const size_t* counts, const gradcomm_dtype* dtypes,
                                           size_t n, gradcomm_op op, const char* algorithm,
                                           size_t fusion_threshold);

/* Reduces recv_count * size elements of send over all ranks with op and leaves block r
 * (elements [r * recv_count, (r + 1) * recv_count)) in recv on rank r, as
 * MPI_Reduce_scatter_block does. The buffers must not overlap. algorithm as for
 * gradcomm_allreduce: that algorithm's all-reduce of the input, then the block; "shm" runs shm's
 * own reduce-scatter from 512 KiB of input. */
gradcomm_status gradcomm_reduce_scatter(gradcomm_comm comm, const void* send, void* recv,
                                        size_t recv_count, gradcomm_dtype dtype, gradcomm_op op,
                                        const char* algorithm);

/* Copies count elements of buffer on root to every rank. A buffer in GPU memory is staged
 * through pinned host memory; the call returns once it holds the data. */
gradcomm_status gradcomm_broadcast(gradcomm_comm comm, void* buffer, size_t count,
                                   gradcomm_dtype dtype, int root);

/* Non-blocking forms. The call is validated at once (bad input returns its error here and
 * nothing is submitted), then runs on the communicator's progress thread in submission order,
 * whether or not the request is ever tested; every rank submits the same calls in the same
 * order. Buffers stay untouched until the request has finished. *request receives a handle for
 * gradcomm_request_test / _wait / _free. Needs MPI at MPI_THREAD_MULTIPLE (gradcomm_init asks for
 * it); otherwise GRADCOMM_ERROR_UNSUPPORTED, naming the level. A blocking call on a communicator
 * with requests in flight first waits for them.
 * stream: for GPU buffers, the cudaStream_t the work is ordered on (NULL: the legacy default
 * stream); the request finishes once the stream has passed the all-reduce. Ignored for host
 * buffers. */
gradcomm_status gradcomm_iallreduce(gradcomm_comm comm, const void* send, void* recv, size_t count,
                                    gradcomm_dtype dtype, gradcomm_op op, const char* algorithm,
                                    void* stream, gradcomm_request* request);
/* gradcomm_grouped_allreduce's non-blocking form (the lists are copied). */
gradcomm_status gradcomm_grouped_allreduce_start(gradcomm_comm comm, void* const* buffers,
                                                 const size_t* counts, const gradcomm_dtype* dtypes,
                                                 size_t n, gradcomm_op op, const char* algorithm,
                                                 size_t fusion_threshold,
                                                 gradcomm_request* request);
/* gradcomm_broadcast's non-blocking form. */
gradcomm_status gradcomm_ibroadcast(gradcomm_comm comm, void* buffer, size_t count,
                                    gradcomm_dtype dtype, int root, gradcomm_request* request);
/* *done = 1 once the call has finished, and then returns the call's own status (its error, if
 * it failed); *done = 0 and GRADCOMM_SUCCESS while it runs. Never blocks. */
gradcomm_status gradcomm_request_test(gradcomm_request request, int* done);
/* Blocks until the call has finished (without spinning) and returns its status. Testing or
 * waiting again on a finished request returns GRADCOMM_SUCCESS. */
gradcomm_status gradcomm_request_wait(gradcomm_request request);
/* Frees the handle (NULL is a no-op), first waiting for an unfinished call: its buffers are in
 * use until then. An error of a call never waited for is written to stderr. */
gradcomm_status gradcomm_request_free(gradcomm_request request);

/* Bytes and messages this rank sent inside its node (group) and across nodes, counted by
 * gradcomm's own algorithms. Any output pointer may be NULL. */
gradcomm_status gradcomm_traffic(gradcomm_comm comm, uint64_t* intra_bytes, uint64_t* inter_bytes,
                                 uint64_t* intra_messages, uint64_t* inter_messages);
gradcomm_status gradcomm_reset_traffic(gradcomm_comm comm);

/* A packer concatenates n tensors into one buffer per dtype, split into num_split chunks
 * (0: 8), and back; the tensors' memory must stay valid while the packer lives. When packing
 * makes no sense (tiny tensors) creation succeeds with *declined set to 1 and pack/unpack fail;
 * declined may be NULL. */
gradcomm_status gradcomm_packer_create(void* const* buffers, const size_t* counts,
                                       const gradcomm_dtype* dtypes, size_t n, int num_split,
                                       gradcomm_packer* out, int* declined);
gradcomm_status gradcomm_packer_pack(gradcomm_packer packer);
gradcomm_status gradcomm_packer_unpack(gradcomm_packer packer);
/* Number of packed buffers (one per dtype), and each one's memory, element count and dtype. */
gradcomm_status gradcomm_packer_buffer_count(gradcomm_packer packer, size_t* count);
gradcomm_status gradcomm_packer_buffer(gradcomm_packer packer, size_t index, void** data,
                                       size_t* count, gradcomm_dtype* dtype);
gradcomm_status gradcomm_packer_free(gradcomm_packer packer);

/* A fixed description of a status ("invalid argument", ...); never NULL. */
const char* gradcomm_error_string(gradcomm_status status);
/* This thread's message for its last failed call ("" if none); valid until its next call. */
const char* gradcomm_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADCOMM_C_H_ */
