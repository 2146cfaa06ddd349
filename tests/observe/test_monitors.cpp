// Monitors' file formats (monitors.hpp) and the comms logger's sizes (comms_logger.hpp),
// against published test vectors and Python's own output.
#include <gtest/gtest.h>

#include "observe/comms_logger.hpp"
#include "observe/monitors.hpp"

using namespace zero3d;

TEST(Crc32c, MatchesTheRfc3720TestVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(static_cast<char>(i));
  EXPECT_EQ(crc32c(ascending.data(), ascending.size()), 0x46DD794Eu);
}

TEST(TfRecord, FramesThePayloadWithItsLengthAndMaskedCrcs) {
  const std::string rec = tfrecord("abc");
  ASSERT_EQ(rec.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  const uint32_t c = crc32c(rec.data(), 8);
  const uint32_t mask = ((c >> 15) | (c << 17)) + 0xa282ead8u;
  EXPECT_EQ(std::string(rec.data() + 8, 4), std::string(reinterpret_cast<const char*>(&mask), 4));
  EXPECT_EQ(rec.substr(12, 3), "abc");
  const uint32_t d = masked_crc32c("abc", 3);
  EXPECT_EQ(std::string(rec.data() + 15, 4), std::string(reinterpret_cast<const char*>(&d), 4));
}

TEST(TfRecord, ScalarEventIsTheEventProtobufTensorBoardReads) {
  // Event{wall_time: 0 (field 1, fixed64), step: 5 (field 2, varint), summary (field 5)
  //   {value (field 1) {tag: "a" (field 1), simple_value: 1.0f (field 2, fixed32)}}}
  const std::string want("\x09\0\0\0\0\0\0\0\0\x10\x05\x2a\x0a\x0a\x08\x0a\x01" "a" "\x15\x00\x00\x80\x3f", 23);
  EXPECT_EQ(scalar_event(0.0, 5, "a", 1.0f), want);
  EXPECT_EQ(file_version_event(0.0), std::string("\x09\0\0\0\0\0\0\0\0\x1a\x0d" "brain.Event:2", 24));
}

TEST(PythonFloat, PrintsWhatPythonsReprPrints) {
  EXPECT_EQ(python_float(0.001), "0.001");
  EXPECT_EQ(python_float(1e-05), "1e-05");
  EXPECT_EQ(python_float(0.0001), "0.0001");
  EXPECT_EQ(python_float(100.0), "100.0");
  EXPECT_EQ(python_float(0.1), "0.1");
  EXPECT_EQ(python_float(-2.5), "-2.5");
  EXPECT_EQ(python_float(0.0), "0.0");
  EXPECT_EQ(python_float(1e16), "1e+16");
  EXPECT_EQ(python_float(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(python_float(4.1393232345581055), "4.1393232345581055");
  EXPECT_EQ(python_float(65536.0), "65536.0");
}

TEST(CommsLogger, SizesAreDeepSpeedsConvertSize) {
  EXPECT_EQ(convert_size(0), "0B");
  EXPECT_EQ(convert_size(8), "8.0 B");
  EXPECT_EQ(convert_size(1024), "1.0 KB");
  EXPECT_EQ(convert_size(1536), "1.5 KB");
  EXPECT_EQ(convert_size(50816), "49.62 KB");
  EXPECT_EQ(convert_size(3 * 1024.0 * 1024 * 1024), "3.0 GB");
}

TEST(CommsLogger, BusFactorsAreNcclTestsAndDeepSpeeds) {
  EXPECT_DOUBLE_EQ(comm_bus_factor(CommOp::AllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(comm_bus_factor(CommOp::AllGather, 4), 0.75);
  EXPECT_DOUBLE_EQ(comm_bus_factor(CommOp::ReduceScatter, 2), 0.5);
  EXPECT_DOUBLE_EQ(comm_bus_factor(CommOp::Send, 2), 1.0);
  EXPECT_DOUBLE_EQ(comm_bus_factor(CommOp::AllReduce, 1), 0.0);
  EXPECT_DOUBLE_EQ(comm_alg_factor(CommOp::AllReduce), 2.0);
}
