#include "common/html_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <vector>

#include "common/assets.h"
#include "common/compare.h"
#include "common/lesson.h"
#include "common/trace_writer.h"

namespace ranklab {

// ---- shared pieces -------------------------------------------------------------------------------------

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string script_json(std::string_view json) {
  // '<' only ever appears inside JSON strings, where \u003c means the same character.
  std::string out;
  out.reserve(json.size());
  for (char c : json) {
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
    }
  }
  return out;
}

std::string json_string(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "0";
  std::string s = fmt::format("{:.3f}", v);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

std::string html_page_start(const std::string& title) {
  return fmt::format(
      "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{}</title>\n"
      "<style>{}</style>\n</head>\n<body>\n<ul id=\"errors\" data-count=\"0\"></ul>\n<script>{}</script>\n"
      "<main>\n",
      html_escape(title), assets::page_css, assets::page_js);
}

std::string html_page_end() {
  return "</main>\n</body>\n</html>\n";
}

namespace {

// ---- configuration ---------------------------------------------------------------------------------------

// The configuration as a line of name/value pairs: short enough to leave the timeline on the first screen.
void config_section(std::string& out, const RunReport& r) {
  out += "<div id=\"config\" class=\"config\">\n";
  auto row = [&out](const std::string& k, const std::string& v) {
    out += fmt::format("<div><span>{}</span> {}</div>\n", html_escape(k), html_escape(v));
  };
  row("lesson", r.lesson.empty() ? "?" : r.lesson);
  row("backend", r.backend.empty() ? "?" : r.backend);
  row("profile", r.profile.empty() ? "?" : r.profile);
  row("ranks", std::to_string(r.world));
  if (r.gpus_per_node > 0) {
    row("GPUs per node", std::to_string(r.gpus_per_node));
    row("nodes", std::to_string((r.world + r.gpus_per_node - 1) / r.gpus_per_node));
  }
  row("makespan", human_time(r.makespan_us));
  // The options a run changed say what it was; the rest are listed, folded, for completeness.
  const Settings defaults = default_options(r.lesson);
  std::vector<std::pair<std::string, std::string>> unchanged;
  for (const auto& [name, value] : r.options) {
    auto it = defaults.find(name);
    if (it != defaults.end() && it->second == value) {
      unchanged.emplace_back(name, value);
    } else {
      row("--" + name, value);
    }
  }
  out += "</div>\n";
  if (!unchanged.empty()) {
    out += fmt::format(
        "<details class=\"sub\"><summary>{} option{} at {} default</summary><div class=\"config\">\n",
        unchanged.size(), unchanged.size() == 1 ? "" : "s", unchanged.size() == 1 ? "its" : "their");
    for (const auto& [name, value] : unchanged) row("--" + name, value);
    out += "</div></details>\n";
  }
}

// ---- topology --------------------------------------------------------------------------------------------

// Light grey-blue for an idle link through orange to dark red for the busiest: readable on white, and
// the order is clear without a legend.
std::string heat_colour(double f) {
  f = std::clamp(std::isfinite(f) ? f : 0.0, 0.0, 1.0);
  struct Rgb {
    double r, g, b;
  };
  const Rgb stops[] = {{208, 215, 226}, {242, 165, 65}, {178, 24, 43}};
  const double pos = f * 2;
  const int i = std::min(1, static_cast<int>(pos));
  const double t = pos - i;
  const Rgb& a = stops[i];
  const Rgb& b = stops[i + 1];
  return fmt::format("#{:02x}{:02x}{:02x}", static_cast<int>(std::lround(a.r + (b.r - a.r) * t)),
                     static_cast<int>(std::lround(a.g + (b.g - a.g) * t)),
                     static_cast<int>(std::lround(a.b + (b.b - a.b) * t)));
}

// The width of a node's box when it is named: its name at the drawing's 11 px font (about 6.4 px a
// character), at most 9 characters of it.
double label_width(const std::string& id) {
  return 6.4 * static_cast<double>(std::min<std::size_t>(id.size(), 9)) + 10;
}

// Each node's index by id.
std::map<std::string, int> node_index(const RunTopology& t) {
  std::map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(t.nodes.size()); ++i) index.emplace(t.nodes[i].id, i);
  return index;
}

// A link's two ends as node indices; false for a link that names a node the topology lacks, or loops.
bool link_ends(const std::map<std::string, int>& index, const TopologyLink& l, int& from, int& to) {
  auto a = index.find(l.from), b = index.find(l.to);
  if (a == index.end() || b == index.end() || a->second == b->second) return false;
  from = a->second;
  to = b->second;
  return true;
}

// Each node's neighbours, each once, whichever way their links go.
std::vector<std::vector<int>> neighbours_of(const RunTopology& t) {
  const std::map<std::string, int> index = node_index(t);
  std::vector<std::vector<int>> out(t.nodes.size());
  std::set<std::pair<int, int>> seen;
  for (const TopologyLink& l : t.links) {
    int a, b;
    if (!link_ends(index, l, a, b) || !seen.insert({std::min(a, b), std::max(a, b)}).second) continue;
    out[a].push_back(b);
    out[b].push_back(a);
  }
  return out;
}

// Puts a row's nodes as near as they can be to where they want to be (left to right in that order),
// `gap` apart and inside the drawing.
void spread_row(std::vector<int>& row, const std::vector<double>& want, double gap, double left, double right,
                std::vector<double>& x) {
  std::stable_sort(row.begin(), row.end(), [&want](int a, int b) { return want[a] < want[b]; });
  for (int i : row) {
    x[i] = std::max(want[i], left);
    left = x[i] + gap;
  }
  for (auto it = row.rbegin(); it != row.rend(); ++it) {
    x[*it] = std::min(x[*it], right);
    right = x[*it] - gap;
  }
}

}  // namespace

TopologyLayout layout_topology(const RunTopology& t) {
  TopologyLayout lay;
  const int n = static_cast<int>(t.nodes.size());
  lay.x.assign(n, 0);
  lay.y.assign(n, 0);
  if (n == 0) return lay;

  // Rows by level, top to bottom, each in the order the backend listed its nodes.
  std::map<int, std::vector<int>> rows;
  for (int i = 0; i < n; ++i) rows[t.nodes[i].level].push_back(i);
  std::size_t widest = 0;
  for (const auto& [level, members] : rows) widest = std::max(widest, members.size());

  // Named boxes where the crowded rows' names fit side by side in a drawing about 1,600 px wide;
  // otherwise unnamed ones (named on hover), packed tighter for larger machines.
  double label_room = 0;
  for (const auto& [level, members] : rows) {
    if (members.size() * 4 < widest * 3) continue;
    for (int i : members) label_room = std::max(label_room, label_width(t.nodes[i].id) + 6);
  }
  const double fit = 1600.0 / static_cast<double>(widest);
  const double named = std::max(label_room, std::min(64.0, fit));
  lay.labels = named <= fit;
  const double spacing = lay.labels ? named : widest <= 64 ? 34 : 14;
  lay.box_w = std::min(spacing - 6, 56.0);
  lay.box_h = 20;
  const double margin = 40, host_gap = spacing * 0.6;

  // The anchor row is the GPUs' (or the widest).
  int anchor = rows.begin()->first;
  for (const auto& [level, members] : rows) {
    if (rows[anchor].size() < members.size()) anchor = level;
  }
  for (int i = 0; i < n; ++i) {
    if (t.nodes[i].kind == "gpu") {
      anchor = t.nodes[i].level;
      break;
    }
  }
  // Each server gets room for its most crowded row, so that its NICs or switches fit above its GPUs instead
  // of spilling over its neighbour's; the anchor row's nodes of a server spread evenly across that room, in
  // list order, with a gap between servers.
  std::map<int, std::map<int, int>> per_row;  // host -> level -> nodes
  for (const TopologyNode& node : t.nodes) ++per_row[node.host][node.level];
  std::map<int, int> room;
  for (const auto& [host, levels] : per_row) {
    for (const auto& [level, count] : levels) room[host] = std::max(room[host], count);
  }
  const std::vector<int>& anchors = rows[anchor];
  double left = margin;
  for (std::size_t first = 0, last; first < anchors.size(); first = last) {
    const int host = t.nodes[anchors[first]].host;
    last = first;
    while (last < anchors.size() && t.nodes[anchors[last]].host == host) ++last;
    const double count = static_cast<double>(last - first);
    const double width = spacing * std::max<double>(room[host], count);
    for (std::size_t k = first; k < last; ++k) {
      lay.x[anchors[k]] = left + (static_cast<double>(k - first) + 0.5) * width / count;
    }
    left += width + host_gap;
  }
  lay.width = std::max(720.0, left - host_gap + margin);

  // Then the other rows, nearest the anchor first: each node above (or below) the mean of its placed
  // neighbours, pushed apart just enough not to overlap (a barycentre layout). A node with no placed
  // neighbour is spread across the width in list order.
  const std::vector<std::vector<int>> neighbours = neighbours_of(t);
  std::vector<int> order;
  for (const auto& [level, members] : rows) order.push_back(level);
  std::stable_sort(order.begin(), order.end(),
                   [anchor](int a, int b) { return std::abs(a - anchor) < std::abs(b - anchor); });
  std::vector<bool> placed(n, false);
  for (int i : rows[anchor]) placed[i] = true;
  std::vector<double> want(n, 0);
  for (int level : order) {
    if (level == anchor) continue;
    std::vector<int>& members = rows[level];
    for (std::size_t k = 0; k < members.size(); ++k) {
      double sum = 0;
      int count = 0;
      for (int m : neighbours[members[k]]) {
        if (!placed[m]) continue;
        sum += lay.x[m];
        ++count;
      }
      want[members[k]] =
          count > 0 ? sum / count : margin + (k + 0.5) * (lay.width - 2 * margin) / members.size();
    }
    const double gap = std::min(spacing, (lay.width - 2 * margin) / static_cast<double>(members.size()));
    spread_row(members, want, gap, margin + lay.box_w / 2, lay.width - margin - lay.box_w / 2, lay.x);
    for (int i : members) placed[i] = true;
  }

  const double row_gap = 72, top = 30;
  int row = 0;
  for (const auto& [level, members] : rows) {
    for (int i : members) lay.y[i] = top + row * row_gap + lay.box_h / 2;
    ++row;
  }
  lay.height = top + (row - 1) * row_gap + lay.box_h + 70;
  return lay;
}

namespace {

// Servers as dashed boxes behind their devices, named in the bottom corner, which the links into the box
// from the fabric above leave free.
void draw_hosts(std::string& out, const RunTopology& t, const TopologyLayout& lay) {
  std::map<int, std::array<double, 4>> hosts;  // host -> x0, y0, x1, y1
  for (std::size_t i = 0; i < t.nodes.size(); ++i) {
    if (t.nodes[i].host < 0) continue;
    const double x = lay.x[i], y = lay.y[i];
    auto [it, inserted] = hosts.try_emplace(t.nodes[i].host, std::array<double, 4>{x, y, x, y});
    auto& b = it->second;
    b = {std::min(b[0], x), std::min(b[1], y), std::max(b[2], x), std::max(b[3], y)};
  }
  const double pad = 10, w = lay.box_w, h = lay.box_h;
  for (const auto& [host, b] : hosts) {
    out += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" rx=\"8\" fill=\"#f6f7f9\" "
        "stroke=\"#9aa5b1\" stroke-dasharray=\"4 3\"/><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "fill=\"#5d6875\">node {}</text>\n",
        b[0] - w / 2 - pad, b[1] - h / 2 - pad, b[2] - b[0] + w + 2 * pad, b[3] - b[1] + h + 2 * pad + 12,
        b[0] - w / 2 - pad + 4, b[3] + h / 2 + pad + 8, host);
  }
}

// The path of a link from a to b: between rows a straight line, nudged sideways so that the two directions
// of a pair sit side by side; within a row an arc, above it going right and below it going left.
std::string link_path(double ax, double ay, double bx, double by, double box_h) {
  if (ay == by) {
    const double mid = (ax + bx) / 2, span = std::fabs(bx - ax);
    const double lift = std::min(70.0, 14 + span * 0.18) * (bx > ax ? -1 : 1);
    const double edge = box_h / 2 * (bx > ax ? -1 : 1);
    return fmt::format("M{:.1f} {:.1f} Q{:.1f} {:.1f} {:.1f} {:.1f}", ax, ay + edge, mid,
                       ay + edge + lift * 2, bx, by + edge);
  }
  const double dx = bx - ax, dy = by - ay, len = std::max(1e-9, std::hypot(dx, dy));
  const double off = 2.2, nx = -dy / len * off, ny = dx / len * off;
  return fmt::format("M{:.1f} {:.1f} L{:.1f} {:.1f}", ax + nx, ay + ny, bx + nx, by + ny);
}

// A link of the drawing with what it carried.
struct DrawnLink {
  const TopologyLink* link;
  int from, to;
  std::int64_t bytes;
  double value;  // what its colour shows: utilisation or bytes
};

// The topology's links with their traffic (joined by id), coloured by utilisation over the run when every
// capacity is known, else by bytes; idle links first, so that busy ones are drawn over them.
std::vector<DrawnLink> drawn_links(const RunReport& r, bool& by_util) {
  std::map<std::string, std::int64_t> bytes;
  for (const LinkTraffic& l : r.links) bytes[l.link] += l.bytes;
  const std::map<std::string, int> index = node_index(r.topology);
  std::vector<DrawnLink> out;
  for (const TopologyLink& l : r.topology.links) {
    int a, b;
    if (!link_ends(index, l, a, b)) continue;
    auto it = bytes.find(l.id);
    out.push_back({&l, a, b, it == bytes.end() ? 0 : it->second, 0});
  }
  by_util = r.makespan_us > 0 && !out.empty() && std::all_of(out.begin(), out.end(), [](const DrawnLink& d) {
              return d.link->bandwidth_gbps > 0;
            });
  for (DrawnLink& d : out) {
    d.value = by_util ? static_cast<double>(d.bytes) / (d.link->bandwidth_gbps * 1e3 * r.makespan_us)
                      : static_cast<double>(d.bytes);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const DrawnLink& a, const DrawnLink& b) { return a.value < b.value; });
  return out;
}

void draw_links(std::string& out, const RunReport& r, const std::vector<DrawnLink>& links, double scale_top,
                const TopologyLayout& lay) {
  for (const DrawnLink& d : links) {
    const double f = scale_top > 0 ? d.value / scale_top : 0;
    std::string title =
        fmt::format("{} ({}): {}", d.link->id, d.link->tier, format_bytes(static_cast<double>(d.bytes)));
    if (d.link->bandwidth_gbps > 0 && r.makespan_us > 0) {
      const double util = static_cast<double>(d.bytes) / (d.link->bandwidth_gbps * 1e3 * r.makespan_us);
      title += fmt::format(", {:.1f}% of {} over the run", 100 * util, format_gbps(d.link->bandwidth_gbps));
    }
    out += fmt::format(
        "<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{:.2f}\" stroke-linecap=\"round\" "
        "data-link=\"{}\"><title>{}</title></path>\n",
        link_path(lay.x[d.from], lay.y[d.from], lay.x[d.to], lay.y[d.to], lay.box_h), heat_colour(f),
        1.2 + 3.3 * f, html_escape(d.link->id), html_escape(title));
  }
}

void draw_nodes(std::string& out, const RunTopology& t, const TopologyLayout& lay) {
  for (std::size_t i = 0; i < t.nodes.size(); ++i) {
    const TopologyNode& n = t.nodes[i];
    // Wide enough for its label where labels are drawn (switch names are longer than "gpu3").
    const double w = lay.labels ? std::max(lay.box_w, label_width(n.id)) : lay.box_w;
    const char* fill = n.kind == "gpu"                      ? "#dce8f5"
                       : n.kind == "nvswitch"               ? "#e8e1f2"
                       : n.kind == "nic" || n.kind == "cpu" ? "#e3f0df"
                                                            : "#fff3dc";
    const std::string title =
        n.rank >= 0 ? fmt::format("{}: rank {}", n.id, n.rank) : fmt::format("{} ({})", n.id, n.kind);
    out += fmt::format(
        "<g data-node=\"{}\"><title>{}</title><rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" "
        "height=\"{:.1f}\" rx=\"3\" fill=\"{}\" stroke=\"#52606d\"/>",
        html_escape(n.id), html_escape(title), lay.x[i] - w / 2, lay.y[i] - lay.box_h / 2, w, lay.box_h,
        fill);
    if (lay.labels) {
      out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>", lay.x[i],
                         lay.y[i] + 4, html_escape(n.id.size() > 9 ? n.id.substr(0, 8) + "\u2026" : n.id));
    }
    out += "</g>\n";
  }
}

// The colour scale runs to the busiest link of this run, whose absolute figure it gives: on an absolute
// scale a run whose busiest link is busy 2% of the time would be grey everywhere and show nothing.
void draw_scale(std::string& out, bool by_util, double top_value, const TopologyLayout& lay) {
  const double lx = 40, ly = lay.height - 28;
  out += "<defs><linearGradient id=\"heat\">";
  for (int i = 0; i <= 4; ++i)
    out += fmt::format("<stop offset=\"{}%\" stop-color=\"{}\"/>", i * 25, heat_colour(i / 4.0));
  out += "</linearGradient></defs>\n";
  const std::string top_label =
      by_util ? fmt::format("the busiest link: {:.2g}% of its capacity over the run", 100 * top_value)
              : format_bytes(top_value);
  out += fmt::format(
      "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"160\" height=\"10\" fill=\"url(#heat)\"/>"
      "<text x=\"{:.1f}\" y=\"{:.1f}\">0</text><text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>"
      "<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#5d6875\">link colour: {}</text>\n",
      lx, ly, lx, ly + 22, lx + 160, ly + 22, html_escape(top_label), lx + 176, ly + 9,
      by_util ? "utilisation" : "bytes carried");
}

// Past this many devices the drawing is a blur of thousands of boxes and tens of megabytes of SVG: the page
// gives the links per tier instead (links_table), and report.json every link.
constexpr std::size_t kMaxDrawnNodes = 600;

// The machine as the backend described it (RunReport::topology), each link coloured by its traffic.
void topology_section(std::string& out, const RunReport& r) {
  if (r.topology.nodes.empty()) {
    out += "<p class=\"sub\">The backend described no topology.</p>\n";
    return;
  }
  if (r.topology.nodes.size() > kMaxDrawnNodes) {
    out += fmt::format(
        "<p class=\"sub\" id=\"topology\" data-nodes=\"{}\">The machine has {} devices and {} links, more "
        "than a drawing can show: the links are summed per tier beside this, and report.json lists each "
        "one.</p>\n",
        r.topology.nodes.size(), r.topology.nodes.size(), r.topology.links.size());
    return;
  }
  const TopologyLayout lay = layout_topology(r.topology);
  bool by_util = false;
  const std::vector<DrawnLink> links = drawn_links(r, by_util);
  const double top_value = links.empty() ? 0 : links.back().value;
  out += fmt::format(
      "<div class=\"wide\"><svg id=\"topology\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" "
      "height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" data-nodes=\"{}\" data-links=\"{}\">\n",
      lay.width, lay.height, lay.width, lay.height, r.topology.nodes.size(), links.size());
  draw_hosts(out, r.topology, lay);
  draw_links(out, r, links, top_value, lay);
  draw_nodes(out, r.topology, lay);
  if (!links.empty()) draw_scale(out, by_util, top_value, lay);
  out += "</svg></div>\n";
}

// Past this many links the table lists the busiest only; report.json lists them all.
constexpr std::size_t kMaxListedLinks = 100;

void links_table(std::string& out, const RunReport& r) {
  if (r.links.empty()) return;
  // Per tier first, then the busiest links; a large world has too many to list them all at once.
  struct Tier {
    std::string name;
    std::int64_t bytes = 0;
    int links = 0;
    double busiest = -1;  // the highest utilisation of its links; -1 when a capacity is unknown
    std::string busiest_link;
  };
  std::vector<Tier> tiers;
  const bool timed = r.makespan_us > 0;
  for (const LinkTraffic& l : r.links) {
    auto it = std::find_if(tiers.begin(), tiers.end(), [&l](const Tier& t) { return t.name == l.tier; });
    if (it == tiers.end()) it = tiers.insert(tiers.end(), Tier{l.tier, 0, 0, -1, {}});
    it->bytes += l.bytes;
    ++it->links;
    if (l.bandwidth_gbps > 0 && timed) {
      const double util = static_cast<double>(l.bytes) / (l.bandwidth_gbps * 1e3 * r.makespan_us);
      if (util > it->busiest) it->busiest = util, it->busiest_link = l.link;
    }
  }
  out +=
      "<div class=\"scroll\"><table id=\"tiers\">\n<tr><th class=\"l\">tier</th><th>links</th><th>bytes</th>"
      "<th class=\"l\">busiest link</th><th>its utilisation</th></tr>\n";
  for (const Tier& t : tiers) {
    out += fmt::format(
        "<tr><td class=\"l\">{}</td><td>{}</td><td>{}</td><td class=\"l\">{}</td><td>{}</td></tr>\n",
        html_escape(t.name), t.links, format_bytes(static_cast<double>(t.bytes)), html_escape(t.busiest_link),
        t.busiest >= 0 ? fmt::format("{:.1f}%", 100 * t.busiest) : "?");
  }
  out += "</table></div>\n";
  std::vector<const LinkTraffic*> sorted;
  for (const LinkTraffic& l : r.links) sorted.push_back(&l);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const LinkTraffic* a, const LinkTraffic* b) { return a->bytes > b->bytes; });
  const std::size_t listed = std::min(sorted.size(), kMaxListedLinks);
  out += fmt::format("<details open><summary>links by traffic ({})</summary><div class=\"scroll\"><table>\n",
                     listed == sorted.size() ? fmt::format("{}", listed)
                                             : fmt::format("the {} busiest of {}", listed, sorted.size()));
  out +=
      "<tr><th class=\"l\">link</th><th "
      "class=\"l\">tier</th><th>bytes</th><th>capacity</th><th>utilisation</th></tr>\n";
  for (std::size_t i = 0; i < listed; ++i) {
    const LinkTraffic* l = sorted[i];
    const bool known = l->bandwidth_gbps > 0 && timed;
    out += fmt::format(
        "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        html_escape(l->link), html_escape(l->tier), format_bytes(static_cast<double>(l->bytes)),
        l->bandwidth_gbps > 0 ? format_gbps(l->bandwidth_gbps) : "?",
        known ? fmt::format("{:.1f}%",
                            100.0 * static_cast<double>(l->bytes) / (l->bandwidth_gbps * 1e3 * r.makespan_us))
              : "?");
  }
  out += "</table></div></details>\n";
}

// ---- training
// -----------------------------------------------------------------------------------------------

// A training lesson's step in figures, above the timeline: what a reader asks first (how long, how
// efficient, where the time and the memory go).
void training_section(std::string& out, const RunReport& r) {
  if (!r.training) return;
  const TrainingStats& t = *r.training;
  out += "<section id=\"training\">\n<h2>Training step</h2>\n";
  if (!t.layout.empty() || !t.model.empty()) {
    out += fmt::format("<p class=\"sub\">{}{}{}</p>\n", html_escape(t.model),
                       t.model.empty() || t.layout.empty() ? "" : ": ", html_escape(t.layout));
  }
  out += "<div class=\"cards\">\n";
  auto card = [&out](const std::string& value, const std::string& label) {
    out += fmt::format("<div><b>{}</b><span>{}</span></div>\n", html_escape(value), html_escape(label));
  };
  card(human_time(t.step_time_us), fmt::format("step, {} tokens", t.tokens_per_step));
  card(fmt::format("{:.1f}%", 100 * t.mfu), "MFU (model FLOPs / dense peak)");
  card(fmt::format("{:.1f}", t.model_tflops_per_gpu), "model TFLOP/s per GPU");
  card(fmt::format("{:.1f}", t.hardware_tflops_per_gpu), "hardware TFLOP/s per GPU (with recompute)");
  card(fmt::format("{:.1f}% / {:.1f}%", 100 * t.bubble_fraction, 100 * t.bubble_fraction_formula),
       fmt::format("bubble: measured / (p-1)/(v m), m = {}", t.micro_batches));
  for (const auto& [dim, us] : t.exposed_comm_us) card(human_time(us), "exposed " + dim + " communication");
  out += "</div>\n";
  // Memory of the reporting rank by part: the bar is the peak, split into its parts; the capacity is said.
  std::int64_t capacity = 0;
  for (const RankSummary& s : r.ranks) capacity = std::max(capacity, s.capacity_bytes);
  const double whole = static_cast<double>(std::max(
      t.peak_memory_bytes, t.weights_bytes + t.grads_bytes + t.optimizer_bytes + t.activations_bytes));
  const std::pair<const char*, std::int64_t> parts[] = {{"weights", t.weights_bytes},
                                                        {"grads", t.grads_bytes},
                                                        {"optimizer", t.optimizer_bytes},
                                                        {"activations", t.activations_bytes}};
  const char* colours[] = {"var(--compute)", "var(--comm)", "var(--region)", "var(--wait)"};
  out += fmt::format(
      "<p>peak memory {}{}</p>\n<div class=\"bar\">", format_bytes(static_cast<double>(t.peak_memory_bytes)),
      capacity > 0
          ? fmt::format(" of {} ({:.1f}%)", format_bytes(static_cast<double>(capacity)),
                        100.0 * static_cast<double>(t.peak_memory_bytes) / static_cast<double>(capacity))
          : "");
  for (int i = 0; i < 4; ++i) {
    if (whole <= 0 || parts[i].second <= 0) continue;
    out += fmt::format("<i title=\"{} {}\" style=\"width:{:.2f}%;background:{}\"></i>", parts[i].first,
                       format_bytes(static_cast<double>(parts[i].second)),
                       100 * static_cast<double>(parts[i].second) / whole, colours[i]);
  }
  out += "</div>\n<div class=\"legend\">";
  for (int i = 0; i < 4; ++i) {
    out += fmt::format("<span style=\"--c:{}\">{} {}</span>", colours[i], parts[i].first,
                       format_bytes(static_cast<double>(parts[i].second)));
  }
  out += "</div>\n</section>\n";
}

// ---- pipeline schedule -----------------------------------------------------------------------------------

// A task's names: for the tooltip ("backward mb 3 chunk 1") and for inside its box ("B3.1").

// The report's pipeline tasks as a schedule: a row per stage, from the stage's lowest rank that reported
// (the ranks of one stage run the same schedule), and the bubble measured as the pipeline lesson measures
// it, idle over compute: (window - mean busy) / mean busy, where (p - 1) / (v m) is its prediction.
struct Schedule {
  int stages = 0, chunks = 0, micro_batches = 0;
  std::vector<int> rank;                                // per stage; -1 when none reported
  std::vector<std::vector<const PipelineTask*>> tasks;  // per stage, by start
  double start_us = 0, end_us = 0;
  double bubble = 0, formula = 0;
};

Schedule schedule_of(const RunReport& r) {
  Schedule s;
  for (const PipelineTask& t : r.pipeline) {
    s.stages = std::max(s.stages, t.stage + 1);
    s.chunks = std::max(s.chunks, t.chunk + 1);
    s.micro_batches = std::max(s.micro_batches, t.micro_batch + 1);
  }
  s.rank.assign(s.stages, -1);
  s.tasks.resize(s.stages);
  for (const PipelineTask& t : r.pipeline) {
    if (t.stage < 0) continue;
    int& owner = s.rank[t.stage];
    if (owner < 0 || t.rank < owner) {
      owner = t.rank;
      s.tasks[t.stage].clear();
    }
    if (t.rank == owner) s.tasks[t.stage].push_back(&t);
  }
  s.start_us = INFINITY;
  s.end_us = -INFINITY;
  double busy = 0;
  int rows = 0;
  for (auto& row : s.tasks) {
    std::stable_sort(row.begin(), row.end(),
                     [](const PipelineTask* a, const PipelineTask* b) { return a->start_us < b->start_us; });
    for (const PipelineTask* t : row) {
      s.start_us = std::min(s.start_us, t->start_us);
      s.end_us = std::max(s.end_us, t->end_us);
      busy += t->end_us - t->start_us;
    }
    rows += row.empty() ? 0 : 1;
  }
  const double mean_busy = rows > 0 ? busy / rows : 0;
  s.bubble = mean_busy > 0 ? (s.end_us - s.start_us - mean_busy) / mean_busy : 0;
  s.formula = s.micro_batches > 0 ? (s.stages - 1.0) / (s.chunks * static_cast<double>(s.micro_batches)) : 0;
  return s;
}

// The timed step's schedule at the top of the page, as the pipeline papers draw it: a row per stage, a box
// per forward (blue) or backward (purple), labelled with its micro-batch (and chunk, paler for later
// chunks), on the pale red of idle time, so the bubble is the red that shows. Beside it, the bubble
// measured against (p - 1) / (v m).
void pipeline_section(std::string& out, const RunReport& r) {
  if (r.pipeline.empty()) return;
  const Schedule s = schedule_of(r);
  const bool interleaved = s.chunks > 1;
  out += "<section id=\"schedule\">\n<h2>Pipeline schedule</h2>\n";
  out += fmt::format(
      "<p class=\"sub\">p = {} stages, m = {} micro-batches{}, the step the lesson timed. Bubble: "
      "<b>{:.1f}%</b> "
      "measured (idle over compute, mean over stages), against (p-1)/(v&middot;m) = {}/({}&middot;{}) = "
      "<b>{:.1f}%</b> for uniform stages and free communication.</p>\n",
      s.stages, s.micro_batches, interleaved ? fmt::format(", v = {} chunks per stage", s.chunks) : "",
      100 * s.bubble, s.stages - 1, s.chunks, s.micro_batches, 100 * s.formula);
  out += fmt::format(
      "<div class=\"legend\"><span style=\"--c:var(--forward)\">forward</span><span "
      "style=\"--c:var(--backward)\">backward</span><span style=\"--c:var(--idle)\">idle: the bubble</span>"
      "<span style=\"--c:transparent\">F3 = forward of micro-batch 3{}</span></div>\n",
      interleaved ? ", F3.1 its chunk 1 (paler)" : "");

  const double label_w = 124, width = 1100, row_h = 24, axis = 22, plot = width - label_w - 16;
  const double window = std::max(s.end_us - s.start_us, 1e-9);
  auto px = [&](double us) { return label_w + (us - s.start_us) / window * plot; };
  const double height = axis + s.stages * row_h + 4;
  out += fmt::format(
      "<div class=\"wide\"><svg id=\"pipeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" "
      "height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" data-stages=\"{}\" data-tasks=\"{}\">\n",
      width, height, width, height, s.stages, r.pipeline.size());
  for (int k = 0; k <= 4; ++k) {
    const double x = label_w + k * plot / 4;
    out += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2:.0f}\" stroke=\"#e4e7eb\"/><text "
        "x=\"{0:.1f}\" "
        "y=\"14\" text-anchor=\"{3}\" style=\"fill:var(--muted)\">{4}</text>\n",
        x, axis - 4, height,
        k == 0   ? "start"
        : k == 4 ? "end"
                 : "middle",
        human_time(k * window / 4));
  }
  for (int stage = 0; stage < s.stages; ++stage) {
    const double y = axis + stage * row_h;
    const auto& row = s.tasks[stage];
    out += fmt::format("<g data-stage=\"{}\" data-rank=\"{}\" data-boxes=\"{}\">", stage, s.rank[stage],
                       row.size());
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">stage {}{}</text><rect x=\"{:.1f}\" "
        "y=\"{:.1f}\" "
        "width=\"{:.1f}\" height=\"{:.1f}\" style=\"fill:var(--idle)\"/>\n",
        label_w - 8, y + row_h / 2 + 4, stage,
        s.rank[stage] >= 0 ? fmt::format(" (rank {})", s.rank[stage]) : "", label_w, y + 1, plot, row_h - 2);
    for (const PipelineTask* t : row) {
      const double x0 = px(t->start_us), w = std::max(0.5, px(t->end_us) - x0);
      const double shade = interleaved ? 1.0 - 0.45 * t->chunk / (s.chunks - 1.0) : 1.0;
      const std::string label = pipeline_task_label(*t, interleaved);
      out += fmt::format(
          "<g class=\"task\"><title>{}: {}, from {}</title><rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" "
          "height=\"{:.1f}\" style=\"fill:var({})\" fill-opacity=\"{:.2f}\" stroke=\"#fff\" "
          "stroke-width=\"0.5\"/>",
          pipeline_task_name(*t, interleaved), human_time(t->end_us - t->start_us),
          human_time(t->start_us - s.start_us), x0, y + 1, w, row_h - 2,
          t->forward ? "--forward" : "--backward", shade);
      // Named where the name fits (about 6.5 px a character at 11 px).
      if (w >= 6.5 * static_cast<double>(label.size()) + 4) {
        out += fmt::format(
            "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" style=\"fill:#fff\">{}</text>",
            x0 + w / 2, y + row_h / 2 + 4, label);
      }
      out += "</g>\n";
    }
    out += "</g>\n";
  }
  out += "</svg></div>\n</section>\n";
}

// ---- timeline --------------------------------------------------------------------------------------------

// The spans as compact JSON for the page's script: per rank, flat arrays [start, end, name, ...] sorted by
// start for compute (c), transfers (m), waits (w), idle (i), regions (g) and a pipeline's forward (f) and
// backward (b) tasks, whose short labels (fl, bl) are beside them; names are indices into one table, since
// a training run repeats a handful of names thousands of times.
std::string timeline_json(const RunReport& r) {
  const std::vector<std::vector<TimeRange>> idle = idle_intervals(r);
  const int n = std::max<int>(static_cast<int>(idle.size()), r.world);
  struct Item {
    double start, end;
    int name;
    int label = -1;  // what a pipeline task's box says inside: "F3"
  };
  std::vector<std::array<std::vector<Item>, 7>> rows(n);
  std::map<std::string, int> name_index;
  std::vector<const std::string*> names;
  auto intern = [&](const std::string& s) {
    auto [it, inserted] = name_index.try_emplace(s, static_cast<int>(names.size()));
    if (inserted) names.push_back(&it->first);
    return it->second;
  };
  for (const Span& s : r.spans) {
    if (s.rank < 0 || s.rank >= n) continue;
    const int band = s.kind == SpanKind::Compute ? 0 : s.kind == SpanKind::Comm ? 1 : 2;
    rows[s.rank][band].push_back({s.start_us, s.end_us, intern(s.name)});
  }
  const int idle_name = intern("idle");
  for (int i = 0; i < static_cast<int>(idle.size()); ++i) {
    for (const TimeRange& t : idle[i]) rows[i][3].push_back({t.start_us, t.end_us, idle_name});
  }
  for (const RegionRecord& g : r.regions) {
    if (g.rank >= 0 && g.rank < n) rows[g.rank][4].push_back({g.start_us, g.end_us, intern(g.name)});
  }
  bool interleaved = false;
  for (const PipelineTask& t : r.pipeline) interleaved = interleaved || t.chunk > 0;
  for (const PipelineTask& t : r.pipeline) {
    if (t.rank < 0 || t.rank >= n) continue;
    rows[t.rank][t.forward ? 5 : 6].push_back({t.start_us, t.end_us,
                                               intern(pipeline_task_name(t, interleaved)),
                                               intern(pipeline_task_label(t, interleaved))});
  }
  std::string out = fmt::format("{{\"end\":{},\"rows\":[", json_number(r.makespan_us));
  const char* keys[] = {"c", "m", "w", "i", "g", "f", "b"};
  bool first_row = true;
  for (int i = 0; i < n; ++i) {
    if (!r.traces(i)) continue;  // a rank whose timeline the report did not keep
    out += fmt::format("{}{{\"r\":{},", first_row ? "" : ",", i);
    first_row = false;
    for (int b = 0; b < 7; ++b) {
      std::vector<Item>& items = rows[i][b];
      std::stable_sort(items.begin(), items.end(),
                       [](const Item& x, const Item& y) { return x.start < y.start; });
      out += fmt::format("{}\"{}\":[", b ? "," : "", keys[b]);
      for (std::size_t k = 0; k < items.size(); ++k) {
        out += fmt::format("{}{},{},{}", k ? "," : "", json_number(items[k].start), json_number(items[k].end),
                           items[k].name);
      }
      out += "]";
      if (b < 5) continue;
      // The pipeline's tasks also carry their short labels, in the same order.
      out += fmt::format(",\"{}l\":[", keys[b]);
      for (std::size_t k = 0; k < items.size(); ++k) out += fmt::format("{}{}", k ? "," : "", items[k].label);
      out += "]";
    }
    out += "}";
  }
  out += "],\"names\":[";
  for (std::size_t k = 0; k < names.size(); ++k) {
    if (k) out += ',';
    out += json_string(*names[k]);
  }
  out += "]}";
  return out;
}

void timeline_section(std::string& out, const RunReport& r) {
  out += "<h2>Timeline</h2>\n";
  out +=
      "<div class=\"legend\"><span style=\"--c:var(--compute)\">compute</span>"
      "<span style=\"--c:var(--comm)\">communication</span>"
      "<span style=\"--c:var(--wait)\">waiting for peers</span>"
      "<span style=\"--c:var(--idle)\">idle (neither stream busy)</span>"
      "<span style=\"--c:var(--region)\">region</span>";
  if (!r.pipeline.empty()) {
    out +=
        "<span style=\"--c:var(--forward)\">forward task (F3: micro-batch 3)</span>"
        "<span style=\"--c:var(--backward)\">backward task</span>";
  }
  out +=
      "<span style=\"--c:transparent\">wheel: zoom &middot; drag: pan &middot; double-click: whole "
      "run</span></div>\n";
  out += fmt::format(
      "<div id=\"timeline\" data-rows=\"0\" data-ranks=\"{}\"><canvas></canvas><div "
      "id=\"tip\"></div></div>\n",
      std::max<int>(r.world, static_cast<int>(r.ranks.size())));
  out += "<noscript><p class=\"sub\">The timeline needs JavaScript.</p></noscript>\n";
  out += "<script type=\"application/json\" id=\"timeline-data\">" + script_json(timeline_json(r)) +
         "</script>\n";
  out += fmt::format("<script>{}</script>\n", assets::timeline_js);
}

// ---- every rank at a glance -----------------------------------------------------------------------------

// RunReport::activity for the strip's script: per rank its digits, or the rank it mirrors.
std::string strip_json(const RunReport& r) {
  std::string out = fmt::format("{{\"end\":{},\"bin_us\":{},\"bins\":{},\"rows\":[",
                                json_number(r.makespan_us), json_number(r.activity.bin_us), r.activity.bins);
  for (std::size_t i = 0; i < r.activity.ranks.size(); ++i) {
    if (i > 0) out += ',';
    const int mirror = i < r.ranks.size() ? r.ranks[i].mirror_of : -1;
    out += r.activity.ranks[i].empty() && mirror >= 0 ? std::to_string(mirror)
                                                      : json_string(r.activity.ranks[i]);
  }
  out += "]}";
  return out;
}

void strip_section(std::string& out, const RunReport& r) {
  if (r.activity.ranks.empty() || r.activity.bins <= 0) return;
  out += "<h2>Every rank</h2>\n";
  out +=
      "<div class=\"legend\"><span style=\"--c:var(--compute)\">compute</span>"
      "<span style=\"--c:var(--comm)\">communication beyond the compute</span>"
      "<span style=\"--c:var(--wait)\">waiting for peers</span><span style=\"--c:var(--panel)\">idle</span>"
      "<span style=\"--c:transparent\">a row per rank, a cell per bin of time; a mirror of a symmetric run "
      "is "
      "drawn as the rank it mirrors</span></div>\n";
  out += fmt::format(
      "<div id=\"strip\" data-ranks=\"{}\" data-rows=\"0\"><canvas></canvas><div "
      "class=\"tip\"></div></div>\n",
      r.activity.ranks.size());
  out += "<script type=\"application/json\" id=\"strip-data\">" + script_json(strip_json(r)) + "</script>\n";
  out += fmt::format("<script>{}</script>\n", assets::strip_js);
}

// ---- tables ----------------------------------------------------------------------------------------------

// Past this many ranks the per-rank tables list the traced ranks, the last to finish and the fullest (the
// strip above shows every rank, report.json holds every rank's figures).
constexpr std::size_t kMaxRankRows = 64;

std::vector<const RankSummary*> listed_ranks(const RunReport& r) {
  std::vector<const RankSummary*> out;
  if (r.ranks.size() <= kMaxRankRows) {
    for (const RankSummary& s : r.ranks) out.push_back(&s);
    return out;
  }
  auto by = [&r](auto less) { return &*std::max_element(r.ranks.begin(), r.ranks.end(), less); };
  const RankSummary* slowest =
      by([](const RankSummary& a, const RankSummary& b) { return a.end_us < b.end_us; });
  const RankSummary* fullest =
      by([](const RankSummary& a, const RankSummary& b) { return a.peak_bytes < b.peak_bytes; });
  for (const RankSummary& s : r.ranks) {
    const bool traced = !r.traced_ranks.empty() && r.traces(s.rank);
    if (&s == slowest || &s == fullest || (traced && out.size() < kMaxRankRows)) out.push_back(&s);
  }
  return out;
}

std::string listed_note(const RunReport& r, std::size_t listed) {
  if (listed == r.ranks.size()) return "";
  return fmt::format(
      "<p class=\"sub\">{} of {} ranks: the traced ones, the last to finish and the one with the highest "
      "peak "
      "(every rank is in the strip above and in report.json).</p>\n",
      listed, r.ranks.size());
}

void collectives_section(std::string& out, const RunReport& r) {
  out += "<h2>Collectives</h2>\n";
  std::vector<CollectiveTotal> rows = collective_totals(r);
  // The lesson's checks, not its communication (summary.txt counts them).
  std::erase_if(rows, [](const CollectiveTotal& c) { return c.bookkeeping; });
  if (rows.empty()) {
    out += "<p class=\"sub\">No collectives.</p>\n";
    return;
  }
  out +=
      "<div class=\"scroll\"><table id=\"collectives\">\n<tr><th "
      "class=\"l\">operation</th><th>bytes</th><th>ranks</th>"
      "<th class=\"l\">algorithm</th><th>count</th><th>mean time</th><th>min</th><th>max</th><th>total</th>"
      "<th>algbw</th><th>busbw</th></tr>\n";
  for (const CollectiveTotal& row : rows) {
    out += fmt::format(
        "<tr><td class=\"l\">{}</td><td>{}</td><td>{}</td><td "
        "class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        comm_op_name(row.op), format_bytes(static_cast<double>(row.bytes)), row.group_size,
        html_escape(row.algorithm.str()), row.count, human_time(row.mean_us()), human_time(row.min_us),
        human_time(row.max_us), human_time(row.total_us), format_gbps(row.algbw_gbps()),
        format_gbps(row.busbw_gbps()));
  }
  out += "</table></div>\n";
}

void ranks_section(std::string& out, const RunReport& r) {
  if (r.ranks.empty()) return;
  double longest = 0;
  for (const RankSummary& s : r.ranks) longest = std::max(longest, s.end_us);
  out +=
      "<h2>Time per rank</h2>\n<div class=\"legend\"><span style=\"--c:var(--compute)\">compute</span>"
      "<span style=\"--c:var(--comm)\">exposed communication</span><span "
      "style=\"--c:var(--idle)\">idle</span></div>\n";
  out +=
      "<div class=\"scroll\"><table id=\"ranks\">\n<tr><th>rank</th><th>end</th><th>compute</th><th>comm</th>"
      "<th>exposed</th><th>comm wait</th><th>idle</th><th class=\"l\">split of the run</th></tr>\n";
  const std::vector<const RankSummary*> listed = listed_ranks(r);
  for (const RankSummary* row : listed) {
    const RankSummary& s = *row;
    auto pct = [longest](double us) { return longest > 0 ? 100.0 * us / longest : 0.0; };
    out += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td "
        "class=\"l\"><div "
        "class=\"bar\"><i style=\"width:{:.2f}%;background:var(--compute)\"></i><i "
        "style=\"width:{:.2f}%;background:var(--comm)\"></i><i "
        "style=\"width:{:.2f}%;background:var(--idle)\"></i>"
        "</div></td></tr>\n",
        s.rank, human_time(s.end_us), human_time(s.compute_us), human_time(s.comm_us),
        human_time(s.exposed_comm_us), human_time(s.comm_wait_us), human_time(s.idle_us), pct(s.compute_us),
        pct(s.exposed_comm_us), pct(s.idle_us));
  }
  out += "</table></div>\n" + listed_note(r, listed.size());

  out +=
      "<h2>Memory per rank</h2>\n<div class=\"scroll\"><table id=\"memory\">\n<tr><th>rank</th><th>peak</th>"
      "<th>capacity</th><th>used</th><th class=\"l\"></th></tr>\n";
  for (const RankSummary* row : listed) {
    const RankSummary& s = *row;
    const double used =
        s.capacity_bytes > 0 ? static_cast<double>(s.peak_bytes) / static_cast<double>(s.capacity_bytes) : 0;
    out += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"l\"><div class=\"bar\"><i "
        "style=\"width:{:.2f}%;background:{}\"></i></div></td></tr>\n",
        s.rank, format_bytes(static_cast<double>(s.peak_bytes)),
        s.capacity_bytes > 0 ? format_bytes(static_cast<double>(s.capacity_bytes)) : "?",
        s.capacity_bytes > 0 ? fmt::format("{:.1f}%", 100 * used) : "?", std::min(100.0, 100 * used),
        used > 0.9 ? "var(--wait)" : "var(--region)");
  }
  out += "</table></div>\n";
}

void checks_section(std::string& out, const RunReport& r) {
  if (!r.checks.empty()) {
    // Grouped by what they check, as the terminal summary does.
    std::vector<std::pair<std::string, std::vector<const CheckRecord*>>> groups;
    for (const CheckRecord& c : r.checks) {
      auto it = std::find_if(groups.begin(), groups.end(), [&c](const auto& g) { return g.first == c.what; });
      if (it == groups.end()) {
        groups.push_back({c.what, {&c}});
      } else {
        it->second.push_back(&c);
      }
    }
    out += "<h2>Checks</h2>\n<ul id=\"checks\">\n";
    for (const auto& [what, list] : groups) {
      std::vector<const CheckRecord*> failed;
      for (const CheckRecord* c : list) {
        if (!c->passed) failed.push_back(c);
      }
      if (failed.empty()) {
        out += fmt::format("<li><span class=\"ok\">\u2713</span> {} ({} rank{})</li>\n", html_escape(what),
                           list.size(), list.size() == 1 ? "" : "s");
      } else {
        out +=
            fmt::format("<li><span class=\"bad\">\u2717</span> {} (failed on {} of {}; rank {}: {})</li>\n",
                        html_escape(what), failed.size(), list.size(), failed.front()->rank,
                        html_escape(failed.front()->detail));
      }
    }
    out += "</ul>\n";
  }
  if (!r.output.empty()) {
    out += fmt::format("<h2>Output</h2>\n<details><summary>{} line{} the lesson printed</summary><pre>",
                       r.output.size(), r.output.size() == 1 ? "" : "s");
    for (const std::string& line : r.output) out += html_escape(line) + "\n";
    out += "</pre></details>\n";
  }
}

}  // namespace

std::string report_to_html(const RunReport& report) {
  const std::string lesson = report.lesson.empty() ? "run" : report.lesson;
  std::string out = html_page_start(fmt::format("ranklab: {} on {}", lesson, report.backend));
  const std::size_t failed = std::count_if(report.checks.begin(), report.checks.end(),
                                           [](const CheckRecord& c) { return !c.passed; });
  out += fmt::format("<h1>{} on {}{}, {} rank{}: {}</h1>\n", html_escape(lesson), html_escape(report.backend),
                     report.profile.empty() ? "" : " (" + html_escape(report.profile) + ")", report.world,
                     report.world == 1 ? "" : "s", human_time(report.makespan_us));
  if (!report.checks.empty()) {
    out += failed == 0
               ? "<p class=\"ok\">every check passed</p>\n"
               : fmt::format("<p class=\"bad\">{} of {} checks failed</p>\n", failed, report.checks.size());
  }
  config_section(out, report);
  pipeline_section(out, report);
  training_section(out, report);
  strip_section(out, report);
  timeline_section(out, report);
  out += "<h2>Topology and traffic</h2>\n<div class=\"side\"><div>\n";
  topology_section(out, report);
  out += "</div><div>\n";
  links_table(out, report);
  out += "</div></div>\n";
  collectives_section(out, report);
  ranks_section(out, report);
  checks_section(out, report);
  out += html_page_end();
  return out;
}

}  // namespace ranklab
