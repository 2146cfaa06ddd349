// config/pld.cpp — the `progressive_layer_drop` section (DEEPSPEED-FACTS-2 §7.2; DeepSpeed's
// runtime/config.py get_pld_params with runtime/constants.py's PLD_* defaults).
#include "config/section.hpp"

namespace zero3d::config_detail {

PldConfig read_progressive_layer_drop(Section& top, const Config& c) {
  PldConfig p;
  Section sec = top.child("progressive_layer_drop");
  p.enabled = sec.boolean("enabled", p.enabled);
  // θ̄ is the keep probability the schedule decays to; γ its decay rate (θ(t) = (1−θ̄)e^(−γt) + θ̄).
  p.theta = sec.number("theta", p.theta, 0.0, 1.0);
  p.gamma = sec.number("gamma", p.gamma, 0.0, std::numeric_limits<double>::infinity());
  sec.finish();
  if (p.enabled) sec.note("pld     " + pld_describe(p, c.model.n_layer));  // validate's and train's start-up lines
  // Every block's skip is decided alike on every rank (pld.hpp), so no layout needs rejecting;
  // with one block there is nothing to drop (the first block always runs), which is worth saying.
  if (p.enabled && c.model.n_layer == 1)
    sec.note("note    `progressive_layer_drop.enabled` = true with model.n_layer 1: the first block always runs, "
             "so no block is ever dropped");
  return p;
}

}  // namespace zero3d::config_detail
