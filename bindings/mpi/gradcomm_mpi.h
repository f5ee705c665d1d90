/* libgradcomm_mpi.so: gradcomm's all-reduce under an unmodified MPI program.
 *
 * Preload the library (mpirun -x LD_PRELOAD=/path/libgradcomm_mpi.so ./app) or link it before
 * libmpi. It defines MPI_Allreduce and MPI_Iallreduce and runs the calls it can take through
 * gradcomm (docs/mpi-preload.md says which); everything else reaches MPI unchanged through the
 * profiling interface (PMPI_*). Nothing in this header is needed to use it: it lets a program
 * (or a test) ask what the library took and passed through. A program that must run with and
 * without the library can look the function up with dlsym(RTLD_DEFAULT, "gradcomm_mpi_get_stats").
 */
#ifndef GRADCOMM_MPI_H
#define GRADCOMM_MPI_H

#ifdef __cplusplus
extern "C" {
#endif

/* Why a call went to MPI unchanged. */
enum gradcomm_mpi_reason {
  GRADCOMM_MPI_BELOW_THRESHOLD = 0, /* fewer bytes than GRADCOMM_MPI_MIN_BYTES */
  GRADCOMM_MPI_DATATYPE = 1,        /* not a predefined type gradcomm reduces exactly */
  GRADCOMM_MPI_OP = 2,              /* not MPI_SUM, MPI_PROD, MPI_MIN or MPI_MAX */
  GRADCOMM_MPI_INTERCOMM = 3,       /* an intercommunicator */
  GRADCOMM_MPI_THREAD_LEVEL = 4,    /* MPI_Iallreduce below MPI_THREAD_MULTIPLE */
  GRADCOMM_MPI_INVALID = 5,         /* a null communicator, a negative count, ...: MPI reports it */
  GRADCOMM_MPI_NOT_READY = 6,       /* before MPI_Init or after MPI_Finalize began */
  GRADCOMM_MPI_NOT_SET_UP = 7,      /* MPI_Iallreduce on a communicator other than MPI_COMM_WORLD
                                       before its first MPI_Allreduce taken by gradcomm */
  GRADCOMM_MPI_INTERNAL = 8,        /* a communicator of another copy of gradcomm in the process */
  GRADCOMM_MPI_REASONS = 9
};

/* This process's counters since MPI_Init. */
typedef struct gradcomm_mpi_stats {
  unsigned long long taken_calls;             /* MPI_Allreduce and MPI_Iallreduce run by gradcomm */
  unsigned long long taken_nonblocking_calls; /* of which MPI_Iallreduce */
  unsigned long long taken_bytes;
  unsigned long long passed_calls; /* handed to PMPI_Allreduce / PMPI_Iallreduce */
  unsigned long long passed_bytes; /* of passed calls whose datatype size MPI could tell */
  unsigned long long passed_by_reason[GRADCOMM_MPI_REASONS];
  unsigned long long min_bytes; /* the threshold in effect (GRADCOMM_MPI_MIN_BYTES) */
} gradcomm_mpi_stats;

/* Fills *stats; returns 0, or -1 for a null pointer. */
int gradcomm_mpi_get_stats(gradcomm_mpi_stats* stats);

/* "below GRADCOMM_MPI_MIN_BYTES", ...; "unknown" outside the enum. */
const char* gradcomm_mpi_reason_name(int reason);

/* 1 when MPI_Error_string of the codes the library returns gives gradcomm's message; 0 where
   this MPI loses the strings of codes added to its predefined classes (MPICH 4.0): there a failed
   call returns the predefined class (MPI_ERR_ARG, ...) and the message goes to standard error. */
int gradcomm_mpi_error_strings(void);

#ifdef __cplusplus
}
#endif

#endif /* GRADCOMM_MPI_H */
