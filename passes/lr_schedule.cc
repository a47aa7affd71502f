#include "passes/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

namespace kiln::passes {
namespace {

double number(const ir::AttrDict& d, const char* key, double dflt) {
  auto it = d.find(key);
  return it != d.end() && it->second.isNumber() ? it->second.asDouble() : dflt;
}

std::string kindOf(const ir::AttrDict& d) {
  auto it = d.find("kind");
  return it != d.end() && it->second.isString() ? it->second.asString() : "constant";
}

double warmup(const ir::AttrDict& d, int64_t step) {
  double w = number(d, "warmup_steps", 0);
  return w > 0 && static_cast<double>(step) <= w ? static_cast<double>(step) / w : 1.0;
}

}  // namespace

Status checkLrSchedule(const ir::AttrDict& schedule) {
  auto kind_it = schedule.find("kind");
  if (kind_it != schedule.end() && !kind_it->second.isString())
    return Status::error("lr_schedule: 'kind' must be a string");
  std::string kind = kindOf(schedule);
  std::set<std::string> allowed;
  if (kind == "constant") {
    allowed = {"kind"};
  } else if (kind == "warmup_decay") {
    allowed = {"kind", "warmup_steps", "decay_start", "decay_steps", "end_factor", "power"};
  } else if (kind == "exponential") {
    allowed = {"kind", "decay_rate", "decay_steps", "staircase", "warmup_steps"};
    if (!schedule.count("decay_rate")) return Status::error("lr_schedule 'exponential' needs 'decay_rate'");
    if (!schedule.count("decay_steps")) return Status::error("lr_schedule 'exponential' needs 'decay_steps'");
  } else {
    return Status::errorf("unknown lr_schedule kind '{}'; expected constant, warmup_decay or exponential", kind);
  }
  for (const auto& [key, value] : schedule) {
    if (!allowed.count(key)) return Status::errorf("lr_schedule '{}' has no field '{}'", kind, key);
    if (key == "kind") continue;
    if (key == "staircase") {
      if (!value.isBool()) return Status::error("lr_schedule: 'staircase' must be true or false");
      continue;
    }
    if (!value.isNumber()) return Status::errorf("lr_schedule: '{}' must be a number, got {}", key, value.str());
    double v = value.asDouble();
    if (!std::isfinite(v) || v < 0) return Status::errorf("lr_schedule: '{}' must be >= 0, got {}", key, value.str());
  }
  if (kind == "exponential") {
    if (number(schedule, "decay_steps", 0) <= 0) return Status::error("lr_schedule: 'decay_steps' must be > 0");
    if (number(schedule, "decay_rate", 0) <= 0) return Status::error("lr_schedule: 'decay_rate' must be > 0");
  }
  if (kind == "warmup_decay") {
    double w = number(schedule, "warmup_steps", 0), s = number(schedule, "decay_start", w);
    if (s < w)
      return Status::errorf("lr_schedule: 'decay_start' ({}) is before the end of warmup ({})", s, w);
    if (number(schedule, "end_factor", 0) > 1) return Status::error("lr_schedule: 'end_factor' must be <= 1");
  }
  return Status::ok();
}

double learningRateFactor(const ir::AttrDict& schedule, int64_t step) {
  std::string kind = kindOf(schedule);
  if (kind == "warmup_decay") {
    double w = number(schedule, "warmup_steps", 0);
    if (w > 0 && static_cast<double>(step) <= w) return static_cast<double>(step) / w;
    double start = number(schedule, "decay_start", w), steps = number(schedule, "decay_steps", 0);
    if (steps <= 0 || static_cast<double>(step) <= start) return 1.0;
    double end = number(schedule, "end_factor", 0), power = number(schedule, "power", 1);
    double done = std::min(static_cast<double>(step) - start, steps) / steps;
    return end + (1 - end) * std::pow(1 - done, power);
  }
  if (kind == "exponential") {
    double w = number(schedule, "warmup_steps", 0);
    if (w > 0 && static_cast<double>(step) <= w) return warmup(schedule, step);
    // Counted from 0 at the first step after warmup, so the first step runs at the base rate.
    double e = (static_cast<double>(step) - w - 1) / number(schedule, "decay_steps", 1);
    auto it = schedule.find("staircase");
    if (it != schedule.end() && it->second.isBool() && it->second.asBool()) e = std::floor(e);
    return std::pow(number(schedule, "decay_rate", 1), e);
  }
  return 1.0;
}

}  // namespace kiln::passes
