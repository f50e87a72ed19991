// Randomized SPMD programs on the simulator. Each program is drawn from a seed: a world of 1 to 8 ranks,
// a few sub-groups, and a sequence of collectives (random operation, reduce op, root, size, group,
// synchronous or not), point-to-point pairs and exchanges. The host computes what every rank must end
// with. Some programs end with a deliberate mistake (a rank with another size, reduce op or root, a rank
// that skips a collective, a receive without its send, a call on a group the rank is not in, a root
// outside the group): those must end with the right error, naming the rank and the operation. None may
// hang (the test's timeout).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/rank.h"
#include "sim/sim_backend.h"
#include "tests/sim_fixture.h"

namespace ranklab {
namespace {

enum class Kind {
  AllReduce,
  Broadcast,
  Reduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Scatter,
  Gather,
  SendRecv,
  Exchange,
  Barrier
};
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce:
      return "all_reduce";
    case Kind::Broadcast:
      return "broadcast";
    case Kind::Reduce:
      return "reduce";
    case Kind::AllGather:
      return "all_gather";
    case Kind::ReduceScatter:
      return "reduce_scatter";
    case Kind::AllToAll:
      return "all_to_all";
    case Kind::Scatter:
      return "scatter";
    case Kind::Gather:
      return "gather";
    case Kind::SendRecv:
      return "send";
    case Kind::Exchange:
      return "exchange";
    case Kind::Barrier:
      return "barrier";
  }
  return "?";
}
bool rooted(Kind k) {
  return k == Kind::Broadcast || k == Kind::Reduce || k == Kind::Scatter || k == Kind::Gather;
}
bool reducing(Kind k) {
  return k == Kind::AllReduce || k == Kind::Reduce || k == Kind::ReduceScatter;
}
bool collective(Kind k) {
  return k != Kind::SendRecv && k != Kind::Exchange;
}

enum class Fault {
  None,
  SizeMismatch,
  ReduceOpMismatch,
  RootMismatch,
  MissingMember,
  RecvWithoutSend,
  SendSizeMismatch,
  NotAMember,
  RootOutsideGroup
};
const char* fault_name(Fault f) {
  switch (f) {
    case Fault::None:
      return "none";
    case Fault::SizeMismatch:
      return "size mismatch";
    case Fault::ReduceOpMismatch:
      return "reduce op mismatch";
    case Fault::RootMismatch:
      return "root mismatch";
    case Fault::MissingMember:
      return "missing member";
    case Fault::RecvWithoutSend:
      return "recv without send";
    case Fault::SendSizeMismatch:
      return "send/recv size mismatch";
    case Fault::NotAMember:
      return "not a member";
    case Fault::RootOutsideGroup:
      return "root outside the group";
  }
  return "?";
}

struct Step {
  Kind kind = Kind::AllReduce;
  int group = 0;  // 0: the world; i > 0: groups[i - 1]
  ReduceOp op = ReduceOp::Sum;
  int root = 0;        // global rank (rooted operations)
  int a = 0, b = 1;    // src and dst of a send, the two ranks of an exchange
  std::int64_t n = 1;  // elements per piece
  bool async = false;
};

struct Program {
  std::uint64_t seed = 0;
  int world = 1;
  std::vector<std::vector<int>> groups;
  std::vector<Step> steps;
  Fault fault = Fault::None;
  int fault_rank = -1;  // the rank that makes the mistake (the last step is the faulty one)
  int other = -1;       // its wrong root or reduce op, where the fault has one

  std::vector<int> members(int g) const {
    if (g == 0) {
      std::vector<int> all(world);
      for (int i = 0; i < world; ++i) all[i] = i;
      return all;
    }
    return groups[g - 1];
  }
  std::string str() const {
    std::ostringstream s;
    s << "seed " << seed << ", world " << world << ", fault " << fault_name(fault) << " by rank "
      << fault_rank << "\n";
    for (size_t g = 0; g < groups.size(); ++g) {
      s << "  group " << g + 1 << ": {";
      for (int r : groups[g]) s << r << " ";
      s << "}\n";
    }
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& st = steps[k];
      s << "  " << k << ": " << kind_name(st.kind) << " n=" << st.n << (st.async ? " async" : "");
      if (collective(st.kind)) s << " group " << st.group;
      if (rooted(st.kind)) s << " root " << st.root;
      if (reducing(st.kind)) s << " " << reduce_op_name(st.op);
      if (!collective(st.kind)) s << " ranks " << st.a << ", " << st.b;
      s << "\n";
    }
    return s.str();
  }
};

// Small integers, so sums and products of up to 8 of them are exact in float32.
float value(size_t step, int rank, std::int64_t i) {
  return static_cast<float>((step * 7 + static_cast<size_t>(rank) * 3 + static_cast<size_t>(i) * 5) % 5 + 1);
}
std::vector<float> values(size_t step, int rank, std::int64_t count) {
  std::vector<float> v(static_cast<size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = value(step, rank, i);
  return v;
}

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

Step random_step(std::mt19937_64& rng, const Program& p) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  Step s;
  const int kinds = p.world >= 2 ? 11 : 8;  // no point-to-point in a world of one
  s.kind = static_cast<Kind>(pick(kinds));
  s.group = pick(static_cast<int>(p.groups.size()) + 1);
  s.op = static_cast<ReduceOp>(pick(5));
  const std::vector<int> m = p.members(s.group);
  s.root = m[static_cast<size_t>(pick(static_cast<int>(m.size())))];
  if (p.world >= 2) {
    s.a = pick(p.world);
    s.b = (s.a + 1 + pick(p.world - 1)) % p.world;
  }
  s.n = 1 + pick(4);
  s.async = pick(3) == 0;
  return s;
}

// Turns the last step into `fault` if it can be; false when that step cannot carry it.
bool inject(std::mt19937_64& rng, Program& p, Fault fault) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  Step& s = p.steps.back();
  const std::vector<int> m = p.members(s.group);
  const int g = static_cast<int>(m.size());
  const int member = m[static_cast<size_t>(pick(g))];
  switch (fault) {
    case Fault::None:
      return true;
    case Fault::SizeMismatch:
    case Fault::MissingMember:
      if (!collective(s.kind) || s.kind == Kind::Barrier || g < 2) return false;
      p.fault_rank = member;
      break;
    case Fault::ReduceOpMismatch:
      if (!reducing(s.kind) || g < 2) return false;
      p.fault_rank = member;
      p.other = (static_cast<int>(s.op) + 1 + pick(4)) % 5;
      break;
    case Fault::RootMismatch:
      if (!rooted(s.kind) || g < 2) return false;
      p.fault_rank = member;
      p.other =
          m[static_cast<size_t>((std::find(m.begin(), m.end(), s.root) - m.begin() + 1 + pick(g - 1)) % g)];
      break;
    case Fault::RecvWithoutSend:
    case Fault::SendSizeMismatch:
      if (s.kind != Kind::SendRecv) return false;
      p.fault_rank = s.a;
      break;
    case Fault::NotAMember: {
      if (!collective(s.kind) || g == p.world) return false;
      std::vector<int> outside;
      for (int r = 0; r < p.world; ++r)
        if (std::find(m.begin(), m.end(), r) == m.end()) outside.push_back(r);
      p.fault_rank = outside[static_cast<size_t>(pick(static_cast<int>(outside.size())))];
      break;
    }
    case Fault::RootOutsideGroup: {
      if (!rooted(s.kind)) return false;
      p.fault_rank = member;
      p.other = p.world;  // outside the world, and so outside every group
      for (int r = 0; r < p.world; ++r)
        if (std::find(m.begin(), m.end(), r) == m.end()) p.other = r;
      break;
    }
  }
  p.fault = fault;
  return true;
}

Program random_program(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  Program p;
  p.seed = seed;
  p.world = 1 + pick(8);
  const int groups = pick(3);
  for (int i = 0; i < groups; ++i) {
    std::vector<int> all(static_cast<size_t>(p.world));
    for (int r = 0; r < p.world; ++r) all[static_cast<size_t>(r)] = r;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(1 + pick(p.world)));
    p.groups.push_back(all);
  }
  const int steps = 1 + pick(10);
  for (int i = 0; i < steps; ++i) p.steps.push_back(random_step(rng, p));
  // One program in three ends with a mistake.
  if (pick(3) == 0) {
    const Fault fault = static_cast<Fault>(1 + pick(8));
    for (int tries = 0; tries < 40 && p.fault == Fault::None; ++tries) {
      p.steps.back() = random_step(rng, p);
      inject(rng, p, fault);
    }
  }
  return p;
}

// What each rank ends with, per step: expected[rank][step] (empty where the rank keeps nothing).
using Results = std::vector<std::map<size_t, std::vector<float>>>;

Results expected_results(const Program& p) {
  Results out(static_cast<size_t>(p.world));
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const Step& s = p.steps[k];
    const std::vector<int> m = p.members(s.group);
    const std::int64_t g = static_cast<std::int64_t>(m.size()), n = s.n;
    auto reduce_at = [&](std::int64_t offset) {
      std::vector<float> acc(static_cast<size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) {
        float a = value(k, m[0], offset + i);
        for (std::int64_t j = 1; j < g; ++j)
          a = combine(s.op, a, value(k, m[static_cast<size_t>(j)], offset + i));
        if (s.op == ReduceOp::Avg) a /= static_cast<float>(g);
        acc[static_cast<size_t>(i)] = a;
      }
      return acc;
    };
    switch (s.kind) {
      case Kind::AllReduce:
        for (int r : m) out[static_cast<size_t>(r)][k] = reduce_at(0);
        break;
      case Kind::Reduce:
        out[static_cast<size_t>(s.root)][k] = reduce_at(0);
        break;
      case Kind::Broadcast:
        for (int r : m) out[static_cast<size_t>(r)][k] = values(k, s.root, n);
        break;
      case Kind::AllGather:
      case Kind::Gather: {
        std::vector<float> all;
        for (int r : m) {
          const std::vector<float> v = values(k, r, n);
          all.insert(all.end(), v.begin(), v.end());
        }
        if (s.kind == Kind::Gather) {
          out[static_cast<size_t>(s.root)][k] = all;
        } else {
          for (int r : m) out[static_cast<size_t>(r)][k] = all;
        }
        break;
      }
      case Kind::ReduceScatter:
        for (std::int64_t j = 0; j < g; ++j)
          out[static_cast<size_t>(m[static_cast<size_t>(j)])][k] = reduce_at(j * n);
        break;
      case Kind::Scatter: {
        const std::vector<float> in = values(k, s.root, g * n);
        for (std::int64_t j = 0; j < g; ++j) {
          out[static_cast<size_t>(m[static_cast<size_t>(j)])][k] =
              std::vector<float>(in.begin() + j * n, in.begin() + (j + 1) * n);
        }
        break;
      }
      case Kind::AllToAll:
        for (std::int64_t j = 0; j < g; ++j) {
          std::vector<float> mine;
          for (std::int64_t q = 0; q < g; ++q) {
            const std::vector<float> in = values(k, m[static_cast<size_t>(q)], g * n);
            mine.insert(mine.end(), in.begin() + j * n, in.begin() + (j + 1) * n);
          }
          out[static_cast<size_t>(m[static_cast<size_t>(j)])][k] = mine;
        }
        break;
      case Kind::SendRecv:
        out[static_cast<size_t>(s.b)][k] = values(k, s.a, n);
        break;
      case Kind::Exchange:
        out[static_cast<size_t>(s.b)][k] = values(k, s.a, n);
        out[static_cast<size_t>(s.a)][k] = values(k, s.b, n);
        break;
      case Kind::Barrier:
        break;
    }
  }
  return out;
}

// Runs the program as every rank would, the faulty rank making its mistake in the last step.
void run_program(Rank& r, const Program& p, Results& got) {
  const int me = r.rank();
  std::vector<Group> groups{Group{}};
  for (const auto& g : p.groups) groups.push_back(r.new_group(g));
  std::vector<Work> pending;
  std::vector<std::pair<size_t, Tensor>> kept;
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const Step& s = p.steps[k];
    const bool last = k + 1 == p.steps.size();
    const bool faulty = last && p.fault != Fault::None && me == p.fault_rank;
    const std::vector<int> m = p.members(s.group);
    const bool member = std::find(m.begin(), m.end(), me) != m.end();
    const Async async = s.async ? Async::Yes : Async::No;
    std::int64_t n = s.n;
    ReduceOp op = s.op;
    int root = s.root;
    if (faulty) {
      if (p.fault == Fault::MissingMember || p.fault == Fault::RecvWithoutSend) continue;
      if (p.fault == Fault::SizeMismatch) n += 1;
      if (p.fault == Fault::ReduceOpMismatch) op = static_cast<ReduceOp>(p.other);
      if (p.fault == Fault::RootMismatch || p.fault == Fault::RootOutsideGroup) root = p.other;
    }
    const std::int64_t g = static_cast<std::int64_t>(m.size());
    auto data = [&](std::int64_t count) { return r.from_host(Shape{count}, values(k, me, count)); };
    auto done = [&](Work w) { pending.push_back(std::move(w)); };
    if (collective(s.kind) && !member && !faulty) continue;
    const Group& grp = groups[static_cast<size_t>(s.group)];
    switch (s.kind) {
      case Kind::AllReduce: {
        Tensor t = data(n);
        done(r.all_reduce(t, op, async, grp));
        kept.emplace_back(k, t);
        break;
      }
      case Kind::Reduce: {
        Tensor t = data(n);
        done(r.reduce(t, root, op, async, grp));
        if (me == root) kept.emplace_back(k, t);
        break;
      }
      case Kind::Broadcast: {
        Tensor t = me == root ? data(n) : r.zeros(Shape{n});
        done(r.broadcast(t, root, async, grp));
        kept.emplace_back(k, t);
        break;
      }
      case Kind::AllGather: {
        Tensor out = r.zeros(Shape{g * n});
        done(r.all_gather(out, data(n), async, grp));
        kept.emplace_back(k, out);
        break;
      }
      case Kind::Gather: {
        Tensor out = me == root ? r.zeros(Shape{g * n}) : Tensor{};
        done(r.gather(out, data(n), root, async, grp));
        if (me == root) kept.emplace_back(k, out);
        break;
      }
      case Kind::ReduceScatter: {
        Tensor out = r.zeros(Shape{n});
        done(r.reduce_scatter(out, data(g * n), op, async, grp));
        kept.emplace_back(k, out);
        break;
      }
      case Kind::Scatter: {
        Tensor out = r.zeros(Shape{n});
        done(r.scatter(out, me == root ? data(g * n) : Tensor{}, root, async, grp));
        kept.emplace_back(k, out);
        break;
      }
      case Kind::AllToAll: {
        Tensor out = r.zeros(Shape{g * n});
        done(r.all_to_all(out, data(g * n), async, grp));
        kept.emplace_back(k, out);
        break;
      }
      case Kind::Barrier:
        r.barrier(grp);
        break;
      case Kind::SendRecv:
        if (me == s.a) done(r.send(data(n), s.b, async));
        if (me == s.b) {
          const bool wrong = last && p.fault == Fault::SendSizeMismatch;
          Tensor t = r.zeros(Shape{wrong ? n + 1 : n});
          done(r.recv(t, s.a, async));
          kept.emplace_back(k, t);
        }
        break;
      case Kind::Exchange:
        if (me == s.a || me == s.b) {
          const int peer = me == s.a ? s.b : s.a;
          Tensor in = r.zeros(Shape{n});
          for (Work& w : r.batch_isend_irecv({{CommOp::Send, data(n), peer}, {CommOp::Recv, in, peer}}))
            done(w);
          kept.emplace_back(k, in);
        }
        break;
    }
  }
  for (Work& w : pending) w.wait();
  for (auto& [k, t] : kept) got[static_cast<size_t>(me)][k] = r.to_host(t);
}

// The error a faulty program must end with: its type and what the message must say.
struct ExpectedError {
  std::string type;
  std::vector<std::string> says;
};

ExpectedError expected_error(const Program& p) {
  const Step& s = p.steps.back();
  const std::string rank = "rank " + std::to_string(p.fault_rank);
  const std::string op = kind_name(s.kind);
  switch (p.fault) {
    case Fault::None:
      return {};
    case Fault::SizeMismatch:
    case Fault::ReduceOpMismatch:
    case Fault::RootMismatch:
      return {"MismatchError", {"ranks disagree on collective #", "(" + op + ")", rank + ": " + op + "("}};
    case Fault::MissingMember:
      return {"DeadlockError", {"(" + op + ")", rank + " has not called it"}};
    case Fault::RecvWithoutSend:
      return {"DeadlockError",
              {"from rank " + std::to_string(s.a) + " to rank " + std::to_string(s.b),
               rank + " has not called it"}};
    case Fault::SendSizeMismatch:
      return {"MismatchError",
              {rank + " sends float32[" + std::to_string(s.n) + "] but rank " + std::to_string(s.b) +
               " receives into float32[" + std::to_string(s.n + 1) + "]"}};
    case Fault::NotAMember:
      return {"UsageError", {rank + ": " + op, rank + " is not a member of the group"}};
    case Fault::RootOutsideGroup:
      return {"UsageError", {rank + ": " + op + ": root " + std::to_string(p.other) + " is not a member of"}};
  }
  return {};
}

TEST(RandomSpmd, ProgramsEndWithTheRightNumbersOrTheRightError) {
  const int programs = 1000;
  int faulty = 0;
  std::map<std::string, int> errors;
  for (int i = 0; i < programs; ++i) {
    const Program p = random_program(0x5eed0000u + static_cast<std::uint64_t>(i));
    SCOPED_TRACE(p.str());
    SimBackend backend(testing::quiet_config());
    Results got(static_cast<size_t>(p.world));
    std::string type, message;
    try {
      backend.launch(p.world, [&](Rank& r) { run_program(r, p, got); });
    } catch (const MismatchError& e) {
      type = "MismatchError", message = e.what();
    } catch (const DeadlockError& e) {
      type = "DeadlockError", message = e.what();
    } catch (const UsageError& e) {
      type = "UsageError", message = e.what();
    } catch (const std::exception& e) {
      type = "other", message = e.what();
    }
    if (p.fault == Fault::None) {
      ASSERT_EQ(type, "") << message;
      const Results want = expected_results(p);
      for (int r = 0; r < p.world; ++r) {
        ASSERT_EQ(got[static_cast<size_t>(r)].size(), want[static_cast<size_t>(r)].size()) << "rank " << r;
        for (const auto& [k, v] : want[static_cast<size_t>(r)]) {
          const std::vector<float>& g = got[static_cast<size_t>(r)][k];
          ASSERT_EQ(g.size(), v.size()) << "rank " << r << ", step " << k;
          for (size_t j = 0; j < v.size(); ++j)
            ASSERT_FLOAT_EQ(g[j], v[j]) << "rank " << r << ", step " << k << ", element " << j;
        }
      }
    } else {
      ++faulty;
      ++errors[type];
      const ExpectedError want = expected_error(p);
      ASSERT_EQ(type, want.type) << message;
      for (const std::string& s : want.says)
        EXPECT_NE(message.find(s), std::string::npos) << s << "\n" << message;
    }
  }
  std::map<Fault, int> faults;
  for (int i = 0; i < programs; ++i)
    ++faults[random_program(0x5eed0000u + static_cast<std::uint64_t>(i)).fault];
  std::string summary = std::to_string(programs - faulty) + " right programs;";
  for (const auto& [f, n] : faults) summary += fmt::format(" {} {},", fault_name(f), n);
  std::printf("%s\n", summary.c_str());
  // The draw covers both kinds of program and every kind of error.
  EXPECT_GT(faulty, programs / 6);
  EXPECT_GT(errors["MismatchError"], 0);
  EXPECT_GT(errors["DeadlockError"], 0);
  EXPECT_GT(errors["UsageError"], 0);
  for (int f = 1; f <= 8; ++f)
    EXPECT_GT(faults[static_cast<Fault>(f)], 0) << fault_name(static_cast<Fault>(f));
}

}  // namespace
}  // namespace ranklab
