#include "core/reduce_kernels.h"

#include <cstdint>
#include <type_traits>

#include "core/half.h"

// Each dtype's loops are compiled twice, for x86-64-v3 (AVX2, FMA, F16C) and for the baseline,
// and the loader picks the best the CPU supports. -fopt-info-vec confirms the loops vectorize.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADCOMM_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GRADCOMM_VECTOR_CLONES
#endif

namespace gradcomm {
namespace {

// Element-wise operations on arithmetic values. Integer sum and product wrap around (computed in
// the unsigned type, so overflow is defined rather than undefined behaviour).
template <class T>
T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <class T>
T wrap_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

struct Sum {
  template <class T>
  T operator()(T a, T b) const {
    return wrap_add(a, b);
  }
};
struct Prod {
  template <class T>
  T operator()(T a, T b) const {
    return wrap_mul(a, b);
  }
};
struct Min {
  template <class T>
  T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};

// Storage types: arithmetic types are used as they are; 16-bit floats are loaded as float32,
// combined, and rounded back once.
template <class Storage>
struct Codec {
  using Value = Storage;
  static Value load(Storage v) { return v; }
  static Storage store(Value v) { return v; }
};
template <>
struct Codec<float16_t> {
  using Value = float;
  static float load(float16_t v) { return half_bits_to_float(v.bits); }
  static float16_t store(float v) { return float16_t{float_to_half_bits(v)}; }
};
template <>
struct Codec<bfloat16_t> {
  using Value = float;
  static float load(bfloat16_t v) { return bfloat16_bits_to_float(v.bits); }
  static bfloat16_t store(float v) { return bfloat16_t{float_to_bfloat16_bits(v)}; }
};

// dst = dst op src, or dst = src op dst when SrcFirst (min/max of equal-comparing values such as
// -0 and +0 depend on the operand order, which callers fix so every rank gets the same bits).
template <bool SrcFirst, class S, class Op>
[[gnu::always_inline]] inline void into_loop(S* __restrict dst, const S* __restrict src,
                                             std::size_t n, Op op) {
  using C = Codec<S>;
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = SrcFirst ? C::store(op(C::load(src[i]), C::load(dst[i])))
                      : C::store(op(C::load(dst[i]), C::load(src[i])));
  }
}

template <class S, class Op>
[[gnu::always_inline]] inline void to_loop(S* __restrict dst, const S* __restrict a,
                                           const S* __restrict b, std::size_t n, Op op) {
  using C = Codec<S>;
  for (std::size_t i = 0; i < n; ++i) dst[i] = C::store(op(C::load(a[i]), C::load(b[i])));
}

template <class S>
[[gnu::always_inline]] inline void divide_loop(S* __restrict buf, std::size_t n, int divisor) {
  using C = Codec<S>;
  using V = typename C::Value;
  const V d = static_cast<V>(divisor);
  for (std::size_t i = 0; i < n; ++i) buf[i] = C::store(C::load(buf[i]) / d);
}

// The forms of one call: dst = a op b, dst = dst op b, dst = a op dst.
enum class Form { three_operand, dst_first, dst_second };

template <class S, class Op>
[[gnu::always_inline]] inline void reduce_form(S* dst, const S* a, const S* b, std::size_t n,
                                               Form form, Op op) {
  switch (form) {
    case Form::three_operand:
      return to_loop(dst, a, b, n, op);
    case Form::dst_first:
      return into_loop<false>(dst, b, n, op);
    case Form::dst_second:
      return into_loop<true>(dst, a, n, op);
  }
}

// One entry per storage type.
template <class S>
[[gnu::always_inline]] inline void reduce_typed(S* dst, const S* a, const S* b, std::size_t n,
                                                Form form, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return reduce_form(dst, a, b, n, form, Sum{});
    case ReduceOp::prod:
      return reduce_form(dst, a, b, n, form, Prod{});
    case ReduceOp::min:
      return reduce_form(dst, a, b, n, form, Min{});
    case ReduceOp::max:
      return reduce_form(dst, a, b, n, form, Max{});
  }
}

GRADCOMM_VECTOR_CLONES void reduce_f32(float* d, const float* a, const float* b, std::size_t n,
                                       Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}
GRADCOMM_VECTOR_CLONES void reduce_f64(double* d, const double* a, const double* b, std::size_t n,
                                       Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}
GRADCOMM_VECTOR_CLONES void reduce_f16(float16_t* d, const float16_t* a, const float16_t* b,
                                       std::size_t n, Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}
GRADCOMM_VECTOR_CLONES void reduce_bf16(bfloat16_t* d, const bfloat16_t* a, const bfloat16_t* b,
                                        std::size_t n, Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}
GRADCOMM_VECTOR_CLONES void reduce_i32(std::int32_t* d, const std::int32_t* a,
                                       const std::int32_t* b, std::size_t n, Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}
GRADCOMM_VECTOR_CLONES void reduce_i64(std::int64_t* d, const std::int64_t* a,
                                       const std::int64_t* b, std::size_t n, Form form, ReduceOp op) {
  reduce_typed(d, a, b, n, form, op);
}

void reduce_dispatch(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                     Form form, ReduceOp op) {
  switch (dtype) {
    case DataType::float32:
      return reduce_f32(static_cast<float*>(dst), static_cast<const float*>(a),
                        static_cast<const float*>(b), n, form, op);
    case DataType::float64:
      return reduce_f64(static_cast<double*>(dst), static_cast<const double*>(a),
                        static_cast<const double*>(b), n, form, op);
    case DataType::float16:
      return reduce_f16(static_cast<float16_t*>(dst), static_cast<const float16_t*>(a),
                        static_cast<const float16_t*>(b), n, form, op);
    case DataType::bfloat16:
      return reduce_bf16(static_cast<bfloat16_t*>(dst), static_cast<const bfloat16_t*>(a),
                         static_cast<const bfloat16_t*>(b), n, form, op);
    case DataType::int32:
      return reduce_i32(static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(a),
                        static_cast<const std::int32_t*>(b), n, form, op);
    case DataType::int64:
      return reduce_i64(static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(a),
                        static_cast<const std::int64_t*>(b), n, form, op);
  }
}

GRADCOMM_VECTOR_CLONES void divide_dispatch(void* buf, std::size_t n, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::float32:
      return divide_loop(static_cast<float*>(buf), n, divisor);
    case DataType::float64:
      return divide_loop(static_cast<double*>(buf), n, divisor);
    case DataType::float16:
      return divide_loop(static_cast<float16_t*>(buf), n, divisor);
    case DataType::bfloat16:
      return divide_loop(static_cast<bfloat16_t*>(buf), n, divisor);
    case DataType::int32:
      return divide_loop(static_cast<std::int32_t*>(buf), n, divisor);
    case DataType::int64:
      return divide_loop(static_cast<std::int64_t*>(buf), n, divisor);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, std::size_t n, DataType dtype, ReduceOp op) {
  reduce_dispatch(dst, dst, src, n, dtype, Form::dst_first, op);
}

void reduce_to(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
               ReduceOp op) {
  const Form form = dst == a ? Form::dst_first : dst == b ? Form::dst_second : Form::three_operand;
  reduce_dispatch(dst, a, b, n, dtype, form, op);
}

void divide_by(void* buf, std::size_t n, DataType dtype, int divisor) {
  if (divisor == 1) return;
  divide_dispatch(buf, n, dtype, divisor);
}

}  // namespace gradcomm
