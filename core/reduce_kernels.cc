#include "core/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"

// Each dtype's loops are compiled twice, for x86-64-v3 (AVX2, FMA, F16C) and for the baseline,
// and the loader picks the best the CPU supports. -fopt-info-vec confirms the loops vectorize.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADCOMM_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define GRADCOMM_HAVE_F16C_PATH 1
#include <immintrin.h>
#else
#define GRADCOMM_VECTOR_CLONES
#define GRADCOMM_HAVE_F16C_PATH 0
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

// Codecs: how a stored element becomes a value to combine and back. Arithmetic types are used as
// they are; 16-bit floats are stored as raw uint16_t bits (plain integer loads vectorize, struct
// loads do not), loaded as float32, combined, and rounded back once.
template <class T>
struct Plain {
  using Storage = T;
  using Value = T;
  static Value load(Storage v) { return v; }
  static Storage store(Value v) { return v; }
};
struct Half {
  using Storage = std::uint16_t;
  using Value = float;
  static float load(std::uint16_t v) { return half_bits_to_float(v); }
  static std::uint16_t store(float v) { return float_to_half_bits(v); }
};
struct BFloat16 {
  using Storage = std::uint16_t;
  using Value = float;
  static float load(std::uint16_t v) { return bfloat16_bits_to_float(v); }
  static std::uint16_t store(float v) { return float_to_bfloat16_bits(v); }
};

// dst = dst op src, or dst = src op dst when SrcFirst (min/max of equal-comparing values such as
// -0 and +0 depend on the operand order, which callers fix so every rank gets the same bits).
template <class C, bool SrcFirst, class Op, class S = typename C::Storage>
[[gnu::always_inline]] inline void into_loop(S* __restrict dst, const S* __restrict src,
                                             std::size_t n, Op op) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = SrcFirst ? C::store(op(C::load(src[i]), C::load(dst[i])))
                      : C::store(op(C::load(dst[i]), C::load(src[i])));
  }
}

template <class C, class Op, class S = typename C::Storage>
[[gnu::always_inline]] inline void to_loop(S* __restrict dst, const S* __restrict a,
                                           const S* __restrict b, std::size_t n, Op op) {
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = C::store(op(C::load(a[i]), C::load(b[i])));
}

// Two outputs from one pass. dst0 may be exactly a and dst1 exactly b: each element is loaded
// before it is stored, at the same index, so there is no dependence between iterations.
template <class C, class Op, class S = typename C::Storage>
[[gnu::always_inline]] inline void both_loop(S* dst0, S* dst1, const S* a, const S* b,
                                             std::size_t n, Op op) {
#pragma GCC ivdep
  for (std::size_t i = 0; i < n; ++i) {
    const S z = C::store(op(C::load(a[i]), C::load(b[i])));
    dst0[i] = z;
    dst1[i] = z;
  }
}

// Calls f with the functor of `op` (avg reduces as a sum; the division comes after).
template <class F>
[[gnu::always_inline]] inline void with_op(ReduceOp op, F f) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return f(Sum{});
    case ReduceOp::prod:
      return f(Prod{});
    case ReduceOp::min:
      return f(Min{});
    case ReduceOp::max:
      return f(Max{});
  }
}

template <class C, class S = typename C::Storage>
[[gnu::always_inline]] inline void both_typed(void* d0, void* d1, const void* a, const void* b,
                                              std::size_t n, ReduceOp op) {
  auto* x0 = static_cast<S*>(d0);
  auto* x1 = static_cast<S*>(d1);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  with_op(
      op, [&](auto f) __attribute__((always_inline)) { both_loop<C>(x0, x1, x, y, n, f); });
}

template <class C, class S = typename C::Storage>
[[gnu::always_inline]] inline void divide_loop(S* __restrict buf, std::size_t n, int divisor) {
  using V = typename C::Value;
  const V d = static_cast<V>(divisor);
  for (std::size_t i = 0; i < n; ++i)
    buf[i] = C::store(C::load(buf[i]) / d);
}

// The forms of one call: dst = a op b, dst = dst op b, dst = a op dst.
enum class Form { three_operand, dst_first, dst_second };

template <class C, class Op, class S = typename C::Storage>
[[gnu::always_inline]] inline void reduce_form(S* dst, const S* a, const S* b, std::size_t n,
                                               Form form, Op op) {
  switch (form) {
    case Form::three_operand:
      return to_loop<C>(dst, a, b, n, op);
    case Form::dst_first:
      return into_loop<C, false>(dst, b, n, op);
    case Form::dst_second:
      return into_loop<C, true>(dst, a, n, op);
  }
}

// One entry per dtype, on untyped pointers.
template <class C, class S = typename C::Storage>
[[gnu::always_inline]] inline void reduce_typed(void* dst, const void* a, const void* b,
                                                std::size_t n, Form form, ReduceOp op) {
  auto* d = static_cast<S*>(dst);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  with_op(
      op, [&](auto f) __attribute__((always_inline)) { reduce_form<C>(d, x, y, n, form, f); });
}

// The clones: one function per dtype, each compiled for every x86-64 level of the list above.
#define GRADCOMM_DEFINE_KERNEL(NAME, CODEC)                                              \
  GRADCOMM_VECTOR_CLONES void NAME(void* d, const void* a, const void* b, std::size_t n, \
                                   Form form, ReduceOp op) {                             \
    reduce_typed<CODEC>(d, a, b, n, form, op);                                           \
  }
GRADCOMM_DEFINE_KERNEL(reduce_f32, Plain<float>)
GRADCOMM_DEFINE_KERNEL(reduce_f64, Plain<double>)
GRADCOMM_DEFINE_KERNEL(reduce_f16, Half)
GRADCOMM_DEFINE_KERNEL(reduce_bf16, BFloat16)
GRADCOMM_DEFINE_KERNEL(reduce_i32, Plain<std::int32_t>)
GRADCOMM_DEFINE_KERNEL(reduce_i64, Plain<std::int64_t>)
#undef GRADCOMM_DEFINE_KERNEL

#define GRADCOMM_DEFINE_BOTH(NAME, CODEC)                                            \
  GRADCOMM_VECTOR_CLONES void NAME(void* d0, void* d1, const void* a, const void* b, \
                                   std::size_t n, ReduceOp op) {                     \
    both_typed<CODEC>(d0, d1, a, b, n, op);                                          \
  }
GRADCOMM_DEFINE_BOTH(both_f32, Plain<float>)
GRADCOMM_DEFINE_BOTH(both_f64, Plain<double>)
GRADCOMM_DEFINE_BOTH(both_bf16, BFloat16)
GRADCOMM_DEFINE_BOTH(both_i32, Plain<std::int32_t>)
GRADCOMM_DEFINE_BOTH(both_i64, Plain<std::int64_t>)
#undef GRADCOMM_DEFINE_BOTH

#if GRADCOMM_HAVE_F16C_PATH
// float16 with the F16C conversion instructions: the portable bit-twiddling conversions cost ~1 ns
// per element even vectorized, the hardware ones a fraction of that. Same rounding (nearest
// even, subnormals exact); the tail uses the portable codec. min/max keep Min/Max's operand
// order: _mm256_min_ps(b, a) is (b < a ? b : a).
template <ReduceOp O>
__attribute__((target("avx2,f16c"))) void f16c_loop(std::uint16_t* dst, const std::uint16_t* a,
                                                    const std::uint16_t* b, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    __m256 z;
    if constexpr (O == ReduceOp::sum || O == ReduceOp::avg) z = _mm256_add_ps(x, y);
    if constexpr (O == ReduceOp::prod) z = _mm256_mul_ps(x, y);
    if constexpr (O == ReduceOp::min) z = _mm256_min_ps(y, x);
    if constexpr (O == ReduceOp::max) z = _mm256_max_ps(y, x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) {  // the tail, scalar (no __restrict: dst may alias a or b)
    const float x = Half::load(a[i]);
    const float y = Half::load(b[i]);
    float z;
    if constexpr (O == ReduceOp::sum || O == ReduceOp::avg) z = Sum{}(x, y);
    if constexpr (O == ReduceOp::prod) z = Prod{}(x, y);
    if constexpr (O == ReduceOp::min) z = Min{}(x, y);
    if constexpr (O == ReduceOp::max) z = Max{}(x, y);
    dst[i] = Half::store(z);
  }
}

// dst = a op b for float16 when the CPU has AVX2 and F16C; false otherwise. dst may alias a or b
// exactly: each vector is loaded before it is stored.
bool reduce_f16_hardware(void* dst, const void* a, const void* b, std::size_t n, ReduceOp op) {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (!available) return false;
  auto* d = static_cast<std::uint16_t*>(dst);
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      f16c_loop<ReduceOp::sum>(d, x, y, n);
      break;
    case ReduceOp::prod:
      f16c_loop<ReduceOp::prod>(d, x, y, n);
      break;
    case ReduceOp::min:
      f16c_loop<ReduceOp::min>(d, x, y, n);
      break;
    case ReduceOp::max:
      f16c_loop<ReduceOp::max>(d, x, y, n);
      break;
  }
  return true;
}
#endif

void reduce_dispatch(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                     Form form, ReduceOp op) {
#if GRADCOMM_HAVE_F16C_PATH
  if (dtype == DataType::float16 && reduce_f16_hardware(dst, a, b, n, op)) return;
#endif
  switch (dtype) {
    case DataType::float32:
      return reduce_f32(dst, a, b, n, form, op);
    case DataType::float64:
      return reduce_f64(dst, a, b, n, form, op);
    case DataType::float16:
      return reduce_f16(dst, a, b, n, form, op);
    case DataType::bfloat16:
      return reduce_bf16(dst, a, b, n, form, op);
    case DataType::int32:
      return reduce_i32(dst, a, b, n, form, op);
    case DataType::int64:
      return reduce_i64(dst, a, b, n, form, op);
  }
}

GRADCOMM_VECTOR_CLONES void divide_dispatch(void* buf, std::size_t n, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::float32:
      return divide_loop<Plain<float>>(static_cast<float*>(buf), n, divisor);
    case DataType::float64:
      return divide_loop<Plain<double>>(static_cast<double*>(buf), n, divisor);
    case DataType::float16:
      return divide_loop<Half>(static_cast<std::uint16_t*>(buf), n, divisor);
    case DataType::bfloat16:
      return divide_loop<BFloat16>(static_cast<std::uint16_t*>(buf), n, divisor);
    case DataType::int32:
      return divide_loop<Plain<std::int32_t>>(static_cast<std::int32_t*>(buf), n, divisor);
    case DataType::int64:
      return divide_loop<Plain<std::int64_t>>(static_cast<std::int64_t*>(buf), n, divisor);
  }
}

template <class From, class To>
[[gnu::always_inline]] inline void convert_loop(typename To::Storage* __restrict dst,
                                                const typename From::Storage* __restrict src,
                                                std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = To::store(From::load(src[i]));
}

GRADCOMM_VECTOR_CLONES void convert_dispatch(void* dst, DataType to, const void* src, DataType from,
                                             std::size_t n) {
  auto* d16 = static_cast<std::uint16_t*>(dst);
  auto* d32 = static_cast<float*>(dst);
  const auto* s16 = static_cast<const std::uint16_t*>(src);
  const auto* s32 = static_cast<const float*>(src);
  if (from == DataType::float32 && to == DataType::float16) {
    return convert_loop<Plain<float>, Half>(d16, s32, n);
  }
  if (from == DataType::float32 && to == DataType::bfloat16) {
    return convert_loop<Plain<float>, BFloat16>(d16, s32, n);
  }
  if (from == DataType::float16 && to == DataType::float32) {
    return convert_loop<Half, Plain<float>>(d32, s16, n);
  }
  return convert_loop<BFloat16, Plain<float>>(d32, s16, n);
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

void reduce_to_both(void* dst0, void* dst1, const void* a, const void* b, std::size_t n,
                    DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::float32:
      return both_f32(dst0, dst1, a, b, n, op);
    case DataType::float64:
      return both_f64(dst0, dst1, a, b, n, op);
    case DataType::bfloat16:
      return both_bf16(dst0, dst1, a, b, n, op);
    case DataType::int32:
      return both_i32(dst0, dst1, a, b, n, op);
    case DataType::int64:
      return both_i64(dst0, dst1, a, b, n, op);
    case DataType::float16:  // the F16C path (reduce_to), then a copy
      reduce_to(dst0, a, b, n, dtype, op);
      std::memcpy(dst1, dst0, n * element_size(dtype));
      return;
  }
}

void convert(void* dst, DataType to, const void* src, DataType from, std::size_t n) {
  if (to == from) {
    if (n > 0) std::memcpy(dst, src, n * element_size(to));
    return;
  }
  const bool f32_to_16 =
      from == DataType::float32 && (to == DataType::float16 || to == DataType::bfloat16);
  const bool f16_to_32 =
      to == DataType::float32 && (from == DataType::float16 || from == DataType::bfloat16);
  if (!f32_to_16 && !f16_to_32) {
    throw Unsupported(error_message("convert", -1,
                                    "no conversion from " + std::string(to_string(from)) + " to " +
                                        std::string(to_string(to))));
  }
  convert_dispatch(dst, to, src, from, n);
}

void reduce_to_all(const std::vector<std::byte*>& targets,
                   const std::vector<const std::byte*>& sources, std::size_t n, DataType dtype,
                   ReduceOp op, int ranks) {
  const std::size_t es = element_size(dtype);
  const std::size_t block = kReduceBlockBytes / es;
  const ReduceOp kernel_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  for (std::size_t b0 = 0; b0 < n; b0 += block) {
    const std::size_t m = std::min(block, n - b0);
    const std::size_t at = b0 * es;
    std::byte* result = targets[0] + at;
    if (sources.size() == 2 && op != ReduceOp::avg) {  // one pass to both outputs
      reduce_to_both(result, targets[1] + at, sources[0] + at, sources[1] + at, m, dtype,
                     kernel_op);
      continue;
    }
    reduce_to(result, sources[0] + at, sources[1] + at, m, dtype, kernel_op);
    for (std::size_t j = 2; j < sources.size(); ++j)
      reduce_into(result, sources[j] + at, m, dtype, kernel_op);
    if (op == ReduceOp::avg) divide_by(result, m, dtype, ranks);
    for (std::size_t j = 1; j < targets.size(); ++j)
      std::memcpy(targets[j] + at, result, m * es);
  }
}

void divide_by(void* buf, std::size_t n, DataType dtype, int divisor) {
  if (divisor == 1) return;
  divide_dispatch(buf, n, dtype, divisor);
}

}  // namespace gradcomm
