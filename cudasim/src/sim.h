// The CUDA simulator's internals, shared by its parts: the device heap and its checks (memory.cpp),
// the execution of a grid on fibers (exec.cpp), streams and graphs (driver.cpp), and the stand-ins
// for NVRTC (nvrtc.cpp), cuBLAS (cublas.cpp) and NCCL (nccl.cpp). One shared object carries them
// all; it is installed under each library's name (libcuda.so, libnvrtc.so, libcublas.so,
// libnccl.so), so cudarc loads it four times and gets one instance.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "abi.h"

namespace sim {

// CUDA driver result codes the simulator returns (the driver's own numbers).
enum Result : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    MISALIGNED_ADDRESS = 716,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    STREAM_CAPTURE_UNSUPPORTED = 900,
    STREAM_CAPTURE_INVALIDATED = 901,
};

// Every device operation (launch, copy, product, collective) runs under this lock, in the calling
// thread, before the call returns: a stream's order is program order, and one block runs at a time
// in the whole process (which is what lets `__shared__` variables be plain statics).
std::recursive_mutex& device_lock();

// Records why the last call failed; cuGetErrorString appends it to the code's own text, so the
// message reaches the Rust error (and it is printed to stderr as it happens).
void fail_detail(const std::string& message);
std::string take_detail();
void clear_detail();
const std::string& peek_detail();

// ---- memory.cpp: the device heap ----

// Reserves the heap on first use; total is CUDASIM_MEMORY_MB (default 4096 MiB).
size_t heap_total();
size_t heap_used();
// A device allocation of `bytes` (256-byte aligned, red zones between allocations); 0 when full.
uint64_t heap_alloc(size_t bytes);
// Frees an allocation made by heap_alloc; false (and a detail) for an address that is not one.
bool heap_free(uint64_t address);
bool in_heap(uint64_t address);

// What a check is for, in messages.
enum class Access { Read, Write };
// Checks that [address, address + bytes) lies inside one live allocation and, for reads, that every
// byte has been written; marks written bytes. Returns SUCCESS or the driver code a GPU would give,
// with a detail naming `who` (a kernel's thread, a copy, a product).
Result check_range(uint64_t address, size_t bytes, Access access, const std::string& who);
// Marks bytes as written (copies from the host, memsets) after check_range accepted them.
void mark_written(uint64_t address, size_t bytes);
// Copies the written-state of `bytes` from one device range to another (device-to-device copies).
void copy_written(uint64_t to, uint64_t from, size_t bytes);
// The hot path for kernels: the same check for one access of 1-16 bytes (see abi.h).
int check_access(uintptr_t address, long bytes, int is_store);
extern std::string access_failure;
// The state a module's hooks read (abi.h); check_access keeps hit_lo/hit_hi there.
extern cudasim_fast fast_state;
// Describes an address for a message: which allocation it falls in or near.
std::string describe(uint64_t address);

// ---- exec.cpp: kernels ----

struct Module;
struct Kernel {
    Module* module;
    const cudasim_kernel_entry* entry;
};

struct Launch {
    Kernel* kernel;
    unsigned grid[3], block[3];
    unsigned shared_bytes;
    // Argument bytes, one buffer per parameter (copied, so a launch can be replayed from a graph).
    std::vector<std::vector<unsigned char>> args;
};

// Loads a module compiled by the simulated NVRTC (`image` is the text it returned as PTX).
Result load_module(const char* image, Module** out);
void unload_module(Module* m);
Result get_kernel(Module* m, const char* name, Kernel** out);
// Runs every block of `launch` to completion (under the device lock).
Result run_launch(const Launch& launch);

// ---- nvrtc.cpp ----
// Compiles a program's source with the host compiler into a module file; returns the "PTX" text
// (which names that file) or fills `log`.
bool compile_program(const std::string& source, const std::string& name, std::string& ptx, std::string& log);

// ---- driver.cpp ----
struct Stream;
// Whether `stream` is being captured; while it is, operations are recorded instead of run.
bool capturing(Stream* stream);
// A host operation for a stream (a product, a collective): runs now, or is recorded while capturing.
Result submit(Stream* stream, std::function<Result()> op);

}  // namespace sim
