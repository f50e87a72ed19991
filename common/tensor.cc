#include "common/tensor.h"

#include <fmt/format.h>

#include "common/errors.h"

namespace ranklab {

std::int64_t dtype_bytes(DType t) {
  switch (t) {
    case DType::Float32:
      return 4;
  }
  return 4;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32:
      return "float32";
  }
  return "?";
}

Shape::Shape(std::initializer_list<std::int64_t> dims) : Shape(std::vector<std::int64_t>(dims)) {}

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
}

std::int64_t Shape::operator[](int i) const {
  if (i < 0 || i >= ndim_) {
    throw UsageError(fmt::format("dimension {} is out of range for shape {}", i, str()));
  }
  return dims_[i];
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

Shape Shape::with_dim(int i, std::int64_t size) const {
  (void)(*this)[i];  // range check
  std::vector<std::int64_t> d = dims();
  d[i] = size;
  return Shape(d);
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i) {
    if (dims_[i] != o.dims_[i]) return false;
  }
  return true;
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{}{}", dtype_name(dtype_), shape_.str(), phantom() ? " phantom" : "");
}

}  // namespace ranklab
