#pragma once

#include <cstddef>

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

// buf[i] = buf[i] / divisor, the last step of avg. Floating types divide (correctly rounded for
// float32/float64; float16/bfloat16 divide in float32 and round once); integers truncate.
void divide_by(void* buf, std::size_t n, DataType dtype, int divisor);

// dst[i] = src[i] converted from `from` to `to`: a plain copy when the types are equal, else one
// of float32 -> float16 / bfloat16 (round to nearest even) and back (exact). Other pairs throw
// Unsupported. dst and src must not overlap.
void convert(void* dst, DataType to, const void* src, DataType from, std::size_t n);

}  // namespace gradcomm
