#include "lessons/parallel/pipeline.h"

#include <algorithm>

namespace ranklab::parallel {

std::vector<Task> schedule(int pp, int stage, int v, int m) {
  const int total = m * v;
  // Warm-up: enough forwards that the rank after this one never waits for one. With chunks, a micro-batch
  // comes back to this rank after going around all pp ranks, so the warm-up grows by pp per extra chunk.
  const int warmup = std::min(total, v == 1 ? pp - stage - 1 : (pp - stage - 1) * 2 + (v - 1) * pp);
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
      m_(m),
      phantom_(phantom),
      exposed_(exposed),
      order_(schedule(pp_, stage, v, m)) {}

void Pipeline::run(const Shape& act, DType dtype, const Fn& forward, const Fn& backward, bool timed) {
  const int next = ranks_[(stage_ + 1) % pp_], prev = ranks_[(stage_ + pp_ - 1) % pp_];
  task_events_.clear();
  if (timed) start_ = r_.record_event();

  // The receive of task i's input, posted with the send of task i-1's output.
  struct Incoming {
    Tensor t;
    Work work;
  };
  auto post = [&](const Tensor* out, const Task* done, const Task* upcoming, Incoming& in) {
    std::vector<Rank::P2POp> ops;
    if (out != nullptr) ops.push_back({CommOp::Send, *out, done->forward ? next : prev});
    if (upcoming != nullptr) {
      in.t = buffer(r_, phantom_, act, dtype);
      ops.push_back({CommOp::Recv, in.t, upcoming->forward ? prev : next});
    }
    if (ops.empty()) return std::vector<Work>();
    std::vector<Work> works = r_.batch_isend_irecv(ops);
    exposed_.communicated(Dim::Pp, works);
    return works;
  };

  Incoming in;
  // Sends are waited on only at the end: a send completes when its receiver posts the receive, which in the
  // interleaved schedule can be several tasks later, and a rank that waited for it earlier would stop
  // posting the receives its neighbours' sends need. The operation keeps the tensor until it has gone.
  std::vector<Work> sends;
  if (pp_ > 1 && needs_input(order_[0])) {
    std::vector<Work> w = post(nullptr, nullptr, &order_[0], in);
    in.work = w.back();
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    const Task& t = order_[i];
    if (pp_ > 1 && needs_input(t)) exposed_.wait(Dim::Pp, in.work);
    if (timed) task_events_.push_back(r_.record_event());
    Tensor out = t.forward ? forward(t, needs_input(t) ? in.t : Tensor())
                           : backward(t, needs_input(t) ? in.t : Tensor());
    if (timed) task_events_.push_back(r_.record_event());
    in = {};
    if (pp_ == 1) continue;
    const bool more = i + 1 < order_.size();
    const Task* upcoming = more && needs_input(order_[i + 1]) ? &order_[i + 1] : nullptr;
    const bool send = sends_output(t);
    std::vector<Work> w = post(send ? &out : nullptr, &t, upcoming, in);
    if (send) sends.push_back(w.front());
    if (upcoming != nullptr) in.work = w.back();
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
