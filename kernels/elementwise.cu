// Elementwise kernels: unary maps with up to two scalar parameters, binary ops over broadcast
// operands, `where`, and dtype casts. Every operand (the output too) is described by a Geo, so one
// kernel serves contiguous, strided and broadcast tensors, and copies into views.

template <typename T> __device__ __forceinline__ T unary_apply(int op, T x, T p0, T p1) {
    switch (op) {
    case U_NEG: return -x;
    case U_ABS: return k_abs(x);
    case U_SQUARE: return x * x;
    case U_RELU: return (x > (T)0 || is_nan(x)) ? x : (T)0;
    case U_EXP: return k_exp(x);
    case U_LOG: return k_log(x);
    case U_SQRT: return k_sqrt(x);
    case U_RECIP: return (T)1 / x;
    case U_TANH: return k_tanh(x);
    case U_SIN: return k_sin(x);
    case U_COS: return k_cos(x);
    case U_SIGMOID: {
        // e^-|x| never overflows; the two branches give 1/(1+e^-x) for either sign.
        T e = k_exp(-k_abs(x));
        T r = (T)1 / ((T)1 + e);
        return x >= (T)0 ? r : e * r;
    }
    case U_GELU: {
        T c = (T)0.7978845608028654; // sqrt(2 / pi)
        T inner = c * (x + (T)0.044715 * x * x * x);
        return (T)0.5 * x * ((T)1 + k_tanh(inner));
    }
    case U_ADD_SCALAR: return x + p0;
    case U_MUL_SCALAR: return x * p0;
    case U_DIV_SCALAR: return x / p0;
    case U_POWF: return k_pow(x, p0);
    case U_CLAMP: return x < p0 ? p0 : (x > p1 ? p1 : x);
    case U_FILL: return p0;
    case U_LOG1P: return k_log1p(x);
    case U_EXPM1: return k_expm1(x);
    case U_ERF: return k_erf(x);
    case U_GELU_EXACT: return (T)0.5 * x * ((T)1 + k_erf(x * (T)0.7071067811865476)); // 1/sqrt(2)
    case U_SILU: return x / ((T)1 + k_exp(-x));
    default: return x;
    }
}

// Integer |x| without the float detour.
template <> __device__ __forceinline__ i64 unary_apply<i64>(int op, i64 x, i64 p0, i64 p1) {
    switch (op) {
    case U_NEG: return -x;
    case U_ABS: return k_abs_int(x);
    case U_SQUARE: return x * x;
    case U_RELU: return x > 0 ? x : 0;
    case U_ADD_SCALAR: return x + p0;
    case U_MUL_SCALAR: return x * p0;
    case U_DIV_SCALAR: return x / p0;
    case U_CLAMP: return x < p0 ? p0 : (x > p1 ? p1 : x);
    case U_FILL: return p0;
    default: return x;
    }
}

// Binary ops, and the derivatives autograd chains (`a` is the incoming gradient and `b` the op's
// input or output, as in src/autograd/ops.rs).
template <typename T> __device__ __forceinline__ T binary_apply(int op, T a, T b, T p0, T p1) {
    switch (op) {
    case B_ADD: return a + b;
    case B_SUB: return a - b;
    case B_MUL: return a * b;
    case B_DIV: return a / b;
    case B_MAXIMUM: return max_nan(a, b);
    case B_MINIMUM: return min_nan(a, b);
    case B_EQ: return a == b ? (T)1 : (T)0;
    case B_NE: return a != b ? (T)1 : (T)0;
    case B_LT: return a < b ? (T)1 : (T)0;
    case B_LE: return a <= b ? (T)1 : (T)0;
    case B_GT: return a > b ? (T)1 : (T)0;
    case B_GE: return a >= b ? (T)1 : (T)0;
    case B_POW: return k_pow(a, b);
    case B_AXPY: return a + p0 * b;
    case B_ASSIGN: return b;
    case B_NEG_GRAD: return -a;
    case B_ABS_GRAD: return b > (T)0 ? a : (b < (T)0 ? -a : (T)0);
    case B_SQUARE_GRAD: return a * b * (T)2;
    case B_SIN_GRAD: return a * k_cos(b);
    case B_COS_GRAD: return -(a * k_sin(b));
    case B_RELU_GRAD: return b > (T)0 ? a : (T)0;
    case B_GELU_GRAD: {
        T c = (T)0.7978845608028654; // sqrt(2 / pi)
        T k = (T)0.044715;
        T u = c * (b + k * b * b * b);
        T th = k_tanh(u);
        T du = c * ((T)1 + (T)3 * k * b * b);
        T d = (T)0.5 * ((T)1 + th) + (T)0.5 * b * ((T)1 - th * th) * du;
        return a * d;
    }
    case B_SQRT_GRAD: return a / (b + b);
    case B_RECIP_GRAD: return -(a * b * b);
    case B_TANH_GRAD: return a * ((T)1 - b * b);
    case B_SIGMOID_GRAD: return a * b * ((T)1 - b);
    case B_POWF_GRAD: return a * p0 * k_pow(b, p0 - (T)1);
    case B_CLAMP_GRAD: return (b >= p0 && b <= p1) ? a : (T)0;
    case B_MASK_NOT: return a * ((T)1 - b);
    case B_EXP_MUL: return k_exp(a) * b;
    case B_ERF_GRAD: return a * (T)1.1283791670955126 * k_exp(-(b * b)); // 2/sqrt(pi)
    case B_GELU_EXACT_GRAD: {
        T cdf = (T)0.5 * ((T)1 + k_erf(b * (T)0.7071067811865476));
        T pdf = (T)0.3989422804014327 * k_exp((T)-0.5 * b * b); // 1/sqrt(2 pi)
        return a * (cdf + b * pdf);
    }
    case B_SILU_GRAD: {
        T s = (T)1 / ((T)1 + k_exp(-b));
        return a * s * ((T)1 + b * ((T)1 - s));
    }
    default: return a;
    }
}

// T is the element type, C the type it computes in (float for the 16-bit types; T otherwise).
#define ELEMENTWISE(T, C, S)                                                                       \
    extern "C" __global__ void unary_##S(int op, i64 n, T* out, Geo go, const T* a, Geo ga, C p0,  \
                                         C p1) {                                                   \
        /* A fill reads nothing: its output has not been written yet. */                          \
        GRID_STRIDE(i, n) {                                                                        \
            C x = op == U_FILL ? (C)0 : ld(a[geo_at(ga, i)]);                                      \
            put(&out[geo_at(go, i)], unary_apply<C>(op, x, p0, p1));                               \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void binary_##S(int op, i64 n, T* out, Geo go, const T* a, Geo ga,       \
                                          const T* b, Geo gb, C p0, C p1) {                        \
        GRID_STRIDE(i, n) {                                                                        \
            C v = binary_apply<C>(op, ld(a[geo_at(ga, i)]), ld(b[geo_at(gb, i)]), p0, p1);         \
            put(&out[geo_at(go, i)], v);                                                           \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void where_##S(i64 n, T* out, const T* c, Geo gc, const T* t, Geo gt,    \
                                         const T* f, Geo gf) {                                     \
        GRID_STRIDE(i, n) { out[i] = ld(c[geo_at(gc, i)]) != (C)0 ? t[geo_at(gt, i)] : f[geo_at(gf, i)]; } \
    }

ELEMENTWISE(float, float, f32)
ELEMENTWISE(double, double, f64)
ELEMENTWISE(i64, i64, i64)
ELEMENTWISE(bf16, float, bf16)
ELEMENTWISE(f16, float, f16)

// A conversion as the host makes it: through double, and into a 16-bit type through float.
#define CAST(S, SN, D, DC, DN)                                                                     \
    extern "C" __global__ void cast_##SN##_##DN(i64 n, D* out, Geo go, const S* a, Geo ga) {        \
        GRID_STRIDE(i, n) { put(&out[geo_at(go, i)], convert<DC>((double)ld(a[geo_at(ga, i)]))); } \
    }

// Same-type "casts" are strided copies; i64 -> i64 must not go through double (it would round).
#define COPY(T, N)                                                                                 \
    extern "C" __global__ void cast_##N##_##N(i64 n, T* out, Geo go, const T* a, Geo ga) {         \
        GRID_STRIDE(i, n) { out[geo_at(go, i)] = a[geo_at(ga, i)]; }                               \
    }

COPY(float, f32)
COPY(double, f64)
COPY(i64, i64)
COPY(bf16, bf16)
COPY(f16, f16)
CAST(float, f32, double, double, f64)
CAST(float, f32, i64, i64, i64)
CAST(float, f32, bf16, float, bf16)
CAST(float, f32, f16, float, f16)
CAST(double, f64, float, float, f32)
CAST(double, f64, i64, i64, i64)
CAST(double, f64, bf16, float, bf16)
CAST(double, f64, f16, float, f16)
CAST(i64, i64, float, float, f32)
CAST(i64, i64, double, double, f64)
CAST(i64, i64, bf16, float, bf16)
CAST(i64, i64, f16, float, f16)
CAST(bf16, bf16, float, float, f32)
CAST(bf16, bf16, double, double, f64)
CAST(bf16, bf16, i64, i64, i64)
CAST(bf16, bf16, f16, float, f16)
CAST(f16, f16, float, float, f32)
CAST(f16, f16, double, double, f64)
CAST(f16, f16, i64, i64, i64)
CAST(f16, f16, bf16, float, bf16)
