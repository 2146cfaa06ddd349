// bench_comm.cpp — bus bandwidth of the communicator's all_reduce / reduce_scatter /
// all_gather against raw MPI calls, 1 KiB .. 256 MiB, nccl-tests convention:
//   algbw = bytes / time;  busbw = algbw · 2(n-1)/n (all_reduce) or · (n-1)/n (the others),
// bytes = the full buffer (all_reduce), the full input (reduce_scatter), the full output
// (all_gather). Run under mpiexec (make bench uses -np 2). Every rank runs the same fixed
// iteration count; the time of an iteration is the slowest rank's; rank 0 reports the median
// of 5 repetitions (shared-memory bandwidth on a busy node varies by ±10% run to run).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <vector>

#include "parallel/comm.hpp"

using namespace zero3d;

namespace {

// The _v forms are what ZeRO uses: per-rank counts (equal here) through the async path.
// AllReduceBf16: the same bytes summed as bf16 (the ring's path from 256 KiB; no raw MPI peer,
// MPI has no bf16 type).
enum Op { AllReduce, ReduceScatter, AllGather, ReduceScatterV, AllGatherV, AllReduceBf16 };
enum Impl { Communicator_, RawMpi };

void run_op(Op op, Impl impl, MpiCommunicator& comm, float* a, float* b, int64_t elems) {
  const int n = comm.size();
  switch (op) {
    case AllReduce:
      if (impl == RawMpi) MPI_Allreduce(MPI_IN_PLACE, a, static_cast<int>(elems), MPI_FLOAT, MPI_SUM, comm.comm());
      else comm.all_reduce(a, elems, DType::F32, ReduceOp::Sum);
      break;
    case AllReduceBf16:
      comm.all_reduce(a, elems * 2, DType::BF16, ReduceOp::Sum);
      break;
    case ReduceScatter:
      if (impl == RawMpi) MPI_Reduce_scatter_block(a, b, static_cast<int>(elems / n), MPI_FLOAT, MPI_SUM, comm.comm());
      else comm.reduce_scatter(a, b, elems / n, DType::F32, ReduceOp::Sum);
      break;
    case AllGather:
      if (impl == RawMpi)
        MPI_Allgather(b, static_cast<int>(elems / n), MPI_FLOAT, a, static_cast<int>(elems / n), MPI_FLOAT, comm.comm());
      else comm.all_gather(b, a, elems / n, DType::F32);
      break;
    case ReduceScatterV: {
      std::vector<int> counts(n, static_cast<int>(elems / n));
      if (impl == RawMpi) MPI_Reduce_scatter(a, b, counts.data(), MPI_FLOAT, MPI_SUM, comm.comm());
      else comm.reduce_scatter_v_async(a, b, std::vector<int64_t>(n, elems / n), DType::F32, ReduceOp::Sum)->wait();
      break;
    }
    case AllGatherV: {
      std::vector<int> counts(n, static_cast<int>(elems / n)), displs(n);
      std::vector<int64_t> c64(n, elems / n), d64(n);
      for (int r = 0; r < n; ++r) d64[r] = displs[r] = static_cast<int>(r * (elems / n));
      if (impl == RawMpi)
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, a, counts.data(), displs.data(), MPI_FLOAT, comm.comm());
      else comm.all_gather_v_async(a, c64, d64, DType::F32)->wait();
      break;
    }
  }
}

void BM_Collective(benchmark::State& state, Op op, Impl impl) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int n = comm.size();
  const int64_t bytes = state.range(0);
  const int64_t elems = std::max<int64_t>(n, bytes / 4 / n * n);
  std::vector<float> a(elems, 1.0f), b(elems / n + 1, 1.0f);
  run_op(op, impl, comm, a.data(), b.data(), elems);  // warm-up, also aligns the ranks
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    run_op(op, impl, comm, a.data(), b.data(), elems);
    double t = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    state.SetIterationTime(t);
  }
  const double factor = n == 1 ? 1.0 : (op == AllReduce || op == AllReduceBf16 ? 2.0 * (n - 1) / n : double(n - 1) / n);  // nccl-tests
  state.counters["busbw_GB/s"] = benchmark::Counter(double(elems) * 4 * factor / 1e9,
                                                    benchmark::Counter::kIsIterationInvariantRate);
  state.SetBytesProcessed(state.iterations() * elems * 4);
}

// Every rank registers the same list with the same fixed iteration counts (Google Benchmark
// would otherwise choose counts per rank and the collectives would not line up).
void register_all() {
  const struct {
    const char* name;
    Op op;
  } ops[] = {{"all_reduce", AllReduce},           {"reduce_scatter", ReduceScatter}, {"all_gather", AllGather},
             {"reduce_scatter_v", ReduceScatterV}, {"all_gather_v", AllGatherV}, {"all_reduce_bf16", AllReduceBf16}};
  for (const auto& o : ops)
    for (int64_t bytes = 1 << 10; bytes <= (int64_t(256) << 20); bytes *= 4)
      for (Impl impl : {Communicator_, RawMpi}) {
        if (o.op == AllReduceBf16 && impl == RawMpi) continue;
        const std::string name = std::string(o.name) + (impl == RawMpi ? "/raw_mpi" : "/communicator");
        benchmark::RegisterBenchmark(name.c_str(), BM_Collective, o.op, impl)
            ->Arg(bytes)
            ->Iterations(std::clamp<int64_t>((int64_t(1) << 30) / bytes, 16, 2000))
            ->Repetitions(5)
            ->ReportAggregatesOnly(true)
            ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); })
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
}

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  register_all();
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  Kokkos::finalize();
  MPI_Finalize();
  return 0;
}
