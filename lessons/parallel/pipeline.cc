#include "lessons/parallel/pipeline.h"

#include <algorithm>
#include <map>

namespace ranklab::parallel {

namespace {
// Warm-up: enough forwards that the rank after this one never waits for one. With chunks, a micro-batch
// comes back to this rank after going around all pp ranks, so the warm-up grows by pp per extra chunk.
int warmup_forwards(int pp, int stage, int v) {
  return v == 1 ? pp - stage - 1 : (pp - stage - 1) * 2 + (v - 1) * pp;
}
}  // namespace

std::vector<Task> schedule(int pp, int stage, int v, int m) {
  const int total = m * v;
  const int warmup = std::min(total, warmup_forwards(pp, stage, v));
  // The k-th forward of this rank: micro-batches go through the chunks in groups of pp.
  auto task = [&](int k, bool forward) {
    const int in_group = k % (pp * v);
    const int chunk = in_group / pp;
    return Task{forward, forward ? chunk : v - 1 - chunk, (k / (pp * v)) * pp + k % pp};
  };
  std::vector<Task> order;
  order.reserve(2 * total);
  for (int k = 0; k < warmup; ++k) order.push_back(task(k, true));
  for (int k = warmup; k < total; ++k) {
    order.push_back(task(k, true));
    order.push_back(task(k - warmup, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(task(k, false));
  return order;
}

std::vector<Task> schedule_through_first_period(int pp, int stage, int v, int m) {
  const int warmup = warmup_forwards(pp, stage, v);
  // Enough micro-batches for the whole warm-up and one period of pp x v steady pairs after it.
  const int enough = (warmup + pp * v + v - 1) / v;
  std::vector<Task> order = schedule(pp, stage, v, std::min(m, enough));
  if (m <= enough) return order;
  // The cool-down of the shorter schedule only frees; the period before it is the longer one's.
  order.resize(order.size() - static_cast<std::size_t>(warmup));
  return order;
}

std::vector<int> most_alive(const std::vector<Task>& order, int v) {
  std::vector<int> alive(v, 0), most(v, 0);
  for (const Task& t : order) {
    alive[t.chunk] += t.forward ? 1 : -1;
    most[t.chunk] = std::max(most[t.chunk], alive[t.chunk]);
  }
  return most;
}

Pipeline::Pipeline(Rank& r, std::vector<int> pp_ranks, int stage, int v, int m, bool phantom,
                   ExposedComm& exposed)
    : r_(r),
      ranks_(std::move(pp_ranks)),
      pp_(static_cast<int>(ranks_.size())),
      stage_(stage),
      v_(v),
      phantom_(phantom),
      exposed_(exposed),
      order_(schedule(pp_, stage, v, m)) {}

void Pipeline::run(const Shape& act, DType dtype, const Fn& forward, const Fn& backward, bool timed) {
  const int next = ranks_[(stage_ + 1) % pp_], prev = ranks_[(stage_ + pp_ - 1) % pp_];
  task_events_.clear();
  if (timed) start_ = r_.record_event();

  // Each task's input is received into a buffer of its own, posted with the send of an earlier task's
  // output.
  struct Incoming {
    Tensor t;
    Work work;
  };
  std::map<std::size_t, Incoming> incoming;  // by task index
  std::size_t posted = 0;                    // tasks whose receives are posted
  // The receives to post once task i has run: up to the next task, or with overlap_p2p up to the next task
  // in task i's direction (Megatron's schedule posts the next forward's receive after a forward and the
  // next backward's after a backward), so that in the steady state the task between runs beside it.
  auto post_until = [&](std::size_t i) {
    std::size_t j = i + 1;
    if (overlap_p2p)
      while (j < order_.size() && order_[j].forward != order_[i].forward) ++j;
    return (j < order_.size() ? j : i + 1) + 1;
  };
  auto post = [&](const Tensor* out, const Task* done, std::size_t upto) {
    std::vector<Rank::P2POp> ops;
    if (out != nullptr) ops.push_back({CommOp::Send, *out, done->forward ? next : prev});
    std::vector<std::size_t> receiving;
    for (; posted < std::min(upto, order_.size()); ++posted) {
      const Task& t = order_[posted];
      if (!needs_input(t)) continue;
      Incoming& in = incoming[posted];
      in.t = buffer(r_, phantom_, act, dtype);
      ops.push_back({CommOp::Recv, in.t, t.forward ? prev : next});
      receiving.push_back(posted);
    }
    if (ops.empty()) return Work();
    std::vector<Work> works = r_.batch_isend_irecv(ops);
    exposed_.communicated(Dim::Pp, works);
    const std::size_t first_recv = out != nullptr ? 1 : 0;
    for (std::size_t k = 0; k < receiving.size(); ++k) incoming[receiving[k]].work = works[first_recv + k];
    return out != nullptr ? works.front() : Work();
  };

  // Sends are waited on only at the end: a send completes when its receiver posts the receive, which in the
  // interleaved schedule can be several tasks later, and a rank that waited for it earlier would stop
  // posting the receives its neighbours' sends need. The operation keeps the tensor until it has gone.
  std::vector<Work> sends;
  if (pp_ > 1) post(nullptr, nullptr, 1);
  for (size_t i = 0; i < order_.size(); ++i) {
    const Task& t = order_[i];
    Incoming in;
    if (pp_ > 1 && needs_input(t)) {
      in = std::move(incoming.at(i));
      incoming.erase(i);
      exposed_.wait(Dim::Pp, in.work);
    }
    if (timed) task_events_.push_back(r_.record_event());
    Tensor out = t.forward ? forward(t, in.t) : backward(t, in.t);
    if (timed) task_events_.push_back(r_.record_event());
    in = {};
    if (pp_ == 1) continue;
    const bool send = sends_output(t);
    Work sent = post(send ? &out : nullptr, &t, post_until(i));
    if (send) sends.push_back(sent);
  }
  for (Work& w : sends) exposed_.wait(Dim::Pp, w);
}

PipelineTimes Pipeline::times() {
  PipelineTimes t;
  if (task_events_.empty()) return t;
  for (size_t i = 0; i + 1 < task_events_.size(); i += 2) {
    t.busy_us += r_.elapsed_us(task_events_[i], task_events_[i + 1]);
  }
  t.window_us = r_.elapsed_us(start_, task_events_.back());
  return t;
}

std::vector<PipelineTask> Pipeline::tasks(const Event& origin, double origin_us) {
  std::vector<PipelineTask> out;
  for (size_t i = 0; i + 1 < task_events_.size(); i += 2) {
    const Task& t = order_[i / 2];
    out.push_back({r_.rank(), stage_, t.chunk, t.mb, t.forward,
                   origin_us + r_.elapsed_us(origin, task_events_[i]),
                   origin_us + r_.elapsed_us(origin, task_events_[i + 1])});
  }
  return out;
}

}  // namespace ranklab::parallel
