// The simulated device, as a CUDA program sees it: prepended by the simulator's NVRTC to the program's
// source, which the host C++ compiler then builds into a module. It maps CUDA's qualifiers and
// built-ins to host C++ and to calls into the simulator's runtime (cudasim_rt):
//
// - `threadIdx`, `blockIdx`, `blockDim`, `gridDim` are module globals the runtime sets for the
//   thread it switches to (each CUDA thread is a fiber; a fiber only changes at a barrier or a warp
//   exchange, so a value the compiler keeps in a register stays right);
// - `__shared__` variables are statics: one block runs at a time in the whole process;
// - `__syncthreads`, `__syncwarp` and the shuffles are barriers in the runtime's scheduler, so a
//   missing barrier changes the result as it would on a GPU, and a barrier reached by part of a block
//   or a shuffle naming an inactive lane is an error;
// - every load and store through a pointer is checked by the runtime (the module is compiled with
//   GCC's outline address-sanitizer calls, which land in the __asan_* functions below): outside its
//   allocation, unaligned, never written (reads), or host memory.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "abi.h"

// NVRTC has no INFINITY or NAN; nor should the simulated programs.
#undef INFINITY
#undef NAN
#undef HUGE_VAL

extern "C" {
extern cudasim_api cudasim_rt;
extern cudasim_uint3 cudasim_thread_idx, cudasim_block_idx, cudasim_block_dim, cudasim_grid_dim;
}

typedef cudasim_uint3 uint3;
struct dim3 {
    unsigned x, y, z;
};

#define threadIdx cudasim_thread_idx
#define blockIdx cudasim_block_idx
#define blockDim cudasim_block_dim
#define gridDim cudasim_grid_dim
#define warpSize 32

// During the simulator's scan of a program, kernels keep a marker the scan finds after
// preprocessing (their names may come from macros); in the real build the marker is nothing.
#ifdef CUDASIM_SCAN
#define __global__ CUDASIM_GLOBAL_MARK
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __shared__ static
#define __constant__ static const
#define __launch_bounds__(...)

#define __syncthreads() cudasim_rt.syncthreads(__FILE__, __LINE__)

namespace cudasim {
template <typename T> inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp exchanges carry up to 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    return bits;
}
template <typename T> inline T from_bits(unsigned long long bits) {
    T v;
    memcpy(&v, &bits, sizeof(T));
    return v;
}
template <typename T>
inline T warp(const char* file, int line, int kind, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(cudasim_rt.warp(mask, to_bits(v), kind, arg, width, file, line));
}
// `__syncwarp` names this object, so `__syncwarp()` and `__syncwarp(mask)` both call it.
struct Syncwarp {
    const char* file;
    int line;
    void operator()(unsigned mask = 0xffffffffu) const { cudasim_rt.warp(mask, 0, CUDASIM_SYNCWARP, 0, 32, file, line); }
};
}  // namespace cudasim

#define __shfl_sync(...) cudasim::warp(__FILE__, __LINE__, CUDASIM_SHFL_IDX, __VA_ARGS__)
#define __shfl_xor_sync(...) cudasim::warp(__FILE__, __LINE__, CUDASIM_SHFL_XOR, __VA_ARGS__)
#define __shfl_down_sync(...) cudasim::warp(__FILE__, __LINE__, CUDASIM_SHFL_DOWN, __VA_ARGS__)
#define __shfl_up_sync(...) cudasim::warp(__FILE__, __LINE__, CUDASIM_SHFL_UP, __VA_ARGS__)
#define __syncwarp cudasim::Syncwarp{__FILE__, __LINE__}

// Bit casts.
inline float __int_as_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long bits) { double d; memcpy(&d, &bits, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }

// Float arithmetic rounded once per operation (CUDA's `_rn` intrinsics keep NVRTC from fusing a
// product into a following sum; the simulated module is built without fused multiply-adds anyway).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// The four-way byte dot product: c plus the products of the signed bytes of a and b, in place.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

// Atomics: one block runs at a time and its threads only switch at barriers, so a read-modify-write
// is atomic as written; the accesses are checked like any other.
inline unsigned int atomicCAS(unsigned int* at, unsigned int compare, unsigned int value) {
    unsigned int old = *at;
    if (old == compare) *at = value;
    return old;
}
inline unsigned long long atomicCAS(unsigned long long* at, unsigned long long compare, unsigned long long value) {
    unsigned long long old = *at;
    if (old == compare) *at = value;
    return old;
}
inline int atomicAdd(int* at, int v) { int old = *at; *at = old + v; return old; }
inline unsigned int atomicAdd(unsigned int* at, unsigned int v) { unsigned int old = *at; *at = old + v; return old; }
inline float atomicAdd(float* at, float v) { float old = *at; *at = old + v; return old; }
inline double atomicAdd(double* at, double v) { double old = *at; *at = old + v; return old; }
inline unsigned long long atomicAdd(unsigned long long* at, unsigned long long v) {
    unsigned long long old = *at;
    *at = old + v;
    return old;
}
inline int atomicMax(int* at, int v) { int old = *at; if (v > old) *at = v; return old; }
inline int atomicMin(int* at, int v) { int old = *at; if (v < old) *at = v; return old; }

// The address-sanitizer hooks GCC calls before every load and store (outline form). Accesses to the
// thread's own stack, and to the block the last checked access fell in (aligned, and for loads
// already written), are accepted here; everything else goes to the runtime's full check.
__attribute__((no_sanitize_address, always_inline)) inline void cudasim_access(uintptr_t p, long n, int store) {
    const cudasim_fast* f = cudasim_rt.fast;
    if (p - f->stack_lo < f->stack_hi - f->stack_lo) return;
    for (int h = 0; h < CUDASIM_HITS; ++h) {
        if (p >= f->hit_lo[h] && p + n <= f->hit_hi[h] && !(p & (n - 1))) {
            unsigned char* s = f->shadow + (p - f->heap_base);
            if (store) {
                for (long i = 0; i < n; ++i) s[i] = 1;
                return;
            }
            long i = 0;
            while (i < n && s[i]) ++i;
            if (i == n) return;
            break;
        }
    }
    cudasim_rt.check(p, n, store);
}
#define CUDASIM_HOOK(kind, n, store)                                                               \
    extern "C" __attribute__((no_sanitize_address)) void __asan_##kind##n##_noabort(void* p) {   \
        cudasim_access((uintptr_t)p, n, store);                                                    \
    }
CUDASIM_HOOK(load, 1, 0)
CUDASIM_HOOK(load, 2, 0)
CUDASIM_HOOK(load, 4, 0)
CUDASIM_HOOK(load, 8, 0)
CUDASIM_HOOK(load, 16, 0)
CUDASIM_HOOK(store, 1, 1)
CUDASIM_HOOK(store, 2, 1)
CUDASIM_HOOK(store, 4, 1)
CUDASIM_HOOK(store, 8, 1)
CUDASIM_HOOK(store, 16, 1)
extern "C" __attribute__((no_sanitize_address)) void __asan_loadN_noabort(void* p, long n) {
    cudasim_rt.check((uintptr_t)p, n, 0);
}
extern "C" __attribute__((no_sanitize_address)) void __asan_storeN_noabort(void* p, long n) {
    cudasim_rt.check((uintptr_t)p, n, 1);
}
extern "C" void __asan_handle_no_return(void) {}
extern "C" void __asan_before_dynamic_init(const char*) {}
extern "C" void __asan_after_dynamic_init(void) {}

// Kernel registration, appended by the simulator's NVRTC after the program: a thunk per kernel that
// copies each argument out of cuLaunchKernel's pointer array and calls the kernel.
namespace cudasim {
template <typename... A> constexpr int arity(void (*)(A...)) { return (int)sizeof...(A); }
// The thunk is not instrumented (the argument pointers are host memory) and calls the kernel through
// a volatile pointer, so the kernel, whose accesses are instrumented, is never inlined into it.
template <typename... A, size_t... I>
__attribute__((no_sanitize_address)) void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    void (*volatile kernel)(A...) = f;
    kernel(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(p[I])...);
}
template <auto F> __attribute__((no_sanitize_address, noinline)) void thunk(void** p) {
    call(F, p, std::make_index_sequence<arity(F)>{});
}
template <typename... A> inline const unsigned* sizes(void (*)(A...)) {
    static const unsigned s[] = {(unsigned)sizeof(A)..., 0u};
    return s;
}
}  // namespace cudasim

#define CUDASIM_KERNEL(name) \
    {#name, &cudasim::thunk<&name>, cudasim::arity(&name), cudasim::sizes(&name)},
