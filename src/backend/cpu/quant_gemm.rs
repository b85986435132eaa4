//! Quantized products for many rows of `x` (a prompt's pass, batched decoding) on AVX-512 VNNI:
//! the weight decoded 16 rows at a time into a panel whose `zmm` lanes are the 16 rows, then every
//! token multiplied into it. Semantics as `quant_product`'s (the same rounded activations, exact
//! integer sums per 16 values, one `f32` scale per 16 values); only the schedule differs.
//!
//! The per-row kernels (`quant_vnni`) put 64 consecutive values of one weight row in a register, so
//! each block's two scales are applied per token and per row: seven instructions per token, row and
//! 64 values. Here a lane holds one row: four `vpdpbusd` (each against 4 bytes of the token
//! broadcast) sum 16 values of 16 rows, and one conversion, multiply and FMA scale all 16 rows — about
//! eleven instructions per token, 16 rows and 16 values, 2.75 per token, row and 64 values. The
//! decoding and interleaving cost once per weight row and call, shared by every token.

use std::arch::x86_64::*;

use super::few_rows::Columns;
use super::quant_product::{Activations, BLOCK, Row, decode_row};
use super::quant_vnni::by_token_chunks;
use crate::quant::QuantType;

/// Weight rows per panel: one per `f32` lane of a `zmm`.
pub(super) const LANES: usize = 16;
/// Values per activation sum (`Activations::sums`).
const HALF: usize = 16;
/// Tokens whose accumulators stay in registers through one panel.
const TOKENS: usize = 8;

/// 16 weight rows decoded and interleaved: for each 4 values `g` of `k`, the rows' 4 levels side by
/// side (64 bytes), and for each `sub` values (the format's scale block: 32, or 16 for Q6_K, Q3_K
/// and Q2_K), per row, `−128 · Σ q` (where the unsigned activations' sums start), the scale, and
/// the offset.
pub(super) struct Panel {
    /// `[k / 4][16]`: each row's 4 levels as one word.
    pub(super) levels: Vec<u32>,
    /// `[k / sub][16]`: `−128 · Σ q` of each row's scale block.
    start: Vec<i32>,
    /// `[k / sub][16]`: each row's scale per scale block.
    pub(super) scale: Vec<f32>,
    /// `[k / sub][16]`: each row's offset per scale block (zero without minimums).
    pub(super) offset: Vec<f32>,
    /// Whether any offset is non-zero.
    pub(super) offsets: bool,
    /// Values per scale block: 32, or 16 for Q6_K, Q3_K and Q2_K.
    pub(super) sub: usize,
}

impl Panel {
    pub(super) fn new(k: usize) -> Panel {
        Panel {
            levels: vec![0; k / 4 * LANES],
            start: vec![0; k / HALF * LANES],
            scale: vec![0.0; k / HALF * LANES],
            offset: vec![0.0; k / HALF * LANES],
            offsets: false,
            sub: HALF,
        }
    }

    /// Fills the panel from `rows` (at most 16) stored rows of `ty`, `row_bytes` each; lanes past
    /// them are zero (their outputs are not kept).
    pub(super) fn fill(&mut self, ty: QuantType, rows: &[u8], row_bytes: usize, row: &mut Row) {
        let k = self.levels.len() / LANES * 4;
        let count = rows.len() / row_bytes;
        assert!(count <= LANES && rows.len() == count * row_bytes && row.q.len() == k);
        self.levels.fill(0);
        self.start.fill(0);
        self.scale.fill(0.0);
        self.offset.fill(0.0);
        self.offsets = false;
        self.sub = match ty {
            QuantType::Q6_K | QuantType::Q3_K | QuantType::Q2_K => HALF,
            _ => 2 * HALF,
        };
        let per = self.sub / HALF;
        for (r, stored) in rows.chunks_exact(row_bytes).enumerate() {
            decode_row(ty, stored, row);
            self.offsets |= row.offsets;
            for (g, four) in row.q.chunks_exact(4).enumerate() {
                self.levels[g * LANES + r] = u32::from_le_bytes([
                    four[0] as u8,
                    four[1] as u8,
                    four[2] as u8,
                    four[3] as u8,
                ]);
            }
            for (b, q) in row.q.chunks_exact(self.sub).enumerate() {
                let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
                // The decoder repeats a 32-value block's scale and offset over its two halves.
                let (scale, offset) = (row.scale[b * per], row.offset[b * per]);
                debug_assert!(
                    row.scale[b * per..(b + 1) * per]
                        .iter()
                        .all(|&s| s == scale)
                        && row.offset[b * per..(b + 1) * per]
                            .iter()
                            .all(|&o| o == offset)
                );
                self.start[b * LANES + r] = -128 * sum;
                self.scale[b * LANES + r] = scale;
                self.offset[b * LANES + r] = offset;
            }
        }
    }
}

/// Column `first + r` of `columns`, row `t` `= x̂_t · ŵ_r` for the panel's first `rows` rows and
/// the tokens `t` in `range` of `a` (`unsigned`: the tokens' levels plus 128).
///
/// # Panics
/// When the operands do not fit (`k` a multiple of 32, `m` tokens of `k` in `a` and `unsigned`,
/// `range` within them, the columns `first..first + rows` in `columns`).
pub(super) fn panel_product(
    panel: &Panel,
    a: &Activations,
    unsigned: &[u8],
    (m, k): (usize, usize),
    range: std::ops::Range<usize>,
    columns: &mut Columns<'_>,
    (first, rows): (usize, usize),
) {
    assert!(
        range.end <= m
            && k.is_multiple_of(BLOCK)
            && panel.levels.len() == k / 4 * LANES
            && a.q.len() >= m * k
            && unsigned.len() >= m * k
            && a.d.len() >= m * k / BLOCK
            && a.sums.len() >= m * k / HALF
            && rows <= LANES
            && first + rows <= columns.len(),
        "quantized panel product: operands do not fit their shape"
    );
    by_token_chunks(range.len(), 8, |t, run| {
        let t0 = range.start + t;
        let mut sums = [[0.0f32; LANES]; TOKENS];
        // SAFETY: `Kernel::Avx512Vnni` (the caller's condition) is detected with AVX-512 F/BW and
        // VNNI; the assertion keeps every read inside the panel and the tokens t0..t0 + run <= m.
        unsafe {
            match (run, panel.sub == HALF) {
                (8, false) => tokens::<8, 8>(panel, a, unsigned, k, t0, &mut sums),
                (4, false) => tokens::<4, 8>(panel, a, unsigned, k, t0, &mut sums),
                (2, false) => tokens::<2, 8>(panel, a, unsigned, k, t0, &mut sums),
                (_, false) => tokens::<1, 8>(panel, a, unsigned, k, t0, &mut sums),
                (8, true) => tokens::<8, 4>(panel, a, unsigned, k, t0, &mut sums),
                (4, true) => tokens::<4, 4>(panel, a, unsigned, k, t0, &mut sums),
                (2, true) => tokens::<2, 4>(panel, a, unsigned, k, t0, &mut sums),
                (_, true) => tokens::<1, 4>(panel, a, unsigned, k, t0, &mut sums),
            }
        }
        for (t, s) in sums.iter().enumerate().take(run) {
            columns.set_run(t0 + t, first, &s[..rows]);
        }
    });
}

/// The panel times tokens `t0..t0 + N` into `sums[..N]`, its scale blocks `4 · GROUPS` values long.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; tokens `t0..t0 + N` lie in `a` and `unsigned`, and the
/// panel holds `k` values per row in blocks of `4 · GROUPS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tokens<const N: usize, const GROUPS: usize>(
    panel: &Panel,
    a: &Activations,
    unsigned: &[u8],
    k: usize,
    t0: usize,
    sums: &mut [[f32; LANES]; TOKENS],
) {
    let sub = 4 * GROUPS;
    let mut acc = [_mm512_setzero_ps(); N];
    let (levels, start) = (panel.levels.as_ptr(), panel.start.as_ptr());
    let (scale, offset) = (panel.scale.as_ptr(), panel.offset.as_ptr());
    for b in 0..k / sub {
        // SAFETY: the caller's contract: block `b` of every array lies in the panel
        // (`k / sub` blocks of 16 lanes, `k / 4` groups of 64 bytes), values `sub · b..sub · (b + 1)`
        // of each token in `unsigned`, and their scales and sums in `a`; `loadu` takes any
        // alignment.
        unsafe {
            let st = _mm512_loadu_si512(start.add(b * LANES).cast());
            let sc = _mm512_loadu_ps(scale.add(b * LANES));
            let w: [__m512i; GROUPS] = std::array::from_fn(|g| {
                _mm512_loadu_si512(levels.add((GROUPS * b + g) * LANES).cast())
            });
            for (t, acc) in acc.iter_mut().enumerate() {
                let token = t0 + t;
                let x = unsigned.as_ptr().add(token * k + b * sub);
                let mut dp = st;
                for (g, &w) in w.iter().enumerate() {
                    let four = i32::from_le_bytes(*x.add(4 * g).cast::<[u8; 4]>());
                    dp = _mm512_dpbusd_epi32(dp, _mm512_set1_epi32(four), w);
                }
                let first = token * k + b * sub;
                let d = _mm512_set1_ps(*a.d.get_unchecked(first / BLOCK));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sc, d), *acc);
                if panel.offsets {
                    let halves = a.sums.as_ptr().add(first / HALF);
                    let sum = if GROUPS == 8 {
                        *halves + *halves.add(1)
                    } else {
                        *halves
                    };
                    let s = _mm512_set1_ps(sum);
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(offset.add(b * LANES)), s, *acc);
                }
            }
        }
    }
    for (sum, acc) in sums.iter_mut().zip(acc) {
        // SAFETY: a row of `sums` holds 16 floats.
        unsafe { _mm512_storeu_ps(sum.as_mut_ptr(), acc) };
    }
}
