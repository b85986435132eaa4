// Shared by every kernel file: element types, operand layouts, math for each element type, and the
// op codes (src/backend/op.rs holds the same numbers; a test compares the two lists).
//
// The files are concatenated in this order and compiled by NVRTC once per GPU, so there is no
// #include and no host code here.

typedef long long i64;

// An operand as ndscope lays it out: shape, strides in elements (0 along broadcast axes) and the
// offset of the first element. `contiguous` skips the index arithmetic for row-major operands.
#define MAX_RANK 8
struct Geo {
    i64 shape[MAX_RANK];
    i64 stride[MAX_RANK];
    i64 offset;
    int rank;
    int contiguous;
};

// Position in memory of the i-th element in row-major order.
__device__ __forceinline__ i64 geo_at(const Geo& g, i64 i) {
    if (g.contiguous) {
        return g.offset + i;
    }
    i64 at = g.offset;
    for (int d = g.rank - 1; d >= 0; --d) {
        i64 n = g.shape[d];
        at += (i % n) * g.stride[d];
        i /= n;
    }
    return at;
}

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)gridDim.x * blockDim.x)

// Threads per block of the row kernels (reductions, softmax); a power of two.
#define ROW_THREADS 256

// Math for every element type. Integer versions exist so the templates compile for i64; ndscope
// never calls them (transcendental ops refuse integer tensors before launching).
#define MATH1(name, ffun, dfun) \
    __device__ __forceinline__ float name(float x) { return ffun(x); } \
    __device__ __forceinline__ double name(double x) { return dfun(x); } \
    __device__ __forceinline__ i64 name(i64 x) { return (i64)dfun((double)x); }
MATH1(k_exp, expf, exp)
MATH1(k_log, logf, log)
MATH1(k_sqrt, sqrtf, sqrt)
MATH1(k_tanh, tanhf, tanh)
MATH1(k_sin, sinf, sin)
MATH1(k_cos, cosf, cos)
MATH1(k_abs, fabsf, fabs)
MATH1(k_log1p, log1pf, log1p)
MATH1(k_expm1, expm1f, expm1)
MATH1(k_erf, erff, erf)
__device__ __forceinline__ i64 k_abs_int(i64 x) { return x < 0 ? -x : x; }
__device__ __forceinline__ float k_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double k_pow(double a, double b) { return pow(a, b); }
__device__ __forceinline__ i64 k_pow(i64 a, i64 b) { return (i64)pow((double)a, (double)b); }

// NVRTC has no INFINITY or NAN macros (it includes no system headers), so the limits are spelled
// with their IEEE 754 bit patterns.
template <typename T> struct Limits;
template <> struct Limits<float> {
    static __device__ __forceinline__ float lowest() { return __int_as_float(0xff800000); }
    static __device__ __forceinline__ float highest() { return __int_as_float(0x7f800000); }
    static __device__ __forceinline__ float nan() { return __int_as_float(0x7fc00000); }
};
template <> struct Limits<double> {
    static __device__ __forceinline__ double lowest() { return __longlong_as_double(0xfff0000000000000LL); }
    static __device__ __forceinline__ double highest() { return __longlong_as_double(0x7ff0000000000000LL); }
    static __device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }
};
template <> struct Limits<i64> {
    static __device__ __forceinline__ i64 lowest() { return (i64)(-9223372036854775807LL - 1); }
    static __device__ __forceinline__ i64 highest() { return (i64)9223372036854775807LL; }
    static __device__ __forceinline__ i64 nan() { return 0; }
};

template <typename T> __device__ __forceinline__ bool is_nan(T x) { return x != x; }

// 16-bit floats are stored as their bits and computed in float, as on the host (src/dtype.rs):
// `ld` widens an element to its compute type (exactly), `put` rounds a computed value into an element
// (to nearest, ties to even; NaN stays NaN, overflow gives inf). The conversions are written out in
// integer arithmetic, so no CUDA header is needed and the host compiler can check them
// (.ci/check-kernels runs them against the compiler's own conversions).
struct bf16 {
    unsigned short bits;
};
struct f16 {
    unsigned short bits;
};

__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

__device__ __forceinline__ unsigned short bf16_from_float(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u); // quiet NaN
    // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even; a carry moves into
    // the exponent, and out of the largest finite value into inf, as it should.
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float f16_to_float(unsigned short h) {
    unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    unsigned int exponent = (h >> 10) & 0x1fu;
    unsigned int mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13)); // inf, NaN
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return __uint_as_float(sign | __float_as_uint(magnitude));
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

__device__ __forceinline__ unsigned short f16_from_float(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u); // NaN
    if (a >= 0x47800000u) return (unsigned short)(sign | 0x7c00u); // 2^16 and above (and inf): inf
    if (a < 0x38800000u) {
        // Below 2^-14, f16 is subnormal (steps of 2^-24): adding 0.5 moves the value's bits so that
        // the float addition itself rounds them to that step, to nearest, ties to even.
        float shifted = __uint_as_float(a) + 0.5f;
        return (unsigned short)(sign | (__float_as_uint(shifted) - 0x3f000000u));
    }
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest, ties to even;
    // a carry out of the largest finite value (65504) gives inf.
    unsigned int rounded = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
    return (unsigned short)(sign | (rounded >> 13));
}

__device__ __forceinline__ bf16 bf16_of_bits(unsigned short b) { bf16 h; h.bits = b; return h; }
__device__ __forceinline__ f16 f16_of_bits(unsigned short b) { f16 h; h.bits = b; return h; }

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ double ld(double x) { return x; }
__device__ __forceinline__ i64 ld(i64 x) { return x; }
__device__ __forceinline__ float ld(bf16 x) { return bf16_to_float(x.bits); }
__device__ __forceinline__ float ld(f16 x) { return f16_to_float(x.bits); }

__device__ __forceinline__ void put(float* at, float v) { *at = v; }
__device__ __forceinline__ void put(double* at, double v) { *at = v; }
__device__ __forceinline__ void put(i64* at, i64 v) { *at = v; }
__device__ __forceinline__ void put(bf16* at, float v) { at->bits = bf16_from_float(v); }
__device__ __forceinline__ void put(f16* at, float v) { at->bits = f16_from_float(v); }

// max and min that propagate NaN, as the host kernels do.
template <typename T> __device__ __forceinline__ T max_nan(T a, T b) { return (is_nan(a) || a > b) ? a : b; }
template <typename T> __device__ __forceinline__ T min_nan(T a, T b) { return (is_nan(a) || a < b) ? a : b; }

// Conversions with the host's rules: floats to integers truncate, saturate and send NaN to 0.
template <typename D> __device__ __forceinline__ D convert(double x) { return (D)x; }
template <> __device__ __forceinline__ i64 convert<i64>(double x) {
    if (x != x) return 0;
    if (x >= 9223372036854775807.0) return Limits<i64>::highest();
    if (x <= -9223372036854775808.0) return Limits<i64>::lowest();
    return (i64)x;
}

// Unary op codes (elementwise.cu).
#define U_NEG 1
#define U_ABS 2
#define U_SQUARE 3
#define U_RELU 4
#define U_EXP 5
#define U_LOG 6
#define U_SQRT 7
#define U_RECIP 8
#define U_TANH 9
#define U_SIN 10
#define U_COS 11
#define U_SIGMOID 12
#define U_GELU 13
#define U_ADD_SCALAR 14
#define U_MUL_SCALAR 15
#define U_DIV_SCALAR 16
#define U_POWF 17
#define U_CLAMP 18
#define U_FILL 19
#define U_LOG1P 20
#define U_EXPM1 21
#define U_ERF 22
#define U_GELU_EXACT 23
#define U_SILU 24

// Binary op codes (elementwise.cu).
#define B_ADD 0
#define B_SUB 1
#define B_MUL 2
#define B_DIV 3
#define B_MAXIMUM 4
#define B_MINIMUM 5
#define B_EQ 6
#define B_NE 7
#define B_LT 8
#define B_LE 9
#define B_GT 10
#define B_GE 11
#define B_POW 12
#define B_AXPY 13
#define B_ASSIGN 14
#define B_NEG_GRAD 15
#define B_ABS_GRAD 16
#define B_SQUARE_GRAD 17
#define B_SIN_GRAD 18
#define B_COS_GRAD 19
#define B_RELU_GRAD 20
#define B_GELU_GRAD 21
#define B_SQRT_GRAD 22
#define B_RECIP_GRAD 23
#define B_TANH_GRAD 24
#define B_SIGMOID_GRAD 25
#define B_POWF_GRAD 26
#define B_CLAMP_GRAD 27
#define B_MASK_NOT 28
#define B_EXP_MUL 29
#define B_ERF_GRAD 30
#define B_GELU_EXACT_GRAD 31
#define B_SILU_GRAD 32

// Reduction op codes (reduce.cu).
#define R_SUM 0
#define R_MAX 1
#define R_MIN 2
#define R_MEAN 3

// Row reductions' identity and combination (op is R_SUM, R_MAX, R_MIN or R_MEAN), and the block-wide
// combination the row kernels (reduce.cu, softmax.cu) share.
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

// Warp-wide reductions (every lane gets the result): attention and paged attention.
#define FULL_WARP 0xffffffffu

template <typename C> __device__ __forceinline__ C warp_sum(C x) {
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(FULL_WARP, x, o);
    return x;
}

template <typename C> __device__ __forceinline__ C warp_max(C x) {
    for (int o = 16; o > 0; o /= 2) {
        C y = __shfl_xor_sync(FULL_WARP, x, o);
        x = y > x ? y : x;
    }
    return x;
}
