#include "sim/reduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/dtype_round.h"
#include "sim/storage.h"

namespace ranklab::sim {

namespace {

float combine(ReduceOp op, float a, float b) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return a + b;
    case ReduceOp::Max:
      return std::max(a, b);
    case ReduceOp::Min:
      return std::min(a, b);
    case ReduceOp::Prod:
      return a * b;
  }
  return a;
}

// Reduces `count` floats at `offset` of every member's input, in member order.
std::vector<float> reduce_inputs(const CommOpState& op, ReduceOp rop, std::int64_t offset,
                                 std::int64_t count) {
  std::vector<float> acc(sim_data(op.members[0].call.input) + offset,
                         sim_data(op.members[0].call.input) + offset + count);
  for (size_t j = 1; j < op.members.size(); ++j) {
    const float* in = sim_data(op.members[j].call.input) + offset;
    for (std::int64_t i = 0; i < count; ++i) acc[i] = combine(rop, acc[i], in[i]);
  }
  if (rop == ReduceOp::Avg) {
    const float n = static_cast<float>(op.members.size());
    for (float& x : acc) x /= n;
  }
  return acc;
}

// A 16-bit output holds the reduced values rounded to its type, as NCCL's bf16/fp16 reductions write them.
void write(const Tensor& t, std::int64_t offset, const float* src, std::int64_t count) {
  float* dst = sim_data(t) + offset;
  std::memmove(dst, src, static_cast<size_t>(count) * sizeof(float));
  if (t.dtype() == DType::BFloat16) {
    for (std::int64_t i = 0; i < count; ++i) dst[i] = round_to_bfloat16(dst[i]);
  } else if (t.dtype() == DType::Float16) {
    for (std::int64_t i = 0; i < count; ++i) dst[i] = round_to_float16(dst[i]);
  }
}

bool any_phantom(const CommOpState& op) {
  for (const CommMember& m : op.members) {
    if ((m.call.input.defined() && m.call.input.phantom()) ||
        (m.call.output.defined() && m.call.output.phantom()))
      return true;
  }
  return false;
}

// Elements in one row (dim 0 entry) of `t`.
std::int64_t row_numel(const Tensor& t) {
  return t.shape().with_dim(0, 1).numel();
}

// Prefix sums of `splits` scaled by `row`: where each member's rows start, in elements.
std::vector<std::int64_t> offsets(const CommCall::Splits& splits, std::int64_t row) {
  std::vector<std::int64_t> out(splits.size(), 0);
  for (std::size_t j = 1; j < splits.size(); ++j) out[j] = out[j - 1] + splits[j - 1] * row;
  return out;
}

}  // namespace

bool uneven_all_to_all(const CommOpState& op) {
  return op.op == CommOp::AllToAll && !op.members.empty() && op.members[0].call.uneven();
}

std::vector<std::int64_t> all_to_all_pair_bytes(const CommOpState& op) {
  const std::size_t n = op.members.size();
  std::vector<std::int64_t> bytes(n * n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const CommCall& c = op.members[i].call;
    const std::int64_t row_bytes = row_numel(c.input) * dtype_bytes(c.input.dtype());
    for (std::size_t j = 0; j < n; ++j) bytes[i * n + j] = c.input_splits[j] * row_bytes;
  }
  return bytes;
}

std::int64_t nccl_size_bytes(const CommOpState& op) {
  const std::int64_t n = static_cast<std::int64_t>(op.members.size());
  const CommCall& c = op.members[0].call;
  if (uneven_all_to_all(op)) {
    std::int64_t most = 0;
    for (const CommMember& m : op.members) most = std::max(most, m.call.input.bytes());
    return most;
  }
  switch (op.op) {
    case CommOp::AllReduce:
    case CommOp::Broadcast:
    case CommOp::Reduce:
    case CommOp::AllToAll:
    case CommOp::Send:
    case CommOp::Recv:
    case CommOp::Barrier:
      return (c.input.defined() ? c.input : c.output).bytes();
    case CommOp::AllGather:
    case CommOp::Gather:
      return c.input.bytes() * n;
    case CommOp::ReduceScatter:
    case CommOp::Scatter:
      return c.output.bytes() * n;
  }
  return 0;
}

void run_numerics(CommOpState& op) {
  if (any_phantom(op)) return;
  const int n = static_cast<int>(op.members.size());
  auto root_index = [&]() -> int {
    const int root = op.members[0].call.peer;
    for (int j = 0; j < n; ++j) {
      if (op.members[j].rank == root) return j;
    }
    return 0;
  };
  switch (op.op) {
    case CommOp::AllReduce: {
      const std::int64_t count = op.members[0].call.input.numel();
      const std::vector<float> r = reduce_inputs(op, op.members[0].call.reduce, 0, count);
      for (const CommMember& m : op.members) write(m.call.output, 0, r.data(), count);
      break;
    }
    case CommOp::Reduce: {
      const std::int64_t count = op.members[0].call.input.numel();
      const std::vector<float> r = reduce_inputs(op, op.members[0].call.reduce, 0, count);
      write(op.members[root_index()].call.output, 0, r.data(), count);
      break;
    }
    case CommOp::Broadcast: {
      const CommMember& root = op.members[root_index()];
      const std::int64_t count = root.call.input.numel();
      for (const CommMember& m : op.members) {
        if (&m != &root) write(m.call.output, 0, sim_data(root.call.input), count);
      }
      break;
    }
    case CommOp::ReduceScatter: {
      const std::int64_t chunk = op.members[0].call.output.numel();
      std::vector<std::vector<float>> parts;
      for (int j = 0; j < n; ++j)
        parts.push_back(reduce_inputs(op, op.members[0].call.reduce, j * chunk, chunk));
      for (int j = 0; j < n; ++j) write(op.members[j].call.output, 0, parts[j].data(), chunk);
      break;
    }
    case CommOp::AllGather: {
      const std::int64_t chunk = op.members[0].call.input.numel();
      std::vector<float> all(static_cast<size_t>(chunk * n));
      for (int j = 0; j < n; ++j)
        std::memcpy(&all[j * chunk], sim_data(op.members[j].call.input), chunk * sizeof(float));
      for (const CommMember& m : op.members) write(m.call.output, 0, all.data(), chunk * n);
      break;
    }
    case CommOp::Scatter: {
      const CommMember& root = op.members[root_index()];
      const std::int64_t chunk = op.members[0].call.output.numel();
      const std::vector<float> in(sim_data(root.call.input), sim_data(root.call.input) + chunk * n);
      for (int j = 0; j < n; ++j) write(op.members[j].call.output, 0, &in[j * chunk], chunk);
      break;
    }
    case CommOp::Gather: {
      const std::int64_t chunk = op.members[0].call.input.numel();
      std::vector<float> all(static_cast<size_t>(chunk * n));
      for (int j = 0; j < n; ++j)
        std::memcpy(&all[j * chunk], sim_data(op.members[j].call.input), chunk * sizeof(float));
      write(op.members[root_index()].call.output, 0, all.data(), chunk * n);
      break;
    }
    case CommOp::AllToAll: {
      if (uneven_all_to_all(op)) {
        // Member j's rows for member i land in member i's output after the rows of members 0..j-1.
        const std::int64_t row = row_numel(op.members[0].call.input);
        std::vector<std::vector<float>> inputs;
        std::vector<std::vector<std::int64_t>> send_at, recv_at;
        for (const CommMember& m : op.members) {
          inputs.emplace_back(sim_data(m.call.input), sim_data(m.call.input) + m.call.input.numel());
          send_at.push_back(offsets(m.call.input_splits, row));
          recv_at.push_back(offsets(m.call.output_splits, row));
        }
        for (int i = 0; i < n; ++i) {
          for (int j = 0; j < n; ++j) {
            const std::int64_t count = op.members[j].call.input_splits[i] * row;
            if (count > 0) write(op.members[i].call.output, recv_at[i][j], &inputs[j][send_at[j][i]], count);
          }
        }
        break;
      }
      // Piece i of member j's input becomes piece j of member i's output.
      const std::int64_t chunk = op.members[0].call.input.numel() / n;
      std::vector<std::vector<float>> inputs;
      for (const CommMember& m : op.members)
        inputs.emplace_back(sim_data(m.call.input), sim_data(m.call.input) + chunk * n);
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) write(op.members[i].call.output, j * chunk, &inputs[j][i * chunk], chunk);
      }
      break;
    }
    case CommOp::Send:
    case CommOp::Recv: {
      const Tensor& sent = op.members[0].call.input;
      write(op.members[1].call.output, 0, sim_data(sent), sent.numel());
      break;
    }
    case CommOp::Barrier:
      break;
  }
}

}  // namespace ranklab::sim
