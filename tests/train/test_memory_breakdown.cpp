// test_memory_breakdown.cpp — memory_breakdown's line (DeepSpeed's see_memory_usage): the model
// states and tiers, the process's resident memory and the machine's, and on a GPU build the
// device's allocated memory, its peak and what the device has free.
#include <gtest/gtest.h>

#include "train/memory_breakdown.hpp"

namespace zero3d {
namespace {

MemoryBreakdown example() {
  MemoryBreakdown m;
  m.states.params = 1230000;
  m.activations = 4560000;
  m.rss = 45600000;
  m.peak_rss = 50100000;
  return m;
}

TEST(MemoryBreakdownLine, NamesTheProcesssResidentMemoryAndNoDeviceOnACpuBuild) {
  const std::string line = memory_breakdown_line(example());
  EXPECT_NE(line.find("params 1.23 MB"), std::string::npos) << line;
  EXPECT_NE(line.find("| resident 45.60 MB (peak 50.10 MB)"), std::string::npos) << line;
  EXPECT_EQ(line.find("device"), std::string::npos) << line;
}

TEST(MemoryBreakdownLine, AGpuBuildAddsTheDevicesAllocatedPeakAndFreeMemoryBeforeTheHosts) {
  MemoryBreakdown m = example();
  m.on_device = true;
  m.device_allocated = 1200000000;
  m.device_peak = 1500000000;
  m.device_free = 140000000000;
  m.device_total = 150000000000;
  const std::string line = memory_breakdown_line(m);
  const size_t device = line.find("| device allocated 1200.00 MB (peak 1500.00 MB) | device free 140000.00 MB of 150000.00 MB");
  ASSERT_NE(device, std::string::npos) << line;
  EXPECT_LT(device, line.find("| resident")) << line;
}

}  // namespace
}  // namespace zero3d
