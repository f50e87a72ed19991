#include "common/compute_checks.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/errors.h"

namespace ranklab {

namespace {

std::string where(int rank, const char* op) {
  return fmt::format("rank {}: {}", rank, op);
}

void need_ndim(int rank, const char* op, const Tensor& t, int ndim, const char* arg, const char* layout) {
  if (t.ndim() != ndim) {
    throw UsageError(
        fmt::format("{}: '{}' must be {}-D {}; got {}", where(rank, op), arg, ndim, layout, t.str()));
  }
}

void need_shape(int rank, const char* op, const Tensor& t, const Shape& want, const char* arg,
                const char* meaning) {
  if (t.shape() != want) {
    throw UsageError(fmt::format("{}: '{}' is {}; expected shape {} ({})", where(rank, op), arg, t.str(),
                                 want.str(), meaning));
  }
}

void need_dtype(int rank, const char* op, const Tensor& t, DType dtype, const char* arg) {
  if (t.dtype() != dtype) {
    throw UsageError(
        fmt::format("{}: '{}' is {}; it must be {}", where(rank, op), arg, t.str(), dtype_name(dtype)));
  }
}

void need_same_dtype(int rank, const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    throw UsageError(
        fmt::format("{}: dtypes differ: {} and {}; cast one first", where(rank, op), a.str(), b.str()));
  }
}

void need_vocab_start(int rank, const char* op, std::int64_t vocab_start) {
  if (vocab_start < 0) {
    throw UsageError(fmt::format("{}: vocab_start {} is negative", where(rank, op), vocab_start));
  }
}

// The routes of a permutation: index a float32 [n] and weights, when given, a float32 of index's shape.
void need_routes(int rank, const char* op, const Tensor& index, const Tensor& weights) {
  need_ndim(rank, op, index, 1, "index", "[n]");
  need_dtype(rank, op, index, DType::Float32, "index");
  if (weights.defined()) {
    need_shape(rank, op, weights, index.shape(), "weights", "one a route of index");
    need_dtype(rank, op, weights, DType::Float32, "weights");
  }
}

}  // namespace

void check_view(int rank, const Tensor& base, std::int64_t offset, const Shape& shape) {
  const std::int64_t n = shape.numel();
  if (offset < 0 || offset > base.numel() - n) {  // no overflow near INT64_MAX
    std::int64_t end = 0;
    if (__builtin_add_overflow(offset, n, &end)) end = std::numeric_limits<std::int64_t>::max();
    throw UsageError(fmt::format("{}: elements [{}, {}) for shape {} are outside {}, which has {}",
                                 where(rank, "view"), offset, end, shape.str(), base.str(), base.numel()));
  }
}

Shape check_matmul(int rank, const char* op, const Tensor& a, const Tensor& b, Trans ta, Trans tb) {
  if (a.ndim() != 2 || b.ndim() != 2) {
    throw UsageError(fmt::format("{}: needs 2-D tensors; got {} and {}", where(rank, op), a.str(), b.str()));
  }
  if (is_float8(a.dtype()) || is_float8(b.dtype())) {
    if (!is_float8(a.dtype()) || !is_float8(b.dtype())) {
      throw UsageError(fmt::format("{}: an FP8 GEMM takes two FP8 inputs; got {} and {}: quantize both",
                                   where(rank, op), a.str(), b.str()));
    }
    if (a.dtype() == DType::Float8E5M2 && b.dtype() == DType::Float8E5M2) {
      throw UsageError(
          fmt::format("{}: no FP8 GEMM multiplies e5m2 by e5m2 (cuBLASLt's FP8 GEMMs take e4m3 "
                      "with e4m3 or e5m2); got {} and {}",
                      where(rank, op), a.str(), b.str()));
    }
  } else {
    need_same_dtype(rank, op, a, b);
  }
  const bool at = ta == Trans::Yes, bt = tb == Trans::Yes;
  const std::int64_t m = at ? a.size(1) : a.size(0), k = at ? a.size(0) : a.size(1);
  const std::int64_t kb = bt ? b.size(1) : b.size(0), n = bt ? b.size(0) : b.size(1);
  if (k != kb) {
    throw UsageError(fmt::format("{}: inner dimensions differ: {}{} @ {}{} ({} vs {})", where(rank, op),
                                 a.str(), at ? ".T" : "", b.str(), bt ? ".T" : "", k, kb));
  }
  return Shape{m, n};
}

void check_matmul_out(int rank, const Tensor& out, const Tensor& a, const Tensor& b, Trans ta, Trans tb,
                      bool accumulate) {
  const char* op = accumulate ? "matmul_add_" : "matmul_";
  need_shape(rank, op, out, check_matmul(rank, op, a, b, ta, tb), "out", "the product");
  const DType product = gemm_output(a.dtype());
  if (!accumulate) {
    need_dtype(rank, op, out, product, "out");
  } else if (out.dtype() != product && out.dtype() != DType::Float32) {
    throw UsageError(fmt::format("{}: 'out' is {}; it must be {} or float32", where(rank, op), out.str(),
                                 dtype_name(product)));
  }
  for (const Tensor* in : {&a, &b}) {
    if (!out.phantom() && in->phantom()) {
      throw UsageError(fmt::format("{}: writes phantom {} into real {}; make both phantom or both real",
                                   where(rank, op), in->str(), out.str()));
    }
  }
}

bool takes_float8(const char* op) {
  for (const char* ok : {"matmul_", "matmul_add_", "matmul", "to_host", "view", "copy_", "all_gather",
                         "all_to_all", "send", "recv", "broadcast"}) {
    if (std::strcmp(op, ok) == 0) return true;
  }
  return false;
}

void check_float8_use(int rank, const char* op, const Tensor& t, const char* arg) {
  if (is_float8(t.dtype())) {
    throw UsageError(
        fmt::format("{}: '{}' is {}; FP8 tensors go only into matmul, copies and communication that does "
                    "not add them up (quantize makes them)",
                    where(rank, op), arg, t.str()));
  }
}

void check_quantize(int rank, const Tensor& x, DType format, const Rank::Fp8Scaling& scaling,
                    const Tensor& scale, const Tensor& record_amax) {
  const char* op = "quantize";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  if (!is_float8(format)) {
    throw UsageError(fmt::format("{}: the format must be float8_e4m3 or float8_e5m2; got {}", where(rank, op),
                                 dtype_name(format)));
  }
  check_float8_use(rank, op, x, "x");
  if (scaling.per_tensor()) {
    if (!scale.defined()) {
      throw UsageError(fmt::format("{}: per-tensor scaling needs a scale (fp8_scale)", where(rank, op)));
    }
    need_shape(rank, op, scale, Shape{1}, "scale", "one per tensor");
    need_dtype(rank, op, scale, DType::Float32, "scale");
    if (record_amax.defined()) {
      need_shape(rank, op, record_amax, Shape{1}, "record_amax", "one per tensor");
      need_dtype(rank, op, record_amax, DType::Float32, "record_amax");
    }
    return;
  }
  if (record_amax.defined()) {
    throw UsageError(fmt::format("{}: block scaling records no amax; pass none", where(rank, op)));
  }
  if (scaling.block_rows <= 0 || scaling.block_cols <= 0) {
    throw UsageError(fmt::format("{}: blocks of {} x {} elements; both sides must be positive",
                                 where(rank, op), scaling.block_rows, scaling.block_cols));
  }
  if (scale.defined()) {
    throw UsageError(fmt::format("{}: block scaling computes its scales; pass no scale", where(rank, op)));
  }
}

void check_fp8_delayed_update(int rank, const Tensor& reduced, const std::vector<Tensor>& histories,
                              const std::vector<Tensor>& scales, const std::vector<Tensor>& amaxes,
                              DType format, int margin) {
  const char* op = "fp8_delayed_update";
  need_ndim(rank, op, reduced, 1, "reduced", "[tensors]");
  need_dtype(rank, op, reduced, DType::Float32, "reduced");
  const std::int64_t n = reduced.size(0);
  if (static_cast<std::int64_t>(histories.size()) != n || static_cast<std::int64_t>(scales.size()) != n ||
      static_cast<std::int64_t>(amaxes.size()) != n) {
    throw UsageError(fmt::format("{}: 'reduced' holds {} amaxes; got {} histories, {} scales and {} amaxes",
                                 where(rank, op), n, histories.size(), scales.size(), amaxes.size()));
  }
  if (!is_float8(format)) {
    throw UsageError(fmt::format("{}: the format must be float8_e4m3 or float8_e5m2; got {}", where(rank, op),
                                 dtype_name(format)));
  }
  if (margin < 0)
    throw UsageError(fmt::format("{}: the margin is {}; it must be >= 0", where(rank, op), margin));
  for (std::int64_t i = 0; i < n; ++i) {
    need_ndim(rank, op, histories[i], 1, "history", "[len - 1]");
    need_dtype(rank, op, histories[i], DType::Float32, "history");
    need_shape(rank, op, scales[i], Shape{1}, "scale", "one per tensor");
    need_dtype(rank, op, scales[i], DType::Float32, "scale");
    need_shape(rank, op, amaxes[i], Shape{1}, "amax", "one per tensor");
    need_dtype(rank, op, amaxes[i], DType::Float32, "amax");
  }
}

void check_randn_slice(int rank, const Shape& full, int dim, std::int64_t start, std::int64_t length) {
  const char* op = "randn_slice";
  if (dim < 0 || dim >= full.ndim()) {
    throw UsageError(
        fmt::format("{}: dimension {} is out of range for shape {}", where(rank, op), dim, full.str()));
  }
  if (start < 0 || length < 0 || start > full[dim] - length) {  // no overflow near INT64_MAX
    std::int64_t end = 0;
    if (__builtin_add_overflow(start, length, &end)) end = std::numeric_limits<std::int64_t>::max();
    throw UsageError(fmt::format("{}: [{}, {}) is outside dimension {} of shape {} (size {})",
                                 where(rank, op), start, end, dim, full.str(), full[dim]));
  }
}

void check_layernorm(int rank, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
  const char* op = "layernorm";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  const std::int64_t cols = x.size(1);
  need_shape(rank, op, gamma, Shape{cols}, "gamma", "the columns of x");
  need_shape(rank, op, beta, Shape{cols}, "beta", "the columns of x");
  need_same_dtype(rank, op, x, gamma);
  need_same_dtype(rank, op, x, beta);
  if (!(eps >= 0)) throw UsageError(fmt::format("{}: eps must be >= 0; got {}", where(rank, op), eps));
}

void check_rmsnorm(int rank, const Tensor& x, const Tensor& gamma, float eps) {
  const char* op = "rmsnorm";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  need_shape(rank, op, gamma, Shape{x.size(1)}, "gamma", "the columns of x");
  need_same_dtype(rank, op, x, gamma);
  if (!(eps >= 0)) throw UsageError(fmt::format("{}: eps must be >= 0; got {}", where(rank, op), eps));
}

void check_rmsnorm_backward(int rank, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                            const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  need_shape(rank, op, dy, x.shape(), "dy", "the shape of x");
  need_shape(rank, op, gamma, Shape{x.size(1)}, "gamma", "the columns of x");
  need_shape(rank, op, rstd, Shape{x.size(0)}, "rstd", "the rows of x");
  need_same_dtype(rank, op, x, dy);
  need_same_dtype(rank, op, x, gamma);
  need_dtype(rank, op, rstd, DType::Float32, "rstd");
}

void check_swiglu(int rank, const Tensor& x) {
  const char* op = "swiglu";
  need_ndim(rank, op, x, 2, "x", "[rows, 2 f]");
  if (x.size(1) % 2 != 0) {
    throw UsageError(
        fmt::format("{}: x is {}; its columns must be pairs (gate, value)", where(rank, op), x.str()));
  }
}

void check_swiglu_backward(int rank, const Tensor& dy, const Tensor& x) {
  const char* op = "swiglu_backward";
  need_ndim(rank, op, x, 2, "x", "[rows, 2 f]");
  if (x.size(1) % 2 != 0) {
    throw UsageError(
        fmt::format("{}: x is {}; its columns must be pairs (gate, value)", where(rank, op), x.str()));
  }
  need_shape(rank, op, dy, Shape{x.size(0), x.size(1) / 2}, "dy", "[rows of x, half its columns]");
  need_same_dtype(rank, op, x, dy);
}

void check_layernorm_backward(int rank, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                              const Tensor& mean, const Tensor& rstd) {
  const char* op = "layernorm_backward";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  const std::int64_t rows = x.size(0), cols = x.size(1);
  need_shape(rank, op, dy, x.shape(), "dy", "the shape of x");
  need_shape(rank, op, gamma, Shape{cols}, "gamma", "the columns of x");
  need_shape(rank, op, mean, Shape{rows}, "mean", "the rows of x");
  need_shape(rank, op, rstd, Shape{rows}, "rstd", "the rows of x");
  need_same_dtype(rank, op, x, dy);
  need_same_dtype(rank, op, x, gamma);
  need_dtype(rank, op, mean, DType::Float32, "mean");
  need_dtype(rank, op, rstd, DType::Float32, "rstd");
}

void check_gelu_backward(int rank, const Tensor& dy, const Tensor& x) {
  const char* op = "gelu_backward";
  need_shape(rank, op, dy, x.shape(), "dy", "the shape of x");
  need_same_dtype(rank, op, dy, x);
}

void check_dropout(int rank, const Tensor& x, float p, const Rank::DropoutRows& rows) {
  const char* op = "dropout";
  if (x.ndim() != 2) {
    throw UsageError(fmt::format("{}: x must be [rows, cols]; got {}", where(rank, op), x.str()));
  }
  if (!(p >= 0.0f && p < 1.0f)) {
    throw UsageError(fmt::format("{}: p must be at least 0 and below 1; got {}", where(rank, op), p));
  }
  if (rows.first_row < 0) {
    throw UsageError(
        fmt::format("{}: first_row must not be negative; got {}", where(rank, op), rows.first_row));
  }
  if (rows.split < 0 || rows.second_row < 0) {
    throw UsageError(
        fmt::format("{}: the second run of rows starts at row {} as global row {}; neither may be "
                    "negative",
                    where(rank, op), rows.split, rows.second_row));
  }
}

AttentionDims check_attention(int rank, const char* op, const Tensor& qkv, const AttentionSpec& spec) {
  const std::int64_t heads = spec.heads, groups = spec.groups(), batch = spec.batch;
  if (heads < 1 || groups < 1 || heads % groups != 0) {
    throw UsageError(
        fmt::format("{}: {} heads cannot share {} key-value heads: the query heads must be a "
                    "multiple of the key-value heads",
                    where(rank, op), heads, groups));
  }
  const std::int64_t width = heads + 2 * groups;  // head_dim columns each
  if (qkv.ndim() != 2 || batch < 1 || qkv.size(0) % batch != 0 || qkv.size(1) % width != 0 ||
      qkv.size(1) == 0) {
    throw UsageError(fmt::format(
        "{}: qkv must be [seq * batch, (heads + 2 kv_heads) * head_dim]; got {} with batch {}, {} heads and "
        "{} key-value heads",
        where(rank, op), qkv.str(), batch, heads, groups));
  }
  if (spec.window < 0 || (spec.window > 0 && !spec.causal)) {
    throw UsageError(
        fmt::format("{}: a sliding window of {} keys needs causal attention and a window >= 0 "
                    "(0: none); got causal = {}",
                    where(rank, op), spec.window, spec.causal));
  }
  if ((spec.window > 0 || spec.sinks.defined()) && spec.kernel != AttentionKernel::Flash) {
    throw UsageError(
        fmt::format("{}: sliding windows and sinks run in the fused attention kernels; the spec "
                    "asks for the unfused path",
                    where(rank, op)));
  }
  if (spec.sinks.defined()) check_sinks(rank, op, spec);
  return {qkv.size(0) / batch, qkv.size(1) / width};
}

void check_sinks(int rank, const char* op, const AttentionSpec& spec) {
  const Tensor& s = spec.sinks;
  if (!s.defined()) throw UsageError(fmt::format("{}: the spec has no sinks", where(rank, op)));
  need_shape(rank, op, s, Shape{spec.heads}, "sinks", "one logit per query head");
  if (is_float8(s.dtype())) {
    throw UsageError(
        fmt::format("{}: 'sinks' is {}; it must be float32, bfloat16 or float16", where(rank, op), s.str()));
  }
}

void check_attention_sinks(int rank, const char* op, const Tensor& out, const Tensor& lse,
                           const AttentionSpec& spec) {
  check_sinks(rank, op, spec);
  need_ndim(rank, op, lse, 3, "lse", "[batch, heads, seq]");
  const std::int64_t seq = lse.size(2);
  need_shape(rank, op, lse, Shape{spec.batch, spec.heads, seq}, "lse", "[batch, heads, seq]");
  need_dtype(rank, op, lse, DType::Float32, "lse");
  need_ndim(rank, op, out, 2, "out", "[seq * batch, heads * head_dim]");
  if (out.size(0) != seq * spec.batch || out.size(1) % spec.heads != 0 || is_float8(out.dtype())) {
    throw UsageError(
        fmt::format("{}: 'out' must be a float32, bfloat16 or float16 [seq * batch, heads * "
                    "head_dim] = [{} * {}, {} * head_dim]; got {}",
                    where(rank, op), seq, spec.batch, spec.heads, out.str()));
  }
}

AttentionDims check_attention_backward(int rank, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                       const Tensor& lse, const AttentionSpec& spec) {
  const char* op = "attention_backward";
  const AttentionDims a = check_attention(rank, op, qkv, spec);
  const Shape out_shape{qkv.size(0), spec.heads * a.head_dim};
  need_shape(rank, op, out, out_shape, "out", "attention's output for qkv");
  need_shape(rank, op, dout, out_shape, "dout", "attention's output for qkv");
  need_shape(rank, op, lse, Shape{spec.batch, spec.heads, a.seq}, "lse", "[batch, heads, seq]");
  need_same_dtype(rank, op, qkv, out);
  need_same_dtype(rank, op, qkv, dout);
  need_dtype(rank, op, lse, DType::Float32, "lse");
  return a;
}

AttentionDims check_key_values(int rank, const char* op, const Tensor& qkv, const Tensor& kv,
                               const AttentionSpec& spec) {
  const AttentionDims a = check_attention(rank, op, qkv, spec);
  const std::int64_t width = 2 * spec.groups() * a.head_dim;
  if (kv.ndim() != 2 || kv.size(1) != width || kv.size(0) % spec.batch != 0 || kv.size(0) == 0) {
    throw UsageError(
        fmt::format("{}: kv must be [kv_seq * batch, 2 * key-value heads * head_dim] = [kv_seq * {}, {}] for "
                    "qkv {}; got {}",
                    where(rank, op), spec.batch, width, qkv.str(), kv.str()));
  }
  need_same_dtype(rank, op, qkv, kv);
  return a;
}

BlockRange check_attention_block(int rank, const char* op, const Tensor& qkv, const Tensor& kv,
                                 const Tensor& out, const Tensor& lse, const AttentionSpec& spec,
                                 const Rank::AttentionBlock& block) {
  if (spec.kernel != AttentionKernel::Flash) {
    throw UsageError(fmt::format(
        "{}: context-parallel blocks run in fused attention kernels; the spec asks for the unfused path",
        where(rank, op)));
  }
  if (spec.sinks.defined()) {
    throw UsageError(
        fmt::format("{}: a block takes no sinks; attention_sinks_ merges them once, after the "
                    "blocks",
                    where(rank, op)));
  }
  if (spec.window > 0 && !block.causal) {
    throw UsageError(fmt::format(
        "{}: a block under a sliding window compares positions, so it must be causal", where(rank, op)));
  }
  const AttentionDims a = check_key_values(rank, op, qkv, kv, spec);
  need_shape(rank, op, out, Shape{qkv.size(0), spec.heads * a.head_dim}, "out",
             "[seq * batch, heads * head_dim]");
  need_shape(rank, op, lse, Shape{spec.batch, spec.heads, a.seq}, "lse", "[batch, heads, seq]");
  need_dtype(rank, op, lse, DType::Float32, "lse");
  if (is_float8(out.dtype())) {
    throw UsageError(
        fmt::format("{}: 'out' is {}; it must be float32, bfloat16 or float16", where(rank, op), out.str()));
  }
  const std::int64_t count = block.q_count < 0 ? a.seq - block.q_first : block.q_count;
  if (block.q_first < 0 || count < 1 || block.q_first + count > a.seq) {
    throw UsageError(fmt::format("{}: the block's queries [{}, {}) are not within qkv's {} positions",
                                 where(rank, op), block.q_first, block.q_first + count, a.seq));
  }
  if (block.q_position < 0 || block.kv_position < 0) {
    throw UsageError(fmt::format("{}: the block's positions must not be negative; got q {} and kv {}",
                                 where(rank, op), block.q_position, block.kv_position));
  }
  return {block.q_first, block.q_first + count};
}

AttentionDims check_rope(int rank, const Tensor& qkv, const AttentionSpec& spec, std::int64_t first_position,
                         double base) {
  const char* op = "rope_";
  const AttentionDims a = check_attention(rank, op, qkv, spec);
  if (a.head_dim % 2 != 0) {
    throw UsageError(fmt::format("{}: head_dim {} is odd; rotary embeddings rotate pairs of columns",
                                 where(rank, op), a.head_dim));
  }
  if (first_position < 0) {
    throw UsageError(fmt::format("{}: first_position must be >= 0; got {}", where(rank, op), first_position));
  }
  if (!(base > 1) || !std::isfinite(base)) {
    throw UsageError(fmt::format("{}: base must be a finite number above 1; got {}", where(rank, op), base));
  }
  return a;
}

void check_gather_rows(int rank, const Tensor& x, const Tensor& index, const Tensor& weights) {
  const char* op = "gather_rows";
  need_ndim(rank, op, x, 2, "x", "[rows, cols]");
  check_float8_use(rank, op, x, "x");
  need_routes(rank, op, index, weights);
}

void check_scatter_add_rows(int rank, const Tensor& src, const Tensor& index, const Tensor& weights,
                            std::int64_t rows) {
  const char* op = "scatter_add_rows";
  need_ndim(rank, op, src, 2, "src", "[n, cols]");
  check_float8_use(rank, op, src, "src");
  need_routes(rank, op, index, weights);
  if (src.size(0) != index.size(0)) {
    throw UsageError(fmt::format("{}: 'src' is {} and 'index' is {}; src needs one row a route of index",
                                 where(rank, op), src.str(), index.str()));
  }
  if (rows < 0) throw UsageError(fmt::format("{}: rows {} is negative", where(rank, op), rows));
}

void check_row_dots(int rank, const Tensor& a, const Tensor& b) {
  const char* op = "row_dots";
  need_ndim(rank, op, a, 2, "a", "[n, cols]");
  need_shape(rank, op, b, a.shape(), "b", "the shape of a");
  check_float8_use(rank, op, a, "a");
  need_same_dtype(rank, op, a, b);
}

std::vector<std::int64_t> check_route_rows(int rank, const char* op, const float* index, std::int64_t n,
                                           std::int64_t rows, const char* what) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = index[i];
    if (!(v >= 0) || v != std::floor(v) || static_cast<double>(v) >= static_cast<double>(rows)) {
      throw UsageError(fmt::format("{}: index[{}] is {}; a route's row must be an integer in [0, {}) ({})",
                                   where(rank, op), i, v, rows, what));
    }
    out[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(v);
  }
  return out;
}

void check_embedding(int rank, const Tensor& ids, const Tensor& table, std::int64_t vocab_start) {
  const char* op = "embedding";
  need_ndim(rank, op, ids, 1, "ids", "[rows]");
  need_ndim(rank, op, table, 2, "table", "[vocab rows, dim]");
  need_vocab_start(rank, op, vocab_start);
  need_dtype(rank, op, ids, DType::Float32, "ids");
}

void check_embedding_backward(int rank, const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                              std::int64_t vocab_start) {
  const char* op = "embedding_backward_";
  need_ndim(rank, op, ids, 1, "ids", "[rows]");
  need_ndim(rank, op, dtable, 2, "dtable", "[vocab rows, dim]");
  need_vocab_start(rank, op, vocab_start);
  need_shape(rank, op, dy, Shape{ids.size(0), dtable.size(1)}, "dy", "[ids, columns of dtable]");
  need_dtype(rank, op, dtable, DType::Float32, "dtable");
  need_dtype(rank, op, ids, DType::Float32, "ids");
}

void check_row_max(int rank, const Tensor& logits) {
  need_ndim(rank, "row_max", logits, 2, "logits", "[rows, vocab shard]");
}

void check_softmax_stats(int rank, const Tensor& logits, const Tensor& row_max, const Tensor& targets,
                         std::int64_t vocab_start) {
  const char* op = "softmax_stats";
  need_ndim(rank, op, logits, 2, "logits", "[rows, vocab shard]");
  need_vocab_start(rank, op, vocab_start);
  const std::int64_t rows = logits.size(0);
  need_shape(rank, op, row_max, Shape{rows}, "row_max", "the rows of logits");
  need_shape(rank, op, targets, Shape{rows}, "targets", "the rows of logits");
  need_dtype(rank, op, row_max, DType::Float32, "row_max");
  need_dtype(rank, op, targets, DType::Float32, "targets");
}

void check_cross_entropy_loss(int rank, const Tensor& row_max, const Tensor& stats) {
  const char* op = "cross_entropy_loss";
  need_ndim(rank, op, row_max, 1, "row_max", "[rows]");
  need_shape(rank, op, stats, Shape{row_max.size(0), 2}, "stats", "[rows of row_max, 2]");
  need_dtype(rank, op, row_max, DType::Float32, "row_max");
  need_dtype(rank, op, stats, DType::Float32, "stats");
}

void check_cross_entropy_backward(int rank, const Tensor& logits, const Tensor& row_max, const Tensor& stats,
                                  const Tensor& targets, std::int64_t vocab_start) {
  const char* op = "cross_entropy_backward";
  need_ndim(rank, op, logits, 2, "logits", "[rows, vocab shard]");
  need_vocab_start(rank, op, vocab_start);
  const std::int64_t rows = logits.size(0);
  need_shape(rank, op, row_max, Shape{rows}, "row_max", "the rows of logits");
  need_shape(rank, op, stats, Shape{rows, 2}, "stats", "[rows of logits, 2]");
  need_shape(rank, op, targets, Shape{rows}, "targets", "the rows of logits");
  need_dtype(rank, op, row_max, DType::Float32, "row_max");
  need_dtype(rank, op, stats, DType::Float32, "stats");
  need_dtype(rank, op, targets, DType::Float32, "targets");
}

}  // namespace ranklab
