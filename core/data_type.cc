#include "core/data_type.h"

#include "core/reduce_op.h"

namespace gradcomm {

bool is_valid(DataType dtype) {
  return element_size(dtype) != 0;
}

bool is_floating(DataType dtype) {
  return dtype == DataType::float32 || dtype == DataType::float64 || dtype == DataType::float16 ||
         dtype == DataType::bfloat16;
}

std::size_t element_size(DataType dtype) {
  switch (dtype) {
    case DataType::float32:
    case DataType::int32:
      return 4;
    case DataType::float64:
    case DataType::int64:
      return 8;
    case DataType::float16:
    case DataType::bfloat16:
      return 2;
  }
  return 0;
}

std::string_view to_string(DataType dtype) {
  switch (dtype) {
    case DataType::float32:
      return "float32";
    case DataType::float64:
      return "float64";
    case DataType::float16:
      return "float16";
    case DataType::bfloat16:
      return "bfloat16";
    case DataType::int32:
      return "int32";
    case DataType::int64:
      return "int64";
  }
  return "invalid";
}

std::optional<DataType> parse_data_type(std::string_view name) {
  for (DataType dtype : kAllDataTypes) {
    if (to_string(dtype) == name) return dtype;
  }
  return std::nullopt;
}

bool is_valid(ReduceOp op) {
  for (ReduceOp valid : kAllReduceOps) {
    if (op == valid) return true;
  }
  return false;
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
    case ReduceOp::prod:
      return "prod";
  }
  return "invalid";
}

std::optional<ReduceOp> parse_reduce_op(std::string_view name) {
  for (ReduceOp op : kAllReduceOps) {
    if (to_string(op) == name) return op;
  }
  return std::nullopt;
}

}  // namespace gradcomm
