#pragma once

#include <cstddef>
#include <vector>

#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm {

// Typed reduction kernels. They vectorize (one clone per x86-64 level, picked at load time) and
// treat avg as sum: dividing by the rank count is a separate, final step (divide_by).

// dst[i] = dst[i] op src[i]. dst and src must not overlap.
void reduce_into(void* dst, const void* src, std::size_t n, DataType dtype, ReduceOp op);

// dst[i] = a[i] op b[i], operands in that order (min/max of -0 and +0 depend on it). dst may be
// exactly a or exactly b; no other overlap is allowed.
void reduce_to(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op);

// dst0[i] = dst1[i] = a[i] op b[i]: one pass that writes the result to two places. dst0 may be
// exactly a and dst1 exactly b; no other overlap is allowed.
void reduce_to_both(void* dst0, void* dst1, const void* a, const void* b, std::size_t n,
                    DataType dtype, ReduceOp op);

// targets[j] = sources[0] op ... op sources[k - 1] over `n` elements, for every j (avg divided by
// `ranks`), in blocks of kReduceBlockBytes so that each block's result is still in L1 when it is
// copied (shm's reduction; gradcomm-bench's bound runs the same). targets[0] may be exactly
// sources[0] (in place) or overlap nothing; targets[j > 0] overlaps no source but its own,
// sources[j], which it may be exactly (it is written only after the block is reduced). At least
// two sources.
inline constexpr std::size_t kReduceBlockBytes = std::size_t{8} << 10;
void reduce_to_all(const std::vector<std::byte*>& targets,
                   const std::vector<const std::byte*>& sources, std::size_t n, DataType dtype,
                   ReduceOp op, int ranks);

// buf[i] = buf[i] / divisor, the last step of avg. Floating types divide (correctly rounded for
// float32/float64; float16/bfloat16 divide in float32 and round once); integers truncate.
void divide_by(void* buf, std::size_t n, DataType dtype, int divisor);

// dst[i] = src[i] converted from `from` to `to`: a plain copy when the types are equal, else one
// of float32 -> float16 / bfloat16 (round to nearest even) and back (exact). Other pairs throw
// Unsupported. dst and src must not overlap.
void convert(void* dst, DataType to, const void* src, DataType from, std::size_t n);

}  // namespace gradcomm
