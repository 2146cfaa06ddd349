#!/bin/sh
# gpu_bundle.sh CUDA_BUILD [CPU_BUILD] — packs what benchmarks/gpu_check.sh runs on a GPU
# machine that has CUDA, cuBLAS and NCCL but neither MPICH, parallel HDF5 nor Kokkos: the CUDA
# build's zero3d, zero3d_gpu_tests, zero3d_device_bench and kernel timer (configure it with
# -DZERO3D_NATIVE=OFF: the GPU machine's CPU may differ), optionally the CPU build's zero3d
# (for the GPU-to-CPU checkpoint check), MPICH's launcher, and every shared library they need
# except glibc's and the CUDA toolkit's. Writes gpu-carry.tar.xz in the current directory;
# pass it to the device's `carry` and run gpu_check.sh there.
set -eu
cuda=${1:?usage: gpu_bundle.sh CUDA_BUILD [CPU_BUILD]}
cpu=${2:-}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/gpu-carry/bin" "$stage/gpu-carry/lib"
cp "$cuda/zero3d" "$cuda/tests/zero3d_gpu_tests" "$cuda/benchmarks/zero3d_device_bench" "$stage/gpu-carry/bin/"
cp "$cuda/benchmarks/libzero3d_kernel_timer.so" "$stage/gpu-carry/lib/"  # the step's kernel table (bf16_breakdown.sh)
[ -n "$cpu" ] && cp "$cpu/zero3d" "$stage/gpu-carry/bin/zero3d-cpu"
for tool in mpiexec.hydra hydra_pmi_proxy; do cp "$(command -v "$tool")" "$stage/gpu-carry/bin/"; done
# a fault's stack for a machine without a debugger (gpu_check.sh preloads it)
cc -O1 -shared -fPIC -o "$stage/gpu-carry/lib/libfault_backtrace.so" "$(dirname "$0")/fault_backtrace.c" -ldl
for exe in "$stage"/gpu-carry/bin/*; do
  ldd "$exe" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libcuda.so*) ;;  # the GPU machine's own
    libcudart*|libcublas*|libnccl*|libcudnn*|libnvrtc*|libnvJitLink*) ;;           # its CUDA toolkit's
    *) cp -L "$lib" "$stage/gpu-carry/lib/" ;;
  esac
done
tar -C "$stage" -cJf gpu-carry.tar.xz gpu-carry
echo "gpu-carry.tar.xz: $(du -h gpu-carry.tar.xz | cut -f1) ($(ls "$stage/gpu-carry/lib" | wc -l) libraries)"
