// The scripts and styles of the HTML pages (report.html, compare.html, plan.html). They live as files in
// common/assets/ and are embedded at build time (cmake/embed_assets.cmake, which names each after its
// file), so each page is still one file that fetches nothing.
#pragma once

#include <string_view>

namespace ranklab::assets {

// Every page: the stylesheet, whose colour variables the scripts read too; and the first script, which
// lists script errors in #errors and holds the helpers the other scripts share (ranklab.colour, .canvas,
// .tip).
extern const std::string_view page_css;
extern const std::string_view page_js;
// report.html: the traced ranks' timeline, and every rank's heat strip.
extern const std::string_view timeline_js;
extern const std::string_view strip_js;
// compare.html: B against A, one point per item.
extern const std::string_view compare_js;

}  // namespace ranklab::assets
