// Optimizer updates: one pass per parameter that rewrites the parameter and its state from the
// (contiguous) gradient, the same arithmetic as the host's fused update. T is the element type, C
// the type the update is computed in (float for the 16-bit types: each target is rounded once).

#define OPTIM(T, C, S)                                                                             \
    extern "C" __global__ void sgd_##S(i64 n, T* p, T* velocity, const T* g, C lr, C mu, C wd,     \
                                       int nesterov) {                                             \
        GRID_STRIDE(i, n) {                                                                        \
            C pi = ld(p[i]);                                                                       \
            C d = ld(g[i]) + wd * pi;                                                              \
            C v = mu * ld(velocity[i]) + d;                                                        \
            put(&velocity[i], v);                                                                  \
            C step = nesterov ? d + mu * v : v;                                                    \
            put(&p[i], pi - lr * step);                                                            \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void adam_##S(i64 n, T* p, T* m, T* v, const T* g,                       \
                                        const double* powers, C b1, C b2, C eps, double lr, C l2,  \
                                        C decay) {                                                 \
        /* The bias corrections from [b1^t, b2^t] on the device (a replayed graph sees each t). */ \
        C step_size = (C)(lr / (1.0 - powers[0]));                                                 \
        C v_scale = (C)(1.0 / sqrt(1.0 - powers[1]));                                              \
        GRID_STRIDE(i, n) {                                                                        \
            C pi = ld(p[i]);                                                                       \
            C gi = ld(g[i]) + l2 * pi;                                                             \
            C mi = b1 * ld(m[i]) + ((C)1 - b1) * gi;                                               \
            C vi = b2 * ld(v[i]) + ((C)1 - b2) * gi * gi;                                          \
            put(&m[i], mi);                                                                        \
            put(&v[i], vi);                                                                        \
            C denom = k_sqrt(vi) * v_scale + eps;                                                  \
            put(&p[i], decay * pi - step_size * mi / denom);                                       \
        }                                                                                          \
    }

OPTIM(float, float, f32)
OPTIM(double, double, f64)
OPTIM(bf16, float, bf16)
OPTIM(f16, float, f16)
