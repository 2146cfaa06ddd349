// comm_staged.cpp — see comm_staged.hpp.
#include "parallel/comm_staged.hpp"

#include <algorithm>
#include <numeric>

#include "kernels/device.hpp"
#include "kernels/memory.hpp"

namespace zero3d {

StagingRoutes model_memory_staging() {
  return {[](const void* p) { return kernels::is_device_memory(p); },
          [](void* host, const void* model, size_t bytes) { kernels::copy_to_host(host, model, bytes); },
          [](void* model, const void* host, size_t bytes) { kernels::copy_to_device(model, host, bytes); }};
}

// One buffer of a call: the host side the wrapped communicator reads and writes. A buffer that
// is not model memory is its own host side, and nothing moves.
class StagedCommunicator::Staged {
 public:
  Staged() = default;
  Staged(void* model, size_t bytes, bool copy_back, const StagingRoutes* routes, std::shared_ptr<StagingPool> pool)
      : model_(model), bytes_(bytes), copy_back_(copy_back), routes_(routes), pool_(std::move(pool)) {
    host_ = pool_->take(static_cast<int64_t>(bytes));
  }
  Staged(Staged&&) = default;
  Staged& operator=(Staged&&) = default;
  static Staged direct(void* buf) {
    Staged s;
    s.direct_ = buf;
    return s;
  }
  void* ptr() { return pool_ ? static_cast<void*>(host_.data()) : direct_; }
  void load() {
    if (pool_) routes_->to_host(host_.data(), model_, bytes_);
  }
  // The call is over: results back into model memory, the staging back to the pool.
  void finish() {
    if (!pool_) return;
    if (copy_back_) routes_->to_model(model_, host_.data(), bytes_);
    pool_->give_back(std::move(host_));
    pool_.reset();
  }

 private:
  void* direct_ = nullptr;
  void* model_ = nullptr;
  size_t bytes_ = 0;
  bool copy_back_ = false;
  const StagingRoutes* routes_ = nullptr;
  std::shared_ptr<StagingPool> pool_;
  kernels::HostStagingBuffer host_;
};

namespace {
// A call in flight on the host side; its staged buffers come back when it completes.
class StagedRequest : public CommRequest {
 public:
  StagedRequest(std::unique_ptr<CommRequest> inner, std::vector<std::function<void()>> finish)
      : inner_(std::move(inner)), finish_(std::move(finish)) {}
  ~StagedRequest() override {
    try {
      wait();  // as the host side's requests do: complete before they go
    } catch (const std::exception&) {
    }
  }
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    complete();
    return true;
  }
  void wait() override {
    if (done_) return;
    inner_->wait();
    complete();
  }

 private:
  void complete() {
    done_ = true;
    for (auto& f : finish_) f();
  }
  std::unique_ptr<CommRequest> inner_;
  std::vector<std::function<void()>> finish_;
  bool done_ = false;
};

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); }
}  // namespace

StagedCommunicator::StagedCommunicator(Communicator& host, StagingRoutes routes)
    : GroupPath(host), routes_(std::move(routes)), pool_(std::make_shared<StagingPool>()) {}

StagedCommunicator::Staged StagedCommunicator::out(const void* buf, int64_t count, DType type) {
  if (count <= 0 || !buf || !routes_.in_model_memory(buf)) return Staged::direct(const_cast<void*>(buf));
  Staged s(const_cast<void*>(buf), static_cast<size_t>(count) * dtype_size(type), false, &routes_, pool_);
  s.load();
  return s;
}

StagedCommunicator::Staged StagedCommunicator::in(void* buf, int64_t count, DType type) {
  if (count <= 0 || !buf || !routes_.in_model_memory(buf)) return Staged::direct(buf);
  return Staged(buf, static_cast<size_t>(count) * dtype_size(type), true, &routes_, pool_);
}

StagedCommunicator::Staged StagedCommunicator::inout(void* buf, int64_t count, DType type) {
  Staged s = in(buf, count, type);
  s.load();
  return s;
}

namespace {
// Moves staged buffers into a request's completion.
template <typename... S>
std::vector<std::function<void()>> finishing(S&&... staged) {
  std::vector<std::function<void()>> f;
  (f.push_back([s = std::make_shared<std::decay_t<S>>(std::move(staged))] { s->finish(); }), ...);
  return f;
}
}  // namespace

void StagedCommunicator::all_reduce(void* buf, int64_t count, DType type, ReduceOp op) {
  Staged b = inout(buf, count, type);
  group_.all_reduce(b.ptr(), count, type, op);
  b.finish();
}

std::unique_ptr<CommRequest> StagedCommunicator::all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) {
  Staged b = inout(buf, count, type);
  auto inner = group_.all_reduce_async(b.ptr(), count, type, op);
  return std::make_unique<StagedRequest>(std::move(inner), finishing(std::move(b)));
}

void StagedCommunicator::reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) {
  Staged s = out(send, recv_count * size(), type), r = in(recv, recv_count, type);
  group_.reduce_scatter(s.ptr(), r.ptr(), recv_count, type, op);
  s.finish();
  r.finish();
}

void StagedCommunicator::all_gather(const void* send, void* recv, int64_t send_count, DType type) {
  Staged s = out(send, send_count, type), r = in(recv, send_count * size(), type);
  group_.all_gather(s.ptr(), r.ptr(), send_count, type);
  s.finish();
  r.finish();
}

std::unique_ptr<CommRequest> StagedCommunicator::reduce_scatter_v_async(const void* send, void* recv,
                                                                       const std::vector<int64_t>& counts, DType type,
                                                                       ReduceOp op) {
  Staged s = out(send, sum(counts), type), r = in(recv, counts[static_cast<size_t>(rank())], type);
  auto inner = group_.reduce_scatter_v_async(s.ptr(), r.ptr(), counts, type, op);
  return std::make_unique<StagedRequest>(std::move(inner), finishing(std::move(s), std::move(r)));
}

std::unique_ptr<CommRequest> StagedCommunicator::all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                                   const std::vector<int64_t>& displs, DType type) {
  // In place: the extent every block lies in, this rank's block loaded, every block written back.
  // An empty block's displacement may point past the buffer (a rank owning none of a ZeRO-3
  // unit): it does not extend the copy (on an H100 it made cudaMemcpy read past the unit).
  int64_t extent = 0;
  for (size_t r = 0; r < counts.size(); ++r)
    if (counts[r] > 0) extent = std::max(extent, displs[r] + counts[r]);
  Staged b = inout(buf, extent, type);
  auto inner = group_.all_gather_v_async(b.ptr(), counts, displs, type);
  return std::make_unique<StagedRequest>(std::move(inner), finishing(std::move(b)));
}

void StagedCommunicator::broadcast(void* buf, int64_t count, DType type, int root) {
  Staged b = inout(buf, count, type);
  group_.broadcast(b.ptr(), count, type, root);
  b.finish();
}

void StagedCommunicator::send(const void* buf, int64_t count, DType type, int peer, int tag) {
  Staged b = out(buf, count, type);
  group_.send(b.ptr(), count, type, peer, tag);
  b.finish();
}

void StagedCommunicator::recv(void* buf, int64_t count, DType type, int peer, int tag) {
  Staged b = in(buf, count, type);
  group_.recv(b.ptr(), count, type, peer, tag);
  b.finish();
}

std::unique_ptr<CommRequest> StagedCommunicator::isend(const void* buf, int64_t count, DType type, int peer, int tag) {
  Staged b = out(buf, count, type);
  auto inner = group_.isend(b.ptr(), count, type, peer, tag);
  return std::make_unique<StagedRequest>(std::move(inner), finishing(std::move(b)));
}

std::unique_ptr<CommRequest> StagedCommunicator::irecv(void* buf, int64_t count, DType type, int peer, int tag) {
  Staged b = in(buf, count, type);
  auto inner = group_.irecv(b.ptr(), count, type, peer, tag);
  return std::make_unique<StagedRequest>(std::move(inner), finishing(std::move(b)));
}

void StagedCommunicator::all_to_all(const void* send, void* recv, int64_t count, DType type) {
  Staged s = out(send, count * size(), type), r = in(recv, count * size(), type);
  group_.all_to_all(s.ptr(), r.ptr(), count, type);
  s.finish();
  r.finish();
}

void StagedCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                      const std::vector<int64_t>& recv_counts, DType type) {
  Staged s = out(send, sum(send_counts), type), r = in(recv, sum(recv_counts), type);
  group_.all_to_all_v(s.ptr(), send_counts, r.ptr(), recv_counts, type);
  s.finish();
  r.finish();
}

void ModelMemoryComms::open_nccl(MPI_Comm world, const std::vector<MpiCommunicator*>& groups, Watchdog* watchdog) {
  if (!nccl_available()) {
    if (kernels::kGpuBuild) transport_ = "MPI through page-locked host copies (built without NCCL)";
    return;
  }
  int spans = 0;  // a group of more than one rank anywhere in the job (else NCCL has nothing to carry)
  for (MpiCommunicator* g : groups) spans |= g && g->size() > 1 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &spans, 1, MPI_INT, MPI_MAX, world);
  std::string why = "no group but the pipeline's spans ranks";
  const int64_t free_before = kernels::kGpuBuild ? kernels::device_info().free_bytes : 0;
  if (spans) nccl_world_ = open_nccl_world(world, watchdog, &why);
  if (!nccl_world_) {
    transport_ = (kernels::kGpuBuild ? "MPI through page-locked host copies (" : "MPI (") + why + ")";
    return;
  }
  for (MpiCommunicator* g : groups)
    if (std::unique_ptr<Communicator> c = nccl_world_->split(g, g ? &staged(*g) : nullptr)) nccl_.emplace_back(g, std::move(c));
  transport_ = nccl_world_->version() + " (each rank has a GPU of its own)";
  // NCCL's buffers are its own allocations, outside the plan: what they took, as the device saw it
  // (the engine holds the plan to the memory left after them).
  const int64_t taken = free_before - kernels::device_info().free_bytes;
  if (kernels::kGpuBuild && taken > 0)
    transport_ += ", " + std::to_string((taken + (1 << 20) - 1) >> 20) + " MiB of device memory for its communicators";
}

Communicator& ModelMemoryComms::of(MpiCommunicator& group) {
  for (auto& [mpi, nccl] : nccl_)
    if (mpi == &group) return *nccl;
  return staged(group);
}

Communicator& ModelMemoryComms::staged(MpiCommunicator& group) {
  if (!kernels::kGpuBuild) return group;
  for (auto& [mpi, staged] : staged_)
    if (mpi == &group) return *staged;
  staged_.emplace_back(&group, std::make_unique<StagedCommunicator>(group, model_memory_staging()));
  return *staged_.back().second;
}

}  // namespace zero3d
