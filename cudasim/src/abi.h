// What a compiled kernel module and the simulator's runtime share (plain C layout): the table of
// runtime entry points a module calls, and the table of kernels a module exports. Bump
// CUDASIM_ABI when either changes; it is part of the compiled modules' cache key.
#pragma once

#include <stdint.h>

#define CUDASIM_ABI 4

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    unsigned x, y, z;
} cudasim_uint3;

// The kinds of warp exchange (`__shfl_sync` and friends, `__syncwarp`).
enum { CUDASIM_SHFL_IDX = 0, CUDASIM_SHFL_XOR = 1, CUDASIM_SHFL_DOWN = 2, CUDASIM_SHFL_UP = 3, CUDASIM_SYNCWARP = 4 };

// What a module's access hooks read to accept most accesses without calling the runtime: every
// fiber's stack lies in [stack_lo, stack_hi); [hit_lo[i], hit_hi[i]) are the blocks the last
// checked accesses fell in, whose bytes' written-state is shadow[address - heap_base]. Owned by the
// runtime.
#define CUDASIM_HITS 4
typedef struct {
    uintptr_t stack_lo, stack_hi;
    uintptr_t hit_lo[CUDASIM_HITS], hit_hi[CUDASIM_HITS];
    uintptr_t heap_base;
    unsigned char* shadow;
} cudasim_fast;

typedef struct {
    // Checks one access of `bytes` at `address` by the running thread; does not return when the
    // access is invalid (the launch ends with the error).
    void (*check)(uintptr_t address, long bytes, int is_store);
    // `__syncthreads()` at file:line.
    void (*syncthreads)(const char* file, int line);
    // A warp exchange: every lane of `mask` must arrive with the same mask; returns the value of the
    // source lane (`kind` and `arg` say which, within segments of `width` lanes).
    unsigned long long (*warp)(unsigned mask, unsigned long long value, int kind, int arg, int width,
                               const char* file, int line);
    cudasim_fast* fast;
} cudasim_api;

// One `extern "C" __global__` function of a module: its name, a thunk that unpacks cuLaunchKernel's
// argument pointers and calls it, and the size of each parameter.
typedef struct {
    const char* name;
    void (*thunk)(void** params);
    int nparams;
    const unsigned* param_sizes;
} cudasim_kernel_entry;

#ifdef __cplusplus
}
#endif
