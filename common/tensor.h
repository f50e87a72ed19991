// Tensor: a shape, a dtype and a buffer that belongs to the backend that made it.
//
// Lessons never see the buffer: they hand tensors to the Rank that made them, which knows whether the
// bytes live in host memory (the simulator) or on a GPU (the real backend). A *phantom* tensor has a
// shape and no bytes at all, so a lesson can be timed at sizes no laptop could hold; every operation
// accepts phantoms and only advances time, and their memory is still accounted.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "common/units.h"  // format_bytes, for the messages about tensors

namespace ranklab {

// Element types. Float32 is what the lessons compute in; BFloat16 and Float16 are the 16-bit types mixed
// precision trains in (weights, activations and GEMMs in 16 bits; master weights, optimizer state and
// usually the gradient reduction in float32). The simulator keeps every value as a float but rounds a
// 16-bit tensor's values to its type after every kernel that writes it (round to nearest even), so its
// numbers are the ones a GPU holds; memory is accounted at the type's size.
//
// Float8E4M3 and Float8E5M2 are FP8 training's formats (common/dtype_round.h). An FP8 tensor is made only by
// Rank::quantize, which scales a tensor into the format's range; its elements read as the values they
// stand for (the stored number divided by its scale), and the one kernel that takes it is matmul.
enum class DType { Float32, BFloat16, Float16, Float8E4M3, Float8E5M2 };

// Inline, as the next few: every kernel and collective asks them several times.
inline std::int64_t dtype_bytes(DType t) {
  switch (t) {
    case DType::Float32:
      return 4;
    case DType::BFloat16:
    case DType::Float16:
      return 2;
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      return 1;
  }
  return 4;
}
const char* dtype_name(DType t);
inline bool is_float8(DType t) {
  return t == DType::Float8E4M3 || t == DType::Float8E5M2;
}
// The dtype a GEMM of `inputs` writes: its own, or bfloat16 for FP8 inputs (TransformerEngine's FP8 GEMMs
// write their output in the 16-bit type the model trains in).
inline DType gemm_output(DType inputs) {
  return is_float8(inputs) ? DType::BFloat16 : inputs;
}

// A shape of 0 to 4 dimensions (0 dimensions is a scalar of one element).
class Shape {
 public:
  static constexpr int kMaxDims = 4;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(const std::vector<std::int64_t>& dims);

  int ndim() const { return ndim_; }
  std::int64_t operator[](int i) const {
    if (i < 0 || i >= ndim_) out_of_range(i);
    return dims_[i];
  }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim_; ++i) n *= dims_[i];
    return n;
  }
  std::vector<std::int64_t> dims() const { return {dims_.begin(), dims_.begin() + ndim_}; }
  // Replaces dimension `i` (used by slicing and concatenation).
  Shape with_dim(int i, std::int64_t size) const;

  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[4, 8]"

 private:
  [[noreturn]] void out_of_range(int i) const;  // UsageError naming `i` and the shape

  std::array<std::int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

// The bytes behind a tensor. Backends derive from it; its destructor returns the bytes to the owning
// rank's memory account. `data()` is null for phantom tensors.
class Storage {
 public:
  Storage(int owner_rank, std::int64_t bytes) : owner_rank_(owner_rank), bytes_(bytes) {}
  virtual ~Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  int owner_rank() const { return owner_rank_; }
  std::int64_t bytes() const { return bytes_; }
  virtual bool phantom() const = 0;

 private:
  int owner_rank_;
  std::int64_t bytes_;
};

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor; using it in an operation is an error
  Tensor(Shape shape, DType dtype, std::shared_ptr<Storage> storage)
      : shape_(shape), dtype_(dtype), storage_(std::move(storage)) {}

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  std::int64_t size(int dim) const { return shape_[dim]; }
  int ndim() const { return shape_.ndim(); }
  std::int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  std::int64_t bytes() const { return numel() * dtype_bytes(dtype_); }
  bool phantom() const { return storage_ && storage_->phantom(); }
  int owner_rank() const { return storage_ ? storage_->owner_rank() : -1; }

  // For backends: the buffer, down-cast by the backend that made it.
  Storage* storage() const { return storage_.get(); }
  // Two tensors that share storage are the same tensor for aliasing checks.
  bool same_storage(const Tensor& o) const { return storage_ == o.storage_; }
  std::string str() const;  // "float32[4, 8]" (with " phantom" when it has no bytes)

 private:
  Shape shape_;
  DType dtype_ = DType::Float32;
  std::shared_ptr<Storage> storage_;
};

// Values in the lecture's notation: "[0, 1, 2, 3]", rows nested for 2-D and up, long runs elided.
std::string format_values(const Shape& shape, const std::vector<float>& values);

}  // namespace ranklab
