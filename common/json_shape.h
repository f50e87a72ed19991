// One description of a struct's JSON form, from which both the writer and the reader are made, so the two
// cannot drift apart. A struct is described by specialising Shape with its fields in the order they are
// written:
//
//   template <> struct json_shape::Shape<LinkTraffic> {
//     static constexpr auto fields = std::tuple{required("link", &LinkTraffic::link),
//                                               optional("bandwidth_gbps", &LinkTraffic::bandwidth_gbps)};
//   };
//
// A member is written and read by its type: bool, integers, double, std::string, std::vector, std::map with
// string keys, std::optional, another described struct, or a type with a Codec (an enum written by name).
// The reader checks every value's type, refuses integers that do not fit their member (never truncating
// them), requires the required fields, leaves an absent optional field at its default and ignores fields it
// does not know. An error names the document and the path of the bad value:
// "report JSON: ranks[3].peak_bytes: expected an integer, got a string ("x")".
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/errors.h"

namespace ranklab::json_shape {

// What the reader does when a field is absent: Required is an error, Optional keeps the member's default
// (for fields that documents written before the field existed lack).
enum class Need : std::uint8_t { Required, Optional };
// Whether the writer leaves a field out: Always writes it; WhenSet leaves out an empty vector or map and an
// empty std::optional.
enum class Write : std::uint8_t { Always, WhenSet };

template <class T, class M>
struct Field {
  const char* key;
  M T::*member;
  Need need;
  Write write;
};

template <class T, class M>
constexpr Field<T, M> required(const char* key, M T::*member) {
  return {key, member, Need::Required, Write::Always};
}

template <class T, class M>
constexpr Field<T, M> optional(const char* key, M T::*member, Write write = Write::Always) {
  return {key, member, Need::Optional, write};
}

// Specialise with `static constexpr auto fields = std::tuple{...};` (see the top of the file), once in the
// program: in the one source file that writes and reads the struct.
template <class T>
struct Shape {};

// Specialise for a type with a JSON form of its own: `static nlohmann::ordered_json write(const T&)` and
// `static void read(const nlohmann::json&, T&, const Path&)`.
template <class T>
struct Codec {};

// Where a value is in the document: built on the stack as the reader descends, and turned into text only
// when something is wrong, so reading millions of elements formats nothing.
class Path {
 public:
  explicit Path(std::string_view document) : document_(document) {}
  Path(const Path& parent, const char* key) : parent_(&parent), key_(key) {}
  Path(const Path& parent, std::string_view key) : parent_(&parent), key_(key), quoted_(true) {}
  Path(const Path& parent, std::size_t index) : parent_(&parent), index_(index), is_index_(true) {}

  // "ranks[3].peak_bytes"; "" for the document itself.
  std::string str() const {
    if (!parent_) return "";
    std::string out = parent_->str();
    if (is_index_) return out + fmt::format("[{}]", index_);
    if (!out.empty()) out += '.';
    // A map's key may hold anything; a field's key is a plain name.
    return out + (quoted_ && !plain(key_)
                      ? nlohmann::json(std::string(key_))
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                      : std::string(key_));
  }

  [[noreturn]] void fail(std::string_view what) const {
    const std::string where = str();
    throw UsageError(where.empty() ? fmt::format("{}: {}", document(), what)
                                   : fmt::format("{}: {}: {}", document(), where, what));
  }

 private:
  std::string_view document() const { return parent_ ? parent_->document() : document_; }
  static bool plain(std::string_view s) {
    if (s.empty()) return false;
    for (char c : s) {
      const bool ok =
          (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
      if (!ok) return false;
    }
    return true;
  }

  const Path* parent_ = nullptr;
  std::string_view document_;
  std::string_view key_;
  std::size_t index_ = 0;
  bool is_index_ = false;
  bool quoted_ = false;
};

// "a string (\"four\")", "2.5", "an object": what the reader found instead, for an error.
inline std::string describe(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return fmt::format("a boolean ({})", j.dump());
    case nlohmann::json::value_t::string: {
      std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      if (text.size() > 40) text = text.substr(0, 36) + "...\"";
      return fmt::format("a string ({})", text);
    }
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::object:
      return "an object";
    default:
      return j.dump();  // a number
  }
}

template <class T>
concept Described = requires {
  Shape<T>::fields;
};

template <class T>
concept HasCodec = requires(const T& v) {
  Codec<T>::write(v);
};

template <class T>
struct IsVector : std::false_type {};
template <class E, class A>
struct IsVector<std::vector<E, A>> : std::true_type {};

template <class T>
struct IsOptional : std::false_type {};
template <class E>
struct IsOptional<std::optional<E>> : std::true_type {};

template <class T>
struct IsStringMap : std::false_type {};
template <class V, class C, class A>
struct IsStringMap<std::map<std::string, V, C, A>> : std::true_type {};

// ---- writing ---------------------------------------------------------------------------------------------

template <class T>
nlohmann::ordered_json write(const T& value);

template <class T>
bool is_set(const T& value) {
  if constexpr (IsOptional<T>::value) {
    return value.has_value();
  } else if constexpr (IsVector<T>::value || IsStringMap<T>::value) {
    return !value.empty();
  } else {
    return true;
  }
}

template <class T>
void write_fields(const T& object, nlohmann::ordered_json& out) {
  std::apply(
      [&](const auto&... field) {
        auto one = [&](const auto& f) {
          const auto& member = object.*(f.member);
          if (f.write == Write::WhenSet && !is_set(member)) return;
          out[f.key] = write(member);
        };
        (one(field), ...);
      },
      Shape<T>::fields);
}

template <class T>
nlohmann::ordered_json write(const T& value) {
  using nlohmann::ordered_json;
  if constexpr (HasCodec<T>) {
    return Codec<T>::write(value);
  } else if constexpr (Described<T>) {
    ordered_json out = ordered_json::object();
    write_fields(value, out);
    return out;
  } else if constexpr (IsVector<T>::value) {
    ordered_json out = ordered_json::array();
    out.get_ref<ordered_json::array_t&>().reserve(value.size());
    for (const auto& e : value) out.push_back(write(e));
    return out;
  } else if constexpr (IsStringMap<T>::value) {
    ordered_json out = ordered_json::object();
    for (const auto& [k, v] : value) out[k] = write(v);
    return out;
  } else if constexpr (IsOptional<T>::value) {
    return value ? write(*value) : ordered_json(nullptr);
  } else {
    static_assert(std::is_arithmetic_v<T> || std::is_same_v<T, std::string>, "no JSON form for this type");
    return ordered_json(value);
  }
}

// The same text as write(object).dump(), appended to `out` member by member, and a vector member element by
// element: a report of millions of spans never stands as one document in memory. Text that is not UTF-8
// is replaced, as dump() with error_handler_t::replace does.
// `flush(out)` is called between elements once `out` holds a megabyte: a writer that streams empties it.
template <class T>
void append_fields(const T& object, std::string& out, const std::function<void(std::string&)>& flush = {}) {
  auto dump = [&out](const nlohmann::ordered_json& j) {
    out += j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  };
  std::apply(
      [&](const auto&... field) {
        auto one = [&](const auto& f) {
          const auto& member = object.*(f.member);
          if (f.write == Write::WhenSet && !is_set(member)) return;
          out += !out.empty() && out.back() == '{' ? "\"" : ",\"";
          out += f.key;
          out += "\":";
          if constexpr (IsVector<std::decay_t<decltype(member)>>::value) {
            out += '[';
            for (std::size_t i = 0; i < member.size(); ++i) {
              if (i > 0) out += ',';
              dump(write(member[i]));
              if (flush && out.size() >= (std::size_t{1} << 20)) flush(out);
            }
            out += ']';
          } else {
            dump(write(member));
          }
        };
        (one(field), ...);
      },
      Shape<T>::fields);
}

// ---- reading ---------------------------------------------------------------------------------------------

template <class T>
void read(const nlohmann::json& j, T& out, const Path& path);

template <class I>
void read_integer(const nlohmann::json& j, I& out, const Path& path) {
  // nlohmann would convert 4294967300 to an int as 4, and 2.5 as 2: only an integer in range is read.
  if (!j.is_number_integer()) path.fail(fmt::format("expected an integer, got {}", describe(j)));
  constexpr auto lo = std::numeric_limits<I>::min();
  constexpr auto hi = std::numeric_limits<I>::max();
  bool fits = false;
  if (j.is_number_unsigned()) {
    fits = j.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi);
  } else {
    const std::int64_t v = j.get<std::int64_t>();
    fits = std::is_signed_v<I>
               ? v >= static_cast<std::int64_t>(lo) &&
                     (hi >= std::numeric_limits<std::int64_t>::max() || v <= static_cast<std::int64_t>(hi))
               : v >= 0 && static_cast<std::uint64_t>(v) <= static_cast<std::uint64_t>(hi);
  }
  if (!fits) path.fail(fmt::format("expected an integer from {} to {}, got {}", lo, hi, j.dump()));
  out = j.get<I>();
}

template <class T>
void read_fields(const nlohmann::json& j, T& out, const Path& path) {
  if (!j.is_object()) path.fail(fmt::format("expected an object, got {}", describe(j)));
  std::apply(
      [&](const auto&... field) {
        auto one = [&](const auto& f) {
          const Path at(path, f.key);
          auto it = j.find(f.key);
          if (it == j.end()) {
            if (f.need == Need::Required) at.fail("required field is missing");
            return;
          }
          read(*it, out.*(f.member), at);
        };
        (one(field), ...);
      },
      Shape<T>::fields);
}

template <class T>
void read(const nlohmann::json& j, T& out, const Path& path) {
  if constexpr (HasCodec<T>) {
    Codec<T>::read(j, out, path);
  } else if constexpr (Described<T>) {
    read_fields(j, out, path);
  } else if constexpr (IsVector<T>::value) {
    if (!j.is_array()) path.fail(fmt::format("expected an array, got {}", describe(j)));
    out.clear();
    out.resize(j.size());
    for (std::size_t i = 0; i < j.size(); ++i) read(j[i], out[i], Path(path, i));
  } else if constexpr (IsStringMap<T>::value) {
    if (!j.is_object()) path.fail(fmt::format("expected an object, got {}", describe(j)));
    out.clear();
    for (auto it = j.begin(); it != j.end(); ++it) {
      typename T::mapped_type v{};
      read(it.value(), v, Path(path, std::string_view(it.key())));
      out.emplace(it.key(), std::move(v));
    }
  } else if constexpr (IsOptional<T>::value) {
    if (j.is_null()) {
      out.reset();
    } else {
      typename T::value_type v{};
      read(j, v, path);
      out = std::move(v);
    }
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) path.fail(fmt::format("expected true or false, got {}", describe(j)));
    out = j.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    read_integer(j, out, path);
  } else if constexpr (std::is_floating_point_v<T>) {
    // JSON has no NaN or infinity; nlohmann writes them as null.
    if (j.is_null()) {
      out = std::numeric_limits<T>::quiet_NaN();
    } else {
      if (!j.is_number()) path.fail(fmt::format("expected a number, got {}", describe(j)));
      out = j.get<T>();
    }
  } else {
    static_assert(std::is_same_v<T, std::string>, "no JSON form for this type");
    if (!j.is_string()) path.fail(fmt::format("expected a string, got {}", describe(j)));
    out = j.get_ref<const std::string&>();
  }
}

// A string that must be one of a fixed set of names; `name_of` is the writer's spelling of a value.
template <class E, std::size_t N>
void read_name(const nlohmann::json& j, E& out, const Path& path, const E (&values)[N],
               const char* (*name_of)(E)) {
  if (j.is_string()) {
    const std::string& text = j.get_ref<const std::string&>();
    for (E v : values) {
      if (text == name_of(v)) {
        out = v;
        return;
      }
    }
  }
  std::string names;
  for (std::size_t i = 0; i < N; ++i) names += fmt::format("{}\"{}\"", i ? ", " : "", name_of(values[i]));
  path.fail(fmt::format("expected one of {}, got {}", names, describe(j)));
}

}  // namespace ranklab::json_shape
