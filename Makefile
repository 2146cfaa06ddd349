# zero3d — the two commands a user needs: `make run` and `make test`.
# Both install missing Debian packages first (root, Debian bookworm), then configure and build.

BUILD_DIR ?= build
NP        ?= 2
JOBS      ?= $(shell nproc)
CONFIG    ?= input/quickstart.json

# Packages the build needs; torch is only for regenerating golden files (tests/golden/make_goldens.py).
DEB_PACKAGES := cmake g++ make mpich libmpich-dev libtrilinos-kokkos-dev libopenblas-dev \
                libhdf5-mpich-dev hdf5-tools nlohmann-json3-dev libcli11-dev libgtest-dev \
                libbenchmark-dev libdnnl-dev liburing-dev strace \
                libsentencepiece-dev sentencepiece

export OPENBLAS_NUM_THREADS := 1
export OMP_NUM_THREADS := 1

.PHONY: all deps configure build run test sanitize bench goldens tokenizer-goldens clean

all: build

deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing missing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release

configure: deps $(BUILD_DIR)/CMakeCache.txt

# `make run` builds the program alone; `make test` builds it with the test suite and the
# benchmarks (compiled, not run, so that a benchmark that stops building fails CI) and runs ctest.
build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target zero3d

run: build
	mpirun -np $(NP) $(BUILD_DIR)/zero3d train $(CONFIG)

test: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target zero3d_test_suite zero3d_benchmarks
	cd $(BUILD_DIR) && ctest --output-on-failure -j 1

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer: configures
# $(SANITIZE_DIR) with -DZERO3D_SANITIZE=ON (every target compiled and linked with
# -fsanitize=address,undefined), builds it and runs ctest there. Runtime options:
#   detect_leaks=0     LeakSanitizer is off: every `mpiexec -np 2 zero3d train` reports ~1 KB
#                      "leaked" from a module MPICH/UCX dlopen()ed and unloaded (<unknown module>,
#                      calloc) and turns exit 0 into 1; MPI_Abort paths never free either. Nothing
#                      zero3d can fix; use-after-free, overflows and the rest of ASan stay on.
#   halt_on_error=1    UBSan stops at the first report instead of printing a line and going on,
#                      so undefined behaviour fails its test.
#   exitcode=86        a sanitizer report is not mistaken for zero3d's own exit 1 or 2 (the CLI
#                      tests check exit codes through mpiexec).
# (The same defaults are linked into the binaries: src/sanitize/defaults.cpp.) TEST_TMPDIR
# gives the tests their own scratch directory, so that a `make test` running at the same time
# does not overwrite their files under /tmp.
SANITIZE_DIR ?= build-sanitize
SANITIZE_ENV := ASAN_OPTIONS=detect_leaks=0:exitcode=86 \
                UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=86 \
                TEST_TMPDIR=$(CURDIR)/$(SANITIZE_DIR)/tmp/

sanitize: deps
	cmake -S . -B $(SANITIZE_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZERO3D_SANITIZE=ON -DZERO3D_BUILD_BENCHMARKS=OFF
	cmake --build $(SANITIZE_DIR) -j $(JOBS)
	mkdir -p $(SANITIZE_DIR)/tmp
	cd $(SANITIZE_DIR) && $(SANITIZE_ENV) ctest --output-on-failure -j 1

bench: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target zero3d zero3d_benchmarks
	$(BUILD_DIR)/benchmarks/zero3d_bench --benchmark_min_time=0.2
	mpirun -np $(NP) $(BUILD_DIR)/benchmarks/zero3d_comm_bench

# The tokenizer parity goldens: token ids from js-tiktoken and @huggingface/tokenizers under Node
# (fetched by `npm pack` into $(BUILD_DIR)/npm, sha256 checked; tests/CMakeLists.txt).
tokenizer-goldens: configure
	cmake --build $(BUILD_DIR) --target zero3d_tokenizer_references
	node tests/golden/make_tokenizer_goldens.js $(BUILD_DIR)/npm/node_modules tests/golden/tokenizer_goldens.json

goldens:
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_moe_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_sparse_attention_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_llama_kernels_golden.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_llama_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_mixtral_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_generate_goldens.py tests/golden
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_dropout_goldens.py tests/golden

clean:
	rm -rf $(BUILD_DIR)
