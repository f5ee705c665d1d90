/* mpi-allreduce-bench: an unmodified MPI program in the style of OSU's osu_allreduce, built
 * against MPI only (no gradcomm). It measures MPI_Allreduce (or MPI_Iallreduce + MPI_Wait) as
 * any MPI application sees it, so that the same binary can be run plain and with
 * libgradcomm_mpi.so preloaded:
 *
 *   mpirun -np 2 mpi-allreduce-bench -b 1K -e 64M
 *   mpirun -np 2 -x LD_PRELOAD=.../libgradcomm_mpi.so mpi-allreduce-bench -b 1K -e 64M
 *
 * Method (gradcomm-bench's, so the two compare): per size, warm-up calls, then rounds; a round is
 * a barrier and a batch of back-to-back calls sized so that it lasts ~200 us or more; the time of
 * a round is the slowest rank's per-call average; statistics are over rounds. With --cycle each
 * call is preceded by every rank rewriting its input and followed by reading the result (a
 * training step's use of the buffers), and both the call and the whole cycle are reported.
 * Timing infrastructure uses MPI_Reduce and MPI_Bcast only, never the call being measured.
 *
 * glibc's malloc is left as the environment sets it: for a fair Open MPI baseline run with
 * MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 (MPI_Allreduce then reuses its
 * temporary buffers instead of mapping fresh pages on every call).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                          \
  do {                                                                       \
    int rc_ = (call);                                                        \
    if (rc_ != MPI_SUCCESS) {                                                \
      char text_[MPI_MAX_ERROR_STRING];                                      \
      int len_ = 0;                                                          \
      MPI_Error_string(rc_, text_, &len_);                                   \
      fprintf(stderr, "mpi-allreduce-bench: %s failed: %s\n", #call, text_); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                          \
    }                                                                        \
  } while (0)

typedef struct {
  size_t min_bytes, max_bytes;
  double factor;
  int rounds, warmup;
  int nonblocking, cycle, inplace, csv;
  int thread_level; /* -1: MPI_Init */
  MPI_Datatype type;
  size_t type_size;
  const char* type_name;
} Options;

static size_t parse_size(const char* text) {
  char* end = NULL;
  double value = strtod(text, &end);
  if (end == text || value < 0) {
    fprintf(stderr, "mpi-allreduce-bench: bad size '%s'\n", text);
    exit(2);
  }
  switch (*end) {
    case 'K':
    case 'k':
      value *= 1024.0;
      break;
    case 'M':
    case 'm':
      value *= 1024.0 * 1024.0;
      break;
    case 'G':
    case 'g':
      value *= 1024.0 * 1024.0 * 1024.0;
      break;
    case '\0':
      break;
    default:
      fprintf(stderr, "mpi-allreduce-bench: bad size '%s'\n", text);
      exit(2);
  }
  return (size_t)value;
}

static void usage(void) {
  fprintf(stderr,
          "usage: mpirun -np N mpi-allreduce-bench [options]\n"
          "  -b SIZE        smallest message in bytes (default 8; K/M/G suffixes)\n"
          "  -e SIZE        largest message (default 64M)\n"
          "  -f F           size multiplier between rows (default 2)\n"
          "  -n N           timed rounds per size (default 20)\n"
          "  -w N           warm-up calls per size (default 5)\n"
          "  -d TYPE        float, double, int or int64 (default float)\n"
          "  --nonblocking  MPI_Iallreduce + MPI_Wait instead of MPI_Allreduce\n"
          "  --inplace      MPI_IN_PLACE\n"
          "  --cycle        rewrite the input before and read the result after each call\n"
          "  --thread L     MPI_Init_thread at single, funneled, serialized or multiple\n"
          "                 (default: MPI_Init)\n"
          "  --csv          machine-readable rows on rank 0's stdout\n");
}

static Options parse(int argc, char** argv) {
  Options o = {8, (size_t)64 << 20, 2.0, 20, 5, 0, 0, 0, 0, -1, MPI_FLOAT, 4, "float"};
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE()                                               \
  if (!next) {                                                     \
    fprintf(stderr, "mpi-allreduce-bench: %s needs a value\n", a); \
    exit(2);                                                       \
  }                                                                \
  ++i
    if (!strcmp(a, "-b")) {
      NEED_VALUE();
      o.min_bytes = parse_size(next);
    } else if (!strcmp(a, "-e")) {
      NEED_VALUE();
      o.max_bytes = parse_size(next);
    } else if (!strcmp(a, "-f")) {
      NEED_VALUE();
      o.factor = atof(next);
    } else if (!strcmp(a, "-n")) {
      NEED_VALUE();
      o.rounds = atoi(next);
    } else if (!strcmp(a, "-w")) {
      NEED_VALUE();
      o.warmup = atoi(next);
    } else if (!strcmp(a, "-d")) {
      NEED_VALUE();
      if (!strcmp(next, "float")) {
        o.type = MPI_FLOAT;
        o.type_size = 4;
      } else if (!strcmp(next, "double")) {
        o.type = MPI_DOUBLE;
        o.type_size = 8;
      } else if (!strcmp(next, "int")) {
        o.type = MPI_INT;
        o.type_size = 4;
      } else if (!strcmp(next, "int64")) {
        o.type = MPI_INT64_T;
        o.type_size = 8;
      } else {
        fprintf(stderr, "mpi-allreduce-bench: unknown type '%s'\n", next);
        exit(2);
      }
      o.type_name = next;
    } else if (!strcmp(a, "--nonblocking"))
      o.nonblocking = 1;
    else if (!strcmp(a, "--inplace"))
      o.inplace = 1;
    else if (!strcmp(a, "--cycle"))
      o.cycle = 1;
    else if (!strcmp(a, "--csv"))
      o.csv = 1;
    else if (!strcmp(a, "--thread")) {
      NEED_VALUE();
      if (!strcmp(next, "single"))
        o.thread_level = MPI_THREAD_SINGLE;
      else if (!strcmp(next, "funneled"))
        o.thread_level = MPI_THREAD_FUNNELED;
      else if (!strcmp(next, "serialized"))
        o.thread_level = MPI_THREAD_SERIALIZED;
      else if (!strcmp(next, "multiple"))
        o.thread_level = MPI_THREAD_MULTIPLE;
      else {
        fprintf(stderr, "mpi-allreduce-bench: unknown level '%s'\n", next);
        exit(2);
      }
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage();
      exit(0);
    } else {
      fprintf(stderr, "mpi-allreduce-bench: unknown option '%s'\n", a);
      usage();
      exit(2);
    }
#undef NEED_VALUE
  }
  if (o.factor <= 1.0 || o.rounds < 1 || o.warmup < 0 || o.max_bytes < o.min_bytes) {
    fprintf(stderr, "mpi-allreduce-bench: need -f > 1, -n >= 1, -w >= 0 and -e >= -b\n");
    exit(2);
  }
  return o;
}

static void fill(void* buffer, size_t count, const Options* o, int rank, int round) {
  for (size_t i = 0; i < count; ++i) {
    const int v = (int)((i + (size_t)rank + (size_t)round) % 7) - 3;
    if (o->type == MPI_FLOAT)
      ((float*)buffer)[i] = (float)v;
    else if (o->type == MPI_DOUBLE)
      ((double*)buffer)[i] = v;
    else if (o->type == MPI_INT)
      ((int*)buffer)[i] = v;
    else
      ((int64_t*)buffer)[i] = v;
  }
}

static double read_all(const void* buffer, size_t bytes) {
  const unsigned char* p = (const unsigned char*)buffer;
  uint64_t sum = 0;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t word;
    memcpy(&word, p + i, 8);
    sum += word;
  }
  return (double)(sum & 0xffff);
}

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static void call(const Options* o, const void* send, void* recv, int count) {
  if (o->nonblocking) {
    MPI_Request request;
    CHECK(MPI_Iallreduce(send, recv, count, o->type, MPI_SUM, MPI_COMM_WORLD, &request));
    CHECK(MPI_Wait(&request, MPI_STATUS_IGNORE));
  } else {
    CHECK(MPI_Allreduce(send, recv, count, o->type, MPI_SUM, MPI_COMM_WORLD));
  }
}

/* Seconds per call of `calls` back-to-back calls after a barrier, the slowest rank's. */
static double time_batch(const Options* o, const void* send, void* recv, int count, int calls,
                         int rank, int round, double* cycle_out) {
  double in_calls = 0;
  CHECK(MPI_Barrier(MPI_COMM_WORLD));
  const double t0 = MPI_Wtime();
  for (int c = 0; c < calls; ++c) {
    if (o->cycle) {
      fill(o->inplace ? recv : (void*)send, (size_t)count, o, rank, round + c);
      const double c0 = MPI_Wtime();
      call(o, send, recv, count);
      in_calls += MPI_Wtime() - c0;
      if (read_all(recv, (size_t)count * o->type_size) < 0) fprintf(stderr, "?");
    } else {
      call(o, send, recv, count);
    }
  }
  double local[2] = {(MPI_Wtime() - t0) / calls, in_calls / calls};
  double slowest[2] = {0, 0};
  CHECK(MPI_Reduce(local, slowest, 2, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
  CHECK(MPI_Bcast(slowest, 2, MPI_DOUBLE, 0, MPI_COMM_WORLD));
  if (o->cycle) {
    *cycle_out = slowest[0];
    return slowest[1];
  }
  *cycle_out = 0;
  return slowest[0];
}

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  int provided = -1;
  if (o.thread_level < 0) {
    CHECK(MPI_Init(&argc, &argv));
  } else {
    CHECK(MPI_Init_thread(&argc, &argv, o.thread_level, &provided));
  }
  int rank = 0, size = 1;
  CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  CHECK(MPI_Query_thread(&provided));
  const size_t max_count = o.max_bytes / o.type_size;
  void* send = NULL;
  void* recv = NULL;
  if (posix_memalign(&send, 64, max_count * o.type_size + 64) ||
      posix_memalign(&recv, 64, max_count * o.type_size + 64)) {
    fprintf(stderr, "mpi-allreduce-bench: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  memset(send, 0, max_count * o.type_size + 64); /* touch once, outside the timing */
  memset(recv, 0, max_count * o.type_size + 64);
  const void* send_arg = o.inplace ? MPI_IN_PLACE : send;
  double* rounds = malloc(sizeof(double) * (size_t)o.rounds);
  double* cycles = malloc(sizeof(double) * (size_t)o.rounds);
  if (rank == 0) {
    if (o.csv) {
      printf(
          "ranks,bytes,count,type,call,median_us,min_us,max_us,algbw_GBs,busbw_GBs,"
          "cycle_median_us\n");
    } else {
      printf("# mpi-allreduce-bench: %d ranks, %s, %s%s%s, thread level %d\n", size, o.type_name,
             o.nonblocking ? "MPI_Iallreduce+MPI_Wait" : "MPI_Allreduce",
             o.inplace ? ", in place" : "", o.cycle ? ", training-like cycle" : "", provided);
      printf("%12s %10s %10s %10s %10s %10s %10s%s\n", "bytes", "count", "median_us", "min_us",
             "max_us", "algbw_GB/s", "busbw_GB/s", o.cycle ? "   cycle_us" : "");
    }
  }
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes;) {
    const int count = (int)(bytes / o.type_size);
    fill(o.inplace ? recv : send, (size_t)count, &o, rank, 0);
    for (int w = 0; w < o.warmup; ++w)
      call(&o, send_arg, recv, count);
    double cycle = 0;
    const double one = time_batch(&o, send_arg, recv, count, 1, rank, 0, &cycle);
    int calls = (int)(200e-6 / (one > 1e-9 ? one : 1e-9)) + 1;
    if (calls > 4096) calls = 4096;
    for (int r = 0; r < o.rounds; ++r) {
      rounds[r] = time_batch(&o, send_arg, recv, count, calls, rank, r, &cycles[r]);
    }
    qsort(rounds, (size_t)o.rounds, sizeof(double), compare_doubles);
    qsort(cycles, (size_t)o.rounds, sizeof(double), compare_doubles);
    const double median = rounds[o.rounds / 2];
    const double algbw = median > 0 ? (double)bytes / median / 1e9 : 0;
    const double busbw = algbw * (size > 1 ? 2.0 * (size - 1) / size : 1.0);
    if (rank == 0) {
      if (o.csv) {
        printf("%d,%zu,%d,%s,%s,%.3f,%.3f,%.3f,%.4f,%.4f,%.3f\n", size, bytes, count, o.type_name,
               o.nonblocking ? "iallreduce" : "allreduce", median * 1e6, rounds[0] * 1e6,
               rounds[o.rounds - 1] * 1e6, algbw, busbw, cycles[o.rounds / 2] * 1e6);
      } else {
        printf("%12zu %10d %10.2f %10.2f %10.2f %10.3f %10.3f", bytes, count, median * 1e6,
               rounds[0] * 1e6, rounds[o.rounds - 1] * 1e6, algbw, busbw);
        if (o.cycle) printf(" %10.2f", cycles[o.rounds / 2] * 1e6);
        printf("\n");
      }
      fflush(stdout);
    }
    const size_t next = (size_t)((double)bytes * o.factor);
    if (bytes == 0 || next <= bytes) break;
    bytes = next;
  }
  free(rounds);
  free(cycles);
  free(send);
  free(recv);
  CHECK(MPI_Finalize());
  return 0;
}
