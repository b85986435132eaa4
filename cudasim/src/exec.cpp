// Kernels on the CPU: a module is a shared object built by the simulated NVRTC; a launch runs its
// blocks one after another, and the threads of a block as fibers on the calling thread. A fiber runs
// until it finishes, reaches `__syncthreads`, or joins a warp exchange; when every fiber of the block
// is waiting, the scheduler releases the barrier or performs the exchanges, so barriers and shuffles
// behave as on a GPU — and a barrier some threads never reach, or a shuffle naming a lane that is not
// there, is an error instead of a hang or a wrong value.
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "sim.h"

namespace sim {

struct Module {
    void* handle = nullptr;
    std::string path;
    std::vector<Kernel*> kernels;
    cudasim_uint3* thread_idx = nullptr;
    cudasim_uint3* block_idx = nullptr;
    cudasim_uint3* block_dim = nullptr;
    cudasim_uint3* grid_dim = nullptr;
    // The module's own loaded image (its statics, `__shared__` variables among them).
    std::vector<std::pair<uintptr_t, uintptr_t>> image;
};

namespace {

// ---- fibers ----

// Switches stacks: saves the callee-saved registers on the current stack, stores the stack pointer
// in *from, and resumes the fiber whose stack pointer is `to`. The FPU control words are not
// switched: kernels never change the rounding mode or exception masks.
extern "C" void cudasim_switch(void** from, void* to);
#if defined(__x86_64__)
asm(R"(
    .text
    .globl cudasim_switch
    .type cudasim_switch, @function
cudasim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudasim_switch, .-cudasim_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#elif defined(__aarch64__)
asm(R"(
    .text
    .globl cudasim_switch
    .type cudasim_switch, %function
cudasim_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x2, sp
    str x2, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size cudasim_switch, .-cudasim_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#else
#error "the CUDA simulator switches fibers on x86-64 and aarch64 only"
#endif

constexpr size_t STACK_BYTES = 256 << 10;  // kernels keep small arrays in registers; this is ample
constexpr size_t GUARD = 4096;              // a page of no access below each stack

enum class State { Ready, AtBarrier, AtWarp, Done };

struct Fiber {
    void* sp = nullptr;
    unsigned char* lo = nullptr;  // the usable stack
    unsigned char* hi = nullptr;
    cudasim_uint3 tid{};
    unsigned linear = 0;
    State state = State::Done;
    const char* file = "";
    int line = 0;
    // A pending warp exchange.
    unsigned mask = 0;
    int kind = 0, arg = 0, width = 32;
    unsigned long long value = 0, result = 0;
};

struct Run;
}  // namespace

cudasim_fast fast_state = {0, 0, {1, 1, 1, 1}, {0, 0, 0, 0}, 0, nullptr};

namespace {

struct Run {
    const Launch* launch = nullptr;
    Module* module = nullptr;
    std::vector<Fiber> fibers;  // one per thread of a block, stacks kept between launches
    unsigned nthreads = 0;
    Fiber* current = nullptr;
    void* scheduler_sp = nullptr;
    void** params = nullptr;
    cudasim_uint3 block{};
    Result error = SUCCESS;
    std::string message;
};

Run run_state;

std::string kernel_name() { return run_state.launch ? run_state.launch->kernel->entry->name : "?"; }

std::string where_thread(const Fiber& f) {
    char buf[160];
    const cudasim_uint3& b = run_state.block;
    snprintf(buf, sizeof buf, "kernel `%s`, block (%u,%u,%u), thread (%u,%u,%u)", kernel_name().c_str(), b.x, b.y,
             b.z, f.tid.x, f.tid.y, f.tid.z);
    return buf;
}

void leave(Fiber& from);

void fiber_main() {
    Run& r = run_state;
    r.launch->kernel->entry->thunk(r.params);
    r.current->state = State::Done;
    leave(*r.current);
    abort();  // a finished fiber is never resumed
}

// Stops the running fiber for good with `error` (the launch ends when the scheduler sees it).
[[noreturn]] void fault(Result error, const std::string& what) {
    Run& r = run_state;
    Fiber& f = *r.current;
    if (r.error == SUCCESS) {
        r.error = error;
        r.message = where_thread(f) + ": " + what;
    }
    f.state = State::Done;
    cudasim_switch(&f.sp, r.scheduler_sp);
    abort();
}

// Every fiber's stack, in one reservation (so a module's hooks recognise a stack access with one
// comparison): 1024 stacks, each above a page of no access that stops an overflow.
constexpr size_t MAX_THREADS = 1024;
unsigned char* stacks = nullptr;

void prepare(Fiber& f) {
    if (!stacks) {
        size_t span = MAX_THREADS * (STACK_BYTES + GUARD);
        void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            fprintf(stderr, "cudasim: cannot map the fibers' stacks\n");
            abort();
        }
        stacks = (unsigned char*)m;
        for (size_t i = 0; i < MAX_THREADS; ++i) mprotect(stacks + i * (STACK_BYTES + GUARD), GUARD, PROT_NONE);
        fast_state.stack_lo = (uintptr_t)stacks;
        fast_state.stack_hi = (uintptr_t)stacks + span;
    }
    if (!f.lo) {
        f.lo = stacks + f.linear * (STACK_BYTES + GUARD) + GUARD;
        f.hi = f.lo + STACK_BYTES;
    }
    uintptr_t top = (uintptr_t)f.hi & ~(uintptr_t)15;
#if defined(__x86_64__)
    // What cudasim_switch pops: six registers, then the return address (fiber_main), above which
    // the stack is aligned as at a call.
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                           // alignment: fiber_main starts with rsp = 8 mod 16
    *--sp = (uint64_t)(void*)&fiber_main;
    for (int i = 0; i < 6; ++i) *--sp = 0;
    f.sp = sp;
#else
    uint64_t* sp = (uint64_t*)(top - 176);
    memset(sp, 0, 176);
    sp[11] = (uint64_t)(void*)&fiber_main;  // x30, the link register `ret` jumps to
    f.sp = sp;
#endif
}

void resume(Fiber& f) {
    Run& r = run_state;
    r.current = &f;
    *r.module->thread_idx = f.tid;
    cudasim_switch(&r.scheduler_sp, f.sp);
    r.current = nullptr;
}

// Leaves fiber `from` (blocked or finished): runs the next ready fiber of the block directly, or
// goes back to the scheduler when none is left in this pass. One switch per fiber and phase.
void leave(Fiber& from) {
    Run& r = run_state;
    for (unsigned j = from.linear + 1; j < r.nthreads; ++j) {
        Fiber& to = r.fibers[j];
        if (to.state == State::Ready) {
            r.current = &to;
            *r.module->thread_idx = to.tid;
            cudasim_switch(&from.sp, to.sp);
            return;
        }
    }
    cudasim_switch(&from.sp, r.scheduler_sp);
}

// Blocks the running fiber in `state` until the scheduler makes it Ready again.
void wait(State state, const char* file, int line) {
    Run& r = run_state;
    Fiber& f = *r.current;
    f.state = state;
    f.file = file;
    f.line = line;
    leave(f);
}

std::string at(const Fiber& f) { return std::string(f.file) + ":" + std::to_string(f.line); }

// ---- what the kernels call ----

void rt_check(uintptr_t address, long bytes, int is_store) {
    Run& r = run_state;
    Fiber& f = *r.current;
    if (address >= (uintptr_t)f.lo && address + bytes <= (uintptr_t)f.hi) return;  // its own stack
    if (in_heap(address)) {
        int code = check_access(address, bytes, is_store);
        if (code != SUCCESS) fault((Result)code, access_failure);
        return;
    }
    for (auto& [lo, hi] : r.module->image) {
        if (address >= lo && address + bytes <= hi) return;  // statics and __shared__ variables
    }
    char buf[400];
    Dl_info info;
    std::string owner;
    if (dladdr((void*)address, &info) && info.dli_fname) {
        owner = std::string(" in ") + info.dli_fname + (info.dli_sname ? std::string(" (") + info.dli_sname + ")" : "");
    }
    snprintf(buf, sizeof buf, "%s %ld bytes at 0x%llx%s, which is host memory, not device memory (a host pointer "
             "passed to a kernel?)", is_store ? "writes" : "reads", bytes, (unsigned long long)address, owner.c_str());
    fault(ILLEGAL_ADDRESS, buf);
}

void rt_syncthreads(const char* file, int line) { wait(State::AtBarrier, file, line); }

unsigned long long rt_warp(unsigned mask, unsigned long long value, int kind, int arg, int width, const char* file,
                           int line) {
    Run& r = run_state;
    Fiber& f = *r.current;
    unsigned lane = f.linear % 32;
    if (!(mask & (1u << lane))) {
        char buf[160];
        snprintf(buf, sizeof buf, "a warp exchange at %s:%d with mask 0x%08x, which leaves out the calling lane %u",
                 file, line, mask, lane);
        fault(INVALID_VALUE, buf);
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        fault(INVALID_VALUE, "a shuffle at " + std::string(file) + ":" + std::to_string(line) + " with width " +
                                 std::to_string(width) + " (a power of two up to 32)");
    }
    f.mask = mask;
    f.kind = kind;
    f.arg = arg;
    f.width = width;
    f.value = value;
    wait(State::AtWarp, file, line);
    return f.result;
}

cudasim_api api = {rt_check, rt_syncthreads, rt_warp, &fast_state};

// ---- the scheduler ----

// Performs the warp exchanges whose lanes have all arrived; false when none could be.
bool resolve_warps(Run& r, bool& failed) {
    bool progressed = false;
    unsigned warps = (r.nthreads + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
        Fiber* lanes = &r.fibers[w * 32];
        unsigned present = r.nthreads - w * 32 < 32 ? r.nthreads - w * 32 : 32;
        for (unsigned l = 0; l < present; ++l) {
            Fiber& f = lanes[l];
            if (f.state != State::AtWarp) continue;
            bool ready = true;
            for (unsigned b = 0; b < 32; ++b) {
                if (!(f.mask & (1u << b))) continue;
                const char* problem = nullptr;
                if (b >= present) problem = "does not exist (the block ends before it)";
                else if (lanes[b].state == State::Done) problem = "has exited";
                if (problem) {
                    r.error = INVALID_VALUE;
                    r.message = where_thread(f) + ": a warp exchange at " + at(f) + " with mask 0x" +
                                [&] { char m[16]; snprintf(m, sizeof m, "%08x", f.mask); return std::string(m); }() +
                                " names lane " + std::to_string(b) + ", which " + problem;
                    failed = true;
                    return false;
                }
                if (lanes[b].state != State::AtWarp) {
                    ready = false;  // still at a block barrier: a deadlock unless it resolves
                    break;
                }
                if (lanes[b].mask != f.mask || lanes[b].kind != f.kind) {
                    r.error = INVALID_VALUE;
                    r.message = where_thread(f) + ": lanes " + std::to_string(l) + " and " + std::to_string(b) +
                                " of a warp meet at different warp exchanges (" + at(f) + " and " + at(lanes[b]) +
                                ") or with different masks";
                    failed = true;
                    return false;
                }
            }
            if (!ready) continue;
            // Every lane of the mask is here: exchange.
            unsigned mask = f.mask;
            for (unsigned b = 0; b < 32; ++b) {
                if (!(mask & (1u << b))) continue;
                Fiber& g = lanes[b];
                unsigned width = (unsigned)g.width, base = b & ~(width - 1), src = b;
                switch (g.kind) {
                case CUDASIM_SHFL_IDX: src = base + ((unsigned)g.arg & (width - 1)); break;
                case CUDASIM_SHFL_XOR: src = b ^ (unsigned)g.arg; if (src < base || src >= base + width) src = b; break;
                case CUDASIM_SHFL_DOWN: src = b + (unsigned)g.arg; if (src >= base + width) src = b; break;
                case CUDASIM_SHFL_UP: src = b >= (unsigned)g.arg && b - (unsigned)g.arg >= base ? b - g.arg : b; break;
                default: break;
                }
                if (g.kind != CUDASIM_SYNCWARP && (src >= 32 || !(mask & (1u << src)))) {
                    r.error = INVALID_VALUE;
                    char m[16];
                    snprintf(m, sizeof m, "%08x", mask);
                    r.message = where_thread(g) + ": a shuffle at " + at(g) + " reads lane " + std::to_string(src) +
                                ", which is not in its mask 0x" + m + " (an inactive lane: the value is undefined)";
                    failed = true;
                    return false;
                }
                g.result = g.kind == CUDASIM_SYNCWARP ? 0 : lanes[src].value;
            }
            for (unsigned b = 0; b < 32; ++b) {
                if (mask & (1u << b)) lanes[b].state = State::Ready;
            }
            progressed = true;
        }
    }
    return progressed;
}

// Runs one block to completion; false with r.error set on a fault.
bool run_block(Run& r) {
    for (unsigned i = 0; i < r.nthreads; ++i) {
        prepare(r.fibers[i]);
        r.fibers[i].state = State::Ready;
    }
    for (;;) {
        for (unsigned i = 0; i < r.nthreads; ++i) {
            if (r.fibers[i].state == State::Ready) {
                resume(r.fibers[i]);
                if (r.error != SUCCESS) return false;
            }
        }
        unsigned done = 0, barrier = 0;
        for (unsigned i = 0; i < r.nthreads; ++i) {
            done += r.fibers[i].state == State::Done;
            barrier += r.fibers[i].state == State::AtBarrier;
        }
        if (done == r.nthreads) return true;
        bool failed = false;
        if (resolve_warps(r, failed)) continue;
        if (failed) return false;
        const Fiber* first = nullptr;
        for (unsigned i = 0; i < r.nthreads && !first; ++i) {
            if (r.fibers[i].state == State::AtBarrier) first = &r.fibers[i];
        }
        if (barrier + done == r.nthreads && done == 0) {
            for (unsigned i = 0; i < r.nthreads; ++i) {
                const Fiber& f = r.fibers[i];
                if (f.file != first->file || f.line != first->line) {
                    r.error = LAUNCH_FAILED;
                    r.message = where_thread(f) + ": waits at __syncthreads at " + at(f) + " while " +
                                where_thread(*first) + " waits at " + at(*first) +
                                " (a barrier in divergent code)";
                    return false;
                }
            }
            for (unsigned i = 0; i < r.nthreads; ++i) r.fibers[i].state = State::Ready;
            continue;
        }
        // Nothing can move: a barrier only part of the block reached, or exchanges that wait on it.
        const Fiber* exited = nullptr;
        for (unsigned i = 0; i < r.nthreads && !exited; ++i) {
            if (r.fibers[i].state == State::Done) exited = &r.fibers[i];
        }
        r.error = LAUNCH_FAILED;
        if (first && exited) {
            r.message = where_thread(*first) + ": __syncthreads at " + at(*first) + " is reached by " +
                        std::to_string(barrier) + " of the block's " + std::to_string(r.nthreads) +
                        " threads; thread (" + std::to_string(exited->tid.x) + "," + std::to_string(exited->tid.y) +
                        "," + std::to_string(exited->tid.z) + ") had already exited (a GPU hangs or corrupts here)";
        } else {
            const Fiber* warp = nullptr;
            for (unsigned i = 0; i < r.nthreads && !warp; ++i) {
                if (r.fibers[i].state == State::AtWarp) warp = &r.fibers[i];
            }
            r.message = where_thread(warp ? *warp : *first) + ": deadlock: " +
                        (warp ? "a warp exchange at " + at(*warp) : std::string("a barrier")) +
                        " waits for lanes that wait at " + (first ? "__syncthreads at " + at(*first) : "another exchange");
        }
        return false;
    }
}

int image_callback(struct dl_phdr_info* info, size_t, void* data) {
    Module* m = (Module*)data;
    if (!info->dlpi_name || m->path != info->dlpi_name) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& p = info->dlpi_phdr[i];
        if (p.p_type == PT_LOAD) {
            uintptr_t lo = info->dlpi_addr + p.p_vaddr;
            m->image.push_back({lo, lo + p.p_memsz});
        }
    }
    return 1;
}

// CUDASIM_PROFILE=1: launches, blocks, threads run and seconds per kernel, printed at exit.
struct Profile {
    struct Row {
        unsigned long long launches = 0, blocks = 0, threads = 0;
        double seconds = 0;
    };
    std::map<std::string, Row> rows;
    ~Profile() {
        if (rows.empty()) return;
        std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
        std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.second.seconds > b.second.seconds; });
        double total = 0;
        for (auto& r : sorted) total += r.second.seconds;
        fprintf(stderr, "cudasim profile: %.2f s in kernels\n%-28s %10s %12s %14s %9s\n", total, "kernel", "launches",
                "blocks", "threads", "seconds");
        for (size_t i = 0; i < sorted.size() && i < 25; ++i) {
            const Row& r = sorted[i].second;
            fprintf(stderr, "%-28s %10llu %12llu %14llu %9.3f\n", sorted[i].first.c_str(), r.launches, r.blocks, r.threads,
                    r.seconds);
        }
    }
};
Profile* profile() {
    static Profile* p = getenv("CUDASIM_PROFILE") ? new Profile : nullptr;
    static struct Flush {
        ~Flush() { delete profile(); }
    } flush;
    return p;
}

}  // namespace

Result load_module(const char* image, Module** out) {
    const char* prefix = "// cudasim module ";
    if (strncmp(image, prefix, strlen(prefix)) != 0) {
        fail_detail("cudasim: this module was not compiled by the simulator's NVRTC (real PTX cannot run on the simulator)");
        return INVALID_IMAGE;
    }
    std::string path(image + strlen(prefix));
    while (!path.empty() && (path.back() == '\n' || path.back() == ' ')) path.pop_back();
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fail_detail(std::string("cudasim: cannot load the compiled module: ") + dlerror());
        return INVALID_IMAGE;
    }
    Module* m = new Module;
    m->handle = handle;
    m->path = path;
    auto sym = [&](const char* name) { return dlsym(handle, name); };
    auto rt = (cudasim_api*)sym("cudasim_rt");
    auto kernels = (const cudasim_kernel_entry*)sym("cudasim_kernels");
    m->thread_idx = (cudasim_uint3*)sym("cudasim_thread_idx");
    m->block_idx = (cudasim_uint3*)sym("cudasim_block_idx");
    m->block_dim = (cudasim_uint3*)sym("cudasim_block_dim");
    m->grid_dim = (cudasim_uint3*)sym("cudasim_grid_dim");
    if (!rt || !kernels || !m->thread_idx || !m->block_idx || !m->block_dim || !m->grid_dim) {
        fail_detail("cudasim: the module " + path + " lacks the simulator's tables (built by another version?)");
        dlclose(handle);
        delete m;
        return INVALID_IMAGE;
    }
    *rt = api;  // the module's own copy: reading it is a plain global access, not a checked one
    for (const cudasim_kernel_entry* e = kernels; e->name; ++e) m->kernels.push_back(new Kernel{m, e});
    dl_iterate_phdr(image_callback, m);
    *out = m;
    return SUCCESS;
}

void unload_module(Module* m) {
    for (Kernel* k : m->kernels) delete k;
    dlclose(m->handle);
    delete m;
}

Result get_kernel(Module* m, const char* name, Kernel** out) {
    for (Kernel* k : m->kernels) {
        if (strcmp(k->entry->name, name) == 0) {
            *out = k;
            return SUCCESS;
        }
    }
    fail_detail(std::string("cudasim: the module has no kernel named `") + name + "`");
    return NOT_FOUND;
}

Result run_launch(const Launch& launch) {
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    const char* name = launch.kernel->entry->name;
    const unsigned* g = launch.grid;
    const unsigned* b = launch.block;
    unsigned long long threads = (unsigned long long)b[0] * b[1] * b[2];
    char limits[320] = "";
    if (!g[0] || !g[1] || !g[2] || !b[0] || !b[1] || !b[2]) {
        snprintf(limits, sizeof limits, "an empty grid or block");
    } else if (b[0] > 1024 || b[1] > 1024 || b[2] > 64 || threads > 1024) {
        snprintf(limits, sizeof limits, "block (%u,%u,%u) exceeds the limits (x, y <= 1024, z <= 64, 1024 threads)", b[0],
                 b[1], b[2]);
    } else if (g[0] > 2147483647u || g[1] > 65535 || g[2] > 65535) {
        snprintf(limits, sizeof limits, "grid (%u,%u,%u) exceeds the limits (x < 2^31, y and z <= 65535)", g[0], g[1], g[2]);
    } else if (launch.shared_bytes > 48 * 1024) {
        snprintf(limits, sizeof limits, "%u bytes of dynamic shared memory exceed the 48 KiB a launch may ask for",
                 launch.shared_bytes);
    }
    if (limits[0]) {
        fail_detail(std::string("cudasim: launch of kernel `") + name + "`: " + limits);
        return INVALID_VALUE;
    }
    if ((int)launch.args.size() != launch.kernel->entry->nparams) {
        fail_detail(std::string("cudasim: launch of kernel `") + name + "` with " + std::to_string(launch.args.size()) +
                    " arguments; it takes " + std::to_string(launch.kernel->entry->nparams));
        return INVALID_VALUE;
    }
    Run& r = run_state;
    r.launch = &launch;
    r.module = launch.kernel->module;
    r.nthreads = (unsigned)threads;
    if (r.fibers.size() < threads) r.fibers.resize(threads);
    for (unsigned i = 0; i < threads; ++i) {
        Fiber& f = r.fibers[i];
        f.linear = i;
        f.tid = {i % b[0], (i / b[0]) % b[1], (unsigned)(i / ((unsigned long long)b[0] * b[1]))};
    }
    std::vector<void*> params(launch.args.size());
    for (size_t i = 0; i < params.size(); ++i) params[i] = (void*)launch.args[i].data();
    r.params = params.data();
    r.error = SUCCESS;
    r.message.clear();
    Module* m = r.module;
    auto started = std::chrono::steady_clock::now();
    *m->block_dim = {b[0], b[1], b[2]};
    *m->grid_dim = {g[0], g[1], g[2]};
    for (unsigned z = 0; z < g[2]; ++z) {
        for (unsigned y = 0; y < g[1]; ++y) {
            for (unsigned x = 0; x < g[0]; ++x) {
                r.block = {x, y, z};
                *m->block_idx = r.block;
                if (!run_block(r)) {
                    r.launch = nullptr;
                    fail_detail("cudasim: " + r.message);
                    return r.error;
                }
            }
        }
    }
    r.launch = nullptr;
    if (Profile* p = profile()) {
        Profile::Row& row = p->rows[name];
        row.launches += 1;
        row.blocks += (unsigned long long)g[0] * g[1] * g[2];
        row.threads += (unsigned long long)g[0] * g[1] * g[2] * threads;
        row.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
    return SUCCESS;
}

}  // namespace sim
