// Rotary position embedding (the op's semantics are stated on Tensor::rotary): x is contiguous
// [tokens, heads, dim], cos and sin [positions, dim/2] in C, pos [tokens]. One thread per plane
// (token, head, i < dim/2) reads x[i] and x[i + dim/2] and writes both rotated values; `inverse`
// turns by the opposite angle (the derivative). A position out of range (only a captured step can
// pass one; the op checks them on the host otherwise) gives NaN rather than a read out of bounds.

#define ROTARY(T, C, S)                                                                            \
    extern "C" __global__ void rotary_##S(i64 tokens, i64 heads, i64 half, i64 positions,          \
                                          T* out, const T* x, const C* cos_t, const C* sin_t,      \
                                          const i64* pos, int inverse) {                           \
        GRID_STRIDE(k, tokens * heads * half) {                                                    \
            const i64 i = k % half, row = k / half, token = row / heads;                           \
            const i64 a_at = row * 2 * half + i, b_at = a_at + half;                               \
            const i64 p = pos[token];                                                              \
            if (p < 0 || p >= positions) {                                                         \
                put(&out[a_at], Limits<C>::nan());                                                 \
                put(&out[b_at], Limits<C>::nan());                                                 \
                continue;                                                                          \
            }                                                                                      \
            const C c = cos_t[p * half + i];                                                       \
            const C s = inverse ? -sin_t[p * half + i] : sin_t[p * half + i];                      \
            const C a = ld(x[a_at]), b = ld(x[b_at]);                                              \
            put(&out[a_at], a * c - b * s);                                                        \
            put(&out[b_at], b * c + a * s);                                                        \
        }                                                                                          \
    }

ROTARY(float, float, f32)
ROTARY(double, double, f64)
ROTARY(bf16, float, bf16)
ROTARY(f16, float, f16)
