// offload_optimizer.cpp — see offload_optimizer.hpp.
#include "offload/offload_optimizer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "kernels/device.hpp"
#include "kernels/optimizers.hpp"
#include "kernels/typed.hpp"

namespace zero3d::offload {

namespace {
const char* kNvmeKey = "zero_optimization.offload_optimizer.nvme_path";
}  // namespace

HostStageBytes host_stage_bytes(int64_t numel, int64_t sub_group_size, double ratio, DType grad_type, DType param_type,
                                bool hold_master, bool params_in_model_memory, bool host_is_device) {
  HostStageBytes b;
  if (host_is_device || numel <= 0) return b;
  // The sub-groups as the constructor cuts them: all of sub_group_size but the last, the first
  // int((1 - ratio)·G) resident, so the first host sub-group is the largest one on the host.
  const int64_t sg = std::max<int64_t>(sub_group_size, 1), groups = (numel + sg - 1) / sg;
  const int64_t cut = std::min(groups, static_cast<int64_t>((1.0 - ratio) * static_cast<double>(groups)));
  const int64_t largest_host = cut < groups ? std::min(sg, numel - cut * sg) : 0;
  for (int64_t k = cut; k < std::min(groups, cut + 2); ++k) {
    b.grad[k % 2] = largest_host * static_cast<int64_t>(dtype_size(grad_type));
    if (!hold_master && params_in_model_memory) b.param[k % 2] = largest_host * static_cast<int64_t>(dtype_size(param_type));
  }
  if (hold_master && cut > 0) b.param[0] = std::min(sg, numel) * 4;  // the fp32 master copy of a resident sub-group
  return b;
}

OffloadedOptimizer::OffloadedOptimizer(const OffloadOptimizerConfig& off, const AioConfig& aio,
                                       const OptimizerConfig& opt, int64_t numel, int64_t sub_group_size,
                                       bool hold_master, const std::string& swap_dir, DType state_type)
    : off_(off), opt_(opt), numel_(numel), sub_group_size_(sub_group_size), master_(hold_master),
      grad_stage_{kernels::HostBuffer("offload_grad_stage", 0, off.pin_memory),
                  kernels::HostBuffer("offload_grad_stage", 0, off.pin_memory)},
      param_stage_{kernels::HostBuffer("offload_param_stage", 0, off.pin_memory),
                   kernels::HostBuffer("offload_param_stage", 0, off.pin_memory)},
      dir_(swap_dir) {
  if (opt.type != OptimizerType::Adam && opt.type != OptimizerType::Lion && opt.type != OptimizerType::Adagrad)
    throw std::logic_error("offloaded optimizer state is updated by DeepSpeed's CPU Adam, Lion or Adagrad only");
  if (hold_master) {
    names_.push_back("master");
    types_.push_back(DType::F32);
  }
  for (const std::string& name : optimizer_state_names(opt)) {
    names_.push_back(name);
    types_.push_back(state_type);
  }
  for (int64_t b = 0; b < numel || (b == 0 && numel == 0); b += std::max<int64_t>(sub_group_size, 1)) {
    groups_.push_back({b, std::min(sub_group_size, numel - b)});
    if (numel == 0) break;
  }
  const auto g = static_cast<int64_t>(groups_.size());
  // DeepSpeed's ratio: sub-groups with index >= int((1 - ratio)·G) are offloaded.
  cut_ = std::min(g, static_cast<int64_t>((1.0 - off_.ratio) * static_cast<double>(g)));
  cut_elems_ = cut_ < g ? groups_[static_cast<size_t>(cut_)].begin : numel;
  for (int s = 0; s < states(); ++s) device_.emplace_back("resident_" + names_[s], types_[s], cut_elems_);
  if (off_.device == OffloadDevice::Cpu) {
    for (int s = 0; s < states(); ++s)
      host_.emplace_back("host_" + names_[s], static_cast<size_t>((numel - cut_elems_) * esize(s)), off_.pin_memory);
    return;
  }
  // device nvme: one file per state and offloaded sub-group, space reserved up front
  int64_t file_bytes = 0;
  for (int64_t k = cut_; k < g; ++k)
    for (int s = 0; s < states(); ++s) file_bytes += align_up(groups_[k].n * esize(s));
  prepare_swap_dir(dir_, file_bytes, kNvmeKey);
  direct_ = true;
  fds_.assign(static_cast<size_t>(states()), {});
  for (int s = 0; s < states(); ++s)
    for (int64_t k = cut_; k < g; ++k) {
      const Group& gr = groups_[static_cast<size_t>(k)];
      // DeepSpeed's names: "<id>.tensor.swp" for the fp32 parameters, "<state>-<id>.tensor.swp"
      // for the moments; the id is the sub-group's element range (sub-groups cut tensors here).
      const std::string id = std::to_string(gr.begin) + "_" + std::to_string(gr.begin + gr.n);
      const std::string path = dir_ + "/" + (names_[s] == "master" ? id : names_[s] + "-" + id) + ".tensor.swp";
      paths_.push_back(path);
      bool direct = direct_;
      const int fd = open_swap_file(path, direct, kNvmeKey);
      fds_[s].push_back(fd);
      reserve_swap_file(fd, align_up(gr.n * esize(s)), kNvmeKey, dir_, path);  // fresh extents read as zeros
    }
  if (g > cut_) {
    aio_ = std::make_unique<AioEngine>(aio);
    // As many sub-groups in flight as the buffers hold, and no more than pipelining uses.
    const int64_t wanted = 1 + (off_.pipeline_read ? 1 : 0) + (off_.pipeline_write ? 1 : 0);
    const int64_t nslots = std::max<int64_t>(1, std::min({off_.buffer_count / states(), wanted, g - cut_}));
    int64_t largest = 0;
    for (int64_t k = cut_; k < g; ++k) largest = std::max(largest, groups_[k].n);
    slots_.resize(static_cast<size_t>(nslots));
    // the NVMe bounce buffers: page-locked per pin_memory (the CPU optimizer's master copy goes to
    // the device from here)
    for (Slot& sl : slots_)
      for (int s = 0; s < states(); ++s) sl.state.emplace_back(largest * esize(s), off.pin_memory);
  }
}

OffloadedOptimizer::~OffloadedOptimizer() {
  aio_.reset();  // joins the I/O threads once the transfers in flight have completed
  for (const auto& per_state : fds_)
    for (int fd : per_state) ::close(fd);
  for (const std::string& p : paths_) ::unlink(p.c_str());
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove(dir_, ec);  // only when empty: never anything but our files
  }
}

std::vector<std::string> OffloadedOptimizer::state_names() const { return names_; }

std::vector<std::string> OffloadedOptimizer::optimizer_states() const {
  return std::vector<std::string>(names_.begin() + (master_ ? 1 : 0), names_.end());
}

int OffloadedOptimizer::state_at(const std::string& name) const {
  for (int s = 0; s < states(); ++s)
    if (names_[s] == name) return s;
  throw std::logic_error("offloaded optimizer has no state " + name);
}

char* OffloadedOptimizer::resident(int s, int64_t begin) {
  if (begin < cut_elems_) return static_cast<char*>(device_[s].at(begin));
  return host_[s].data() + (begin - cut_elems_) * esize(s);
}

TierBytes OffloadedOptimizer::bytes() const {
  TierBytes t;
  for (int s = 0; s < states(); ++s) {
    const int64_t resident = cut_elems_ * esize(s), rest = (numel_ - cut_elems_) * esize(s);
    t.device += resident;
    if (off_.device == OffloadDevice::Cpu) t.host += rest;
    else t.nvme += rest;
    const int64_t in_memory = resident + (off_.device == OffloadDevice::Cpu ? rest : 0);
    (master_ && s == 0 ? t.master : t.moments) += in_memory;
  }
  for (const Slot& sl : slots_)
    for (const AlignedBuffer& b : sl.state) t.swap_buffers += b.bytes();
  // A GPU build's stages, as allocated (host_stage_bytes' sizes, from the first step on)
  for (int j = 0; j < 2; ++j) t.host += static_cast<int64_t>(grad_stage_[j].size() + param_stage_[j].size());
  return t;
}

void OffloadedOptimizer::update(int64_t k, char* const* st, const ParamAccess& params, const void* grads,
                                DType grad_type, float grad_mul, bool on_host) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  std::vector<TypedSpan> moments;
  for (int s = master_ ? 1 : 0; s < states(); ++s) moments.push_back({st[s], types_[static_cast<size_t>(s)]});
  const char* g = static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(dtype_size(grad_type));
  // The CPU optimizer reads host memory: on a GPU build the sub-group's gradients (DeepSpeed's
  // D2H of the gradient partition, stage3.py) and parameters held in device memory come over on
  // the copy stream first, and the parameters go back on it after the update.
  if (on_host) g = host_inputs(k, params, grads, grad_type);
  const bool staged = on_host && stages_params(params);
  const TypedSpan p = master_ ? TypedSpan{st[0], DType::F32}
                              : staged ? incoming_[k % 2] : params.acquire(gr.begin, gr.n);
  TypedSpan updated = p;
  if (staged) updated.data = param_stage_[k % 2].data();
  updater_.run(step_, updated, g, grad_type, grad_mul, moments, gr.n, on_host);
  if (staged) {
    sending_ = k;  // goes back while the CPU updates the next sub-group; released at the end of the step
    return;
  }
  // The device's kernels updated host memory in place (offload_param's partition, or its swap
  // files' page-locked stage): they are done before release() writes the stage to the swap
  // files and the next acquire() refills it (the H200 measured the race: losses off from step 4).
  if (!on_host && !master_ && !params.in_model_memory) kernels::fence();
  // release() takes the fp32 master copy in host memory: the device tier's goes through a host copy
  if (master_ && !on_host && !kernels::kHostIsDevice) {
    const size_t bytes = static_cast<size_t>(gr.n) * sizeof(float);
    param_stage_[0].grow(static_cast<size_t>(planned_stages(grad_type, DType::F32, false).param[0]));  // once
    updated.data = const_cast<char*>(kernels::host_view_of(param_stage_[0], p.data, bytes));
  }
  params.release(gr.begin, gr.n, master_ ? updated : p);
}

// One copy stream, in order: a copy starts once the one queued before it is done, and the host
// touches a stage only after a wait() that covers every copy queued on it. So sub-group k + 1's
// parameters come into param_stage_[(k + 1) % 2] only after k - 1's have gone out of it
// (send_back queues that first, behind the same wait), the gradients' stages are read by no copy
// the other way, and the two directions touch disjoint sub-groups of model memory. The
// parameters come over on the stream too: a blocking copy_to_host (Kokkos::deep_copy) fences the
// whole device, copy stream included, and would wait for the copies queued to overlap the update.
void OffloadedOptimizer::queue_inputs(int64_t k, const ParamAccess& params, const void* grads, DType grad_type) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  const int j = static_cast<int>(k % 2);
  const size_t es = dtype_size(grad_type), bytes = static_cast<size_t>(gr.n) * es;
  if (!copies_) copies_ = std::make_unique<kernels::CopyStream>();
  if (queued_ >= 0) copies_->wait();  // a copy in flight may be writing the stages this one takes
  incoming_[j] = stages_params(params) ? params.acquire(gr.begin, gr.n) : TypedSpan{};
  // Each stage grown once to its planned size (host_stage_bytes), which bytes() then counts.
  const HostStageBytes planned = planned_stages(grad_type, incoming_[j].type, incoming_[j].data != nullptr);
  copies_->to_host(grad_stage_[j].grow(std::max(static_cast<size_t>(planned.grad[j]), bytes)),
                   static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(es), bytes);
  if (incoming_[j].data) {
    const size_t param_bytes = static_cast<size_t>(gr.n) * dtype_size(incoming_[j].type);
    copies_->to_host(param_stage_[j].grow(std::max(static_cast<size_t>(planned.param[j]), param_bytes)),
                     incoming_[j].data, param_bytes);
  }
  queued_ = k;
}

const char* OffloadedOptimizer::host_inputs(int64_t k, const ParamAccess& params, const void* grads, DType grad_type) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  if (kernels::kHostIsDevice) return static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(dtype_size(grad_type));
  if (queued_ != k) queue_inputs(k, params, grads, grad_type);
  copies_->wait();  // sub-group k's inputs are here; stages (k + 1) % 2 are out of flight
  queued_ = -1;
  // Queued after the wait, so that they travel while the CPU updates k (a wait before it would
  // hold the update until k - 1's parameters were back).
  send_back();
  if (k + 1 < sub_groups()) queue_inputs(k + 1, params, grads, grad_type);
  return grad_stage_[k % 2].data();
}

void OffloadedOptimizer::send_back() {
  if (sending_ < 0) return;
  const Group& gr = groups_[static_cast<size_t>(sending_)];
  const TypedSpan p = incoming_[sending_ % 2];
  copies_->to_device(p.data, param_stage_[sending_ % 2].data(), static_cast<size_t>(gr.n) * dtype_size(p.type));
  returning_.emplace_back(sending_, p);
  sending_ = -1;
}

void OffloadedOptimizer::finish_copies(const ParamAccess& params) {
  if (!copies_) return;  // nothing was staged (a CPU build, or no host sub-group)
  send_back();
  copies_->wait();  // the next forward reads the parameters, and the next step reuses the stages
  queued_ = -1;
  for (const auto& [k, p] : returning_) {
    const Group& gr = groups_[static_cast<size_t>(k)];
    params.release(gr.begin, gr.n, p);
  }
  returning_.clear();
}

void OffloadedOptimizer::start_read(Slot& slot, int64_t k) {
  wait_writes(slot);  // the slot's previous sub-group must be on the drive first
  slot.group = k;
  for (int s = 0; s < states(); ++s)
    slot.reads.push_back(aio_->read(fds_[s][k - cut_], slot.state[s].data(),
                                    align_up(groups_[static_cast<size_t>(k)].n * esize(s)), 0, path(s, k)));
}

void OffloadedOptimizer::wait_reads(Slot& slot) {
  for (const Ticket& t : slot.reads) aio_->wait(t);
  slot.reads.clear();
}

void OffloadedOptimizer::start_write(Slot& slot) {
  const int64_t k = slot.group;
  for (int s = 0; s < states(); ++s)
    slot.writes.push_back(aio_->write(fds_[s][k - cut_], slot.state[s].data(),
                                      align_up(groups_[static_cast<size_t>(k)].n * esize(s)), 0, path(s, k)));
}

void OffloadedOptimizer::wait_writes(Slot& slot) {
  for (const Ticket& t : slot.writes) aio_->wait(t);
  slot.writes.clear();
}

void OffloadedOptimizer::step(const ParamAccess& params, const void* grads, DType grad_type, float grad_mul,
                              double lr, std::optional<std::pair<double, double>> betas) {
  ++step_count_;  // DeepSpeed's CPU optimizers advance the step before the update: the first is t = 1
  step_ = make_elementwise_step(opt_, step_count_, lr, betas, /*cpu_optimizer=*/true);
  const auto g = static_cast<int64_t>(groups_.size());
  std::vector<char*> st(static_cast<size_t>(states()));
  // Resident sub-groups: device memory, the device kernel. Host sub-groups: the CPU optimizer.
  const int64_t last_resident = off_.device == OffloadDevice::Cpu ? g : cut_;
  sending_ = -1;
  returning_.clear();
  // The first host sub-group's inputs come over while the device updates its own sub-groups.
  if (!kernels::kHostIsDevice && cut_ < g) queue_inputs(cut_, params, grads, grad_type);
  for (int64_t k = 0; k < last_resident; ++k) {
    for (int s = 0; s < states(); ++s) st[s] = resident(s, groups_[static_cast<size_t>(k)].begin);
    update(k, st.data(), params, grads, grad_type, grad_mul, /*on_host=*/k >= cut_);
  }
  if (off_.device == OffloadDevice::Nvme && g > cut_) swap_sub_groups(params, grads, grad_type, grad_mul);
  finish_copies(params);
}

void OffloadedOptimizer::swap_sub_groups(const ParamAccess& params, const void* grads, DType grad_type, float grad_mul) {
  const auto g = static_cast<int64_t>(groups_.size());
  std::vector<char*> st(static_cast<size_t>(states()));
  // NVMe: sub-group k lives in slot (k - cut) mod slots while it is read, updated and written.
  const auto nslots = static_cast<int64_t>(slots_.size());
  auto slot_of = [&](int64_t k) -> Slot& { return slots_[static_cast<size_t>((k - cut_) % nslots)]; };
  start_read(slot_of(cut_), cut_);
  for (int64_t k = cut_; k < g; ++k) {
    Slot& slot = slot_of(k);
    if (slot.group != k) start_read(slot, k);  // not prefetched (pipeline_read off)
    wait_reads(slot);
    if (off_.pipeline_read && k + 1 < g) start_read(slot_of(k + 1), k + 1);  // overlaps this update
    for (int s = 0; s < states(); ++s) st[s] = static_cast<char*>(slot.state[s].data());
    update(k, st.data(), params, grads, grad_type, grad_mul, /*on_host=*/true);
    start_write(slot);
    if (!off_.pipeline_write) wait_writes(slot);
  }
  for (Slot& slot : slots_) {
    wait_writes(slot);
    slot.group = -1;  // the next step reads every sub-group afresh
  }
}

void OffloadedOptimizer::file_access(int s, int64_t k, int64_t a, int64_t b, const std::function<void(char*)>& use,
                                     bool write_back) {
  Slot& slot = slots_.front();
  wait_writes(slot);
  wait_reads(slot);
  slot.group = -1;  // the step reads its sub-groups afresh
  const Group& gr = groups_[static_cast<size_t>(k)];
  file_span(*aio_, fds_[s][k - cut_], path(s, k), static_cast<char*>(slot.state[s].data()), (a - gr.begin) * esize(s),
            (b - gr.begin) * esize(s), gr.n * esize(s), use, write_back);
}

void OffloadedOptimizer::on_host(int s, int64_t k, int64_t a, int64_t b, const std::function<void(char*)>& use,
                                 bool write_back) {
  if (k >= cut_ && off_.device == OffloadDevice::Nvme) return file_access(s, k, a, b, use, write_back);
  char* at = resident(s, a);
  if (k >= cut_ || kernels::kHostIsDevice) return use(at);
  // A checkpoint's copy of the device tier: host memory of its own, so the step's page-locked
  // stages keep their planned sizes.
  const size_t bytes = static_cast<size_t>((b - a) * esize(s));
  std::vector<char> copy(bytes);
  kernels::copy_to_host(copy.data(), at, bytes);
  use(copy.data());
  if (write_back) kernels::copy_to_device(at, copy.data(), bytes);
}

// (out and in are host memory: the checkpoint's chunks)
void OffloadedOptimizer::read(const std::string& state, int64_t begin, int64_t n, float* out) {
  const int s = state_at(state);
  const DType type = types_[static_cast<size_t>(s)];
  for (int64_t k = 0; k < sub_groups(); ++k) {
    const Group& gr = groups_[static_cast<size_t>(k)];
    const int64_t a = std::max(begin, gr.begin), b = std::min(begin + n, gr.begin + gr.n);
    if (a >= b) continue;
    on_host(s, k, a, b, [&](char* at) { convert_on_host(out + (a - begin), DType::F32, at, type, b - a); }, false);
  }
}

void OffloadedOptimizer::write(const std::string& state, int64_t begin, int64_t n, const float* in) {
  const int s = state_at(state);
  const DType type = types_[static_cast<size_t>(s)];
  for (int64_t k = 0; k < sub_groups(); ++k) {
    const Group& gr = groups_[static_cast<size_t>(k)];
    const int64_t a = std::max(begin, gr.begin), b = std::min(begin + n, gr.begin + gr.n);
    if (a >= b) continue;
    on_host(s, k, a, b, [&](char* at) { convert_on_host(at, type, in + (a - begin), DType::F32, b - a); }, true);
  }
}

}  // namespace zero3d::offload
