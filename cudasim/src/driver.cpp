// The CUDA driver API calls cudarc makes, over the simulated device. Work is done at once, in the
// calling thread, under the device lock: a stream's operations happen in program order, which is all
// that one stream guarantees on a GPU. A stream being captured records its operations into a graph
// instead, refusing what CUDA refuses during a capture (synchronizing, copies with pageable host
// memory), and a graph launch replays the recording.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <chrono>
#include <memory>

#include "sim.h"

namespace sim {

std::recursive_mutex& device_lock() {
    static std::recursive_mutex m;
    return m;
}

namespace {
thread_local std::string last_detail;
}

void fail_detail(const std::string& message) {
    last_detail = message;
    if (!getenv("CUDASIM_QUIET")) fprintf(stderr, "%s\n", message.c_str());
}

std::string take_detail() {
    std::string d;
    d.swap(last_detail);
    return d;
}

void clear_detail() { last_detail.clear(); }
const std::string& peek_detail() { return last_detail; }

struct Graph {
    std::vector<std::function<Result()>> ops;
};

struct Stream {
    bool capturing = false;
    bool invalidated = false;
    Graph* graph = nullptr;
};

bool capturing(Stream* s) { return s && s->capturing; }

Result submit(Stream* s, std::function<Result()> op) {
    if (s && s->capturing) {
        s->graph->ops.push_back(std::move(op));
        return SUCCESS;
    }
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    return op();
}

}  // namespace sim

using namespace sim;

namespace {

Stream default_stream;

Stream* stream_of(void* s) {
    // The legacy and per-thread default streams (0, 1, 2) are one stream here.
    return (uintptr_t)s <= 2 ? &default_stream : (Stream*)s;
}

int device_count() {
    const char* v = getenv("CUDASIM_DEVICES");
    int n = v ? atoi(v) : 1;
    return n < 0 ? 0 : n;
}

struct Context {
    int device;
};
Context contexts[16];
thread_local Context* current_context = nullptr;
bool initialized = false;

// Every stream, so that a context-wide synchronization can refuse while any is capturing.
std::vector<Stream*>& streams() {
    static std::vector<Stream*> all{&default_stream};
    return all;
}

Result refuse_while_capturing(Stream* s, const char* what) {
    if (!capturing(s)) return SUCCESS;
    s->invalidated = true;
    fail_detail(std::string("cudasim: ") + what +
                " on a stream that is being captured into a CUDA graph (CUDA refuses this and invalidates the capture)");
    return STREAM_CAPTURE_UNSUPPORTED;
}

struct Event {
    std::chrono::steady_clock::time_point at;
};

}  // namespace

extern "C" {

typedef unsigned long long CUdeviceptr;

int cuInit(unsigned) {
    initialized = true;
    return SUCCESS;
}

int cuDriverGetVersion(int* v) {
    *v = 12080;
    return SUCCESS;
}

int cuDeviceGetCount(int* n) {
    *n = device_count();
    return SUCCESS;
}

int cuDeviceGet(int* device, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count() || ordinal >= 16) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

int cuDeviceGetName(char* name, int len, int) {
    snprintf(name, len, "ndscope CUDA simulator (CPU)");
    return SUCCESS;
}

int cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = heap_total();
    return SUCCESS;
}

int cuDeviceGetUuid(unsigned char* uuid, int device) {
    memset(uuid, 0, 16);
    uuid[0] = (unsigned char)device;
    return SUCCESS;
}
int cuDeviceGetUuid_v2(unsigned char* uuid, int device) { return cuDeviceGetUuid(uuid, device); }

int cuDeviceGetAttribute(int* value, int attribute, int) {
    switch (attribute) {
    case 1: *value = 1024; return SUCCESS;         // max threads per block
    case 2: *value = 1024; return SUCCESS;         // max block x
    case 3: *value = 1024; return SUCCESS;         // max block y
    case 4: *value = 64; return SUCCESS;           // max block z
    case 5: *value = 2147483647; return SUCCESS;   // max grid x
    case 6: *value = 65535; return SUCCESS;        // max grid y
    case 7: *value = 65535; return SUCCESS;        // max grid z
    case 8: *value = 49152; return SUCCESS;        // shared memory per block
    case 10: *value = 32; return SUCCESS;          // warp size
    case 16: *value = 132; return SUCCESS;         // multiprocessors
    case 75: *value = 9; return SUCCESS;           // compute capability major (an H100's)
    case 76: *value = 0; return SUCCESS;           // minor
    case 115: *value = 1; return SUCCESS;          // memory pools (cuMemAllocAsync)
    default: *value = 0; return SUCCESS;
    }
}

int cuDevicePrimaryCtxRetain(void** ctx, int device) {
    if (device < 0 || device >= device_count() || device >= 16) return INVALID_DEVICE;
    contexts[device].device = device;
    *ctx = &contexts[device];
    return SUCCESS;
}
int cuDevicePrimaryCtxRelease_v2(int) { return SUCCESS; }
int cuDevicePrimaryCtxRelease(int) { return SUCCESS; }

int cuCtxGetCurrent(void** ctx) {
    *ctx = current_context;
    return SUCCESS;
}
int cuCtxSetCurrent(void* ctx) {
    current_context = (Context*)ctx;
    return SUCCESS;
}
int cuCtxPushCurrent_v2(void* ctx) { return cuCtxSetCurrent(ctx); }
int cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = current_context;
    return SUCCESS;
}
int cuCtxGetDevice(int* device) {
    if (!current_context) return INVALID_CONTEXT;
    *device = current_context->device;
    return SUCCESS;
}
int cuCtxSynchronize() {
    for (Stream* s : streams()) {
        Result r = refuse_while_capturing(s, "cuCtxSynchronize");
        if (r != SUCCESS) return r;
    }
    return SUCCESS;
}

// ---- memory ----

int cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    *total = heap_total();
    *free_bytes = heap_total() - heap_used();
    return SUCCESS;
}

int cuMemAlloc_v2(CUdeviceptr* out, size_t bytes) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    if (bytes == 0) return INVALID_VALUE;
    *out = heap_alloc(bytes);
    return *out ? SUCCESS : OUT_OF_MEMORY;
}

int cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    return heap_free(p) ? SUCCESS : INVALID_VALUE;
}

int cuMemAllocAsync(CUdeviceptr* out, size_t bytes, void* stream) {
    Stream* s = stream_of(stream);
    if (capturing(s)) {
        s->invalidated = true;
        fail_detail("cudasim: cuMemAllocAsync inside a CUDA graph capture (graph memory nodes are not simulated; "
                    "a captured step should allocate nothing)");
        return STREAM_CAPTURE_UNSUPPORTED;
    }
    return cuMemAlloc_v2(out, bytes);
}

int cuMemFreeAsync(CUdeviceptr p, void* stream) {
    Stream* s = stream_of(stream);
    if (capturing(s)) {
        s->invalidated = true;
        fail_detail("cudasim: cuMemFreeAsync inside a CUDA graph capture (graph memory nodes are not simulated)");
        return STREAM_CAPTURE_UNSUPPORTED;
    }
    return cuMemFree_v2(p);
}

int cuDeviceGetDefaultMemPool(void** pool, int) {
    static int the_pool;
    *pool = &the_pool;
    return SUCCESS;
}
int cuMemPoolTrimTo(void*, size_t) { return SUCCESS; }

int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
    Stream* s = stream_of(stream);
    Result r = refuse_while_capturing(s, "a copy from pageable host memory (cuMemcpyHtoDAsync)");
    if (r != SUCCESS) return r;
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    r = check_range(dst, bytes, Access::Write, "cudasim: a copy to the device");
    if (r != SUCCESS) return r;
    memcpy((void*)dst, src, bytes);
    return SUCCESS;
}
int cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) { return cuMemcpyHtoDAsync_v2(dst, src, bytes, nullptr); }

int cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
    Stream* s = stream_of(stream);
    Result r = refuse_while_capturing(s, "a copy to pageable host memory (cuMemcpyDtoHAsync)");
    if (r != SUCCESS) return r;
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    r = check_range(src, bytes, Access::Read, "cudasim: a copy to the host");
    if (r != SUCCESS) return r;
    memcpy(dst, (const void*)src, bytes);
    return SUCCESS;
}
int cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) { return cuMemcpyDtoHAsync_v2(dst, src, bytes, nullptr); }

int cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream) {
    return submit(stream_of(stream), [=]() -> Result {
        Result r = check_range(src, bytes, Access::Read, "cudasim: a device-to-device copy");
        if (r != SUCCESS) return r;
        r = check_range(dst, bytes, Access::Write, "cudasim: a device-to-device copy");
        if (r != SUCCESS) return r;
        memmove((void*)dst, (const void*)src, bytes);
        return SUCCESS;
    });
}
int cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) { return cuMemcpyDtoDAsync_v2(dst, src, bytes, nullptr); }

int cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, void* stream) {
    return submit(stream_of(stream), [=]() -> Result {
        Result r = check_range(dst, n, Access::Write, "cudasim: cuMemsetD8");
        if (r == SUCCESS) memset((void*)dst, value, n);
        return r;
    });
}
int cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) { return cuMemsetD8Async(dst, value, n, nullptr); }
int cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t n, void* stream) {
    return submit(stream_of(stream), [=]() -> Result {
        Result r = check_range(dst, n * 4, Access::Write, "cudasim: cuMemsetD32");
        if (r == SUCCESS) {
            for (size_t i = 0; i < n; ++i) memcpy((char*)dst + 4 * i, &value, 4);
        }
        return r;
    });
}
int cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t n) { return cuMemsetD32Async(dst, value, n, nullptr); }

// ---- streams and events ----

int cuStreamCreate(void** out, unsigned) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    Stream* s = new Stream;
    streams().push_back(s);
    *out = s;
    return SUCCESS;
}
int cuStreamCreateWithPriority(void** out, unsigned flags, int) { return cuStreamCreate(out, flags); }

int cuStreamDestroy_v2(void* stream) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    Stream* s = stream_of(stream);
    if (s == &default_stream) return SUCCESS;
    auto& all = streams();
    for (size_t i = 0; i < all.size(); ++i) {
        if (all[i] == s) {
            all.erase(all.begin() + i);
            delete s->graph;
            delete s;
            return SUCCESS;
        }
    }
    return INVALID_HANDLE;
}

int cuStreamSynchronize(void* stream) { return refuse_while_capturing(stream_of(stream), "cuStreamSynchronize"); }
int cuStreamQuery(void* stream) { return refuse_while_capturing(stream_of(stream), "cuStreamQuery"); }
int cuStreamWaitEvent(void*, void*, unsigned) { return SUCCESS; }

int cuEventCreate(void** out, unsigned) {
    *out = new Event{std::chrono::steady_clock::now()};
    return SUCCESS;
}
int cuEventRecord(void* e, void*) {
    ((Event*)e)->at = std::chrono::steady_clock::now();
    return SUCCESS;
}
int cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
int cuEventSynchronize(void*) { return SUCCESS; }
int cuEventQuery(void*) { return SUCCESS; }
int cuEventElapsedTime(float* ms, void* start, void* end) {
    *ms = std::chrono::duration<float, std::milli>(((Event*)end)->at - ((Event*)start)->at).count();
    return SUCCESS;
}
int cuEventElapsedTime_v2(float* ms, void* start, void* end) { return cuEventElapsedTime(ms, start, end); }
int cuEventDestroy_v2(void* e) {
    delete (Event*)e;
    return SUCCESS;
}

// ---- graphs ----

int cuStreamBeginCapture_v2(void* stream, int) {
    Stream* s = stream_of(stream);
    if (s->capturing) {
        fail_detail("cudasim: cuStreamBeginCapture on a stream that is already being captured");
        return STREAM_CAPTURE_UNSUPPORTED;
    }
    s->capturing = true;
    s->invalidated = false;
    s->graph = new Graph;
    return SUCCESS;
}

int cuStreamEndCapture(void* stream, void** graph) {
    Stream* s = stream_of(stream);
    if (!s->capturing) {
        fail_detail("cudasim: cuStreamEndCapture on a stream that is not being captured");
        return STREAM_CAPTURE_INVALIDATED;
    }
    s->capturing = false;
    Graph* g = s->graph;
    s->graph = nullptr;
    if (s->invalidated) {
        delete g;
        *graph = nullptr;
        fail_detail("cudasim: the capture was invalidated by an operation CUDA refuses while capturing");
        return STREAM_CAPTURE_INVALIDATED;
    }
    *graph = g;
    return SUCCESS;
}

int cuStreamIsCapturing(void* stream, int* status) {
    Stream* s = stream_of(stream);
    *status = !s->capturing ? 0 : (s->invalidated ? 2 : 1);
    return SUCCESS;
}

int cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new Graph(*(Graph*)graph);
    return SUCCESS;
}
int cuGraphInstantiate_v2(void** exec, void* graph, void*, char*, size_t) {
    return cuGraphInstantiateWithFlags(exec, graph, 0);
}
int cuGraphUpload(void*, void*) { return SUCCESS; }
int cuGraphLaunch(void* exec, void* stream) {
    Graph* g = (Graph*)exec;
    Stream* s = stream_of(stream);
    if (capturing(s)) {
        Graph copy = *g;
        s->graph->ops.insert(s->graph->ops.end(), copy.ops.begin(), copy.ops.end());
        return SUCCESS;
    }
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    for (auto& op : g->ops) {
        Result r = op();
        if (r != SUCCESS) return r;
    }
    return SUCCESS;
}
int cuGraphExecDestroy(void* exec) {
    delete (Graph*)exec;
    return SUCCESS;
}
int cuGraphDestroy(void* graph) {
    delete (Graph*)graph;
    return SUCCESS;
}

// ---- modules and launches ----

int cuModuleLoadData(void** module, const void* image) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    return load_module((const char*)image, (Module**)module);
}
int cuModuleLoadDataEx(void** module, const void* image, unsigned, void*, void*) { return cuModuleLoadData(module, image); }
int cuModuleUnload(void* module) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    unload_module((Module*)module);
    return SUCCESS;
}
int cuModuleGetFunction(void** f, void* module, const char* name) {
    return get_kernel((Module*)module, name, (Kernel**)f);
}
int cuFuncGetAttribute(int* value, int attribute, void*) {
    *value = attribute == 0 ? 1024 : 0;  // max threads per block; nothing else is modelled
    return SUCCESS;
}
int cuFuncSetAttribute(void*, int, int) { return SUCCESS; }

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void* stream, void** params, void** extra) {
    Kernel* k = (Kernel*)f;
    clear_detail();
    if (extra) {
        fail_detail(std::string("cudasim: launch of `") + k->entry->name + "` with `extra` arguments (not simulated)");
        return INVALID_VALUE;
    }
    auto launch = std::make_shared<Launch>();
    launch->kernel = k;
    launch->grid[0] = gx, launch->grid[1] = gy, launch->grid[2] = gz;
    launch->block[0] = bx, launch->block[1] = by, launch->block[2] = bz;
    launch->shared_bytes = shared;
    for (int i = 0; i < k->entry->nparams; ++i) {
        const unsigned char* p = (const unsigned char*)params[i];
        launch->args.emplace_back(p, p + k->entry->param_sizes[i]);
    }
    return submit(stream_of(stream), [launch]() { return run_launch(*launch); });
}

// ---- errors ----

static const char* error_text(int code) {
    switch (code) {
    case SUCCESS: return "no error";
    case INVALID_VALUE: return "invalid argument";
    case OUT_OF_MEMORY: return "out of memory";
    case NOT_INITIALIZED: return "initialization error";
    case NO_DEVICE: return "no CUDA-capable device is detected";
    case INVALID_DEVICE: return "invalid device ordinal";
    case INVALID_IMAGE: return "device kernel image is invalid";
    case INVALID_CONTEXT: return "invalid device context";
    case INVALID_HANDLE: return "invalid resource handle";
    case NOT_FOUND: return "named symbol not found";
    case ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
    case LAUNCH_OUT_OF_RESOURCES: return "too many resources requested for launch";
    case MISALIGNED_ADDRESS: return "misaligned address";
    case LAUNCH_FAILED: return "unspecified launch failure";
    case NOT_SUPPORTED: return "operation not supported";
    case STREAM_CAPTURE_UNSUPPORTED: return "operation not permitted when stream is capturing";
    case STREAM_CAPTURE_INVALIDATED: return "operation failed due to a previous error during capture";
    default: return "unknown error";
    }
}

static const char* error_name(int code) {
    switch (code) {
    case SUCCESS: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case MISALIGNED_ADDRESS: return "CUDA_ERROR_MISALIGNED_ADDRESS";
    case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    default: return "CUDA_ERROR_UNKNOWN";
    }
}

// The code's text, followed by the simulator's account of the last failure on this thread: cudarc
// formats its errors with this call, so the account reaches ndscope's error message.
int cuGetErrorString(int code, const char** out) {
    static thread_local std::string text;
    const std::string& detail = peek_detail();
    text = error_text(code);
    if (!detail.empty()) text += " [" + detail + "]";
    *out = text.c_str();
    return SUCCESS;
}

int cuGetErrorName(int code, const char** out) {
    *out = error_name(code);
    return SUCCESS;
}

}  // extern "C"
