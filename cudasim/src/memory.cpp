// The simulated device's memory: one reservation of host address space (CUDASIM_MEMORY_MB, default
// 4096 MiB) handed out as device allocations, with a shadow byte per byte that says whether it has
// been written. Allocations are 256-byte aligned, as cudaMalloc's are, and each is followed by a red
// zone no allocation uses, so a read or write just past an allocation lands outside every allocation.
// Freed addresses are not handed out again until the heap wraps around (next fit), so a use after a
// free also lands outside every live allocation.
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <map>

#include "sim.h"

namespace sim {
namespace {

constexpr size_t ALIGN = 256;
constexpr size_t RED_ZONE = 256;
constexpr size_t PAGE = 4096;

struct Heap {
    unsigned char* base = nullptr;
    unsigned char* shadow = nullptr;  // 1 where the byte has been written
    size_t total = 0;
    size_t used = 0;
    size_t cursor = 0;                    // next fit starts here
    std::map<uint64_t, size_t> live;      // start -> requested bytes
    std::map<uint64_t, size_t> free_runs; // start -> bytes (offsets from base), coalesced
    // Blocks a caching allocator lent out of its allocations (cudasimNoteBlock): in an allocation
    // that has any, an access must fall inside one live block.
    std::map<uint64_t, size_t> blocks;    // start -> bytes
    std::map<uint64_t, bool> subdivided;  // allocation start -> true once a block was lent from it
};

Heap& heap() {
    static Heap* h = [] {
        Heap* h = new Heap;
        size_t mb = 4096;
        if (const char* v = getenv("CUDASIM_MEMORY_MB")) mb = strtoull(v, nullptr, 10);
        if (mb == 0) mb = 4096;
        h->total = mb << 20;
        int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
        // Leave a page of no access on both sides of the heap.
        void* region = mmap(nullptr, h->total + 2 * PAGE, PROT_NONE, flags, -1, 0);
        void* shadow = mmap(nullptr, h->total, PROT_READ | PROT_WRITE, flags, -1, 0);
        if (region == MAP_FAILED || shadow == MAP_FAILED) {
            fprintf(stderr, "cudasim: cannot reserve %zu MiB for the simulated device\n", mb);
            abort();
        }
        h->base = (unsigned char*)region + PAGE;
        mprotect(h->base, h->total, PROT_READ | PROT_WRITE);
        h->shadow = (unsigned char*)shadow;
        h->free_runs[0] = h->total;
        fast_state.heap_base = (uintptr_t)h->base;
        fast_state.shadow = h->shadow;
        return h;
    }();
    return *h;
}

// Gives whole pages inside [offset, offset + bytes) back to the system (they read as zero again,
// and their shadow as never written); clears the shadow of the partial pages at the ends.
void release(Heap& h, size_t offset, size_t bytes) {
    size_t lo = (offset + PAGE - 1) / PAGE * PAGE, hi = (offset + bytes) / PAGE * PAGE;
    if (hi > lo) {
        madvise(h.base + lo, hi - lo, MADV_DONTNEED);
        madvise(h.shadow + lo, hi - lo, MADV_DONTNEED);
        memset(h.shadow + offset, 0, lo - offset);
        memset(h.shadow + hi, 0, offset + bytes - hi);
    } else {
        memset(h.shadow + offset, 0, bytes);
    }
}

// The live allocation holding `address`, or live.end().
std::map<uint64_t, size_t>::iterator find(Heap& h, uint64_t address) {
    auto it = h.live.upper_bound(address);
    if (it == h.live.begin()) return h.live.end();
    --it;
    // The allocation's usable extent is its requested size (not the rounded one).
    return address < it->first + it->second ? it : h.live.end();
}

// The last blocks checks found (kernels touch a handful of buffers, so most checks hit one): kept
// in fast_state, where the modules' hooks read them too; replaced round robin.
unsigned next_hit = 0;

void forget_hits() {
    for (int i = 0; i < CUDASIM_HITS; ++i) {
        fast_state.hit_lo[i] = 1;
        fast_state.hit_hi[i] = 0;
    }
}

bool hit(uintptr_t address, long bytes) {
    for (int i = 0; i < CUDASIM_HITS; ++i) {
        if (address >= fast_state.hit_lo[i] && address + bytes <= fast_state.hit_hi[i]) return true;
    }
    return false;
}

}  // namespace

size_t heap_total() { return heap().total; }
size_t heap_used() { return heap().used; }

bool in_heap(uint64_t address) {
    Heap& h = heap();
    return address >= (uint64_t)h.base && address < (uint64_t)h.base + h.total;
}

uint64_t heap_alloc(size_t bytes) {
    Heap& h = heap();
    if (bytes == 0) return 0;
    size_t need = (bytes + ALIGN - 1) / ALIGN * ALIGN + RED_ZONE;
    auto take = [&](std::map<uint64_t, size_t>::iterator run) -> uint64_t {
        size_t start = run->first, len = run->second;
        h.free_runs.erase(run);
        if (len > need) h.free_runs[start + need] = len - need;
        h.cursor = start + need;
        h.used += need;
        uint64_t address = (uint64_t)h.base + start;
        h.live[address] = bytes;
        return address;
    };
    // Next fit: the first large-enough run that starts at or after the cursor, then from the start.
    for (int pass = 0; pass < 2; ++pass) {
        auto it = pass == 0 ? h.free_runs.lower_bound(h.cursor) : h.free_runs.begin();
        for (; it != h.free_runs.end(); ++it) {
            if (it->second >= need) return take(it);
        }
    }
    return 0;
}

bool heap_free(uint64_t address) {
    Heap& h = heap();
    auto it = h.live.find(address);
    if (it == h.live.end()) {
        fail_detail("cudasim: free of " + describe(address) + ", which is not the start of a live allocation");
        return false;
    }
    size_t need = (it->second + ALIGN - 1) / ALIGN * ALIGN + RED_ZONE;
    size_t offset = address - (uint64_t)h.base;
    h.blocks.erase(h.blocks.lower_bound(address), h.blocks.lower_bound(address + it->second));
    h.subdivided.erase(address);
    h.live.erase(it);
    h.used -= need;
    forget_hits();
    release(h, offset, need);
    // Coalesce with the neighbouring free runs.
    size_t start = offset, len = need;
    auto next = h.free_runs.lower_bound(offset);
    if (next != h.free_runs.end() && next->first == offset + need) {
        len += next->second;
        next = h.free_runs.erase(next);
    }
    if (next != h.free_runs.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == offset) {
            start = prev->first;
            len += prev->second;
            h.free_runs.erase(prev);
        }
    }
    h.free_runs[start] = len;
    return true;
}

std::string describe(uint64_t address) {
    Heap& h = heap();
    char buf[256];
    if (!in_heap(address)) {
        snprintf(buf, sizeof buf, "0x%llx (host memory, not device memory)", (unsigned long long)address);
        return buf;
    }
    auto it = h.live.upper_bound(address);
    if (it != h.live.begin()) {
        auto prev = std::prev(it);
        uint64_t end = prev->first + prev->second;
        if (address < end) {
            snprintf(buf, sizeof buf, "0x%llx (byte %llu of the %zu-byte allocation at 0x%llx)",
                     (unsigned long long)address, (unsigned long long)(address - prev->first), prev->second,
                     (unsigned long long)prev->first);
        } else {
            snprintf(buf, sizeof buf, "0x%llx (%llu bytes past the end of the %zu-byte allocation at 0x%llx)",
                     (unsigned long long)address, (unsigned long long)(address - end), prev->second,
                     (unsigned long long)prev->first);
        }
        return buf;
    }
    if (it != h.live.end()) {
        snprintf(buf, sizeof buf, "0x%llx (%llu bytes before the %zu-byte allocation at 0x%llx)",
                 (unsigned long long)address, (unsigned long long)(it->first - address), it->second,
                 (unsigned long long)it->first);
        return buf;
    }
    snprintf(buf, sizeof buf, "0x%llx (no allocation is live)", (unsigned long long)address);
    return buf;
}

// Where [address, address + bytes) may be accessed: inside one live allocation and, in an allocation
// a caching allocator subdivides, inside one live block. On success [lo, hi) is that extent; on
// failure `why` says where the range falls.
bool locate(Heap& h, uint64_t address, size_t bytes, uint64_t& lo, uint64_t& hi, std::string& why) {
    auto it = find(h, address);
    if (it == h.live.end() || address + bytes > it->first + it->second) {
        why = describe(address);
        if (it != h.live.end()) why += ", out of bounds from " + describe(it->first + it->second);
        return false;
    }
    lo = it->first;
    hi = it->first + it->second;
    if (!h.subdivided.count(it->first)) return true;
    auto b = h.blocks.upper_bound(address);
    if (b != h.blocks.begin()) {
        --b;
        if (address >= b->first && address + bytes <= b->first + b->second) {
            lo = b->first;
            hi = b->first + b->second;
            return true;
        }
    }
    char buf[200];
    if (b != h.blocks.end() && address >= b->first && address < b->first + b->second) {
        snprintf(buf, sizeof buf, ", which runs %llu bytes past the end of the %zu-byte block at 0x%llx",
                 (unsigned long long)(address + bytes - b->first - b->second), b->second, (unsigned long long)b->first);
    } else if (b != h.blocks.end() && address >= b->first + b->second) {
        snprintf(buf, sizeof buf, ", %llu bytes past the end of the %zu-byte block at 0x%llx (no live block holds it)",
                 (unsigned long long)(address - b->first - b->second), b->second, (unsigned long long)b->first);
    } else {
        snprintf(buf, sizeof buf, ", which no live block of the pool holds");
    }
    why = describe(address) + buf;
    return false;
}

Result check_range(uint64_t address, size_t bytes, Access access, const std::string& who) {
    if (bytes == 0) return SUCCESS;
    Heap& h = heap();
    const char* verb = access == Access::Read ? "reads" : "writes";
    uint64_t lo, hi;
    std::string why;
    if (!locate(h, address, bytes, lo, hi, why)) {
        fail_detail(who + " " + verb + " " + std::to_string(bytes) + " bytes at " + why);
        return ILLEGAL_ADDRESS;
    }
    size_t offset = address - (uint64_t)h.base;
    if (access == Access::Read) {
        const unsigned char* s = h.shadow + offset;
        const void* zero = memchr(s, 0, bytes);
        if (zero) {
            size_t at = (const unsigned char*)zero - s;
            fail_detail(who + " reads " + std::to_string(bytes) + " bytes from " + describe(address) +
                        ", and the byte at " + describe(address + at) + " was never written");
            return ILLEGAL_ADDRESS;
        }
    } else {
        memset(h.shadow + offset, 1, bytes);
    }
    return SUCCESS;
}

void mark_written(uint64_t address, size_t bytes) {
    Heap& h = heap();
    memset(h.shadow + (address - (uint64_t)h.base), 1, bytes);
}

void copy_written(uint64_t to, uint64_t from, size_t bytes) {
    Heap& h = heap();
    memmove(h.shadow + (to - (uint64_t)h.base), h.shadow + (from - (uint64_t)h.base), bytes);
}

// The account of the last failed check_access (the caller adds which thread made the access).
std::string access_failure;

// 0 when the access is fine; otherwise the driver code, with access_failure saying why.
int check_access(uintptr_t address, long bytes, int is_store) {
    Heap& h = heap();
    const char* verb = is_store ? "writes " : "reads ";
    if (!hit(address, bytes)) {
        uint64_t lo, hi;
        std::string why;
        if (!locate(h, address, (size_t)bytes, lo, hi, why)) {
            access_failure = verb + std::to_string(bytes) + " bytes at " + why;
            return ILLEGAL_ADDRESS;
        }
        fast_state.hit_lo[next_hit] = lo;
        fast_state.hit_hi[next_hit] = hi;
        next_hit = (next_hit + 1) % CUDASIM_HITS;
    }
    if ((bytes == 2 || bytes == 4 || bytes == 8 || bytes == 16) && (address & (bytes - 1))) {
        access_failure = verb + std::to_string(bytes) + " bytes at " + describe(address) + ", which is not aligned to " +
                         std::to_string(bytes) + " bytes";
        return MISALIGNED_ADDRESS;
    }
    unsigned char* s = h.shadow + (address - (uint64_t)h.base);
    if (is_store) {
        memset(s, 1, bytes);
    } else {
        for (long i = 0; i < bytes; ++i) {
            if (!s[i]) {
                access_failure = verb + std::to_string(bytes) + " bytes at " + describe(address) +
                                 (i ? ", and byte " + std::to_string(i) + " of them" : std::string(", which")) +
                                 " was never written";
                return ILLEGAL_ADDRESS;
            }
        }
    }
    return SUCCESS;
}

}  // namespace sim

// A caching allocator's note that `bytes` at `address` were lent to one block (lent = 1: its bytes
// count as never written) or came back (lent = 0). 0, or INVALID_VALUE for a range outside every
// live allocation (reported on stderr).
extern "C" int cudasimNoteBlock(uint64_t address, size_t bytes, int lent) {
    using namespace sim;
    std::lock_guard<std::recursive_mutex> guard(device_lock());
    Heap& h = heap();
    auto it = find(h, address);
    if (it == h.live.end() || address + bytes > it->first + it->second) {
        fail_detail("cudasim: a pool notes a block at " + describe(address) + " outside every live allocation");
        return INVALID_VALUE;
    }
    forget_hits();
    if (lent) {
        h.subdivided[it->first] = true;
        h.blocks[address] = bytes;
    } else {
        h.blocks.erase(address);
    }
    memset(h.shadow + (address - (uint64_t)h.base), 0, bytes);
    return SUCCESS;
}
