//! Host attention over a paged KV cache, and the writes that fill the pages ([`PagedAttention`]
//! states the math; [`PageGeometry`] the page layout).
//!
//! A page holds a head's keys (and values) as `tokens × width` consecutive elements. One task per
//! head and tile of up to [`QUERY_TILE`] queries of one sequence walks the tokens the tile sees in
//! key tiles of [`KEY_TILE`], and passes each key tile to every query row in turn while it is in
//! cache: a decoding step (one query) reads every cached byte once, which is its whole cost; a
//! prompt (many queries) reads the cache once per query tile rather than once per query.
//!
//! Each row's result depends on nothing but the row and the tokens it sees: key tiles start at
//! multiples of [`KEY_TILE`] in the sequence, each score is one [`rows::dot`], each row keeps its own
//! online softmax (the maximum and sum of the weights so far, rescaling what it accumulated when the
//! maximum grows) and adds its weighted values key after key. So a token's output is the same bits
//! whether it comes alone, in a chunk of its prompt, beside other sequences or in the whole prompt,
//! and the engine's batching and chunking never change what a request generates.

use rayon::prelude::*;

use super::rows::{self, Real};
use crate::backend::op::{Math, PagedAttention};
use crate::backend::{Buf, Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::{DType, Element, bf16, f16};

/// Multiply-adds below which one thread does the whole call. A decoding step's attention (one
/// query per head) reads the cache from memory, not from cache, so even a short one is worth both
/// threads once they are kept awake (`warm`): GPT-2 small's twelve heads over 100 tokens (77 K)
/// took 15 % of its decoding step on one thread.
const PARALLEL_WORK: usize = 1 << 14;
/// Queries per task: they share each key tile while it is in cache.
const QUERY_TILE: usize = 64;
/// Keys per tile: a tile of 64-wide `f32` keys and values is 64 KiB, in L2 while the task's query
/// rows pass over it.
const KEY_TILE: usize = 128;
/// Elements of a row accumulated at once in registers when adding weighted values (four AVX-512
/// registers of `f32`).
const BLOCK: usize = 64;
/// How many keys ahead of the one it scores a tile's first query row asks for the key's lines (it
/// asks for the value of the key it scores, read after the tile's scores, at the same time). A
/// decoding step reads each cached row once, in runs of a page (16 rows) scattered in memory: too
/// short for the hardware prefetcher, and the multiply-add reading each key took 35 % of the score
/// loop's samples in eight requests' decoding of GPT-2 small (Zen 5). With the requests, attention
/// fell from 20 % to 18 % of that decoding, the values' loop from 9 % to 5 %, and the engine's
/// tokens/s rose 5-20 % (A/B runs alternated, `benches/gguf.rs`, `gpt2-small-Q8_0/engine`).
const AHEAD: usize = 32;

/// Asks for the cache lines of `row`.
#[inline(always)]
fn prefetch<C>(row: &[C]) {
    super::prefetch_lines(row.as_ptr().cast(), std::mem::size_of_val(row));
}

pub(super) fn attention(
    dtype: DType,
    math: &PagedAttention,
    geometry: PageGeometry,
    q: Src,
    seqs: PagedSeqs,
    out: Dst,
) {
    match dtype {
        DType::F32 => attention_as::<f32>(math, geometry, q, seqs, out),
        DType::F64 => attention_as::<f64>(math, geometry, q, seqs, out),
        DType::BF16 => attention_as::<bf16>(math, geometry, q, seqs, out),
        DType::F16 => attention_as::<f16>(math, geometry, q, seqs, out),
        DType::I64 => unreachable!("paged attention refuses integer dtypes before computing"),
    }
}

/// A page (or the queries) as the kernel reads it: in the compute type already, or stored elements
/// to widen.
#[derive(Clone, Copy)]
enum Page<'a, T: Math> {
    Compute(&'a [T::Compute]),
    Stored(&'a [T]),
}

impl<'a, T: Math> Page<'a, T> {
    fn of(page: Buf<'a>) -> Page<'a, T> {
        if T::DTYPE.is_half() {
            Page::Stored(page.host::<T>())
        } else {
            // Not 16-bit: the element type is its own compute type.
            Page::Compute(page.host::<T::Compute>())
        }
    }

    /// Copies `into.len()` elements from `at` into `into`, in the compute type.
    fn read(self, at: usize, into: &mut [T::Compute]) {
        let len = into.len();
        match self {
            Page::Compute(x) => into.copy_from_slice(&x[at..at + len]),
            Page::Stored(x) => into
                .iter_mut()
                .zip(&x[at..at + len])
                .for_each(|(i, v)| *i = v.load()),
        }
    }
}

/// The queries of one task: `rows` consecutive packed rows from `first`, all of sequence `seq`.
#[derive(Clone, Copy)]
struct Tile {
    seq: usize,
    first: usize,
    rows: usize,
}

fn attention_as<T: Math>(
    math: &PagedAttention,
    geometry: PageGeometry,
    q: Src,
    seqs: PagedSeqs,
    out: Dst,
) where
    T::Compute: Scores,
{
    let shape = q.layout.shape();
    let (heads, width) = (shape[1], shape[2]);
    let (qs, qst, qoff) = (q.buf.host::<T>(), q.layout.strides(), q.layout.offset());
    let pages: Vec<Page<'_, T>> = seqs.pages.iter().map(|&p| Page::of(p)).collect();
    let scale = T::Compute::from_f64(math.scale);
    let tiles: Vec<Tile> = (0..seqs.lengths.len())
        .flat_map(|seq| {
            let (from, to) = (seqs.queries[seq], seqs.queries[seq + 1]);
            (from..to).step_by(QUERY_TILE).map(move |first| Tile {
                seq,
                first,
                rows: QUERY_TILE.min(to - first),
            })
        })
        .collect();
    let task = |t: usize| -> Vec<T::Compute> {
        let (tile, h) = (tiles[t / heads], t % heads);
        let s = tile.seq;
        let count = seqs.queries[s + 1] - seqs.queries[s];
        let mut queries = vec![T::Compute::zero(); tile.rows * width];
        for (r, query) in queries.chunks_mut(width).enumerate() {
            Page::<T>::Stored(qs).read(qoff + (tile.first + r) * qst[0] + h * qst[1], query);
        }
        let cache = Cached {
            geometry,
            layer: math.layer,
            table: &pages[seqs.first[s]..seqs.first[s + 1]],
            // Grouped-query attention: query head h reads key and value head h / group.
            head: h / (heads / geometry.heads),
        };
        attend_rows(cache, &queries, scale, |r| {
            let i = tile.first + r - seqs.queries[s];
            math.first(i, count, seqs.lengths[s])..math.visible(i, count, seqs.lengths[s])
        })
    };
    let work = tiles
        .iter()
        .map(|t| t.rows * seqs.lengths[t.seq])
        .sum::<usize>()
        * heads
        * width;
    let results: Vec<Vec<T::Compute>> = if work < PARALLEL_WORK {
        (0..tiles.len() * heads).map(task).collect()
    } else {
        super::warm::hold();
        (0..tiles.len() * heads).into_par_iter().map(task).collect()
    };
    let o = out.contiguous_host::<T>();
    for (t, result) in results.iter().enumerate() {
        let (tile, h) = (tiles[t / heads], t % heads);
        for (r, row) in result.chunks(width).enumerate() {
            let at = ((tile.first + r) * heads + h) * width;
            for (o, &c) in o[at..at + width].iter_mut().zip(row) {
                *o = T::store(c);
            }
        }
    }
}

/// Where a task reads its keys and values: one key/value head of one layer in one sequence's pages.
struct Cached<'p, 'a, T: Math> {
    geometry: PageGeometry,
    layer: usize,
    table: &'p [Page<'a, T>],
    head: usize,
}

/// The outputs (`rows × width`) of the queries `queries` (the same layout), row `r` over the tokens
/// `window(r)`; later rows see no fewer tokens and start no earlier.
///
/// The crate is built for any x86-64, so the same loops are also compiled for AVX-512 and AVX2 and
/// picked at run time. Every version does the same operations in the same order (the compiler
/// vectorises across independent sums and never reassociates one), so the bits do not depend on the
/// CPU's vector unit either.
fn attend_rows<T: Math>(
    cache: Cached<'_, '_, T>,
    queries: &[T::Compute],
    scale: T::Compute,
    window: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<T::Compute>
where
    T::Compute: Scores,
{
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the only feature the version is compiled for.
            return unsafe { attend_rows_avx512(cache, queries, scale, window) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, the only feature the version is compiled for.
            return unsafe { attend_rows_avx2(cache, queries, scale, window) };
        }
    }
    attend_rows_with(cache, queries, scale, window)
}

/// [`attend_rows_with`] compiled for a vector unit: `$name` with `$features`.
macro_rules! attend_rows_for {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name<T: Math>(
            cache: Cached<'_, '_, T>,
            queries: &[T::Compute],
            scale: T::Compute,
            window: impl Fn(usize) -> std::ops::Range<usize>,
        ) -> Vec<T::Compute>
        where
            T::Compute: Scores,
        {
            attend_rows_with(cache, queries, scale, window)
        }
    };
}

attend_rows_for!(attend_rows_avx512, "avx512f");
attend_rows_for!(attend_rows_avx2, "avx2");

/// [`attend_rows`]' loops, inlined into each version.
#[inline(always)]
fn attend_rows_with<T: Math>(
    cache: Cached<'_, '_, T>,
    queries: &[T::Compute],
    scale: T::Compute,
    window: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<T::Compute>
where
    T::Compute: Scores,
{
    let (g, zero) = (cache.geometry, T::Compute::zero());
    let rows = queries.len() / g.width;
    let mut out = vec![zero; rows * g.width];
    let (mut max, mut sum) = (vec![T::Compute::lowest(); rows], vec![zero; rows]);
    let mut scores = [zero; KEY_TILE];
    // 16-bit pages are widened a key tile at a time; wider ones are read where they lie.
    let mut wide = Vec::new();
    let (start, end) = (window(0).start / KEY_TILE * KEY_TILE, window(rows - 1).end);
    for j0 in (start..end).step_by(KEY_TILE) {
        let j1 = (j0 + KEY_TILE).min(end);
        let (keys, values) = key_tile(&cache, j0..j1, &mut wide);
        // The first row to meet the tile reads it from memory; later ones find it in cache.
        let mut first_row = true;
        for (r, query) in queries.chunks(g.width).enumerate() {
            let sees = window(r);
            let (from, to) = (sees.start.max(j0), sees.end.min(j1));
            if from >= to {
                continue;
            }
            let (keys, values) = (&keys[from - j0..to - j0], &values[from - j0..to - j0]);
            let scores = &mut scores[..to - from];
            let fetch = std::mem::take(&mut first_row).then_some(values);
            T::Compute::scores(query, keys, fetch, scale, scores);
            let tile_max = rows::max(scores);
            let out = &mut out[r * g.width..(r + 1) * g.width];
            if tile_max > max[r] {
                let rescale = (max[r] - tile_max).exp();
                sum[r] *= rescale;
                out.iter_mut().for_each(|o| *o *= rescale);
                max[r] = tile_max;
            }
            sum[r] += rows::exp_in_place(scores, max[r]);
            add_weighted(out, scores, values);
        }
    }
    for (out, &sum) in out.chunks_mut(g.width).zip(&sum) {
        if sum > zero {
            let inv = sum.recip();
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
    out
}

/// The rows of the keys and of the values of tokens `tokens`, in the compute type: slices of the
/// pages, or of `wide` where 16-bit pages are widened.
#[allow(clippy::type_complexity)]
fn key_tile<'w, T: Math>(
    cache: &Cached<'w, '_, T>,
    tokens: std::ops::Range<usize>,
    wide: &'w mut Vec<T::Compute>,
) -> (Vec<&'w [T::Compute]>, Vec<&'w [T::Compute]>) {
    let g = cache.geometry;
    let len = tokens.len();
    if !T::DTYPE.is_half() {
        let rows = |which: usize| -> Vec<&'w [T::Compute]> {
            slots(cache, which, tokens.clone())
                .map(|(page, at)| match cache.table[page] {
                    Page::Compute(x) => &x[at..at + g.width],
                    Page::Stored(_) => unreachable!("only 16-bit pages are stored to widen"),
                })
                .collect()
        };
        return (rows(0), rows(1));
    }
    wide.resize(2 * len * g.width, T::Compute::zero());
    for which in 0..2 {
        for (i, (page, from)) in slots(cache, which, tokens.clone()).enumerate() {
            let into = (which * len + i) * g.width;
            cache.table[page].read(from, &mut wide[into..into + g.width]);
        }
    }
    let (keys, values) = wide.split_at(len * g.width);
    (
        keys.chunks(g.width).collect(),
        values.chunks(g.width).collect(),
    )
}

/// The page and the element where the key (`which` 0) or value (1) row of each token of `tokens`
/// starts, walked slot after slot: one division a tile rather than one a key (dividing by the
/// page's token count for every key took 6 % of eight requests' decoding of GPT-2 small).
fn slots<T: Math>(
    cache: &Cached<'_, '_, T>,
    which: usize,
    tokens: std::ops::Range<usize>,
) -> impl Iterator<Item = (usize, usize)> {
    let g = cache.geometry;
    let first = g.row(cache.layer, which, cache.head, 0);
    let (mut page, mut slot) = (tokens.start / g.tokens, tokens.start % g.tokens);
    tokens.map(move |_| {
        let at = (page, first + slot * g.width);
        slot += 1;
        if slot == g.tokens {
            (page, slot) = (page + 1, 0);
        }
        at
    })
}

/// `out += Σ_j weights[j] · values[j]`, each element summed key after key in order. [`BLOCK`]
/// elements are summed at once, as independent chains in registers (one chain waits for its last
/// addition; several hide that wait).
#[inline(always)]
fn add_weighted<C: Real>(out: &mut [C], weights: &[C], values: &[&[C]]) {
    let mut at = 0;
    for chunk in out.chunks_exact_mut(BLOCK) {
        let mut acc = [C::zero(); BLOCK];
        acc.copy_from_slice(chunk);
        for (&w, v) in weights.iter().zip(values) {
            let v: &[C; BLOCK] = v[at..at + BLOCK].try_into().unwrap();
            for l in 0..BLOCK {
                acc[l] += w * v[l];
            }
        }
        chunk.copy_from_slice(&acc);
        at += BLOCK;
    }
    for (e, o) in out[at..].iter_mut().enumerate() {
        for (&w, v) in weights.iter().zip(values) {
            *o += w * v[at + e];
        }
    }
}

/// Before key `j` of `keys` is scored, with `values` given: asks for the rows of key `j +`
/// [`AHEAD`] (and of the first ones, at `j == 0`) and of value `j`, which the caller reads once the
/// tile's scores are done.
#[inline(always)]
fn fetch_for<C>(j: usize, keys: &[&[C]], values: Option<&[&[C]]>) {
    let Some(values) = values else { return };
    if j == 0 {
        keys.iter().take(AHEAD).for_each(|key| prefetch(key));
    }
    if let Some(key) = keys.get(j + AHEAD) {
        prefetch(key);
    }
    if let Some(value) = values.get(j) {
        prefetch(value);
    }
}

/// The compute types' score kernels: `out[j] = scale · query · keys[j]`. A score depends on the
/// query and key only, never on which other keys come in the same call. With `values` (as many as
/// the keys), the kernel asks for the lines of the keys ahead and of the values as it goes
/// ([`fetch_for`]): what a tile's first query row does.
trait Scores: Real {
    fn scores(
        query: &[Self],
        keys: &[&[Self]],
        values: Option<&[&[Self]]>,
        scale: Self,
        out: &mut [Self],
    ) {
        dot_scores(query, keys, values, scale, out);
    }
}

/// [`Scores::scores`] on any CPU: one [`rows::dot`] per key.
#[inline(always)]
fn dot_scores<C: Real>(
    query: &[C],
    keys: &[&[C]],
    values: Option<&[&[C]]>,
    scale: C,
    out: &mut [C],
) {
    for (j, (o, key)) in out.iter_mut().zip(keys).enumerate() {
        fetch_for(j, keys, values);
        *o = scale * rows::dot(query, key);
    }
}

impl Scores for f64 {}

impl Scores for f32 {
    fn scores(
        query: &[f32],
        keys: &[&[f32]],
        values: Option<&[&[f32]]>,
        scale: f32,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the only feature the kernel is compiled for.
            unsafe { scores_avx512(query, keys, values, scale, out) };
            return;
        }
        dot_scores(query, keys, values, scale, out);
    }
}

/// [`Scores::scores`] with one 16-float accumulator per key (fused multiply-adds over the row, the
/// last partial chunk through masked loads), reduced in the fixed order of
/// `_mm512_reduce_add_ps`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn scores_avx512(
    query: &[f32],
    keys: &[&[f32]],
    values: Option<&[&[f32]]>,
    scale: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_maskz_loadu_ps, _mm512_reduce_add_ps,
        _mm512_setzero_ps,
    };
    let width = query.len();
    let full = width / 16 * 16;
    let mask = ((1u32 << (width - full)) - 1) as u16;
    for (j, (o, key)) in out.iter_mut().zip(keys).enumerate() {
        fetch_for(j, keys, values);
        let key = &key[..width];
        let mut acc = _mm512_setzero_ps();
        for c in (0..full).step_by(16) {
            // SAFETY: `c + 16 <= full <= width`, the length of both slices; `loadu` needs no
            // alignment.
            let (q, k) = unsafe {
                (
                    _mm512_loadu_ps(query.as_ptr().add(c)),
                    _mm512_loadu_ps(key.as_ptr().add(c)),
                )
            };
            acc = _mm512_fmadd_ps(q, k, acc);
        }
        if full < width {
            // SAFETY: the mask selects elements `full..width` of each slice; masked-off lanes
            // touch no memory.
            let (q, k) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, query.as_ptr().add(full)),
                    _mm512_maskz_loadu_ps(mask, key.as_ptr().add(full)),
                )
            };
            acc = _mm512_fmadd_ps(q, k, acc);
        }
        *o = scale * _mm512_reduce_add_ps(acc);
    }
}

/// Copies each row of `kv` (`[rows, 2, heads, width]`) into its slot of `layer`: bytes, whatever the
/// dtype (the cache holds the model's dtype).
pub(super) fn write(dtype: DType, g: PageGeometry, layer: usize, kv: Src, rows: PageRows) {
    let e = dtype.size();
    let (src, st, off) = (kv.buf.bytes(), kv.layout.strides(), kv.layout.offset());
    let row_bytes = g.width * e;
    for (r, &(page, slot)) in rows.slots.iter().enumerate() {
        let dst = rows.pages[page].reborrow().bytes();
        for which in 0..2 {
            for h in 0..g.heads {
                let from = (off + r * st[0] + which * st[1] + h * st[2]) * e;
                let to = g.row(layer, which, h, slot) * e;
                dst[to..to + row_bytes].copy_from_slice(&src[from..from + row_bytes]);
            }
        }
    }
}
