//! The `bf16` fused attention forward on `bf16` blocks ([`Attention`] states the math; the schedule
//! is [`super::attention`]'s: one task per batch, head and tile of [`QUERY_TILE`] queries, keys in
//! tiles of [`KEY_TILE`], a running maximum per query).
//!
//! Both products run in 32 × 32 blocks ([`Blocks::block_into`], on AMX tiles or on AVX-512 BF16
//! vectors: [`super::bf16_blocks`]): the scores `q kᵀ` from the query tile's rows (copied,
//! zero-padded to whole steps) and the keys packed as right panels, and `p v` from the weights (in
//! two `bf16` parts) and the values packed as right panels. Keys and values are packed once per
//! batch and key head, before the tasks, and read by every query tile of the head (and of every
//! query head of its group), so nothing is widened to `f32` on the way.
//!
//! The weights `p = e^(s - max)` multiply the values as two `bf16`, `hi = bf16(p)` and `lo = bf16(p -
//! hi)` (two tile products instead of one): 16 significant bits, so an output moves by at most 2⁻¹⁶
//! of `Σ p |v| / Σ p` from [`super::attention`]'s `f32` result, the size of its own summation-order
//! noise. Rounding `p` once to `bf16`, as FlashAttention and PyTorch's CPU attention do, moved outputs
//! by up to 2⁻⁸, and a bf16-autocast GPT-2's logits then left the GPU's (which multiply in `f32`) by
//! more than the tolerance of `tests/cuda.rs`; the second part costs a tenth of the time.

use rayon::prelude::*;

use super::attention::{QUERY_TILE, keys_of, run_tasks, store_rows};
use super::bf16_blocks::{BlockUnit, Blocks};
use super::bf16_gemm::pack_panel;
use super::bf16_tiles::{BLOCK, STEP_PAIRS};
use super::rows::larger_or_nan;
use crate::backend::op::Attention;
use crate::backend::{AttentionInputs, Dst, Src};
use crate::dtype::{Float, bf16, bf16_of_f32};

/// Keys per tile (as many as the `f32` path's, for the same reason): the weights' row pass has a
/// fixed cost per row and tile (two lane reductions, the outputs' rescaling) that 128 keys did not
/// cover (criterion's `fused_forward/bf16`, `[1, 12, 1024, 64]` causal, on the Xeon with AMX:
/// 16.0-17.4 ms at 128 keys, 11.6-12.4 at 256, 12.6-12.9 at 512). A tile's scores are 64 KiB, in L2.
const KEY_TILE: usize = 256;
/// `k` elements per step of a block: a tile row of 32 `bf16`.
pub(super) const STEP: usize = 2 * STEP_PAIRS;
/// Row stride of the query tile and of the weights: one step past their depth, so that the 32 rows
/// a tile load reads do not share L1 sets.
pub(super) const PAD: usize = STEP;
/// Row stride of the weights of a key tile (`bf16`).
const WEIGHT_STRIDE: usize = KEY_TILE + PAD;

/// Whether the tiles compute this attention: head widths both non-zero (a block needs a step).
pub(super) fn computes(inputs: &AttentionInputs) -> bool {
    inputs.q.layout.shape()[3] > 0 && inputs.v.layout.shape()[3] > 0
}

/// One `[batch, heads, len, width]` operand of `bf16` elements (width stride 1).
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    pub(super) data: &'a [bf16],
    pub(super) dims: [usize; 4],
    pub(super) strides: [usize; 3],
    pub(super) offset: usize,
}

impl<'a> Operand<'a> {
    pub(super) fn of(x: &Src<'a>) -> Operand<'a> {
        let (shape, st) = (x.layout.shape(), x.layout.strides());
        Operand {
            data: x.buf.host::<bf16>(),
            dims: [shape[0], shape[1], shape[2], shape[3]],
            strides: [st[0], st[1], st[2]],
            offset: x.layout.offset(),
        }
    }

    /// Row `i` of head `(b, h)`.
    pub(super) fn row(&self, head: (usize, usize), i: usize) -> &'a [bf16] {
        &self.head(head)[i * self.strides[2]..][..self.dims[3]]
    }

    /// Head `(b, h)`'s elements from its first row on: row `i`, element `c` at `i · strides[2] + c`.
    fn head(&self, (b, h): (usize, usize)) -> &'a [bf16] {
        let [sb, sh, _] = self.strides;
        &self.data[self.offset + b * sb + h * sh..]
    }
}

/// Keys of one head as right panels of the scores: `[key block][width pair][key]`, 32 keys a
/// block, the width padded to whole steps (`pairs` pairs) and the keys to whole blocks with zeros
/// (left as they are in `out`).
pub(super) fn pack_keys(k: &Operand<'_>, head: (usize, usize), pairs: usize, out: &mut [u32]) {
    let (keys, width) = (k.dims[2], k.dims[3]);
    for (block, panel) in out.chunks_exact_mut(pairs * BLOCK).enumerate() {
        let first = block * BLOCK;
        let lines = first..keys.min(first + BLOCK);
        pack_panel(k.head(head), (k.strides[2], 1), lines, width, BLOCK, panel);
    }
}

/// Values of one head as right panels of `p v`: `[column block][key pair][column]`, 32 columns a
/// block, the keys padded to whole blocks (`key_pairs` pairs) and the columns with zeros (left as
/// they are in `out`).
pub(super) fn pack_values(
    v: &Operand<'_>,
    head: (usize, usize),
    key_pairs: usize,
    out: &mut [u32],
) {
    let (keys, width) = (v.dims[2], v.dims[3]);
    for (block, panel) in out.chunks_exact_mut(key_pairs * BLOCK).enumerate() {
        let first = block * BLOCK;
        let lines = first..width.min(first + BLOCK);
        let panel = &mut panel[..keys.div_ceil(2) * BLOCK];
        pack_panel(v.head(head), (1, v.strides[2]), lines, keys, BLOCK, panel);
    }
}

/// A head's keys and values, packed (see [`pack_keys`] and [`pack_values`]).
struct PackedHead {
    keys: Vec<u32>,
    values: Vec<u32>,
}

/// Forward pass on `unit`'s blocks: `out` and `lse` of every query (`computes(&inputs)` must hold).
pub(super) fn forward(
    unit: impl BlockUnit,
    math: &Attention,
    inputs: AttentionInputs,
    out: Dst,
    lse: Dst,
) {
    let operands = [
        Operand::of(&inputs.q),
        Operand::of(&inputs.k),
        Operand::of(&inputs.v),
    ];
    let [_, heads, queries, _] = operands[0].dims;
    let key_lengths = inputs.key_lengths.map(|l| l.contiguous_host::<i64>());
    let results = query_tiles(unit, math, operands, key_lengths);
    let tiles = queries.div_ceil(QUERY_TILE);
    let (out_layout, out) = (out.layout, out.buf.host::<bf16>());
    let lse = lse.contiguous_host::<f32>();
    for (task, (o, l)) in results.into_iter().enumerate() {
        let (bh, tile) = (task / tiles, task % tiles);
        let from = tile * QUERY_TILE;
        store_rows::<bf16>(out, out_layout, (bh / heads, bh % heads), from, &o);
        lse[bh * queries + from..][..l.len()].copy_from_slice(&l);
    }
}

/// The outputs (`rows × value width`, `f32`) and `lse` of every query tile, in the order batch,
/// head, tile.
fn query_tiles(
    unit: impl BlockUnit,
    math: &Attention,
    [q, k, v]: [Operand<'_>; 3],
    key_lengths: Option<&[i64]>,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let ([batch, heads, queries, width], [_, key_heads, keys, dv]) = (q.dims, v.dims);
    let steps = width.div_ceil(STEP);
    let (pairs, key_blocks) = (steps * STEP_PAIRS, keys.div_ceil(BLOCK));
    let key_pairs = key_blocks * BLOCK / 2;
    let packed: Vec<PackedHead> = (0..batch * key_heads)
        .into_par_iter()
        .map(|bh| {
            let head = (bh / key_heads, bh % key_heads);
            let mut keys_packed = vec![0u32; key_blocks * pairs * BLOCK];
            pack_keys(&k, head, pairs, &mut keys_packed);
            let mut values = vec![0u32; dv.div_ceil(BLOCK) * key_pairs * BLOCK];
            pack_values(&v, head, key_pairs, &mut values);
            PackedHead {
                keys: keys_packed,
                values,
            }
        })
        .collect();
    let tiles = queries.div_ceil(QUERY_TILE);
    let work = batch * heads * queries * keys * width;
    run_tasks(batch * heads * tiles, work, |task| {
        let (bh, tile) = (task / tiles, task % tiles);
        let (b, h) = (bh / heads, bh % heads);
        let from = tile * QUERY_TILE;
        let rows = QUERY_TILE.min(queries - from);
        // Grouped-query attention: query head h reads key and value head h / group.
        let kv = &packed[b * key_heads + h / math.group];
        let mut query_rows = vec![bf16::ZERO; QUERY_TILE * (steps * STEP + PAD)];
        for (r, dst) in query_rows
            .chunks_exact_mut(steps * STEP + PAD)
            .take(rows)
            .enumerate()
        {
            dst[..width].copy_from_slice(q.row((b, h), from + r));
        }
        forward_tile(
            unit,
            math,
            (&query_rows, steps),
            kv,
            (dv, key_pairs),
            keys_of(key_lengths, b, keys),
            (from, rows),
        )
    })
}

/// `rows` queries from `from` of one head (their rows in `query_rows`, `steps` steps deep plus
/// [`PAD`]): their outputs (`rows × dv`) and `lse`, against the first `keys` keys of `kv`.
fn forward_tile(
    unit: impl BlockUnit,
    math: &Attention,
    (query_rows, steps): (&[bf16], usize),
    kv: &PackedHead,
    (dv, key_pairs): (usize, usize),
    keys: usize,
    (from, rows): (usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let mut blocks = unit.start();
    let (query_stride, pairs) = (steps * STEP + PAD, steps * STEP_PAIRS);
    let (row_blocks, out_stride) = (rows.div_ceil(BLOCK), dv.div_ceil(BLOCK) * BLOCK);
    let mut out = vec![0.0f32; QUERY_TILE * out_stride];
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0.0f32; rows];
    let mut scores = vec![0.0f32; QUERY_TILE * KEY_TILE];
    // The weights' high parts, then their low parts (`p ≈ hi + lo`, both bf16).
    let mut weights = vec![bf16::ZERO; 2 * QUERY_TILE * WEIGHT_STRIDE];
    let scale = math.scale as f32;
    let seen_by_tile = math.visible(from + rows - 1, keys);
    let start = math.first(from) / KEY_TILE * KEY_TILE;
    #[cfg(target_arch = "x86_64")]
    let vector_rows = Avx512::detect();
    for j0 in (start..seen_by_tile).step_by(KEY_TILE) {
        let cols = KEY_TILE.min(seen_by_tile - j0);
        let col_blocks = cols.div_ceil(BLOCK);
        for rb in 0..row_blocks {
            // Rows rb·32.. see keys first(r0)..visible(last): blocks outside that range are
            // masked for every row of the block, and left uncomputed.
            let (r0, last) = (rb * BLOCK, (rb * BLOCK + BLOCK).min(rows) - 1);
            let (lo, hi) = (math.first(from + r0), math.visible(from + last, keys));
            for cb in 0..col_blocks {
                let c0 = j0 + cb * BLOCK;
                if c0 >= hi || c0 + BLOCK <= lo {
                    continue;
                }
                blocks.block_into(
                    (&query_rows[r0 * query_stride..], query_stride),
                    &kv.keys[(c0 / BLOCK) * pairs * BLOCK..],
                    steps,
                    false,
                    (&mut scores[r0 * KEY_TILE + cb * BLOCK..], KEY_TILE),
                );
            }
        }
        let key_tile = KeyTile {
            scores: &scores,
            weights: &mut weights,
            out: &mut out,
            running: (&mut max, &mut sum),
        };
        let geometry = (math, scale, from, (j0, col_blocks * BLOCK), keys, dv);
        #[cfg(target_arch = "x86_64")]
        match vector_rows {
            Some(rows) => weigh(rows, key_tile, geometry),
            None => weigh(Portable, key_tile, geometry),
        }
        #[cfg(not(target_arch = "x86_64"))]
        weigh(Portable, key_tile, geometry);
        for rb in 0..row_blocks {
            let r0 = rb * BLOCK;
            for (vb, panel) in kv.values.chunks_exact(key_pairs * BLOCK).enumerate() {
                for part in weights.chunks_exact(QUERY_TILE * WEIGHT_STRIDE) {
                    blocks.block_into(
                        (&part[r0 * WEIGHT_STRIDE..], WEIGHT_STRIDE),
                        &panel[j0 / 2 * BLOCK..],
                        col_blocks,
                        true,
                        (&mut out[r0 * out_stride + vb * BLOCK..], out_stride),
                    );
                }
            }
        }
    }
    drop(blocks);
    let mut outputs = Vec::with_capacity(rows * dv);
    let lse = (0..rows)
        .map(|r| {
            let row = &out[r * out_stride..][..dv];
            if sum[r] == 0.0 {
                // No key visible: the output is 0 and the row's log-sum is -inf.
                outputs.extend(std::iter::repeat_n(0.0, dv));
                return f32::NEG_INFINITY;
            }
            let inv = sum[r].recip();
            outputs.extend(row.iter().map(|o| o * inv));
            max[r] + sum[r].ln()
        })
        .collect();
    (outputs, lse)
}

/// A query tile's state at one key tile: the scores of its rows (`q · k`, unscaled, [`KEY_TILE`]
/// apart), and what [`weigh`] writes: the weights (two `bf16` parts, the high parts' rows then the
/// low parts', [`WEIGHT_STRIDE`] apart), the outputs
/// accumulated so far (rows of the value width rounded up to a block) and each row's running
/// maximum and sum.
struct KeyTile<'a> {
    scores: &'a [f32],
    weights: &'a mut [bf16],
    out: &'a mut [f32],
    running: (&'a mut [f32], &'a mut [f32]),
}

/// Where the key tile lies: the attention, its scale, the query tile's first query, the tile's
/// first key and its width in whole blocks, the keys of the batch, the value width.
type Geometry<'a> = (&'a Attention, f32, usize, (usize, usize), usize, usize);

/// For every query row `r` of the tile: its weights `p_j = e^(scale s_j - max)` over the keys it
/// sees (0 elsewhere, up to the tile's width), against the running maximum raised to the tile's
/// (the row's outputs and sum rescaled by `e^(old - new)`); the sum grows by the weights in `f32`,
/// and the weights are stored as two `bf16` parts (the high parts first, then the low ones). The
/// two passes over a row's scores (its maximum, then its weights) are `rows`'.
fn weigh(
    rows: impl RowPass,
    tile: KeyTile<'_>,
    (math, scale, from, (j0, width), keys, dv): Geometry<'_>,
) {
    let (max, sum) = tile.running;
    let out_stride = tile.out.len() / QUERY_TILE;
    let (high, low) = tile.weights.split_at_mut(QUERY_TILE * WEIGHT_STRIDE);
    for (r, (max, sum)) in max.iter_mut().zip(sum.iter_mut()).enumerate() {
        let row = &tile.scores[r * KEY_TILE..][..width];
        let high = &mut high[r * WEIGHT_STRIDE..][..width];
        let low = &mut low[r * WEIGHT_STRIDE..][..width];
        let seen = math.visible(from + r, keys).saturating_sub(j0).min(width);
        let skip = math.first(from + r).saturating_sub(j0).min(seen);
        if seen == skip {
            high.fill(bf16::ZERO);
            low.fill(bf16::ZERO);
            continue;
        }
        // Only the chunks of lanes that hold a key the row sees are computed; the rest weigh 0.
        let span = Span::new(skip, seen);
        for part in [&mut *high, &mut *low] {
            part[..span.first].fill(bf16::ZERO);
            part[span.end..].fill(bf16::ZERO);
        }
        let new_max = larger_or_nan(*max, rows.max(row, &span, scale));
        let rescale = Float::exp(*max - new_max);
        let total = rows.weights(row, (high, low), &span, scale, new_max);
        *sum = *sum * rescale + total;
        *max = new_max;
        if rescale != 1.0 {
            tile.out[r * out_stride..][..dv]
                .iter_mut()
                .for_each(|o| *o *= rescale);
        }
    }
}

/// Lanes of the row pass: a chunk of keys is 16 `f32` scores, one AVX-512 register.
pub(super) const LANES: usize = 16;

/// The keys of one row within a key tile (tile-relative): the row sees `skip..seen`, and the
/// chunks of [`LANES`] that hold them are `first..end` (`first` and `end` multiples of [`LANES`],
/// `end` within the tile).
#[derive(Clone, Copy)]
pub(super) struct Span {
    skip: usize,
    seen: usize,
    first: usize,
    end: usize,
}

impl Span {
    /// The span of a row that sees keys `skip..seen` (`skip <= seen`, both within the tile).
    pub(super) fn new(skip: usize, seen: usize) -> Span {
        Span {
            skip,
            seen,
            first: skip / LANES * LANES,
            end: seen.div_ceil(LANES) * LANES,
        }
    }

    /// Which lanes of the chunk at `c` hold a key the row sees (bit `i`: key `c + i`).
    #[inline(always)]
    pub(super) fn visible(&self, c: usize) -> u16 {
        let lanes_below = |n: usize| ((1u32 << n.saturating_sub(c).min(LANES)) - 1) as u16;
        lanes_below(self.seen) & !lanes_below(self.skip)
    }
}

/// The two passes over one row's scores (its chunks `span.first..span.end`; keys outside
/// `span.skip..span.seen` are masked): the same maxima and weights whichever runs (the sums add
/// in another order), one of them in AVX-512 registers.
trait RowPass: Copy {
    /// The largest visible `scale · s`; NaN if any visible score is NaN.
    fn max(self, row: &[f32], span: &Span, scale: f32) -> f32;

    /// Writes the weights `p = e^(scale · s - max)` of the chunks (0 for masked keys) as their two
    /// `bf16` parts, `hi = bf16(p)` and `lo = bf16(p - hi)` (so `hi + lo` keeps 16 significant
    /// bits), and returns their sum.
    fn weights(
        self,
        row: &[f32],
        parts: (&mut [bf16], &mut [bf16]),
        span: &Span,
        scale: f32,
        max: f32,
    ) -> f32;
}

/// The row pass in plain Rust, for CPUs the AMX tiles run on without AVX-512 BF16 (none known,
/// but the tiles' detection does not promise it).
#[derive(Clone, Copy)]
pub(super) struct Portable;

impl RowPass for Portable {
    fn max(self, row: &[f32], span: &Span, scale: f32) -> f32 {
        row[span.skip..span.seen]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| larger_or_nan(m, s * scale))
    }

    fn weights(
        self,
        row: &[f32],
        (high, low): (&mut [bf16], &mut [bf16]),
        span: &Span,
        scale: f32,
        max: f32,
    ) -> f32 {
        let mut total = 0.0;
        for c in span.first..span.end {
            let p = if (span.skip..span.seen).contains(&c) {
                exp_weight(row[c] * scale - max)
            } else {
                0.0
            };
            total += p;
            let hi = bf16_of_f32(p);
            high[c] = hi;
            low[c] = bf16_of_f32(p - hi.to_f32());
        }
        total
    }
}

/// The row pass in AVX-512F and AVX-512 BF16 registers: only [`Avx512::detect`] makes one.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx512 {
    _detected: (),
}

#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// The row pass, where the CPU has AVX-512F and AVX-512 BF16 (every CPU with AMX-BF16 known).
    pub(super) fn detect() -> Option<Avx512> {
        (std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16"))
            .then_some(Avx512 { _detected: () })
    }
}

#[cfg(target_arch = "x86_64")]
impl RowPass for Avx512 {
    fn max(self, row: &[f32], span: &Span, scale: f32) -> f32 {
        // SAFETY: an `Avx512` exists only where the CPU has AVX-512F and AVX-512 BF16 (`detect`),
        // the features the function is compiled for.
        unsafe { row_max_avx512(row, span, scale) }
    }

    fn weights(
        self,
        row: &[f32],
        parts: (&mut [bf16], &mut [bf16]),
        span: &Span,
        scale: f32,
        max: f32,
    ) -> f32 {
        // SAFETY: as in `max`.
        unsafe { row_weights_avx512(row, parts, span, scale, max) }
    }
}

/// [`RowPass::max`] in 16 lanes: a masked maximum per chunk, NaNs noted apart (`vmaxps` passes
/// a NaN on only from its second operand).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn row_max_avx512(row: &[f32], span: &Span, scale: f32) -> f32 {
    use std::arch::x86_64::*;
    let scale = _mm512_set1_ps(scale);
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut nan: __mmask16 = 0;
    for c in (span.first..span.end).step_by(LANES) {
        let chunk = &row[c..c + LANES];
        // SAFETY: 16 floats from a slice of 16.
        let s = _mm512_mul_ps(unsafe { _mm512_loadu_ps(chunk.as_ptr()) }, scale);
        let keep = span.visible(c);
        max = _mm512_mask_max_ps(max, keep, max, s);
        nan |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(keep, s, s);
    }
    if nan != 0 {
        f32::NAN
    } else {
        _mm512_reduce_max_ps(max)
    }
}

/// [`RowPass::weights`] in 16 lanes: [`exp_weight`]'s steps on a register, both parts rounded by
/// `vcvtneps2bf16` (round to nearest even, as [`bf16_of_f32`]; the weights are normal floats, whose
/// subnormal low parts it flushes to zero, 2⁻¹²⁶ apart at most).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn row_weights_avx512(
    row: &[f32],
    (high, low): (&mut [bf16], &mut [bf16]),
    span: &Span,
    scale: f32,
    max: f32,
) -> f32 {
    use std::arch::x86_64::*;
    let (scale, max) = (_mm512_set1_ps(scale), _mm512_set1_ps(max));
    let floor = _mm512_set1_ps(EXP_FLOOR);
    let mut total = _mm512_setzero_ps();
    for c in (span.first..span.end).step_by(LANES) {
        let chunk = &row[c..c + LANES];
        // SAFETY: 16 floats from a slice of 16.
        let s = unsafe { _mm512_loadu_ps(chunk.as_ptr()) };
        let x = _mm512_sub_ps(_mm512_mul_ps(s, scale), max);
        // Below the floor `e^x` is no normal float: those weigh 0, as masked keys do.
        let keep = span.visible(c) & !_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor);
        // `vmaxps` returns its second operand when one is NaN: a NaN `x` stays NaN.
        let p = _mm512_maskz_mov_ps(keep, exp_avx512(_mm512_max_ps(floor, x)));
        total = _mm512_add_ps(total, p);
        let hi: __m256bh = _mm512_cvtneps_pbh(p);
        // SAFETY: `__m256bh` and `__m256i` are both 32 bytes, and any bits are valid in either.
        let hi = unsafe { std::mem::transmute::<__m256bh, __m256i>(hi) };
        let widened = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
        let lo: __m256bh = _mm512_cvtneps_pbh(_mm512_sub_ps(p, widened));
        let (hi_out, lo_out) = (&mut high[c..c + LANES], &mut low[c..c + LANES]);
        // SAFETY: 32 bytes into slices of 16 `bf16`; `__m256bh` is 32 bytes of 16 `bf16`.
        unsafe {
            _mm256_storeu_si256(hi_out.as_mut_ptr().cast(), hi);
            _mm256_storeu_si256(
                lo_out.as_mut_ptr().cast(),
                std::mem::transmute::<__m256bh, __m256i>(lo),
            );
        }
    }
    _mm512_reduce_add_ps(total)
}

/// [`exp_weight`]'s `e^x` on 16 lanes of `x` in `[EXP_FLOOR, 0]` (or NaN), the same steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let magic = _mm512_set1_ps(ROUND_MAGIC);
    let shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), magic);
    let k = _mm512_sub_ps(shifted, magic);
    let k_int = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(magic));
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for coefficient in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(coefficient));
    }
    let two_k = _mm512_slli_epi32::<23>(_mm512_add_epi32(k_int, _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(two_k))
}

/// `e^x` for a weight: `x <= 0` (a score less its row's maximum) or NaN (which stays NaN); 0 below
/// -87, where `e^x` is no longer a normal `f32`. `x = k ln 2 + r` with `|r| <= ln 2 / 2` (Cody and
/// Waite's two-part `ln 2`), `e^r` by its Taylor series to degree 6 (the first omitted term is
/// below 2^-22 of the result), and `2^k` from exponent bits (`k` in -126..=0), in fused
/// multiply-adds ([`exp_avx512`] takes the same steps on 16 lanes). Weights are rounded to `bf16`, so
/// [`crate::fastmath`]'s `exp` (degree 7, overflow and the whole range handled) would spend its
/// extra work on bits the two parts of a weight do not keep.
#[inline(always)]
pub(super) fn exp_weight(x: f32) -> f32 {
    let xc = if x < EXP_FLOOR { EXP_FLOOR } else { x };
    let shifted = xc.mul_add(std::f32::consts::LOG2_E, ROUND_MAGIC);
    let k = shifted - ROUND_MAGIC;
    let k_int = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = k.mul_add(-LN2_LO, k.mul_add(-LN2_HI, xc));
    let p = r.mul_add(1.0 / 720.0, 1.0 / 120.0);
    let p = r.mul_add(p, 1.0 / 24.0);
    let p = r.mul_add(p, 1.0 / 6.0);
    let p = r.mul_add(p, 0.5);
    let p = r.mul_add(p, 1.0);
    let p = r.mul_add(p, 1.0);
    let y = p * f32::from_bits((k_int.wrapping_add(127) as u32) << 23);
    if x < EXP_FLOOR { 0.0 } else { y }
}

/// `1.5 · 2^23`: adding it rounds a float of magnitude below `2^22` to an integer.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// `ln 2` in two parts (Cody and Waite): the high part's product by `k` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this `e^x` is no longer a normal `f32`: such weights are 0.
pub(super) const EXP_FLOOR: f32 = -87.0;

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `n` values in [-2, 2) from the crate's seeded generator, as `bf16`.
    pub(in super::super) fn values(n: usize, seed: u64) -> Vec<bf16> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n)
            .map(|_| bf16_of_f32((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0))
            .collect()
    }

    /// One case: dims `[batch, heads, key heads, queries, keys, width, value width]`.
    struct Case {
        dims: [usize; 7],
        causal: Option<i64>,
        window: Option<usize>,
        key_lengths: Option<Vec<i64>>,
        /// The queries stored `[batch, queries, heads, width]` and read through a permuted view.
        permuted_queries: bool,
    }

    /// `out` and `lse` of query `i` of head `(b, h)`, in f64 from the `bf16` values.
    fn reference(
        math: &Attention,
        [q, k, v]: [&Operand<'_>; 3],
        (b, h): (usize, usize),
        i: usize,
        keys: usize,
    ) -> (Vec<f64>, f64) {
        let kh = h / math.group;
        let (first, seen) = (math.first(i), math.visible(i, keys));
        let f = |x: &[bf16]| x.iter().map(|x| f64::from(x.to_f32())).collect::<Vec<_>>();
        let qi = f(q.row((b, h), i));
        let scores: Vec<f64> = (first..seen.max(first))
            .map(|j| {
                let kj = f(k.row((b, kh), j));
                math.scale * qi.iter().zip(&kj).map(|(a, b)| a * b).sum::<f64>()
            })
            .collect();
        let dv = v.dims[3];
        if scores.is_empty() {
            return (vec![0.0; dv], f64::NEG_INFINITY);
        }
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let mut out = vec![0.0; dv];
        for (j, w) in (first..).zip(&weights) {
            for (o, x) in out.iter_mut().zip(f(v.row((b, kh), j))) {
                *o += w / sum * x;
            }
        }
        (out, max + sum.ln())
    }

    /// The AVX-512 row pass against the portable one: the same maxima and weight bits (each
    /// weight takes the same steps), sums within rounding (the lanes add in another order); masked
    /// keys, weights below the floor, a NaN seen and a NaN masked.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_row_pass_matches_the_portable_one() {
        let Some(vector) = Avx512::detect() else {
            eprintln!("the AVX-512 row pass: not run (this CPU has no AVX-512 BF16)");
            return;
        };
        let mut rng = crate::rng::Rng::new(11);
        let width = 96;
        let mut row: Vec<f32> = (0..width)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 80.0 - 40.0)
            .collect();
        row[21] = -2000.0;
        let scale = 0.3;
        for (skip, seen, nan) in [
            (0, 96, None),
            (5, 70, None),
            (17, 18, None),
            (33, 96, Some(40)),
            (35, 96, Some(33)),
        ] {
            let mut row = row.clone();
            if let Some(i) = nan {
                row[i] = f32::NAN;
            }
            let span = Span::new(skip, seen);
            let (want_max, got_max) = (
                Portable.max(&row, &span, scale),
                vector.max(&row, &span, scale),
            );
            assert_eq!(
                want_max.to_bits(),
                got_max.to_bits(),
                "span {skip}..{seen}: the maximum"
            );
            assert_eq!(
                want_max.is_nan(),
                nan == Some(40),
                "span {skip}..{seen}: a NaN seen"
            );
            let mut want = (vec![bf16::ZERO; width], vec![bf16::ZERO; width]);
            let mut got = want.clone();
            let max = if want_max.is_nan() { 0.0 } else { want_max };
            let want_sum = Portable.weights(&row, (&mut want.0, &mut want.1), &span, scale, max);
            let got_sum = vector.weights(&row, (&mut got.0, &mut got.1), &span, scale, max);
            let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&want.0),
                bits(&got.0),
                "span {skip}..{seen}: the high parts"
            );
            assert_eq!(
                bits(&want.1),
                bits(&got.1),
                "span {skip}..{seen}: the low parts"
            );
            if nan == Some(40) {
                assert!(want_sum.is_nan() && got_sum.is_nan());
            } else {
                assert!(
                    (want_sum - got_sum).abs() <= 1e-6 * want_sum,
                    "{want_sum} vs {got_sum}"
                );
                assert!(want_sum >= 1.0, "the row's maximum weighs 1");
            }
        }
    }

    #[test]
    fn tiles_match_f64_attention() {
        // Every unit this CPU has (valgrind's has neither).
        let amx = super::super::bf16_tiles::Amx::detect();
        let vectors = super::super::bf16_blocks::Vectors::detect();
        match amx {
            Some(amx) => check_against_f64("amx", amx),
            None => {
                eprintln!("bf16 attention on AMX tiles: not run (this CPU or kernel has no AMX)")
            }
        }
        match vectors {
            Some(vectors) => check_against_f64("avx512-bf16", vectors),
            None => eprintln!(
                "bf16 attention on AVX-512 BF16 vectors: not run (this CPU has no AVX-512 BF16)"
            ),
        }
    }

    /// The attention on `unit`'s blocks against f64, for every case.
    fn check_against_f64(name: &str, unit: impl BlockUnit) {
        let cases = [
            Case {
                dims: [2, 2, 2, 70, 150, 16, 16],
                causal: Some(80),
                window: None,
                key_lengths: None,
                permuted_queries: false,
            },
            Case {
                dims: [1, 4, 2, 200, 200, 64, 64],
                causal: Some(0),
                window: None,
                key_lengths: None,
                permuted_queries: true,
            },
            Case {
                dims: [2, 3, 3, 33, 130, 80, 48],
                causal: None,
                window: None,
                key_lengths: Some(vec![100, 0]),
                permuted_queries: false,
            },
            Case {
                dims: [1, 2, 1, 300, 300, 32, 40],
                causal: Some(0),
                window: Some(40),
                key_lengths: None,
                permuted_queries: true,
            },
            Case {
                // Three key tiles, so the running maximum rescales what the rows hold.
                dims: [1, 2, 1, 70, 600, 64, 64],
                causal: Some(530),
                window: None,
                key_lengths: None,
                permuted_queries: false,
            },
            Case {
                dims: [1, 1, 1, 5, 1, 7, 3],
                causal: None,
                window: None,
                key_lengths: None,
                permuted_queries: false,
            },
        ];
        for (n, case) in cases.iter().enumerate() {
            let [batch, heads, key_heads, queries, keys, width, dv] = case.dims;
            let math = Attention {
                scale: 1.0 / (width as f64).sqrt(),
                causal: case.causal,
                group: heads / key_heads,
                window: case.window,
            };
            let q_data = values(batch * heads * queries * width, 3 * n as u64 + 1);
            let k_data = values(batch * key_heads * keys * width, 3 * n as u64 + 2);
            let v_data = values(batch * key_heads * keys * dv, 3 * n as u64 + 3);
            let contiguous = |data, [b, h, l, w]: [usize; 4]| Operand {
                data,
                dims: [b, h, l, w],
                strides: [h * l * w, l * w, w],
                offset: 0,
            };
            let q = if case.permuted_queries {
                Operand {
                    data: &q_data,
                    dims: [batch, heads, queries, width],
                    strides: [queries * heads * width, width, heads * width],
                    offset: 0,
                }
            } else {
                contiguous(&q_data, [batch, heads, queries, width])
            };
            let k = contiguous(&k_data, [batch, key_heads, keys, width]);
            let v = contiguous(&v_data, [batch, key_heads, keys, dv]);
            let results = query_tiles(unit, &math, [q, k, v], case.key_lengths.as_deref());
            let tiles = queries.div_ceil(QUERY_TILE);
            for (task, (out, lse)) in results.iter().enumerate() {
                let (bh, tile) = (task / tiles, task % tiles);
                let (b, h) = (bh / heads, bh % heads);
                let keys = keys_of(case.key_lengths.as_deref(), b, keys);
                for (r, got) in out.chunks(dv).enumerate() {
                    let i = tile * QUERY_TILE + r;
                    let (want, want_lse) = reference(&math, [&q, &k, &v], (b, h), i, keys);
                    // The weights are carried as two bf16 (within 2^-16) and |v| <= 2.
                    for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() <= 2.0 * 2f64.powi(-16) + 2e-5,
                            "{name}, case {n}, batch {b}, head {h}, query {i}, column {c}: {g} vs {w}"
                        );
                    }
                    let got_lse = f64::from(lse[r]);
                    assert!(
                        got_lse == want_lse
                            || (got_lse - want_lse).abs() <= 1e-4 * want_lse.abs().max(1.0),
                        "{name}, case {n}, batch {b}, head {h}, query {i}: lse {got_lse} vs {want_lse}"
                    );
                }
            }
        }
    }
}
