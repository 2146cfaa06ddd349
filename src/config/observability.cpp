// config/observability.cpp — flops_profiler, csv_monitor, tensorboard, wandb, comet,
// comms_logger (DeepSpeed's keys and defaults: profiling/config.py, monitor/config.py,
// comm/config.py; DEEPSPEED-FACTS §9.2–9.3) and zero3d's trace section.
#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

MonitorConfig read_monitor(Section& top, const std::string& name) {
  Section sec = top.child(name);
  MonitorConfig m;
  m.enabled = sec.boolean("enabled", false);
  m.output_path = sec.path("output_path", "");
  m.job_name = sec.path("job_name", "DeepSpeedJobName");
  if (m.job_name.empty() || m.job_name.find('/') != std::string::npos || m.job_name == "." || m.job_name == "..")
    sec.fail_key("job_name", "must name one directory (no '/'), got " + show(json(m.job_name)));
  sec.finish();
  return m;
}

// wandb and comet report to a web service: zero3d contacts no network service, so an enabled
// section is refused by name rather than silently writing nothing.
void reject_network_monitor(Section& top, const std::string& name, const std::vector<std::string>& keys) {
  Section sec = top.child(name);
  const bool enabled = sec.boolean("enabled", false);
  for (const std::string& k : keys) sec.mark_known(k);
  sec.finish();
  if (enabled)
    top.fail_key(name, "the " + name + " monitor reports to a network service, which zero3d never contacts; set \"" +
                           name + ".enabled\": false and use csv_monitor or tensorboard (files under output_path)");
}

}  // namespace

ObservabilityConfig read_observability(Section& top) {
  ObservabilityConfig o;
  {
    Section sec = top.child("flops_profiler");
    FlopsProfilerConfig& f = o.flops_profiler;
    f.enabled = sec.boolean("enabled", false);
    sec.number("recompute_fwd_factor", 0.0, 0.0, 1e6);  // DeepSpeed's guess at recompute; zero3d counts it
    f.profile_step = sec.integer("profile_step", 1, 1, INT64_MAX);
    f.module_depth = static_cast<int>(sec.integer("module_depth", -1, -1, 1 << 20));
    f.top_modules = static_cast<int>(sec.integer("top_modules", 1, 1, 1 << 20));
    f.detailed = sec.boolean("detailed", true);
    const json* out = sec.raw("output_file");
    if (out && !out->is_null()) f.output_file = sec.path("output_file", "");
    else sec.record("output_file", nullptr);
    sec.finish();
  }
  o.csv_monitor = read_monitor(top, "csv_monitor");
  o.tensorboard = read_monitor(top, "tensorboard");
  reject_network_monitor(top, "wandb", {"team", "group", "project"});
  reject_network_monitor(top, "comet", {"samples_log_interval", "project", "workspace", "api_key", "experiment_name",
                                        "experiment_key", "online", "mode"});
  {
    Section sec = top.child("comms_logger");
    CommsLoggerConfig& c = o.comms_logger;
    c.enabled = sec.boolean("enabled", false);
    c.verbose = sec.boolean("verbose", false);
    c.prof_all = sec.boolean("prof_all", true);
    c.debug = sec.boolean("debug", false);
    const json* ops = sec.raw("prof_ops");
    if (ops) {
      if (!ops->is_array()) sec.fail_key("prof_ops", "expected a list of operation names, got " + show(*ops));
      for (const json& op : *ops) {
        if (!op.is_string()) sec.fail_key("prof_ops", "expected operation names (strings), got " + show(op));
        c.prof_ops.push_back(op.get<std::string>());
      }
    }
    sec.record("prof_ops", c.prof_ops);
    sec.finish();
  }
  {
    Section sec = top.child("trace");
    TraceConfig& t = o.trace;
    t.enabled = sec.boolean("enabled", false);
    const json* steps = sec.raw("steps");
    if (steps) {
      if (!steps->is_array() || steps->empty())
        sec.fail_key("steps", "expected a non-empty list of step numbers (1-based), got " + show(*steps));
      t.steps.clear();
      for (const json& s : *steps) {
        if (!s.is_number_integer() || s.get<int64_t>() < 1)
          sec.fail_key("steps", "expected step numbers >= 1, got " + show(s));
        t.steps.push_back(s.get<int64_t>());
      }
    }
    sec.record("steps", t.steps);
    sec.finish();
  }
  return o;
}

}  // namespace zero3d::config_detail
