// pld.hpp — progressive layer drop (DeepSpeed's `progressive_layer_drop`; Zhang & He 2020,
// "Accelerating Training of Transformer-Based Language Models with Progressive Layer Dropping").
// The schedule θ(t) (DEEPSPEED-FACTS-2 §7.2) and the per-block drop decisions: pure functions
// of (seed, step, micro-batch, block), so every rank of every layout decides alike without
// communication and a resumed run decides as the uninterrupted one did.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace zero3d {

// `progressive_layer_drop`: DeepSpeed's runtime/constants.py defaults (PLD_THETA_DEFAULT 1.0,
// PLD_GAMMA_DEFAULT 0.001; the ProgressiveLayerDrop class's own defaults are 0.5/0.001).
struct PldConfig {
  bool enabled = false;
  double theta = 1.0;   // θ̄: the keep probability θ(t) decays to
  double gamma = 0.001;  // how fast it decays
};

// DeepSpeed's ProgressiveLayerDrop.update_state(global_step): θ(t) = (1−θ̄)·exp(−γ·t) + θ̄
// (runtime/progressive_layer_drop.py), computed as DeepSpeed computes it.
double pld_theta(const PldConfig& pld, int64_t t);
// θ in force while the forwards of optimizer step `steps_done` + 1 run: DeepSpeed starts at
// 1.0 and updates in step() with the pre-increment global step, so step s (0-based) uses θ(s−1).
double pld_theta_in_step(const PldConfig& pld, int64_t steps_done);
// Block l's (0-based, of L) keep probability under θ: DeepSpeedExamples' BertEncoder
// (training/bing_bert/nvidia/modelingpreln_layerdrop.py) draws layer i with p = 1 − i·(1−θ)/L,
// so the first block always runs and the last keeps 1 − (L−1)(1−θ)/L (the paper's
// p_l = 1 − (l/L)(1−θ̄) with l counted from 0).
double pld_keep_probability(double theta, int64_t l, int64_t L);
// Whether block l runs in micro-batch `micro` of step `steps_done` + 1: one uniform draw of
// zero3d's counter RNG keyed by (seed, step, micro-batch, block) below the keep probability.
// The stream id is FNV-1a of "pld/<step>/<micro>/<block>" (tests/golden/make_pld_goldens.py
// reimplements it).
bool pld_keeps(uint64_t seed, int64_t steps_done, int64_t micro, int64_t l, double keep_probability);

// Per global block of one micro-batch: 0 where the block is dropped (the identity in forward,
// nothing in backward), else the factor 1/p its two residual branches are scaled by.
// DeepSpeedExamples' BertLayer drops the whole block (attention and MLP together) and scales
// each kept branch's output by 1/keep_prob before its residual add; it passes the *next*
// layer's p there (its loop decrements p before the call, so the last layer would divide by
// 1 − (1−θ) = θ, by zero at θ = 0). zero3d scales by the p the block was drawn with, the
// paper's expectation-preserving 1/p: E[x + keep·f(x)/p] = x + f(x), which evaluation runs.
// out = in + s·(out − in) over n floats: a residual branch already added to `in`, scaled by s
// (model_pld.cpp, a kernel over the default execution space).
void scale_residual_branch(float* out, const float* in, float s, int64_t n);

std::vector<float> pld_block_scales(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t micro,
                                    int64_t n_layer);

// metrics.jsonl "pld" of step `steps_done` + 1: θ in force, each block's keep probability, and
// the blocks run over the step's `gas` micro-batches (the same on every rank: no communication).
nlohmann::json pld_metrics(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t gas, int64_t n_layer);
// Blocks run over blocks scheduled in the step's gas micro-batches: the share of the blocks'
// FLOPs the step did (MFU counts only those).
double pld_blocks_run_fraction(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t gas, int64_t n_layer);
// The start-up line: the schedule and what it does to the blocks.
std::string pld_describe(const PldConfig& pld, int64_t n_layer);

}  // namespace zero3d
