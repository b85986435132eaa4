// Products of f32 rows by block-quantized weights, out = x Ŵᵀ (the op's semantics are stated in
// src/backend/cpu/quant_product.rs and on Tensor::matmul_quantized_t): the rows of x are first
// rounded to 8 bits per block of 32 values exactly as the host rounds them (`quant_rows_q8`), then
// every weight row is decoded 16 values at a time into integer levels with a scale and an offset
// (`Unit`, the form the host's `decode_row` gives every format) and multiplied into up to QP_ROWS
// rows of x while its levels are in registers. The integer products of 16 values are exact; the
// units' scaled sums are added in float, in an order of their own (so the last bits differ from
// the host's).
//
// The rounded activations live in a scratch block the op allocates: per block of 32 values, its
// f32 scale then its 32 signed levels (QX_BYTES bytes, so a block's scale is 4-byte aligned).

#define QX_BYTES 36
#define QP_WARPS 4
#define QP_ROWS 8

// Rounds each block of 32 values of x (contiguous, `blocks` blocks) as the host's `quantize_block`:
// d = max|x| / 127, q = round half away from zero of x * (1/d), and d kept as the nearest f16 where
// f16 holds it as a normal number. One warp per block, a value per lane (the launch has 32 threads
// per block, so a warp's lanes run the loop together). Products and sums are rounded one by one
// (`__fmul_rn`, `__fadd_rn`) so that no fused multiply-add changes a level; the maximum ignores NaN,
// as the host's does.
extern "C" __global__ void quant_rows_q8(i64 blocks, const float* x, unsigned char* out) {
    GRID_STRIDE(t, blocks * 32) {
        const i64 b = t / 32;
        const int lane = (int)(t % 32);
        const float v = x[t];
        float amax = fabsf(v);
        for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(FULL_WARP, amax, o));
        const float exact = amax / 127.0f;
        const float id = exact == 0.0f ? 0.0f : 1.0f / exact;
        unsigned char* o = out + b * QX_BYTES;
        const float y = __fmul_rn(v, id);
        const float half = y < 0.0f ? -0.49999997f : 0.49999997f;
        ((signed char*)(o + 4))[lane] = (signed char)(int)__fadd_rn(y, half);
        if (lane == 0) {
            const unsigned short h = f16_from_float(exact);
            const unsigned int e = (h >> 10) & 0x1fu;
            const bool normal = e != 0 && e != 0x1fu;
            *(float*)o = exact == 0.0f || normal ? f16_to_float(h) : exact;
        }
    }
}

// Blocks are an even number of bytes and their fields start at even offsets, so 16-bit loads are
// aligned in every format (wider ones are not: Q4_0's blocks are 18 bytes).
__device__ __forceinline__ float qp_f16(const unsigned char* b) {
    return f16_to_float(*(const unsigned short*)b);
}

// Four bytes at an even address, little-endian, in two aligned 16-bit loads.
__device__ __forceinline__ unsigned int qp_u32(const unsigned char* b) {
    const unsigned short* h = (const unsigned short*)b;
    return (unsigned int)h[0] | ((unsigned int)h[1] << 16);
}

// 16 values of a weight row decoded: value i is scale * q_i + offset, the levels q_i (all within
// -32..63) packed four to an int, byte i % 4 of q[i / 4], for __dp4a.
struct Unit {
    int q[4];
    float scale, offset;
};

// Level v of value i into its byte of the unit (the unit's q starts zeroed).
__device__ __forceinline__ void qp_put(Unit& o, int i, int v) {
    o.q[i / 4] |= (v & 0xff) << (8 * (i % 4));
}

// ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block s of a Q4_K/Q5_K block.
__device__ __forceinline__ void qp_scale_min_k4(const unsigned char* sc, int s, int& d, int& m) {
    if (s < 4) {
        d = sc[s] & 63;
        m = sc[s + 4] & 63;
    } else {
        d = (sc[s + 4] & 0xf) | ((sc[s - 4] >> 6) << 4);
        m = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// The formats, by ggml's type number: bytes and 16-value units per block, and unit u of block b.
template <int TY> struct Fmt;

template <> struct Fmt<8> {  // Q8_0
    enum { BYTES = 34, UNITS = 2 };
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        o.scale = qp_f16(b);
        o.offset = 0.0f;
        for (int i = 0; i < 4; i++) o.q[i] = (int)qp_u32(b + 2 + 16 * u + 4 * i);
    }
};

// Q4_0 (2) and Q4_1 (3): low nibbles are values 0..15, high nibbles 16..31.
template <int AT, int BIAS> struct Fmt4 {
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        // Levels 0..15, four nibbles to an int; Q4_0's bias of 8 goes into the offset (exactly:
        // 8 times an f16 scale).
        o.scale = qp_f16(b);
        o.offset = AT == 4 ? qp_f16(b + 2) : -(float)BIAS * o.scale;
        for (int i = 0; i < 4; i++) o.q[i] = (int)((qp_u32(b + AT + 4 * i) >> (4 * u)) & 0x0f0f0f0fu);
    }
};
template <> struct Fmt<2> : Fmt4<2, 8> { enum { BYTES = 18, UNITS = 2 }; };
template <> struct Fmt<3> : Fmt4<4, 0> { enum { BYTES = 20, UNITS = 2 }; };

// Q5_0 (6) and Q5_1 (7): a nibble plus a fifth bit from the block's 32-bit mask.
template <int AT, int BIAS> struct Fmt5 {
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        o.scale = qp_f16(b);
        o.offset = AT == 4 ? qp_f16(b + 2) : 0.0f;
        const unsigned int high = (unsigned int)b[AT] | ((unsigned int)b[AT + 1] << 8) |
                                  ((unsigned int)b[AT + 2] << 16) | ((unsigned int)b[AT + 3] << 24);
        const unsigned char* qs = b + AT + 4;
        for (int i = 0; i < 16; i++) {
            const int h = (high >> (i + 16 * u)) & 1;
            qp_put(o, i, (((qs[i] >> (4 * u)) & 0xf) | (h << 4)) - BIAS);
        }
    }
};
template <> struct Fmt<6> : Fmt5<2, 16> { enum { BYTES = 22, UNITS = 2 }; };
template <> struct Fmt<7> : Fmt5<4, 0> { enum { BYTES = 24, UNITS = 2 }; };

// Q4_K (12) and Q5_K (13): 8 sub-blocks of 32 with 6-bit scales and minimums.
template <bool FIVE> struct FmtK45 {
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        const int s = u / 2, half = u % 2;
        int sc, m;
        qp_scale_min_k4(b + 4, s, sc, m);
        o.scale = qp_f16(b) * (float)sc;
        o.offset = -(qp_f16(b + 2) * (float)m);
        const unsigned char* qs = (FIVE ? b + 48 : b + 16) + (s / 2) * 32 + half * 16;
        const int shift = 4 * (s % 2);
        for (int i = 0; i < 4; i++) {
            unsigned int v = (qp_u32(qs + 4 * i) >> shift) & 0x0f0f0f0fu;
            if (FIVE) v |= ((qp_u32(b + 16 + half * 16 + 4 * i) >> s) & 0x01010101u) << 4;
            o.q[i] = (int)v;
        }
    }
};
template <> struct Fmt<12> : FmtK45<false> { enum { BYTES = 144, UNITS = 16 }; };
template <> struct Fmt<13> : FmtK45<true> { enum { BYTES = 176, UNITS = 16 }; };

template <> struct Fmt<14> {  // Q6_K: 16 sub-blocks of 16 with i8 scales, 6-bit levels
    enum { BYTES = 210, UNITS = 16 };
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        // Levels 0..63, the bias of 32 in the offset (exactly: 32 times the scale).
        o.scale = qp_f16(b + 208) * (float)(signed char)b[192 + u];
        o.offset = -32.0f * o.scale;
        const int a = u / 8, r = (u % 8) / 2, j0 = (u % 2) * 16;
        const unsigned char* low = b + a * 64 + (r % 2) * 32 + j0;
        const unsigned char* high = b + 128 + a * 32 + j0;
        for (int i = 0; i < 4; i++) {
            const unsigned int l = (qp_u32(low + 4 * i) >> (4 * (r / 2))) & 0x0f0f0f0fu;
            const unsigned int h = (qp_u32(high + 4 * i) >> (2 * r)) & 0x03030303u;
            o.q[i] = (int)(l | (h << 4));
        }
    }
};

template <> struct Fmt<10> {  // Q2_K: 16 sub-blocks of 16 with 4-bit scales and minimums
    enum { BYTES = 84, UNITS = 16 };
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        const int sc = b[u];
        o.scale = qp_f16(b + 80) * (float)(sc & 0xf);
        o.offset = -(qp_f16(b + 82) * (float)(sc >> 4));
        const int a = u / 8, s = (u % 8) / 2, j0 = (u % 2) * 16;
        for (int i = 0; i < 16; i++) qp_put(o, i, (b[16 + a * 32 + j0 + i] >> (2 * s)) & 3);
    }
};

template <> struct Fmt<11> {  // Q3_K: 16 sub-blocks of 16 with 6-bit scales, 3-bit levels
    enum { BYTES = 110, UNITS = 16 };
    static __device__ __forceinline__ void unit(const unsigned char* b, int u, Unit& o) {
        const unsigned char* packed = b + 96;
        const int low = (packed[u % 8] >> (4 * (u / 8))) & 0xf;
        const int high = (packed[8 + u % 4] >> (2 * (u / 4))) & 3;
        o.scale = qp_f16(b + 108) * (float)((low | (high << 4)) - 32);
        o.offset = 0.0f;
        const int a = u / 8, s = (u % 8) / 2, j0 = (u % 2) * 16, v32 = u / 2;
        for (int i = 0; i < 16; i++) {
            const int l = (b[32 + a * 32 + j0 + i] >> (2 * s)) & 3;
            const int h = ((b[j0 + i] >> v32) & 1) ^ 1;
            qp_put(o, i, l - (h << 2));
        }
    }
};

// out[t][j] for rows t0 + (0..QP_ROWS) of the rounded activations `xq` (m rows of k values) and
// every weight row j of `w` (n rows of k values in blocks of TY): one warp per weight row, its lanes
// taking the row's 32 values at a time in turn (two units, one activation block), each multiplied
// into every row of x before the next is decoded. The integer dot products are __dp4a's.
template <int TY>
__device__ void quant_product(i64 m, i64 k, i64 n, i64 t0, const unsigned char* w,
                              const unsigned char* xq, float* out) {
    const int lane = threadIdx.x % 32;
    const i64 j = (i64)blockIdx.x * QP_WARPS + threadIdx.x / 32;
    if (j >= n) return;  // the whole warp leaves; the block never synchronises
    t0 += (i64)blockIdx.y * QP_ROWS;
    const i64 rows = m - t0 < QP_ROWS ? m - t0 : QP_ROWS;
    const i64 units = k / 16, xblocks = k / 32;
    const unsigned char* row = w + j * (units / Fmt<TY>::UNITS) * Fmt<TY>::BYTES;
    float acc[QP_ROWS];
    for (int r = 0; r < QP_ROWS; r++) acc[r] = 0.0f;
    for (i64 c = lane; c < xblocks; c += 32) {
        // Value c·32.. of the row: units 2c and 2c + 1, against block c of each row of x.
        Unit d[2];
        for (int h = 0; h < 2; h++) {
            const i64 u = 2 * c + h;
            d[h] = Unit{{0, 0, 0, 0}, 0.0f, 0.0f};
            Fmt<TY>::unit(row + (u / Fmt<TY>::UNITS) * Fmt<TY>::BYTES, (int)(u % Fmt<TY>::UNITS),
                          d[h]);
        }
        for (int r = 0; r < QP_ROWS; r++) {
            if (r >= rows) break;
            const unsigned char* xb = xq + ((t0 + r) * xblocks + c) * QX_BYTES;
            const int* xs = (const int*)(xb + 4);
            float part = 0.0f;
            for (int h = 0; h < 2; h++) {
                int dot = 0, sum = 0;
                for (int i = 0; i < 4; i++) {
                    const int x4 = xs[4 * h + i];
                    dot = __dp4a(d[h].q[i], x4, dot);
                    sum = __dp4a(0x01010101, x4, sum);
                }
                part += d[h].scale * (float)dot + d[h].offset * (float)sum;
            }
            acc[r] += *(const float*)xb * part;
        }
    }
    for (int r = 0; r < QP_ROWS; r++) {
        if (r >= rows) break;
        const float v = warp_sum(acc[r]);
        if (lane == 0) out[(t0 + r) * n + j] = v;
    }
}

#define QUANT_PRODUCT(NAME, TY)                                                                   \
    extern "C" __global__ void quant_product_##NAME(i64 m, i64 k, i64 n, i64 t0,                  \
                                                    const unsigned char* w,                        \
                                                    const unsigned char* xq, float* out) {         \
        quant_product<TY>(m, k, n, t0, w, xq, out);                                                \
    }

QUANT_PRODUCT(q4_0, 2)
QUANT_PRODUCT(q4_1, 3)
QUANT_PRODUCT(q5_0, 6)
QUANT_PRODUCT(q5_1, 7)
QUANT_PRODUCT(q8_0, 8)
QUANT_PRODUCT(q2_k, 10)
QUANT_PRODUCT(q3_k, 11)
QUANT_PRODUCT(q4_k, 12)
QUANT_PRODUCT(q5_k, 13)
QUANT_PRODUCT(q6_k, 14)
