// Softmax, log-softmax, the cross-entropy derivative and RMS normalisation, over contiguous rows
// (ndscope moves the softmax axis last first). Each softmax row is shifted by its maximum before exp,
// as on the host.

// T is the element type, C the type the row is computed in (float for the 16-bit types).

// The row's maximum `m` (NaN if it holds one) and, when `m` is finite, `s` = sum e^(x - m) (else 0),
// combined over the block: every thread gets both. Every thread of the block calls it.
template <typename T, typename C>
__device__ __forceinline__ void block_max_exp_sum(const T* x, i64 len, C* buf, C& m, C& s) {
    m = Limits<C>::lowest();
    for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) m = max_nan(m, ld(x[j]));
    buf[threadIdx.x] = m;
    block_combine(R_MAX, buf);
    m = buf[0];
    __syncthreads();
    s = (C)0;
    if (m == Limits<C>::lowest() || is_nan(m)) return;  // the same for the whole block
    for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) s += k_exp(ld(x[j]) - m);
    buf[threadIdx.x] = s;
    block_combine(R_SUM, buf);
    s = buf[0];
    __syncthreads();
}

#define SOFTMAX(T, C, S)                                                                           \
    extern "C" __global__ void softmax_##S(i64 rows, i64 len, T* out, const T* in, int log_out) {  \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* x = in + r * len;                                                             \
            T* y = out + r * len;                                                                  \
            C m, s;                                                                                \
            block_max_exp_sum(x, len, buf, m, s);                                                  \
            if (m == Limits<C>::lowest() || is_nan(m)) {                                           \
                /* every entry is -inf, or one is NaN: no distribution (NaN, as on the host) */    \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) put(&y[j], Limits<C>::nan()); \
                continue;                                                                          \
            }                                                                                      \
            if (log_out) {                                                                         \
                C lse = k_log(s);                                                                  \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) put(&y[j], ld(x[j]) - m - lse); \
            } else {                                                                               \
                C inv = (C)1 / s;                                                                  \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) put(&y[j], k_exp(ld(x[j]) - m) * inv); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* ln sum e^x of each row, into the compute type: -inf for a row of -inf, NaN with a NaN */  \
    extern "C" __global__ void logsumexp_##S(i64 rows, i64 len, C* out, const T* in) {             \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            C m, s;                                                                                \
            block_max_exp_sum(in + r * len, len, buf, m, s);                                       \
            if (threadIdx.x == 0) out[r] = (m == Limits<C>::lowest() || is_nan(m)) ? m : m + k_log(s); \
        }                                                                                          \
    }                                                                                              \
    /* d(cross-entropy)/d(logits): (e^(x - lse) - (1 - eps) one_hot - eps / classes) * weight */   \
    extern "C" __global__ void xent_grad_##S(i64 rows, i64 classes, T* out, const T* logits,       \
                                             const C* lse, const i64* labels, const C* weight,     \
                                             C on, C off) {                                        \
        GRID_STRIDE(i, rows * classes) {                                                           \
            i64 r = i / classes;                                                                   \
            i64 c = i - r * classes;                                                               \
            C hot = labels[r] == c ? on : (C)0;                                                    \
            put(&out[i], (k_exp(ld(logits[i]) - lse[r]) - hot - off) * weight[r]);                 \
        }                                                                                          \
    }

SOFTMAX(float, float, f32)
SOFTMAX(double, double, f64)
SOFTMAX(bf16, float, bf16)
SOFTMAX(f16, float, f16)

// RMS normalisation of each row, as the host computes it (`Tensor::rms_norm`): `inv = 1 / sqrt(sum
// x^2 / len + eps)` in C, the normalised value rounded to T, then times the weight (when `w` is not
// null) and rounded again. One block a row: a decoding step's norms are one launch, not seven.
#define RMS_NORM(T, C, S)                                                                          \
    extern "C" __global__ void rms_norm_##S(i64 rows, i64 len, T* out, const T* in, const T* w,    \
                                            C eps) {                                               \
        __shared__ C buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* x = in + r * len;                                                             \
            T* y = out + r * len;                                                                  \
            C s = (C)0;                                                                            \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                C v = ld(x[j]);                                                                    \
                s += v * v;                                                                        \
            }                                                                                      \
            buf[threadIdx.x] = s;                                                                  \
            block_combine(R_SUM, buf);                                                             \
            C inv = (C)1 / k_sqrt(buf[0] / (C)len + eps);                                          \
            __syncthreads();                                                                       \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) {                                 \
                T n;                                                                               \
                put(&n, ld(x[j]) * inv);                                                           \
                put(&y[j], w ? ld(n) * ld(w[j]) : ld(n));                                          \
            }                                                                                      \
        }                                                                                          \
    }

RMS_NORM(float, float, f32)
RMS_NORM(double, double, f64)
RMS_NORM(bf16, float, bf16)
RMS_NORM(f16, float, f16)
