#pragma once

#include <cstddef>

// Dense float32 kernels of the built-in models: row-major matrices, accumulation in a fixed order
// (so a given machine always produces the same bits), vectorized per CPU (AVX2 clone when the
// CPU has it). Small and cache-blocked, not a BLAS: the models here are a proof of the
// communication layer, and a BLAS dependency with its own threads would fight the MPI ranks for
// the cores.
namespace gradcomm::trainer {

// C[m x n] += A[m x k] * B[k x n]
void matmul_add(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                std::size_t n);
// C[k x n] += A[m x k]^T * B[m x n]
void matmul_at_b_add(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                     std::size_t n);
// C[m x k] = A[m x n] * B[k x n]^T
void matmul_a_bt(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                 std::size_t n);

}  // namespace gradcomm::trainer
