// NCCL at a world of one: a communicator of one rank, whose collectives copy their input to their
// output (a sum, mean, maximum or minimum over one rank is the value itself), ordered on the stream
// like every other device operation and checked like a kernel's accesses. A communicator of more
// ranks is refused: the simulator runs one process's device.
#include <string.h>

#include "sim.h"

using namespace sim;

namespace {
enum { NCCL_SUCCESS = 0, NCCL_INVALID_ARGUMENT = 4, NCCL_INVALID_USAGE = 5 };
struct Comm {
    int rank;
};
size_t type_size(int t) {
    switch (t) {
    case 0: case 1: return 1;   // int8, uint8
    case 2: case 3: return 4;   // int32, uint32
    case 4: case 5: return 8;   // int64, uint64
    case 6: return 2;           // float16
    case 7: return 4;           // float32
    case 8: return 8;           // float64
    case 9: return 2;           // bfloat16
    default: return 0;
    }
}
Stream* stream_of(void* s) { return (uintptr_t)s <= 2 ? nullptr : (Stream*)s; }

int copy(const char* what, uint64_t send, uint64_t recv, size_t count, int type, void* comm, void* stream) {
    if (!comm) return NCCL_INVALID_ARGUMENT;
    size_t es = type_size(type);
    if (!es) {
        fail_detail(std::string("cudasim: ") + what + " with an unknown NCCL data type");
        return NCCL_INVALID_ARGUMENT;
    }
    size_t bytes = count * es;
    Result r = submit(stream_of(stream), [=]() -> Result {
        std::string who = std::string("cudasim: NCCL ") + what;
        Result r = check_range(send, bytes, Access::Read, who);
        if (r == SUCCESS) r = check_range(recv, bytes, Access::Write, who);
        if (r == SUCCESS && send != recv) memmove((void*)recv, (const void*)send, bytes);
        return r;
    });
    return r == SUCCESS ? NCCL_SUCCESS : NCCL_INVALID_USAGE;
}
}  // namespace

extern "C" {

int ncclGetVersion(int* v) {
    *v = 23000;
    return NCCL_SUCCESS;
}
int ncclGetUniqueId(unsigned char* id) {
    memset(id, 0, 128);
    memcpy(id, "cudasim", 7);
    return NCCL_SUCCESS;
}
int ncclCommInitRank(void** comm, int nranks, unsigned char*, int rank) {
    if (nranks != 1 || rank != 0) {
        fail_detail("cudasim: an NCCL communicator of " + std::to_string(nranks) +
                    " ranks; the simulator runs a world of one (rank 0 of 1)");
        return NCCL_INVALID_USAGE;
    }
    *comm = new Comm{0};
    return NCCL_SUCCESS;
}
int ncclCommInitAll(void** comms, int n, const int*) {
    if (n != 1) return NCCL_INVALID_USAGE;
    comms[0] = new Comm{0};
    return NCCL_SUCCESS;
}
int ncclCommDestroy(void* comm) {
    delete (Comm*)comm;
    return NCCL_SUCCESS;
}
int ncclCommAbort(void* comm) { return ncclCommDestroy(comm); }
int ncclCommFinalize(void*) { return NCCL_SUCCESS; }
int ncclCommCount(void*, int* n) {
    *n = 1;
    return NCCL_SUCCESS;
}
int ncclCommUserRank(void*, int* rank) {
    *rank = 0;
    return NCCL_SUCCESS;
}
int ncclCommCuDevice(void*, int* device) {
    *device = 0;
    return NCCL_SUCCESS;
}
int ncclCommGetAsyncError(void*, int* error) {
    *error = NCCL_SUCCESS;
    return NCCL_SUCCESS;
}
int ncclGroupStart() { return NCCL_SUCCESS; }
int ncclGroupEnd() { return NCCL_SUCCESS; }
const char* ncclGetErrorString(int code) {
    switch (code) {
    case NCCL_SUCCESS: return "no error";
    case NCCL_INVALID_ARGUMENT: return "invalid argument";
    default: return "invalid usage (see the simulator's message on stderr)";
    }
}
const char* ncclGetLastError(void*) { return peek_detail().c_str(); }

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int, void* comm, void* stream) {
    return copy("all-reduce", (uint64_t)send, (uint64_t)recv, count, type, comm, stream);
}
int ncclReduce(const void* send, void* recv, size_t count, int type, int, int, void* comm, void* stream) {
    return copy("reduce", (uint64_t)send, (uint64_t)recv, count, type, comm, stream);
}
int ncclBroadcast(const void* send, void* recv, size_t count, int type, int, void* comm, void* stream) {
    return copy("broadcast", (uint64_t)send, (uint64_t)recv, count, type, comm, stream);
}
int ncclBcast(void* buf, size_t count, int type, int, void* comm, void* stream) {
    return copy("broadcast", (uint64_t)buf, (uint64_t)buf, count, type, comm, stream);
}
int ncclAllGather(const void* send, void* recv, size_t count, int type, void* comm, void* stream) {
    return copy("all-gather", (uint64_t)send, (uint64_t)recv, count, type, comm, stream);
}
int ncclReduceScatter(const void* send, void* recv, size_t count, int type, int, void* comm, void* stream) {
    return copy("reduce-scatter", (uint64_t)send, (uint64_t)recv, count, type, comm, stream);
}

}  // extern "C"
