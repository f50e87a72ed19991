// Data parallelism with mixed precision and ZeRO (Rajbhandari et al. 2020).
//
// Mixed precision keeps, for every parameter, a 16-bit copy the GEMMs read (2 bytes), a float32 master
// copy the optimizer updates (4), a gradient the micro-batches add into (4 in float32) and Adam's two
// float32 moments (8): 18 bytes per parameter, the same on every data-parallel rank. ZeRO removes the
// redundancy in stages; each rank of the dp group owns 1/dp of it (its shard):
//
//   zero 0  everything whole. After the step's last backward, all_reduce(Avg) the gradients.
//   zero 1  the optimizer state (master weights, moments) is sharded: the gradients are reduce-scattered
//           after the step's last backward, each rank updates its shard, and an all_gather rebuilds the
//           16-bit weights: the traffic of one all-reduce (Rajbhandari et al. 2020, section 7.2.1).
//   zero 2  the gradients are sharded too: each micro-batch's gradient is reduce-scattered as soon as
//           backward makes it, and each rank keeps only its shard's sum. More traffic (once per
//           micro-batch, not per step), a 1/dp gradient buffer.
//   zero 3  the 16-bit weights are sharded as well (FSDP): a layer's weights are all-gathered just before
//           its forward and again before its backward, and freed after use.
//
// Zero 2 and 3 gather and reduce a transformer block's parameters together, as FSDP wraps each block in a
// unit of its own (torch.distributed.fsdp.fully_shard, torchtitan's per-block wrapping): one all_gather of
// the block's shards concatenated, then copied out into each parameter, and one reduce_scatter of the
// block's gradients laid out rank by rank (FSDP2's copy-in, copy-out and chunk_cat), in place of one small
// collective per parameter, whose latency the biases and norms would pay each.
//
// Zero 0 and 1 lay the parameters out as Megatron-LM's distributed data parallelism does
// (megatron/core/distributed/param_and_grad_buffer.py, Megatron-Core 0.7 on): the parameters are grouped
// into buckets in the order backward makes their gradients final (the reverse of the forward's), and each
// bucket is one flat buffer of gradients, every parameter's gradient a view of it (Rank::view), so a
// bucket is reduced by one collective however many parameters it holds. The gradients are kept and reduced
// in the reduction dtype (float32 unless --grad-reduce-dtype says otherwise). Zero 1 is Megatron's
// distributed optimizer: the bucket's weights are a flat buffer too; each rank's shard is a contiguous
// 1/dp of the bucket, across parameter boundaries, reduce-scattered in place, updated, and all-gathered in
// place into the weights. Its buckets are padded to a multiple of lcm(dp, 128) elements and each parameter
// starts on a multiple of 64 (aligned addresses for cuBLAS and NCCL), and the tied embedding of a pipeline
// has a bucket of its own, so that both stages shard it alike. A bucket holds at least `bucket_params`
// parameters, max(40M, 1M x dp) unless set (DistributedDataParallelConfig.bucket_size); without
// overlap_grad_reduce the stage is one bucket, as Megatron makes it.
//
// Zero 2 and 3 shard tensor by tensor: each rank owns 1/dp of every tensor's rows (dim 0, the dimension
// reduce_scatter and all_gather split); a tensor whose rows do not divide by dp is padded with zero rows.
//
// Overlap, as Megatron-LM and FSDP schedule it:
//
//   plain                  zero 0 and 1 reduce every bucket after the last backward, the compute stream
//                          waiting for each; zero 2 and 3 reduce-scatter each micro-batch's gradients as
//                          backward makes them, a unit at a time, and wait at once; zero 1 and 2 all-gather
//                          the updated weights at the end of the step; zero 3 gathers a layer's weights when
//                          it needs them.
//   overlap_grad_reduce    a bucket's reduction starts when its last gradient of the step is final, while
//                          the layers below it are still in backward (zero 0, 1); a unit's
//                          reduce-scatter runs beside the next unit's backward and is waited for when
//                          that one's is issued, the task's last one by the next task (zero 2, 3).
//   overlap_param_gather   zero 1 and 2: the step's first bucket's all_gather starts as the next step
//                          begins and each bucket's forward starts the next one's, so the forward waits only
//                          for what has not arrived (Megatron's forward pre-hook); zero 3: the next layer's
//                          weights are gathered while the current one computes, forward and backward.
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
  bool tp_partial = false;  // a tp rank's gradient covers its own heads only (QK-norm's gains)
  bool tied = false;        // the word embedding: the output layer shares it
  std::uint64_t seed = 0;
  float std = 0;  // normal(0, std) from `seed` when std > 0, else the constant `value`
  float value = 0;
};

struct Param {
  ParamSpec spec;
  Shape local;                // this tp rank's part
  std::int64_t tp_start = 0;  // where it starts along spec.tp_dim
  std::int64_t rows = 0;      // of the local part
  // Its tensors by ZeRO stage (zero 1 on one dp rank is zero 0); "rows": this rank's rows of the local part
  //   copy:   compute dtype, the local part; zero 1: a view of its bucket's weights; zero 3: rows
  //   master: float32, the local part; zero 1: none, its bucket holds the shard's; zero 2, 3: rows
  //   grad:   zero 0, 1: a view of its bucket's gradients, in the reduction dtype; zero 2, 3: float32 rows
  //   m, v:   float32, like master
  Tensor copy, master, grad, m, v;
  int bucket = -1;          // the bucket of its gradient and of its weights' gather
  std::int64_t offset = 0;  // zero 0, 1: its first element in the bucket's buffers
  // zero 2, 3: rows of each rank's shard, and the local rows padded to dp of them.
  std::int64_t shard_rows = 0, rows_padded = 0;
  int unit = -1;  // zero 2, 3: the unit it is gathered and reduced with (add_unit), or -1: on its own
};

struct ZeroConfig {
  int stage = 0;
  DType dtype = DType::BFloat16;        // weights and activations
  DType reduce_dtype = DType::Float32;  // the gradients of zero 0 and 1, and every reduction
  bool phantom = false;
  int tp_rank = 0, tp_size = 1, dp_rank = 0, dp_size = 1;
  Group tp, dp, embedding;
  bool seq_parallel = false;
  bool embedding_group = false;  // the tied embedding lives on two ranks (pp > 1)
  bool counts_tied = true;       // this rank's copy of the tied embedding counts in the gradient norm
  std::string broken;            // a deliberate bug for the tests: dp-sum, no-reduce-scatter
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool grad_accum_fusion = false;  // weight-gradient GEMMs sum into the gradients (wgrad_into)
  std::int64_t bucket_params = 0;  // 0: max(40M, 1M x dp)
};
// The parameters of one bucket by Megatron's rule, for a data-parallel group of `dp_size`.
std::int64_t default_bucket_params(int dp_size);
// The part of `s` a rank of a tensor-parallel group of `tp_size` holds.
Shape local_shape(const ParamSpec& s, int tp_size);
// All that the buckets and the bytes of a parameter depend on: its local part's elements and rows, and
// whether it is the tied embedding. (A memory plan counts the bytes of tens of thousands of expert weights
// without making their specs.)
struct LocalSize {
  std::int64_t elements = 0, rows = 0;
  bool tied = false;
};
LocalSize local_size(const ParamSpec& s, int tp_size);

// Zero 0 and 1: where each parameter (in backward order) lies in which bucket, and each bucket's elements.
struct BucketLayout {
  std::vector<int> bucket;             // per parameter
  std::vector<std::int64_t> offset;    // per parameter: its first element in the bucket
  std::vector<std::int64_t> elements;  // per bucket, padded as the distributed optimizer pads it
};
BucketLayout layout_buckets(const std::vector<LocalSize>& backward_order, const ZeroConfig& c);

class DataParallel {
 public:
  DataParallel(Rank& r, ZeroConfig c, ExposedComm& exposed);

  // Groups the parameters into buckets (`backward_order` lists them as backward makes their gradients
  // final) and makes zero 0's and 1's flat buffers; then init() makes each parameter's tensors.
  void set_buckets(const std::vector<Param*>& backward_order);
  // Makes the parameter's tensors: the local part of the seeded full tensor, cast and sharded.
  void init(Param& p);
  // Zero 2 and 3 (after set_buckets): these parameters, a block's, are one unit: gathered by one all_gather
  // and their gradients reduced by one reduce_scatter once backward has given each of them (add_grad).
  void add_unit(const std::vector<Param*>& ps);
  // Bytes the parameters take, by kind, before they are made (the pre-flight estimate uses it too): the
  // whole set as the lesson lays it out, or one tensor sharded by rows (zero 2 and 3; the zero lesson's way).
  struct Bytes {
    std::int64_t weights = 0, grads = 0, optimizer = 0;
    Bytes& operator+=(const Bytes& o) {
      weights += o.weights, grads += o.grads, optimizer += o.optimizer;
      return *this;
    }
  };
  static Bytes bytes(const std::vector<LocalSize>& backward_order, const ZeroConfig& c);
  static Bytes bytes(const LocalSize& s, const ZeroConfig& c);

  // The step begins: the buckets' gradients are not final yet, and with overlap_param_gather the first
  // bucket's all_gather of the weights the previous step updated starts.
  void start_step();

  // The weight as the GEMMs read it. zero 3: an all_gather of the shards (asynchronous with
  // overlap_param_gather, prefetched before the layer before it computes); zero 1 and 2 with
  // overlap_param_gather: the all_gather of the previous step's update, its bucket's and the next bucket's
  // started here. get() waits for it.
  struct Gathered {
    Param* p = nullptr;
    Tensor full;
    Work work;
  };
  Gathered gather(Param& p);
  Tensor get(Gathered& g);
  // The same for several parameters; a unit's, with zero 3, by one all_gather (all of a unit's, in the
  // order add_unit was given them).
  struct GatheredUnit {
    std::vector<Gathered> each;  // one gather per parameter, unless gathered as a unit
    int unit = -1;
    Tensor in, flat;  // the unit's shards concatenated, and [dp, their elements] from every rank
    Work work;
  };
  GatheredUnit gather(const std::vector<Param*>& ps);
  std::vector<Tensor> get(GatheredUnit& g);

  // A micro-batch's gradient (any dtype, the local part's shape) into the parameter's gradient. An undefined
  // `g` is one its GEMM already summed into wgrad_into(p).
  void add_grad(Param& p, const Tensor& g);
  // With grad_accum_fusion, where the parameter's gradient is its whole local part (zero 0 and 1, or one
  // dp rank) in the compute dtype or float32: that gradient, for a weight-gradient GEMM to sum into
  // (Rank::matmul_add_). Otherwise undefined: the GEMM makes a tensor for add_grad.
  Tensor wgrad_into(Param& p) const;
  // The float32 tensor the embedding's backward adds into, and its hand-over.
  Tensor embedding_grad_target(Param& p);
  void embedding_grad_done(Param& p, const Tensor& target);
  // These parameters' gradients are final for this step (their last micro-batch's backward is done); a
  // bucket whose gradients all are starts its reduction (overlap_grad_reduce).
  void grads_ready(const std::vector<Param*>& ps);
  // Waits for the reductions ZeRO 2 and 3 have in flight (the last one of the previous backward task).
  void drain();
  // After the last backward: starts the reductions not started yet and waits for every one, then adds the
  // gradients of sequence-parallel parameters over tp and those of the tied embedding over its two stages.
  void finish(const std::vector<Param*>& ps);
  // Gradient clipping by the global norm: the squares of every gradient element this rank holds, each
  // parameter's counted once over the world (counts_once), summed over the world; the host reads the norm (it
  // waits for the stream, as Megatron's does), and when it exceeds `max_norm` every gradient is scaled by
  // max_norm / (norm + 1e-6). Returns the norm (0 for phantom tensors). With `experts` (the experts'
  // DataParallel, over the ranks that hold the same experts, and its parameters) their gradients join the
  // same norm, each element counted once too (the ep ranks hold different experts), and are scaled alike.
  double clip_grads(const std::vector<Param*>& ps, double max_norm, DataParallel* experts = nullptr,
                    const std::vector<Param*>& expert_ps = {});
  // AdamW on this rank's part, then the 16-bit weights rebuilt (all_gather for zero 1 and 2, at once or,
  // with overlap_param_gather, during the next step's forward).
  void step(const std::vector<Param*>& ps, const AdamW& h, int t);
  void zero_grads(const std::vector<Param*>& ps);
  // After the last step: the all_gathers the next step's forward would have started, so that every rank
  // ends with whole weights, as the plain schedule does.
  void finish_gathers();

  // The part of a parameter's local part this rank reduces and updates, between finish() and the next
  // step: elements [first, first + count) of the local part (row-major), their reduced gradient, their
  // float32 master and Adam's moments (each holding at least `count` elements, the first of them `first`'s).
  struct Held {
    std::int64_t first = 0, count = 0;
    Tensor grad, master, m, v;
  };
  Held held(const Param& p) const;
  // Whether this rank's held part of `p` is counted for the world, each element on exactly one rank: a
  // tensor every tp rank holds whole on tp rank 0 only, the tied embedding on its first stage only, what
  // every dp rank holds alike (zero 0) on dp rank 0 only.
  bool counts_once(const Param& p) const;

 private:
  // The gradients the optimizer reads, times `scale`.
  void scale_grads(const std::vector<Param*>& ps, float scale);
  // Whether `p`'s gradient covers only this tp rank's share (its tokens under sequence parallelism, or its
  // heads), to be summed over tp after the data-parallel reduction.
  bool partial_over_tp(const Param& p) const {
    return c_.tp_size > 1 && ((p.spec.sp_partial && c_.seq_parallel) || p.spec.tp_partial);
  }
  // An operation in flight on the dp group: a reduction of `p`'s gradient into `out`, or a gather of its
  // weights into `out`; `in` is kept alive until it finishes.
  struct Pending {
    Param* p;
    Tensor out, in;
    Work work;
  };
  // Zero 2 and 3: a reduce_scatter of the gradients of `ps` (one parameter's, or a unit's laid out rank by
  // rank) into `out`, this rank's shard of each in turn.
  struct Reduction {
    std::vector<Param*> ps;
    Tensor out, in;
    Work work;
  };
  struct Unit {
    std::vector<Param*> ps;
    std::vector<std::int64_t> offset;  // of each parameter's shard in the unit's shard
    std::int64_t shard_elements = 0;
    std::vector<Tensor> grads;  // this micro-batch's, padded, until each has come
    std::size_t received = 0;
  };
  struct Bucket {
    std::vector<Param*> params;
    std::int64_t elements = 0;
    Tensor grads;         // zero 0, 1: the flat gradients, in the reduction dtype
    Tensor weights;       // zero 1: the flat compute-dtype weights
    Tensor master, m, v;  // zero 1: this rank's shard, float32 (master a view of weights in float32)
    Tensor shard_grad;    // zero 1: the shard's reduced gradient in float32, after finish()
    int initialized = 0;  // parameters made (init)
    int ready = 0;        // parameters whose gradient is final this step
    bool reducing = false;
    Work reduction;                // zero 0, 1
    bool gather_due = false;       // zero 1, overlap_param_gather: the update's all_gather awaits the forward
    Work gather;                   // zero 1: the all_gather of the updated weights
    std::vector<Pending> gathers;  // zero 2, overlap_param_gather: its parameters' all_gathers
  };

  bool sharded() const { return c_.dp_size > 1; }
  bool flat() const { return c_.stage <= 1; }
  // Whether a parameter's gradient is its whole local part, summed over the step's micro-batches (zero 0 and
  // 1, or one dp rank), rather than rows reduce-scattered micro-batch by micro-batch.
  bool whole_grads() const { return c_.stage <= 1 || !sharded(); }
  bool distributed_optimizer() const { return c_.stage == 1 && sharded(); }
  // Whether each dp rank holds a part of the gradients of its own (else every one holds them all).
  bool sharded_grads() const { return c_.stage >= 1 && sharded(); }
  std::int64_t shard_elements(const Bucket& b) const { return b.elements / c_.dp_size; }
  // This rank's shard of one of a bucket's flat buffers (its gradients or weights), a view.
  Tensor shard_of(const Bucket& b, const Tensor& flat) const {
    return r_.view(flat, c_.dp_rank * shard_elements(b), Shape{shard_elements(b)});
  }
  ReduceOp dp_op() const;

  // ---- zero 0 and 1: flat buckets (zero_buckets.cc)
  void make_buffers(Bucket& b);
  void init_flat(Param& p, const Tensor& local);
  void issue_reduction(Bucket& b);
  void finish_flat(const std::vector<Param*>& ps);
  void step_flat(const std::vector<Param*>& ps, const AdamW& h, int t);
  // A distributed optimizer's parameter: the elements [first, first + count) of it in this rank's shard,
  // at element `at` of the shard.
  struct InShard {
    std::int64_t first = 0, count = 0, at = 0;
  };
  InShard in_shard(const Param& p) const;

  // ---- zero 2 and 3: row shards (zero.cc)
  Tensor pad(const Param& p, const Tensor& t);    // rows up to rows_padded
  Tensor unpad(const Param& p, const Tensor& t);  // back to rows
  Tensor shard_of(const Param& p, const Tensor& local);
  std::int64_t shard_first_row(const Param& p) const;
  std::int64_t shard_valid_rows(const Param& p) const;
  // The 16-bit weights of `p` from the all_gather of its shards (`whole`, padded rows and all).
  void take_gathered(Param& p, const Tensor& whole);
  void issue_gathers(int bucket);
  void reduce_unit(Unit& u);

  Rank& r_;
  ZeroConfig c_;
  ExposedComm& exposed_;
  std::vector<Reduction> pending_;  // zero 2, 3: the reduce-scatters in flight
  std::vector<Unit> units_;
  std::vector<Bucket> buckets_;  // in backward order
  int next_gather_bucket_ = 0;   // in forward order: buckets_.size() - 1 down to 0
};

}  // namespace ranklab::parallel
