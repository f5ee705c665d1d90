#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace gradcomm {

// Element types gradcomm reduces. float16 and bfloat16 are accumulated in float32 and rounded
// back to nearest-even once per reduction step.
enum class DataType : int {
  float32 = 0,
  float64 = 1,
  float16 = 2,
  bfloat16 = 3,
  int32 = 4,
  int64 = 5,
};

inline constexpr DataType kAllDataTypes[] = {DataType::float32, DataType::float64,
                                             DataType::float16, DataType::bfloat16,
                                             DataType::int32,   DataType::int64};

// IEEE 754 binary16, stored as its bits. Conversions live in core/half.h.
struct float16_t {
  std::uint16_t bits;
};
// bfloat16 (the upper half of a float32), stored as its bits.
struct bfloat16_t {
  std::uint16_t bits;
};

bool is_valid(DataType dtype);
bool is_floating(DataType dtype);
// Bytes per element; 0 for an invalid value.
std::size_t element_size(DataType dtype);
// "float32", ...; "invalid" for a value outside the enum.
std::string_view to_string(DataType dtype);
std::optional<DataType> parse_data_type(std::string_view name);

template <class T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> {
  static constexpr DataType value = DataType::float32;
};
template <>
struct DataTypeOf<double> {
  static constexpr DataType value = DataType::float64;
};
template <>
struct DataTypeOf<float16_t> {
  static constexpr DataType value = DataType::float16;
};
template <>
struct DataTypeOf<bfloat16_t> {
  static constexpr DataType value = DataType::bfloat16;
};
template <>
struct DataTypeOf<std::int32_t> {
  static constexpr DataType value = DataType::int32;
};
template <>
struct DataTypeOf<std::int64_t> {
  static constexpr DataType value = DataType::int64;
};
// The DataType of a C++ element type, for typed overloads: dtype_of<float> == float32.
template <class T>
inline constexpr DataType dtype_of = DataTypeOf<T>::value;

}  // namespace gradcomm
