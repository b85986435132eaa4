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
use super::widen::Widen;

mod half_rows;
use crate::backend::op::{Math, PagedAttention};
use crate::backend::{Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::{DType, Element, Float, bf16, f16};

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

/// How many runs of a page's rows ahead (2 KiB each: 16 rows of 64 `f16`) a key tile of 16-bit
/// pages asks for while it widens: the runs lie scattered in memory, each too short for the
/// hardware prefetcher to find.
const RUNS_AHEAD: usize = 2;

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

/// A page (or the queries) as stored.
type Page<'a, T> = &'a [T];

/// Widens `into.len()` elements of `page` from `at` into `into`.
#[inline(always)]
fn read<T: PageElement>(page: Page<'_, T>, at: usize, into: &mut [T::Compute]) {
    let len = into.len();
    T::widen(&page[at..at + len], into);
}

/// The queries of one task: `rows` consecutive packed rows from `first`, all of sequence `seq`.
#[derive(Clone, Copy)]
struct Tile {
    seq: usize,
    first: usize,
    rows: usize,
}

fn attention_as<T: PageElement>(
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
    let pages: Vec<Page<'_, T>> = seqs.pages.iter().map(|p| p.host::<T>()).collect();
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
    // A task widens 16-bit pages into `wide`, reused by the tasks a thread runs (zeroing a fresh
    // tile's buffer for every task was 3 % of eight requests' decoding of GPT-2 small).
    let task = |wide: &mut Vec<T::Compute>, t: usize| -> Vec<T::Compute> {
        let (tile, h) = (tiles[t / heads], t % heads);
        let s = tile.seq;
        let count = seqs.queries[s + 1] - seqs.queries[s];
        let mut queries = vec![T::Compute::zero(); tile.rows * width];
        for (r, query) in queries.chunks_mut(width).enumerate() {
            read(qs, qoff + (tile.first + r) * qst[0] + h * qst[1], query);
        }
        let cache = Cached {
            geometry,
            layer: math.layer,
            table: &pages[seqs.first[s]..seqs.first[s + 1]],
            // Grouped-query attention: query head h reads key and value head h / group.
            head: h / (heads / geometry.heads),
        };
        attend_rows(cache, &queries, scale, wide, |r| {
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
        let mut wide = Vec::new();
        (0..tiles.len() * heads)
            .map(|t| task(&mut wide, t))
            .collect()
    } else {
        super::warm::hold();
        (0..tiles.len() * heads)
            .into_par_iter()
            .map_init(Vec::new, task)
            .collect()
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
struct Cached<'p, 'a, T: PageElement> {
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
fn attend_rows<T: PageElement>(
    cache: Cached<'_, '_, T>,
    queries: &[T::Compute],
    scale: T::Compute,
    wide: &mut Vec<T::Compute>,
    window: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<T::Compute>
where
    T::Compute: Scores,
{
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the only feature the version is compiled for.
            return unsafe { attend_rows_avx512(cache, queries, scale, wide, window) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, the only feature the version is compiled for.
            return unsafe { attend_rows_avx2(cache, queries, scale, wide, window) };
        }
    }
    attend_rows_with(cache, queries, scale, wide, window)
}

/// [`attend_rows_with`] compiled for a vector unit: `$name` with `$features`.
macro_rules! attend_rows_for {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name<T: PageElement>(
            cache: Cached<'_, '_, T>,
            queries: &[T::Compute],
            scale: T::Compute,
            wide: &mut Vec<T::Compute>,
            window: impl Fn(usize) -> std::ops::Range<usize>,
        ) -> Vec<T::Compute>
        where
            T::Compute: Scores,
        {
            attend_rows_with(cache, queries, scale, wide, window)
        }
    };
}

attend_rows_for!(attend_rows_avx512, "avx512f");
attend_rows_for!(attend_rows_avx2, "avx2");

/// [`attend_rows`]' loops, inlined into each version.
#[inline(always)]
fn attend_rows_with<T: PageElement>(
    cache: Cached<'_, '_, T>,
    queries: &[T::Compute],
    scale: T::Compute,
    wide: &mut Vec<T::Compute>,
    window: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<T::Compute>
where
    T::Compute: Scores,
{
    let g = cache.geometry;
    let rows = queries.len() / g.width;
    let mut online = Online::new(rows, g.width);
    let (start, end) = (window(0).start / KEY_TILE * KEY_TILE, window(rows - 1).end);
    let in_place = T::in_place(rows);
    for j0 in (start..end).step_by(KEY_TILE) {
        let j1 = (j0 + KEY_TILE).min(end);
        if in_place {
            let (keys, values) = (rows_of(&cache, 0, j0..j1), rows_of(&cache, 1, j0..j1));
            online.tile(
                queries,
                j0..j1,
                &window,
                &keys,
                &values,
                true,
                |q, k, f, o| T::scores(q, k, f, scale, o),
            );
        } else {
            let (keys, values) = widened_tile(&cache, j0..j1, wide);
            online.tile(
                queries,
                j0..j1,
                &window,
                &keys,
                &values,
                false,
                |q, k, f, o| T::Compute::scores(q, k, f, scale, o),
            );
        }
    }
    online.finish()
}

/// Each query row's online softmax over the key tiles so far: the largest score, the sum of the
/// weights, and the weighted values added (rescaled when the largest score grows).
struct Online<C> {
    width: usize,
    out: Vec<C>,
    max: Vec<C>,
    sum: Vec<C>,
    scores: [C; KEY_TILE],
}

impl<C: Real> Online<C> {
    fn new(rows: usize, width: usize) -> Online<C> {
        Online {
            width,
            out: vec![C::zero(); rows * width],
            max: vec![C::lowest(); rows],
            sum: vec![C::zero(); rows],
            scores: [C::zero(); KEY_TILE],
        }
    }

    /// Passes the key tile `tokens` (its key and value rows) to every query row that sees part of
    /// it. With `fetch`, the first row to meet the tile asks for its lines ahead as it scores
    /// ([`fetch_for`]): it reads the tile from memory, later rows find it in cache.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn tile<E: AddWeighted<C>>(
        &mut self,
        queries: &[C],
        tokens: std::ops::Range<usize>,
        window: &impl Fn(usize) -> std::ops::Range<usize>,
        keys: &[&[E]],
        values: &[&[E]],
        fetch: bool,
        scores_of: impl Fn(&[C], &[&[E]], Option<&[&[E]]>, &mut [C]),
    ) {
        let (j0, j1, w) = (tokens.start, tokens.end, self.width);
        let mut fetch = fetch;
        for (r, query) in queries.chunks(w).enumerate() {
            let sees = window(r);
            let (from, to) = (sees.start.max(j0), sees.end.min(j1));
            if from >= to {
                continue;
            }
            let (keys, values) = (&keys[from - j0..to - j0], &values[from - j0..to - j0]);
            let scores = &mut self.scores[..to - from];
            scores_of(
                query,
                keys,
                std::mem::take(&mut fetch).then_some(values),
                scores,
            );
            let tile_max = rows::max(scores);
            let out = &mut self.out[r * w..(r + 1) * w];
            if tile_max > self.max[r] {
                let rescale = Float::exp(self.max[r] - tile_max);
                self.sum[r] *= rescale;
                out.iter_mut().for_each(|o| *o *= rescale);
                self.max[r] = tile_max;
            }
            self.sum[r] += rows::exp_in_place(scores, self.max[r]);
            E::add_weighted(out, scores, values);
        }
    }

    /// The outputs: each row's weighted values over its sum.
    fn finish(mut self) -> Vec<C> {
        for (out, &sum) in self.out.chunks_mut(self.width).zip(&self.sum) {
            if sum > C::zero() {
                let inv = Float::recip(sum);
                out.iter_mut().for_each(|o| *o *= inv);
            }
        }
        self.out
    }
}

/// The key (`which` 0) or value (1) rows of tokens `tokens`, where they lie in the pages: each
/// page's run of rows cut into rows (one bounds check a run; walking slot by slot with one a row was
/// 2 % of eight requests' decoding of GPT-2 small).
#[inline(always)]
fn rows_of<'p, T: PageElement>(
    cache: &Cached<'_, 'p, T>,
    which: usize,
    tokens: std::ops::Range<usize>,
) -> Vec<&'p [T]> {
    let width = cache.geometry.width;
    let mut rows = Vec::with_capacity(tokens.len());
    for_runs(cache, which, tokens, |page, from, count| {
        rows.extend(cache.table[page][from..from + count * width].chunks_exact(width));
    });
    rows
}

/// The key and value rows of tokens `tokens` widened into `wide` (16-bit pages where
/// [`PageElement::in_place`] says no), a page's run of rows at once.
#[allow(clippy::type_complexity)]
fn widened_tile<'w, T: PageElement>(
    cache: &Cached<'_, '_, T>,
    tokens: std::ops::Range<usize>,
    wide: &'w mut Vec<T::Compute>,
) -> (Vec<&'w [T::Compute]>, Vec<&'w [T::Compute]>) {
    let g = cache.geometry;
    let len = tokens.len();
    if wide.len() < 2 * len * g.width {
        wide.resize(2 * len * g.width, T::Compute::zero());
    }
    let runs: [Vec<(usize, usize, usize)>; 2] =
        [0, 1].map(|which| runs(cache, which, tokens.clone()));
    let fetch = |i: usize| {
        for run in &runs {
            if let Some(&(page, from, count)) = run.get(i) {
                prefetch(&cache.table[page][from..from + count * g.width]);
            }
        }
    };
    (0..RUNS_AHEAD).for_each(fetch);
    let mut into = [0, len * g.width];
    for i in 0..runs[0].len() {
        fetch(i + RUNS_AHEAD);
        for (which, run) in runs.iter().enumerate() {
            let (page, from, count) = run[i];
            let n = count * g.width;
            read(
                cache.table[page],
                from,
                &mut wide[into[which]..into[which] + n],
            );
            into[which] += n;
        }
    }
    let (keys, values) = wide[..2 * len * g.width].split_at(len * g.width);
    (
        keys.chunks(g.width).collect(),
        values.chunks(g.width).collect(),
    )
}

/// Calls `f(page, first element, rows)` for each run of consecutive rows that the key (`which` 0)
/// or value (1) rows of `tokens` make in their pages, one per page the tokens touch, in order: one
/// division a tile rather than one a key (dividing by the page's token count for every key took 6 %
/// of eight requests' decoding of GPT-2 small).
#[inline(always)]
fn for_runs<T: PageElement>(
    cache: &Cached<'_, '_, T>,
    which: usize,
    tokens: std::ops::Range<usize>,
    mut f: impl FnMut(usize, usize, usize),
) {
    let g = cache.geometry;
    let first = g.row(cache.layer, which, cache.head, 0);
    let (mut page, mut slot) = (tokens.start / g.tokens, tokens.start % g.tokens);
    let mut left = tokens.len();
    while left > 0 {
        let count = (g.tokens - slot).min(left);
        f(page, first + slot * g.width, count);
        (page, slot, left) = (page + 1, 0, left - count);
    }
}

/// The runs of [`for_runs`], collected: `(page, first element, rows)`.
fn runs<T: PageElement>(
    cache: &Cached<'_, '_, T>,
    which: usize,
    tokens: std::ops::Range<usize>,
) -> Vec<(usize, usize, usize)> {
    let mut runs = Vec::with_capacity(tokens.len() / cache.geometry.tokens + 2);
    for_runs(cache, which, tokens, |page, from, count| {
        runs.push((page, from, count))
    });
    runs
}

/// Value rows of element type `Self` added into outputs of compute type `C`: `out += Σ_j
/// weights[j] · values[j]` (each value widened, exactly), each element summed key after key in
/// order, each term a product then a sum (never fused), so that every version gives the bits of
/// [`add_weighted`] over the widened values.
trait AddWeighted<C>: Sized {
    fn add_weighted(out: &mut [C], weights: &[C], values: &[&[Self]]);
}

impl<C: Real> AddWeighted<C> for C {
    #[inline(always)]
    fn add_weighted(out: &mut [C], weights: &[C], values: &[&[C]]) {
        add_weighted(out, weights, values);
    }
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

/// The element types pages hold: how a key tile's rows are scored and added where they lie.
trait PageElement: Widen + AddWeighted<<Self as Math>::Compute> {
    /// Whether a task of `rows` query rows scores and adds rows of this type where they lie; if
    /// not, each key tile is widened once for all the rows.
    fn in_place(rows: usize) -> bool;

    /// [`Scores::scores`] over rows of this type, each key widened (exactly): the same bits.
    fn scores(
        query: &[Self::Compute],
        keys: &[&[Self]],
        values: Option<&[&[Self]]>,
        scale: Self::Compute,
        out: &mut [Self::Compute],
    );
}

/// The compute types' rows are read where they lie, by their own kernels.
macro_rules! compute_page_element {
    ($t:ty) => {
        impl PageElement for $t {
            fn in_place(_rows: usize) -> bool {
                true
            }

            #[inline(always)]
            fn scores(
                query: &[$t],
                keys: &[&[$t]],
                values: Option<&[&[$t]]>,
                scale: $t,
                out: &mut [$t],
            ) {
                <$t as Scores>::scores(query, keys, values, scale, out);
            }
        }
    };
}

compute_page_element!(f32);
compute_page_element!(f64);

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

/// Key elements as the AVX-512 score kernel loads them: 16 at a time into `f32` lanes.
#[cfg(target_arch = "x86_64")]
trait Lanes16: Sized {
    /// The 16 elements from `at`, in `f32`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `at..at + 16` must be readable.
    unsafe fn load16(at: *const Self) -> std::arch::x86_64::__m512;

    /// The elements of `row` after its last full 16 (`mask` selects them), zeros after them.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `mask` has `row.len() % 16` low bits set.
    unsafe fn tail16(row: &[Self], mask: u16) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
impl Lanes16 for f32 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(at: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract; `loadu` takes any alignment.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(at) }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tail16(row: &[f32], mask: u16) -> std::arch::x86_64::__m512 {
        // SAFETY: the mask selects the elements after the last full 16; masked-off lanes touch no
        // memory.
        unsafe {
            std::arch::x86_64::_mm512_maskz_loadu_ps(mask, row.as_ptr().add(row.len() / 16 * 16))
        }
    }
}

/// [`Scores::scores`] with one 16-float accumulator per key (fused multiply-adds over the row, the
/// last partial chunk with zeros in the lanes past the row), reduced in the fixed order of
/// `_mm512_reduce_add_ps`; keys of any [`Lanes16`] type (16-bit keys widened as they are loaded:
/// the bits of their widened `f32` copy).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn scores_avx512<K: Lanes16>(
    query: &[f32],
    keys: &[&[K]],
    values: Option<&[&[K]]>,
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
            // SAFETY: `c + 16 <= full <= width`, the length of both slices; the CPU has AVX-512 F;
            // `loadu` needs no alignment.
            let (q, k) = unsafe {
                (
                    _mm512_loadu_ps(query.as_ptr().add(c)),
                    K::load16(key.as_ptr().add(c)),
                )
            };
            acc = _mm512_fmadd_ps(q, k, acc);
        }
        if full < width {
            // SAFETY: the mask selects elements `full..width` of each slice; masked-off lanes
            // touch no memory; the CPU has AVX-512 F.
            let (q, k) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, query.as_ptr().add(full)),
                    K::tail16(key, mask),
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
