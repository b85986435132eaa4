// Attention over a KV cache kept in pages, and the writes that fill the pages (`PagedAttention` in
// src/backend/op.rs states the math, `PageGeometry` in src/backend/mod.rs the page layout: a page is
// [layers][2][heads][tokens][width] elements). The host builds one i64 table per call: for paged
// attention, each query row's (first page in the table, tokens it sees) followed by the pages'
// addresses; for a write, the address of each row's key slot (head 0, this layer) in its page.
// One warp per query row and head, the keys taken 32 at a time (one per lane) with a running
// maximum, as in attention.cu; each lane keeps 1/32 of the row's width in registers.

#define PAGED_WARPS 4
#define PAGED_MAX_WIDTH 256
#define PAGED_PER_LANE (PAGED_MAX_WIDTH / 32)

struct PagedGeo {
    i64 rows, heads, tokens, width, layer;  // heads: the pages' key and value heads
    i64 q_row, q_head;  // the queries' row and head strides (the width's is 1)
    i64 q_heads;        // query heads, a multiple of heads (grouped-query attention)
    i64 window;         // a query sees only its last `window` tokens (0: all)
};

// Keys (which = 0) or values (1) of `layer`, head h, slot t, in the page at `page`.
template <typename T>
__device__ __forceinline__ const T* paged_row(const PagedGeo& g, i64 page, int which, i64 h, i64 t) {
    const T* base = (const T*)(unsigned long long)page;
    return base + (((g.layer * 2 + which) * g.heads + h) * g.tokens + t) * g.width;
}

template <typename T, typename C>
__device__ void paged_attention(const PagedGeo& g, T* out, const T* q, const i64* table, C scale) {
    __shared__ C qrow[PAGED_WARPS][PAGED_MAX_WIDTH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 qh = blockIdx.y, h = qh / (g.q_heads / g.heads);  // query head, its key head
    const i64 r = (i64)blockIdx.x * PAGED_WARPS + warp;
    if (r >= g.rows) return;  // the whole warp leaves; the block never synchronises
    const T* qr = q + r * g.q_row + qh * g.q_head;
    for (i64 c = lane; c < g.width; c += 32) qrow[warp][c] = ld(qr[c]);
    __syncwarp();
    const i64 first = table[2 * r], seen = table[2 * r + 1];
    const i64* pages = table + 2 * g.rows + first;
    C acc[PAGED_PER_LANE];
    for (int t = 0; t < PAGED_PER_LANE; t++) acc[t] = (C)0;
    C m = Limits<C>::lowest(), l = (C)0;
    const i64 from = g.window > 0 && seen > g.window ? seen - g.window : 0;  // the sliding window
    for (i64 j0 = from; j0 < seen; j0 += 32) {
        const i64 j = j0 + lane;
        C s = Limits<C>::lowest();
        if (j < seen) {
            const T* kj = paged_row<T>(g, pages[j / g.tokens], 0, h, j % g.tokens);
            C d = (C)0;
            for (i64 c = 0; c < g.width; c++) d += qrow[warp][c] * ld(kj[c]);
            s = scale * d;
        }
        const C tile_max = warp_max(s);
        const C new_m = tile_max > m ? tile_max : m;
        const C p = j < seen ? k_exp(s - new_m) : (C)0;
        const C rescale = k_exp(m - new_m);  // 0 on the first tile (m = -inf)
        l = l * rescale + warp_sum(p);
        for (int t = 0; t < PAGED_PER_LANE; t++) acc[t] *= rescale;
        const i64 n = seen - j0 < 32 ? seen - j0 : 32;
        for (int u = 0; u < n; u++) {
            const C pu = __shfl_sync(FULL_WARP, p, u);
            const i64 ju = j0 + u;
            const T* vu = paged_row<T>(g, pages[ju / g.tokens], 1, h, ju % g.tokens);
            for (int t = 0; t < PAGED_PER_LANE; t++) {
                const i64 c = lane + 32 * t;
                if (c < g.width) acc[t] += pu * ld(vu[c]);
            }
        }
        m = new_m;
    }
    T* o = out + (r * g.q_heads + qh) * g.width;
    const C inv = l > (C)0 ? (C)1 / l : (C)0;  // no token seen: zeros
    for (int t = 0; t < PAGED_PER_LANE; t++) {
        const i64 c = lane + 32 * t;
        if (c < g.width) put(&o[c], acc[t] * inv);
    }
}

// Row r of kv ([rows, 2, heads, width], strides s0, s1, s2; the width's is 1) into its slot: the
// keys of head h at slots[r] + h * tokens * width, the values heads * tokens * width further.
template <typename T>
__device__ void paged_write(const PagedGeo& g, const T* kv, i64 s0, i64 s1, i64 s2, const i64* slots) {
    const i64 n = g.rows * 2 * g.heads * g.width;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 c = e % g.width, h = e / g.width % g.heads, which = e / (g.width * g.heads) % 2;
        const i64 r = e / (g.width * g.heads * 2);
        T* dst = (T*)(unsigned long long)slots[r];
        dst[(which * g.heads + h) * g.tokens * g.width + c] = kv[r * s0 + which * s1 + h * s2 + c];
    }
}

#define PAGED(T, C, S)                                                                             \
    extern "C" __global__ void paged_attention_##S(PagedGeo g, T* out, const T* q,                 \
                                                   const i64* table, C scale) {                    \
        paged_attention<T, C>(g, out, q, table, scale);                                            \
    }                                                                                              \
    extern "C" __global__ void paged_write_##S(PagedGeo g, const T* kv, i64 s0, i64 s1, i64 s2,    \
                                               const i64* slots) {                                 \
        paged_write<T>(g, kv, s0, s1, s2, slots);                                                  \
    }

PAGED(float, float, f32)
PAGED(double, double, f64)
PAGED(bf16, float, bf16)
PAGED(f16, float, f16)
