// Data parallelism with mixed precision and ZeRO (Rajbhandari et al. 2020).
//
// Mixed precision keeps, for every parameter, a 16-bit copy the GEMMs read (2 bytes), a float32 master
// copy the optimizer updates (4), a float32 gradient the micro-batches add into (4) and Adam's two float32
// moments (8): 18 bytes per parameter, the same on every data-parallel rank. ZeRO removes the redundancy
// in stages; each rank of the dp group owns 1/dp of every tensor's rows (its shard):
//
//   zero 0  everything whole. After the step's last backward, all_reduce(Avg) the gradients.
//   zero 1  the optimizer state (master weights, moments) is sharded: the gradient is still all-reduced
//           whole, each rank updates its shard, and an all_gather rebuilds the 16-bit weights.
//   zero 2  the gradients are sharded too: each micro-batch's gradient is reduce-scattered as soon as
//           backward makes it, and each rank keeps only its shard's sum. More traffic (once per
//           micro-batch, not per step), a 1/dp gradient buffer.
//   zero 3  the 16-bit weights are sharded as well (FSDP): a layer's weights are all-gathered just before
//           its forward and again before its backward, and freed after use.
//
// Overlap: the reductions are asynchronous. With zero 0 and 1 a layer's gradients are final when its last
// micro-batch's backward is done; that layer is a bucket and its all-reduces start at once, while the
// layers below it are still in backward. With zero 2 and 3 each micro-batch's reduce-scatters start as
// the layer's backward produces them and are waited on one task later. zero 3 gathers the next layer's
// weights while the current one computes.
//
// Shards are rows (dim 0), the dimension reduce_scatter and all_gather split. A tensor whose rows do not
// divide by dp is padded with zero rows; the padding stays zero.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/rank.h"
#include "lessons/parallel/exposed.h"

namespace ranklab::parallel {

struct ParamSpec {
  std::string name;         // "layer 3 qkv weight"
  Shape full;               // the whole parameter, as one device holds it
  int tp_dim = -1;          // the dimension tensor parallelism splits, or -1: every tp rank holds all of it
  bool decay = true;        // AdamW's weight decay applies (not to biases and norms)
  bool sp_partial = false;  // with sequence parallelism a tp rank's gradient covers its own tokens only
  bool tied = false;        // the word embedding: the output layer shares it
  std::uint64_t seed = 0;
  float std = 0;  // normal(0, std) from `seed` when std > 0, else the constant `value`
  float value = 0;
};

struct Param {
  ParamSpec spec;
  Shape local;                // this tp rank's part
  std::int64_t tp_start = 0;  // where it starts along spec.tp_dim
  std::int64_t rows = 0, rows_padded = 0, shard_rows = 0;
  Tensor copy;    // compute dtype: the local part (zero 3: this rank's shard)
  Tensor master;  // float32: the local part (zero >= 1: the shard)
  Tensor grad;    // float32: the local part (zero >= 2: the shard)
  Tensor m, v;    // float32, like master
};

struct ZeroConfig {
  int stage = 0;
  DType dtype = DType::BFloat16;        // weights and activations
  DType reduce_dtype = DType::Float32;  // the gradient reduction
  bool phantom = false;
  int tp_rank = 0, tp_size = 1, dp_rank = 0, dp_size = 1;
  Group tp, dp, embedding;
  bool seq_parallel = false;
  bool embedding_group = false;  // the tied embedding lives on two ranks (pp > 1)
  std::string broken;            // a deliberate bug for the tests: dp-sum, no-reduce-scatter
};

class DataParallel {
 public:
  DataParallel(Rank& r, ZeroConfig c, ExposedComm& exposed);

  // Makes the parameter's tensors: the local part of the seeded full tensor, cast and sharded.
  void init(Param& p);
  // Bytes one parameter takes, by kind, before it is made (the pre-flight estimate uses it too).
  struct Bytes {
    std::int64_t weights = 0, grads = 0, optimizer = 0;
  };
  static Bytes bytes(const ParamSpec& s, const ZeroConfig& c);

  // The weight as the GEMMs read it. zero 3: an asynchronous all_gather of the shards, prefetched before
  // the layer before it computes; get() waits for it.
  struct Gathered {
    Param* p = nullptr;
    Tensor full;
    Work work;
  };
  Gathered gather(Param& p);
  Tensor get(Gathered& g);

  // A micro-batch's gradient (any dtype, the local part's shape) into the parameter's float32 gradient.
  void add_grad(Param& p, const Tensor& g);
  // The float32 tensor the embedding's backward adds into, and its hand-over.
  Tensor embedding_grad_target(Param& p);
  void embedding_grad_done(Param& p, const Tensor& target);
  // These parameters' gradients are final for this step (their last micro-batch's backward is done).
  void bucket_ready(const std::vector<Param*>& ps);
  // Waits for the reductions ZeRO 2 and 3 started one task ago.
  void drain();
  // After the last backward: waits for every reduction, then adds the gradients of sequence-parallel
  // parameters over tp and those of the tied embedding over its two stages.
  void finish(const std::vector<Param*>& ps);
  // AdamW on this rank's part, then the 16-bit weights rebuilt (all_gather for zero 1 and 2).
  void step(const std::vector<Param*>& ps, const AdamW& h, int t);
  void zero_grads(const std::vector<Param*>& ps);

  // Rows [first, first + count) of the local part this rank's shard holds that are real (not padding).
  std::int64_t shard_first_row(const Param& p) const;
  std::int64_t shard_valid_rows(const Param& p) const;

 private:
  Tensor pad(const Param& p, const Tensor& t);    // rows up to rows_padded
  Tensor unpad(const Param& p, const Tensor& t);  // back to rows
  Tensor shard_of(const Param& p, const Tensor& local);
  ReduceOp dp_op() const;

  Rank& r_;
  ZeroConfig c_;
  ExposedComm& exposed_;
  struct Pending {
    Param* p;
    Tensor out, in;  // in: kept alive until the reduction finishes
    Work work;
  };
  std::vector<Pending> pending_, pending_prev_, reduces_;
};

}  // namespace ranklab::parallel
