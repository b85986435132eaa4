// Optimizer updates: one pass per parameter that rewrites the parameter and its state from the
// (contiguous) gradient, the same arithmetic as the host's fused update.

#define OPTIM(T, S)                                                                                \
    extern "C" __global__ void sgd_##S(i64 n, T* p, T* velocity, const T* g, T lr, T mu, T wd,     \
                                       int nesterov) {                                             \
        GRID_STRIDE(i, n) {                                                                        \
            T d = g[i] + wd * p[i];                                                                \
            T v = mu * velocity[i] + d;                                                            \
            velocity[i] = v;                                                                       \
            T step = nesterov ? d + mu * v : v;                                                    \
            p[i] = p[i] - lr * step;                                                               \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_##S(i64 n, T* p, T* m, T* v, const T* g,                       \
                                        const double* powers, T b1, T b2, T eps, double lr, T l2,  \
                                        T decay) {                                                 \
        /* The bias corrections from [b1^t, b2^t] on the device (a replayed graph sees each t). */ \
        T step_size = (T)(lr / (1.0 - powers[0]));                                                 \
        T v_scale = (T)(1.0 / sqrt(1.0 - powers[1]));                                              \
        GRID_STRIDE(i, n) {                                                                        \
            T gi = g[i] + l2 * p[i];                                                               \
            T mi = b1 * m[i] + ((T)1 - b1) * gi;                                                   \
            T vi = b2 * v[i] + ((T)1 - b2) * gi * gi;                                              \
            m[i] = mi;                                                                             \
            v[i] = vi;                                                                             \
            T denom = k_sqrt(vi) * v_scale + eps;                                                  \
            p[i] = decay * p[i] - step_size * mi / denom;                                          \
        }                                                                                          \
    }

OPTIM(float, f32)
OPTIM(double, f64)
