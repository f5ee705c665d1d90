#include "collectives/allreduce_mpi.h"

#include <algorithm>
#include <map>
#include <utility>

#include "core/error.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kMpiCall = "allreduce(mpi)";

// MPI user function for a (dtype, op) pair: inout = in op inout, MPI's operand order.
template <DataType D, ReduceOp O>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_to(inout, in, inout, static_cast<std::size_t>(*len), D, O);
}

template <DataType D>
MPI_User_function* user_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return user_reduce<D, ReduceOp::sum>;
    case ReduceOp::prod:
      return user_reduce<D, ReduceOp::prod>;
    case ReduceOp::min:
      return user_reduce<D, ReduceOp::min>;
    case ReduceOp::max:
      return user_reduce<D, ReduceOp::max>;
  }
  return nullptr;
}

MPI_Datatype mpi_type(DataType dtype) {
  switch (dtype) {
    case DataType::float32:
      return MPI_FLOAT;
    case DataType::float64:
      return MPI_DOUBLE;
    case DataType::int32:
      return MPI_INT32_T;
    case DataType::int64:
      return MPI_INT64_T;
    case DataType::float16:
    case DataType::bfloat16:
      return MPI_UINT16_T;  // combined only by our user-defined operations
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op builtin_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return MPI_SUM;
    case ReduceOp::prod:
      return MPI_PROD;
    case ReduceOp::min:
      return MPI_MIN;
    case ReduceOp::max:
      return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// The user-defined MPI_Ops of one communicator, freed with it.
class UserOps : public Attachment {
 public:
  explicit UserOps(Communicator&) {}
  ~UserOps() override {
    if (!mpi_ready()) return;
    for (auto& [key, op] : ops_)
      MPI_Op_free(&op);
  }

  MPI_Op get(DataType dtype, ReduceOp op) {
    if (op == ReduceOp::avg) op = ReduceOp::sum;
    auto [it, inserted] = ops_.try_emplace({dtype, op}, MPI_OP_NULL);
    if (inserted) {
      MPI_User_function* fn = dtype == DataType::float16 ? user_function<DataType::float16>(op)
                                                         : user_function<DataType::bfloat16>(op);
      check_mpi(MPI_Op_create(fn, /*commute=*/1, &it->second), "allreduce(mpi): MPI_Op_create");
    }
    return it->second;
  }

 private:
  std::map<std::pair<DataType, ReduceOp>, MPI_Op> ops_;
};

}  // namespace

void AllreduceMpi::run(const AllreduceArgs& args, Communicator& comm) {
  const bool half = args.dtype == DataType::float16 || args.dtype == DataType::bfloat16;
  const MPI_Op op =
      half ? comm.attachment<UserOps>().get(args.dtype, args.op) : builtin_op(args.op);
  const MPI_Datatype type = mpi_type(args.dtype);
  const std::size_t es = args.element_bytes();
  // MPI counts are int: reduce in pieces of at most 2^30 elements.
  constexpr std::size_t kPiece = std::size_t{1} << 30;
  for (std::size_t offset = 0; offset < args.count; offset += kPiece) {
    const int len = static_cast<int>(std::min(kPiece, args.count - offset));
    auto* out = static_cast<std::byte*>(args.recv) + offset * es;
    const void* in =
        args.in_place() ? MPI_IN_PLACE : static_cast<const std::byte*>(args.send) + offset * es;
    // Also on a progress engine: MPI_Iallreduce would give other bits (Open MPI reduces in
    // another order there), and a request must equal the blocking call. So this wait alone
    // polls inside MPI while the application computes.
    check_mpi(MPI_Allreduce(in, out, len, type, op, comm.mpi_comm()),
              std::string(kMpiCall) + ": MPI_Allreduce", comm.rank());
  }
  if (args.op == ReduceOp::avg) divide_by(args.recv, args.count, args.dtype, comm.size());
}

}  // namespace gradcomm::collectives
