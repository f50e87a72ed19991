#include "common/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "common/assets.h"
#include "common/errors.h"
#include "common/html_report.h"
#include "common/text.h"

namespace ranklab {

// ---- the configuration a report records ------------------------------------------------------------------

RecordedOptions read_recorded_options(const RunReport& report) {
  const Lesson& lesson = find_lesson(report.lesson);
  const OptionTable<BackendOptions>& backend = backend_options();
  RecordedOptions out;
  Settings backend_settings;
  for (const auto& [name, value] : report.options) {
    if (backend.find(name) != nullptr) {
      backend_settings[name] = value;
    } else if (lesson.option(name) != nullptr) {
      out.lesson[name] = value;
    } else {
      throw UsageError(fmt::format(
          "the report was run with an option this build does not know (--{} {}); it cannot be repeated here",
          name, value));
    }
  }
  out.lesson["world"] = std::to_string(report.world);
  try {
    out.backend = backend.read(backend_settings, "the report's options");
    lesson.prepare(out.lesson);  // refuses what does not parse
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("the report's options cannot be repeated here: {}", e.what()));
  }
  return out;
}

Settings default_options(const std::string& lesson) {
  Settings out = backend_options().write(BackendOptions{}, /*identity_only=*/true);
  for (const Lesson& l : lessons()) {
    if (l.name != lesson) continue;
    for (const OptionSpec& s : l.options) {
      if (s.identity && s.flag != "world") out[s.flag] = s.default_text;
    }
  }
  return out;
}

void record_run_config(RunReport& report, const Profile& profile, const BackendOptions& backend) {
  report.gpus_per_node = profile.gpus_per_node;
  for (const auto& [name, value] : backend_options().write(backend, /*identity_only=*/true)) {
    report.options[name] = value;
  }
  // A link's capacity by its tier, where the backend did not know it: what each GPU has of that kind of link.
  for (LinkTraffic& l : report.links) {
    if (l.bandwidth_gbps > 0) continue;
    if (l.tier == "nvlink" && profile.has_nvlink) {
      l.bandwidth_gbps = profile.nvlink.gpu_bandwidth_gbps();
    } else if (l.tier == "pcie") {
      l.bandwidth_gbps = profile.pcie.bandwidth_gbps;
    } else if (l.tier == profile.fabric.kind || l.tier == "network" || l.tier == "nic") {
      l.bandwidth_gbps = profile.nic.bandwidth_gbps;
    }
  }
}

// ---- comparing -------------------------------------------------------------------------------------------

double geomean_error(const std::vector<double>& ratios) {
  double sum = 0;
  int n = 0;
  for (double r : ratios) {
    if (!(r > 0) || !std::isfinite(r)) continue;
    sum += std::fabs(std::log(r));
    ++n;
  }
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : std::exp(sum / n) - 1;
}

namespace {

std::string source_of(const RunReport& r) {
  if (r.profile.empty()) return r.backend.empty() ? "?" : r.backend;
  return fmt::format("{}, {}", r.backend.empty() ? "?" : r.backend, r.profile);
}

void check_comparable(const RunReport& a, const RunReport& b, const std::string& an, const std::string& bn) {
  if (a.lesson != b.lesson) {
    throw UsageError(
        fmt::format("cannot compare reports of different lessons: {} is lesson '{}' and {} is lesson '{}'",
                    an, a.lesson, bn, b.lesson));
  }
  if (a.world != b.world) {
    throw UsageError(fmt::format("cannot compare runs of different sizes: {} has {} ranks and {} has {}", an,
                                 a.world, bn, b.world));
  }
  // Reports that predate the options record (or come from a writer without it) are compared on trust.
  if (a.options.empty() || b.options.empty()) return;
  // An option only one report has came from a build with more options than the other's; it is not a
  // difference the other run could have shown.
  std::vector<std::string> differences;
  auto shown = [](const std::string& v) { return v.empty() ? std::string("\"\"") : v; };
  for (const auto& [k, va] : a.options) {
    auto ib = b.options.find(k);
    if (ib != b.options.end() && ib->second != va) {
      differences.push_back(
          fmt::format("--{} {} in {} but {} in {}", k, shown(va), an, shown(ib->second), bn));
    }
  }
  if (!differences.empty()) {
    throw UsageError(fmt::format("cannot compare runs of different configurations of '{}': {}", a.lesson,
                                 fmt::join(differences, "; ")));
  }
}

// Groups items by key, each group in start order, so "the third `forward` of rank 2" means the same in both
// reports however the backend ordered its records.
template <class Key, class T, class KeyOf>
std::map<Key, std::vector<const T*>> by_key(const std::vector<T>& items, KeyOf key_of) {
  std::map<Key, std::vector<const T*>> out;
  for (const T& item : items) out[key_of(item)].push_back(&item);
  for (auto& [key, list] : out) {
    // A start that is not a number (null in the file) sorts last, so the order stays a strict weak one.
    auto start = [](const T* t) { return std::isnan(t->start_us) ? INFINITY : t->start_us; };
    std::stable_sort(list.begin(), list.end(), [&](const T* x, const T* y) { return start(x) < start(y); });
  }
  return out;
}

std::string collective_what(const CollectiveRecord& c) {
  return fmt::format("{} {} on {}", comm_op_name(c.op), format_bytes(static_cast<double>(c.bytes)), c.group);
}

std::string ellipsize(const std::string& s, std::size_t width) {
  if (s.size() <= width) return s;
  return s.substr(0, width - 3) + "...";
}

}  // namespace

Comparison compare_reports(const RunReport& a, const RunReport& b, const std::string& a_name,
                           const std::string& b_name) {
  check_comparable(a, b, a_name, b_name);
  Comparison c;
  c.lesson = a.lesson;
  c.world = a.world;
  c.a_name = a_name;
  c.b_name = b_name;
  c.a_source = source_of(a);
  c.b_source = source_of(b);
  c.a_makespan_us = a.makespan_us;
  c.b_makespan_us = b.makespan_us;

  std::map<std::pair<ItemKind, std::string>, std::size_t> row_of;
  std::vector<double> first_start_us;  // of each row's items in A, to order the rows by
  auto row_for = [&](ItemKind kind, const std::string& what, double start_us) {
    auto [it, inserted] = row_of.try_emplace({kind, what}, c.rows.size());
    if (inserted) {
      c.rows.push_back(ComparisonRow{kind, what});
      first_start_us.push_back(start_us);
    }
    first_start_us[it->second] = std::min(first_start_us[it->second], start_us);
    return it->second;
  };
  auto match = [&](ItemKind kind, const auto& list_a, const auto& list_b, auto what_of, auto label_of,
                   auto describe_row) {
    for (const auto& [key, in_a] : list_a) {
      auto it = list_b.find(key);
      const std::size_t in_b = it == list_b.end() ? 0 : it->second.size();
      const std::size_t both = std::min(in_a.size(), in_b);
      c.only_in_a += static_cast<int>(in_a.size() - both);
      c.only_in_b += static_cast<int>(in_b - both);
      if (both == 0) continue;
      // A time written as null (a NaN or infinity when written) gives no duration: such an item is
      // matched but not measured, and is counted apart rather than turning its row into "nan".
      std::vector<std::size_t> measured;
      for (std::size_t k = 0; k < both; ++k) {
        const double ta = in_a[k]->end_us - in_a[k]->start_us,
                     tb = it->second[k]->end_us - it->second[k]->start_us;
        if (std::isfinite(ta) && std::isfinite(tb)) {
          measured.push_back(k);
        } else {
          ++c.unmeasured;
        }
      }
      if (measured.empty()) continue;
      const std::size_t row = row_for(kind, what_of(*in_a.front()), in_a.front()->start_us);
      describe_row(c.rows[row], *in_a.front());
      for (std::size_t k : measured) {
        const double ta = in_a[k]->end_us - in_a[k]->start_us,
                     tb = it->second[k]->end_us - it->second[k]->start_us;
        c.items.push_back({kind, row, label_of(*in_a[k], k), ta, tb});
      }
    }
    for (const auto& [key, in_b] : list_b) {
      if (!list_a.count(key)) c.only_in_b += static_cast<int>(in_b.size());
    }
  };

  using RegionKey = std::pair<int, std::string>;
  auto region_key = [](const RegionRecord& g) { return RegionKey{g.rank, g.name}; };
  match(
      ItemKind::Region, by_key<RegionKey, RegionRecord>(a.regions, region_key),
      by_key<RegionKey, RegionRecord>(b.regions, region_key), [](const RegionRecord& g) { return g.name; },
      [](const RegionRecord& g, std::size_t k) {
        return fmt::format("rank {} {} #{}", g.rank, g.name, k + 1);
      },
      [](ComparisonRow&, const RegionRecord&) {});

  using CollectiveKey = std::tuple<int, std::int64_t, std::string>;
  auto collective_key = [](const CollectiveRecord& r) {
    return CollectiveKey{static_cast<int>(r.op), r.bytes, r.group};
  };
  // The lessons' bookkeeping (checks, printed figures) is not what either run is compared on.
  auto lesson_work = [](const std::vector<CollectiveRecord>& all) {
    std::vector<CollectiveRecord> out;
    std::copy_if(all.begin(), all.end(), std::back_inserter(out),
                 [](const CollectiveRecord& c) { return !c.bookkeeping; });
    return out;
  };
  const std::vector<CollectiveRecord> a_work = lesson_work(a.collectives),
                                      b_work = lesson_work(b.collectives);
  match(
      ItemKind::Collective, by_key<CollectiveKey, CollectiveRecord>(a_work, collective_key),
      by_key<CollectiveKey, CollectiveRecord>(b_work, collective_key), collective_what,
      [](const CollectiveRecord& r, std::size_t k) {
        return fmt::format("{} #{}", collective_what(r), k + 1);
      },
      [](ComparisonRow& row, const CollectiveRecord& r) {
        row.op = r.op;
        row.bytes = r.bytes;
        row.group_size = r.group_size;
      });

  // Rows in order of first appearance in A, regions before collectives; items follow their rows.
  std::vector<std::size_t> order(c.rows.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    return std::make_pair(static_cast<int>(c.rows[x].kind), first_start_us[x]) <
           std::make_pair(static_cast<int>(c.rows[y].kind), first_start_us[y]);
  });
  std::vector<std::size_t> new_index(c.rows.size());
  std::vector<ComparisonRow> rows;
  for (std::size_t i = 0; i < order.size(); ++i) {
    new_index[order[i]] = i;
    rows.push_back(c.rows[order[i]]);
  }
  c.rows = std::move(rows);
  for (ComparedItem& item : c.items) item.row = new_index[item.row];
  std::stable_sort(c.items.begin(), c.items.end(),
                   [](const ComparedItem& x, const ComparedItem& y) { return x.row < y.row; });

  std::vector<std::vector<double>> row_ratios(c.rows.size());
  std::vector<double> all, regions, collectives;
  for (const ComparedItem& item : c.items) {
    ComparisonRow& row = c.rows[item.row];
    ++row.count;
    row.a_us += item.a_us;
    row.b_us += item.b_us;
    if (!(item.a_us > 0 && item.b_us > 0)) continue;  // a zero-length item has no ratio to score
    const double ratio = item.b_us / item.a_us;
    row_ratios[item.row].push_back(ratio);
    all.push_back(ratio);
    (item.kind == ItemKind::Region ? regions : collectives).push_back(ratio);
  }
  for (std::size_t i = 0; i < c.rows.size(); ++i) c.rows[i].error = geomean_error(row_ratios[i]);
  c.error = geomean_error(all);
  c.region_error = geomean_error(regions);
  c.collective_error = geomean_error(collectives);
  c.scored = static_cast<int>(all.size());
  return c;
}

namespace {
double busbw_gbps(const ComparisonRow& r, double total_us) {
  if (r.kind != ItemKind::Collective || r.count == 0 || !(total_us > 0) || r.group_size < 1) return 0;
  // nccl-tests: algbw = size / time, busbw = algbw * the op's bus factor (doc/PERFORMANCE.md).
  const double mean_us = total_us / r.count;
  return static_cast<double>(r.bytes) / (mean_us * 1e3) * bus_factor(r.op, r.group_size);
}
}  // namespace

double ComparisonRow::a_busbw_gbps() const {
  return busbw_gbps(*this, a_us);
}
double ComparisonRow::b_busbw_gbps() const {
  return busbw_gbps(*this, b_us);
}

std::string format_comparison(const Comparison& c) {
  std::string out =
      fmt::format("{}, {} rank{}\n", c.lesson.empty() ? "run" : c.lesson, c.world, c.world == 1 ? "" : "s");
  const std::size_t name_width = std::max(c.a_name.size(), c.b_name.size());
  out += fmt::format("  A: {:<{}}  ({}), makespan {}\n", c.a_name, name_width, c.a_source,
                     human_time(c.a_makespan_us));
  out += fmt::format("  B: {:<{}}  ({}), makespan {}", c.b_name, name_width, c.b_source,
                     human_time(c.b_makespan_us));
  if (c.a_makespan_us > 0) out += fmt::format(" (B/A {:.3f})", c.b_makespan_us / c.a_makespan_us);
  out += "\n";

  std::size_t what_width = 10;
  for (const ComparisonRow& r : c.rows)
    what_width = std::max(what_width, std::min<std::size_t>(r.what.size(), 44));
  for (ItemKind kind : {ItemKind::Region, ItemKind::Collective}) {
    bool header = false;
    for (const ComparisonRow& r : c.rows) {
      if (r.kind != kind) continue;
      if (!header) {
        out += fmt::format("\n  {:<{}} {:>6} {:>11} {:>11} {:>7} {:>7}\n",
                           kind == ItemKind::Region ? "region" : "collective", what_width, "count",
                           "A (mean)", "B (mean)", "B/A", "error");
        header = true;
      }
      out += fmt::format("  {:<{}} {:>6} {:>11} {:>11} {:>7.3f} {:>7}\n", ellipsize(r.what, what_width),
                         what_width, r.count, human_time(r.a_us / r.count), human_time(r.b_us / r.count),
                         r.ratio(), format_percent(r.error));
    }
  }
  out += fmt::format("\ngeometric-mean error: {} over {} matched item{} (regions {}, collectives {})\n",
                     format_percent(c.error), c.scored, c.scored == 1 ? "" : "s",
                     format_percent(c.region_error), format_percent(c.collective_error));
  if (c.unmeasured > 0) {
    out += fmt::format("  without a duration: {} matched item{} with a null start or end time, left out\n",
                       c.unmeasured, c.unmeasured == 1 ? "" : "s");
  }
  if (c.only_in_a > 0 || c.only_in_b > 0) {
    out += fmt::format("  unmatched: {} item{} only in A, {} only in B\n", c.only_in_a,
                       c.only_in_a == 1 ? "" : "s", c.only_in_b);
  }
  return out;
}

namespace {

// Bus bandwidth against size, log-log: a line per (collective, group) for A (solid) and B (dashed), drawn
// as SVG so it needs no script. Where the lines part is where the model and the machine disagree.
void busbw_section(std::string& out, const Comparison& c) {
  struct Point {
    double bytes, a, b;
  };
  std::map<std::string, std::vector<Point>> series;
  for (const ComparisonRow& r : c.rows) {
    if (r.kind != ItemKind::Collective || r.bytes <= 0) continue;
    const std::string group = r.what.substr(r.what.find(" on ") + 4);
    const double a = r.a_busbw_gbps(), b = r.b_busbw_gbps();
    if (a > 0 && b > 0)
      series[fmt::format("{} on {}", comm_op_name(r.op), group)].push_back({double(r.bytes), a, b});
  }
  std::size_t points = 0;
  double x0 = INFINITY, x1 = 0, y0 = INFINITY, y1 = 0;
  for (auto& [name, pts] : series) {
    std::sort(pts.begin(), pts.end(), [](const Point& p, const Point& q) { return p.bytes < q.bytes; });
    for (const Point& p : pts) {
      x0 = std::min(x0, p.bytes), x1 = std::max(x1, p.bytes);
      y0 = std::min({y0, p.a, p.b}), y1 = std::max({y1, p.a, p.b});
      ++points;
    }
  }
  if (points < 2) return;
  const double lx0 = std::floor(std::log10(x0)), lx1 = std::max(lx0 + 1, std::ceil(std::log10(x1)));
  const double ly0 = std::floor(std::log10(y0)), ly1 = std::max(ly0 + 1, std::ceil(std::log10(y1)));
  const double W = 640, H = 360, L = 64, R = 16, T = 12, B = 44;
  auto sx = [&](double v) { return L + (std::log10(v) - lx0) / (lx1 - lx0) * (W - L - R); };
  auto sy = [&](double v) { return H - B - (std::log10(v) - ly0) / (ly1 - ly0) * (H - T - B); };
  out += "<h2>Bus bandwidth against size</h2>\n";
  out +=
      fmt::format("<svg id=\"busbw\" data-points=\"{}\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\">\n",
                  points, W, H, W, H);
  for (double e = lx0; e <= lx1; ++e) {
    const double v = std::pow(10, e);
    out += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#e4e7eb\"/><text x=\"{0:.1f}\" "
        "y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        sx(v), T, H - B, H - B + 14, html_escape(format_bytes(v)));
  }
  for (double e = ly0; e <= ly1; ++e) {
    const double v = std::pow(10, e);
    out += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#e4e7eb\"/><text x=\"{3}\" "
        "y=\"{4:.1f}\" text-anchor=\"end\">{5}</text>\n",
        L, W - R, sy(v), L - 6, sy(v) + 4, html_escape(format_gbps(v)));
  }
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">size (nccl-tests' size)</text>\n",
                     (L + W) / 2, H - 6);
  const char* colours[] = {"#3b75af", "#ef8a17", "#6a9f58", "#c8383e", "#8e6bb8", "#5d6875"};
  std::size_t k = 0;
  std::string legend;
  for (const auto& [name, pts] : series) {
    const char* colour = colours[k++ % 6];
    for (int side = 0; side < 2; ++side) {
      std::string path;
      for (const Point& p : pts) {
        path +=
            fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", sx(p.bytes), sy(side == 0 ? p.a : p.b));
      }
      out += fmt::format(
          "<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}><title>{} ({})</title></path>\n",
          path, colour, side == 0 ? "" : " stroke-dasharray=\"6 4\"", html_escape(name),
          side == 0 ? "A" : "B");
    }
    legend += fmt::format("<span style=\"--c:{}\">{}</span>", colour, html_escape(name));
  }
  out += "</svg>\n";
  out += fmt::format(
      "<div class=\"legend\">{}<span style=\"--c:transparent\">solid: A ({}); dashed: B ({})</span></div>\n",
      legend, html_escape(c.a_name), html_escape(c.b_name));
}

}  // namespace

std::string comparison_to_html(const Comparison& c) {
  std::string out = html_page_start(fmt::format("ranklab compare: {}", c.lesson));
  out += fmt::format("<h1>{}: {} against {}</h1>\n", html_escape(c.lesson.empty() ? "run" : c.lesson),
                     html_escape(c.b_name), html_escape(c.a_name));
  out += fmt::format(
      "<p class=\"sub\">{} rank{}. A is {} ({}), makespan {}; B is {} ({}), makespan {}.</p>\n", c.world,
      c.world == 1 ? "" : "s", html_escape(c.a_name), html_escape(c.a_source), human_time(c.a_makespan_us),
      html_escape(c.b_name), html_escape(c.b_source), human_time(c.b_makespan_us));
  out += fmt::format(
      "<p id=\"error\" data-error=\"{}\"><b>Geometric-mean error {}</b> over {} matched items (regions {}, "
      "collectives {}){}.</p>\n",
      std::isfinite(c.error) ? fmt::format("{:.6f}", c.error) : "nan", format_percent(c.error), c.scored,
      format_percent(c.region_error), format_percent(c.collective_error),
      c.only_in_a + c.only_in_b > 0 ? fmt::format("; {} only in A, {} only in B", c.only_in_a, c.only_in_b)
                                    : "");

  // Points as [a_us, b_us, kind, label index].
  std::string data =
      fmt::format("{{\"a\":{},\"b\":{},\"points\":[", json_string(c.a_name), json_string(c.b_name));
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    const ComparedItem& item = c.items[i];
    data += fmt::format("{}[{},{},{},{}]", i ? "," : "", json_number(item.a_us), json_number(item.b_us),
                        item.kind == ItemKind::Region ? 0 : 1, i);
  }
  data += "],\"labels\":[";
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    if (i) data += ',';
    data += json_string(c.items[i].label);
  }
  data += "]}";

  out += "<h2>B against A, one point per item</h2>\n";
  out +=
      "<div class=\"legend\"><span style=\"--c:var(--compute)\">region</span><span "
      "style=\"--c:var(--comm)\">collective</span><span style=\"--c:transparent\">solid: equal; dashed: 10% "
      "apart; dotted: 2x apart</span></div>\n";
  out +=
      "<div id=\"plot\" data-points=\"0\" style=\"position:relative;max-width:660px\"><canvas></canvas><div "
      "id=\"tip\"></div></div>\n";
  out += "<script type=\"application/json\" id=\"compare-data\">" + script_json(data) + "</script>\n";
  out += fmt::format("<script>{}</script>\n", assets::compare_js);

  busbw_section(out, c);

  out +=
      "<h2>By region and collective</h2>\n<div class=\"scroll\"><table id=\"rows\">\n<tr><th "
      "class=\"l\">kind</th>"
      "<th class=\"l\">what</th><th>count</th><th>A (mean)</th><th>B (mean)</th><th>B/A</th><th>error</th>"
      "<th class=\"l\"></th></tr>\n";
  for (const ComparisonRow& r : c.rows) {
    // A bar from the middle: right for B slower, left for B faster, full width at 2x.
    const double lr = r.ratio() > 0 ? std::clamp(std::log2(r.ratio()), -1.0, 1.0) : 0;
    const double w = std::fabs(lr) * 50;
    out += fmt::format(
        "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}</td>"
        "<td>{}</td><td class=\"l\"><div class=\"bar\" style=\"width:160px;position:relative\"><i "
        "style=\"position:absolute;left:{:.1f}%;width:{:.1f}%;background:{}\"></i><i "
        "style=\"position:absolute;left:50%;width:1px;background:#1d232b\"></i></div></td></tr>\n",
        r.kind == ItemKind::Region ? "region" : "collective", html_escape(r.what), r.count,
        human_time(r.count ? r.a_us / r.count : 0), human_time(r.count ? r.b_us / r.count : 0), r.ratio(),
        format_percent(r.error), lr < 0 ? 50 - w : 50.0, w, lr < 0 ? "var(--compute)" : "var(--comm)");
  }
  out += "</table></div>\n";
  out += html_page_end();
  return out;
}

}  // namespace ranklab
