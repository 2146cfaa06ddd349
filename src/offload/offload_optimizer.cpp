// offload_optimizer.cpp — see offload_optimizer.hpp.
#include "offload/offload_optimizer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base.hpp"
#include "input_file.hpp"
#include "optimizers.hpp"
#include "typed.hpp"

namespace zero3d::offload {

namespace {
constexpr int64_t kWidenChunk = 16384;  // gradients widened 64 KiB at a time (stays in L2), as Optimizer::step
const char* kNvmeKey = "zero_optimization.offload_optimizer.nvme_path";
}  // namespace

OffloadedAdam::OffloadedAdam(const OffloadOptimizerConfig& off, const AioConfig& aio, const OptimizerConfig& opt,
                             int64_t numel, int64_t sub_group_size, bool hold_master, const std::string& swap_dir)
    : off_(off), opt_(opt), numel_(numel), dir_(swap_dir) {
  if (hold_master) names_.push_back("master");
  names_.push_back("exp_avg");
  names_.push_back("exp_avg_sq");
  for (int64_t b = 0; b < numel || (b == 0 && numel == 0); b += std::max<int64_t>(sub_group_size, 1)) {
    groups_.push_back({b, std::min(sub_group_size, numel - b)});
    if (numel == 0) break;
  }
  const auto g = static_cast<int64_t>(groups_.size());
  // DeepSpeed's ratio: sub-groups with index >= int((1 - ratio)·G) are offloaded.
  cut_ = std::min(g, static_cast<int64_t>((1.0 - off_.ratio) * static_cast<double>(g)));
  cut_elems_ = cut_ < g ? groups_[static_cast<size_t>(cut_)].begin : numel;
  for (int s = 0; s < states(); ++s) device_.push_back(make_flat_buffer("resident_" + names_[s], cut_elems_));
  if (off_.device == OffloadDevice::Cpu) {
    for (int s = 0; s < states(); ++s) host_.emplace_back("host_" + names_[s], numel - cut_elems_);
    return;
  }
  // device nvme: one file per state and offloaded sub-group, space reserved up front
  int64_t file_bytes = 0;
  for (int64_t k = cut_; k < g; ++k) file_bytes += states() * align_up(groups_[k].n * 4);
  prepare_swap_dir(dir_, file_bytes, kNvmeKey);
  require_direct_io(dir_, kNvmeKey);
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
      const int64_t bytes = align_up(gr.n * 4);
      reserve_swap_file(fd, bytes, kNvmeKey, dir_, path);  // fresh extents read as zeros: m = v = 0
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
      for (int s = 0; s < states(); ++s) sl.state.emplace_back(largest * 4);
  }
}

OffloadedAdam::~OffloadedAdam() {
  aio_.reset();  // joins the I/O threads once the transfers in flight have completed
  for (const auto& per_state : fds_)
    for (int fd : per_state) ::close(fd);
  for (const std::string& p : paths_) ::unlink(p.c_str());
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove(dir_, ec);  // only when empty: never anything but our files
  }
}

std::vector<std::string> OffloadedAdam::state_names() const { return names_; }

int OffloadedAdam::state_at(const std::string& name) const {
  for (int s = 0; s < states(); ++s)
    if (names_[s] == name) return s;
  throw std::logic_error("offloaded optimizer has no state " + name);
}

float* OffloadedAdam::resident(int s, int64_t begin) {
  if (begin < cut_elems_) return device_[s].data() + begin;
  return host_[s].data() + (begin - cut_elems_);
}

TierBytes OffloadedAdam::bytes() const {
  TierBytes t;
  t.device = states() * cut_elems_ * 4;
  const int64_t rest = states() * (numel_ - cut_elems_) * 4;
  if (off_.device == OffloadDevice::Cpu) t.host = rest;
  else t.nvme = rest;
  for (const Slot& sl : slots_)
    for (const AlignedBuffer& b : sl.state) t.swap_buffers += b.bytes();
  return t;
}

void OffloadedAdam::update(int64_t k, float* const* st, const ParamAccess& params, const void* grads, DType grad_type,
                           float grad_mul, bool on_host) {
  const Group& gr = groups_[static_cast<size_t>(k)];
  const bool master = names_[0] == "master";
  float* p = master ? st[0] : params.acquire(gr.begin, gr.n);
  float* m = st[master ? 1 : 0];
  float* v = st[master ? 2 : 1];
  const double beta1 = betas_ ? betas_->first : opt_.beta1, beta2 = betas_ ? betas_->second : opt_.beta2;
  const auto s = kernels::make_adam_step(lr_, beta1, beta2, opt_.eps, opt_.weight_decay, step_count_,
                                         opt_.bias_correction, opt_.adam_w_mode);
  const size_t esize = dtype_size(grad_type);
  if (widened_.size() < static_cast<size_t>(kWidenChunk)) widened_.resize(static_cast<size_t>(kWidenChunk));
  for (int64_t a = 0; a < gr.n; a += kWidenChunk) {
    const int64_t c = std::min(kWidenChunk, gr.n - a);
    convert_any(widened_.data(), DType::F32, static_cast<const char*>(grads) + (gr.begin + a) * esize, grad_type, c,
                grad_mul);
    if (on_host) kernels::cpu_adam_update(p + a, widened_.data(), m + a, v + a, c, s);
    else kernels::adam_update(p + a, widened_.data(), m + a, v + a, c, s);
  }
  params.release(gr.begin, gr.n, p);
}

void OffloadedAdam::start_read(Slot& slot, int64_t k) {
  wait_writes(slot);  // the slot's previous sub-group must be on the drive first
  slot.group = k;
  const int64_t bytes = align_up(groups_[static_cast<size_t>(k)].n * 4);
  for (int s = 0; s < states(); ++s)
    slot.reads.push_back(aio_->read(fds_[s][k - cut_], slot.state[s].data(), bytes, 0, path(s, k)));
}

void OffloadedAdam::wait_reads(Slot& slot) {
  for (const Ticket& t : slot.reads) aio_->wait(t);
  slot.reads.clear();
}

void OffloadedAdam::start_write(Slot& slot) {
  const int64_t k = slot.group;
  const int64_t bytes = align_up(groups_[static_cast<size_t>(k)].n * 4);
  for (int s = 0; s < states(); ++s)
    slot.writes.push_back(aio_->write(fds_[s][k - cut_], slot.state[s].data(), bytes, 0, path(s, k)));
}

void OffloadedAdam::wait_writes(Slot& slot) {
  for (const Ticket& t : slot.writes) aio_->wait(t);
  slot.writes.clear();
}

void OffloadedAdam::step(const ParamAccess& params, const void* grads, DType grad_type, float grad_mul, double lr,
                         std::optional<std::pair<double, double>> betas) {
  ++step_count_;  // DeepSpeedCPUAdam advances the step before the update: the first update is t = 1
  lr_ = lr;
  betas_ = betas;
  const auto g = static_cast<int64_t>(groups_.size());
  std::vector<float*> st(static_cast<size_t>(states()));
  // Resident sub-groups: device memory, the device kernel. Host sub-groups: the CPU Adam.
  const int64_t last_resident = off_.device == OffloadDevice::Cpu ? g : cut_;
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
    for (int s = 0; s < states(); ++s) st[s] = slot.state[s].floats();
    update(k, st.data(), params, grads, grad_type, grad_mul, /*on_host=*/true);
    start_write(slot);
    if (!off_.pipeline_write) wait_writes(slot);
  }
  for (Slot& slot : slots_) {
    wait_writes(slot);
    slot.group = -1;  // the next step reads every sub-group afresh
  }
}

void OffloadedAdam::file_access(int s, int64_t k, int64_t a, int64_t b, const std::function<void(float*)>& use,
                                bool write_back) {
  Slot& slot = slots_.front();
  wait_writes(slot);
  wait_reads(slot);
  slot.group = -1;  // the step reads its sub-groups afresh
  const Group& gr = groups_[static_cast<size_t>(k)];
  file_span(*aio_, fds_[s][k - cut_], path(s, k), static_cast<char*>(slot.state[s].data()), (a - gr.begin) * 4,
            (b - gr.begin) * 4, gr.n * 4, [&](char* at) { use(reinterpret_cast<float*>(at)); }, write_back);
}

void OffloadedAdam::read(const std::string& state, int64_t begin, int64_t n, float* out) {
  const int s = state_at(state);
  for (int64_t k = 0; k < sub_groups(); ++k) {
    const Group& gr = groups_[static_cast<size_t>(k)];
    const int64_t a = std::max(begin, gr.begin), b = std::min(begin + n, gr.begin + gr.n);
    if (a >= b) continue;
    if (off_.device == OffloadDevice::Cpu || k < cut_) std::copy_n(resident(s, a), b - a, out + (a - begin));
    else file_access(s, k, a, b, [&](float* at) { std::copy_n(at, b - a, out + (a - begin)); }, false);
  }
}

void OffloadedAdam::write(const std::string& state, int64_t begin, int64_t n, const float* in) {
  const int s = state_at(state);
  for (int64_t k = 0; k < sub_groups(); ++k) {
    const Group& gr = groups_[static_cast<size_t>(k)];
    const int64_t a = std::max(begin, gr.begin), b = std::min(begin + n, gr.begin + gr.n);
    if (a >= b) continue;
    if (off_.device == OffloadDevice::Cpu || k < cut_) std::copy_n(in + (a - begin), b - a, resident(s, a));
    else file_access(s, k, a, b, [&](float* at) { std::copy_n(in + (a - begin), b - a, at); }, true);
  }
}

}  // namespace zero3d::offload
