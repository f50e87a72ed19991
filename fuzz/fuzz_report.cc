// report.json: any text must load or raise UsageError, never crash or raise anything else. What loads
// must also summarise and write out again.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/report.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    ranklab::RunReport r = ranklab::report_from_json(std::string(reinterpret_cast<const char*>(data), size));
    ranklab::report_to_json(r);
  } catch (const ranklab::Error&) {
    // the answer to bad input
  }
  return 0;
}
