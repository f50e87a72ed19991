// Measurements: nccl-tests logs, CSV and profiler traces. The first byte picks the reader (and, for
// traces, how many ranks' traces the rest is cut into, at NUL bytes); any text must load or raise a
// ranklab error, never crash or raise anything else.
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/measurements.h"
#include "common/text.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t selector = data[0];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (selector % 4) {
      case 0:
        ranklab::read_nccl_tests(text, "fuzz.log", std::nullopt);
        break;
      case 1:
        ranklab::read_measurement_csv(text, "fuzz.csv");
        break;
      case 2: {
        std::vector<std::pair<std::string, std::string>> traces;
        for (std::string& piece : ranklab::split_at(text, '\0'))
          traces.emplace_back("rank" + std::to_string(traces.size()) + ".json", std::move(piece));
        ranklab::read_kineto_traces(traces);
        break;
      }
      default:
        ranklab::detect_measurement_format(text, "fuzz.txt");
        break;
    }
  } catch (const ranklab::Error&) {
    // the answer to bad input
  }
  return 0;
}
