// input_file.cpp
#include "base/input_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/errors.hpp"

namespace zero3d {

namespace {

// Length of the well-formed UTF-8 sequence starting at s[i] (RFC 3629: no overlongs, no
// surrogates, at most U+10FFFF), or 0 when the bytes there are not one.
size_t utf8_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c == 0xE0) n = 3, lo = 0xA0;
  else if (c == 0xED) n = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) n = 3;
  else if (c == 0xF0) n = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) n = 4;
  else if (c == 0xF4) n = 4, hi = 0x8F;
  else return 0;
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  return n;
}

std::string errno_text(int err) { return std::strerror(err); }

// Opens `path` for reading without blocking and checks it is a regular file within bounds.
int open_regular(const std::string& path, const std::string& what, int64_t max_bytes, int64_t* size) {
  if (path.find('\0') != std::string::npos) throw InputError(echo(path) + ": " + what + ": path contains a NUL byte");
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw InputError(echo(path) + ": cannot open " + what + " (" + errno_text(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw InputError(echo(path) + ": cannot stat " + what + " (" + errno_text(err) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(echo(path) + ": " + what + " is " +
                     (S_ISDIR(st.st_mode) ? "a directory" : "not a regular file (a device, FIFO or socket)"));
  }
  if (st.st_size > max_bytes) {
    ::close(fd);
    throw InputError(echo(path) + ": " + what + " is " + human_bytes(double(st.st_size)) + ", more than the " +
                     human_bytes(double(max_bytes)) + " zero3d reads");
  }
  *size = st.st_size;
  return fd;
}

}  // namespace

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

size_t find_control_byte(const std::string& s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) return i;
  }
  return std::string::npos;
}

std::string echo(const std::string& s, size_t max) {
  std::string out;
  size_t i = 0;
  while (i < s.size() && out.size() < max) {
    const size_t n = utf8_length(s, i);
    const unsigned char c = static_cast<unsigned char>(s[i]);
    // Control bytes, C1 controls (U+0080..U+009F) and invalid bytes are escaped, one byte each.
    const bool c1 = n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0;
    if (n == 0 || c < 0x20 || c == 0x7f || c1) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
      i += 1;
    } else {
      out.append(s, i, n);
      i += n;
    }
  }
  if (i < s.size()) out += "\xE2\x80\xA6 (" + std::to_string(s.size()) + " bytes)";
  return out;
}

int64_t regular_file_size(const std::string& path, const std::string& what, int64_t max_bytes) {
  int64_t size = 0;
  ::close(open_regular(path, what, max_bytes, &size));
  return size;
}

std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  int64_t size = 0;
  const int fd = open_regular(path, what, max_bytes, &size);
  std::string out(static_cast<size_t>(size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw InputError(echo(path) + ": cannot read " + what + " (" + errno_text(err) + ")");
    }
    if (n == 0) break;  // shrank since fstat: take what is there
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(got);
  return out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) bytes /= 1024.0, ++u;
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof(buf), "%.0f bytes", bytes);
  else std::snprintf(buf, sizeof(buf), "%.1f %s", bytes, units[u]);
  return buf;
}

}  // namespace zero3d
