//! `bf16` matrix products on the CPU's own bf16 dot products (AVX-512 BF16's `vdpbf16ps`), where
//! the CPU has them: `f32` accumulation, each output rounded once to `bf16`, and no widened copy of
//! either operand (the portable path in `matmul.rs` widens both to `f32` scratch on every call,
//! which made a bf16 product slower than an f32 one).
//!
//! The schedule is the classic one: the left operand is packed once into panels of [`MR`] rows in
//! `k` pairs (`u32` each: the two `bf16` a dot-product lane multiplies); the columns are split into
//! blocks of [`NC`], one rayon task each, which packs its block of the right operand into panels of
//! [`NR`] columns in `k` pairs and runs the `MR × NR` micro-kernel over every row panel with the
//! whole `k` in sixteen `zmm` accumulators. Rows and columns past the matrix are zero padding, as is
//! the second half of an odd `k`'s last pair. Like the instruction, subnormal inputs and results
//! count as zero.

use std::marker::PhantomData;

use rayon::prelude::*;

use crate::dtype::{bf16, bf16_of_f32};

/// Rows per micro-kernel tile.
const MR: usize = 8;
/// Columns per micro-kernel tile: two vectors of 16 `f32` lanes.
const NR: usize = 32;
/// Columns per task (and per packed block of the right operand).
const NC: usize = 256;

/// Proof that this CPU has AVX-512F and AVX-512 BF16: only [`detect`](Self::detect) makes one, and
/// [`matmul`] takes one, so the intrinsics cannot be reached on a CPU without them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bf16Dot {
    _detected: (),
}

impl Bf16Dot {
    /// The proof, where this CPU runs the bf16 dot-product path (the check is cached by `std`).
    pub(super) fn detect() -> Option<Bf16Dot> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
            return Some(Bf16Dot { _detected: () });
        }
        None
    }
}

/// A `bf16` matrix in a slice: element `(r, c)` is `data[r * rows + c * cols]`.
#[derive(Clone, Copy)]
pub(super) struct Matrix<'a> {
    pub(super) data: &'a [bf16],
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl Matrix<'_> {
    #[inline]
    fn at(&self, r: usize, c: usize) -> u16 {
        self.data[r * self.rows + c * self.cols].to_bits()
    }
}

/// `out = a b` (`a` `m×k`, `b` `k×n`, `out` contiguous `m×n`), rounded once per element.
///
/// # Panics
/// When `out` does not hold exactly `m * n` elements (the stores below rely on it), or an operand's
/// slice is too short for its strides (a bounds check of the packing).
pub(super) fn matmul(
    dot: Bf16Dot,
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
) {
    assert_eq!(
        out.len(),
        m * n,
        "bf16 matmul: the output must hold m * n elements"
    );
    if m == 0 || n == 0 {
        return;
    }
    if b.rows == 1 && k.is_multiple_of(2) {
        if m <= FEW_TOKENS {
            return few_tokens(dot, a, b, (m, k, n), out);
        }
        return weight_stationary(dot, a, b, (m, k, n), out);
    }
    let pairs = k.div_ceil(2);
    let panels = m.div_ceil(MR);
    // Left panels: [panel][pair][row], each the u32 of (a[r][2p], a[r][2p + 1]).
    let mut left = vec![0u32; panels * pairs * MR];
    left.par_chunks_mut(pairs * MR)
        .enumerate()
        .for_each(|(panel, packed)| {
            let (r0, rows) = (panel * MR, MR.min(m - panel * MR));
            // Rows along their lines, `k` across them.
            pack_panel(a.data, (a.rows, a.cols), r0..r0 + rows, k, MR, packed);
        });
    let out_rows = OutRows::new(out, n);
    (0..n.div_ceil(NC)).into_par_iter().for_each(|block| {
        let (j0, cols) = (block * NC, NC.min(n - block * NC));
        let col_panels = cols.div_ceil(NR);
        // Right panels: [panel][pair][column], each the u32 of (b[2p][c], b[2p + 1][c]).
        let mut right = vec![0u32; col_panels * pairs * NR];
        for (cp, packed) in right.chunks_mut(pairs * NR).enumerate() {
            let (c0, panel_cols) = (j0 + cp * NR, NR.min(cols - cp * NR));
            // Columns as the lines, `k` down them.
            pack_panel(b.data, (b.cols, b.rows), c0..c0 + panel_cols, k, NR, packed);
        }
        let mut tile = [[0.0f32; NR]; MR];
        for panel in 0..panels {
            let lp = &left[panel * pairs * MR..(panel + 1) * pairs * MR];
            for cp in 0..col_panels {
                let rp = &right[cp * pairs * NR..(cp + 1) * pairs * NR];
                micro_kernel(dot, lp, rp, pairs, &mut tile);
                let (i0, c0) = (panel * MR, j0 + cp * NR);
                let (rows, width) = (MR.min(m - i0), NR.min(j0 + cols - c0));
                for (r, values) in tile.iter().enumerate().take(rows) {
                    out_rows.store(i0 + r, c0, &values[..width]);
                }
            }
        }
    });
}

/// The lines `lines` of an operand, element `i < k` of line `l` at `data[l · line + i · depth]`
/// (`strides` = `(line, depth)`), as a panel `[pair][lane]` in `out` (`lanes` ≥ the lines; lanes
/// past them, and the high half past an odd `k`, are left as they are: zero). Every packing of both
/// products goes through here: lines contiguous along `k` ([`transpose_pairs`]), lines side by side
/// (a transposed operand, or a weight `[k, n]` as stored: [`interleave_pairs`] of two runs), or
/// neither (element by element).
fn pack_panel(
    data: &[bf16],
    (line, depth): (usize, usize),
    lines: std::ops::Range<usize>,
    k: usize,
    lanes: usize,
    out: &mut [u32],
) {
    let (first, count) = (lines.start, lines.len());
    if depth == 1 {
        let rows: Vec<&[bf16]> = lines.map(|l| &data[l * line..][..k]).collect();
        transpose_pairs(&rows, lanes, out);
    } else if line == 1 {
        for (p, dst) in out.chunks_exact_mut(lanes).enumerate() {
            let lo = &data[2 * p * depth + first..][..count];
            let hi = (2 * p + 1 < k).then(|| &data[(2 * p + 1) * depth + first..][..count]);
            interleave_pairs(lo, hi, &mut dst[..count]);
        }
    } else {
        let at = |l: usize, i: usize| u32::from(data[l * line + i * depth].to_bits());
        for (p, dst) in out.chunks_exact_mut(lanes).enumerate() {
            for (d, l) in dst.iter_mut().zip(lines.clone()) {
                let hi = if 2 * p + 1 < k { at(l, 2 * p + 1) } else { 0 };
                *d = at(l, 2 * p) | hi << 16;
            }
        }
    }
}

/// `out[p · lanes + i]` = pair `p` of `rows[i]` (`rows[i][2p]` in the low half, `rows[i][2p + 1]`
/// or 0 past an odd length in the high one), for rows of one length: rows contiguous along `k`
/// become a panel's `[pair][lane]`. Pair by pair, so that the writes run along the panel and the
/// reads advance along every row together (a few cache lines each); row by row, every write went
/// to another cache line, a panel apart.
fn transpose_pairs(rows: &[&[bf16]], lanes: usize, out: &mut [u32]) {
    let Some(len) = rows.first().map(|r| r.len()) else {
        return;
    };
    assert!(rows.len() <= lanes && rows.iter().all(|r| r.len() == len));
    let whole = len / 2;
    for (p, dst) in out.chunks_exact_mut(lanes).take(whole).enumerate() {
        for (d, row) in dst.iter_mut().zip(rows) {
            let pair = &row[2 * p..2 * p + 2];
            *d = u32::from(pair[0].to_bits()) | u32::from(pair[1].to_bits()) << 16;
        }
    }
    if len % 2 == 1 {
        for (d, row) in out[whole * lanes..][..lanes].iter_mut().zip(rows) {
            *d = u32::from(row[len - 1].to_bits());
        }
    }
}

/// `out[i] = lo[i] | hi[i] << 16` (`hi` zero when absent): two runs of `bf16` as a panel's pairs
/// (the layout of both operands' panels).
/// Slices and zipped iterators, so the packing is checked once per run rather than per element.
fn interleave_pairs(lo: &[bf16], hi: Option<&[bf16]>, out: &mut [u32]) {
    match hi {
        Some(hi) => {
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = u32::from(l.to_bits()) | u32::from(h.to_bits()) << 16;
            }
        }
        None => {
            for (o, l) in out.iter_mut().zip(lo) {
                *o = u32::from(l.to_bits());
            }
        }
    }
}

/// Rows of the transposed operand per task of [`weight_stationary`].
const ROWS_PER_TASK: usize = 8 * MR;

/// `out = a b` for a right operand that is contiguous along `k` (a weight `[n, k]` used transposed,
/// as every `Linear` uses its weight) and an even `k`: computed as `outᵀ = bᵀ aᵀ`. The activations
/// `a` are packed once (`m × k`, shared by every task); the weight is read row by row along its unit
/// stride, [`MR`] rows at a time into a panel that stays in L1 and serves every token, instead of
/// being packed whole with a stride of `k` per element. Tasks take [`ROWS_PER_TASK`] weight rows
/// (output columns) each.
fn weight_stationary(
    dot: Bf16Dot,
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
) {
    let pairs = k / 2;
    let token_panels = m.div_ceil(NR);
    // aᵀ as right panels: [panel][pair][token], each the u32 of (a[t][2p], a[t][2p + 1]).
    let mut right = vec![0u32; token_panels * pairs * NR];
    right
        .par_chunks_mut(pairs * NR)
        .enumerate()
        .for_each(|(tp, packed)| {
            let (t0, tokens) = (tp * NR, NR.min(m - tp * NR));
            pack_panel(a.data, (a.rows, a.cols), t0..t0 + tokens, k, NR, packed);
        });
    let out_rows = OutRows::new(out, n);
    (0..n.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let mut tile = [[0.0f32; NR]; MR];
            let mut left = vec![0u32; pairs * MR];
            let mut column = [0.0f32; MR];
            let end = n.min((task + 1) * ROWS_PER_TASK);
            for j0 in (task * ROWS_PER_TASK..end).step_by(MR) {
                let rows = MR.min(n - j0);
                // The weight rows' pairs as the kernel's left panel ([pair][row]); rows past `n` stay 0.
                if rows < MR {
                    left.fill(0);
                }
                pack_panel(b.data, (b.cols, 1), j0..j0 + rows, k, MR, &mut left);
                for tp in 0..token_panels {
                    let rp = &right[tp * pairs * NR..(tp + 1) * pairs * NR];
                    micro_kernel(dot, &left, rp, pairs, &mut tile);
                    for t in 0..NR.min(m - tp * NR) {
                        for (c, row) in column.iter_mut().zip(&tile) {
                            *c = row[t];
                        }
                        out_rows.store(tp * NR + t, j0, &column[..rows]);
                    }
                }
            }
        });
}

/// Tokens up to which [`few_tokens`] computes a product: decoding's batches. Above it, the
/// micro-kernel's `NR`-token panels waste less than they gain.
const FEW_TOKENS: usize = 8;

/// `out = a b` for at most [`FEW_TOKENS`] rows of `a` and a weight `b` contiguous along an even `k`
/// (decoding: one token per sequence). [`weight_stationary`] would pad the tokens to a panel of
/// [`NR`] and compute 32 columns where one is wanted; here each weight row is read once, 32 `bf16`
/// at a time, and multiplied into every token's accumulator, so the product runs at the speed the
/// weight streams from memory.
fn few_tokens(
    dot: Bf16Dot,
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
) {
    let pairs = k / 2;
    // The activations' pairs, [token][pair]; tokens past `m` stay 0 and are never read.
    let mut x = vec![0u32; FEW_TOKENS * pairs];
    for t in 0..m {
        for p in 0..pairs {
            x[t * pairs + p] = u32::from(a.at(t, 2 * p)) | u32::from(a.at(t, 2 * p + 1)) << 16;
        }
    }
    let out_rows = OutRows::new(out, n);
    (0..n.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let (j0, end) = (task * ROWS_PER_TASK, n.min((task + 1) * ROWS_PER_TASK));
            let mut sums = vec![[0.0f32; FEW_TOKENS]; end - j0];
            for (g, group) in sums.chunks_mut(GROUP).enumerate() {
                let first = j0 + g * GROUP;
                // Rows past the task's end repeat its last row; their sums are not kept.
                let rows: [&[bf16]; GROUP] = std::array::from_fn(|r| {
                    let j = (first + r).min(end - 1);
                    &b.data[j * b.cols..j * b.cols + k]
                });
                let all = dot_rows(dot, &x, pairs, m, rows);
                group.copy_from_slice(&all[..group.len()]);
            }
            let mut column = vec![0.0f32; end - j0];
            for t in 0..m {
                for (c, s) in column.iter_mut().zip(&sums) {
                    *c = s[t];
                }
                out_rows.store(t, j0, &column);
            }
        });
}

/// Weight rows [`few_tokens`] walks together: several independent accumulator chains per token.
const GROUP: usize = 4;

/// Every token's dot product with each of [`GROUP`] weight rows of `2 · pairs` `bf16`.
fn dot_rows(
    dot: Bf16Dot,
    x: &[u32],
    pairs: usize,
    m: usize,
    w: [&[bf16]; GROUP],
) -> [[f32; FEW_TOKENS]; GROUP] {
    assert!(
        (1..=FEW_TOKENS).contains(&m)
            && x.len() >= FEW_TOKENS * pairs
            && w.iter().all(|w| w.len() >= 2 * pairs)
    );
    let _ = dot;
    let mut sums = [[0.0f32; FEW_TOKENS]; GROUP];
    // One instantiation per token count and rows per call, so that the accumulators (tokens × rows
    // vectors, at most 16) stay in registers.
    #[cfg(target_arch = "x86_64")]
    macro_rules! call {
        ($t:literal, $r:literal) => {
            for (w, s) in w.chunks_exact($r).zip(sums.chunks_exact_mut($r)) {
                let (w, s) = (w.try_into().expect("R rows"), s.try_into().expect("R rows"));
                // SAFETY: `dot` exists, so `Bf16Dot::detect` found AVX-512F and AVX-512 BF16 on
                // this CPU; the assertion keeps every load inside `x` and `w`.
                unsafe { dot_rows_avx512::<$t, $r>(x, pairs, w, s) }
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    match m {
        1 => call!(1, 4),
        2 => call!(2, 4),
        3 => call!(3, 4),
        4 => call!(4, 4),
        5 => call!(5, 2),
        6 => call!(6, 2),
        7 => call!(7, 2),
        _ => call!(8, 2),
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("a Bf16Dot is only made on x86-64 with AVX-512 BF16");
    #[allow(unreachable_code)]
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn dot_rows_avx512<const T: usize, const R: usize>(
    x: &[u32],
    pairs: usize,
    w: &[&[bf16]; R],
    sums: &mut [[f32; FEW_TOKENS]; R],
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_reduce_add_ps,
        _mm512_setzero_ps,
    };
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let full = pairs / 16 * 16;
    let xp: [*const u32; T] = std::array::from_fn(|t| x[t * pairs..].as_ptr());
    let wp: [*const bf16; R] = std::array::from_fn(|r| w[r].as_ptr());
    for p in (0..full).step_by(16) {
        // SAFETY: `dot_rows` checked that `x` holds `FEW_TOKENS · pairs` pairs and `t < T <= m <=
        // FEW_TOKENS`, and `p + 16 <= pairs`: the 16 pairs at `t · pairs + p` stay inside; `loadu`
        // needs no alignment. The cast rereads 16 pairs as 32 bf16, the layout `vdpbf16ps` reads.
        let tokens: [__m512bh; T] = std::array::from_fn(|t| unsafe {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(xp[t].add(p).cast()))
        });
        for (acc, w) in acc.iter_mut().zip(&wp) {
            // SAFETY: `dot_rows` checked that each row holds `2 · pairs` elements: the 64-byte load
            // of 32 bf16 at `2p` stays inside. As above, 512 bits reread as 32 bf16.
            let weights = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(w.add(2 * p).cast()))
            };
            for (acc, tokens) in acc.iter_mut().zip(&tokens) {
                *acc = _mm512_dpbf16_ps(*acc, *tokens, weights);
            }
        }
    }
    for ((sums, acc), w) in sums.iter_mut().zip(&acc).zip(w) {
        for (t, (sum, acc)) in sums.iter_mut().zip(acc).enumerate() {
            let mut s = _mm512_reduce_add_ps(*acc);
            // The pairs past the last 16: as the instruction does, in f32.
            for p in full..pairs {
                let pair = x[t * pairs + p];
                let widen = |bits: u32| f32::from_bits(bits << 16);
                s += widen(pair & 0xffff) * f32::from(w[2 * p])
                    + widen(pair >> 16) * f32::from(w[2 * p + 1]);
            }
            *sum = s;
        }
    }
}

/// The output, written by the column-block tasks: each task writes only its own columns. It holds
/// the exclusive borrow of the output for `'a`, so it cannot outlive it.
#[derive(Clone, Copy)]
struct OutRows<'a> {
    ptr: *mut bf16,
    len: usize,
    n: usize,
    _out: PhantomData<&'a mut [bf16]>,
}

// SAFETY: the tasks that share an `OutRows` write disjoint columns of it (see `store`), and the
// borrow of the output outlives them (`'a`; `matmul` and `weight_stationary` return after their
// parallel loops).
unsafe impl Send for OutRows<'_> {}
// SAFETY: as above.
unsafe impl Sync for OutRows<'_> {}

impl<'a> OutRows<'a> {
    /// The rows of `n` elements of `out`.
    fn new(out: &'a mut [bf16], n: usize) -> OutRows<'a> {
        OutRows {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            n,
            _out: PhantomData,
        }
    }

    /// Rounds `values` into row `row`, columns `col..col + values.len()`, which must lie inside the
    /// row (checked). The callers give each column block to one task.
    fn store(&self, row: usize, col: usize, values: &[f32]) {
        assert!(
            col + values.len() <= self.n && (row * self.n + col + values.len()) <= self.len,
            "bf16 matmul: a store outside the output"
        );
        // SAFETY: the range is inside the borrowed output (checked above); each column block
        // belongs to one task, so no other thread touches these elements meanwhile.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(row * self.n + col), values.len())
        };
        dst.iter_mut()
            .zip(values)
            .for_each(|(o, &v)| *o = bf16_of_f32(v));
    }
}

/// `tile = left_panel · right_panel` over `pairs` k-pairs (`left` `[pair][row]`, `right`
/// `[pair][column]`, each element a `u32` of two `bf16`).
fn micro_kernel(
    dot: Bf16Dot,
    left: &[u32],
    right: &[u32],
    pairs: usize,
    tile: &mut [[f32; NR]; MR],
) {
    assert!(left.len() >= pairs * MR && right.len() >= pairs * NR);
    let _ = dot;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `dot` exists, so `Bf16Dot::detect` found AVX-512F and AVX-512 BF16 on this CPU; the
    // assertion is the kernel's contract.
    unsafe {
        micro_kernel_avx512(left, right, pairs, tile)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("a Bf16Dot is only made on x86-64 with AVX-512 BF16")
}

/// # Safety
/// The CPU must have AVX-512F and AVX-512 BF16; `left` holds `pairs · MR` elements and `right`
/// `pairs · NR` (the loads below are unchecked: per pair, 16 `vdpbf16ps` and a bounds check per
/// load would be a third of the instructions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_kernel_avx512(
    left: &[u32],
    right: &[u32],
    pairs: usize,
    tile: &mut [[f32; NR]; MR],
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32,
        _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (left, right) = (left.as_ptr(), right.as_ptr());
    for p in 0..pairs {
        // SAFETY: the caller's contract: `right` holds `pairs · NR` pairs, so the two 64-byte
        // loads of 16 pairs at `p · NR` and `p · NR + 16` stay inside; `loadu` needs no alignment.
        // The casts reinterpret 512 bits as 32 bf16, the layout `vdpbf16ps` reads.
        let (b0, b1) = unsafe {
            let at = right.add(p * NR);
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(16).cast())),
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `left` holds `pairs · MR` pairs and `r < MR` (the caller's contract); 512
            // bits of a broadcast pair, reread as 32 bf16.
            let a = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *left.add(p * MR + r) as i32
                ))
            };
            acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
        }
    }
    for (row, acc) in tile.iter_mut().zip(&acc) {
        // SAFETY: each row of the tile holds NR = 32 floats: two 16-float stores.
        unsafe {
            _mm512_storeu_ps(row.as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[1]);
        }
    }
}
