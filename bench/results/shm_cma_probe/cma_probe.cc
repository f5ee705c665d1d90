// Linux cross-memory attach against shared memory, 2 ranks: rank 0 rewrites a buffer (memset),
// then rank 1 pulls it, either with process_vm_readv from rank 0's private buffer or with memcpy
// from a shared mapping rank 0 wrote. The two modes alternate 15 times per size; medians.
// Build: mpicxx -O2 -o cma_probe cma_probe.cc; run: mpirun -n 2 --bind-to core ./cma_probe
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank; MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t maxb = 64u << 20;
  char name[64]; snprintf(name, sizeof name, "/cmatest");
  int fd = -1;
  if (rank == 0) { shm_unlink(name); fd = shm_open(name, O_CREAT|O_RDWR, 0600); ftruncate(fd, maxb); }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) fd = shm_open(name, O_RDWR, 0600);
  void* shared = mmap(nullptr, maxb, PROT_READ|PROT_WRITE, MAP_SHARED, fd, 0);
  std::vector<char> priv(maxb, 1), local(maxb, 2);
  memset(shared, 3, maxb);
  long pid = getpid(), peer_pid; unsigned long addr = (unsigned long)priv.data(), peer_addr;
  MPI_Sendrecv(&pid, 1, MPI_LONG, 1 - rank, 0, &peer_pid, 1, MPI_LONG, 1 - rank, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  MPI_Sendrecv(&addr, 1, MPI_UNSIGNED_LONG, 1 - rank, 0, &peer_addr, 1, MPI_UNSIGNED_LONG, 1 - rank, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  for (size_t bytes : {1u << 20, 4u << 20, 16u << 20, 64u << 20}) {
    std::vector<double> t_cma, t_shm;
    for (int it = 0; it < 15; ++it) {
      for (int mode = 0; mode < 2; ++mode) {
        // rank 0 writes its source (private or shared) fresh
        if (rank == 0) memset(mode == 0 ? priv.data() : (char*)shared, it + mode, bytes);
        MPI_Barrier(MPI_COMM_WORLD);
        double t = 0;
        if (rank == 1) {
          auto s = std::chrono::steady_clock::now();
          if (mode == 0) {
            size_t done = 0;
            while (done < bytes) {
              iovec l{local.data() + done, bytes - done}, r{(void*)(peer_addr + done), bytes - done};
              ssize_t n = process_vm_readv(peer_pid, &l, 1, &r, 1, 0);
              if (n <= 0) { perror("process_vm_readv"); MPI_Abort(MPI_COMM_WORLD, 1); }
              done += n;
            }
          } else {
            memcpy(local.data(), shared, bytes);
          }
          t = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
          (mode == 0 ? t_cma : t_shm).push_back(t);
        }
        MPI_Barrier(MPI_COMM_WORLD);
      }
    }
    if (rank == 1) {
      std::sort(t_cma.begin(), t_cma.end()); std::sort(t_shm.begin(), t_shm.end());
      printf("%3zu MiB  process_vm_readv %6.2f GB/s (min %.2f)  memcpy from shm %6.2f GB/s\n", bytes >> 20,
             bytes / t_cma[7] / 1e9, bytes / t_cma[0] / 1e9, bytes / t_shm[7] / 1e9);
    }
  }
  if (rank == 0) shm_unlink(name);
  MPI_Finalize();
}
