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
#include "kernels/optimizers.hpp"
#include "kernels/typed.hpp"

namespace zero3d::offload {

namespace {
const char* kNvmeKey = "zero_optimization.offload_optimizer.nvme_path";
}  // namespace

OffloadedOptimizer::OffloadedOptimizer(const OffloadOptimizerConfig& off, const AioConfig& aio,
                                       const OptimizerConfig& opt, int64_t numel, int64_t sub_group_size,
                                       bool hold_master, const std::string& swap_dir, DType state_type)
    : off_(off), opt_(opt), numel_(numel), master_(hold_master),
      grad_stage_{kernels::HostBuffer("offload_grad_stage", 0, off.pin_memory),
                  kernels::HostBuffer("offload_grad_stage", 0, off.pin_memory)},
      param_stage_("offload_param_stage", 0, off.pin_memory),
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
    for (Slot& sl : slots_)
      for (int s = 0; s < states(); ++s) sl.state.emplace_back(largest * esize(s));
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
  return t;
}

void OffloadedOptimizer::update(int64_t k, char* const* st, const ParamAccess& params, const void* grads,
                                DType grad_type, float grad_mul, bool on_host) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  const TypedSpan p = master_ ? TypedSpan{st[0], DType::F32} : params.acquire(gr.begin, gr.n);
  std::vector<TypedSpan> moments;
  for (int s = master_ ? 1 : 0; s < states(); ++s) moments.push_back({st[s], types_[static_cast<size_t>(s)]});
  const char* g = static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(dtype_size(grad_type));
  // The CPU optimizer reads host memory: on a GPU build the sub-group's gradients come over first
  // (DeepSpeed's D2H of the gradient partition, stage3.py), and parameters held in device memory
  // go there and back around the update.
  const size_t param_bytes = static_cast<size_t>(gr.n) * dtype_size(p.type);
  const bool stage_params = on_host && !master_ && params.in_model_memory && !kernels::kHostIsDevice;
  TypedSpan updated = p;
  if (on_host) g = host_gradients(k, grads, grad_type);
  if (stage_params) updated.data = const_cast<char*>(kernels::host_view_of(param_stage_, p.data, param_bytes));
  updater_.run(step_, updated, g, grad_type, grad_mul, moments, gr.n, on_host);
  if (stage_params) kernels::copy_to_device(p.data, updated.data, param_bytes);
  // release() takes the fp32 master copy in host memory: the device tier's goes through a host copy
  if (master_ && !on_host && !kernels::kHostIsDevice)
    updated.data = const_cast<char*>(kernels::host_view_of(param_stage_, p.data, param_bytes));
  params.release(gr.begin, gr.n, master_ ? updated : p);
}

void OffloadedOptimizer::queue_gradients(int64_t k, const void* grads, DType grad_type) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  const size_t es = dtype_size(grad_type), bytes = static_cast<size_t>(gr.n) * es;
  if (!copies_) copies_ = std::make_unique<kernels::CopyStream>();
  if (queued_ >= 0) copies_->wait();  // a copy in flight may be writing the stage this one takes
  copies_->to_host(grad_stage_[k % 2].grow(bytes), static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(es),
                   bytes);
  queued_ = k;
}

const char* OffloadedOptimizer::host_gradients(int64_t k, const void* grads, DType grad_type) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  if (kernels::kHostIsDevice) return static_cast<const char*>(grads) + gr.begin * static_cast<int64_t>(dtype_size(grad_type));
  if (queued_ != k) queue_gradients(k, grads, grad_type);
  copies_->wait();  // sub-group k's gradients are here; stage (k + 1) % 2 (sub-group k - 1's) is free
  queued_ = -1;
  if (k + 1 < sub_groups()) queue_gradients(k + 1, grads, grad_type);  // comes over while the CPU updates k
  return grad_stage_[k % 2].data();
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
  // The first host sub-group's gradients come over while the device updates its own sub-groups.
  if (!kernels::kHostIsDevice && cut_ < g) queue_gradients(cut_, grads, grad_type);
  for (int64_t k = 0; k < last_resident; ++k) {
    for (int s = 0; s < states(); ++s) st[s] = resident(s, groups_[static_cast<size_t>(k)].begin);
    update(k, st.data(), params, grads, grad_type, grad_mul, /*on_host=*/k >= cut_);
  }
  if (off_.device != OffloadDevice::Nvme || g == cut_) return;
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
  const size_t bytes = static_cast<size_t>((b - a) * esize(s));
  char* copy = const_cast<char*>(kernels::host_view_of(param_stage_, at, bytes));
  use(copy);
  if (write_back) kernels::copy_to_device(at, copy, bytes);
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
