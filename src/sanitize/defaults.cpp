// defaults.cpp — sanitizer runtime defaults, linked into every executable of a
// -DZERO3D_SANITIZE=ON build (CMakeLists.txt), so that the binaries behave the same under
// ctest, under `make sanitize` and when run by hand (ASAN_OPTIONS/UBSAN_OPTIONS still win):
//   detect_leaks=0   MPICH/UCX leave ~1 KB allocated by a module they dlopen()ed and unloaded
//                    (<unknown module>), reported on every MPI run and turning exit 0 into 1;
//   exitcode=86      a sanitizer report is not mistaken for zero3d's own exit codes 1 and 2;
//   halt_on_error=1  undefined behaviour fails the run instead of printing a line.
extern "C" const char* __asan_default_options() { return "detect_leaks=0:exitcode=86"; }
extern "C" const char* __ubsan_default_options() { return "halt_on_error=1:print_stacktrace=1:exitcode=86"; }
