#include "lessons/gpt/config.h"

#include <fmt/format.h>

#include "common/errors.h"
#include "lessons/parallel/groups.h"

namespace ranklab::gpt {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
  }
  return "?";
}

std::string Config::layout() const {
  std::string s =
      fmt::format("tp {}{} x pp {}{} x dp {}, zero {}, recompute {}, {}", tp,
                  seq_parallel ? " (seq-parallel)" : "", pp, v > 1 ? fmt::format(" (interleave {})", v) : "",
                  dp, zero, recompute_name(recompute), dtype_name(dtype));
  if (reduce_dtype != DType::Float32) s += fmt::format(", {} gradient reduction", dtype_name(reduce_dtype));
  if (dropout > 0) s += fmt::format(", dropout {}", dropout);
  return s;
}

std::string Config::shape() const {
  return fmt::format("{} layers, hidden {}, {} heads, seq {}, vocab {}", layers, hidden, heads, seq, vocab);
}

namespace {
DType parse_dtype(const std::string& s, const char* option) {
  if (s == "bf16" || s == "bfloat16") return DType::BFloat16;
  if (s == "fp16" || s == "float16") return DType::Float16;
  if (s == "fp32" || s == "float32") return DType::Float32;
  throw UsageError(fmt::format("{} must be bf16, fp16 or fp32 (got '{}')", option, s));
}

void positive(std::int64_t v, const char* option) {
  if (v < 1) throw UsageError(fmt::format("gpt: {} must be at least 1 (got {})", option, v));
}
}  // namespace

Config config_from(const Options& o, int world) {
  Config c;
  c.model = o.model.empty() ? "custom" : o.model;
  c.layers = o.layers;
  c.hidden = static_cast<int>(o.hidden);
  c.heads = o.heads;
  c.seq = o.seq;
  c.vocab = o.vocab;
  c.global_batch = o.global_batch;
  c.micro_batch = o.micro_batch;
  c.tp = o.tp;
  c.pp = o.pp;
  c.v = o.interleave;
  c.zero = o.zero;
  c.seq_parallel = o.seq_parallel;
  c.order = o.order;
  c.phantom = o.phantom;
  c.steps = o.steps;
  c.lr = o.lr;
  c.dropout = static_cast<float>(o.dropout);
  c.broken = o.broken;
  c.dtype = parse_dtype(o.dtype, "--dtype");
  c.reduce_dtype = parse_dtype(o.grad_reduce_dtype, "--grad-reduce-dtype");
  if (o.recompute == "none") {
    c.recompute = Recompute::None;
  } else if (o.recompute == "selective") {
    c.recompute = Recompute::Selective;
  } else if (o.recompute == "full") {
    c.recompute = Recompute::Full;
  } else {
    throw UsageError(fmt::format("gpt: --recompute must be none, selective or full (got '{}')", o.recompute));
  }
  positive(c.layers, "--layers");
  positive(c.hidden, "--hidden");
  positive(c.heads, "--heads");
  positive(c.seq, "--seq");
  positive(c.vocab, "--vocab");
  positive(c.global_batch, "--global-batch");
  positive(c.micro_batch, "--micro-batch");
  positive(c.tp, "--tp");
  positive(c.pp, "--pp");
  positive(c.v, "--interleave");
  positive(c.steps, "--steps");
  if (c.zero < 0 || c.zero > 3)
    throw UsageError(fmt::format("gpt: --zero must be 0, 1, 2 or 3 (got {})", c.zero));
  parallel::validate_order(c.order);
  if (c.hidden % c.heads != 0) {
    throw UsageError(
        fmt::format("gpt: --hidden {} is not divisible by --heads {}: every head has hidden/heads "
                    "features",
                    c.hidden, c.heads));
  }
  const int model_ranks = c.tp * c.pp;
  if (o.dp > 0) {
    c.dp = o.dp;
    if (c.tp * c.pp * c.dp != world) {
      throw UsageError(
          fmt::format("gpt: --world {} is not --tp {} x --pp {} x --dp {} = {}; leave out --dp to "
                      "get world / (tp pp)",
                      world, c.tp, c.pp, c.dp, c.tp * c.pp * c.dp));
    }
  } else {
    if (world % model_ranks != 0) {
      throw UsageError(
          fmt::format("gpt: --world {} is not divisible by --tp {} x --pp {} = {}: data parallelism "
                      "replicates groups of tp x pp ranks",
                      world, c.tp, c.pp, model_ranks));
    }
    c.dp = world / model_ranks;
  }
  if (c.heads % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --heads {} is not divisible by --tp {}: tensor parallelism gives each "
                    "rank whole attention heads",
                    c.heads, c.tp));
  }
  if (c.vocab % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --vocab {} is not divisible by --tp {}: each rank holds vocab/tp rows of "
                    "the embedding; pad it as Megatron does, to a multiple of 128 x tp = {}",
                    c.vocab, c.tp, (c.vocab + 128 * c.tp - 1) / (128 * c.tp) * 128 * c.tp));
  }
  if (c.seq_parallel && c.tp == 1) {
    throw UsageError(
        "gpt: --seq-parallel splits the sequence across the tensor-parallel ranks; it needs --tp 2 "
        "or more");
  }
  if (c.seq_parallel && c.rows() % c.tp != 0) {
    throw UsageError(
        fmt::format("gpt: --seq {} x --micro-batch {} tokens do not divide among --tp {} ranks "
                    "(--seq-parallel)",
                    c.seq, c.micro_batch, c.tp));
  }
  if (c.v > 1 && c.pp == 1) {
    throw UsageError(
        "gpt: --interleave gives each pipeline rank several model chunks; it needs --pp 2 or more");
  }
  if (c.layers % (c.pp * c.v) != 0) {
    throw UsageError(
        fmt::format("gpt: --layers {} is not divisible by --pp {} x --interleave {} = {}: every "
                    "model chunk holds the same number of layers",
                    c.layers, c.pp, c.v, c.pp * c.v));
  }
  if (c.global_batch % (c.micro_batch * c.dp) != 0) {
    throw UsageError(
        fmt::format("gpt: --global-batch {} is not divisible by --micro-batch {} x dp {} = {}: each "
                    "data-parallel pipeline runs global / (micro x dp) whole micro-batches",
                    c.global_batch, c.micro_batch, c.dp, c.micro_batch * c.dp));
  }
  const std::int64_t m = c.micro_batches();
  if (c.v > 1 && m % c.pp != 0) {
    throw UsageError(fmt::format(
        "gpt: --interleave {} needs the micro-batches per pipeline, m = global / (micro x dp) = {} / ({} x "
        "{}) = "
        "{}, to be a multiple of --pp {}: the interleaved schedule sends micro-batches through the chunks in "
        "groups of pp, so that a rank starts chunk c of a group just as the previous rank finishes it "
        "(Megatron requires the same); try --global-batch {}",
        c.v, c.global_batch, c.micro_batch, c.dp, m, c.pp, (m / c.pp + 1) * c.pp * c.micro_batch * c.dp));
  }
  return c;
}

}  // namespace ranklab::gpt
