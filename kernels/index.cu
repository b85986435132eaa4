// Indexing: gather along an axis (index_select is a gather whose index is broadcast). The index
// geometry's shape is the output's shape; ndscope checks every index against the axis first (a
// gather also guards on the device, see GATHER).

// Where the i-th element of an index (in row-major order of its shape) is, in the index and in the
// tensor it indexes along `axis`, leaving out the axis coordinate the index itself supplies.
__device__ __forceinline__ void index_positions(i64 i, const Geo& gi, const Geo& gx, int axis,
                                                i64* at_index, i64* at_x) {
    i64 rest = i;
    *at_index = gi.offset;
    *at_x = gx.offset;
    for (int d = gi.rank - 1; d >= 0; --d) {
        i64 c = rest % gi.shape[d];
        rest /= gi.shape[d];
        *at_index += c * gi.stride[d];
        if (d != axis) *at_x += c * gx.stride[d];
    }
}

// An index out of range reads nothing and gives `missing` (NaN, or 0 for integers): ndscope checks
// indices on the host first, except inside a captured CUDA graph, where the host cannot read them.
#define GATHER(T, S, missing)                                                                      \
    extern "C" __global__ void gather_##S(i64 n, T* out, const T* src, Geo gs, const i64* index,   \
                                          Geo gi, int axis) {                                      \
        GRID_STRIDE(i, n) {                                                                        \
            i64 at_index, at_src;                                                                  \
            index_positions(i, gi, gs, axis, &at_index, &at_src);                                  \
            i64 k = index[at_index];                                                               \
            out[i] = (k >= 0 && k < gs.shape[axis]) ? src[at_src + k * gs.stride[axis]] : (missing);\
        }                                                                                          \
    }

GATHER(float, f32, __int_as_float(0x7fc00000))
GATHER(double, f64, __longlong_as_double(0x7ff8000000000000LL))
GATHER(i64, i64, 0)
GATHER(bf16, bf16, bf16_of_bits(0x7fc0))
GATHER(f16, f16, f16_of_bits(0x7e00))

// Scatter-add: target[p with coordinate axis replaced by index[p]] += src[p], one thread per element
// of src (whose shape the index geometry has). Two elements may land on one target element, so the
// add is atomic; the order of the additions, and with floats the rounding of the sum, is not fixed.
__device__ __forceinline__ void atomic_add(float* at, float v) { atomicAdd(at, v); }
__device__ __forceinline__ void atomic_add(double* at, double v) { atomicAdd(at, v); }
__device__ __forceinline__ void atomic_add(i64* at, i64 v) {
    // Two's complement addition is the same on unsigned bits.
    atomicAdd((unsigned long long*)at, (unsigned long long)v);
}

// A 16-bit element is added by compare-and-swap on the aligned 32-bit word that holds it (its
// neighbour in the word is written back unchanged). The word stays inside the block: blocks are
// 64-byte aligned and sized in whole 64-byte units. The sum is computed in float and rounded once
// per addition, as the host's scatter-add of 16-bit elements rounds each addition.
#define ATOMIC_ADD_16(T)                                                                           \
    __device__ __forceinline__ void atomic_add(T* at, float v) {                                   \
        unsigned long long address = (unsigned long long)at;                                       \
        unsigned int* word = (unsigned int*)(address & ~3ull);                                     \
        unsigned int shift = (address & 2ull) ? 16u : 0u;                                          \
        unsigned int old = *word;                                                                  \
        unsigned int assumed;                                                                      \
        do {                                                                                       \
            assumed = old;                                                                         \
            T current;                                                                             \
            current.bits = (unsigned short)(assumed >> shift);                                     \
            T sum;                                                                                 \
            put(&sum, ld(current) + v);                                                            \
            unsigned int next = (assumed & ~(0xffffu << shift)) | ((unsigned int)sum.bits << shift); \
            old = atomicCAS(word, assumed, next);                                                  \
        } while (old != assumed);                                                                  \
    }
ATOMIC_ADD_16(bf16)
ATOMIC_ADD_16(f16)

#define SCATTER_ADD(T, S)                                                                          \
    extern "C" __global__ void scatter_add_##S(i64 n, T* target, Geo gt, const T* src, Geo gs,     \
                                               const i64* index, Geo gi, int axis) {               \
        GRID_STRIDE(i, n) {                                                                        \
            i64 at_index, at_target;                                                               \
            index_positions(i, gi, gt, axis, &at_index, &at_target);                               \
            atomic_add(&target[at_target + index[at_index] * gt.stride[axis]], ld(src[geo_at(gs, i)])); \
        }                                                                                          \
    }

SCATTER_ADD(float, f32)
SCATTER_ADD(double, f64)
SCATTER_ADD(i64, i64)
SCATTER_ADD(bf16, bf16)
SCATTER_ADD(f16, f16)
