#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "chromium.h"
#include "common/assets.h"
#include "common/compare.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/report.h"
#include "sim_fixture.h"

namespace ranklab {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

CollectiveRecord collective(CommOp op, std::int64_t bytes, const std::string& group, double start_us,
                            double end_us) {
  CollectiveRecord c;
  c.op = op;
  c.bytes = bytes;
  c.group = group;
  c.group_size = 2;
  c.start_us = start_us;
  c.end_us = end_us;
  return c;
}

RunReport report(const std::string& lesson, int world) {
  RunReport r;
  r.lesson = lesson;
  r.world = world;
  r.backend = "sim";
  return r;
}

TEST(GeomeanError, ByHand) {
  EXPECT_DOUBLE_EQ(geomean_error({1, 1, 1}), 0);
  // |log 2| = |log 1/2|: twice as slow and twice as fast are the same error, 100%.
  EXPECT_NEAR(geomean_error({2, 0.5}), 1.0, 1e-12);
  EXPECT_NEAR(geomean_error({1.1}), 0.1, 1e-12);
  // exp((log 1.21 + 0) / 2) - 1 = 1.1 - 1.
  EXPECT_NEAR(geomean_error({1.21, 1}), 0.1, 1e-12);
  EXPECT_TRUE(std::isnan(geomean_error({})));
  EXPECT_NEAR(geomean_error({0, -1, NAN, 2}), 1.0, 1e-12);  // only the positive, finite ratio counts
}

TEST(Compare, MatchesByIdentityNotByOrder) {
  RunReport a = report("data_parallel", 2), b = report("data_parallel", 2);
  // A records rank 1 first; B records in time order. Rank 0's two `forward`s are 10 and 20 us in A.
  a.regions = {{1, "forward", 0, 40}, {0, "forward", 50, 70}, {0, "forward", 0, 10}, {0, "backward", 10, 30}};
  b.regions = {{0, "forward", 0, 11},
               {0, "backward", 11, 33},
               {0, "forward", 60, 82},
               {1, "forward", 0, 44},
               {1, "backward", 44, 50}};
  a.collectives = {collective(CommOp::AllReduce, 1024, "world", 30, 40),
                   collective(CommOp::AllReduce, 4096, "world", 70, 90),
                   collective(CommOp::AllReduce, 1024, "world", 90, 100)};
  b.collectives = {collective(CommOp::AllReduce, 1024, "world", 33, 53),
                   collective(CommOp::AllReduce, 1024, "world", 90, 110),
                   collective(CommOp::AllReduce, 4096, "world", 80, 80)};
  const Comparison c = compare_reports(a, b, "sim.json", "gpu.json");
  EXPECT_EQ(c.items.size(), 7u);
  EXPECT_EQ(c.only_in_a, 0);
  EXPECT_EQ(c.only_in_b, 1);  // rank 1's backward
  // Rows: forward, backward, then the two collective sizes, in order of first appearance.
  ASSERT_EQ(c.rows.size(), 4u);
  EXPECT_EQ(c.rows[0].what, "forward");
  EXPECT_EQ(c.rows[0].count, 3);
  EXPECT_DOUBLE_EQ(c.rows[0].a_us, 10 + 20 + 40);
  EXPECT_DOUBLE_EQ(c.rows[0].b_us, 11 + 22 + 44);
  EXPECT_NEAR(c.rows[0].ratio(), 1.1, 1e-12);
  EXPECT_NEAR(c.rows[0].error, 0.1, 1e-12);
  EXPECT_EQ(c.rows[1].what, "backward");
  EXPECT_EQ(c.rows[2].kind, ItemKind::Collective);
  EXPECT_EQ(c.rows[2].what, "all_reduce 1 KiB on world");
  EXPECT_DOUBLE_EQ(c.rows[2].ratio(), 2.0);
  EXPECT_EQ(c.rows[3].what, "all_reduce 4 KiB on world");
  // The zero-length 4 KiB all_reduce in B is matched but cannot be scored.
  EXPECT_EQ(c.scored, 6);
  EXPECT_NEAR(c.region_error, 0.1, 1e-12);
  EXPECT_NEAR(c.collective_error, 1.0, 1e-12);
  EXPECT_NEAR(c.error, std::exp((4 * std::log(1.1) + 2 * std::log(2.0)) / 6) - 1, 1e-12);

  const std::string text = format_comparison(c);
  EXPECT_TRUE(contains(text, "sim.json")) << text;
  EXPECT_TRUE(contains(text, "geometric-mean error: ")) << text;
  EXPECT_TRUE(contains(text, "1 only in B")) << text;

  const std::string html = comparison_to_html(c);
  EXPECT_TRUE(contains(html, "id=\"plot\""));
  EXPECT_TRUE(contains(html, "id=\"compare-data\""));
  EXPECT_TRUE(contains(html, "rank 0 forward #2"));
  // The stylesheet and the shared script of every page, and the plot's own script, inline.
  EXPECT_TRUE(contains(html, std::string(assets::page_css)));
  EXPECT_TRUE(contains(html, std::string(assets::page_js)));
  EXPECT_TRUE(contains(html, std::string(assets::compare_js)));

  // In a browser the plot draws every scored item and raises no script error.
  const std::string chromium = testing::find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "chromium is not installed (Debian: apt-get install chromium)";
  const std::filesystem::path page =
      std::filesystem::temp_directory_path() / fmt::format("ranklab-compare-{}.html", getpid());
  std::ofstream(page) << html;
  const std::string dom = testing::run_chromium(chromium, page, "--dump-dom");
  std::filesystem::remove(page);
  EXPECT_TRUE(contains(dom, "data-rendered=\"1\"")) << "the page's script did not finish";
  EXPECT_TRUE(std::regex_search(dom, std::regex(R"(id="plot"[^>]*data-points="6")")));
  EXPECT_TRUE(contains(dom, "<ul id=\"errors\" data-count=\"0\"></ul>"));
}

// A time written as null (a NaN or infinity when the report was written) reads back as NaN: its item is
// left out and counted, and no row shows "nan".
TEST(Compare, NullDurationsAreLeftOutAndCountedNotShownAsNan) {
  RunReport a = report("data_parallel", 2), b = report("data_parallel", 2);
  a.regions = {{0, "forward", 0, 10}, {0, "forward", 10, 20}, {0, "backward", 20, 30}};
  b.regions = {{0, "forward", 0, 12}, {0, "forward", 12, NAN}, {0, "backward", NAN, 40}};
  const Comparison c = compare_reports(a, b, "a.json", "b.json");
  EXPECT_EQ(c.unmeasured, 2);
  ASSERT_EQ(c.rows.size(), 1u);  // backward has no measured item
  EXPECT_EQ(c.rows[0].count, 1);
  EXPECT_DOUBLE_EQ(c.rows[0].b_us, 12);
  EXPECT_EQ(c.scored, 1);
  const std::string text = format_comparison(c);
  EXPECT_FALSE(contains(text, "nan")) << text;
  EXPECT_TRUE(contains(text, "without a duration: 2 matched items with a null start or end time")) << text;
  // Nothing measured at all: the error is "-", not 0.0%.
  b.regions = {{0, "forward", 0, NAN}};
  a.regions = {{0, "forward", 0, 10}};
  const std::string none = format_comparison(compare_reports(a, b, "a.json", "b.json"));
  EXPECT_FALSE(contains(none, "nan")) << none;
  EXPECT_FALSE(contains(none, "0.0%")) << none;
}

TEST(Compare, RefusesDifferentRuns) {
  try {
    compare_reports(report("collectives", 4), report("data_parallel", 4), "a.json", "b.json");
    FAIL() << "different lessons were compared";
  } catch (const UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "'collectives'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "'data_parallel'")) << e.what();
  }
  try {
    compare_reports(report("collectives", 4), report("collectives", 8), "a.json", "b.json");
    FAIL() << "different world sizes were compared";
  } catch (const UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "4 ranks")) << e.what();
    EXPECT_TRUE(contains(e.what(), "8")) << e.what();
  }
  RunReport a = report("data_parallel", 4), b = report("data_parallel", 4);
  a.options = default_options("data_parallel");
  b.options = a.options;
  b.options["dim"] = "128";
  try {
    compare_reports(a, b, "a.json", "b.json");
    FAIL() << "different options were compared";
  } catch (const UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "--dim 64 in a.json but 128 in b.json")) << e.what();
  }
  // A report without recorded options is compared on trust.
  b.options.clear();
  EXPECT_NO_THROW(compare_reports(a, b));
}

TEST(RunConfig, OptionsRoundTrip) {
  const Lesson& dp = find_lesson("data_parallel");
  const Settings given = {{"world", "8"},         {"batch", "48"},     {"lr", "0.0030"},
                          {"optimizer", "adamw"}, {"overlap", "true"}, {"bucket-mb", "12.5"}};
  const Settings record = dp.prepare(given).record;
  EXPECT_EQ(record.at("lr"), "0.003");  // as the table writes it
  EXPECT_EQ(record.at("overlap"), "true");
  EXPECT_EQ(record.at("layers"), "4");  // the lesson's default
  EXPECT_FALSE(record.count("quiet"));  // not part of the run's identity
  EXPECT_FALSE(record.count("world"));  // the report's own field
  EXPECT_FALSE(record.count("count"));  // another lesson's option

  RunReport r;
  r.lesson = "data_parallel";
  r.world = 8;
  r.options = record;
  r.options["algo"] = "ring";
  const RecordedOptions back = read_recorded_options(r);
  EXPECT_EQ(back.backend.algo, "ring");
  EXPECT_EQ(back.lesson.at("world"), "8");
  EXPECT_FALSE(back.lesson.count("algo"));
  EXPECT_EQ(dp.prepare(back.lesson).record, record);

  RunReport bad = r;
  bad.options["steps"] = "three";
  EXPECT_THROW(read_recorded_options(bad), UsageError);
  RunReport unknown = r;
  unknown.options["warp-speed"] = "9";
  EXPECT_THROW(read_recorded_options(unknown), UsageError);
}

TEST(RunConfig, RecordsWhatRunKnows) {
  const Profile p = load_profile("dgx-h100");
  RunReport r;
  r.links = {{"gpu0->gpu1", "nvlink", 10},
             {"gpu0->nic0", "pcie", 10},
             {"nic0->leaf0", p.fabric.kind, 10},
             {"x->y", "mystery", 10},
             {"gpu1->gpu0", "nvlink", 10, 123}};
  r.options = {{"steps", "7"}};
  BackendOptions backend;
  backend.proto = "simple";
  record_run_config(r, p, backend);
  EXPECT_EQ(r.gpus_per_node, p.gpus_per_node);
  EXPECT_EQ(r.options.at("steps"), "7");  // the lesson's, kept
  EXPECT_EQ(r.options.at("proto"), "simple");
  EXPECT_EQ(r.options.at("no-sm-contention"), "false");
  EXPECT_DOUBLE_EQ(r.links[0].bandwidth_gbps, p.nvlink.gpu_bandwidth_gbps());
  EXPECT_DOUBLE_EQ(r.links[1].bandwidth_gbps, p.pcie.bandwidth_gbps);
  EXPECT_DOUBLE_EQ(r.links[2].bandwidth_gbps, p.nic.bandwidth_gbps);
  EXPECT_DOUBLE_EQ(r.links[3].bandwidth_gbps, 0);    // unknown stays unknown
  EXPECT_DOUBLE_EQ(r.links[4].bandwidth_gbps, 123);  // what the backend knew is kept
  // And all of it survives the JSON file.
  const RunReport back = report_from_json(report_to_json(r));
  EXPECT_EQ(back.options, r.options);
  EXPECT_EQ(back.gpus_per_node, r.gpus_per_node);
  EXPECT_DOUBLE_EQ(back.links[0].bandwidth_gbps, r.links[0].bandwidth_gbps);
}

// Large all_reduces and all_gathers inside a node, on phantom tensors (time without numbers).
void bandwidth_bound(Rank& r) {
  for (std::int64_t mib : {16, 64}) {
    auto scope = r.region(fmt::format("{} MiB", mib));
    Tensor t = r.phantom({mib << 18});
    r.all_reduce(t, ReduceOp::Sum);
    Tensor out = r.phantom({(mib << 18) * r.world_size()});
    r.all_gather(out, t);
    r.synchronize();
  }
}

TEST(Compare, BusBandwidthPerCollectiveRow) {
  RunReport a = report("benchmark", 8), b = report("benchmark", 8);
  // 1 GiB in 5 ms and 8 MiB in 100 us against half and twice those times.
  a.collectives = {collective(CommOp::AllReduce, 1 << 30, "world", 0, 5000),
                   collective(CommOp::AllReduce, 8 << 20, "world", 5000, 5100)};
  b.collectives = {collective(CommOp::AllReduce, 1 << 30, "world", 0, 2500),
                   collective(CommOp::AllReduce, 8 << 20, "world", 2500, 2700)};
  for (auto* r : {&a, &b}) {
    for (CollectiveRecord& c : r->collectives) c.group_size = 8;
  }
  const Comparison c = compare_reports(a, b);
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.rows[0].bytes, 1 << 30);
  // nccl-tests' busbw: size / time * 2 (n - 1) / n.
  EXPECT_DOUBLE_EQ(c.rows[0].a_busbw_gbps(), (1 << 30) / 5000e3 * 1.75);
  EXPECT_DOUBLE_EQ(c.rows[0].b_busbw_gbps(), (1 << 30) / 2500e3 * 1.75);
  EXPECT_DOUBLE_EQ(c.rows[1].b_busbw_gbps(), (8 << 20) / 200e3 * 1.75);
  const std::string html = comparison_to_html(c);
  EXPECT_NE(html.find("id=\"busbw\" data-points=\"2\""), std::string::npos);
  EXPECT_NE(html.find("all_reduce on world (A)"), std::string::npos);
  EXPECT_NE(html.find("all_reduce on world (B)"), std::string::npos);
  // Regions have no bus bandwidth.
  ComparisonRow region;
  region.kind = ItemKind::Region;
  region.count = 1;
  region.a_us = 10;
  EXPECT_EQ(region.a_busbw_gbps(), 0);
}

TEST(Compare, SlowerLinksShowInTheCollectives) {
  SimConfig fast = testing::quiet_config();
  SimConfig slow = fast;
  slow.profile.nvlink.efficiency /= 2;
  SimBackend fast_backend(fast), slow_backend(slow);
  const RunReport a = fast_backend.launch(8, bandwidth_bound);
  const RunReport b = slow_backend.launch(8, bandwidth_bound);
  const Comparison c = compare_reports(a, b, "fast", "slow");
  EXPECT_EQ(c.only_in_a, 0);
  EXPECT_EQ(c.only_in_b, 0);
  EXPECT_EQ(c.scored, 4 + 2 * 8);  // four collectives, two regions on each of 8 ranks
  // Everything moved over NVLink at half the bandwidth: close to twice as slow, never more.
  for (const ComparisonRow& row : c.rows) {
    EXPECT_GT(row.ratio(), 1.3) << row.what;
    EXPECT_LE(row.ratio(), 2.0 + 1e-9) << row.what;
  }
  EXPECT_GT(c.collective_error, 0.3);
  // A report compared with itself agrees exactly.
  EXPECT_DOUBLE_EQ(compare_reports(a, a).error, 0);
}

}  // namespace
}  // namespace ranklab
