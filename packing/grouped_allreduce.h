#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

#include "core/communicator.h"
#include "core/reduce_op.h"
#include "core/request.h"
#include "packing/fusion_planner.h"
#include "packing/tensor.h"

namespace gradcomm {

// What float32 gradients travel as. float16 / bfloat16 halve the bytes on the wire: tensors are
// rounded to 16 bits when packed, reduced with float32 arithmetic but 16-bit partial results
// (each reduction step rounds once), and widened back to float32 when unpacked. Relative error
// per element stays within (n + 1) * u * sum_r |x_r| / |sum_r x_r| with u = 2^-11 (float16) or
// 2^-8 (bfloat16); float16 also overflows to infinity above 65504. Other dtypes are unaffected.
enum class Compression { none, float16, bfloat16 };

// The dtype a tensor of `dtype` travels as under `compression` (only float32 is compressed).
DataType wire_dtype(DataType dtype, Compression compression);

struct GroupedAllreduceOptions {
  std::string_view algorithm = {};  // empty: Config::algorithm
  // Bucket size in bytes; nullopt: Config::fusion_threshold (GRADCOMM_FUSION_THRESHOLD).
  std::optional<std::size_t> fusion_threshold = std::nullopt;
  Compression compression = Compression::none;
  // Ready order of the tensors (a permutation of their indices); empty: reverse registration.
  std::span<const std::size_t> order = {};
};

// All-reduces every tensor of the list with `op`, fusing small tensors into buckets (see
// packing::plan_fusion): each bucket is packed into a fused buffer, all-reduced with the chosen
// algorithm and unpacked; a bucket of one tensor is reduced in place without copying. Plans are
// cached per communicator and fused buffers reused, so a training loop allocates nothing per
// step. Collective: every rank passes the same tensor counts and dtypes in the same order (data
// pointers may differ). This is checked on every call at the cost of one 16-byte all-reduce; a
// mismatch throws InvalidArgument on every rank naming the first differing tensor. An empty
// list is a no-op.
void grouped_allreduce(Communicator& comm, std::span<const packing::TensorDesc> tensors,
                       ReduceOp op, const GroupedAllreduceOptions& options = {});

// The non-blocking form: validated here (bad input throws before anything is submitted), run on
// the communicator's progress engine in submission order; the tensor list is copied, the tensors'
// data must stay untouched until the request has finished (iallreduce in collectives/allreduce.h
// has the whole contract).
Request igrouped_allreduce(Communicator& comm, std::span<const packing::TensorDesc> tensors,
                           ReduceOp op, const GroupedAllreduceOptions& options = {});

// The buckets grouped_allreduce uses for these tensors and options (for reports and tests).
packing::FusionPlan grouped_allreduce_plan(const Communicator& comm,
                                           std::span<const packing::TensorDesc> tensors,
                                           const GroupedAllreduceOptions& options = {});

}  // namespace gradcomm
