#include "common/tensor.h"

#include <fmt/format.h>

#include <limits>

#include "common/errors.h"

namespace ranklab {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32:
      return "float32";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float16:
      return "float16";
    case DType::Float8E4M3:
      return "float8_e4m3";
    case DType::Float8E5M2:
      return "float8_e5m2";
  }
  return "?";
}

namespace {
// The most elements a shape may hold: its bytes at the widest dtype (8) must fit an int64.
constexpr std::int64_t kMaxElements = std::numeric_limits<std::int64_t>::max() / 8;

// numel() and bytes() multiply the dimensions: a product past int64 would wrap (to 0, say) and every size
// computed from it would be wrong.
void check_element_count(const std::array<std::int64_t, Shape::kMaxDims>& dims, int ndim,
                         const Shape& shape) {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    if (__builtin_mul_overflow(n, dims[i], &n) || n > kMaxElements) {
      throw UsageError(
          fmt::format("shape {} has too many elements: more than {} (2^60) would overflow a "
                      "byte count",
                      shape.str(), kMaxElements));
    }
  }
}
}  // namespace

// Filled in place rather than through a vector: kernels make shapes on every launch.
Shape::Shape(std::initializer_list<std::int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxDims)) {
    throw UsageError(fmt::format("a tensor has at most {} dimensions; got {}", kMaxDims, dims.size()));
  }
  int i = 0;
  for (std::int64_t d : dims) {
    if (d < 0) throw UsageError(fmt::format("dimension {} of a shape is negative ({})", i, d));
    dims_[i++] = d;
  }
  ndim_ = i;
  check_element_count(dims_, ndim_, *this);
}

Shape::Shape(const std::vector<std::int64_t>& dims) {
  if (dims.size() > static_cast<size_t>(kMaxDims)) {
    throw UsageError(fmt::format("a tensor has at most {} dimensions; got {}", kMaxDims, dims.size()));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) {
      throw UsageError(fmt::format("dimension {} of a shape is negative ({})", i, dims[i]));
    }
    dims_[i] = dims[i];
  }
  ndim_ = static_cast<int>(dims.size());
  check_element_count(dims_, ndim_, *this);
}

void Shape::out_of_range(int i) const {
  throw UsageError(fmt::format("dimension {} is out of range for shape {}", i, str()));
}

Shape Shape::with_dim(int i, std::int64_t size) const {
  (void)(*this)[i];  // range check
  if (size < 0) throw UsageError(fmt::format("dimension {} of a shape is negative ({})", i, size));
  Shape out = *this;
  out.dims_[i] = size;
  return out;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i) {
    if (dims_[i] != o.dims_[i]) return false;
  }
  return true;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(dims(), ", "));
}

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{}{}", dtype_name(dtype_), shape_.str(), phantom() ? " phantom" : "");
}

namespace {
// Integers print without a decimal point, as the lecture writes them.
std::string format_number(float x) {
  if (x == static_cast<float>(static_cast<long long>(x)) && x > -1e9f && x < 1e9f) {
    return fmt::format("{}", static_cast<long long>(x));
  }
  return fmt::format("{:.4g}", x);
}

// At most this many numbers per innermost row before the middle is elided.
constexpr std::int64_t kMaxRowItems = 12;

void append_row(std::string& out, const float* row, std::int64_t n) {
  out += '[';
  for (std::int64_t i = 0; i < n; ++i) {
    if (n > kMaxRowItems && i == kMaxRowItems / 2) {
      out += "..., ";
      i = n - kMaxRowItems / 2;
    }
    out += format_number(row[i]);
    if (i + 1 < n) out += ", ";
  }
  out += ']';
}

void append_dims(std::string& out, const std::vector<std::int64_t>& dims, size_t d, const float* data) {
  if (d + 1 == dims.size()) {
    append_row(out, data, dims[d]);
    return;
  }
  std::int64_t stride = 1;
  for (size_t k = d + 1; k < dims.size(); ++k) stride *= dims[k];
  out += '[';
  for (std::int64_t i = 0; i < dims[d]; ++i) {
    append_dims(out, dims, d + 1, data + i * stride);
    if (i + 1 < dims[d]) out += ", ";
  }
  out += ']';
}
}  // namespace

std::string format_values(const Shape& shape, const std::vector<float>& values) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel()) {
    throw UsageError(fmt::format("format_values: {} values for shape {}", values.size(), shape.str()));
  }
  if (shape.ndim() == 0) return format_number(values[0]);
  std::string out;
  append_dims(out, shape.dims(), 0, values.data());
  return out;
}

}  // namespace ranklab
