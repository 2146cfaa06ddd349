// flops_profiler.cpp — DeepSpeed's flops profiler report (profiling/flops_profiler/profiler.py
// print_model_profile; DEEPSPEED-FACTS §9.2) from the counts base/profiler.hpp's hooks gathered.
#include "observe/flops_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "base/profiler.hpp"

namespace zero3d::obs {

// ---- the report ------------------------------------------------------------------------

namespace {
// DeepSpeed number_to_string: round(x / magnitude, 2):g and the magnitude's letter.
// Python's round(x, 2) (exact binary value, ties to even: what printf's %.2f does).
double round2(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return std::strtod(buf, nullptr);
}
std::string number_to_string(double num, bool params = false) {
  double mag = 1.0;
  const char* unit = "";
  if (num >= 1e12) mag = 1e12, unit = "T";
  else if (num >= 1e9) mag = 1e9, unit = params ? "B" : "G";
  else if (num >= 1e6) mag = 1e6, unit = "M";
  else if (num >= 1e3) mag = 1e3, unit = "K";
  else if (num >= 1 || num == 0) mag = 1.0, unit = "";
  else if (num >= 1e-3) mag = 1e-3, unit = "m";
  else mag = 1e-6, unit = "u";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g %s", round2(num / mag), unit);
  return buf;
}
std::string macs_str(double x) { return number_to_string(x) + "MACs"; }
std::string flops_str(double x) { return number_to_string(x) + "FLOPS"; }
std::string params_str(double x) { return number_to_string(x, true); }
// DeepSpeed duration_to_string over seconds: s, ms or us.
std::string duration_str(double ms) {
  const double s = ms / 1e3;
  char buf[64];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%g s", round2(s));
  else if (s >= 1e-3 || s == 0) std::snprintf(buf, sizeof buf, "%g ms", round2(ms));
  else std::snprintf(buf, sizeof buf, "%g us", round2(ms * 1e3));
  return buf;
}
std::string pct(double part, double whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", whole > 0 ? round2(100.0 * part / whole) : 0.0);
  return buf;
}
std::string line(const std::string& label, const std::string& value) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-70s  %-8s\n", label.c_str(), value.c_str());
  return buf;
}
}  // namespace

std::string flops_profile_report(const FlopsReport& r) {
  const FlopsProfilerConfig& cfg = r.cfg;
  std::string out;
  out += "\n-------------------------- DeepSpeed Flops Profiler --------------------------\n";
  out += "Profile Summary at step " + std::to_string(r.step) + ":\n";
  out += "Notations:\n"
         "data parallel size (dp_size), model parallel size(mp_size),\n"
         "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
         "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
         "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
         "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n\n";
  const double fwd_flops = 2.0 * r.fwd_macs;
  out += line("world size: ", std::to_string(r.world_size));
  out += line("data parallel size: ", std::to_string(r.dp_size));
  out += line("model parallel size: ", std::to_string(r.mp_size));
  out += line("batch size per GPU: ", std::to_string(r.batch_per_gpu));
  out += line("params per GPU: ", params_str(static_cast<double>(r.params_per_gpu)));
  out += line("params of model = params per GPU * mp_size: ", params_str(static_cast<double>(r.params_of_model)));
  out += line("fwd MACs per GPU: ", macs_str(r.fwd_macs));
  out += line("fwd flops per GPU: ", number_to_string(fwd_flops));
  out += line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(2.0 * r.fwd_macs_of_model));
  out += line("fwd latency: ", duration_str(r.fwd_ms));
  out += line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
              flops_str(r.fwd_ms > 0 ? fwd_flops / (r.fwd_ms / 1e3) : 0.0));
  // zero3d counts the recompute it ran instead of DeepSpeed's recompute_fwd_factor guess.
  const double r_factor = r.fwd_macs > 0 ? r.recompute_macs / r.fwd_macs : 0.0;
  char factor[32];
  std::snprintf(factor, sizeof factor, "%g", std::round((2.0 + r_factor) * 100) / 100);
  if (r.wall_clock_breakdown) {
    out += line("bwd latency: ", duration_str(r.bwd_ms));
    out += line(std::string("bwd FLOPS per GPU = ") + factor + " * fwd flops per GPU / bwd latency: ",
                flops_str(r.bwd_ms > 0 ? 2.0 * (r.bwd_macs + r.recompute_macs) / (r.bwd_ms / 1e3) : 0.0));
    std::snprintf(factor, sizeof factor, "%g", std::round((3.0 + r_factor) * 100) / 100);
    out += line(std::string("fwd+bwd FLOPS per GPU = ") + factor + " * fwd flops per GPU / (fwd+bwd latency): ",
                flops_str(r.fwd_ms + r.bwd_ms > 0 ? r.hardware_flops / ((r.fwd_ms + r.bwd_ms) / 1e3) : 0.0));
    out += line("step latency: ", duration_str(r.step_ms));
  }
  std::snprintf(factor, sizeof factor, "%g", std::round((3.0 + r_factor) * 100) / 100);
  out += line("iter latency: ", duration_str(r.iter_ms));
  out += line(std::string("FLOPS per GPU = ") + factor + " * fwd flops per GPU / iter latency: ",
              flops_str(r.iter_ms > 0 ? r.hardware_flops / (r.iter_ms / 1e3) : 0.0));
  char sps[32];
  std::snprintf(sps, sizeof sps, "%.2f", r.samples_per_s);
  out += line("samples/second: ", sps);
  // Model FLOPs (what the model needs: 3 × forward) beside hardware FLOPs (what ran, with recompute).
  out += line("model flops per GPU (fwd + bwd, MFU numerator): ", number_to_string(r.model_flops));
  out += line("hardware flops per GPU (fwd + bwd + recompute, HFU numerator): ", number_to_string(r.hardware_flops));
  char mfu[64];
  std::snprintf(mfu, sizeof mfu, "%.2f%% / %.2f%%", 100.0 * r.mfu, 100.0 * r.hfu);
  out += line("MFU / HFU (all ranks' flops over their peak " + number_to_string(r.peak_flops_total) + "FLOPS): ", mfu);

  const std::vector<ProfiledModule>& m = r.modules;
  const double total_params = m.empty() ? 0 : static_cast<double>(m[0].params);
  const double total_macs = m.empty() ? 0 : m[0].macs;
  const double total_ms = m.empty() ? 0 : m[0].ms;
  int max_depth = 0;
  for (const ProfiledModule& p : m) max_depth = std::max(max_depth, p.depth);
  const int depth_limit = cfg.module_depth < 0 ? max_depth : std::min(cfg.module_depth, max_depth);

  out += "\n----------------------------- Aggregated Profile per GPU -----------------------------\n";
  out += "Top " + std::to_string(cfg.top_modules) +
         " modules in terms of params, MACs or fwd latency at different model depths:\n";
  for (int d = 0; d <= depth_limit; ++d) {
    // Modules of one depth and type are summed (DeepSpeed aggregates by class name).
    std::map<std::string, ProfiledModule> by_type;
    std::vector<std::string> order;
    for (const ProfiledModule& p : m) {
      if (p.depth != d) continue;
      if (!by_type.count(p.type)) order.push_back(p.type);
      ProfiledModule& a = by_type[p.type];
      a.params += p.params;
      a.macs += p.macs;
      a.ms += p.ms;
    }
    const auto top = [&](auto value, auto show) {
      std::vector<std::string> names = order;
      std::stable_sort(names.begin(), names.end(),
                       [&](const std::string& a, const std::string& b) { return value(by_type[a]) > value(by_type[b]); });
      std::string s = "{";
      for (size_t i = 0; i < names.size() && i < static_cast<size_t>(cfg.top_modules); ++i)
        s += (i ? ", '" : "'") + names[i] + "': '" + show(value(by_type[names[i]])) + "'";
      return s + "}";
    };
    out += "depth " + std::to_string(d) + ":\n";
    out += "    params      - " + top([](const ProfiledModule& p) { return double(p.params); }, params_str) + "\n";
    out += "    MACs        - " + top([](const ProfiledModule& p) { return p.macs; }, macs_str) + "\n";
    out += "    fwd latency - " + top([](const ProfiledModule& p) { return p.ms; }, duration_str) + "\n";
  }

  if (cfg.detailed) {
    out += "\n------------------------------ Detailed Profile per GPU ------------------------------\n";
    out += "Each module profile is listed after its name in the following order: \n"
           "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd "
           "latency, fwd FLOPS\n\n"
           "Note: MACs are counted where zero3d's matrix products run (the GEMM and attention kernels), so a parent's "
           "MACs are the sum of its submodules'; LayerNorms, GELU, softmax and the cross-entropy are not matrix "
           "products and count 0.\n\n";
    const auto repr = [&](const ProfiledModule& p) {
      return params_str(double(p.params)) + " = " + pct(double(p.params), total_params) + "% Params, " + macs_str(p.macs) +
             " = " + pct(p.macs, total_macs) + "% MACs, " + duration_str(p.ms) + " = " + pct(p.ms, total_ms) +
             "% latency, " + flops_str(p.ms > 0 ? 2.0 * p.macs / (p.ms / 1e3) : 0.0);
    };
    // The module tree in torch's repr layout, cut at module_depth.
    std::vector<int> depth_open;
    for (size_t i = 0; i < m.size(); ++i) {
      const ProfiledModule& p = m[i];
      if (p.depth > depth_limit) continue;
      while (!depth_open.empty() && depth_open.back() >= p.depth) {
        out += std::string(2 * static_cast<size_t>(depth_open.back()), ' ') + ")\n";
        depth_open.pop_back();
      }
      const std::string indent(2 * static_cast<size_t>(p.depth), ' ');
      const std::string head = p.depth == 0 ? p.type : "(" + p.name + "): " + p.type;
      const bool has_children = i + 1 < m.size() && m[i + 1].depth > p.depth && m[i + 1].depth <= depth_limit;
      if (has_children) {
        out += indent + head + "(\n" + indent + "  " + repr(p) + "\n";
        depth_open.push_back(p.depth);
      } else {
        out += indent + head + "(" + repr(p) + ")\n";
      }
    }
    while (!depth_open.empty()) {
      out += std::string(2 * static_cast<size_t>(depth_open.back()), ' ') + ")\n";
      depth_open.pop_back();
    }
  }
  out += "------------------------------------------------------------------------------\n";
  return out;
}

}  // namespace zero3d::obs
