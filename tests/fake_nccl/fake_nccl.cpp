// fake_nccl.cpp — NCCL over MPI on host memory for the CPU suite (fake_nccl.hpp says what it checks).
#include "fake_nccl.hpp"

#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <utility>

#include "cuda_runtime.h"
#include "kernels/half.hpp"
#include "nccl.h"

struct FakeCudaStream {
  bool ordered = false;  // waited on the compute stream since its last NCCL call
};
struct FakeCudaEvent {
  bool on_compute = false;  // last recorded on the compute stream (the null stream: kernels::compute_stream_handle)
};
struct FakeNcclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1;
  bool world = false;
};

namespace {

fake_nccl::Counts g_counts;
std::string g_error;
std::vector<std::pair<const void*, size_t>> g_host;

struct Region {
  const char* p;
  size_t bytes;
};

// A group in progress: its requests, the copies they read or write, the streams it ordered.
struct Group {
  int depth = 0;
  std::vector<MPI_Request> requests;
  std::vector<std::unique_ptr<std::vector<char>>> temps;
  std::vector<FakeCudaStream*> streams;
  std::vector<Region> sends, recvs;
};
Group g_group;

ncclResult_t refuse(ncclResult_t rc, const std::string& why) {
  g_error = why;
  std::fprintf(stderr, "fake NCCL: %s\n", why.c_str());
  return rc;
}

size_t size_of(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

MPI_Datatype mpi_of(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat16: case ncclBfloat16: return MPI_UINT16_T;
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
  }
  return MPI_DATATYPE_NULL;
}

// NCCL's 16-bit reductions: each pair in fp32, rounded once to the type.
template <typename T, int Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = zero3d::kernels::to_float(a[i]), y = zero3d::kernels::to_float(b[i]);
    const float r = Op == 0 ? x + y : Op == 1 ? (x > y ? x : y) : (x < y ? x : y);
    b[i] = zero3d::kernels::from_float<T>(r);
  }
}

MPI_Op half_mpi_op(ncclDataType_t t, int op) {
  static MPI_Op ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
  using zero3d::kernels::bf16;
  using zero3d::kernels::fp16;
  static MPI_User_function* fns[2][3] = {{&half_op<bf16, 0>, &half_op<bf16, 1>, &half_op<bf16, 2>},
                                         {&half_op<fp16, 0>, &half_op<fp16, 1>, &half_op<fp16, 2>}};
  const int k = t == ncclBfloat16 ? 0 : 1;
  if (ops[k][op] == MPI_OP_NULL) MPI_Op_create(fns[k][op], 1, &ops[k][op]);
  return ops[k][op];
}

bool op_of(ncclRedOp_t op, ncclDataType_t t, MPI_Op* out) {
  const int k = op == ncclSum ? 0 : op == ncclMax ? 1 : op == ncclMin ? 2 : -1;
  if (k < 0) return false;  // the fake carries what comm_nccl.cpp asks for: sum, max, min
  if (t == ncclFloat16 || t == ncclBfloat16) {
    *out = half_mpi_op(t, k);
  } else {
    *out = k == 0 ? MPI_SUM : k == 1 ? MPI_MAX : MPI_MIN;
  }
  return true;
}

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char *x = static_cast<const char*>(a), *y = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// NCCL's rules for a call's buffers: in place only in the form it names, else apart.
ncclResult_t check_buffers(const char* call, const void* send, size_t send_bytes, const void* recv, size_t recv_bytes,
                           const void* in_place_send) {
  if ((send_bytes > 0 && !send) || (recv_bytes > 0 && !recv))
    return refuse(ncclInvalidArgument, std::string(call) + ": a null buffer with elements");
  if (send == in_place_send) return ncclSuccess;
  if (overlap(send, send_bytes, recv, recv_bytes))
    return refuse(ncclInvalidArgument, std::string(call) + ": send and receive buffers overlap other than in place");
  return ncclSuccess;
}

ncclResult_t check_stream(const char* call, cudaStream_t stream) {
  if (!stream) return refuse(ncclInvalidUsage, std::string(call) + ": on the compute stream itself");
  if (!stream->ordered)
    return refuse(ncclInvalidUsage, std::string(call) +
                                        ": its stream was not ordered after the compute stream (cudaStreamWaitEvent on "
                                        "an event recorded there) since its last call");
  if (g_group.depth == 0) {
    stream->ordered = false;
  } else {
    g_group.streams.push_back(stream);
  }
  return ncclSuccess;
}

char* keep_copy(const void* src, size_t bytes) {  // a call's input as it was when the call was made
  g_group.temps.push_back(std::make_unique<std::vector<char>>(static_cast<const char*>(src),
                                                               static_cast<const char*>(src) + bytes));
  return g_group.temps.back()->data();
}

// An MPI call's result as NCCL's. Every call is posted nonblocking (next_request) and completes
// at once outside a group (finish_if_outside), or at ncclGroupEnd inside one.
ncclResult_t run(int rc_mpi, const char* call) {
  if (rc_mpi != MPI_SUCCESS) return refuse(ncclSystemError, std::string(call) + ": MPI failed");
  return ncclSuccess;
}
MPI_Request* next_request() {
  g_group.requests.emplace_back(MPI_REQUEST_NULL);
  return &g_group.requests.back();
}
ncclResult_t finish_if_outside() {
  if (g_group.depth > 0) return ncclSuccess;
  const int rc = MPI_Waitall(static_cast<int>(g_group.requests.size()), g_group.requests.data(), MPI_STATUSES_IGNORE);
  g_group.requests.clear();
  g_group.temps.clear();
  return run(rc, "wait");
}

}  // namespace

namespace fake_nccl {
Counts counts() { return g_counts; }
void set_host_ranges(std::vector<std::pair<const void*, size_t>> ranges) { g_host = std::move(ranges); }
std::string take_error() { return std::exchange(g_error, std::string()); }
}  // namespace fake_nccl

// ---- CUDA runtime ----

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = new FakeCudaStream;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }  // every call has completed when it returns
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (stream && event && event->on_compute) stream->ordered = true;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = new FakeCudaEvent;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  event->on_compute = stream == nullptr;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = {};
  a->type = cudaMemoryTypeDevice;
  for (const auto& [base, bytes] : g_host)
    if (p >= base && static_cast<const char*>(p) < static_cast<const char*>(base) + bytes) a->type = cudaMemoryTypeUnregistered;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "fake CUDA error"; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int) {
  const char* shared = std::getenv("ZERO3D_FAKE_GPU_SHARED");
  const bool one = shared && std::string(shared) == "1";
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:%05d.0", one ? 0 : 1, one ? 0 : static_cast<int>(getpid() % 100000));
  return cudaSuccess;
}

// ---- NCCL ----

ncclResult_t ncclGetVersion(int* version) {
  *version = 22809;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t rc) {
  switch (rc) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    default: return "unhandled system error";
  }
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  std::strcpy(id->internal, "fake NCCL");
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  int world_size = 1, world_rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  if (std::strcmp(id.internal, "fake NCCL") != 0)
    return refuse(ncclInvalidArgument, "ncclCommInitRank: an id no rank got from ncclGetUniqueId");
  if (nranks != world_size || rank != world_rank)
    return refuse(ncclInvalidUsage, "ncclCommInitRank: the fake makes the world's communicator this way only; "
                                    "groups come from ncclCommSplit");
  auto* c = new FakeNcclComm;
  MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi);
  c->rank = rank;
  c->size = nranks;
  c->world = true;
  *comm = c;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  if (g_group.depth > 0) return refuse(ncclInvalidUsage, "ncclCommSplit inside a group");
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &c);
  *newcomm = nullptr;
  if (c == MPI_COMM_NULL) return ncclSuccess;
  auto* n = new FakeNcclComm;
  n->mpi = c;
  MPI_Comm_rank(c, &n->rank);
  MPI_Comm_size(c, &n->size);
  *newcomm = n;
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  const char* dir = std::getenv("ZERO3D_FAKE_NCCL_REPORT");
  if (comm->world && dir) {
    std::ofstream out(std::string(dir) + "/rank" + std::to_string(comm->rank) + ".txt");
    const fake_nccl::Counts& k = g_counts;
    out << "all_reduce " << k.all_reduce << "\nreduce_scatter " << k.reduce_scatter << "\nall_gather " << k.all_gather
        << "\nreduce " << k.reduce << "\nbroadcast " << k.broadcast << "\nsend " << k.send << "\nrecv " << k.recv
        << "\ngroups " << k.groups << "\nbytes " << k.bytes << "\nrefused " << (g_error.empty() ? "none" : g_error) << "\n";
  }
  MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t bytes = count * size_of(t);
  MPI_Op mop;
  if (!op_of(op, t, &mop)) return refuse(ncclInvalidArgument, "ncclAllReduce: an operation the fake does not carry");
  if (ncclResult_t rc = check_buffers("ncclAllReduce", send, bytes, recv, bytes, recv)) return rc;
  if (ncclResult_t rc = check_stream("ncclAllReduce", stream)) return rc;
  ++g_counts.all_reduce;
  g_counts.bytes += static_cast<int64_t>(bytes);
  if (send != recv && bytes > 0) std::memcpy(recv, send, bytes);
  if (ncclResult_t rc = run(MPI_Iallreduce_c(MPI_IN_PLACE, recv, static_cast<MPI_Count>(count), mpi_of(t), mop, comm->mpi,
                                             next_request()),
                            "ncclAllReduce"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  const size_t bytes = recvcount * size_of(t);
  MPI_Op mop;
  if (!op_of(op, t, &mop)) return refuse(ncclInvalidArgument, "ncclReduceScatter: an operation the fake does not carry");
  const char* in_place = static_cast<const char*>(send) + bytes * static_cast<size_t>(comm->rank);
  if (bytes > 0 && (!send || !recv)) return refuse(ncclInvalidArgument, "ncclReduceScatter: a null buffer with elements");
  if (overlap(send, bytes * static_cast<size_t>(comm->size), recv, bytes) && static_cast<const void*>(in_place) != recv)
    return refuse(ncclInvalidArgument, "ncclReduceScatter: the receive buffer overlaps the send buffer other than at send + "
                                       "rank·recvcount");
  if (ncclResult_t rc = check_stream("ncclReduceScatter", stream)) return rc;
  ++g_counts.reduce_scatter;
  g_counts.bytes += static_cast<int64_t>(bytes * static_cast<size_t>(comm->size));
  const char* input = keep_copy(send, bytes * static_cast<size_t>(comm->size));
  if (ncclResult_t rc = run(MPI_Ireduce_scatter_block_c(input, recv, static_cast<MPI_Count>(recvcount), mpi_of(t), mop,
                                                        comm->mpi, next_request()),
                            "ncclReduceScatter"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t bytes = sendcount * size_of(t);
  const char* in_place = static_cast<const char*>(recv) + bytes * static_cast<size_t>(comm->rank);
  if ((bytes > 0 && (!send || !recv)))
    return refuse(ncclInvalidArgument, "ncclAllGather: a null buffer with elements");
  if (static_cast<const void*>(in_place) != send && overlap(send, bytes, recv, bytes * static_cast<size_t>(comm->size)))
    return refuse(ncclInvalidArgument, "ncclAllGather: the send buffer overlaps the receive buffer other than at recv + "
                                       "rank·sendcount");
  if (ncclResult_t rc = check_stream("ncclAllGather", stream)) return rc;
  ++g_counts.all_gather;
  g_counts.bytes += static_cast<int64_t>(bytes);
  const char* input = keep_copy(send, bytes);
  if (ncclResult_t rc = run(MPI_Iallgather_c(input, static_cast<MPI_Count>(sendcount), mpi_of(t), recv,
                                             static_cast<MPI_Count>(sendcount), mpi_of(t), comm->mpi, next_request()),
                            "ncclAllGather"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  const size_t bytes = count * size_of(t);
  MPI_Op mop;
  if (!op_of(op, t, &mop)) return refuse(ncclInvalidArgument, "ncclReduce: an operation the fake does not carry");
  const bool is_root = comm->rank == root;
  if (ncclResult_t rc = check_buffers("ncclReduce", send, bytes, is_root ? recv : nullptr, is_root ? bytes : 0, recv))
    return rc;
  if (g_group.depth > 0) {  // the root's own block may be reduced in place; no other call may touch it
    if (is_root) g_group.recvs.push_back({static_cast<const char*>(recv), bytes});
    if (!is_root || send != recv) g_group.sends.push_back({static_cast<const char*>(send), bytes});
  }
  if (ncclResult_t rc = check_stream("ncclReduce", stream)) return rc;
  ++g_counts.reduce;
  g_counts.bytes += static_cast<int64_t>(bytes);
  const char* input = keep_copy(send, bytes);
  if (ncclResult_t rc = run(MPI_Ireduce_c(input, is_root ? recv : nullptr, static_cast<MPI_Count>(count), mpi_of(t), mop,
                                          root, comm->mpi, next_request()),
                            "ncclReduce"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t bytes = count * size_of(t);
  const bool is_root = comm->rank == root;
  if (ncclResult_t rc = check_buffers("ncclBroadcast", is_root ? send : nullptr, is_root ? bytes : 0, recv, bytes, recv))
    return rc;
  if (g_group.depth > 0) g_group.recvs.push_back({static_cast<const char*>(recv), bytes});
  if (ncclResult_t rc = check_stream("ncclBroadcast", stream)) return rc;
  ++g_counts.broadcast;
  g_counts.bytes += static_cast<int64_t>(bytes);
  if (is_root && send != recv && bytes > 0) std::memcpy(recv, send, bytes);
  if (ncclResult_t rc = run(MPI_Ibcast_c(recv, static_cast<MPI_Count>(count), mpi_of(t), root, comm->mpi, next_request()),
                            "ncclBroadcast"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
  const size_t bytes = count * size_of(t);
  if (bytes > 0 && !send) return refuse(ncclInvalidArgument, "ncclSend: a null buffer with elements");
  if (ncclResult_t rc = check_stream("ncclSend", stream)) return rc;
  if (g_group.depth > 0) g_group.sends.push_back({static_cast<const char*>(send), bytes});
  ++g_counts.send;
  g_counts.bytes += static_cast<int64_t>(bytes);
  constexpr int kTag = 7;  // one tag: a pair's messages match in the order they were issued, as NCCL's do
  if (ncclResult_t rc = run(MPI_Issend_c(send, static_cast<MPI_Count>(count), mpi_of(t), peer, kTag, comm->mpi,
                                         next_request()),
                            "ncclSend"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
  const size_t bytes = count * size_of(t);
  if (bytes > 0 && !recv) return refuse(ncclInvalidArgument, "ncclRecv: a null buffer with elements");
  if (ncclResult_t rc = check_stream("ncclRecv", stream)) return rc;
  if (g_group.depth > 0) g_group.recvs.push_back({static_cast<const char*>(recv), bytes});
  ++g_counts.recv;
  constexpr int kTag = 7;
  if (ncclResult_t rc = run(MPI_Irecv_c(recv, static_cast<MPI_Count>(count), mpi_of(t), peer, kTag, comm->mpi,
                                        next_request()),
                            "ncclRecv"))
    return rc;
  return finish_if_outside();
}

ncclResult_t ncclGroupStart() {
  ++g_group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (g_group.depth == 0) return refuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--g_group.depth > 0) return ncclSuccess;
  // What a group writes must not overlap anything else it reads or writes.
  ncclResult_t rc = ncclSuccess;
  for (size_t i = 0; i < g_group.recvs.size() && rc == ncclSuccess; ++i) {
    for (const Region& s : g_group.sends)
      if (overlap(g_group.recvs[i].p, g_group.recvs[i].bytes, s.p, s.bytes))
        rc = refuse(ncclInvalidArgument, "a group's receive buffer overlaps one of its send buffers");
    for (size_t j = i + 1; j < g_group.recvs.size() && rc == ncclSuccess; ++j)
      if (overlap(g_group.recvs[i].p, g_group.recvs[i].bytes, g_group.recvs[j].p, g_group.recvs[j].bytes))
        rc = refuse(ncclInvalidArgument, "two of a group's receive buffers overlap");
  }
  for (FakeCudaStream* s : g_group.streams) s->ordered = false;
  g_group.streams.clear();
  g_group.sends.clear();
  g_group.recvs.clear();
  ++g_counts.groups;
  const ncclResult_t done = finish_if_outside();
  return rc != ncclSuccess ? rc : done;
}
