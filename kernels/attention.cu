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

// ---- Tiled kernels: f32, bf16 and f16 (float compute), head widths up to 128 ----
//
// The kernels above read every key once per query row (and every query once per key row), each lane
// a different row: at GPT-2's [1, 12, 1024, 64] they took 2.3 ms forward and 10.4 ms forward and
// backward on an H200, where PyTorch's scaled_dot_product_attention took 0.16 and 0.69 ms. These
// share the other side's rows among the rows of a block instead: a block of ATTN_WARPS warps holds
// TR rows per warp, and the other side's rows come through shared memory a tile of KT = 4096 / W
// rows at a time, loaded once (coalesced) for all 4·TR rows. Each lane computes the dot products of
// its KT/32 tile rows with the warp's TR rows (the tile's rows padded to W + 4 floats, so that the
// 16-byte loads of a quarter-warp fall in distinct banks) and owns W/32 of the output columns. The
// masks are those of the kernels above, element by element; a block skips the tiles none of its rows
// sees. TR is chosen per kernel so that its shared memory stays under the 48 KiB a block has without
// opting in. f64 keeps the kernels above (its tiles would not fit), and so do heads wider than 128.

#define ATTN_THREADS (32 * ATTN_WARPS)

// A tile of other-side rows for heads up to W wide: KT rows of P floats.
template <int W> struct AttnTile {
    static constexpr int KT = 4096 / W;
    static constexpr int P = W + 4;
};

// Rows [0, n) of `src` (row stride `stride`) into `tile`, zeros past n rows and past `width`
// columns: by every thread of the block.
template <int W, typename T>
__device__ __forceinline__ void attn_tile_load(float* tile, const T* src, i64 stride, i64 n, i64 width) {
    constexpr int KT = AttnTile<W>::KT, P = AttnTile<W>::P;
    for (int e = threadIdx.x; e < KT * W; e += ATTN_THREADS) {
        const int r = e / W, c = e % W;
        tile[r * P + c] = r < n && c < width ? ld(src[r * stride + c]) : 0.f;
    }
}

// This warp's row `at` (width n) into `row` (W floats), zeros past n; an absent row (`at` null) is
// all zeros.
template <int W, typename T>
__device__ __forceinline__ void attn_own_load(float* row, const T* at, i64 n, int lane) {
    for (int c = lane; c < W; c += 32) row[c] = at && c < n ? ld(at[c]) : 0.f;
}

// s[r][t] = own row r . tile row (lane + 32 t), over the first `width4` columns (a multiple of 4;
// both sides hold zeros past the head's width).
template <int W, int TR>
__device__ __forceinline__ void attn_tile_dots(float (&s)[TR][AttnTile<W>::KT / 32], const float* own,
                                               const float* tile, int lane, int width4) {
    constexpr int KPL = AttnTile<W>::KT / 32, P = AttnTile<W>::P;
    for (int r = 0; r < TR; r++)
        for (int t = 0; t < KPL; t++) s[r][t] = 0.f;
    for (int c = 0; c < width4; c += 4) {
        float x[KPL][4];
        for (int t = 0; t < KPL; t++)
            for (int e = 0; e < 4; e++) x[t][e] = tile[(lane + 32 * t) * P + c + e];
        for (int r = 0; r < TR; r++) {
            const float* a = own + r * W + c;
            for (int t = 0; t < KPL; t++)
                s[r][t] += a[0] * x[t][0] + a[1] * x[t][1] + a[2] * x[t][2] + a[3] * x[t][3];
        }
    }
}

// acc[r][t] += sum over the tile's rows u of w[r][u] · tile[u][lane + 32 t] (`w` is this warp's TR
// rows of KT weights, zero for rows a row does not see).
template <int W, int TR>
__device__ __forceinline__ void attn_tile_accumulate(float (&acc)[TR][W / 32], const float* w, const float* tile,
                                                     int lane) {
    constexpr int KT = AttnTile<W>::KT, P = AttnTile<W>::P;
    for (int u = 0; u < KT; u++) {
        float x[W / 32];
        for (int t = 0; t < W / 32; t++) x[t] = tile[u * P + lane + 32 * t];
        for (int r = 0; r < TR; r++) {
            const float wr = w[r * KT + u];
            for (int t = 0; t < W / 32; t++) acc[r][t] += wr * x[t];
        }
    }
}

// The keys query row i sees in batch b: [from, seen); empty past the queries.
__device__ __forceinline__ void attn_query_range(const AttnGeo& g, i64 i, i64 keys, i64& from, i64& seen) {
    from = 0;
    seen = 0;
    if (i < g.queries) {
        from = attn_first(g, i);
        seen = attn_visible(g, i, keys);
    }
}

// The queries that see key row j in batch b: [first, end), as attention_backward_dkv finds them.
__device__ __forceinline__ void attn_key_range(const AttnGeo& g, i64 j, i64 keys, i64& first, i64& end) {
    first = g.queries;
    end = g.queries;
    if (j < g.keys && j < keys) first = g.causal ? (j - g.offset > 0 ? j - g.offset : 0) : 0;
    if (g.causal && g.window > 0) {
        const i64 last = j - g.offset + g.window;
        end = last < 0 ? 0 : (last < g.queries ? last : g.queries);
    }
}

// The scale of a running sum when its maximum moves from m to new_m (1 while no score was seen).
__device__ __forceinline__ float attn_rescale(float m, float new_m) {
    return new_m == Limits<float>::lowest() ? 1.f : k_exp(m - new_m);
}

// The other side's rows any of the block's `rows` rows from row0 sees: [lo, hi), empty when no row
// sees any. `by_keys` says the block's rows are keys (the rows it sees are queries). Every thread
// finds the same bounds, so the tile loop's barriers are reached by all.
__device__ __forceinline__ void attn_block_range(const AttnGeo& g, bool by_keys, i64 row0, int rows, i64 keys,
                                                 i64& lo, i64& hi) {
    lo = by_keys ? g.queries : g.keys;
    hi = 0;
    for (int r = 0; r < rows; r++) {
        i64 from, to;
        if (by_keys)
            attn_key_range(g, row0 + r, keys, from, to);
        else
            attn_query_range(g, row0 + r, keys, from, to);
        if (from < to) {
            lo = from < lo ? from : lo;
            hi = to > hi ? to : hi;
        }
    }
}

// Rows [r0, min(r0 + KT, end)) of two operands of batch b, head h (x in slot sx, width wx; y in sy,
// wy) into the tiles xt and yt, between two barriers: the last tile's readers are done before it is
// overwritten, and the new one is whole before it is read.
template <int W, typename T>
__device__ __forceinline__ void attn_tile_pair(const AttnGeo& g, float* xt, const T* x, int sx, i64 wx, float* yt,
                                               const T* y, int sy, i64 wy, i64 b, i64 h, i64 r0, i64 end) {
    constexpr int KT = AttnTile<W>::KT;
    const i64 n = end - r0 < KT ? end - r0 : KT;
    __syncthreads();
    attn_tile_load<W>(xt, x + attn_at(g, sx, b, h, r0), g.s[sx][2], n, wx);
    attn_tile_load<W>(yt, y + attn_at(g, sy, b, h, r0), g.s[sy][2], n, wy);
}

template <typename T, int W, int TR>
__device__ void attention_tiled_forward(const AttnGeo& g, T* out, float* lse, const T* q, const T* k, const T* v,
                                        const i64* lengths, float scale) {
    constexpr int KT = AttnTile<W>::KT, KPL = KT / 32, CPL = W / 32, ROWS = ATTN_WARPS * TR;
    alignas(16) __shared__ float kt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float vt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float qs[ATTN_WARPS][TR * W];
    alignas(16) __shared__ float ps[ATTN_WARPS][TR * KT];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 row0 = (i64)blockIdx.x * ROWS, keys = attn_keys(g, lengths, b);
    i64 lo, hi;
    attn_block_range(g, false, row0, ROWS, keys, lo, hi);
    i64 from[TR], seen[TR];
    float acc[TR][CPL], m[TR], l[TR];
    for (int r = 0; r < TR; r++) {
        const i64 i = row0 + warp * TR + r;
        attn_query_range(g, i, keys, from[r], seen[r]);
        attn_own_load<W>(qs[warp] + r * W, i < g.queries ? q + attn_at(g, A_Q, b, h, i) : nullptr, g.width, lane);
        for (int t = 0; t < CPL; t++) acc[r][t] = 0.f;
        m[r] = Limits<float>::lowest();
        l[r] = 0.f;
    }
    const int width4 = (int)((g.width + 3) & ~3LL);
    for (i64 j0 = lo; j0 < hi; j0 += KT) {
        attn_tile_pair<W>(g, kt, k, A_K, g.width, vt, v, A_V, g.vwidth, b, h, j0, hi);
        __syncthreads();
        float s[TR][KPL];
        attn_tile_dots<W, TR>(s, qs[warp], kt, lane, width4);
        for (int r = 0; r < TR; r++) {
            float tile_max = Limits<float>::lowest();
            for (int t = 0; t < KPL; t++) {
                const i64 j = j0 + lane + 32 * t;
                s[r][t] = j >= from[r] && j < seen[r] ? s[r][t] * scale : Limits<float>::lowest();
                tile_max = s[r][t] > tile_max ? s[r][t] : tile_max;
            }
            tile_max = warp_max(tile_max);
            const float new_m = tile_max > m[r] ? tile_max : m[r];
            const float rescale = attn_rescale(m[r], new_m);
            float sum = 0.f;
            for (int t = 0; t < KPL; t++) {
                const float p = s[r][t] == Limits<float>::lowest() ? 0.f : k_exp(s[r][t] - new_m);
                ps[warp][r * KT + lane + 32 * t] = p;
                sum += p;
            }
            l[r] = l[r] * rescale + warp_sum(sum);
            for (int t = 0; t < CPL; t++) acc[r][t] *= rescale;
            m[r] = new_m;
        }
        __syncwarp();
        attn_tile_accumulate<W, TR>(acc, ps[warp], vt, lane);
        __syncwarp();  // the weights are read before the next tile's are written
    }
    for (int r = 0; r < TR; r++) {
        const i64 i = row0 + warp * TR + r;
        if (i >= g.queries) break;
        T* oi = out + attn_at(g, A_O, b, h, i);
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no key seen: zeros
        for (int t = 0; t < CPL; t++) {
            const i64 c = lane + 32 * t;
            if (c < g.vwidth) put(&oi[c], acc[r][t] * inv);
        }
        if (lane == 0) lse[bh * g.queries + i] = l[r] > 0.f ? m[r] + k_log(l[r]) : Limits<float>::lowest();
    }
}

template <typename T, int W, int TR>
__device__ void attention_tiled_backward_dq(const AttnGeo& g, T* dq, float* delta, const T* q, const T* k,
                                            const T* v, const T* out, const T* dout, const float* lse,
                                            const i64* lengths, float scale) {
    constexpr int KT = AttnTile<W>::KT, KPL = KT / 32, CPL = W / 32, ROWS = ATTN_WARPS * TR;
    alignas(16) __shared__ float kt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float vt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float qs[ATTN_WARPS][TR * W];
    alignas(16) __shared__ float dos[ATTN_WARPS][TR * W];
    alignas(16) __shared__ float ws[ATTN_WARPS][TR * KT];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 row0 = (i64)blockIdx.x * ROWS, keys = attn_keys(g, lengths, b);
    i64 lo, hi;
    attn_block_range(g, false, row0, ROWS, keys, lo, hi);
    i64 from[TR], seen[TR];
    float acc[TR][CPL], li[TR], d[TR];
    for (int r = 0; r < TR; r++) {
        const i64 i = row0 + warp * TR + r;
        const bool row = i < g.queries;
        attn_query_range(g, i, keys, from[r], seen[r]);
        attn_own_load<W>(qs[warp] + r * W, row ? q + attn_at(g, A_Q, b, h, i) : nullptr, g.width, lane);
        attn_own_load<W>(dos[warp] + r * W, row ? dout + attn_at(g, A_DO, b, h, i) : nullptr, g.vwidth, lane);
        for (int t = 0; t < CPL; t++) acc[r][t] = 0.f;
        // D_i = dout_i . out_i, which the key-side kernel reads too.
        float part = 0.f;
        if (row) {
            const T* oi = out + attn_at(g, A_O, b, h, i);
            for (i64 c = lane; c < g.vwidth; c += 32) part += dos[warp][r * W + c] * ld(oi[c]);
        }
        d[r] = warp_sum(part);
        li[r] = row ? lse[bh * g.queries + i] : Limits<float>::lowest();
        if (row && lane == 0) delta[bh * g.queries + i] = d[r];
        if (li[r] == Limits<float>::lowest()) seen[r] = 0;  // no key seen: no gradient
    }
    __syncwarp();
    const int width4 = (int)((g.width + 3) & ~3LL), vwidth4 = (int)((g.vwidth + 3) & ~3LL);
    for (i64 j0 = lo; j0 < hi; j0 += KT) {
        attn_tile_pair<W>(g, kt, k, A_K, g.width, vt, v, A_V, g.vwidth, b, h, j0, hi);
        __syncthreads();
        float s[TR][KPL], dp[TR][KPL];
        attn_tile_dots<W, TR>(s, qs[warp], kt, lane, width4);
        attn_tile_dots<W, TR>(dp, dos[warp], vt, lane, vwidth4);
        for (int r = 0; r < TR; r++)
            for (int t = 0; t < KPL; t++) {
                const i64 j = j0 + lane + 32 * t;
                float ds = 0.f;
                if (j >= from[r] && j < seen[r]) ds = k_exp(scale * s[r][t] - li[r]) * (dp[r][t] - d[r]) * scale;
                ws[warp][r * KT + lane + 32 * t] = ds;
            }
        __syncwarp();
        attn_tile_accumulate<W, TR>(acc, ws[warp], kt, lane);
        __syncwarp();
    }
    for (int r = 0; r < TR; r++) {
        const i64 i = row0 + warp * TR + r;
        if (i >= g.queries) break;
        T* gi = dq + attn_at(g, A_DQ, b, h, i);
        for (int t = 0; t < CPL; t++) {
            const i64 c = lane + 32 * t;
            if (c < g.width) put(&gi[c], acc[r][t]);
        }
    }
}

template <typename T, int W, int TR>
__device__ void attention_tiled_backward_dkv(const AttnGeo& g, T* dk, T* dv, const T* q, const T* k, const T* v,
                                             const T* dout, const float* lse, const float* delta,
                                             const i64* lengths, float scale) {
    constexpr int KT = AttnTile<W>::KT, KPL = KT / 32, CPL = W / 32, ROWS = ATTN_WARPS * TR;
    alignas(16) __shared__ float qt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float dt[KT * AttnTile<W>::P];
    alignas(16) __shared__ float ks[ATTN_WARPS][TR * W];
    alignas(16) __shared__ float vs[ATTN_WARPS][TR * W];
    alignas(16) __shared__ float ps[ATTN_WARPS][TR * KT];
    alignas(16) __shared__ float dss[ATTN_WARPS][TR * KT];
    __shared__ float lt[KT], dlt[KT];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 bh = blockIdx.y, b = bh / g.heads, h = bh % g.heads;
    const i64 row0 = (i64)blockIdx.x * ROWS, keys = attn_keys(g, lengths, b);
    i64 lo, hi;
    attn_block_range(g, true, row0, ROWS, keys, lo, hi);
    i64 first[TR], end[TR];
    float acc_k[TR][CPL], acc_v[TR][CPL];
    for (int r = 0; r < TR; r++) {
        const i64 j = row0 + warp * TR + r;
        const bool row = j < g.keys;
        attn_key_range(g, j, keys, first[r], end[r]);
        attn_own_load<W>(ks[warp] + r * W, row ? k + attn_at(g, A_K, b, h, j) : nullptr, g.width, lane);
        attn_own_load<W>(vs[warp] + r * W, row ? v + attn_at(g, A_V, b, h, j) : nullptr, g.vwidth, lane);
        for (int t = 0; t < CPL; t++) acc_k[r][t] = acc_v[r][t] = 0.f;
    }
    __syncwarp();
    const int width4 = (int)((g.width + 3) & ~3LL), vwidth4 = (int)((g.vwidth + 3) & ~3LL);
    for (i64 i0 = lo; i0 < hi; i0 += KT) {
        const i64 n = hi - i0 < KT ? hi - i0 : KT;
        attn_tile_pair<W>(g, qt, q, A_Q, g.width, dt, dout, A_DO, g.vwidth, b, h, i0, hi);
        for (int u = threadIdx.x; u < KT; u += ATTN_THREADS) {
            lt[u] = u < n ? lse[bh * g.queries + i0 + u] : Limits<float>::lowest();
            dlt[u] = u < n ? delta[bh * g.queries + i0 + u] : 0.f;
        }
        __syncthreads();
        float s[TR][KPL], dp[TR][KPL];
        attn_tile_dots<W, TR>(s, ks[warp], qt, lane, width4);
        attn_tile_dots<W, TR>(dp, vs[warp], dt, lane, vwidth4);
        for (int r = 0; r < TR; r++)
            for (int t = 0; t < KPL; t++) {
                const int u = lane + 32 * t;
                const i64 i = i0 + u;
                float p = 0.f, ds = 0.f;
                if (i >= first[r] && i < end[r] && lt[u] != Limits<float>::lowest()) {
                    p = k_exp(scale * s[r][t] - lt[u]);
                    ds = p * (dp[r][t] - dlt[u]) * scale;
                }
                ps[warp][r * KT + u] = p;
                dss[warp][r * KT + u] = ds;
            }
        __syncwarp();
        attn_tile_accumulate<W, TR>(acc_k, dss[warp], qt, lane);
        attn_tile_accumulate<W, TR>(acc_v, ps[warp], dt, lane);
        __syncwarp();
    }
    for (int r = 0; r < TR; r++) {
        const i64 j = row0 + warp * TR + r;
        if (j >= g.keys) break;
        T* gk = dk + attn_at(g, A_DK, b, h, j);
        T* gv = dv + attn_at(g, A_DV, b, h, j);
        for (int t = 0; t < CPL; t++) {
            const i64 c = lane + 32 * t;
            if (c < g.width) put(&gk[c], acc_k[r][t]);
            if (c < g.vwidth) put(&gv[c], acc_v[r][t]);
        }
    }
}

// Rows per warp: 256 / W forward and on the query side (4 at W = 64, 2 at 128; the forward's
// registers spill at 4 and W = 128), 2 on the key side (two tiles, two own rows and two weights
// per row: under 48 KiB of shared memory at both widths).
// src/backend/cuda/attention.rs launches ATTN_WARPS times as many rows per block.
#define ATTENTION_TILED(T, S, W)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                         \
        attention_tiled_fwd_w##W##_##S(AttnGeo g, T* out, float* lse, const T* q, const T* k,          \
                                       const T* v, const i64* lengths, float scale) {                  \
        attention_tiled_forward<T, W, 256 / W>(g, out, lse, q, k, v, lengths, scale);                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                         \
        attention_tiled_bwd_dq_w##W##_##S(AttnGeo g, T* dq, float* delta, const T* q, const T* k,      \
                                          const T* v, const T* out, const T* dout, const float* lse,   \
                                          const i64* lengths, float scale) {                           \
        attention_tiled_backward_dq<T, W, 256 / W>(g, dq, delta, q, k, v, out, dout, lse, lengths,     \
                                                   scale);                                             \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                         \
        attention_tiled_bwd_dkv_w##W##_##S(AttnGeo g, T* dk, T* dv, const T* q, const T* k,            \
                                           const T* v, const T* dout, const float* lse,                \
                                           const float* delta, const i64* lengths, float scale) {      \
        attention_tiled_backward_dkv<T, W, 2>(g, dk, dv, q, k, v, dout, lse, delta, lengths,     \
                                                    scale);                                            \
    }

ATTENTION_TILED(float, f32, 64)
ATTENTION_TILED(bf16, bf16, 64)
ATTENTION_TILED(f16, f16, 64)
ATTENTION_TILED(float, f32, 128)
ATTENTION_TILED(bf16, bf16, 128)
ATTENTION_TILED(f16, f16, 128)
