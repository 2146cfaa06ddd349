// engine.hpp — builds model, data, optimizer and schedule from a Config and runs the
// training loop: micro-batches with local gradient accumulation, one data-parallel
// gradient average per optimizer step, clipping, update, LR step, one line of figures.
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/watchdog.hpp"
#include "config/config.hpp"
#include "io/data.hpp"
#include "model/model.hpp"
#include "observe/monitor.hpp"
#include "optim/loss_scaler.hpp"
#include "optim/lr_schedule.hpp"
#include "optim/optimizer.hpp"
#include "parallel/comm.hpp"
#include "parallel/comm_staged.hpp"
#include "parallel/pipe_schedule.hpp"
#include "parallel/topology.hpp"
#include "train/observer.hpp"
#include "zero/zero.hpp"

namespace zero3d {

// Evaluation: the mean token cross-entropy of the model over the validation data.
struct EvalResult {
  double loss = 0.0;  // mean over every token of training.eval_steps × train_batch_size samples
  double ppl = 0.0;   // perplexity, exp(loss)
  int64_t samples = 0, tokens = 0;
  double elapsed_ms = 0.0;
};

struct StepResult {
  int64_t step = 0;  // 1-based optimizer step
  double loss = 0.0; // mean over the global batch
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping, unscaled; -1 when the step overflowed
  double loss_scale = 1.0;
  bool skipped = false;        // gradients held inf/NaN: no update (DEEPSPEED-FACTS §2.4)
  int64_t skipped_steps = 0;   // running count
  double elapsed_ms = 0.0;
  double tokens_per_s = 0.0;
  double mfu = 0.0;
  double flops_per_token = 0.0;  // the model FLOPs the step did per token (fewer with blocks dropped)
  int64_t comm_bytes = 0;  // bus bytes this rank moved in the step
  std::array<int64_t, 2> expert_comm_bytes{};  // of them, MoE: in the expert (all-to-all) and expert-data groups
  std::array<int64_t, 3> comm_by_axis{};
  // MiCS / hpZ groups ("mics_shard", "mics_replicate", "mics_inter", "mics_intra", "hpz"): each one's
  // bus bytes in the step (counted in comm_bytes)
  std::vector<std::pair<std::string, int64_t>> shard_comm_bytes;
  std::array<int64_t, 2> link_bytes{};  // comm_bytes by link (parallel/nodes.hpp): intra-node, inter-node
  double tensor_comm_ms = 0.0;  // blocked in tensor-parallel collectives  // of them: data (with the tied embedding group), tensor, pipe
  // 1 − (this stage's forward and backward time) ÷ (the longest stage's span from the step's
  // start to its last pass): the pipeline bubble as the schedule formulas count it.
  double idle_fraction = 0.0;
  std::vector<double> stage_idle;  // idle_fraction of every pipeline stage (same on all ranks)
  std::optional<EvalResult> eval;  // the step ran an evaluation (training.eval_interval)
  std::vector<GPT::CheckpointTime> checkpoint_times;  // activation_checkpointing.profile: this rank's checkpoints
};

// The validation data (data.validation) as a run reads it, or null when not given. InputError
// when training.eval_steps rounds need more samples than its sequential windows hold (they
// would repeat). What start-up and `validate` check.
std::unique_ptr<DataLoader> open_validation_data(const Config& cfg);

// Start-up facts of the node (engine_report.cpp), collective over `world`: "N nodes, M ranks on
// rank 0's node" (this rank's local rank in *local_rank_out), and a GPU build's plan against
// its device before any model memory exists: the ranks that share this rank's device (local
// ranks with the same local rank mod visible devices) each need the plan; InputError (exit 2)
// names the shortfall.
std::string node_summary(MPI_Comm world, int* local_rank_out);
void check_device_memory(const Config& cfg, MPI_Comm world);

class Engine {
 public:
  // Collective over groups.world(): a setup error on any rank is reported once and thrown on
  // all ranks (failure.hpp). output_dir empty = write no files. watchdog may be null.
  Engine(const Config& cfg, const ProcessGroups& groups, std::string output_dir, Watchdog* watchdog = nullptr);

  // Runs cfg.training.steps optimizer steps; returns the per-step results.
  std::vector<StepResult> train();
  StepResult train_step();

  // Evaluation (evaluate.cpp). Forward passes only, over training.eval_steps global batches of
  // data.validation (pipelines run DeepSpeed's InferenceSchedule): no gradients, no update, no
  // change to any state training reads. Collective; every rank returns the same result.
  EvalResult evaluate();
  // evaluate() reads these samples in place of data.validation's (zero3d eval --text); the
  // config's training.eval_steps rounds of them.
  void set_validation_data(std::unique_ptr<DataLoader> data) { validation_ = std::move(data); }
  // zero3d eval: the parameters of a checkpoint saved by any layout (`tag` empty: the one
  // `latest` names, or `path` itself when it is a tag directory). Collective; returns its step.
  int64_t load_checkpoint_params(const std::string& path, const std::string& tag);

  // Generation (src/infer) runs its own forward passes over this rank's parameters: the model,
  // and the store that fetches them with its fetch trace set to one forward pass (ZeRO-3
  // prefetches along it; a prefill and every decode step fetch the units in that order).
  const GPT& model() const { return *model_; }
  ParamStore& inference_store();
  // The same while training: runs `f` with inference_store(), then puts training's fetch traces
  // back, so the next step fetches and prefetches as if nothing had run in between.
  void with_inference_store(const std::function<void(ParamStore&)>& f);
  // Generation's groups over model memory: the pipeline group (this rank's stage is its rank) and
  // the data-parallel group (its replica).
  Communicator& pipe_group() { return model_comms_.of(*pipe_comm_); }
  Communicator& data_group() { return model_comms_.of(*dp_comm_); }

  // Called by train() on every rank after each step's report line and before its save (the
  // training samples of training.sample_every: src/infer, set up by the train command). It may
  // run collectives and forward passes; it must change nothing training reads.
  void set_after_step(std::function<void(int64_t step)> hook) { after_step_ = std::move(hook); }

  int64_t step() const { return step_; }  // optimizer steps taken (after a resume: the saved step)
  // The preemption signal that ended train() early (after a save at the step reached); 0 when
  // it ran to training.steps.
  int stopped_by_signal() const { return stopped_by_signal_; }


 private:
  void setup_local();  // everything that may fail on one rank alone: weights, data, files
  // Rank 0's reporting (engine_report.cpp): the start-up lines, each step's metrics record and
  // report line, the end-of-run summary.
  void print_startup() const;
  MemoryBytes model_state_memory() const;
  void report_step(const StepResult& r, const nlohmann::json& moe, double dropped, bool last_step);
  void print_summary(const std::vector<StepResult>& results, double total_ms) const;
  void resume_from_checkpoint();
  bool resume_agreed();  // resume "auto": every rank finds a checkpoint (or none does)
  void save(bool final_step, bool forced = false);  // forced: preemption, whatever save_interval says
  void open_metrics();
  void stop_for_preemption(int signal, bool stepped);  // save at the step reached, say so  // after a resume: records past the resumed step are dropped first
  void inject_fault(int64_t step) const;
  void setup_evaluation();               // the validation data, checked at start-up (evaluate.cpp)
  void evaluate_if_due(StepResult& r);   // after step r: every eval_interval steps and after the last
  std::string eval_description() const;  // the start-up line
  // A forward-only pass in progress: LoadMicroBatch reads this round of the validation data and
  // each Forward ending with the head records its samples' summed token losses.
  struct EvalPass {
    int64_t first_sample = 0;         // round · train_batch_size
    std::vector<double> sample_loss;  // per sample of the round, in sample order
  };
  void record_eval_losses(int micro_batch, const ActivationBuffer& buf);
  // The executor: one schedule instruction mapped to its call (DeepSpeed pipe/engine.py's
  // _INSTRUCTION_MAP).
  void execute(const pipe::Instruction& in, StepResult& r, double& local_loss);
  // Everything between backward and the step, once (Megatron finalize_model_grads): drain the
  // data-parallel reduction, sum the tied wte over the embedding group, norm and overflow over
  // the whole model.
  void finalize_grads();
  void optimizer_step(StepResult& r);
  void check_tensor_replicas();
  int64_t activation_bytes() const;
  void wait_sends(int buffer);
  int peer_stage(int chunk, int delta) const;  // pipe rank of the virtual stage chunk·p + stage + delta
  int tag(int chunk, int delta, int kind) const;

  Config cfg_;
  const ProcessGroups& groups_;
  std::unique_ptr<MpiCommunicator> dp_comm_, pipe_comm_, tp_comm_, mp_comm_, emb_comm_, world_comm_;
  // MiCS / hpZ's groups (ProcessGroups' DataShards), by name; empty without them.
  std::vector<std::pair<std::string, std::unique_ptr<MpiCommunicator>>> shard_comms_;
  ShardGroups shard_groups();  // the ZeRO optimizer's view of them
  // MoE (engine_moe.cpp): the expert groups; null on a dense model.
  std::unique_ptr<MpiCommunicator> ep_comm_, edp_comm_, enorm_comm_;
  // What each group uses for buffers in model memory (the MPI communicators above on a CPU
  // build): declared after the groups it wraps and before everything that holds one of its
  // communicators, so that it is destroyed after those and before the groups. NCCL's are opened
  // at start-up (open_nccl, collective over the world); a staged one is made on first use.
  mutable ModelMemoryComms model_comms_;
  std::unique_ptr<ZeroOptimizer> zero_;
  // The experts' own ZeRO optimizer over the expert-data group (DESIGN-3D: no MoE branch inside
  // ZeRO); null on a dense model or on a pipeline stage without MoE blocks.
  std::unique_ptr<ZeroOptimizer> expert_zero_;
  MoeRouting moe_routing() const;
  void setup_expert_optimizer(const std::function<void(float*, int64_t, int64_t)>& fill_global);
  // Adds the experts' gradient squares to stats_ (each expert once, at DeepSpeed's 1/dp scale).
  void expert_grad_stats();
  // The experts' update: the same clip and scale as the dense step, averaged over the whole
  // data group (DeepSpeed _reduce_expert_gradients divides by dp, not by the expert-data size).
  void expert_step(double lr, double clip, double loss_scale, bool skip);
  // This rank's checkpoint segments of the experts (global offsets), and their load.
  void expert_checkpoint_segments(ShardSlice& slice);
  void read_expert_checkpoint(const CheckpointReader& reader);
  void resume_loco(const CheckpointReader& reader);
  // metrics.jsonl "moe": per MoE block, summed over the step's micro-batches and data ranks.
  nlohmann::json moe_metrics(double* dropped_fraction);
  int rank_ = 0, world_ = 1;  // in the data-parallel group
  int stage_ = 0, stages_ = 1;  // pipeline
  pipe::StageSchedule schedule_steps_;
  std::vector<int> last_backward_;  // per chunk: index (in flat instruction order) of its last weight-gradient pass
  std::vector<ActivationBuffer> buffers_;
  // A GPU build's token ids and targets on their way to the device: page-locked, reused from
  // micro-batch to micro-batch (the CPU build's loader writes the buffers themselves).
  kernels::HostBuffer token_stage_{"token_ids_stage", 0, /*pinned=*/true};
  struct Pending {
    std::unique_ptr<CommRequest> act_recv, grad_recv, act_send, grad_send;
    // Mixtral's load-balancing loss: the router sums travel with the activations, the expert
    // fractions with the gradients (ActivationBuffer::router_sums, router_fraction).
    std::unique_ptr<CommRequest> sums_recv, fraction_recv, sums_send, fraction_send;
  };
  std::vector<Pending> pending_;
  // What the model calls: ZeRO's store, whose progress() also advances the pipeline's
  // transfers (MPICH moves nonblocking messages only inside MPI calls).
  class Store : public ParamStore {
   public:
    explicit Store(Engine& e) : e_(e) {}
    // Units past the dense ones are MoE experts: their optimizer's units, in the same order.
    const void* fetch(int u) override { return owner(u).fetch(local(u)); }
    void release(int u) override { owner(u).release(local(u)); }
    float* grad_target(int u) override { return owner(u).grad_target(local(u)); }
    bool grads_start_at_zero(int u) override { return owner(u).grads_start_at_zero(local(u)); }
    void grads_done(int u) override { owner(u).grads_done(local(u)); }
    void progress() override;

   private:
    bool expert(int u) const { return e_.expert_zero_ && u >= e_.first_expert_unit_; }
    ZeroOptimizer& owner(int u) { return expert(u) ? *e_.expert_zero_ : *e_.zero_; }
    int local(int u) const { return expert(u) ? u - e_.first_expert_unit_ : u; }
    Engine& e_;
  };
  Store store_{*this};
  int first_expert_unit_ = -1;
  std::vector<int> expert_trace_;  // the experts' fetch trace (set on expert_zero_ when it is built)
  int64_t tied_numel_ = 0;  // wte elements at local offset 0 on the first and last stage (p > 1)
  bool finalized_ = false;
  GradStats stats_;
  double busy_ms_ = 0.0;  // in forward and backward passes this step
  double tensor_comm_ms_ = 0.0;  // in the tensor group's collectives this step (blocking part)
  std::chrono::steady_clock::time_point step_start_, compute_end_;
  int instr_index_ = 0;
  int local_rank_ = 0;        // on this node (MPI_COMM_TYPE_SHARED): the GPU a CUDA build would use
  std::string node_summary_;
  std::string output_dir_;
  std::unique_ptr<GPT> model_;
  std::unique_ptr<DataLoader> data_;
  std::unique_ptr<DataLoader> validation_;  // data.validation, when given
  std::optional<EvalPass> eval_;            // set while evaluate() runs
  std::unique_ptr<LRSchedule> schedule_;
  std::unique_ptr<LossScaler> scaler_;
  bool check_overflow_ = false;  // fp16 always; bf16 when bf16.check_grad_overflow
  int64_t skipped_steps_ = 0;
  std::unique_ptr<MetricsWriter> metrics_;
  PhaseTimers timers_;
  std::unique_ptr<Observer> observer_;  // flops profiler, monitors, breakdown across ranks, comms logger, trace
  double flops_per_token_ = 0.0, peak_gflops_total_ = 0.0;
  double block_flops_per_token_ = 0.0;  // of flops_per_token_, the transformer blocks' share
  int64_t step_ = 0;
  // The memory plan (estimator.hpp) the run is checked against at its end: predicted peak per
  // rank (the largest rank's budget) and the measured peak resident memory (max over ranks).
  int64_t predicted_peak_ = 0, measured_peak_ = 0;
  int64_t samples_ = 0;  // global samples consumed: the next step's data starts here (a resume keeps it)
  bool resumed_ = false;
  int stopped_by_signal_ = 0;
  bool saved_this_step_ = false;
  std::function<void(int64_t)> after_step_;
};

}  // namespace zero3d
