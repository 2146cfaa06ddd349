// estimator.cpp
#include "estimator.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "base.hpp"
#include "attention.hpp"
#include "h5.hpp"
#include "model.hpp"
#include "zero.hpp"

namespace zero3d {

namespace {
constexpr double kGiB = 1073741824.0;  // DeepSpeed prints GB = bytes / 2^30
// Fixed resident memory of a zero3d rank before any model: MPI, Kokkos, HDF5, OpenBLAS
// buffers and the executable, measured as the peak RSS of a 28k-parameter run (np 2).
constexpr int64_t kRuntimeBytes = 30 * 1000 * 1000;

std::string plural(int n, const char* word) { return std::to_string(n) + " " + word + (n > 1 ? "s" : ""); }
}  // namespace

std::vector<DeepSpeedEstimateRow> deepspeed_zero2_rows(double P, int g, int n, double f) {
  const double total_gpus = double(g) * n;
  std::vector<DeepSpeedEstimateRow> rows;
  // offload_optimizer=cpu: gpu = 2P, cpu = P·max(4·total_gpus, 16)·f (DeepSpeed uses total_gpus)
  rows.push_back({double(int64_t(P * std::max(4.0 * total_gpus, 16.0) * f)), double(int64_t(2 * P)), "offload_optimizer=cpu "});
  // none: gpu = 2P + int(18P/total_gpus) (DeepSpeed since Jun-2024; its docs print the older 4P + 16P/N)
  rows.push_back({double(int64_t(P * 4 * g * f)), double(int64_t(2 * P + int64_t(18 * P / total_gpus))),
                  "offload_optimizer=none"});
  return rows;
}

std::vector<DeepSpeedEstimateRow> deepspeed_zero3_rows(double P, double L, int g, int n, double f) {
  const double total_gpus = double(g) * n, gf = 1.0 / n, llm = 4 * L;
  auto opts = [](bool opt, bool param, bool zero_init) {
    return std::string("offload_param=") + (param ? "cpu " : "none") + ", offload_optimizer=" + (opt ? "cpu " : "none") +
           ", zero_init=" + (zero_init ? "1" : "0");
  };
  auto i64 = [](double x) { return double(int64_t(x)); };
  std::vector<DeepSpeedEstimateRow> rows;
  rows.push_back({i64(P * 18 * gf * f), i64(llm), opts(true, true, true)});
  rows.push_back({i64(P * std::max(4.0 * g, 18 * gf) * f), i64(llm), opts(true, true, false)});
  const double gpu_opt = llm + int64_t(2 * P / total_gpus);
  rows.push_back({i64(P * 16 * gf * f), i64(gpu_opt), opts(true, false, true)});
  rows.push_back({i64(P * std::max(4.0 * g, 16 * gf) * f), i64(gpu_opt), opts(true, false, false)});
  const double gpu_none = llm + int64_t(18 * P / total_gpus);
  rows.push_back({i64(L * 4 * g * f), i64(gpu_none), opts(false, false, true)});
  rows.push_back({i64(P * 4 * g * f), i64(gpu_none), opts(false, false, false)});
  return rows;
}

std::string deepspeed_table(const std::vector<DeepSpeedEstimateRow>& rows, double P, double L, int g, int n) {
  char line[256];
  std::string out = "Estimated memory needed for params, optim states and gradients for a:\n";
  out += "HW: Setup with " + plural(n, "node") + ", " + plural(g, "GPU") + " per node.\n";
  std::snprintf(line, sizeof(line), "SW: Model with %lldM total params", (long long)int64_t(P / 1e6));
  out += line;
  if (L >= 0) {
    std::snprintf(line, sizeof(line), ", %lldM largest layer params", (long long)int64_t(L / 1e6));
    out += line;
  }
  out += ".\n  per CPU  |  per GPU |   Options\n";
  for (const auto& r : rows) {
    std::snprintf(line, sizeof(line), " %7.2fGB | %6.2fGB | %s\n", r.cpu_bytes / kGiB, r.gpu_bytes / kGiB, r.options.c_str());
    out += line;
  }
  return out;
}

ModelCounts count_model(const ModelConfig& m) {
  const ParamLayout layout = gpt_layout(GPTShape{m.vocab_size, m.n_positions, m.n_layer, m.n_head, m.n_embd});
  ModelCounts c;
  c.params = layout.total();  // wte counted once: the LM head shares it
  // A "layer" is a module's own parameters: weight and bias together (DeepSpeed's L).
  std::map<std::string, int64_t> modules;
  for (const TensorSpec& t : layout.tensors()) modules[t.name.substr(0, t.name.find_last_of('.'))] += t.numel;
  for (const auto& [name, n] : modules)
    if (n > c.largest_layer) c.largest_layer = n, c.largest_layer_name = name;
  return c;
}

nlohmann::json MemoryBudget::to_json() const {
  return {{"stage", stage},
          {"micro_batch", micro_batch},
          {"params", params},
          {"grads", grads},
          {"master", master},
          {"optimizer_states", optimizer_states},
          {"comm_reduce", comm_reduce},
          {"comm_gather", comm_gather},
          {"comm_prefetch", comm_prefetch},
          {"live_params", live_params},
          {"activations", activations},
          {"activations_checkpointed", activations_checkpointed},
          {"workspace", workspace},
          {"runtime", runtime},
          {"model_states", model_states()},
          {"total", total()}};
}

MemoryBudget estimate_budget(const Config& cfg, int64_t world, int stage) {
  const ModelConfig& m = cfg.model;
  const GPTShape shape{m.vocab_size, m.n_positions, m.n_layer, m.n_head, m.n_embd};
  const ParamLayout layout = gpt_layout(shape);
  const std::vector<ParamUnit> units = gpt_units(layout, m.n_layer);
  const int64_t psi = layout.total();
  const Partition part(psi, static_cast<int>(world));
  MemoryBudget b;
  b.stage = stage < 0 ? static_cast<int>(cfg.zero.stage) : stage;
  b.micro_batch = cfg.batch.micro_batch;
  // Model states: what ZeroOptimizer allocates (zero.hpp's table) in the configured dtypes.
  const PrecisionConfig& pc = cfg.precision;
  const int64_t ps = static_cast<int64_t>(dtype_size(pc.param)), gs = static_cast<int64_t>(dtype_size(pc.grad_accum)),
                cs = static_cast<int64_t>(dtype_size(pc.comm));
  const bool mixed = pc.param != DType::F32;
  const int64_t full = b.stage == 0 ? psi : part.padded;
  b.params = ps * (b.stage == 3 ? part.part : full);
  b.grads = gs * (b.stage >= 2 ? part.part : full);
  const int64_t state_elems = b.stage == 0 ? psi : part.part;
  b.master = mixed ? 4 * state_elems : 0;  // fp32 parameters are their own master copy
  const int moments = cfg.optimizer.type == OptimizerType::SGD ? (cfg.optimizer.momentum != 0.0 ? 1 : 0) : 2;
  b.optimizer_states = 4 * moments * state_elems;
  // Communication: reduce-scatter staging (rank 0's part of the buckets in flight, in the
  // communication dtype), send buffers for buckets converted to that dtype, and the fp32
  // gradient windows (embeddings, ln_f, one block; two with overlap_comm) that stages 2-3 and
  // 16-bit gradients use. Parameter all-gathers are in place (stages 1-2) or land in the
  // gathered units (stage 3).
  int64_t largest_block = 0, largest_unit = 0, largest_tensor = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    largest_unit = std::max(largest_unit, units[u].numel);
    if (u > 0 && u + 1 < units.size()) largest_block = std::max(largest_block, units[u].numel);
  }
  for (const TensorSpec& t : layout.tensors()) largest_tensor = std::max(largest_tensor, t.numel);
  const bool overlap = cfg.zero.overlap_comm;
  if (b.stage >= 1) b.comm_reduce = cs * (overlap ? part.part : std::min(cfg.zero.reduce_bucket_size, part.part));
  const bool windows = b.stage >= 2 || pc.grad_accum != DType::F32;
  if (windows) b.comm_reduce += 4 * (units.front().numel + units.back().numel + largest_block * (overlap ? 2 : 1));
  const DType source = b.stage >= 2 ? DType::F32 : pc.grad_accum;  // what the buckets are cut from
  if (source != pc.comm) {
    const int64_t one_call = b.stage >= 2 ? largest_unit : psi;  // what one reduction covers
    const int64_t in_flight =
        overlap ? (b.stage >= 2 ? 2 * largest_unit : psi) : std::min(cfg.zero.reduce_bucket_size, one_call);
    b.comm_reduce += cs * in_flight;
  }
  if (b.stage == 3) {
    // Gathered units: everything, when units are kept for reuse within the step (DeepSpeed's
    // defaults), else at most max_live_parameters plus the unit being fetched.
    const bool keep_all = cfg.zero.max_reuse_distance >= 2 * psi && cfg.zero.max_live_parameters >= psi;
    b.live_params = ps * (keep_all ? psi : std::min(psi, cfg.zero.max_live_parameters + largest_unit));
    b.comm_prefetch = 0;  // prefetched units are inside live_params
  }
  // Activations: the GPT's buffers for one micro-batch (model.cpp allocates exactly these).
  const int64_t B = cfg.batch.micro_batch, T = m.n_positions, C = m.n_embd, L = m.n_layer, V = m.vocab_size,
                H = m.n_head, BT = B * T;
  const int64_t per_block = 16 * BT * C + 4 * BT + B * H * T * T;
  const int64_t head = BT * C + 2 * BT + BT * V + 2 * BT;
  const int64_t scratch = 10 * BT * C + kernels::kRowBlock * T;
  b.activations = 4 * (BT * C + L * per_block + head + scratch);
  // With every block checkpointed: block inputs kept, one block's internals recomputed at a time.
  b.activations_checkpointed = 4 * (BT * C + L * BT * C + per_block + head + scratch);
  // Workspace: token ids, the start-up product that measures peak GFLOP/s, initial weights
  // read whole by init_from, data held in memory (text bytes and token shards as int32).
  b.workspace = 2 * 4 * BT + 3 * 512 * 512 * 4;
  // 16-bit runs: operand conversions of the matrix products (gemm.cpp) and the tensor groups
  // that fill the 16-bit copy at start-up (stages 1-2). (oneDNN's own code and caches measured
  // within ±5 MB of nothing: kRuntimeBytes covers them.)
  if (pc.param == DType::BF16) b.workspace += 2 * std::max(4 * BT * C, BT * V) + 2 * 4 * BT * C;
  if (pc.param == DType::F16) b.workspace += 4 * std::max(V * C, 4 * C * C);
  if (mixed && (b.stage == 1 || b.stage == 2)) b.workspace += 4 * std::min(psi, ZeroOptimizer::kInitFillElems + largest_tensor);
  if (!m.init_from.empty()) b.workspace += 4 * psi;
  struct stat st {};
  if (cfg.data.source == DataSource::Text && ::stat(cfg.data.path.c_str(), &st) == 0) b.workspace += 5 * st.st_size;
  if (cfg.data.source == DataSource::Tokens && ::stat(cfg.data.path.c_str(), &st) == 0) b.workspace += 3 * st.st_size;
  b.runtime = kRuntimeBytes;
  return b;
}

int64_t largest_fitting_micro_batch(const Config& cfg, int64_t world, int stage, int64_t bytes_per_rank) {
  Config c = cfg;
  auto fits = [&](int64_t micro) {
    c.batch.micro_batch = micro;
    return estimate_budget(c, world, stage).total() <= bytes_per_rank;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= (int64_t(1) << 24) && fits(hi)) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

void write_budget_report(const std::string& path, const Config& cfg, int64_t world,
                         const std::vector<MemoryBudget>& budgets) {
  h5::File f = h5::File::create(path);
  h5::write_attribute(f.id(), "config", cfg.resolved.dump());
  h5::write_attribute(f.id(), "config_file", cfg.file);
  h5::write_attribute(f.id(), "world_size", world);
  h5::write_attribute(f.id(), "micro_batch", cfg.batch.micro_batch);
  h5::write_attribute(f.id(), "param_dtype", dtype_name(cfg.precision.param));
  h5::write_attribute(f.id(), "grad_accum_dtype", dtype_name(cfg.precision.grad_accum));
  h5::write_attribute(f.id(), "communication_data_type", dtype_name(cfg.precision.comm));
  h5::write_attribute(f.id(), "parameters", count_model(cfg.model).params);
  h5::write_attribute(f.id(), "units", "bytes per rank; element k of each dataset is ZeRO stage k");
  const nlohmann::json first = budgets.front().to_json();
  for (auto it = first.begin(); it != first.end(); ++it) {
    if (it.key() == "stage") continue;
    std::vector<double> values;
    for (const auto& b : budgets) values.push_back(b.to_json()[it.key()].get<double>());
    const hsize_t n = values.size();
    h5::Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    h5::Handle ds(H5Dcreate2(f.id(), it.key().c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                  H5Dclose);
    std::vector<int64_t> ints(values.begin(), values.end());
    if (ds.get() < 0 || H5Dwrite(ds.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, ints.data()) < 0)
      throw SystemError(path + ": cannot write " + it.key());
  }
}

}  // namespace zero3d
