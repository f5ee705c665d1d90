#include "bindings/torch/reduction.h"

#include <optional>
#include <utility>

#include "collectives/allreduce.h"
#include "collectives/reduce_scatter.h"
#include "core/error.h"

namespace gradcomm::torch_backend {

void unsupported(const std::string& call, int rank, const std::string& detail) {
  throw Unsupported(error_message("torch.distributed " + call + " (gradcomm)", rank, detail));
}

namespace {

// gradcomm's dtypes and torch's, one pair each way.
constexpr std::pair<at::ScalarType, DataType> kDtypes[] = {
    {at::kFloat, DataType::float32}, {at::kDouble, DataType::float64},
    {at::kHalf, DataType::float16},  {at::kBFloat16, DataType::bfloat16},
    {at::kInt, DataType::int32},     {at::kLong, DataType::int64}};

std::optional<DataType> native_dtype(at::ScalarType type) {
  for (const auto& [torch_type, dtype] : kDtypes) {
    if (torch_type == type) return dtype;
  }
  return std::nullopt;
}

at::ScalarType scalar_type_of(DataType dtype) {
  for (const auto& [torch_type, ours] : kDtypes) {
    if (ours == dtype) return torch_type;
  }
  return at::kFloat;  // not reached: every DataType has its pair
}

const char* op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "an unknown op";
  }
}

}  // namespace

Reduction plan_reduction(const std::string& call, int rank, at::ScalarType type,
                         const c10d::ReduceOp& op) {
  Reduction r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      r.op = ReduceOp::sum;
      break;
    case c10d::ReduceOp::AVG:
      r.op = ReduceOp::avg;
      break;
    case c10d::ReduceOp::PRODUCT:
      r.op = ReduceOp::prod;
      break;
    case c10d::ReduceOp::MIN:
      r.op = ReduceOp::min;
      break;
    case c10d::ReduceOp::MAX:
      r.op = ReduceOp::max;
      break;
    default:
      unsupported(call, rank,
                  std::string("ReduceOp.") + op_name(op) +
                      " is not supported (SUM, AVG, PRODUCT, MIN and MAX are); for PREMUL_SUM "
                      "scale the tensor first and use SUM");
  }
  if (const auto native = native_dtype(type)) {
    r.dtype = *native;
    return r;
  }
  if (type == at::kComplexFloat || type == at::kComplexDouble) {
    if (r.op != ReduceOp::sum && r.op != ReduceOp::avg) {
      unsupported(call, rank,
                  std::string("ReduceOp.") + op_name(op) + " of complex tensors " +
                      "(SUM and AVG are defined on them)");
    }
    r.dtype = type == at::kComplexFloat ? DataType::float32 : DataType::float64;
    r.via = Reduction::Via::complex_parts;
    return r;
  }
  if (type == at::kBool) {
    // Logical: SUM and MAX are "any", PRODUCT and MIN "all", as on 0/1 integers.
    if (r.op == ReduceOp::avg) unsupported(call, rank, "ReduceOp.AVG of bool tensors");
    r.op = r.op == ReduceOp::sum || r.op == ReduceOp::max ? ReduceOp::max : ReduceOp::min;
    r.dtype = DataType::int32;
    r.via = Reduction::Via::widened;
    return r;
  }
  if (at::isIntegralType(type, /*includeBool=*/false)) {
    // Reduced as int64 and converted back: sums and products wrap as in the narrow type.
    r.dtype = DataType::int64;
    r.via = Reduction::Via::widened;
    return r;
  }
  unsupported(call, rank, "reductions of " + std::string(c10::toString(type)) + " tensors");
}

void reduce_scatter_host(Communicator& comm, const Reduction& r, const at::Tensor& in,
                         const at::Tensor& out, const AllreduceOptions& options,
                         const CallMark& mark) {
  const collectives::CallAnnotation note = annotation_of(in, mark);
  const auto in_bytes = static_cast<std::size_t>(in.numel()) * in.element_size();
  const auto* from = static_cast<const std::byte*>(in.data_ptr());
  const auto* into = static_cast<const std::byte*>(out.data_ptr());
  const bool overlap = into < from + in_bytes && from < into + out.numel() * out.element_size();
  const at::Tensor source = overlap ? in.clone() : in;
  switch (r.via) {
    case Reduction::Via::native:
      reduce_scatter(comm, source.data_ptr(), out.data_ptr(), static_cast<std::size_t>(out.numel()),
                     r.dtype, r.op, options);
      return;
    case Reduction::Via::complex_parts: {
      const at::Tensor parts_in = at::view_as_real(source), parts_out = at::view_as_real(out);
      reduce_scatter(comm, parts_in.data_ptr(), parts_out.data_ptr(),
                     static_cast<std::size_t>(parts_out.numel()), r.dtype, r.op, options);
      return;
    }
    case Reduction::Via::widened: {
      const at::Tensor wide = in.to(scalar_type_of(r.dtype));
      at::Tensor wide_out = at::empty({out.numel()}, wide.options());
      reduce_scatter(comm, wide.data_ptr(), wide_out.data_ptr(),
                     static_cast<std::size_t>(out.numel()), r.dtype, r.op, options);
      out.view({-1}).copy_(wide_out);
      return;
    }
  }
}

collectives::CallAnnotation annotation_of(const at::Tensor& t, const CallMark& mark) {
  return collectives::CallAnnotation(static_cast<int>(t.scalar_type()), mark.root, mark.as,
                                     mark.list);
}

std::uint64_t list_mark(const std::vector<at::Tensor>& tensors) {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the list's shape
  const auto add = [&h](std::uint64_t v) { h = (h ^ v) * 0x100000001b3ULL; };
  add(tensors.size());
  for (const at::Tensor& t : tensors) {
    add(static_cast<std::uint64_t>(t.scalar_type()));
    add(static_cast<std::uint64_t>(t.numel()));
  }
  return h != 0 ? h : 1;
}

namespace {
constexpr int kSparseElement = 1 << 8;  // above every at::ScalarType
}  // namespace

collectives::CallAnnotation sparse_annotation_of(const at::Tensor& values) {
  return collectives::CallAnnotation(static_cast<int>(values.scalar_type()) | kSparseElement);
}

std::string torch_dtype_name(int element) {
  if (element & kSparseElement) return "sparse " + torch_dtype_name(element & ~kSparseElement);
  const auto type = static_cast<at::ScalarType>(element);
  switch (type) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kByte:
      return "torch.uint8";
    case at::kChar:
      return "torch.int8";
    case at::kShort:
      return "torch.int16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kBool:
      return "torch.bool";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch dtype ") + c10::toString(type);
  }
}

void reduce_into(Communicator& comm, const Reduction& r, const at::Tensor& in,
                 const at::Tensor& out, const AllreduceOptions& options, const CallMark& mark) {
  const collectives::CallAnnotation note = annotation_of(in, mark);
  switch (r.via) {
    case Reduction::Via::native:
      allreduce(comm, in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(in.numel()), r.dtype,
                r.op, options);
      return;
    case Reduction::Via::complex_parts: {
      const at::Tensor parts_in = at::view_as_real(in), parts_out = at::view_as_real(out);
      allreduce(comm, parts_in.data_ptr(), parts_out.data_ptr(),
                static_cast<std::size_t>(parts_in.numel()), r.dtype, r.op, options);
      return;
    }
    case Reduction::Via::widened: {
      at::Tensor wide = in.to(scalar_type_of(r.dtype));
      allreduce(comm, wide.data_ptr(), wide.data_ptr(), static_cast<std::size_t>(wide.numel()),
                r.dtype, r.op, options);
      out.copy_(wide);
      return;
    }
  }
}

}  // namespace gradcomm::torch_backend
