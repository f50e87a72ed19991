// pipeline_parallel: equal to one device for every schedule, world size, optimizer and kind of send/recv;
// the bubble of uniform stages against (p-1)/(m+p-1); 1f1b's bound on activations; the clear errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "common/html_report.h"
#include "common/lesson.h"
#include "common/report.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

RunReport run(const Settings& o, const Profile& profile) {
  SimConfig c = testing::quiet_config();
  c.profile = profile;
  SimBackend backend(c);
  return run_lesson(backend, "pipeline_parallel", o);
}
RunReport run(const Settings& o) {
  return run(o, testing::quiet_config().profile);
}

Settings small(int world, const std::string& schedule, bool async, const std::string& optimizer) {
  Settings o;
  o["world"] = option_text(world);
  o["batch"] = option_text(12);
  o["micro-batches"] = option_text(4);  // 3 samples each
  o["dim"] = option_text(
      16);  // at 8, twelve relu layers leave float32's bound on stage 0 as large as its values by step 3
  o["layers"] = option_text(12);  // divisible by 1, 2, 3 and 4
  o["steps"] = option_text(3);
  o["schedule"] = option_text(schedule);
  o["async-p2p"] = option_text(async);
  o["optimizer"] = option_text(optimizer);
  o["lr"] = option_text(optimizer == "adamw" ? 0.01 : 0.05);
  o["quiet"] = option_text(true);
  return o;
}

// The dgx-h100 profile without the costs of launching kernels and of memory traffic: what remains is the
// matmuls' arithmetic, the same on every stage, and the transfers between stages.
Profile compute_only_profile() {
  Profile p = testing::quiet_config().profile;
  p.gpu.launch_overhead_us = 0;
  p.gpu.hbm_bandwidth_gbps = 1e12;
  p.barrier_latency_us = 0;
  return p;
}

// The longest send/recv of a run, as the report recorded it.
double longest_transfer(const RunReport& rep) {
  double longest = 0;
  for (const CollectiveRecord& c : rep.collectives) {
    if (c.op == CommOp::Send) longest = std::max(longest, c.time_us());
  }
  return longest;
}

// From the first rank's start of the last step's schedule to the last rank's end.
double schedule_window(const RunReport& rep) {
  std::vector<RegionRecord> last(rep.world);
  for (const RegionRecord& g : rep.regions) {
    if (g.name == "schedule") last[g.rank] = g;
  }
  double from = last[0].start_us, to = last[0].end_us;
  for (const RegionRecord& g : last) {
    from = std::min(from, g.start_us);
    to = std::max(to, g.end_us);
  }
  return to - from;
}

// The "bubble fraction X measured" the lesson prints.
double printed_bubble(const RunReport& rep) {
  for (const std::string& line : rep.output) {
    const std::string key = "bubble fraction ";
    if (line.rfind(key, 0) == 0) return std::strtod(line.c_str() + key.size(), nullptr);
  }
  ADD_FAILURE() << "the lesson printed no bubble fraction";
  return -1;
}

// The same from the report: each rank's compute-stream busy time inside its own "schedule" region of the
// last step (after it, a rank is on to its optimizer step), against the time from the first rank's start to
// the last rank's end, averaged over ranks.
double report_bubble(const RunReport& rep) {
  std::vector<RegionRecord> last(rep.world);
  for (const RegionRecord& g : rep.regions) {
    if (g.name == "schedule") last[g.rank] = g;
  }
  double from = last[0].start_us, to = last[0].end_us;
  for (const RegionRecord& g : last) {
    from = std::min(from, g.start_us);
    to = std::max(to, g.end_us);
  }
  double bubble = 0;
  for (int r = 0; r < rep.world; ++r) {
    double busy = 0;  // the compute stream runs one kernel at a time: spans do not overlap
    for (const Span& s : rep.spans) {
      if (s.rank != r || s.kind != SpanKind::Compute) continue;
      busy += std::max(0.0, std::min(s.end_us, last[r].end_us) - std::max(s.start_us, last[r].start_us));
    }
    bubble += 1 - busy / (to - from);
  }
  return bubble / rep.world;
}

// How many times `needle` occurs in `text`.
int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

Settings uniform_stages(int p, int m, const std::string& schedule) {
  Settings o;
  o["world"] = option_text(p);
  o["phantom"] = option_text(true);
  o["dim"] = option_text(4096);  // a matmul of tens of microseconds: large against a launch or a transfer
  o["layers"] = option_text(2 * p);
  o["micro-batches"] = option_text(m);
  o["batch"] = option_text(64 * m);
  o["steps"] = option_text(1);
  o["schedule"] = option_text(schedule);
  o["quiet"] = option_text(true);
  return o;
}

TEST(PipelineParallel, EqualsOneDeviceForEverySchedule) {
  for (const char* schedule : {"naive", "gpipe", "1f1b"}) {
    for (int world : {1, 2, 3, 4}) {
      for (bool async : {false, true}) {
        for (const char* optimizer : {"sgd", "adamw"}) {
          SCOPED_TRACE(::testing::Message() << schedule << ", world " << world
                                            << (async ? ", isend/irecv" : "") << ", " << optimizer);
          const Settings o = small(world, schedule, async, optimizer);
          RunReport rep = run(o);
          EXPECT_TRUE(rep.all_checks_passed());
          int steps_checked = 0;
          for (const CheckRecord& c : rep.checks) {
            if (c.what.rfind("pipeline_parallel step", 0) == 0 && c.passed) ++steps_checked;
          }
          EXPECT_EQ(steps_checked, testing::number(o, "steps") * world);  // every stage, every step
        }
      }
    }
  }
}

TEST(PipelineParallel, ManyStagesAndMicroBatchesNeverDeadlock) {
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int p : {5, 8}) {
      for (int m : {1, 3, 8, 13}) {
        for (bool async : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << schedule << " p=" << p << " m=" << m << (async ? " async" : ""));
          Settings o = uniform_stages(p, m, schedule);
          o["dim"] = option_text(64);
          o["async-p2p"] = option_text(async);
          EXPECT_NO_THROW(run(o));
        }
      }
    }
  }
}

TEST(PipelineParallel, BubbleOfUniformStagesIsTheFormulaWithinTheTransfers) {
  // Every stage runs the same matmuls, so the bubble is (p-1)/(m+p-1), plus what the formula leaves out:
  // the transfers. A step's critical path has 2(m+p-1) tasks, and before each one at most two transfers
  // (its input arriving, and a blocking send of the task before it); the test takes their time from the
  // report. (The last stage's sum of its output for
  // the loss is the one other difference between stages: `skew`, its arithmetic against a forward's.)
  const Profile prof = compute_only_profile();
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int p : {2, 4}) {
      for (int m : {1, 4, 8}) {
        for (bool async : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << schedule << " p=" << p << " m=" << m << (async ? " isend/irecv" : ""));
          Settings o = uniform_stages(p, m, schedule);
          o["async-p2p"] = option_text(async);
          RunReport rep = run(o, prof);
          const double analytic = (p - 1.0) / (m + p - 1.0);
          const double skew = 1.0 / (2 * testing::number(o, "dim"));
          const double term = 2 * (m + p - 1) * 2 * longest_transfer(rep) / schedule_window(rep);
          const double measured = printed_bubble(rep);
          EXPECT_GE(measured, analytic - skew - 1e-4);
          EXPECT_LE(measured, analytic + skew + term);
          EXPECT_NEAR(report_bubble(rep), measured, 1e-3);  // the lesson's own clock agrees with the report
        }
      }
    }
  }
}

TEST(PipelineParallel, TheScheduleIsInTheReportAndDrawnAtTheTopOfThePage) {
  const int p = 4, m = 8;
  const RunReport rep = run(uniform_stages(p, m, "1f1b"), compute_only_profile());
  // Every stage reported its forward and backward of every micro-batch, once, on its own rank.
  ASSERT_EQ(rep.pipeline.size(), static_cast<std::size_t>(p * 2 * m));
  std::map<std::tuple<int, bool, int>, int> seen;
  for (const PipelineTask& t : rep.pipeline) {
    EXPECT_EQ(t.rank, t.stage);
    EXPECT_EQ(t.chunk, 0);
    EXPECT_LT(t.start_us, t.end_us);
    ++seen[{t.stage, t.forward, t.micro_batch}];
    // On the run's clock: the rank's compute stream is busy for (nearly) all of the task.
    double covered = 0;
    for (const Span& s : rep.spans) {
      if (s.rank != t.rank || s.kind != SpanKind::Compute) continue;
      covered += std::max(0.0, std::min(s.end_us, t.end_us) - std::max(s.start_us, t.start_us));
    }
    EXPECT_GT(covered, 0.99 * (t.end_us - t.start_us)) << "stage " << t.stage << " mb " << t.micro_batch;
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(p * 2 * m));

  const std::string html = report_to_html(rep);
  const auto chart = html.find("<svg id=\"pipeline\""), timeline = html.find("id=\"timeline\"");
  ASSERT_NE(chart, std::string::npos);
  EXPECT_LT(chart, timeline);
  for (int stage = 0; stage < p; ++stage) {
    EXPECT_NE(
        html.find(fmt::format("<g data-stage=\"{0}\" data-rank=\"{0}\" data-boxes=\"{1}\">", stage, 2 * m)),
        std::string::npos)
        << stage;
  }
  EXPECT_EQ(count(html, "<g class=\"task\">"), p * 2 * m);
  EXPECT_NE(html.find("(p-1)/(v&middot;m) = 3/(1&middot;8) = <b>37.5%</b>"), std::string::npos);

  // A run without a pipeline has no chart.
  Settings dp;
  dp["world"] = option_text(2);
  dp["steps"] = option_text(1);
  dp["quiet"] = option_text(true);
  SimBackend backend(testing::quiet_config());
  const RunReport flat = run_lesson(backend, "data_parallel", dp);
  EXPECT_TRUE(flat.pipeline.empty());
  EXPECT_EQ(report_to_html(flat).find("id=\"pipeline\""), std::string::npos);
}

TEST(PipelineParallel, IsendIrecvHideTransfersUnderCompute) {
  // With blocking send/recv each transfer sits between two tasks; with isend/irecv the next input travels
  // while the current task computes, and the sender does not wait for its send.
  const Profile prof = compute_only_profile();
  for (const char* schedule : {"gpipe", "1f1b"}) {
    SCOPED_TRACE(schedule);
    Settings o = uniform_stages(4, 8, schedule);
    const double blocking = schedule_window(run(o, prof));
    o["async-p2p"] = option_text(true);
    const double overlapped = schedule_window(run(o, prof));
    EXPECT_LT(overlapped, blocking);
  }
}

TEST(PipelineParallel, LaunchOverheadWidensTheBubbleByAtMostItsTerm) {
  // The real profile's kernel launches. Every hand-over from one task to the next costs the host four
  // launches (the send, the recv, the timing marker, the first kernel of the task) besides the transfers.
  const Profile prof = testing::quiet_config().profile;
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int m : {4, 8}) {
      const int p = 4;
      SCOPED_TRACE(::testing::Message() << schedule << " m=" << m);
      Settings o = uniform_stages(p, m, schedule);
      RunReport rep = run(o, prof);
      const double analytic = (p - 1.0) / (m + p - 1.0);
      const double hand_over = 4 * prof.gpu.launch_overhead_us + 2 * longest_transfer(rep);
      const double term = 2 * (m + p - 1) * hand_over / schedule_window(rep);
      const double measured = printed_bubble(rep);
      EXPECT_GE(measured, analytic - 1e-4);
      EXPECT_LE(measured, analytic + term);
    }
  }
}

TEST(PipelineParallel, OneFOneBKeepsAtMostPMicroBatchesAlive) {
  Settings o = uniform_stages(4, 12, "1f1b");
  o["dim"] = option_text(256);
  o["layers"] =
      option_text(32);  // eight layers a stage: most of a micro-batch's activations never leave the stage
  RunReport f1b1 = run(o);
  int bounded = 0;
  for (const CheckRecord& c : f1b1.checks) {
    if (c.what.find("keeps the activations of at most p micro-batches") != std::string::npos && c.passed)
      ++bounded;
  }
  EXPECT_EQ(bounded, 4);  // every stage
  EXPECT_TRUE(f1b1.all_checks_passed());
  // GPipe keeps all twelve: the first stage's peak memory shows it.
  o["schedule"] = option_text("gpipe");
  RunReport gpipe = run(o);
  const double activation = 4.0 * 64 * 256;  // one layer's output for one micro-batch
  EXPECT_GT(static_cast<double>(gpipe.ranks[0].peak_bytes - f1b1.ranks[0].peak_bytes), (12 - 4) * activation);
}

std::string error_of(const Settings& o) {
  try {
    run(o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineParallel, LayersNotDivisibleByTheStagesIsAClearError) {
  Settings o = small(4, "gpipe", false, "sgd");
  o["layers"] = option_text(10);
  const std::string msg = error_of(o);
  EXPECT_NE(msg.find("--layers 10 is not divisible by --world 4"), std::string::npos) << msg;
}

TEST(PipelineParallel, MicroBatchesThatDoNotDivideTheBatchAreAClearError) {
  Settings o = small(4, "gpipe", false, "sgd");
  o["micro-batches"] = option_text(5);
  const std::string msg = error_of(o);
  EXPECT_NE(msg.find("--micro-batches 5 does not divide --batch 12"), std::string::npos) << msg;
}

TEST(PipelineParallel, UnknownScheduleIsAClearError) {
  Settings o = small(2, "zigzag", false, "sgd");
  EXPECT_NE(error_of(o).find("--schedule must be naive, gpipe or 1f1b"), std::string::npos);
}

}  // namespace
}  // namespace ranklab
