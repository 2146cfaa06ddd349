// profiler.hpp — the hooks the model and its kernels call to say what they compute: FLOPs
// counted where the matrix products run (gemm, the attention kernels), attributed to the
// module in scope (embedding, each block's attention and MLP, ln_f, LM head) and its pass
// (forward, backward, recompute), with the module's wall time; the same scopes become named
// regions of the trace (the recorder below; observe/trace.hpp writes it). Off (the default),
// every hook is one predictable branch. The bottom layer holds them because the kernels call
// them; the reports they feed live in observe/.
//
// Modules have global ids: 0 embedding, 1 + 2b block b's attention, 2 + 2b its MLP,
// 2L + 1 ln_f, 2L + 2 the LM head. MACs follow DeepSpeed's profiler (a linear layer
// counts input rows × in × out MACs, no bias; FLOPs = 2 · MACs); attention counts its two
// products densely (B·T·T·C MACs each), as the FLOPs formula of Megatron and DeepSpeed does.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zero3d::obs {

enum class Pass : int { Forward = 0, Backward = 1, Recompute = 2 };
constexpr int kPasses = 3;

inline int embedding_module() { return 0; }
inline int attention_module(int block) { return 1 + 2 * block; }
inline int mlp_module(int block) { return 2 + 2 * block; }
inline int ln_f_module(int n_layer) { return 2 * n_layer + 1; }
inline int lm_head_module(int n_layer) { return 2 * n_layer + 2; }
inline int num_modules(int n_layer) { return 2 * n_layer + 3; }
// "embedding", "block3/attention", "block3/mlp", "ln_f", "lm_head"
std::string module_name(int module, int n_layer);

// What is being recorded now; the engine switches it at step boundaries.
struct Hooks {
  bool flops = false;  // the flops profiler's step
  bool trace = false;  // a traced step
  bool any() const { return flops || trace; }
  // Waits for the device (set by a GPU build's start-up): a region's boundaries take it before
  // reading the clock, so a module's time counts the kernels it queued, not their launches, as
  // DeepSpeed's profiler synchronises CUDA. Null on the CPU, where work is done when it returns.
  void (*device_fence)() = nullptr;
  std::chrono::steady_clock::time_point now() const {
    if (device_fence) device_fence();
    return std::chrono::steady_clock::now();
  }
};
extern Hooks g_hooks;

// Per module and pass: MACs and wall milliseconds (flops profiler).
struct ModuleCounts {
  double macs[kPasses] = {0, 0, 0};
  double ms[kPasses] = {0, 0, 0};
};
struct Counters {
  int module = -1;  // in scope now; -1 = outside every module (not counted)
  Pass pass = Pass::Forward;
  std::vector<ModuleCounts> modules;  // indexed by global module id
  double unattributed_macs = 0.0;     // products outside any module scope (none in the model)
  int n_layer = 0;
  void reset(int layers) {
    n_layer = layers;
    modules.assign(static_cast<size_t>(num_modules(layers)), ModuleCounts{});
    unattributed_macs = 0.0;
  }
};
extern Counters g_counters;

// The timeline of a traced step: named regions as begin/end pairs. Regions nest (every one
// is a scope), so each begin has its end. observe/trace.hpp writes it as Chrome trace events.
struct TraceEvent {
  std::string name;
  double begin_us = 0.0, end_us = 0.0;  // since the trace origin
  int depth = 0;                        // nesting level when it began
};

class TraceRecorder {
 public:
  // Common origin of every rank's clock: taken by all ranks right after a barrier.
  void set_origin(std::chrono::steady_clock::time_point t) { origin_ = t; }
  // A region opened: returns its slot; close() fills its end.
  size_t open(std::string name, std::chrono::steady_clock::time_point t0);
  void close(size_t slot, std::chrono::steady_clock::time_point t1);
  const std::vector<TraceEvent>& events() const { return events_; }
  int open_regions() const { return depth_; }

 private:
  double us(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  }
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
  std::vector<TraceEvent> events_;
  int depth_ = 0;
};
extern TraceRecorder g_trace;

// A named region of a traced step (nothing when the step is not traced).
class TraceScope {
 public:
  explicit TraceScope(const char* name) {
    if (g_hooks.trace) start(name);
  }
  explicit TraceScope(const std::string& name) {
    if (g_hooks.trace) start(name);
  }
  ~TraceScope() {
    if (active_) g_trace.close(slot_, g_hooks.now());
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  void start(std::string name) {
    slot_ = g_trace.open(std::move(name), g_hooks.now());
    active_ = true;
  }
  size_t slot_ = 0;
  bool active_ = false;
};

namespace detail {
void add_macs(double macs);
// Returns the trace slot of the region (when the step is traced).
size_t begin_region(int module, Pass pass, std::chrono::steady_clock::time_point t0);
void end_region(int module, Pass pass, std::chrono::steady_clock::time_point t0, size_t slot);
}  // namespace detail

// A product of M·N·K multiply-accumulates ran.
inline void add_macs(double macs) {
  if (g_hooks.flops) detail::add_macs(macs);
}

// The module in scope until destruction (or next()); times it and names its trace region.
class Region {
 public:
  explicit Region(int module) {
    if (g_hooks.any()) start(module);
  }
  ~Region() { stop(); }
  // The same scope moves on to the next module (attention → MLP within a block).
  void next(int module) {
    stop();
    if (g_hooks.any()) start(module);
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  void start(int module) {
    outer_ = g_counters.module;
    module_ = module;
    pass_ = g_counters.pass;
    g_counters.module = module;
    t0_ = g_hooks.now();
    slot_ = detail::begin_region(module, pass_, t0_);
  }
  void stop() {
    if (module_ < 0) return;
    detail::end_region(module_, pass_, t0_, slot_);
    g_counters.module = outer_;
    module_ = -1;
  }
  int module_ = -1, outer_ = -1;
  size_t slot_ = 0;
  Pass pass_ = Pass::Forward;
  std::chrono::steady_clock::time_point t0_;
};

// The pass in force until destruction or end(): forward, backward, or a backward's recompute.
class PassScope {
 public:
  explicit PassScope(Pass p) : outer_(g_counters.pass) { g_counters.pass = p; }
  ~PassScope() { end(); }
  void end() {
    if (active_) g_counters.pass = outer_, active_ = false;
  }
  PassScope(const PassScope&) = delete;
  PassScope& operator=(const PassScope&) = delete;

 private:
  Pass outer_;
  bool active_ = true;
};

}  // namespace zero3d::obs
