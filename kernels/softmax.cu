// Softmax, log-softmax and the cross-entropy derivative, over contiguous rows (ndscope moves the
// softmax axis last first). Each row is shifted by its maximum before exp, as on the host.

#define SOFTMAX(T, S)                                                                              \
    extern "C" __global__ void softmax_##S(i64 rows, i64 len, T* out, const T* in, int log_out) {  \
        __shared__ T buf[ROW_THREADS];                                                             \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            const T* x = in + r * len;                                                             \
            T* y = out + r * len;                                                                  \
            T m = Limits<T>::lowest();                                                             \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) m = max_nan(m, x[j]);             \
            buf[threadIdx.x] = m;                                                                  \
            block_combine(R_MAX, buf);                                                             \
            m = buf[0];                                                                            \
            __syncthreads();                                                                       \
            if (m == Limits<T>::lowest()) {                                                        \
                /* every entry is -inf: the distribution is undefined (NaN, as on the host) */     \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) y[j] = Limits<T>::nan();       \
                continue;                                                                          \
            }                                                                                      \
            T s = (T)0;                                                                            \
            for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) s += k_exp(x[j] - m);             \
            buf[threadIdx.x] = s;                                                                  \
            block_combine(R_SUM, buf);                                                             \
            s = buf[0];                                                                            \
            __syncthreads();                                                                       \
            if (log_out) {                                                                         \
                T lse = k_log(s);                                                                  \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) y[j] = x[j] - m - lse;        \
            } else {                                                                               \
                T inv = (T)1 / s;                                                                  \
                for (i64 j = threadIdx.x; j < len; j += ROW_THREADS) y[j] = k_exp(x[j] - m) * inv; \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* d(mean cross-entropy)/d(logits) from the log-probabilities: (softmax - one_hot) * scale */  \
    extern "C" __global__ void xent_grad_##S(i64 rows, i64 classes, T* out, const T* log_p,        \
                                             const i64* labels, T scale) {                         \
        GRID_STRIDE(i, rows * classes) {                                                           \
            i64 r = i / classes;                                                                   \
            i64 c = i - r * classes;                                                               \
            T hot = labels[r] == c ? (T)1 : (T)0;                                                  \
            out[i] = (k_exp(log_p[i]) - hot) * scale;                                              \
        }                                                                                          \
    }

SOFTMAX(float, f32)
SOFTMAX(double, f64)
