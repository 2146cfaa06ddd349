// param_swapper.hpp — ZeRO-Infinity's parameter tier (offload_param device nvme, stage 3).
//
// Each unit's slice of this rank's parameter partition lives in its own swap file
// (<nvme_path>/zero_stage_3/<dtype>params/rank<r>/<unit>_param.tensor.swp, DEEPSPEED-FACTS-2
// §3.3). A unit is read when it is gathered; at most max_in_cpu elements stay cached in memory
// (least recently used first out), and up to buffer_count reads run ahead of compute along the
// fetch trace. A slice larger than buffer_size elements is rejected up front.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.hpp"
#include "config/config.hpp"
#include "offload/aio.hpp"

namespace zero3d::offload {

class ParamSwapper {
 public:
  // slices: partition-local [begin, end) of each unit's owned elements (ascending).
  ParamSwapper(const OffloadParamConfig& cfg, const AioConfig& aio, DType type,
               std::vector<std::pair<int64_t, int64_t>> slices, const std::string& dir);
  ~ParamSwapper();
  ParamSwapper(const ParamSwapper&) = delete;
  ParamSwapper& operator=(const ParamSwapper&) = delete;

  // Starts reading unit u unless cached or in flight; false when no read buffer or cache room is left.
  bool prefetch(int u);
  // Whether unit u is in memory now (a prefetch has completed).
  bool ready(int u);
  // Unit u's slice in memory (read now if needed); valid until the next call on this object.
  const void* acquire(int u);
  // Partition-local elements [begin, begin + n) in the parameter type; elements outside every
  // slice (padding) read as zeros and are dropped on write. Writes keep cached slices current.
  void read(int64_t begin, int64_t n, void* out);
  void write(int64_t begin, int64_t n, const void* in);

  int64_t nvme_bytes() const { return file_bytes_; }
  int64_t cached_elems() const { return cached_elems_; }
  int64_t cached_peak_bytes() const { return cached_peak_ * static_cast<int64_t>(esize_); }
  bool direct_io() const { return direct_; }
  const std::vector<std::string>& swap_files() const { return paths_; }
  IoStats take_io_stats() { return aio_->take_stats(); }

 private:
  struct Entry {
    AlignedBuffer buf;
    Ticket read;  // in flight while set
    uint64_t last_use = 0;
  };
  int64_t slice_elems(int u) const { return slices_[u].second - slices_[u].first; }
  void finish_read(Entry& e);
  void evict_for(int64_t elems, int keep, bool include_reads);
  void transfer_slice(int u, int64_t a, int64_t b, const std::function<void(char*)>& change, bool write_back);

  OffloadParamConfig cfg_;
  DType type_;
  size_t esize_;
  std::vector<std::pair<int64_t, int64_t>> slices_;
  std::string dir_;
  std::unique_ptr<AioEngine> aio_;
  bool direct_ = true;
  std::vector<int> fds_;  // per unit (-1: empty slice)
  std::vector<std::string> paths_;
  int64_t file_bytes_ = 0;
  std::map<int, Entry> cache_;
  int64_t cached_elems_ = 0, cached_peak_ = 0;
  int reads_in_flight_ = 0;
  uint64_t clock_ = 0;
  AlignedBuffer scratch_;  // one slice, for writes to uncached units
};

}  // namespace zero3d::offload
