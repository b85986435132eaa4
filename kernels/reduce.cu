// Row reductions over a contiguous [rows, len] input: one block per row (blocks stride over rows),
// each thread folds a strided share of the row, then the block combines the partial results in
// shared memory. ndscope moves the reduced axes last (a copy when needed) before launching.
// T is the element type, C the type partial results are kept in (float for the 16-bit types).
// The combining helpers live in common.cuh, which softmax.cu shares.

#define REDUCE(T, C, S)                                                                            \
    extern "C" __global__ void reduce_##S(int op, i64 rows, i64 len, T* out, const T* in) {        \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* row = in + r * len;                                                           \
            C acc = reduce_identity<C>(op);                                                        \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                acc = reduce_combine(op, acc, ld(row[j]));                                         \
            }                                                                                      \
            buf[threadIdx.x] = acc;                                                                \
            block_combine(op, buf);                                                                \
            if (threadIdx.x == 0) {                                                                \
                put(&out[r], op == R_MEAN ? buf[0] / (C)len : buf[0]);                            \
            }                                                                                      \
            __syncthreads();                                                                       \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void argmax_##S(i64 rows, i64 len, i64* out, const T* in) {              \
        __shared__ C best[ROW_THREADS];                                                            \
        __shared__ i64 at[ROW_THREADS];                                                            \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* row = in + r * len;                                                           \
            C b = ld(row[0]);                                                                      \
            i64 k = 0;                                                                             \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                C v = ld(row[j]);                                                                  \
                if (argmax_better(v, j, b, k)) {                                                   \
                    b = v;                                                                         \
                    k = j;                                                                         \
                }                                                                                  \
            }                                                                                      \
            best[threadIdx.x] = b;                                                                 \
            at[threadIdx.x] = k;                                                                   \
            for (unsigned width = ROW_THREADS / 2; width > 0; width /= 2) {                        \
                __syncthreads();                                                                   \
                if (threadIdx.x < width) {                                                         \
                    unsigned o = threadIdx.x + width;                                              \
                    if (argmax_better(best[o], at[o], best[threadIdx.x], at[threadIdx.x])) {       \
                        best[threadIdx.x] = best[o];                                               \
                        at[threadIdx.x] = at[o];                                                   \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            __syncthreads();                                                                       \
            if (threadIdx.x == 0) {                                                                \
                out[r] = at[0];                                                                    \
            }                                                                                      \
            __syncthreads();                                                                       \
        }                                                                                          \
    }

// Whether (v, j) beats (b, k) for argmax: the first NaN wins, then the larger value, then the first
// index on ties; the host kernel's order.
template <typename T> __device__ __forceinline__ bool argmax_better(T v, i64 j, T b, i64 k) {
    if (is_nan(v) || is_nan(b)) {
        return is_nan(v) && (!is_nan(b) || j < k);
    }
    return v > b || (v == b && j < k);
}

REDUCE(float, float, f32)
REDUCE(double, double, f64)
REDUCE(i64, i64, i64)
REDUCE(bf16, float, bf16)
REDUCE(f16, float, f16)

// Few long rows (a whole-tensor sum, a gradient norm): one block per row would read at the speed of
// one multiprocessor (a 16M-element sum took milliseconds on an H200). The backend splits each row
// into `parts` equal chunks (`reduce_parts` in ops.rs): reduce_part folds chunk p of row r into
// partial[r * parts + p] (in C; a mean as a sum), then reduce_join folds each row's parts in order
// and writes the row's result. Both passes combine in an order fixed by the shape alone, so a result
// does not depend on timing. `partial` is the GPU's scratch block (REDUCE_PARTIALS in ops.rs).
#define REDUCE_SPLIT(T, C, S)                                                                      \
    extern "C" __global__ void reduce_part_##S(int op, i64 rows, i64 len, i64 parts, C* partial,   \
                                               const T* in) {                                      \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 b = blockIdx.x; b < rows * parts; b += gridDim.x) {                               \
            const i64 r = b / parts, p = b % parts;                                                \
            const T* row = in + r * len;                                                           \
            const i64 end = (p + 1) * len / parts;                                                 \
            C acc = reduce_identity<C>(op);                                                        \
            for (i64 j = p * len / parts + threadIdx.x; j < end; j += ROW_THREADS) {               \
                acc = reduce_combine(op, acc, ld(row[j]));                                         \
            }                                                                                      \
            buf[threadIdx.x] = acc;                                                                \
            block_combine(op, buf);                                                                \
            if (threadIdx.x == 0) {                                                                \
                partial[b] = buf[0];                                                               \
            }                                                                                      \
            __syncthreads();                                                                       \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void reduce_join_##S(int op, i64 rows, i64 len, i64 parts, T* out,       \
                                               const C* partial) {                                 \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            C acc = reduce_identity<C>(op);                                                        \
            for (i64 p = threadIdx.x; p < parts; p += ROW_THREADS) {                               \
                acc = reduce_combine(op, acc, partial[r * parts + p]);                             \
            }                                                                                      \
            buf[threadIdx.x] = acc;                                                                \
            block_combine(op, buf);                                                                \
            if (threadIdx.x == 0) {                                                                \
                put(&out[r], op == R_MEAN ? buf[0] / (C)len : buf[0]);                            \
            }                                                                                      \
            __syncthreads();                                                                       \
        }                                                                                          \
    }

REDUCE_SPLIT(float, float, f32)
REDUCE_SPLIT(double, double, f64)
REDUCE_SPLIT(i64, i64, i64)
REDUCE_SPLIT(bf16, float, bf16)
REDUCE_SPLIT(f16, float, f16)

// Running sums of contiguous rows, one thread per row, added in order (from the end when reverse)
// as the host adds them.
#define CUMSUM(T, C, S)                                                                            \
    extern "C" __global__ void cumsum_##S(i64 rows, i64 len, T* out, const T* x, int reverse) {   \
        GRID_STRIDE(r, rows) {                                                                     \
            C acc = (C)0;                                                                          \
            for (i64 k = 0; k < len; ++k) {                                                        \
                i64 j = reverse ? len - 1 - k : k;                                                 \
                acc += ld(x[r * len + j]);                                                         \
                put(&out[r * len + j], acc);                                                       \
            }                                                                                      \
        }                                                                                          \
    }

CUMSUM(float, float, f32)
CUMSUM(double, double, f64)
CUMSUM(i64, i64, i64)
CUMSUM(bf16, float, bf16)
CUMSUM(f16, float, f16)
