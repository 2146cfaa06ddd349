// input_file.hpp — reading files a user names, and echoing text a user wrote, safely.
//
// A path from a config or the command line is read only when it is a regular file of at
// most a given size: a FIFO would block forever and /dev/zero never ends. Text from the
// user appears in messages escaped and capped, so that one bad value gives one short line.
#pragma once

#include <cstdint>
#include <string>

namespace zero3d {

// `s` for a message: control bytes and invalid UTF-8 escaped as \xNN, cut after about `max`
// bytes with the full length appended ("abc… (52428800 bytes)").
std::string echo(const std::string& s, size_t max = 80);

bool is_valid_utf8(const std::string& s);

// Offset of the first control byte (< 0x20 or 0x7f) in `s`, or std::string::npos.
size_t find_control_byte(const std::string& s);

// Size of the regular file at `path` (symlinks followed). InputError naming the path and
// `what` (e.g. "data.path") when it is missing, not a regular file, or over max_bytes.
int64_t regular_file_size(const std::string& path, const std::string& what, int64_t max_bytes);

// The whole content of a regular file of at most max_bytes (checks as regular_file_size);
// opened non-blocking, so a FIFO swapped in after the check does not hang the reader.
std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes);

// "1.5 GiB", "300.0 MiB", "12 bytes": a byte count for messages.
std::string human_bytes(double bytes);

}  // namespace zero3d
