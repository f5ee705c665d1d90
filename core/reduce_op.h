#pragma once

#include <optional>
#include <string_view>

namespace gradcomm {

// Reductions. avg is sum divided by the rank count; for integer types the division truncates
// toward zero (C++ integer division), so avg of {1, 2} is 1 and avg of {-1, -2} is -1.
enum class ReduceOp : int {
  sum = 0,
  avg = 1,
  min = 2,
  max = 3,
  prod = 4,
};

inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min,
                                             ReduceOp::max, ReduceOp::prod};

bool is_valid(ReduceOp op);
// "sum", ...; "invalid" for a value outside the enum.
std::string_view to_string(ReduceOp op);
std::optional<ReduceOp> parse_reduce_op(std::string_view name);

}  // namespace gradcomm
