# zero3d — the two commands a user needs: `make run` and `make test`.
# Both install missing Debian packages first (root, Debian bookworm), then configure and build.

BUILD_DIR ?= build
NP        ?= 2
JOBS      ?= $(shell nproc)
CONFIG    ?= input/quickstart.json

# Packages the build needs; torch is only for regenerating golden files (tests/golden/make_goldens.py).
DEB_PACKAGES := cmake g++ make mpich libmpich-dev libtrilinos-kokkos-dev libopenblas-dev \
                libhdf5-mpich-dev hdf5-tools nlohmann-json3-dev libcli11-dev libgtest-dev \
                libbenchmark-dev libdnnl-dev

export OPENBLAS_NUM_THREADS := 1
export OMP_NUM_THREADS := 1

.PHONY: all deps configure build run test bench goldens clean

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

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

run: build
	mpirun -np $(NP) $(BUILD_DIR)/zero3d train $(CONFIG)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j 1

bench: build
	$(BUILD_DIR)/benchmarks/zero3d_bench --benchmark_min_time=0.2
	mpirun -np $(NP) $(BUILD_DIR)/benchmarks/zero3d_comm_bench

goldens:
	OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_goldens.py tests/golden

clean:
	rm -rf $(BUILD_DIR)
