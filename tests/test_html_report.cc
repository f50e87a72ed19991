#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>

#include "chromium.h"
#include "common/assets.h"
#include "common/html_report.h"
#include "common/report.h"
#include "common/trace_ranks.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A link of the machine, and its traffic when it carried some.
void add_link(RunReport& r, const std::string& from, const std::string& to, const std::string& tier,
              std::int64_t bytes, double gbps) {
  const std::string id = from + "->" + to;
  r.topology.links.push_back({id, from, to, tier, gbps});
  if (bytes > 0) r.links.push_back({id, tier, bytes, gbps});
}

// A two-node machine as data: per GPU, NVLink up and down through its node's NVSwitch and a PCIe link to its
// own NIC; each NIC to the leaf of its rail, and each leaf to one spine. Every link carries bytes.
void add_machine(RunReport& r) {
  const int per_node = r.gpus_per_node;
  for (int k = 0; k < r.world; ++k)
    r.topology.nodes.push_back({fmt::format("gpu{}", k), "gpu", 4, k / per_node, k});
  for (int node = 0; node < 2; ++node) {
    r.topology.nodes.push_back({fmt::format("nvswitch{}", node), "nvswitch", 5, node, -1});
  }
  for (int k = 0; k < r.world; ++k)
    r.topology.nodes.push_back({fmt::format("nic{}", k), "nic", 2, k / per_node, -1});
  for (int leaf = 0; leaf < per_node; ++leaf)
    r.topology.nodes.push_back({fmt::format("leaf{}", leaf), "leaf", 1, -1, -1});
  r.topology.nodes.push_back({"spine0", "spine", 0, -1, -1});
  for (int k = 0; k < r.world; ++k) {
    const std::string gpu = fmt::format("gpu{}", k), nvswitch = fmt::format("nvswitch{}", k / per_node),
                      nic = fmt::format("nic{}", k);
    add_link(r, gpu, nvswitch, "nvlink", (k + 1) * (std::int64_t{1} << 30), 450);
    add_link(r, nvswitch, gpu, "nvlink", (k + 1) * (std::int64_t{1} << 29), 450);
    add_link(r, gpu, nic, "pcie", std::int64_t{1} << 28, 63);
    add_link(r, nic, fmt::format("leaf{}", k % per_node), "infiniband", std::int64_t{1} << 28, 50);
  }
  for (int leaf = 0; leaf < per_node; ++leaf) {
    add_link(r, fmt::format("leaf{}", leaf), "spine0", "infiniband", std::int64_t{1} << 27, 50);
  }
}

// A training-like run: `world` ranks, `steps` steps of forward and backward kernels, an all_reduce whose
// members arrive at different times (waits), and idle gaps; links of a two-node machine with NVSwitches,
// NICs and a leaf/spine fabric.
RunReport training_report(int world, int steps) {
  RunReport r;
  r.lesson = "data_parallel";
  r.backend = "sim";
  r.profile = "dgx-h100";
  r.world = world;
  r.gpus_per_node = world / 2;
  r.options = {{"steps", std::to_string(steps)}, {"dim", "1024"}};
  const double step_us = 100;
  for (int s = 0; s < steps; ++s) {
    const double t0 = s * step_us;
    for (int k = 0; k < world; ++k) {
      const double skew = 3.0 * k;  // later ranks finish their backward later
      r.spans.push_back({k, SpanKind::Compute, "matmul", t0, t0 + 20});
      r.spans.push_back({k, SpanKind::Compute, "relu", t0 + 20, t0 + 25});
      r.spans.push_back({k, SpanKind::Compute, "matmul", t0 + 25, t0 + 50 + skew});
      const double arrive = t0 + 50 + skew, start = t0 + 50 + 3.0 * (world - 1);
      if (start > arrive) r.spans.push_back({k, SpanKind::Idle, "all_reduce", arrive, start});
      r.spans.push_back({k, SpanKind::Comm, "all_reduce", start, start + 30});
      r.spans.push_back({k, SpanKind::Compute, "sgd_step", start + 30, start + 33});
      r.regions.push_back({k, "step", t0, start + 33});
    }
    CollectiveRecord c;
    c.op = CommOp::AllReduce;
    c.group = "world";
    c.group_size = world;
    c.bytes = 64 << 20;
    c.algorithm = "ring";
    c.start_us = t0 + 50 + 3.0 * (world - 1);
    c.end_us = c.start_us + 30;
    c.algbw_gbps = static_cast<double>(c.bytes) / (30 * 1e3);
    c.busbw_gbps = c.algbw_gbps * bus_factor(c.op, world);
    r.collectives.push_back(c);
  }
  for (int k = 0; k < world; ++k) {
    RankSummary s;
    s.rank = k;
    s.peak_bytes = (std::int64_t{10} + k) << 30;
    s.capacity_bytes = std::int64_t{80} << 30;
    r.ranks.push_back(s);
  }
  add_machine(r);
  r.checks = {{0, "loss decreases", true, ""}, {1, "params equal", false, "off by 1e-3"}};
  r.output = {"step 0 loss 2.3", "<script>alert('not run')</script>"};
  summarize_spans(r);
  return r;
}

TEST(HtmlReport, EscapesWhatItEmbeds) {
  EXPECT_EQ(html_escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
  EXPECT_EQ(script_json(R"({"x":"</script><!--"})"), R"({"x":"\u003c/script>\u003c!--"})");
  EXPECT_EQ(json_number(1.5), "1.5");
  EXPECT_EQ(json_number(2.0), "2");
  EXPECT_EQ(json_number(0.0001), "0");
  EXPECT_EQ(json_number(-0.0001), "0");
  EXPECT_EQ(json_number(1.23456), "1.235");
}

TEST(HtmlReport, SelfContainedWithEverySection) {
  const std::string html = report_to_html(training_report(8, 10));
  for (const char* id :
       {"id=\"config\"", "id=\"topology\"", "id=\"timeline\"", "id=\"timeline-data\"", "id=\"collectives\"",
        "id=\"ranks\"", "id=\"memory\"", "id=\"checks\"", "id=\"errors\""}) {
    EXPECT_TRUE(contains(html, id)) << id;
  }
  // Nothing is fetched: no external scripts, styles, fonts or images.
  EXPECT_FALSE(std::regex_search(html, std::regex(R"(<script[^>]*\ssrc=)")));
  EXPECT_FALSE(std::regex_search(html, std::regex(R"(<link\b)")));
  EXPECT_FALSE(std::regex_search(html, std::regex(R"(@import|url\(\s*['"]?(https?:|//))")));
  EXPECT_FALSE(std::regex_search(html, std::regex(R"(<img\b)")));
  // The lesson's output is text, never markup.
  EXPECT_FALSE(contains(html, "<script>alert"));
  EXPECT_TRUE(contains(html, "&lt;script&gt;alert"));
  // The configuration, the options and a failed check are there.
  EXPECT_TRUE(contains(html, "--dim"));
  EXPECT_TRUE(contains(html, "off by 1e-3"));
  EXPECT_TRUE(contains(html, "1 of 2 checks failed"));
}

// The text of a file of the source tree.
std::string source_file(const std::string& path) {
  std::ifstream f(fs::path(RANKLAB_SOURCE_DIR) / path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

TEST(HtmlReport, ScriptsAndStylesAreTheAssetFilesEmbedded) {
  // What the build embedded is each file of common/assets/ byte for byte.
  const std::pair<const char*, std::string_view> files[] = {{"page.css", assets::page_css},
                                                            {"page.js", assets::page_js},
                                                            {"timeline.js", assets::timeline_js},
                                                            {"compare.js", assets::compare_js}};
  for (const auto& [name, text] : files) {
    const std::string file = source_file(std::string("common/assets/") + name);
    ASSERT_FALSE(file.empty()) << name;
    EXPECT_EQ(text, file) << name;
  }
  // And the page holds them, inline: the shared helpers, the timeline's drawing, the colours.
  const std::string html = report_to_html(training_report(4, 2));
  EXPECT_TRUE(contains(html, std::string(assets::page_css)));
  EXPECT_TRUE(contains(html, std::string(assets::page_js)));
  EXPECT_TRUE(contains(html, std::string(assets::timeline_js)));
  EXPECT_TRUE(contains(html, "var ranklab = {"));
  EXPECT_TRUE(contains(html, "function drawBand("));
  EXPECT_TRUE(contains(html, "--compute: #3b75af"));
  EXPECT_FALSE(contains(html, std::string(assets::compare_js)));  // only what the page uses
}

TEST(HtmlReport, TrainingStepAboveTheTimeline) {
  RunReport r = training_report(8, 10);
  EXPECT_FALSE(contains(report_to_html(r), "id=\"training\""));  // only for training lessons
  TrainingStats t;
  t.model = "gpt3-175b";
  t.layout = "tp 8 x pp 8";
  t.step_time_us = 2e6;
  t.mfu = 0.42;
  t.bubble_fraction = 0.1;
  t.bubble_fraction_formula = 0.09;
  t.micro_batches = 8;
  t.exposed_comm_us = {{"tp", 1000}};
  t.peak_memory_bytes = 1 << 30;
  t.weights_bytes = 1 << 28;
  t.activations_bytes = 3 << 28;
  r.training = t;
  const std::string html = report_to_html(r);
  const auto training = html.find("id=\"training\""), timeline = html.find("id=\"timeline\"");
  ASSERT_NE(training, std::string::npos);
  EXPECT_LT(training, timeline);
  EXPECT_TRUE(contains(html, "42.0%"));
  EXPECT_TRUE(contains(html, "10.0% / 9.0%"));
  EXPECT_TRUE(contains(html, "exposed tp communication"));
  EXPECT_TRUE(contains(html, "activations 768 MiB"));
}

// A two-stage pipeline of m micro-batches, gpipe-like: the forwards, then the backwards, each task 10 us;
// stage 1 starts a task later than stage 0 and stage 0 waits for stage 1's backwards.
void add_pipeline(RunReport& r, int m, int chunks) {
  for (int stage = 0; stage < 2; ++stage) {
    double t = 10.0 * stage;
    for (int c = 0; c < chunks; ++c) {
      for (int k = 0; k < m; ++k, t += 10) r.pipeline.push_back({stage, stage, c, k, true, t, t + 10});
    }
    t = 10.0 * m * chunks + 10 + 10.0 * (1 - stage);
    for (int c = chunks - 1; c >= 0; --c) {
      for (int k = 0; k < m; ++k, t += 10) r.pipeline.push_back({stage, stage, c, k, false, t, t + 10});
    }
  }
}

TEST(HtmlReport, PipelineScheduleAtTheTop) {
  RunReport r = training_report(2, 1);
  EXPECT_EQ(report_to_html(r).find("id=\"pipeline\""), std::string::npos);  // only with a pipeline
  add_pipeline(r, 4, 1);
  const std::string html = report_to_html(r);
  const auto chart = html.find("<svg id=\"pipeline\""), timeline = html.find("id=\"timeline\"");
  ASSERT_NE(chart, std::string::npos);
  EXPECT_LT(chart, timeline);
  EXPECT_LT(html.find("id=\"config\""), chart);
  EXPECT_TRUE(contains(html, "data-stages=\"2\" data-tasks=\"16\""));
  EXPECT_TRUE(contains(html, "<g data-stage=\"0\" data-rank=\"0\" data-boxes=\"8\">"));
  EXPECT_TRUE(contains(html, "<g data-stage=\"1\" data-rank=\"1\" data-boxes=\"8\">"));
  // Each stage computes 80 us in a window of 100: idle 20 over compute 80. The formula: (2-1)/(1·4).
  EXPECT_TRUE(contains(html, "Bubble: <b>25.0%</b> measured")) << html.substr(chart - 600, 600);
  EXPECT_TRUE(contains(html, "(p-1)/(v&middot;m) = 1/(1&middot;4) = <b>25.0%</b>"));
  // Boxes are named by micro-batch, forward and backward apart, and the timeline has the tasks too.
  EXPECT_TRUE(contains(html, "<title>backward mb 3: 10.0 us, from 90.0 us</title>"));
  EXPECT_TRUE(contains(html, ">F3</text>"));
  EXPECT_TRUE(contains(html, "style=\"fill:var(--backward)\""));
  EXPECT_TRUE(contains(html, "\"f\":[0,10,"));
  EXPECT_TRUE(contains(html, "forward task (F3: micro-batch 3)"));
}

TEST(HtmlReport, InterleavedScheduleNamesChunks) {
  RunReport r = training_report(2, 1);
  add_pipeline(r, 2, 2);
  const std::string html = report_to_html(r);
  EXPECT_TRUE(contains(html, "v = 2 chunks per stage"));
  EXPECT_TRUE(contains(html, "<title>forward mb 1 chunk 1: "));
  EXPECT_TRUE(contains(html, ">F1.1</text>"));
  EXPECT_TRUE(contains(html, "(p-1)/(v&middot;m) = 1/(2&middot;2) = <b>25.0%</b>"));
}

// The y of each node the topology drawing placed, by name.
std::map<std::string, double> node_rows(const std::string& html) {
  std::map<std::string, double> y;
  const std::regex node(
      R"re(<g data-node="([^"]+)"><title>[^<]*</title><rect x="[-0-9.]+" y="([-0-9.]+)")re");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), node); it != std::sregex_iterator(); ++it) {
    y[(*it)[1]] = std::stod((*it)[2]);
  }
  return y;
}

TEST(HtmlReport, TopologyFromData) {
  const std::string html = report_to_html(training_report(8, 1));
  const auto y = node_rows(html);
  // 8 GPUs, 2 NVSwitches, 8 NICs, 4 leaves, 1 spine.
  EXPECT_EQ(y.size(), 23u);
  // Spine on top, then leaves, NICs, GPUs, and the NVSwitches below the GPUs.
  EXPECT_LT(y.at("spine0"), y.at("leaf0"));
  EXPECT_LT(y.at("leaf0"), y.at("nic0"));
  EXPECT_LT(y.at("nic0"), y.at("gpu0"));
  EXPECT_LT(y.at("gpu0"), y.at("nvswitch0"));
  EXPECT_DOUBLE_EQ(y.at("gpu0"), y.at("gpu7"));
  // Every link is drawn, and both servers are boxed.
  EXPECT_TRUE(contains(html, "data-links=\"36\""));
  EXPECT_TRUE(contains(html, ">node 0</text>"));
  EXPECT_TRUE(contains(html, ">node 1</text>"));
  // Every capacity is known, so links are coloured by utilisation.
  EXPECT_TRUE(contains(html, "link colour: utilisation"));
}

// The colour of each link the drawing drew, in order.
std::vector<std::string> link_colours(const std::string& html) {
  std::vector<std::string> out;
  const std::regex path(R"re(<path d="[^"]*" fill="none" stroke="(#[0-9a-f]+)")re");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), path); it != std::sregex_iterator(); ++it) {
    out.push_back((*it)[1]);
  }
  return out;
}

TEST(HtmlReport, TopologyDoesNotReadNames) {
  // The same machine with every device and link renamed to names that say nothing: the same drawing.
  const RunReport named = training_report(8, 1);
  RunReport opaque = named;
  std::map<std::string, std::string> rename;
  for (TopologyNode& n : opaque.topology.nodes) n.id = rename[n.id] = fmt::format("x{}", rename.size());
  for (TopologyLink& l : opaque.topology.links) {
    const std::string id = l.id;
    l.id = fmt::format("wire {}", l.from + l.to);
    l.from = rename.at(l.from);
    l.to = rename.at(l.to);
    for (LinkTraffic& t : opaque.links) {
      if (t.link == id) t.link = l.id;
    }
  }
  const TopologyLayout a = layout_topology(named.topology), b = layout_topology(opaque.topology);
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.y, b.y);
  const std::string html = report_to_html(opaque);
  EXPECT_EQ(link_colours(html), link_colours(report_to_html(named)));
  EXPECT_TRUE(contains(html, "data-links=\"36\""));
  EXPECT_TRUE(contains(html, ">node 1</text>"));
}

TEST(HtmlReport, LayoutOfTheStructure) {
  // Four GPUs in two servers, listed out of name order, under one switch each pair.
  RunTopology t;
  t.nodes = {{"b", "gpu", 7, 0, 0},      {"a", "gpu", 7, 0, 1},      {"d", "gpu", 7, 1, 2},
             {"c", "gpu", 7, 1, 3},      {"s0", "switch", 3, 0, -1}, {"s1", "switch", 3, 1, -1},
             {"top", "core", -2, -1, -1}};
  t.links = {{"l0", "b", "s0", "x", 1},     {"l1", "a", "s0", "x", 1},   {"l2", "d", "s1", "x", 1},
             {"l3", "c", "s1", "x", 1},     {"l4", "s0", "top", "x", 1}, {"l5", "top", "s1", "x", 1},
             {"l6", "a", "nowhere", "x", 1}};
  const TopologyLayout lay = layout_topology(t);
  ASSERT_EQ(lay.x.size(), 7u);
  // The GPUs' row in the order listed, a wider gap between the servers than inside one.
  EXPECT_LT(lay.x[0], lay.x[1]);
  EXPECT_LT(lay.x[1], lay.x[2]);
  EXPECT_LT(lay.x[2], lay.x[3]);
  EXPECT_GT(lay.x[2] - lay.x[1], lay.x[1] - lay.x[0]);
  EXPECT_DOUBLE_EQ(lay.x[1] - lay.x[0], lay.x[3] - lay.x[2]);
  // Each switch above the middle of its GPUs, the core above the middle of the switches.
  EXPECT_DOUBLE_EQ(lay.x[4], (lay.x[0] + lay.x[1]) / 2);
  EXPECT_DOUBLE_EQ(lay.x[5], (lay.x[2] + lay.x[3]) / 2);
  EXPECT_DOUBLE_EQ(lay.x[6], (lay.x[4] + lay.x[5]) / 2);
  // Rows by level, whatever the numbers.
  EXPECT_LT(lay.y[6], lay.y[4]);
  EXPECT_LT(lay.y[4], lay.y[0]);
  EXPECT_DOUBLE_EQ(lay.y[0], lay.y[3]);
  EXPECT_TRUE(lay.labels);
  EXPECT_GE(lay.width, lay.x[3]);
}

TEST(HtmlReport, IdleLinksAreDrawnIdle) {
  RunReport r;
  r.world = 2;
  r.makespan_us = 100;
  r.topology.nodes = {
      {"gpu0", "gpu", 4, 0, 0}, {"gpu1", "gpu", 4, 0, 1}, {"nvswitch0", "nvswitch", 5, 0, -1}};
  add_link(r, "gpu0", "nvswitch0", "nvlink", 1 << 20, 450);
  add_link(r, "nvswitch0", "gpu1", "nvlink", 1 << 20, 450);
  add_link(r, "gpu1", "nvswitch0", "nvlink", 0, 450);
  add_link(r, "nvswitch0", "gpu0", "nvlink", 0, 450);
  const std::string html = report_to_html(r);
  EXPECT_TRUE(contains(html, "data-links=\"4\""));
  // The idle ones first, in the scale's lightest colour; the busy ones drawn over them, in its darkest.
  EXPECT_EQ(link_colours(html), (std::vector<std::string>{"#d0d7e2", "#d0d7e2", "#b2182b", "#b2182b"}));
  EXPECT_TRUE(contains(html, "0 B, 0.0% of 450.0 GB/s over the run"));
}

TEST(HtmlReport, WithoutATopology) {
  // What a backend that knew nothing of the machine reports: its links, if any, are still listed.
  RunReport r;
  r.world = 4;
  r.links = {{"gpu0->gpu1", "nvlink", 100}, {"gpu1->gpu0", "nvlink", 50}};
  const std::string html = report_to_html(r);
  EXPECT_FALSE(contains(html, "id=\"topology\""));
  EXPECT_TRUE(contains(html, "The backend described no topology"));
  EXPECT_TRUE(contains(html, "links by traffic (2)"));
  // The real backend's: the ranks' GPUs in their hosts, no links.
  for (int k = 0; k < 4; ++k) r.topology.nodes.push_back({fmt::format("gpu{}", k), "gpu", 0, k / 2, k});
  r.links.clear();
  const std::string gpus = report_to_html(r);
  EXPECT_EQ(node_rows(gpus).size(), 4u);
  EXPECT_TRUE(contains(gpus, "data-links=\"0\""));
  EXPECT_TRUE(contains(gpus, ">node 1</text>"));
}

// ---- in a browser
// ------------------------------------------------------------------------------------------

TEST(HtmlReportInBrowser, RendersOneRowPerRankWithoutScriptErrors) {
  const std::string chromium = testing::find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "chromium is not installed (Debian: apt-get install chromium)";
  const fs::path page = fs::temp_directory_path() / fmt::format("ranklab-report-{}.html", getpid());
  {
    std::ofstream f(page);
    f << report_to_html(training_report(8, 100));  // thousands of spans per rank
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string dom = testing::run_chromium(chromium, page, "--dump-dom");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fs::remove(page);
  ASSERT_FALSE(dom.empty()) << "chromium printed nothing";
  EXPECT_TRUE(contains(dom, "data-rendered=\"1\"")) << "the page's script did not finish";
  EXPECT_TRUE(std::regex_search(dom, std::regex(R"(id="timeline"[^>]*data-rows="8")"))) << "one row per rank";
  std::smatch errors;
  ASSERT_TRUE(
      std::regex_search(dom, errors, std::regex(R"re(<ul id="errors" data-count="(\d+)">(.*?)</ul>)re")));
  EXPECT_EQ(errors[1], "0") << errors[2];
  EXPECT_LT(seconds, 20);
}

// A run of 4,096 ranks as the page must show it: every rank in the strip, the traced ranks' timeline, the
// machine's links per tier, in a page of a few megabytes that loads without a script error.
TEST(HtmlReportInBrowser, A4096RankRunShowsEveryRankInTheStrip) {
  const std::string chromium = testing::find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "chromium is not installed (Debian: apt-get install chromium)";
  SimConfig config = testing::quiet_config(512);
  config.trace_ranks = TraceRanks::parse("0,4095", "--trace-ranks");
  SimBackend backend(config);
  const RunReport report = backend.launch(4096, [](Rank& r) {
    const Tensor x = r.phantom(Shape{1 << 20}, DType::BFloat16);
    const Tensor w = r.phantom(Shape{2048, 2048}, DType::BFloat16);
    for (int step = 0; step < 3; ++step) {
      // Later ranks compute longer, so the strip has something to show.
      for (int k = 0; k <= r.rank() / 1024; ++k) r.matmul(w, w);
      r.all_reduce(x, ReduceOp::Sum);
    }
    r.synchronize();
  });
  ASSERT_EQ(report.activity.ranks.size(), 4096u);
  const std::string html = report_to_html(report);
  EXPECT_LT(html.size(), 20u << 20);
  const fs::path page = fs::temp_directory_path() / fmt::format("ranklab-report-4096-{}.html", getpid());
  {
    std::ofstream f(page);
    f << html;
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string dom = testing::run_chromium(chromium, page, "--dump-dom");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fs::remove(page);
  ASSERT_FALSE(dom.empty()) << "chromium printed nothing";
  std::smatch errors;
  ASSERT_TRUE(
      std::regex_search(dom, errors, std::regex(R"re(<ul id="errors" data-count="(\d+)">(.*?)</ul>)re")));
  EXPECT_EQ(errors[1], "0") << errors[2];
  EXPECT_TRUE(std::regex_search(dom, std::regex(R"(id="strip" data-ranks="4096" data-rows="512")")));
  EXPECT_TRUE(std::regex_search(dom, std::regex(R"(id="timeline"[^>]*data-rows="2")"))) << "the traced ranks";
  EXPECT_TRUE(contains(dom, "id=\"tiers\""));
  std::printf("4,096-rank report.html: %.1f MB, loaded and drawn by chromium in %.2f s\n", html.size() / 1e6,
              seconds);
  EXPECT_LT(seconds, 20);
}

}  // namespace
}  // namespace ranklab
