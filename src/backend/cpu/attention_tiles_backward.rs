//! The `bf16` fused attention backward on `bf16` blocks ([`Attention`] states the math; the
//! schedule is [`super::attention`]'s backward: one task per batch and head, the keys in tiles of
//! [`KEY_TILE`], for each the query tiles of [`QUERY_TILE`] that see it).
//!
//! All five products of a query tile and a key tile run in 32 × 32 blocks ([`Blocks::block_into`],
//! on AMX tiles or AVX-512 BF16 vectors, as the forward's: [`super::attention_tiles`]):
//!
//! - the scores `s = q kᵀ` and `dp = dout vᵀ`, from the rows of `q` and `dout` and the keys and
//!   values packed as right panels (as the forward packs the keys);
//! - `dvᵀ += doutᵀ p` and `dkᵀ += qᵀ ds`, from the rows of `doutᵀ` and `qᵀ` (made once per head) and
//!   the weights `p = e^(scale s - lse)` and `ds = p (dp - D) scale`, which the row pass writes
//!   straight into right panels (`[query pair][key]`), two query rows at a time;
//! - `dq += ds k`, from `ds`'s rows and the keys packed as right panels along the keys.
//!
//! The key and value gradients are computed transposed and turned around once per head when stored.
//! Query tiles of 128 or 256 (2x and 4x the depth of the key and value gradients' products) measured
//! the same as 64 (criterion's `attention_1x12x1024x64_causal/fused_forward_backward/bf16`, Zen 4).
//! Nothing is widened to `f32` but the sums: the path this replaces widened every operand and
//! multiplied with `gemm` in `f32`.
//!
//! `p` and `ds` are rounded once to `bf16` before they multiply, as PyTorch's CPU attention and
//! FlashAttention do: each term of a gradient moves by at most 2⁻⁹ of itself, and the gradients are
//! stored in `bf16` (2⁻⁹) anyway. (The forward keeps `p` in two parts because its outputs feed the
//! logits, which `tests/cuda.rs` holds to the GPU's `f32` weights.)

use super::attention::{KEY_TILE, QUERY_TILE, keys_of, run_tasks, seen_tiles, store_gradients};
#[cfg(target_arch = "x86_64")]
use super::attention_tiles::{Avx512, exp_avx512};
use super::attention_tiles::{
    EXP_FLOOR, LANES, Operand, PAD, Portable, STEP, Span, exp_weight, pack_keys, pack_values,
};
use super::bf16_blocks::{BlockUnit, Blocks};
use super::bf16_tiles::{BLOCK, STEP_PAIRS};
use crate::backend::op::Attention;
use crate::backend::{AttentionInputs, Dst, Src};
use crate::dtype::{bf16, bf16_of_f32};

/// Row stride of `ds`'s rows (`bf16`): one step past a key tile.
const DS_STRIDE: usize = KEY_TILE + PAD;
/// `u32` elements of one key block's panel of weights (or of `ds`): a query tile's pairs × 32 keys.
const PANEL: usize = QUERY_TILE / 2 * BLOCK;

/// Backward pass on `unit`'s blocks: the gradients `[dq, dk, dv]` from `[out, dout, lse]`
/// (`attention_tiles::computes(&inputs)` must hold; `dk` and `dv` per query head, as the caller
/// sums them over a group).
pub(super) fn backward(
    unit: impl BlockUnit,
    math: &Attention,
    inputs: AttentionInputs,
    [out, dout, lse]: [Src; 3],
    grads: [Dst; 3],
) {
    let operands = [
        Operand::of(&inputs.q),
        Operand::of(&inputs.k),
        Operand::of(&inputs.v),
        Operand::of(&out),
        Operand::of(&dout),
    ];
    let lse = lse.contiguous_host::<f32>();
    let key_lengths = inputs.key_lengths.map(|l| l.contiguous_host::<i64>());
    #[cfg(target_arch = "x86_64")]
    let results = match Avx512::detect() {
        Some(rows) => head_gradients(unit, rows, math, operands, lse, key_lengths),
        None => head_gradients(unit, Portable, math, operands, lse, key_lengths),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let results = head_gradients(unit, Portable, math, operands, lse, key_lengths);
    store_gradients::<bf16>(grads, operands[0].dims[1], results);
}

/// Every head's gradients `[dq, dk, dv]` (`f32` rows of the queries', keys' and values' widths;
/// `dk` and `dv` of the key head that query head reads), in the order batch, head.
fn head_gradients(
    unit: impl BlockUnit,
    rows: impl GradientRows,
    math: &Attention,
    operands: [Operand<'_>; 5],
    lse: &[f32],
    key_lengths: Option<&[i64]>,
) -> Vec<[Vec<f32>; 3]> {
    let [q, k, ..] = operands;
    let ([batch, heads, queries, width], keys) = (q.dims, k.dims[2]);
    let work = batch * heads * queries * keys * width;
    run_tasks(batch * heads, work, |bh| {
        let head = (bh / heads, bh % heads);
        let lse = &lse[bh * queries..(bh + 1) * queries];
        let keys = (keys_of(key_lengths, head.0, keys), keys);
        Head::new(math, operands, head).gradients(unit, rows, lse, keys)
    })
}

/// One query head's operands, as the blocks read them (rows padded to whole blocks and steps with
/// zeros, panels packed), and its gradients' sums.
struct Head {
    /// `q`'s rows, `dout`'s rows (one step past their widths' steps apart), and their transposes
    /// (rows of the widths, `queries` rounded up to a block plus [`PAD`] apart).
    q_rows: Vec<bf16>,
    dout_rows: Vec<bf16>,
    q_t: Vec<bf16>,
    dout_t: Vec<bf16>,
    /// The keys and values as right panels of the scores (`[key block][width pair][key]`), and the
    /// keys as right panels of `ds k` (`[width block][key pair][column]`).
    keys: Vec<u32>,
    values: Vec<u32>,
    keys_along: Vec<u32>,
    /// `q`'s and `v`'s widths, and their steps; the queries, keys and both widths rounded up to
    /// blocks.
    widths: (usize, usize),
    steps: (usize, usize),
    padded: Padded,
    math: Attention,
    /// `D_i = dout_i · out_i`.
    delta: Vec<f32>,
}

/// Lengths rounded up to whole blocks.
#[derive(Clone, Copy)]
struct Padded {
    queries: usize,
    keys: usize,
    width: usize,
    value_width: usize,
}

impl Head {
    fn new(math: &Attention, [q, k, v, out, dout]: [Operand<'_>; 5], head: (usize, usize)) -> Head {
        let key_head = (head.0, head.1 / math.group);
        let ([_, _, queries, width], [_, _, keys, value_width]) = (q.dims, v.dims);
        let up = |n: usize| n.div_ceil(BLOCK) * BLOCK;
        let padded = Padded {
            queries: up(queries),
            keys: up(keys),
            width: up(width),
            value_width: up(value_width),
        };
        let steps = (width.div_ceil(STEP), value_width.div_ceil(STEP));
        let rows_of = |x: &Operand<'_>, steps: usize| {
            let stride = steps * STEP + PAD;
            let mut rows = vec![bf16::ZERO; padded.queries * stride];
            for (i, row) in rows.chunks_exact_mut(stride).take(queries).enumerate() {
                row[..x.dims[3]].copy_from_slice(x.row(head, i));
            }
            rows
        };
        let transposed = |x: &Operand<'_>, lines: usize| {
            let stride = padded.queries + PAD;
            let mut t = vec![bf16::ZERO; lines * stride];
            // In runs of a block of queries, so that the lines written stay in L1.
            for i0 in (0..queries).step_by(BLOCK) {
                for i in i0..queries.min(i0 + BLOCK) {
                    for (c, &e) in x.row(head, i).iter().enumerate() {
                        t[c * stride + i] = e;
                    }
                }
            }
            t
        };
        let mut keys_packed = vec![0u32; padded.keys * steps.0 * STEP_PAIRS];
        pack_keys(&k, key_head, steps.0 * STEP_PAIRS, &mut keys_packed);
        let mut values = vec![0u32; padded.keys * steps.1 * STEP_PAIRS];
        pack_keys(&v, key_head, steps.1 * STEP_PAIRS, &mut values);
        let mut keys_along = vec![0u32; padded.width * padded.keys / 2];
        pack_values(&k, key_head, padded.keys / 2, &mut keys_along);
        let delta = (0..queries)
            .map(|i| {
                let (o, g) = (out.row(head, i), dout.row(head, i));
                o.iter().zip(g).map(|(o, g)| o.to_f32() * g.to_f32()).sum()
            })
            .collect();
        Head {
            q_rows: rows_of(&q, steps.0),
            dout_rows: rows_of(&dout, steps.1),
            q_t: transposed(&q, padded.width),
            dout_t: transposed(&dout, padded.value_width),
            keys: keys_packed,
            values,
            keys_along,
            widths: (width, value_width),
            steps,
            padded,
            math: *math,
            delta,
        }
    }

    /// The head's gradients against the first `keys` of its `all_keys` keys (see
    /// [`head_gradients`]).
    fn gradients(
        &self,
        unit: impl BlockUnit,
        rows: impl GradientRows,
        lse: &[f32],
        (keys, all_keys): (usize, usize),
    ) -> [Vec<f32>; 3] {
        let (math, p) = (&self.math, self.padded);
        let queries = lse.len();
        let mut blocks = unit.start();
        let mut sums = Sums {
            dq: vec![0.0; p.queries * p.width],
            dk_t: vec![0.0; p.width * p.keys],
            dv_t: vec![0.0; p.value_width * p.keys],
        };
        let mut tile = TileState {
            scores: vec![0.0; QUERY_TILE * KEY_TILE],
            dp: vec![0.0; QUERY_TILE * KEY_TILE],
            weights: vec![0; KEY_TILE / BLOCK * PANEL],
            ds: vec![0; KEY_TILE / BLOCK * PANEL],
            ds_rows: vec![bf16::ZERO; QUERY_TILE * DS_STRIDE],
        };
        for (query_tile, key_tile) in seen_tiles(math, queries, keys) {
            let at = TileAt {
                queries: query_tile,
                keys: key_tile,
                batch_keys: keys,
            };
            self.scores(&mut blocks, at, &mut tile);
            self.weigh(rows, at, lse, &mut tile);
            self.accumulate(&mut blocks, at, &tile, &mut sums);
        }
        drop(blocks);
        let (d, dv) = self.widths;
        let mut dq = Vec::with_capacity(queries * d);
        for row in sums.dq.chunks_exact(p.width).take(queries) {
            dq.extend_from_slice(&row[..d]);
        }
        // The key and value gradients were summed transposed: row `c` holds column `c` of every
        // key. Turned around a block of keys at a time, so that the rows written stay in L1.
        let turned = |t: &[f32], width: usize| -> Vec<f32> {
            let mut out = vec![0.0; all_keys * width];
            for j0 in (0..all_keys).step_by(BLOCK) {
                let n = BLOCK.min(all_keys - j0);
                for c in 0..width {
                    for (j, &x) in t[c * p.keys + j0..][..n].iter().enumerate() {
                        out[(j0 + j) * width + c] = x;
                    }
                }
            }
            out
        };
        [dq, turned(&sums.dk_t, d), turned(&sums.dv_t, dv)]
    }

    /// `s = q kᵀ` and `dp = dout vᵀ` of the tile's blocks that some query of their row block sees
    /// (the others keep what they held: the row pass masks them).
    fn scores(&self, blocks: &mut impl Blocks, at: TileAt, tile: &mut TileState) {
        let (math, (i0, n), (j0, cols)) = (&self.math, at.queries, at.keys);
        let (q_stride, dout_stride) = (self.steps.0 * STEP + PAD, self.steps.1 * STEP + PAD);
        let (pairs, value_pairs) = (self.steps.0 * STEP_PAIRS, self.steps.1 * STEP_PAIRS);
        for r0 in (0..n).step_by(BLOCK) {
            let last = (r0 + BLOCK).min(n) - 1;
            let (lo, hi) = (math.first(i0 + r0), math.visible(i0 + last, at.batch_keys));
            for c0 in (j0..j0 + cols).step_by(BLOCK) {
                if c0 >= hi || c0 + BLOCK <= lo {
                    continue;
                }
                let sums = r0 * KEY_TILE + (c0 - j0);
                blocks.block_into(
                    (&self.q_rows[(i0 + r0) * q_stride..], q_stride),
                    &self.keys[c0 / BLOCK * pairs * BLOCK..],
                    self.steps.0,
                    false,
                    (&mut tile.scores[sums..], KEY_TILE),
                );
                blocks.block_into(
                    (&self.dout_rows[(i0 + r0) * dout_stride..], dout_stride),
                    &self.values[c0 / BLOCK * value_pairs * BLOCK..],
                    self.steps.1,
                    false,
                    (&mut tile.dp[sums..], KEY_TILE),
                );
            }
        }
    }

    /// The row pass over the tile's rows, two at a time, up to a whole row block (rows past the
    /// tile's queries, rows that see no key and keys a row does not see weigh 0).
    fn weigh(&self, rows: impl GradientRows, at: TileAt, lse: &[f32], tile: &mut TileState) {
        let (math, (i0, n), (j0, cols)) = (&self.math, at.queries, at.keys);
        let row = |r: usize| -> Option<RowAt> {
            let i = i0 + r;
            if r >= n || lse[i] == f32::NEG_INFINITY {
                return None;
            }
            let seen = math.visible(i, at.batch_keys).saturating_sub(j0).min(cols);
            let skip = math.first(i).saturating_sub(j0).min(seen);
            Some(RowAt {
                span: Span::new(skip, seen),
                lse: lse[i],
                delta: self.delta[i],
            })
        };
        for pair in 0..n.div_ceil(BLOCK) * BLOCK / 2 {
            let input = PairIn {
                scores: &tile.scores,
                dp: &tile.dp,
                pair,
                rows: [row(2 * pair), row(2 * pair + 1)],
                scale: math.scale as f32,
                width: cols.div_ceil(BLOCK) * BLOCK,
            };
            let out = PairOut {
                weights: &mut tile.weights,
                ds: &mut tile.ds,
                ds_rows: &mut tile.ds_rows,
            };
            rows.pair(input, out);
        }
    }

    /// `dvᵀ += doutᵀ p` and `dkᵀ += qᵀ ds` over the key blocks some query of the tile sees, and
    /// `dq += ds k` over the key blocks each row block sees.
    fn accumulate(&self, blocks: &mut impl Blocks, at: TileAt, tile: &TileState, sums: &mut Sums) {
        let (math, p, (i0, n), (j0, cols)) = (&self.math, self.padded, at.queries, at.keys);
        // Steps of 32 queries: the depth of the key and value gradients' products.
        let depth = n.div_ceil(BLOCK);
        let t_stride = p.queries + PAD;
        let (lo, hi) = (math.first(i0), math.visible(i0 + n - 1, at.batch_keys));
        for c0 in (j0..j0 + cols).step_by(BLOCK) {
            if c0 >= hi || c0 + BLOCK <= lo {
                continue;
            }
            let panel = (c0 - j0) / BLOCK * PANEL;
            for (left, right, out) in [
                (&self.dout_t, &tile.weights, &mut sums.dv_t),
                (&self.q_t, &tile.ds, &mut sums.dk_t),
            ] {
                for l0 in (0..left.len() / t_stride).step_by(BLOCK) {
                    blocks.block_into(
                        (&left[l0 * t_stride + i0..], t_stride),
                        &right[panel..],
                        depth,
                        true,
                        (&mut out[l0 * p.keys + c0..], p.keys),
                    );
                }
            }
        }
        let key_pairs = p.keys / 2;
        for r0 in (0..n).step_by(BLOCK) {
            let last = (r0 + BLOCK).min(n) - 1;
            let (lo, hi) = (
                math.first(i0 + r0),
                math.visible(i0 + last, at.batch_keys).min(j0 + cols),
            );
            // The key blocks of the tile this row block sees.
            let (from, to) = (
                lo.saturating_sub(j0) / BLOCK,
                hi.saturating_sub(j0).div_ceil(BLOCK),
            );
            if from >= to {
                continue;
            }
            for d0 in (0..p.width).step_by(BLOCK) {
                let panel = d0 / BLOCK * key_pairs + j0 / 2 + from * STEP_PAIRS;
                blocks.block_into(
                    (&tile.ds_rows[r0 * DS_STRIDE + from * BLOCK..], DS_STRIDE),
                    &self.keys_along[panel * BLOCK..],
                    to - from,
                    true,
                    (&mut sums.dq[(i0 + r0) * p.width + d0..], p.width),
                );
            }
        }
    }
}

/// Where a query tile and a key tile meet: the tile's first query and its count, its first key and
/// its count, and the keys of the batch.
#[derive(Clone, Copy)]
struct TileAt {
    queries: (usize, usize),
    keys: (usize, usize),
    batch_keys: usize,
}

/// A tile's scratch: the scores and `dp` (`f32`, rows [`KEY_TILE`] apart), the weights and `ds` as
/// right panels (`[key block][query pair][key]`, [`PANEL`] a key block) and `ds`'s rows
/// ([`DS_STRIDE`] apart).
struct TileState {
    scores: Vec<f32>,
    dp: Vec<f32>,
    weights: Vec<u32>,
    ds: Vec<u32>,
    ds_rows: Vec<bf16>,
}

/// A head's gradients as they are summed: `dq` (rows of the padded width), `dkᵀ` and `dvᵀ` (rows of
/// the padded keys).
struct Sums {
    dq: Vec<f32>,
    dk_t: Vec<f32>,
    dv_t: Vec<f32>,
}

/// One query row in a key tile: the keys it sees (tile-relative), its `lse` and its `D`.
#[derive(Clone, Copy)]
struct RowAt {
    span: Span,
    lse: f32,
    delta: f32,
}

/// A row pair's inputs: the tile's scores and `dp` (rows [`KEY_TILE`] apart), the pair (rows `2 ·
/// pair` and `2 · pair + 1`), each row's place (`None`: it weighs nothing), the scale, and the keys
/// to write (whole blocks).
struct PairIn<'a> {
    scores: &'a [f32],
    dp: &'a [f32],
    pair: usize,
    rows: [Option<RowAt>; 2],
    scale: f32,
    width: usize,
}

/// Where a row pair's `p` and `ds` go (see [`TileState`]).
struct PairOut<'a> {
    weights: &'a mut [u32],
    ds: &'a mut [u32],
    ds_rows: &'a mut [bf16],
}

/// The row pass of the gradients, on two query rows at a time (a pair of a right panel).
trait GradientRows: Copy + Send + Sync {
    /// For each key `j < width` of both rows: `p = e^(scale s - lse)` (`e^x` as the forward's
    /// weights compute it, `x` at most 0; 0 for keys the row does not see and below the
    /// forward's floor) and `ds = p (dp - D) scale`, both rounded to `bf16`, into the panels (the
    /// pair's first row in the low half of a `u32`) and `ds`'s rows. The same bits whichever runs.
    fn pair(self, input: PairIn<'_>, out: PairOut<'_>);
}

impl GradientRows for Portable {
    fn pair(self, input: PairIn<'_>, out: PairOut<'_>) {
        for c in 0..input.width {
            let mut halves = [[0u32; 2]; 2];
            for (t, row) in input.rows.iter().enumerate() {
                let r = 2 * input.pair + t;
                let (p, ds) = match row {
                    Some(row) if row.span.visible(c / LANES * LANES) >> (c % LANES) & 1 == 1 => {
                        let x = input.scores[r * KEY_TILE + c] * input.scale - row.lse;
                        if x < EXP_FLOOR {
                            (0.0, 0.0)
                        } else {
                            let p = exp_weight(if x > 0.0 { 0.0 } else { x });
                            let dp = input.dp[r * KEY_TILE + c];
                            (p, p * (dp - row.delta) * input.scale)
                        }
                    }
                    _ => (0.0, 0.0),
                };
                let (p, ds) = (bf16_of_f32(p), bf16_of_f32(ds));
                halves[0][t] = u32::from(p.to_bits());
                halves[1][t] = u32::from(ds.to_bits());
                out.ds_rows[r * DS_STRIDE + c] = ds;
            }
            let at = c / BLOCK * PANEL + input.pair * BLOCK + c % BLOCK;
            out.weights[at] = halves[0][0] | halves[0][1] << 16;
            out.ds[at] = halves[1][0] | halves[1][1] << 16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl GradientRows for Avx512 {
    fn pair(self, input: PairIn<'_>, out: PairOut<'_>) {
        // SAFETY: an `Avx512` exists only where the CPU has AVX-512F and AVX-512 BF16
        // (`Avx512::detect`), the features the function is compiled for.
        unsafe { pair_avx512(input, out) }
    }
}

/// [`GradientRows::pair`] in 16 lanes: the forward's `e^x` ([`exp_avx512`]), `vcvtneps2bf16`'s
/// rounding (to nearest even, as [`bf16_of_f32`]; it flushes subnormal results to zero), and the two
/// rows' `bf16` interleaved into the panels' pairs by widening and a shift.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn pair_avx512(input: PairIn<'_>, out: PairOut<'_>) {
    use std::arch::x86_64::*;
    let scale = _mm512_set1_ps(input.scale);
    let (floor, zero) = (_mm512_set1_ps(EXP_FLOOR), _mm512_setzero_ps());
    for c in (0..input.width).step_by(LANES) {
        // The rows' `p` and `ds` as `bf16` bits in the low halves of 16 `u32`.
        let mut halves = [[_mm512_setzero_si512(); 2]; 2];
        for (t, row) in input.rows.iter().enumerate() {
            let r = 2 * input.pair + t;
            let ds_row = &mut out.ds_rows[r * DS_STRIDE + c..][..LANES];
            let keep = row.map_or(0, |row| row.span.visible(c));
            let Some(row) = row.filter(|_| keep != 0) else {
                // SAFETY: 32 bytes into a slice of 16 `bf16`.
                unsafe { _mm256_storeu_si256(ds_row.as_mut_ptr().cast(), _mm256_setzero_si256()) };
                continue;
            };
            let (s, dp) = (
                &input.scores[r * KEY_TILE + c..][..LANES],
                &input.dp[r * KEY_TILE + c..][..LANES],
            );
            // SAFETY: 16 floats from slices of 16.
            let (s, dp) = unsafe { (_mm512_loadu_ps(s.as_ptr()), _mm512_loadu_ps(dp.as_ptr())) };
            let x = _mm512_sub_ps(_mm512_mul_ps(s, scale), _mm512_set1_ps(row.lse));
            let keep = keep & !_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor);
            // `vmaxps` and `vminps` return their second operand when one is NaN: NaN stays NaN.
            let p = exp_avx512(_mm512_min_ps(zero, _mm512_max_ps(floor, x)));
            let p = _mm512_maskz_mov_ps(keep, p);
            let g = _mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_set1_ps(row.delta)));
            let ds = _mm512_maskz_mul_ps(keep, g, scale);
            // SAFETY: `__m256bh` and `__m256i` are both 32 bytes, and any bits are valid in either.
            let (p, ds) = unsafe {
                (
                    std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(p)),
                    std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(ds)),
                )
            };
            // SAFETY: 32 bytes into a slice of 16 `bf16`.
            unsafe { _mm256_storeu_si256(ds_row.as_mut_ptr().cast(), ds) };
            halves[0][t] = _mm512_cvtepu16_epi32(p);
            halves[1][t] = _mm512_cvtepu16_epi32(ds);
        }
        let at = c / BLOCK * PANEL + input.pair * BLOCK + c % BLOCK;
        for (panel, [first, second]) in [&mut *out.weights, &mut *out.ds].into_iter().zip(halves) {
            let pairs = _mm512_or_si512(first, _mm512_slli_epi32::<16>(second));
            let dst = &mut panel[at..at + LANES];
            // SAFETY: 64 bytes into a slice of 16 `u32`.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), pairs) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::attention_tiles::tests::values;
    use super::super::bf16_blocks::Vectors;
    use super::super::bf16_tiles::Amx;
    use super::*;

    /// One case: dims `[batch, heads, key heads, queries, keys, width, value width]`.
    struct Case {
        dims: [usize; 7],
        causal: Option<i64>,
        window: Option<usize>,
        key_lengths: Option<Vec<i64>>,
    }

    fn cases() -> Vec<Case> {
        let case = |dims, causal, window, key_lengths| Case {
            dims,
            causal,
            window,
            key_lengths,
        };
        vec![
            // Odd lengths and widths, a bottom-right mask, grouped heads.
            case([2, 2, 1, 70, 150, 16, 24], Some(80), None, None),
            // Two query tiles over one key tile, causal from the top.
            case([1, 4, 2, 130, 130, 64, 64], Some(0), None, None),
            // No mask, a batch with no key at all, widths past one block.
            case([2, 3, 3, 33, 130, 80, 48], None, None, Some(vec![100, 0])),
            // A sliding window across key tiles: rows see keys of two tiles, blocks skipped.
            case([1, 2, 1, 300, 600, 32, 40], Some(300), Some(90), None),
            // Three key tiles, each query row block seeing a different part.
            case([1, 1, 1, 64, 700, 64, 64], Some(636), None, None),
            // Queries that see no key (a causal offset below zero).
            case([1, 1, 1, 40, 40, 8, 8], Some(-10), None, None),
            case([1, 1, 1, 5, 1, 7, 3], None, None, None),
        ]
    }

    /// `[b, h, l, w]` contiguous.
    fn contiguous(data: &[bf16], [b, h, l, w]: [usize; 4]) -> Operand<'_> {
        Operand {
            data,
            dims: [b, h, l, w],
            strides: [h * l * w, l * w, w],
            offset: 0,
        }
    }

    fn widen(x: &[bf16]) -> Vec<f64> {
        x.iter().map(|x| f64::from(x.to_f32())).collect()
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(a, b)| a * b).sum()
    }

    /// The `lse` of every query, in f64 from the `bf16` values, rounded to `f32` (as the forward
    /// stores it): -inf for a query that sees no key.
    fn lse_of(
        math: &Attention,
        [q, k]: [&Operand<'_>; 2],
        key_lengths: Option<&[i64]>,
    ) -> Vec<f32> {
        let [batch, heads, queries, _] = q.dims;
        let mut lse = Vec::new();
        for b in 0..batch {
            let keys = keys_of(key_lengths, b, k.dims[2]);
            for h in 0..heads {
                for i in 0..queries {
                    let qi = widen(q.row((b, h), i));
                    let scores: Vec<f64> = (math.first(i)..math.visible(i, keys))
                        .map(|j| math.scale * dot(&qi, &widen(k.row((b, h / math.group), j))))
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    lse.push(if scores.is_empty() {
                        f32::NEG_INFINITY
                    } else {
                        (max + sum.ln()) as f32
                    });
                }
            }
        }
        lse
    }

    /// Head `(b, h)`'s gradients `[dq, dk, dv]` in f64 from the `bf16` values and `lse`, and the
    /// sums of their terms' magnitudes (what rounding each term to `bf16` can move them by).
    fn reference(
        math: &Attention,
        [q, k, v, out, dout]: [&Operand<'_>; 5],
        lse: &[f32],
        (b, h): (usize, usize),
        keys: usize,
    ) -> [(Vec<f64>, Vec<f64>); 3] {
        let (kh, queries, all_keys) = (h / math.group, q.dims[2], k.dims[2]);
        debug_assert_eq!(lse.len(), queries);
        let (d, dv) = (q.dims[3], v.dims[3]);
        let zeros = |n| (vec![0.0; n], vec![0.0; n]);
        let (mut gq, mut gk, mut gv) = (
            zeros(queries * d),
            zeros(all_keys * d),
            zeros(all_keys * dv),
        );
        for (i, &l) in lse.iter().enumerate() {
            let l = f64::from(l);
            if l == f64::NEG_INFINITY {
                continue;
            }
            let (qi, gi) = (widen(q.row((b, h), i)), widen(dout.row((b, h), i)));
            let delta = dot(&gi, &widen(out.row((b, h), i)));
            for j in math.first(i)..math.visible(i, keys) {
                let (kj, vj) = (widen(k.row((b, kh), j)), widen(v.row((b, kh), j)));
                let p = (math.scale * dot(&qi, &kj) - l).exp();
                let ds = p * (dot(&gi, &vj) - delta) * math.scale;
                for (c, g) in gi.iter().enumerate() {
                    gv.0[j * dv + c] += p * g;
                    gv.1[j * dv + c] += (p * g).abs();
                }
                for c in 0..d {
                    gk.0[j * d + c] += ds * qi[c];
                    gk.1[j * d + c] += (ds * qi[c]).abs();
                    gq.0[i * d + c] += ds * kj[c];
                    gq.1[i * d + c] += (ds * kj[c]).abs();
                }
            }
        }
        [gq, gk, gv]
    }

    /// The gradients on `unit`'s blocks with `rows`' row pass against f64, for every case: each
    /// within 2⁻⁸ of the magnitude of its terms (`p` and `ds` are rounded to `bf16`, 2⁻⁹).
    fn check_against_f64(name: &str, unit: impl BlockUnit, rows: impl GradientRows) {
        for (n, case) in cases().iter().enumerate() {
            let [batch, heads, key_heads, queries, keys, width, dv] = case.dims;
            let math = Attention {
                scale: 1.0 / (width as f64).sqrt(),
                causal: case.causal,
                group: heads / key_heads,
                window: case.window,
            };
            let seed = 5 * n as u64;
            let q_data = values(batch * heads * queries * width, seed + 1);
            let k_data = values(batch * key_heads * keys * width, seed + 2);
            let v_data = values(batch * key_heads * keys * dv, seed + 3);
            let out_data = values(batch * heads * queries * dv, seed + 4);
            let dout_data = values(batch * heads * queries * dv, seed + 5);
            let q = contiguous(&q_data, [batch, heads, queries, width]);
            let k = contiguous(&k_data, [batch, key_heads, keys, width]);
            let v = contiguous(&v_data, [batch, key_heads, keys, dv]);
            let out = contiguous(&out_data, [batch, heads, queries, dv]);
            let dout = contiguous(&dout_data, [batch, heads, queries, dv]);
            let lengths = case.key_lengths.as_deref();
            let lse = lse_of(&math, [&q, &k], lengths);
            let got = head_gradients(unit, rows, &math, [q, k, v, out, dout], &lse, lengths);
            for (bh, got) in got.iter().enumerate() {
                let (b, h) = (bh / heads, bh % heads);
                let lse = &lse[bh * queries..][..queries];
                let keys = keys_of(lengths, b, keys);
                let want = reference(&math, [&q, &k, &v, &out, &dout], lse, (b, h), keys);
                for (g, ((w, magnitude), which)) in
                    got.iter().zip(want.iter().zip(["dq", "dk", "dv"]))
                {
                    assert_eq!(g.len(), w.len(), "{name}, case {n}: {which}'s length");
                    for (e, ((g, w), m)) in g.iter().zip(w).zip(magnitude).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() <= 2f64.powi(-8) * m + 1e-6,
                            "{name}, case {n}, batch {b}, head {h}, {which}[{e}]: {g} vs {w} (terms {m})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_match_f64_on_every_unit() {
        // Every unit this CPU has (valgrind's has neither), with each row pass it has.
        let (amx, vectors) = (Amx::detect(), Vectors::detect());
        #[cfg(target_arch = "x86_64")]
        let vector_rows = Avx512::detect();
        match amx {
            Some(amx) => {
                check_against_f64("amx, portable rows", amx, Portable);
                #[cfg(target_arch = "x86_64")]
                if let Some(rows) = vector_rows {
                    check_against_f64("amx, avx-512 rows", amx, rows);
                }
            }
            None => eprintln!(
                "bf16 attention gradients on AMX tiles: not run (this CPU or kernel has no AMX)"
            ),
        }
        match vectors {
            Some(vectors) => {
                check_against_f64("avx512-bf16, portable rows", vectors, Portable);
                #[cfg(target_arch = "x86_64")]
                if let Some(rows) = vector_rows {
                    check_against_f64("avx512-bf16, avx-512 rows", vectors, rows);
                }
            }
            None => eprintln!(
                "bf16 attention gradients on AVX-512 BF16 vectors: not run (this CPU has no \
                 AVX-512 BF16)"
            ),
        }
    }

    /// The AVX-512 row pass against the portable one on one pair of rows: the same bits in the
    /// panels and `ds`'s rows (NaN for NaN), for masked keys, weights below the floor, a score
    /// above `lse`, a NaN seen, a row that weighs nothing, and stale scores in masked lanes.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_row_pass_matches_the_portable_one() {
        let Some(vector) = Avx512::detect() else {
            eprintln!("the AVX-512 gradient row pass: not run (this CPU has no AVX-512 BF16)");
            return;
        };
        let mut rng = crate::rng::Rng::new(17);
        let mut random = |n: usize, spread: f32| -> Vec<f32> {
            (0..n)
                .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread)
                .collect()
        };
        let mut scores = random(QUERY_TILE * KEY_TILE, 40.0);
        let dp = random(QUERY_TILE * KEY_TILE, 4.0);
        scores[3] = -2000.0; // below the floor
        scores[5] = 60.0; // above the row's lse
        scores[KEY_TILE + 200] = f32::NAN; // masked: must weigh 0
        scores[KEY_TILE + 7] = f32::NAN; // seen
        let width = 224;
        for rows in [
            [
                Some((Span::new(0, 224), 10.0, 0.3)),
                Some((Span::new(5, 190), 12.0, -0.7)),
            ],
            [Some((Span::new(33, 34), 1.0, 0.0)), None],
            [None, None],
        ] {
            let rows = rows.map(|r| r.map(|(span, lse, delta)| RowAt { span, lse, delta }));
            let run = |pass: &dyn Fn(PairIn<'_>, PairOut<'_>)| {
                let mut weights = vec![7u32; KEY_TILE / BLOCK * PANEL];
                let mut ds = vec![7u32; KEY_TILE / BLOCK * PANEL];
                let mut ds_rows = vec![bf16::ONE; QUERY_TILE * DS_STRIDE];
                let input = PairIn {
                    scores: &scores,
                    dp: &dp,
                    pair: 0,
                    rows,
                    scale: 0.5,
                    width,
                };
                let out = PairOut {
                    weights: &mut weights,
                    ds: &mut ds,
                    ds_rows: &mut ds_rows,
                };
                pass(input, out);
                let bits = ds_rows.iter().map(|x| u32::from(x.to_bits()));
                (weights, ds, bits.collect::<Vec<_>>())
            };
            let want = run(&|i, o| Portable.pair(i, o));
            let got = run(&|i, o| vector.pair(i, o));
            // NaNs compare by being NaN: the two roundings may give other payloads.
            let halves = |x: u32| [x & 0xffff, x >> 16];
            let nan = |h: u32| h & 0x7fff > 0x7f80;
            let same = |a: u32, b: u32| {
                (halves(a).into_iter().zip(halves(b))).all(|(a, b)| a == b || nan(a) && nan(b))
            };
            for (part, (w, g)) in [(&want.0, &got.0), (&want.1, &got.1), (&want.2, &got.2)]
                .into_iter()
                .enumerate()
            {
                for (e, (&w, &g)) in w.iter().zip(g).enumerate() {
                    assert!(same(w, g), "part {part}, element {e}: {w:#x} vs {g:#x}");
                }
            }
            // The seen NaN reaches the second row's weights.
            if rows[1].is_some() {
                assert!(nan(want.0[7] >> 16));
            }
        }
    }
}
