/* fault_backtrace.c — preloaded (LD_PRELOAD) into a run on a lent GPU machine that has no
 * debugger. A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints the faulting
 * address and instruction, glibc's backtrace, and, because a fault inside a library without
 * unwind tables (the CUDA driver's) stops that backtrace at once, every word of the top 16 KiB
 * of the stack that points into an executable mapping: "path +offset", which
 * `addr2line -f -C -e path offset` resolves on the build machine (return addresses among
 * them are the callers). Then the process dies of the signal as it would have.
 * With FAULT_BACKTRACE_THROW=1 every C++ throw prints the thrower's stack the same way before it
 * unwinds (an error that main() reports in one line, such as a CUDA call's, then names its
 * site). gpu_bundle.sh builds it (with -ldl). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <stdlib.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void put(const char* s) { (void)!write(2, s, strlen(s)); }

static void put_hex(uintptr_t v) {
  char b[19] = "0x", t[16];
  int n = 0;
  do t[n++] = "0123456789abcdef"[v & 15]; while (v >>= 4);
  for (int i = 0; i < n; ++i) b[2 + i] = t[n - 1 - i];
  b[2 + n] = 0;
  put(b);
}

static uintptr_t parse_hex(const char** p) {
  uintptr_t v = 0;
  for (;; ++*p) {
    const char c = **p;
    if (c >= '0' && c <= '9') v = v * 16 + (uintptr_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v = v * 16 + (uintptr_t)(c - 'a' + 10);
    else return v;
  }
}

/* Executable file mappings of this process, read once at the fault. */
struct map { uintptr_t lo, hi, off; char path[160]; };
static struct map maps[128];
static int n_maps;
static char text[1 << 16];

static void read_maps(void) {
  const int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return;
  ssize_t len = 0, r;
  while (len < (ssize_t)sizeof text - 1 && (r = read(fd, text + len, sizeof text - 1 - len)) > 0) len += r;
  close(fd);
  text[len] = 0;
  for (const char* line = text; *line && n_maps < 128;) {
    const char* end = strchr(line, '\n');
    if (!end) end = line + strlen(line);
    const char* p = line;
    struct map m;
    m.lo = parse_hex(&p); ++p;
    m.hi = parse_hex(&p); ++p;
    const int exec = p[2] == 'x';
    p += 5;
    m.off = parse_hex(&p);
    const char* path = memchr(p, '/', (size_t)(end - p));
    if (exec && path) {
      size_t k = (size_t)(end - path);
      if (k >= sizeof m.path) k = sizeof m.path - 1;
      memcpy(m.path, path, k);
      m.path[k] = 0;
      maps[n_maps++] = m;
    }
    line = *end ? end + 1 : end;
  }
}

static int put_code_address(uintptr_t v) {
  for (int i = 0; i < n_maps; ++i)
    if (v >= maps[i].lo && v < maps[i].hi) {
      put(maps[i].path);
      put(" +");
      put_hex(v - maps[i].lo + maps[i].off);
      put("\n");
      return 1;
    }
  return 0;
}

static void on_fatal(int sig, siginfo_t* info, void* context) {
  const ucontext_t* uc = (const ucontext_t*)context;
  const uintptr_t pc = (uintptr_t)uc->uc_mcontext.gregs[REG_RIP], sp = (uintptr_t)uc->uc_mcontext.gregs[REG_RSP];
  put("== fault_backtrace: fatal signal ");
  put(strsignal(sig));
  put(", address ");
  put_hex((uintptr_t)info->si_addr);
  put(", pc ");
  put_hex(pc);
  put("\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  read_maps();
  put("== pc: ");
  if (!put_code_address(pc)) put("(outside every executable mapping)\n");
  put("== code addresses on the stack, innermost first:\n");
  for (const uintptr_t* w = (const uintptr_t*)sp; w < (const uintptr_t*)(sp + 16384); ++w) put_code_address(*w);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* The C++ runtime's throw, wrapped: the stack, then the real __cxa_throw. */
typedef void (*cxa_throw_fn)(void*, void*, void (*)(void*));
void __cxa_throw(void* exception, void* type, void (*destructor)(void*)) {
  static cxa_throw_fn real;
  static int enabled = -1;
  if (!real) real = (cxa_throw_fn)dlsym(RTLD_NEXT, "__cxa_throw");
  if (!real) {  /* a C++ runtime loaded later, out of the global scope (a Python extension's) */
    put("== fault_backtrace: __cxa_throw of this process's C++ runtime not found; preload it only into zero3d\n");
    abort();
  }
  if (enabled < 0) enabled = getenv("FAULT_BACKTRACE_THROW") && getenv("FAULT_BACKTRACE_THROW")[0] == '1';
  if (enabled) {
    void* frames[48];
    put("== fault_backtrace: C++ throw from\n");
    backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
  }
  real(exception, type, destructor);
  __builtin_unreachable();
}

__attribute__((constructor)) static void install(void) {
  const int fatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO;
  for (unsigned i = 0; i < sizeof fatal / sizeof fatal[0]; ++i) sigaction(fatal[i], &sa, NULL);
}
