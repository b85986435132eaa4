// Fused attention (`Attention` in src/backend/op.rs states the math): one warp per query row in the
// forward pass, the keys taken 32 at a time (one per lane) with a running maximum, so no [queries,
// keys] tensor exists. Each lane keeps 1/32 of the row's output width in registers. The backward
// pass is two kernels without atomics, so its result does not depend on the schedule: one warp per
// query row for dq (it also stores D_i = dout_i . out_i), then one warp per key row for dk and dv.
// C is the compute type (float for the 16-bit types).

#define ATTN_WARPS 4
#define ATTN_MAX_WIDTH 256
#define ATTN_PER_LANE (ATTN_MAX_WIDTH / 32)

// The operands' strides (batch, head, row; the width's is 1), by index into AttnGeo::s.
#define A_Q 0
#define A_K 1
#define A_V 2
#define A_O 3
#define A_DO 4
#define A_DQ 5
#define A_DK 6
#define A_DV 7

struct AttnGeo {
    i64 batch, heads, queries, keys, width, vwidth;
    i64 causal, offset;  // with causal != 0, query i sees keys j <= i + offset
    i64 group;           // query heads per key and value head (grouped-query attention)
    i64 window;          // with causal != 0 and window > 0, query i sees keys j > i + offset - window
    i64 s[8][3];
};

// The first key query i sees: past the sliding window's start, or 0.
__device__ __forceinline__ i64 attn_first(const AttnGeo& g, i64 i) {
    if (!g.causal || g.window <= 0) return 0;
    i64 n = i + g.offset + 1 - g.window;
    return n < 0 ? 0 : n;
}

// How many keys, from the first, query i sees when its batch holds `keys`.
__device__ __forceinline__ i64 attn_visible(const AttnGeo& g, i64 i, i64 keys) {
    if (!g.causal) return keys;
    i64 n = i + g.offset + 1;
    return n < 0 ? 0 : (n > keys ? keys : n);
}

// The keys batch b holds: all, or its length clamped to [0, keys].
__device__ __forceinline__ i64 attn_keys(const AttnGeo& g, const i64* lengths, i64 b) {
    if (!lengths) return g.keys;
    i64 n = lengths[b];
    return n < 0 ? 0 : (n > g.keys ? g.keys : n);
}

// Keys and values are read from head h / group (grouped-query attention); every other operand,
// the key and value gradients included (one per query head, summed by the op), at head h.
__device__ __forceinline__ i64 attn_at(const AttnGeo& g, int which, i64 b, i64 h, i64 row) {
    if (which == A_K || which == A_V) h /= g.group;
    return b * g.s[which][0] + h * g.s[which][1] + row * g.s[which][2];
}

// Row `x` (width n) into this warp's shared row, in the compute type.
template <typename T, typename C> __device__ __forceinline__ void attn_load_row(C* to, const T* x, i64 n, int lane) {
    for (i64 c = lane; c < n; c += 32) to[c] = ld(x[c]);
    __syncwarp();
}

template <typename T, typename C> __device__ __forceinline__ C attn_dot(const C* a, const T* b, i64 n) {
    C d = (C)0;
    for (i64 c = 0; c < n; c++) d += a[c] * ld(b[c]);
    return d;
}

template <typename T, typename C>
__device__ void attention_forward(const AttnGeo& g, T* out, C* lse, const T* q, const T* k, const T* v,
                                  const i64* lengths, C scale) {
    __shared__ C qrow[ATTN_WARPS][ATTN_MAX_WIDTH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 i = (i64)blockIdx.x * ATTN_WARPS + warp;
    if (i >= g.queries) return;  // the whole warp leaves; the block never synchronises
    attn_load_row(qrow[warp], q + attn_at(g, A_Q, b, h, i), g.width, lane);
    const i64 seen = attn_visible(g, i, attn_keys(g, lengths, b));
    const i64 from = attn_first(g, i);
    C acc[ATTN_PER_LANE];
    for (int t = 0; t < ATTN_PER_LANE; t++) acc[t] = (C)0;
    C m = Limits<C>::lowest(), l = (C)0;
    for (i64 j0 = from; j0 < seen; j0 += 32) {
        const i64 j = j0 + lane;
        C s = Limits<C>::lowest();
        if (j < seen) s = scale * attn_dot(qrow[warp], k + attn_at(g, A_K, b, h, j), g.width);
        const C tile_max = warp_max(s);
        const C new_m = tile_max > m ? tile_max : m;
        const C p = j < seen ? k_exp(s - new_m) : (C)0;
        const C rescale = k_exp(m - new_m);  // 0 on the first tile (m = -inf)
        l = l * rescale + warp_sum(p);
        for (int t = 0; t < ATTN_PER_LANE; t++) acc[t] *= rescale;
        const i64 n = seen - j0 < 32 ? seen - j0 : 32;
        for (int u = 0; u < n; u++) {
            const C pu = __shfl_sync(FULL_WARP, p, u);
            const T* vu = v + attn_at(g, A_V, b, h, j0 + u);
            for (int t = 0; t < ATTN_PER_LANE; t++) {
                const i64 c = lane + 32 * t;
                if (c < g.vwidth) acc[t] += pu * ld(vu[c]);
            }
        }
        m = new_m;
    }
    T* oi = out + attn_at(g, A_O, b, h, i);
    const C inv = l > (C)0 ? (C)1 / l : (C)0;  // no key seen: zeros
    for (int t = 0; t < ATTN_PER_LANE; t++) {
        const i64 c = lane + 32 * t;
        if (c < g.vwidth) put(&oi[c], acc[t] * inv);
    }
    if (lane == 0) lse[bh * g.queries + i] = l > (C)0 ? m + k_log(l) : Limits<C>::lowest();
}

template <typename T, typename C>
__device__ void attention_backward_dq(const AttnGeo& g, T* dq, C* delta, const T* q, const T* k, const T* v,
                                      const T* out, const T* dout, const C* lse, const i64* lengths, C scale) {
    __shared__ C qrow[ATTN_WARPS][ATTN_MAX_WIDTH];
    __shared__ C drow[ATTN_WARPS][ATTN_MAX_WIDTH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 i = (i64)blockIdx.x * ATTN_WARPS + warp;
    if (i >= g.queries) return;
    attn_load_row(qrow[warp], q + attn_at(g, A_Q, b, h, i), g.width, lane);
    attn_load_row(drow[warp], dout + attn_at(g, A_DO, b, h, i), g.vwidth, lane);
    const T* oi = out + attn_at(g, A_O, b, h, i);
    C part = (C)0;
    for (i64 c = lane; c < g.vwidth; c += 32) part += drow[warp][c] * ld(oi[c]);
    const C d = warp_sum(part);
    if (lane == 0) delta[bh * g.queries + i] = d;
    const C li = lse[bh * g.queries + i];
    const i64 seen = li == Limits<C>::lowest() ? 0 : attn_visible(g, i, attn_keys(g, lengths, b));
    C acc[ATTN_PER_LANE];
    for (int t = 0; t < ATTN_PER_LANE; t++) acc[t] = (C)0;
    for (i64 j0 = attn_first(g, i); j0 < seen; j0 += 32) {
        const i64 j = j0 + lane;
        C ds = (C)0;
        if (j < seen) {
            const C p = k_exp(scale * attn_dot(qrow[warp], k + attn_at(g, A_K, b, h, j), g.width) - li);
            const C dp = attn_dot(drow[warp], v + attn_at(g, A_V, b, h, j), g.vwidth);
            ds = p * (dp - d) * scale;
        }
        const i64 n = seen - j0 < 32 ? seen - j0 : 32;
        for (int u = 0; u < n; u++) {
            const C du = __shfl_sync(FULL_WARP, ds, u);
            const T* ku = k + attn_at(g, A_K, b, h, j0 + u);
            for (int t = 0; t < ATTN_PER_LANE; t++) {
                const i64 c = lane + 32 * t;
                if (c < g.width) acc[t] += du * ld(ku[c]);
            }
        }
    }
    T* gi = dq + attn_at(g, A_DQ, b, h, i);
    for (int t = 0; t < ATTN_PER_LANE; t++) {
        const i64 c = lane + 32 * t;
        if (c < g.width) put(&gi[c], acc[t]);
    }
}

template <typename T, typename C>
__device__ void attention_backward_dkv(const AttnGeo& g, T* dk, T* dv, const T* q, const T* k, const T* v,
                                       const T* dout, const C* lse, const C* delta, const i64* lengths,
                                       C scale) {
    __shared__ C krow[ATTN_WARPS][ATTN_MAX_WIDTH];
    __shared__ C vrow[ATTN_WARPS][ATTN_MAX_WIDTH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 j = (i64)blockIdx.x * ATTN_WARPS + warp;
    if (j >= g.keys) return;
    attn_load_row(krow[warp], k + attn_at(g, A_K, b, h, j), g.width, lane);
    attn_load_row(vrow[warp], v + attn_at(g, A_V, b, h, j), g.vwidth, lane);
    // The queries that see key j: from the first whose causal bound passes j, if the batch holds j,
    // to the last whose sliding window still holds it.
    i64 first = g.queries, end = g.queries;
    if (j < attn_keys(g, lengths, b)) first = g.causal ? (j - g.offset > 0 ? j - g.offset : 0) : 0;
    if (g.causal && g.window > 0) {
        const i64 last = j - g.offset + g.window;  // one past the last query whose window holds j
        end = last < 0 ? 0 : (last < g.queries ? last : g.queries);
    }
    C acc_k[ATTN_PER_LANE], acc_v[ATTN_PER_LANE];
    for (int t = 0; t < ATTN_PER_LANE; t++) acc_k[t] = acc_v[t] = (C)0;
    for (i64 i0 = first; i0 < end; i0 += 32) {
        const i64 i = i0 + lane;
        C p = (C)0, ds = (C)0;
        if (i < end) {
            const C li = lse[bh * g.queries + i];
            if (li != Limits<C>::lowest()) {
                p = k_exp(scale * attn_dot(krow[warp], q + attn_at(g, A_Q, b, h, i), g.width) - li);
                const C dp = attn_dot(vrow[warp], dout + attn_at(g, A_DO, b, h, i), g.vwidth);
                ds = p * (dp - delta[bh * g.queries + i]) * scale;
            }
        }
        const i64 n = end - i0 < 32 ? end - i0 : 32;
        for (int u = 0; u < n; u++) {
            const C pu = __shfl_sync(FULL_WARP, p, u);
            const C du = __shfl_sync(FULL_WARP, ds, u);
            const T* qu = q + attn_at(g, A_Q, b, h, i0 + u);
            const T* gu = dout + attn_at(g, A_DO, b, h, i0 + u);
            for (int t = 0; t < ATTN_PER_LANE; t++) {
                const i64 c = lane + 32 * t;
                if (c < g.width) acc_k[t] += du * ld(qu[c]);
                if (c < g.vwidth) acc_v[t] += pu * ld(gu[c]);
            }
        }
    }
    T* gk = dk + attn_at(g, A_DK, b, h, j);
    T* gv = dv + attn_at(g, A_DV, b, h, j);
    for (int t = 0; t < ATTN_PER_LANE; t++) {
        const i64 c = lane + 32 * t;
        if (c < g.width) put(&gk[c], acc_k[t]);
        if (c < g.vwidth) put(&gv[c], acc_v[t]);
    }
}

#define ATTENTION(T, C, S)                                                                         \
    extern "C" __global__ void attention_fwd_##S(AttnGeo g, T* out, C* lse, const T* q, const T* k, \
                                                 const T* v, const i64* lengths, C scale) {        \
        attention_forward<T, C>(g, out, lse, q, k, v, lengths, scale);                             \
    }                                                                                              \
    extern "C" __global__ void attention_bwd_dq_##S(AttnGeo g, T* dq, C* delta, const T* q,        \
                                                    const T* k, const T* v, const T* out,          \
                                                    const T* dout, const C* lse,                   \
                                                    const i64* lengths, C scale) {                 \
        attention_backward_dq<T, C>(g, dq, delta, q, k, v, out, dout, lse, lengths, scale);        \
    }                                                                                              \
    extern "C" __global__ void attention_bwd_dkv_##S(AttnGeo g, T* dk, T* dv, const T* q,          \
                                                     const T* k, const T* v, const T* dout,        \
                                                     const C* lse, const C* delta,                 \
                                                     const i64* lengths, C scale) {                \
        attention_backward_dkv<T, C>(g, dk, dv, q, k, v, dout, lse, delta, lengths, scale);        \
    }

ATTENTION(float, float, f32)
ATTENTION(double, double, f64)
ATTENTION(bf16, float, bf16)
ATTENTION(f16, float, f16)
