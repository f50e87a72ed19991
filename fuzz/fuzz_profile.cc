// A profile's TOML: any text must load or raise ProfileError, never crash, hang or raise anything else.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    ranklab::parse_profile(std::string(reinterpret_cast<const char*>(data), size), "fuzz.toml");
  } catch (const ranklab::Error&) {
    // the answer to bad input
  }
  return 0;
}
