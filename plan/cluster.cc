#include "plan/cluster.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "common/report.h"

namespace ranklab::plan {

namespace {

using nlohmann::json;

json simulated_json(const Simulated& s) {
  return {{"stats", training_to_json(s.stats)},
          {"peak_bytes", s.peak_bytes},
          {"peak_stage", s.peak_stage},
          {"peak_part", s.peak_part},
          {"extrapolated_from", s.extrapolated_from}};
}

Simulated simulated_from(const json& j, const std::string& document) {
  Simulated s;
  s.stats = training_from_json(j.at("stats").get<std::string>(), document);
  s.peak_bytes = j.at("peak_bytes").get<std::int64_t>();
  s.peak_stage = j.at("peak_stage").get<int>();
  s.peak_part = j.at("peak_part").get<std::string>();
  s.extrapolated_from = j.at("extrapolated_from").get<std::int64_t>();
  return s;
}

const char* kind_name(Message::Kind k) {
  switch (k) {
    case Message::Kind::Task:
      return "task";
    case Message::Kind::Result:
      return "result";
    case Message::Kind::Error:
      return "error";
    case Message::Kind::Stop:
      return "stop";
  }
  return "?";
}

}  // namespace

std::string encode(const Message& m) {
  json j = {{"kind", kind_name(m.kind)}, {"id", m.id}};
  if (m.kind == Message::Kind::Task) {
    j["layout"] = m.layout;
    j["symmetry"] = m.symmetry;
    j["extrapolate"] = m.extrapolate;
    if (m.cutoff) j["cutoff"] = {{"us", m.cutoff->us}, {"name", m.cutoff->name}};
  } else if (m.kind == Message::Kind::Error) {
    j["error"] = m.error;
    j["host"] = m.host;
  } else if (m.kind == Message::Kind::Result) {
    const Result& r = *m.result;
    const Candidate& k = r.candidate;
    j["candidate"] = {{"name", k.name},
                      {"status", static_cast<int>(k.status)},
                      {"reason", k.reason},
                      {"bound_us", k.bound_us},
                      {"probed", k.probed},
                      {"planned_bytes", k.planned_bytes},
                      {"capacity_bytes", k.capacity_bytes}};
    if (r.run) j["run"] = simulated_json(*r.run);
    if (r.screening) j["screening"] = simulated_json(*r.screening);
    j["full"] = r.full;
    j["wall_s"] = r.wall_s;
  }
  // Invalid UTF-8 in a reason (a lesson's message) is replaced rather than refused.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Message decode(const std::string& text, int from) {
  const std::string document = fmt::format("plan message from rank {}", from);
  try {
    const json j = json::parse(text);
    Message m;
    const std::string kind = j.at("kind").get<std::string>();
    m.id = j.at("id").get<std::size_t>();
    if (kind == "task") {
      m.kind = Message::Kind::Task;
      m.layout = j.at("layout").get<std::string>();
      m.symmetry = j.at("symmetry").get<bool>();
      m.extrapolate = j.at("extrapolate").get<bool>();
      if (j.contains("cutoff")) {
        const json& c = j.at("cutoff");
        m.cutoff = Cutoff{c.at("us").get<double>(), c.at("name").get<std::string>()};
      }
    } else if (kind == "error") {
      m.kind = Message::Kind::Error;
      m.error = j.at("error").get<std::string>();
      m.host = j.at("host").get<std::string>();
    } else if (kind == "result") {
      m.kind = Message::Kind::Result;
      Result r;
      const json& k = j.at("candidate");
      r.candidate.name = k.at("name").get<std::string>();
      r.candidate.layout = parse_layout(r.candidate.name);
      r.candidate.status = static_cast<Status>(k.at("status").get<int>());
      r.candidate.reason = k.at("reason").get<std::string>();
      r.candidate.bound_us = k.at("bound_us").get<double>();
      r.candidate.probed = k.at("probed").get<bool>();
      r.candidate.planned_bytes = k.at("planned_bytes").get<std::int64_t>();
      r.candidate.capacity_bytes = k.at("capacity_bytes").get<std::int64_t>();
      if (j.contains("run")) r.run = simulated_from(j.at("run"), document);
      if (j.contains("screening")) r.screening = simulated_from(j.at("screening"), document);
      r.full = j.at("full").get<bool>();
      r.wall_s = j.at("wall_s").get<double>();
      m.result = std::move(r);
    } else if (kind == "stop") {
      m.kind = Message::Kind::Stop;
    } else {
      throw ProgramError(fmt::format("{}: unknown kind '{}'", document, kind));
    }
    return m;
  } catch (const json::exception& e) {
    throw ProgramError(fmt::format("{}: not a message of this build of ranklab: {}", document, e.what()));
  } catch (const UsageError& e) {
    throw ProgramError(fmt::format("{}: {}", document, e.what()));
  }
}

}  // namespace ranklab::plan
