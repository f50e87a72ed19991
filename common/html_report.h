// report.html: the run as one self-contained page that fetches nothing (no external scripts, fonts or
// styles), so it can be mailed, archived or opened on a laptop with no network. It shows the run's
// configuration, the topology with each link coloured by its traffic, a per-rank timeline (a canvas with
// zoom and pan, legible at thousands of spans per rank), the collectives, time and memory per rank, the
// checks and the lesson's output.
//
// The page's script marks what it drew for tests: the timeline element gets data-rows (one row per rank)
// and the element #errors lists any script error (data-count).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/report.h"

namespace ranklab {

std::string report_to_html(const RunReport& report);

// Where the topology drawing puts each node of a report's topology: rows by level, top to bottom; the
// GPUs' row evenly spaced in the order the backend listed them, a gap between servers; every other node
// above or below its neighbours. Nothing is read from the nodes' names.
struct TopologyLayout {
  std::vector<double> x, y;  // per node of RunTopology::nodes: the centre of its box
  double width = 0, height = 0;
  double box_w = 0, box_h = 0;
  bool labels = false;  // whether the nodes are few enough to be named in their boxes
};
TopologyLayout layout_topology(const RunTopology& topology);

// ---- pieces compare.html shares ------------------------------------------------------------------------

// Text made safe for HTML element content and attribute values.
std::string html_escape(std::string_view text);
// JSON made safe inside <script type="application/json">: no '<' can end the element early.
std::string script_json(std::string_view json);
// A JSON string literal of `text` (bytes that are not UTF-8 replaced).
std::string json_string(const std::string& text);
// A time or count for embedded data: at most three decimals (a nanosecond, in microseconds), no trailing
// zeros, and 0 for what JSON cannot hold.
std::string json_number(double v);
// From <!doctype> to the opening of <main>: the stylesheet and the script that lists script errors.
std::string html_page_start(const std::string& title);
std::string html_page_end();

}  // namespace ranklab
