#include "trainer/dense_kernels.h"

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADCOMM_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GRADCOMM_VECTOR_CLONES
#endif

namespace gradcomm::trainer {

// Rows of A are taken four at a time so every row of B streamed from memory serves four rows of
// C; columns are tiled so the four C rows stay in L1.
GRADCOMM_VECTOR_CLONES
void matmul_add(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                std::size_t n) {
  constexpr std::size_t kTile = 512;
  for (std::size_t j0 = 0; j0 < n; j0 += kTile) {
    const std::size_t j1 = std::min(n, j0 + kTile);
    std::size_t i = 0;
    for (; i + 4 <= m; i += 4) {
      float* c0 = c + i * n;
      float* c1 = c0 + n;
      float* c2 = c1 + n;
      float* c3 = c2 + n;
      for (std::size_t p = 0; p < k; ++p) {
        const float a0 = a[i * k + p], a1 = a[(i + 1) * k + p], a2 = a[(i + 2) * k + p],
                    a3 = a[(i + 3) * k + p];
        const float* bp = b + p * n;
        for (std::size_t j = j0; j < j1; ++j) {
          const float bv = bp[j];
          c0[j] += a0 * bv;
          c1[j] += a1 * bv;
          c2[j] += a2 * bv;
          c3[j] += a3 * bv;
        }
      }
    }
    for (; i < m; ++i) {
      float* ci = c + i * n;
      for (std::size_t p = 0; p < k; ++p) {
        const float av = a[i * k + p];
        const float* bp = b + p * n;
        for (std::size_t j = j0; j < j1; ++j)
          ci[j] += av * bp[j];
      }
    }
  }
}

// Four rows of A and B at a time: each row of C (a row of the weight gradient) is read and
// written once per four samples.
GRADCOMM_VECTOR_CLONES
void matmul_at_b_add(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                     std::size_t n) {
  std::size_t i = 0;
  for (; i + 4 <= m; i += 4) {
    const float* b0 = b + i * n;
    const float* b1 = b0 + n;
    const float* b2 = b1 + n;
    const float* b3 = b2 + n;
    for (std::size_t p = 0; p < k; ++p) {
      const float a0 = a[i * k + p], a1 = a[(i + 1) * k + p], a2 = a[(i + 2) * k + p],
                  a3 = a[(i + 3) * k + p];
      if (a0 == 0.0f && a1 == 0.0f && a2 == 0.0f && a3 == 0.0f) continue;  // ReLU zeros
      float* cp = c + p * n;
      for (std::size_t j = 0; j < n; ++j)
        cp[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
    }
  }
  for (; i < m; ++i) {
    const float* bi = b + i * n;
    for (std::size_t p = 0; p < k; ++p) {
      const float av = a[i * k + p];
      if (av == 0.0f) continue;
      float* cp = c + p * n;
      for (std::size_t j = 0; j < n; ++j)
        cp[j] += av * bi[j];
    }
  }
}

// Dot products of rows, with B's row outermost so each row of B (a row of the weights) is read
// from memory once and stays in L1 while every row of A passes by. Eight partial sums per dot (a
// fixed order) let the compiler vectorize without reassociating on its own.
GRADCOMM_VECTOR_CLONES
void matmul_a_bt(const float* a, const float* b, float* c, std::size_t m, std::size_t k,
                 std::size_t n) {
  constexpr std::size_t kLanes = 8;
  const std::size_t n8 = n - n % kLanes;
  for (std::size_t p = 0; p < k; ++p) {
    const float* bp = b + p * n;
    for (std::size_t i = 0; i < m; ++i) {
      const float* ai = a + i * n;
      float lane[kLanes] = {};
      for (std::size_t j = 0; j < n8; j += kLanes) {
        for (std::size_t l = 0; l < kLanes; ++l)
          lane[l] += ai[j + l] * bp[j + l];
      }
      float sum =
          ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
      for (std::size_t j = n8; j < n; ++j)
        sum += ai[j] * bp[j];
      c[i * k + p] = sum;
    }
  }
}

}  // namespace gradcomm::trainer
