#include "lessons/gpt/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace ranklab::gpt {

using parallel::Param;

Tolerance tolerance(const Config& c) {
  const std::string name = dtype_name(c.dtype);
  if (c.fp8 != parallel::Fp8Recipe::None) {
    return {2e-3, 0.5, 0.7, fmt::format("{} with fp8 GEMMs ({})", name, parallel::fp8_recipe_name(c.fp8))};
  }
  switch (c.dtype) {
    case DType::Float32:
      return {1e-5, 1e-3, 2e-3, name};
    case DType::Float16:
      return {1e-3, 5e-2, 0.2, name};
    case DType::BFloat16:
      return {2e-3, 0.15, 0.3, name};
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      break;
  }
  return {0, 0, 0, name};
}

namespace {

// Where element `e` (row-major) of a rank's tensor-parallel part of a parameter lies in the full tensor.
std::int64_t full_index(const Param& p, std::int64_t e) {
  const Shape& f = p.spec.full;
  const std::int64_t cols = f.ndim() == 2 ? p.local[1] : 1, full_cols = f.ndim() == 2 ? f[1] : 1;
  const std::int64_t row0 = p.spec.tp_dim == 0 ? p.tp_start : 0, col0 = p.spec.tp_dim == 1 ? p.tp_start : 0;
  return (row0 + e / cols) * full_cols + col0 + e % cols;
}

// Elements [first, first + count) of a rank's tensor-parallel part of a full reference tensor.
std::vector<double> local_part(const std::vector<double>& full, const Param& p, std::int64_t first,
                               std::int64_t count) {
  std::vector<double> out(count);
  for (std::int64_t e = 0; e < count; ++e) out[e] = full[full_index(p, first + e)];
  return out;
}

// A rank's tensor (its elements [first, first + count)) against the reference's.
struct TensorDifference {
  double largest_error = 0;      // the largest |got - want|
  double largest_magnitude = 0;  // gradients: the largest sum of an element's terms' magnitudes
  std::int64_t at = 0;           // the element of the largest error
  double squared_error = 0;      // weights: sum of (got - want)^2, and of the update's (want - before)^2
  double squared_update = 0;
};
// Over the elements of part `part` only where `parts` gives each element's part (qkv_parts).
// `magnitude`: gradients, each element's sum of its terms' magnitudes (Reference::grad_magnitude).
TensorDifference difference(const std::vector<float>& got, const std::vector<double>& want,
                            const std::vector<double>* before, const std::vector<double>* magnitude = nullptr,
                            const std::vector<int>& parts = {}, int part = 0) {
  TensorDifference t;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!parts.empty() && parts[i] != part) continue;
    const double d = std::fabs(got[i] - want[i]);
    if (!(d <= t.largest_error)) t.largest_error = d, t.at = static_cast<std::int64_t>(i);
    if (magnitude) t.largest_magnitude = std::max(t.largest_magnitude, (*magnitude)[i]);
    if (before) {
      t.squared_error += d * d;
      t.squared_update += (want[i] - (*before)[i]) * (want[i] - (*before)[i]);
    }
  }
  return t;
}

// The fused attention projection's gradient holds three GEMMs' outputs, whose scales differ: per column, 0
// for a query's, 1 for a key's, 2 for a value's (each group's q heads, then its k and its v: the
// reference's layout). Each part is compared against its own scale, so that a wrong query or key
// gradient (one left in the rotated frame) does not hide under the values'. Not the bias: its keys' part is
// zero in exact arithmetic (softmax ignores a shift common to a query's scores), rounding noise in a run.
// Empty for other parameters.
std::vector<int> qkv_parts(const Config& c, const Model::Named& n, std::int64_t first, std::int64_t count) {
  const bool fused = n.layer >= 0 && n.kind == (c.llama() ? int{kWqkv} : int{kQkvW});
  if (!fused) return {};
  const Param& p = *n.p;
  const std::int64_t d = c.head_dim(), per = c.heads / c.kv(), group = (per + 2) * d;
  const std::int64_t full_cols = p.spec.full[1];
  std::vector<int> parts(count);
  for (std::int64_t e = 0; e < count; ++e) {
    const std::int64_t at = full_index(p, first + e) % full_cols % group;
    parts[e] = at < per * d ? 0 : at < (per + 1) * d ? 1 : 2;
  }
  return parts;
}

}  // namespace

OneDeviceCheck::OneDeviceCheck(Rank& r, const Config& c, const parallel::Layout::Coord& me)
    : r_(r), c_(c), me_(me) {
  for (check::Agreement* a : {&grad, &weight, &loss}) a->where = "every tensor equal";
  if (!c.phantom) ref_ = Reference::get(c);
}

Reference::State OneDeviceCheck::gather_state(Model& model) {
  // One flat buffer of every parameter of the full model, in the reference's order, three times (values,
  // m, v): each rank writes the elements it holds and counts (every element on one rank), the others are
  // zero, and a sum over the world puts the whole state on every rank. float32 values and zeros add exactly.
  std::vector<std::int64_t> at(ref_->params() + 1, 0);
  for (int i = 0; i < ref_->params(); ++i) at[i + 1] = at[i] + ref_->numel(i);
  const std::int64_t total = at.back();
  std::vector<float> mine(3 * total, 0.0f);
  for (const Model::Named& n : model.named_params()) {
    const Param& p = *n.p;
    if (!n.dp->counts_once(p)) continue;
    const parallel::DataParallel::Held held = n.dp->held(p);
    const std::int64_t base = at[ref_->index(n.kind, n.layer)];
    int part = 0;
    for (const Tensor* t : {&held.master, &held.m, &held.v}) {
      const std::vector<float> values = r_.to_host(*t);
      for (std::int64_t e = 0; e < held.count; ++e)
        mine[part * total + base + full_index(p, held.first + e)] = values[e];
      ++part;
    }
  }
  Tensor all = r_.from_host(Shape{3 * total}, mine);
  r_.all_reduce(all, ReduceOp::Sum);
  const std::vector<float> sum = r_.to_host(all);
  Reference::State s;
  for (auto* v : {&s.w, &s.m, &s.v}) v->resize(ref_->params());
  for (int i = 0; i < ref_->params(); ++i) {
    int part = 0;
    for (auto* v : {&s.w, &s.m, &s.v}) {
      const float* first = sum.data() + part * total + at[i];
      (*v)[i].assign(first, first + ref_->numel(i));
      ++part;
    }
  }
  return s;
}

Reference::Routes OneDeviceCheck::gather_routes(Model& model) {
  // Every token's experts, each written by the one rank that routed it (e + 1, or -1 - e when dropped: zero
  // is unwritten), and summed over the world.
  const std::int64_t n = c_.global_batch * c_.seq, k = c_.top_k;
  std::vector<int> slot(c_.layers, -1);
  int moe_layers = 0;
  for (int layer = 0; layer < c_.layers; ++layer)
    if (c_.moe_layer(layer)) slot[layer] = moe_layers++;
  std::vector<float> mine(moe_layers * n * k, 0.0f);
  for (const auto& [layer, tokens] : model.routes()) {
    for (const auto& [row, experts] : tokens)
      for (std::int64_t j = 0; j < k; ++j) {
        const int e = experts[j];  // -1 - e when dropped: nonzero either way
        mine[(slot[layer] * n + row) * k + j] = static_cast<float>(e >= 0 ? e + 1 : e);
      }
  }
  Tensor all = r_.from_host(Shape{static_cast<std::int64_t>(mine.size())}, mine);
  r_.all_reduce(all, ReduceOp::Sum);
  const std::vector<float> sum = r_.to_host(all);
  Reference::Routes routes(c_.layers);
  for (int layer = 0; layer < c_.layers; ++layer) {
    if (slot[layer] < 0) continue;
    for (std::int64_t i = 0; i < n * k; ++i) {
      const int v = static_cast<int>(sum[slot[layer] * n * k + i]);
      const int expert = v > 0 ? v - 1 : -v - 1;
      if (v == 0 || expert >= c_.experts) {
        throw std::logic_error(
            fmt::format("gpt: layer {} token {}: routed by no rank, or by more than one", layer, i / k));
      }
      routes[layer].push_back(v > 0 ? expert : -1 - expert);
    }
  }
  return routes;
}

void OneDeviceCheck::compare_step(int step, Model& model, Group dp_group) {
  if (!ref_) return;
  auto scope = r_.bookkeeping("check");
  if (c_.moe()) {
    const Reference::Routes routes = gather_routes(model);
    ref_->step(step, step == 1 ? nullptr : &state_, &routes);
  } else {
    ref_->step(step, step == 1 ? nullptr : &state_);
  }
  // A step whose softmaxes the run's precision cannot resolve is not judged by what flows from them: its
  // gradients, routes and loss (every rank reads the same reference, so all of them skip it).
  const bool judged = ref_->softmax_shift() <= kSoftmaxShiftPerTolerance * tolerance(c_).grad;
  if (!judged) {
    if (unjudged_steps_++ == 0) first_unjudged_ = step;
    largest_shift_ = std::max(largest_shift_, ref_->softmax_shift());
  }
  if (c_.moe() && judged) {
    const Reference::RoutingAgreement& ra = ref_->routing();
    routed_tokens += ra.tokens, close_calls += ra.close_calls, wrong_routes += ra.decisive;
    if (ra.decisive > 0 || (wrong_routes == 0 && !ra.where.empty())) routing_where = ra.where;
  }
  // Weight updates are compared over all of the rank's parameters together, each against AdamW's step (in
  // double) from the values and moments the step started from and the gradient the run holds, which the
  // gradient check has judged. Adam divides by the gradient's size, so where a gradient is zero in exact
  // arithmetic (the key bias: softmax ignores a shift common to a query's scores) or small against Adam's
  // eps, the gradient's rounding noise becomes an update of either sign up to the learning rate: against the
  // exact gradient's step, lr 0.02 in float32 failed at step 38 on the key bias, by the gradient's rounding
  // alone. From the run's gradient the update is off by the optimizer's own roundings; a wrong shard, a
  // skipped update or a wrong moment moves the weights all the same.
  double step_error = 0, step_update = 0, most_error = -1;
  std::string most_where;
  for (const Model::Named& n : model.named_params()) {
    const Param& p = *n.p;
    // The elements this rank reduced and updated: all of the local part, or its shard of them.
    const parallel::DataParallel::Held held = n.dp->held(p);
    const std::int64_t first = held.first, count = held.count;
    std::vector<double> got_grad;  // the run's gradient, which the weights' check takes as given
    auto compare = [&](const Tensor& t, bool is_grad) {
      std::vector<float> got = r_.to_host(t);
      got.resize(count);
      std::vector<double> want, before;
      if (is_grad) {
        want = local_part(ref_->grad(n.kind, n.layer), p, first, count);
        got_grad.assign(got.begin(), got.end());
      } else {
        // AdamW's step from the run's gradient, as the reference takes it (Training::adamw).
        before = local_part(ref_->before(n.kind, n.layer), p, first, count);
        want = before;
        std::vector<double> m = local_part(ref_->m_before(n.kind, n.layer), p, first, count),
                            v = local_part(ref_->v_before(n.kind, n.layer), p, first, count);
        const AdamW hyper;
        check::adamw_step(want, got_grad, m, v, c_.lr_at(step), p.spec.decay ? hyper.weight_decay : 0.0,
                          hyper, step);
      }
      const std::string coordinate = fmt::format(
          "tp {}{}, dp {}, pp {}", me_.tp, c_.cp > 1 ? fmt::format(", cp {}", me_.cp) : "", me_.dp, me_.pp);
      auto where = [&](const std::string& part, std::int64_t at) {
        return fmt::format(
            "rank {} ({}) {}{} {} element {} of its elements [{}, {}): got {:.9g}, want {:.9g}", r_.rank(),
            coordinate, p.spec.name, part, is_grad ? "gradient" : "value", first + at, first, first + count,
            want.empty() ? 0.0 : got[at], want.empty() ? 0.0 : want[at]);
      };
      if (is_grad && judged) {
        const std::vector<double> magnitude =
            local_part(ref_->grad_magnitude(n.kind, n.layer), p, first, count);
        const std::vector<int> parts = qkv_parts(c_, n, first, count);
        const char* names[] = {" (queries)", " (keys)", " (values)"};
        for (int part = 0; part < (parts.empty() ? 1 : 3); ++part) {
          const TensorDifference d = difference(got, want, nullptr, &magnitude, parts, part);
          double& largest = largest_grad_[{n.kind, n.layer, part}];
          largest = std::max(largest, d.largest_magnitude);
          const double rel = d.largest_error / std::max(largest, 1e-30);
          grad.merge(
              rel, fmt::format("{}; largest |got - want| {:.3e} over the largest sum of its terms' "
                               "magnitudes so far {:.3e} = {:.3e}",
                               where(parts.empty() ? "" : names[part], d.at), d.largest_error, largest, rel));
        }
      } else if (!is_grad) {
        const TensorDifference d = difference(got, want, &before);
        step_error += d.squared_error, step_update += d.squared_update;
        if (d.squared_error > most_error) {
          most_error = d.squared_error;
          most_where = where("", d.at);
        }
      }
    };
    compare(held.grad, true);
    compare(held.master, false);
  }
  // A step's error is measured against the largest update so far: a step the schedule makes small (a
  // learning rate decayed to 0) still rounds the weights it leaves alone, and is not judged by its own
  // update.
  largest_update_ = std::max(largest_update_, step_update);
  const double wrel = std::sqrt(step_error / std::max(largest_update_, 1e-60));
  weight.merge(wrel,
               fmt::format("step {}: |got - want| {:.3e} over the largest |update| so far {:.3e} = {:.3e} "
                           "over the rank's parameters; most of it at {}",
                           step, std::sqrt(step_error), std::sqrt(largest_update_), wrel, most_where));
  // The state the next step is checked from (every rank takes part).
  if (step < c_.steps) state_ = gather_state(model);
  if (!model.has_head()) return;
  Tensor total = r_.cast(model.loss_sum, DType::Float32);
  r_.all_reduce(total, ReduceOp::Sum, Async::No, dp_group);
  const double got = r_.to_host(total)[0] / static_cast<double>(c_.tokens_per_step());
  if (!judged) return;
  const double want = ref_->loss(step);
  largest_loss_ = std::max(largest_loss_, std::abs(want));
  const double rel = got == want ? 0.0 : std::abs(got - want) / largest_loss_;
  losses.push_back(got);
  loss.merge(rel,
             fmt::format("step {}: got {:.9g}, want {:.9g}, |got - want| over the largest loss so far {:.3e}",
                         step, got, want, rel));
}

void OneDeviceCheck::record(bool has_head) const {
  if (!ref_) return;
  const Tolerance tol = tolerance(c_);

  const std::string who = fmt::format(" ({})", c_.layout());
  // Steps left unjudged are named in each check they leave out; with none judged the gradients fail.
  const std::string unjudged =
      unjudged_steps_ == 0
          ? std::string()
          : fmt::format(
                "; {} of {} steps not judged, from step {}: the run's rounding of its attention scores or "
                "logits could move them by up to {:.3g}, a softmax weight by e^{:.3g}, more than {:g} times "
                "the tolerance, so the terms downstream may be wrong by more than it allows in a correct run "
                "at {} (run in fp32 to judge them)",
                unjudged_steps_, c_.steps, first_unjudged_, largest_shift_, largest_shift_,
                kSoftmaxShiftPerTolerance, tol.name);
  const bool some_judged = unjudged_steps_ < c_.steps;
  if (unjudged_steps_ > 0 && r_.rank() == 0) {
    r_.print(
        fmt::format("check: {} of {} steps not judged against one device, from step {}: at {} the run's "
                    "rounding could move their attention scores or logits by up to {:.3g} (the report's "
                    "checks say more)",
                    unjudged_steps_, c_.steps, first_unjudged_, tol.name, largest_shift_));
  }
  r_.check("gpt: every step's gradients equal one device's" + who, grad.worst <= tol.grad && some_judged,
           fmt::format("{} (tolerance {:.2g} for {}){}", grad.where, tol.grad, tol.name, unjudged));
  r_.check("gpt: every step's weight updates equal one device's" + who, weight.worst <= tol.weight,
           fmt::format("{} (tolerance {:.2g} for {})", weight.where, tol.weight, tol.name));
  if (c_.moe()) {
    r_.check(
        "gpt: every token's experts are one device's top-k" + who, wrong_routes == 0,
        fmt::format("{} close calls (a token's expert, or a route dropped over capacity, chosen otherwise "
                    "than one device chooses within the run's rounding) and {} beyond it, over {} routed "
                    "tokens{}",
                    close_calls, wrong_routes, routed_tokens,
                    routing_where.empty() ? "" : fmt::format("; {}", routing_where)) +
            unjudged);
  }
  if (has_head) {
    r_.check("gpt: every step's loss equals one device's" + who, loss.worst <= tol.loss,
             fmt::format("{} (tolerance {:.2g} for {}){}", loss.where, tol.loss, tol.name, unjudged));
  }
}

void check_memory_plan(Rank& r, const Config& c, const parallel::Layout::Coord& me, const MemoryPlan& plan,
                       std::int64_t model_bytes, const std::vector<std::int64_t>& stash_measured_bytes,
                       const std::vector<std::int64_t>& routed_measured_bytes) {
  const std::int64_t data_bytes = plan.activations - plan.stash - plan.transient;
  r.check(
      "gpt: the parameters (and data) take what the memory plan says",
      model_bytes == plan.fixed() + data_bytes,
      fmt::format(
          "rank {} stage {}: allocated {} bytes, planned {} (weights {} + grads {} + optimizer {} + data {})",
          r.rank(), me.pp, model_bytes, plan.fixed() + data_bytes, plan.weights, plan.grads, plan.optimizer,
          data_bytes));
  for (int k = 0; k < c.v; ++k) {
    const int vs = k * c.pp + me.pp, first = c.chunk_first_layer(vs);
    std::int64_t want = stash_bytes(c, c.chunk_layers(vs), vs == 0, vs == c.pp * c.v - 1, first);
    std::int64_t got = stash_measured_bytes[k];
    // The plan gives each expert its share of the routed tokens; with real numbers the router decides (and
    // a phantom run's routing model, unless balanced), so what the MoE layers keep of them is left out of
    // the comparison.
    std::string routed;
    if ((!c.phantom || !c.balanced_routing()) && c.recompute != Recompute::Full) {
      const std::int64_t moe_layers = c.moe_layer_count(first, c.chunk_layers(vs));
      want -= moe_layers * routed_stash_bytes(c);
      got -= routed_measured_bytes[k];
      if (moe_layers > 0) routed = " (less the routed tokens' activations, which the routing sizes)";
    }
    r.check(
        "gpt: a micro-batch keeps for backward what the memory plan says", got == want,
        fmt::format("rank {} chunk {}: allocated {} bytes, planned {}{}", r.rank(), k, got, want, routed));
  }
}

}  // namespace ranklab::gpt
