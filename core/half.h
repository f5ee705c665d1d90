#pragma once

// float16 / bfloat16 <-> float32 conversions, written branch-free (selects only) so loops that
// call them vectorize. Rounding is to nearest, ties to even; NaN stays NaN (quieted, top payload
// bits kept), infinities and signed zeros are preserved, float16 subnormals are handled exactly.

#include <bit>
#include <cstdint>

#include "core/data_type.h"

namespace gradcomm {

inline float half_bits_to_float(std::uint16_t h) {
  // Move exponent and mantissa into float32 position and rebias the exponent (15 -> 127).
  const std::uint32_t shifted_exp = 0x7c00u << 13;
  std::uint32_t magnitude = (static_cast<std::uint32_t>(h) & 0x7fffu) << 13;
  const std::uint32_t exp = magnitude & shifted_exp;
  magnitude += (127u - 15u) << 23;
  // Inf/NaN: rebias once more so the exponent becomes all ones.
  const std::uint32_t inf_nan = magnitude + ((128u - 16u) << 23);
  // Zero/subnormal: renormalize through a float subtraction (exact).
  const float sub = std::bit_cast<float>(magnitude + (1u << 23)) - std::bit_cast<float>(113u << 23);
  std::uint32_t out = exp == shifted_exp ? inf_nan : magnitude;
  out = exp == 0 ? std::bit_cast<std::uint32_t>(sub) : out;
  out |= (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  return std::bit_cast<float>(out);
}

inline std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t magnitude = bits ^ sign;
  const std::uint32_t f32_inf = 255u << 23;
  const std::uint32_t f16_overflow = (127u + 16u) << 23;  // first float that rounds to inf
  const std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  // Overflow and infinity give infinity; NaN keeps the top 10 payload bits and is quieted, as
  // the F16C instruction does, so both paths give the same bits.
  const std::uint32_t special =
      magnitude > f32_inf ? 0x7e00u | ((magnitude >> 13) & 0x3ffu) : 0x7c00u;
  // Results that are float16 subnormals: let the FPU round by adding a magic number.
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(std::bit_cast<float>(magnitude) +
                                                               std::bit_cast<float>(denorm_magic)) -
                                  denorm_magic;
  // Normal results: rebias, round to nearest even on bit 13.
  const std::uint32_t mant_odd = (magnitude >> 13) & 1u;
  const std::uint32_t normal =
      (magnitude + (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
  std::uint32_t out = magnitude < (113u << 23) ? subnormal : normal;
  out = magnitude >= f16_overflow ? special : out;
  return static_cast<std::uint16_t>(out | (sign >> 16));
}

inline float bfloat16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline std::uint16_t float_to_bfloat16_bits(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? ((bits >> 16) | 0x40u) : rounded);
}

inline float to_float(float16_t v) {
  return half_bits_to_float(v.bits);
}
inline float to_float(bfloat16_t v) {
  return bfloat16_bits_to_float(v.bits);
}
inline float16_t to_float16(float f) {
  return float16_t{float_to_half_bits(f)};
}
inline bfloat16_t to_bfloat16(float f) {
  return bfloat16_t{float_to_bfloat16_bits(f)};
}

}  // namespace gradcomm
