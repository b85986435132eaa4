// Row reductions over a contiguous [rows, len] input: one block per row (blocks stride over rows),
// each thread folds a strided share of the row, then the block combines the partial results in
// shared memory. ndscope moves the reduced axes last (a copy when needed) before launching.

template <typename T> __device__ __forceinline__ T reduce_identity(int op) {
    switch (op) {
    case R_MAX: return Limits<T>::lowest();
    case R_MIN: return Limits<T>::highest();
    default: return (T)0;
    }
}

template <typename T> __device__ __forceinline__ T reduce_combine(int op, T a, T b) {
    switch (op) {
    case R_MAX: return max_nan(a, b);
    case R_MIN: return min_nan(a, b);
    default: return a + b;
    }
}

// Combines the block's ROW_THREADS partial values in `buf`; the result ends in buf[0].
template <typename T> __device__ __forceinline__ void block_combine(int op, T* buf) {
    for (unsigned width = ROW_THREADS / 2; width > 0; width /= 2) {
        __syncthreads();
        if (threadIdx.x < width) {
            buf[threadIdx.x] = reduce_combine(op, buf[threadIdx.x], buf[threadIdx.x + width]);
        }
    }
    __syncthreads();
}

#define REDUCE(T, S)                                                                               \
    extern "C" __global__ void reduce_##S(int op, i64 rows, i64 len, T* out, const T* in) {        \
        __shared__ T buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* row = in + r * len;                                                           \
            T acc = reduce_identity<T>(op);                                                        \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                acc = reduce_combine(op, acc, row[j]);                                             \
            }                                                                                      \
            buf[threadIdx.x] = acc;                                                                \
            block_combine(op, buf);                                                                \
            if (threadIdx.x == 0) {                                                                \
                out[r] = buf[0];                                                                   \
            }                                                                                      \
            __syncthreads();                                                                       \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void argmax_##S(i64 rows, i64 len, i64* out, const T* in) {              \
        __shared__ T best[ROW_THREADS];                                                            \
        __shared__ i64 at[ROW_THREADS];                                                            \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* row = in + r * len;                                                           \
            T b = row[0];                                                                          \
            i64 k = 0;                                                                             \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                if (argmax_better(row[j], j, b, k)) {                                              \
                    b = row[j];                                                                    \
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

REDUCE(float, f32)
REDUCE(double, f64)
REDUCE(i64, i64)

// Running sums of contiguous rows, one thread per row, added in order (from the end when reverse)
// as the host adds them.
#define CUMSUM(T, S)                                                                               \
    extern "C" __global__ void cumsum_##S(i64 rows, i64 len, T* out, const T* x, int reverse) {   \
        GRID_STRIDE(r, rows) {                                                                     \
            T acc = (T)0;                                                                          \
            for (i64 k = 0; k < len; ++k) {                                                        \
                i64 j = reverse ? len - 1 - k : k;                                                 \
                acc += x[r * len + j];                                                             \
                out[r * len + j] = acc;                                                            \
            }                                                                                      \
        }                                                                                          \
    }

CUMSUM(float, f32)
CUMSUM(double, f64)
CUMSUM(i64, i64)
