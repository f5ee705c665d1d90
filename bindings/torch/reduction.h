#pragma once
// How the gradcomm backend reduces a torch tensor: gradcomm's op and dtype for torch's, and the
// conversion into and out of it where gradcomm has no such dtype. Narrow integers (int8, uint8,
// int16, the unsigned types) are reduced as int64 and converted back, so sums and products wrap
// as in the narrow type; bool is logic (SUM and MAX "any", PRODUCT and MIN "all"); complex
// tensors reduce their real and imaginary parts (SUM, AVG). Integer AVG truncates.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/check/call_info.h"
#include "core/communicator.h"
#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm::torch_backend {

// Throws Unsupported: "torch.distributed CALL (gradcomm)" on `rank`, and `detail`.
[[noreturn]] void unsupported(const std::string& call, int rank, const std::string& detail);

struct Reduction {
  ReduceOp op = ReduceOp::sum;
  DataType dtype = DataType::float32;
  enum class Via { native, complex_parts, widened } via = Via::native;
};

// The plan for reducing `type` with `op`; Unsupported naming `call` and the op or dtype where
// there is none (BAND, BOR, BXOR, PREMUL_SUM; AVG of bool; MIN of complex, ...).
Reduction plan_reduction(const std::string& call, int rank, at::ScalarType type,
                         const c10d::ReduceOp& op);

// What a torch call is, beyond its tensors, for the comparison across ranks
// (collectives::CallAnnotation):
// - `root` >= 0: torch's reduce, run as an all-reduce of which only the root keeps the result;
// - `as` CallKind::reduce_scatter: torch's reduce_scatter run as an all-reduce on the host;
// - `list` != 0: one call of a coalesced list (list_mark), the same on every call of it.
struct CallMark {
  int root = -1;
  collectives::CallKind as = collectives::CallKind::allreduce;
  std::uint64_t list = 0;
};

// The `list` of a CallMark for the calls of a coalesced list of `tensors`: their number, dtypes
// and element counts (never 0).
std::uint64_t list_mark(const std::vector<at::Tensor>& tensors);

// Reduces `in` across `comm` into `out` (the same tensor for in place), by the plan. On the
// engine: the tensors' data is read and written here only. CUDA tensors: `options` names the
// stream, which must be current (the conversions of a plan run on torch's current stream).
void reduce_into(Communicator& comm, const Reduction& r, const at::Tensor& in,
                 const at::Tensor& out, const AllreduceOptions& options = {},
                 const CallMark& mark = {});

// Reduce-scatters host tensor `in` (group size times `out`'s elements) across `comm` by the plan:
// this rank's block into `out`, through gradcomm::reduce_scatter (shm reads only this rank's block
// of every rank's input). A plan that converts the dtype converts both ways around the call; an
// `out` that lies inside `in` gets a copy of `in` first.
void reduce_scatter_host(Communicator& comm, const Reduction& r, const at::Tensor& in,
                         const at::Tensor& out, const AllreduceOptions& options = {},
                         const CallMark& mark = {});

// The torch dtype of `t`, for the comparison of every call made while the result lives (ranks
// whose tensors differ in dtype differ in the call, even where gradcomm moves bytes or reduces
// the dtype as another), with `mark`. Made on the thread that makes the calls, inside the call's
// body.
collectives::CallAnnotation annotation_of(const at::Tensor& t, const CallMark& mark = {});

// The annotation of a sparse all_reduce's steps, whose values are `values`: their dtype marked
// sparse ("sparse torch.float32"), so that no dense call of the same bytes passes for a step.
collectives::CallAnnotation sparse_annotation_of(const at::Tensor& values);

// "torch.float32" for an annotation's element type; registered as the reports' namer.
std::string torch_dtype_name(int element);

}  // namespace gradcomm::torch_backend
