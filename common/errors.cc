#include "common/errors.h"

#include <cxxabi.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <typeinfo>

namespace ranklab {

namespace {

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                                &std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

}  // namespace

std::exception_ptr current_error_of_rank(int rank) {
  try {
    throw;
  } catch (const Error&) {
    return std::current_exception();
  } catch (const std::exception& e) {
    // Not one of ranklab's own: the message alone would not say where it came from.
    return std::make_exception_ptr(
        ProgramError(fmt::format("rank {} threw {}: {}", rank, demangle(typeid(e).name()), e.what())));
  } catch (...) {
    const std::type_info* type = abi::__cxa_current_exception_type();
    return std::make_exception_ptr(
        ProgramError(fmt::format("rank {} threw a value of type {}, which is not a std::exception", rank,
                                 type ? demangle(type->name()) : std::string("unknown"))));
  }
}

}  // namespace ranklab
