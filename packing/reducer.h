#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/communicator.h"
#include "core/reduce_op.h"
#include "core/request.h"
#include "core/shared_memory.h"
#include "packing/grouped_allreduce.h"
#include "packing/tensor.h"

namespace gradcomm::packing {

struct ReducerOptions {
  // A bucket is closed once it holds at least this many bytes (DDP's bucket_cap_mb, 25 MiB); the
  // first bucket of each dtype closes at first_bucket_bytes (DDP's 1 MiB), so communication
  // starts early in backward.
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  ReduceOp op = ReduceOp::avg;
  std::string algorithm = {};  // empty: the communicator's Config::algorithm
  // float32 tensors travel as float16 or bfloat16 (grouped_allreduce's Compression).
  Compression compression = Compression::none;
  // The order the tensors are expected to become ready in (a permutation of their indices);
  // empty: reverse index order, the order backward produces the gradients of parameters listed
  // from the input layer up.
  std::vector<std::size_t> order = {};
  // After the first iteration, plan the buckets again from the order the tensors became ready
  // on rank 0 (broadcast, so every rank plans the same buckets).
  bool rebuild_buckets = true;
  // Explicit buckets instead of the planner's (Horovod's `groups`): each group's tensors of one
  // dtype form one bucket, whatever its size (a group holding several dtypes gives one bucket per
  // dtype), and every tensor in no group gets a bucket of its own. Caps are ignored then; buckets
  // still launch in the order their first tensor is expected. A tensor may be in one group only.
  std::vector<std::vector<std::size_t>> groups = {};
  // false: mark_ready only packs, and finish() all-reduces the buckets in order with blocking
  // calls on the caller's thread. The same buckets and bit-identical results, nothing overlapped:
  // the baseline that overlap is measured against.
  bool overlap = true;
  // With op avg and compression: divide each gradient by the rank count in the wire dtype right
  // after compressing it, then sum (torch DDP's fp16 / bf16 hooks: a float16 sum cannot
  // overflow where the float32 average fits). false: sum, then divide (Horovod's
  // Compression.fp16). Uncompressed buckets always sum, then divide.
  bool divide_before_sum = false;
};

// One bucket: tensors of one dtype, laid out one after another in the reducer's buffer.
struct ReducerBucket {
  DataType dtype = DataType::float32;  // the tensors' dtype
  DataType wire = DataType::float32;   // what the bucket is reduced as (compression)
  std::vector<std::size_t> tensors;    // indices, in layout order
  std::vector<std::size_t> offsets;    // element offset of each tensor in the bucket
  std::size_t count = 0;               // elements
  std::size_t byte_offset = 0;         // of the bucket in the buffer (64-byte aligned)
};

// The launch order the planner takes for `n` tensors: `order` itself, or reverse index order when
// it is empty. Throws InvalidArgument, naming `call` and `rank`, unless that is a permutation of
// the indices and each index is in at most one of `groups`.
std::vector<std::size_t> checked_reducer_order(std::vector<std::size_t> order, std::size_t n,
                                               const std::vector<std::vector<std::size_t>>& groups,
                                               std::string_view call, int rank);

// The buckets for these tensors, in launch order: tensors are taken in `order`, each into the
// open bucket of its dtype, which closes when it reaches its cap (first_bucket_bytes for a
// dtype's first bucket, bucket_cap_bytes after); buckets are ordered by when their first tensor
// is expected. Pure: the same on every rank for the same arguments.
std::vector<ReducerBucket> plan_reducer_buckets(std::span<const TensorDesc> tensors,
                                                std::span<const std::size_t> order,
                                                const ReducerOptions& options);

// All-reduces gradients while backward still produces them (DDP's Reducer, framework-neutral).
// Built once from the list of gradient tensors; each iteration the caller marks every tensor
// ready as backward produces it, and a bucket is all-reduced (iallreduce on the communicator's
// progress engine) as soon as all its tensors are ready and every bucket before it has been
// launched; the last bucket, complete only when backward is, is reduced by finish() on the
// caller's thread. finish() waits for all buckets and writes the results back into the tensors.
//
// Packing is the copy-in: where the ranks share one host the buckets are registered memory
// (Communicator::allocate), which shm reads in place. Results are bit-identical on every rank,
// and to blocking all-reduces of the same buckets with the same algorithm.
//
// Collective: every rank builds it from the same tensor counts and dtypes, and calls finish()
// the same number of times. Ready order may differ between ranks; launch order never does. Not
// thread-safe: one thread marks and finishes.
class Reducer {
 public:
  // Validates the tensors and options (InvalidArgument, before any communication) and plans the
  // buckets. Collective (it allocates the buffer). With overlap, needs MPI at
  // MPI_THREAD_MULTIPLE.
  Reducer(Communicator& comm, std::vector<TensorDesc> tensors, ReducerOptions options = {});
  // Waits for buckets still in flight.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Tensor `index` holds its gradient for this iteration: copies it into its bucket and launches
  // every bucket that is now complete, in order. InvalidArgument for an index out of range, a
  // tensor marked twice in one iteration or null data; such a refusal also fails this rank's
  // iteration (fail_iteration).
  void mark_ready(std::size_t index);
  // The same, for a gradient that now lives at `data` (same count and dtype); it is also where
  // finish() writes the result.
  void mark_ready(std::size_t index, void* data);
  // Marks the tensors not marked yet (in index order, as they are: unused parameters keep their
  // gradient), waits for every bucket (rethrowing the first error) and writes the results into
  // the tensors. After the first iteration, rebuilds the buckets from rank 0's ready order when
  // options.rebuild_buckets (collective).
  // On a MismatchError every bucket is still called, so the ranks stay in step, and the first
  // one is thrown.
  void finish();
  // This rank cannot complete this iteration (a gradient was refused here; `why` says how): each
  // bucket not launched yet is replaced by a stand-in (collectives::compare_failed_call), in
  // launch order, at once with overlap (else in finish()), so that the other ranks' all-reduce of
  // it fails with a MismatchError naming this rank instead of waiting for this rank or reducing
  // without its gradients. finish() then throws on every rank (here InvalidArgument, with `why`),
  // writes nothing back, and the next iteration starts clean on every rank; this rank must still
  // call it. Where every rank's iteration failed alike, the stand-ins agree and each rank has
  // only its own error. With GRADCOMM_CHECK=off nothing is compared: the others wait for this
  // rank until the watchdog names it. (A reducer of no tensors has no call to stand in: only
  // this rank throws.)
  void fail_iteration(std::string_view why);

  // Where tensor `index` sits in its bucket (its wire dtype): a framework may produce the
  // gradient there directly (DDP's gradient_as_bucket_view) and mark it ready with this pointer
  // as `data`; nothing is copied then. Valid until the buckets are rebuilt.
  void* bucket_view(std::size_t index);

  std::span<const ReducerBucket> buckets() const { return buckets_; }
  // The buckets' memory (registered where the ranks share a host). It moves only when the buckets
  // are rebuilt, after the first iteration.
  std::span<std::byte> buffer() { return {buffer_, buffer_bytes_}; }
  std::size_t iterations() const { return iterations_; }
  // True once the buckets were planned again from an observed order.
  bool rebuilt() const { return rebuilt_; }

 private:
  void plan(std::span<const std::size_t> order);
  void launch_ready_buckets();
  std::string stand_in_name(std::size_t bucket) const;
  // Whether `bucket`'s gradients are divided before the sum (divide_before_sum), and the op its
  // all-reduce then runs.
  bool divides_first(const ReducerBucket& bucket) const;
  ReduceOp op_of(const ReducerBucket& bucket) const;
  void start_iteration();
  std::byte* slot_of(std::size_t index);
  std::byte* bucket_data(const ReducerBucket& bucket) { return buffer_ + bucket.byte_offset; }

  Communicator& comm_;
  std::vector<TensorDesc> tensors_;
  ReducerOptions options_;
  std::vector<ReducerBucket> buckets_;
  std::vector<std::size_t> bucket_of_;    // tensor -> bucket
  std::vector<std::size_t> position_of_;  // tensor -> its place in the bucket's list
  // This iteration: which tensors are ready, where their gradients live, how many tensors each
  // bucket still waits for, the next bucket to launch, and the ready order seen.
  std::vector<char> ready_;
  std::vector<void*> data_;
  std::vector<std::size_t> waiting_;
  std::size_t next_launch_ = 0;
  std::vector<std::size_t> observed_;
  bool failed_ = false;  // fail_iteration
  std::string failed_why_;
  std::size_t iterations_ = 0;
  bool rebuilt_ = false;
  // The buckets' memory (registered where the ranks share a host), then the requests: declared
  // after it so they are destroyed, which waits for them, before it.
  RegisteredBuffer registered_;
  AlignedBuffer private_;
  std::byte* buffer_ = nullptr;
  std::size_t buffer_bytes_ = 0;
  std::vector<Request> requests_;
};

}  // namespace gradcomm::packing
