//! `bf16` matrix products on the CPU's own bf16 instructions, where the CPU has them: AMX tiles
//! (`TDPBF16PS`, [`super::bf16_tiles`]) for products of more than [`FEW_TOKENS`] rows, AVX-512
//! BF16's `vdpbf16ps` for decoding's few rows and on CPUs without tiles; `f32` accumulation, each
//! output rounded once to `bf16`, and no widened copy of either operand (the portable path in
//! `matmul.rs` widens both to `f32` scratch on every call, which made a bf16 product slower than an
//! f32 one).
//!
//! The vector schedule is the classic one: the left operand is packed once into panels of [`MR`]
//! rows in `k` pairs (`u32` each: the two `bf16` a dot-product lane multiplies); the columns are
//! split into blocks of [`NC`], one rayon task each, which packs its block of the right operand into
//! panels of [`NR`] columns in `k` pairs and runs the `MR × NR` micro-kernel over every row panel
//! with the whole `k` in sixteen `zmm` accumulators. The tile schedule ([`tiled`]) packs the right
//! operand into the same `[pair][column]` panels (the layout a right tile is) and reads the left
//! one as rows along `k` (the layout a left tile is: a `Linear`'s weight as it is stored, anything
//! else packed), 32 × 32 blocks per call. Rows and columns past the matrix are zero padding, as is
//! the second half of an odd `k`'s last pair. Like the instructions, subnormal inputs and results
//! count as zero. On Intel's CPUs without tiles, where `vdpbf16ps` has half the FMAs' rate, the
//! micro-kernel multiplies the same panels with `f32` FMAs instead ([`micro_kernel_fma`], which
//! keeps subnormals).

use std::borrow::Cow;
use std::marker::PhantomData;

use rayon::prelude::*;

use super::bf16_blocks::Vectors;
use super::bf16_tiles::{Amx, BLOCK, STEP_PAIRS, Tiles};
use super::narrow::{Narrow, bf16_rounded};
use super::widen::HalfUnit;
use crate::dtype::bf16;
use crate::fastmath::bf16_bits_of_f32;

/// Rows per micro-kernel tile.
const MR: usize = 8;
/// Columns per micro-kernel tile: two vectors of 16 `f32` lanes.
const NR: usize = 32;
/// Columns per task (and per packed block of the right operand).
const NC: usize = 256;
/// `k` pairs per block of the vector schedule: a task's right panels for a block are `NC · KC`
/// pairs (256 KiB), in L2 beside the left panel's slice (8 KiB, in L1).
const KC: usize = 256;
/// Row panels whose tiles' sums a task keeps between `k` blocks (64 KiB of `f32` per column panel).
const MC_PANELS: usize = 64;

/// The environment variable that caps the bf16 products' kernel below the CPU's best: `amx`,
/// `avx512-bf16` (the dot products without tiles), `avx512-fma` (the vector schedule's `f32`
/// multiply-adds, Intel's choice without tiles) or `portable` (`f32` products of widened copies),
/// to compare the paths on one machine. A kernel the CPU lacks is never chosen; an
/// unknown value is reported once on standard error and ignored.
pub(crate) const KERNEL_VARIABLE: &str = "NDSCOPE_BF16_KERNEL";

/// Proof that this CPU has AVX-512F and AVX-512 BF16 (and, with `tiles`, AMX): only
/// [`detect`](Self::detect) makes one, and [`matmul`] takes one, so the instructions cannot be
/// reached on a CPU without them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bf16Dot {
    /// AMX, for the products of more than [`FEW_TOKENS`] rows.
    tiles: Option<Amx>,
    /// Without tiles, whether the micro-kernel multiplies with `f32`'s fused multiply-adds on
    /// pairs widened in registers ([`micro_kernel_fma`]) rather than with `vdpbf16ps`: on Intel's
    /// cores `vdpbf16ps` retires one every two cycles, half the multiply-adds per cycle of the two
    /// FMA units (measured on one Emerald Rapids core: 84 GFLOP/s against 169). Decoding's few rows
    /// ([`few_tokens`]), bound by the weight's reads, keep `vdpbf16ps` everywhere.
    fma: bool,
}

impl Bf16Dot {
    /// The proof, where this CPU runs a bf16 path and [`KERNEL_VARIABLE`] does not ask for the
    /// portable one (read and checked once).
    pub(super) fn detect() -> Option<Bf16Dot> {
        static CHOSEN: std::sync::OnceLock<Option<Bf16Dot>> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Bf16Dot::best();
            match std::env::var(KERNEL_VARIABLE)
                .ok()
                .as_deref()
                .map(str::trim)
            {
                None | Some("" | "amx") => best,
                Some("avx512-bf16") => best.map(|_| Bf16Dot {
                    tiles: None,
                    fma: false,
                }),
                Some("avx512-fma") => best.map(|_| Bf16Dot {
                    tiles: None,
                    fma: true,
                }),
                Some("portable") => None,
                Some(other) => {
                    eprintln!(
                        "ndscope: {KERNEL_VARIABLE}={other:?} is not a bf16 kernel (amx, \
                         avx512-bf16, avx512-fma, portable); using the CPU's best"
                    );
                    best
                }
            }
        })
    }

    /// The tiles, where this path has them (for the other `bf16` kernels that run on tiles).
    pub(super) fn tiles(self) -> Option<Amx> {
        self.tiles
    }

    /// The vector blocks of `bf16` products, where this path multiplies with `vdpbf16ps` (on
    /// Intel's cores without tiles, where the `f32` FMAs are faster, the attention stays in `f32`).
    pub(super) fn vectors(self) -> Option<Vectors> {
        if self.fma { None } else { Vectors::detect() }
    }

    /// The best path this CPU runs.
    fn best() -> Option<Bf16Dot> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
            return Some(Bf16Dot {
                tiles: Amx::detect(),
                fma: super::cpu_vendor() == *b"GenuineIntel",
            });
        }
        None
    }

    /// Every path this CPU runs, named: the dot products, and the tiles where it has them.
    #[cfg(test)]
    fn paths() -> Vec<(&'static str, Bf16Dot)> {
        let Some(best) = Bf16Dot::best() else {
            return Vec::new();
        };
        let mut paths = vec![
            (
                "avx512-bf16",
                Bf16Dot {
                    tiles: None,
                    fma: false,
                },
            ),
            (
                "avx512-fma",
                Bf16Dot {
                    tiles: None,
                    fma: true,
                },
            ),
        ];
        if best.tiles.is_some() {
            paths.push(("amx", best));
        }
        paths
    }
}

/// An element the products pack as `bf16` pairs: a `bf16` as it is; an `f32` rounded to nearest,
/// ties to even, as it is packed ([`bf16_bits_of_f32`], the rounding of every cast to `bf16`, so a
/// product of an `f32` operand has the bits of the product of its rounded copy). Autocast's
/// products read an `f32` weight this way: rounding it first wrote a `bf16` copy of every weight
/// each step and read it back to pack it (a quarter of GPT-2 small's autocast forward at 128 tokens
/// on a Zen 4).
pub(super) trait Packed: Copy + Send + Sync {
    /// Whether the packing of a weight reads ahead: a `[k, n]` weight pair by pair across a task's
    /// panels ([`pack_across`]), a weight contiguous along `k` with the next panel's lines
    /// prefetched ([`pack_panel`]). Measured for `f32` weights, which are read from memory; the
    /// `bf16` packing is as it was measured before.
    const READ_AHEAD: bool;

    /// The element's `bf16` bits.
    fn bits(self) -> u16;

    /// A run of elements as `bf16`: the run itself, or a rounded copy.
    fn as_bf16(run: &[Self]) -> Cow<'_, [bf16]>;

    /// [`pack_panel`] of elements of this type (its portable body by default).
    fn pack_panel(
        data: &[Self],
        strides: (usize, usize),
        lines: std::ops::Range<usize>,
        k: usize,
        lanes: usize,
        out: &mut [u32],
    ) {
        pack_panel_of(data, strides, lines, k, lanes, out);
    }

    /// [`transpose_pairs`] of elements of this type.
    fn transpose_pairs(rows: &[&[Self]], lanes: usize, out: &mut [u32]);

    /// [`pack_across`] of elements of this type (its portable body by default).
    fn pack_across(
        data: &[Self],
        stride: usize,
        columns: std::ops::Range<usize>,
        k: usize,
        out: &mut [u32],
    ) {
        pack_across(data, stride, columns, k, out);
    }
}

impl Packed for bf16 {
    const READ_AHEAD: bool = false;

    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }

    fn as_bf16(run: &[bf16]) -> Cow<'_, [bf16]> {
        Cow::Borrowed(run)
    }

    #[inline(always)]
    fn transpose_pairs(rows: &[&[bf16]], lanes: usize, out: &mut [u32]) {
        transpose_pairs(rows, lanes, out);
    }
}

impl Packed for f32 {
    const READ_AHEAD: bool = true;

    #[inline(always)]
    fn bits(self) -> u16 {
        bf16_bits_of_f32(self)
    }

    fn as_bf16(run: &[f32]) -> Cow<'_, [bf16]> {
        let mut rounded = vec![bf16::ZERO; run.len()];
        bf16::narrow(run, &mut rounded);
        Cow::Owned(rounded)
    }

    fn pack_panel(
        data: &[f32],
        strides: (usize, usize),
        lines: std::ops::Range<usize>,
        k: usize,
        lanes: usize,
        out: &mut [u32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if HalfUnit::detect() == HalfUnit::Avx512 {
            // SAFETY: the CPU has AVX-512 F and BW, all the function is compiled for.
            unsafe { pack_f32_avx512(data, strides, lines, k, lanes, out) };
            return;
        }
        pack_panel_of(data, strides, lines, k, lanes, out);
    }

    fn pack_across(
        data: &[f32],
        stride: usize,
        columns: std::ops::Range<usize>,
        k: usize,
        out: &mut [u32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if HalfUnit::detect() == HalfUnit::Avx512 {
            // SAFETY: the CPU has AVX-512 F and BW, all the function is compiled for.
            unsafe { pack_across_f32_avx512(data, stride, columns, k, out) };
            return;
        }
        pack_across(data, stride, columns, k, out);
    }

    /// Rows rounded [`ROUND_RUN`] elements at a time into a buffer on the stack, in vector
    /// registers ([`bf16_rounded`]), then paired as `bf16` rows are: rounding pair by pair across
    /// the rows does not vectorise.
    #[inline(always)]
    fn transpose_pairs(rows: &[&[f32]], lanes: usize, out: &mut [u32]) {
        let Some(len) = rows.first().map(|r| r.len()) else {
            return;
        };
        assert!(
            rows.len() <= MAX_LANES,
            "bf16 packing: at most 32 lines a panel"
        );
        let mut rounded = [bf16::ZERO; MAX_LANES * ROUND_RUN];
        for start in (0..len).step_by(ROUND_RUN) {
            let run = ROUND_RUN.min(len - start);
            for (row, into) in rows.iter().zip(rounded.chunks_exact_mut(ROUND_RUN)) {
                bf16_rounded(&row[start..start + run], &mut into[..run]);
            }
            let runs: [&[bf16]; MAX_LANES] =
                std::array::from_fn(|i| &rounded[i * ROUND_RUN..i * ROUND_RUN + run]);
            transpose_pairs(&runs[..rows.len()], lanes, &mut out[start / 2 * lanes..]);
        }
    }
}

/// [`pack_across`] of `f32` compiled for AVX-512, as [`pack_f32_avx512`].
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_across_f32_avx512(
    data: &[f32],
    stride: usize,
    columns: std::ops::Range<usize>,
    k: usize,
    out: &mut [u32],
) {
    pack_across(data, stride, columns, k, out);
}

/// The most lines a panel packs: [`NR`], and the tiles' [`BLOCK`].
const MAX_LANES: usize = 32;
/// Elements of each row [`f32`'s `transpose_pairs`](Packed::transpose_pairs) rounds at a time
/// (even, so that pairs do not straddle two runs): 16 KiB of `bf16` for 32 rows.
const ROUND_RUN: usize = 256;

/// [`pack_panel`] of `f32` compiled for AVX-512, where the rounding of [`bf16_bits_of_f32`] runs
/// sixteen lanes wide.
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_f32_avx512(
    data: &[f32],
    strides: (usize, usize),
    lines: std::ops::Range<usize>,
    k: usize,
    lanes: usize,
    out: &mut [u32],
) {
    pack_panel_of(data, strides, lines, k, lanes, out);
}

/// A matrix in a slice (`bf16`, or `f32` rounded as it is packed): element `(r, c)` is
/// `data[r * rows + c * cols]`.
pub(super) struct Matrix<'a, E = bf16> {
    pub(super) data: &'a [E],
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl<E> Clone for Matrix<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Matrix<'_, E> {}

impl<'a, E: Packed> Matrix<'a, E> {
    /// The transpose: the same elements, rows and columns swapped.
    fn transposed(self) -> Matrix<'a, E> {
        Matrix {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
        }
    }

    /// The `k × n` matrix in `bf16`, for the paths that read `bf16` in place (a few tokens' weight
    /// rows, the tiles' left rows): borrowed, or the span it covers rounded.
    fn as_bf16(self, (k, n): (usize, usize)) -> (Cow<'a, [bf16]>, (usize, usize)) {
        let span = (k - 1) * self.rows + (n - 1) * self.cols + 1;
        (E::as_bf16(&self.data[..span]), (self.rows, self.cols))
    }
}

impl Matrix<'_> {
    #[inline]
    fn at(&self, r: usize, c: usize) -> u16 {
        self.at_value(r, c).to_bits()
    }

    #[inline]
    fn at_value(&self, r: usize, c: usize) -> bf16 {
        self.data[r * self.rows + c * self.cols]
    }
}

/// `out = a b` (`a` `m×k`, `b` `k×n`, `out` contiguous `m×n`), rounded once per element; an `f32`
/// `b` is rounded to `bf16` as it is packed (the same bits as the product of its rounded copy).
///
/// # Panics
/// When `out` does not hold exactly `m * n` elements (the stores below rely on it), or an operand's
/// slice is too short for its strides (a bounds check of the packing).
pub(super) fn matmul<E: Packed>(
    dot: Bf16Dot,
    a: Matrix<'_>,
    b: Matrix<'_, E>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
    scratch: Option<Scratch<'_>>,
) {
    assert_eq!(
        out.len(),
        m * n,
        "bf16 matmul: the output must hold m * n elements"
    );
    if m == 0 || n == 0 || k == 0 {
        out.fill(bf16::ZERO);
        return;
    }
    // The paths that read `b` in place as `bf16` (decoding's weight rows, the tiles' left rows)
    // take an `f32` one rounded first.
    let few = b.rows == 1 && k.is_multiple_of(2) && m <= FEW_TOKENS;
    if few || dot.tiles.is_some() {
        let (data, (rows, cols)) = b.as_bf16((k, n));
        let b = Matrix {
            data: &data,
            rows,
            cols,
        };
        return match dot.tiles {
            Some(amx) if !few => tiled(amx, a, b, (m, k, n), out, scratch),
            _ => few_tokens(dot, a, b, (m, k, n), out),
        };
    }
    if b.rows == 1 && k.is_multiple_of(2) {
        return weight_stationary(dot, a, b, (m, k, n), out, scratch);
    }
    let pairs = k.div_ceil(2);
    let panels = m.div_ceil(MR);
    // Left panels: [panel][pair][row], each the u32 of (a[r][2p], a[r][2p + 1]).
    let mut own = Vec::new();
    let left = panels_in(scratch, panels * pairs * MR, &mut own);
    left.par_chunks_mut(pairs * MR)
        .enumerate()
        .for_each(|(panel, packed)| {
            let (r0, rows) = (panel * MR, MR.min(m - panel * MR));
            // Rows along their lines, `k` across them. Lanes past `m` keep what scratch held:
            // they reach only tile rows that are never stored.
            pack_panel(a.data, (a.rows, a.cols), r0..r0 + rows, k, MR, packed);
        });
    let out_rows = OutRows::new(out, n);
    // `k` in blocks of at most KC pairs: a task's right panels for one block stay in L2, however
    // deep the product (the tied head's `dY · W` is 128,256 deep: its panels were 65 MB a task).
    let kc = KC.min(pairs);
    let k_blocks = pairs.div_ceil(kc);
    let nc = column_block(n, rayon::current_num_threads());
    (0..n.div_ceil(nc)).into_par_iter().for_each(|block| {
        let (j0, cols) = (block * nc, nc.min(n - block * nc));
        let col_panels = cols.div_ceil(NR);
        // This thread's buffers, taken for the task and put back after it.
        let mut task = VECTOR_TASK.take();
        let TaskPanels { right, sums } = &mut task;
        // Right panels of one `k` block: [panel][pair][column], each the u32 of
        // (b[2p][c], b[2p + 1][c]). Reused, not zeroed: every pair a stored tile reads is packed
        // first.
        if right.len() < col_panels * kc * NR {
            right.resize(col_panels * kc * NR, 0);
        }
        let right = &mut right[..col_panels * kc * NR];
        // The block of `np` pairs from pair `p0`.
        let pack_right = |right: &mut [u32], p0: usize, np: usize| {
            let depth = (2 * np).min(k - 2 * p0);
            if E::READ_AHEAD && b.cols == 1 {
                // Columns side by side along memory: every pair's rows read once, across the panels.
                let data = &b.data[2 * p0 * b.rows..];
                return E::pack_across(data, b.rows, j0..j0 + cols, depth, right);
            }
            for (cp, packed) in right.chunks_mut(np * NR).take(col_panels).enumerate() {
                let (c0, panel_cols) = (j0 + cp * NR, NR.min(cols - cp * NR));
                // Columns as the lines, `k` down them, from pair `p0`. Lanes past the columns
                // keep what the previous block left there: they reach only tile columns that are
                // never stored.
                let data = &b.data[2 * p0 * b.rows..];
                pack_panel(
                    data,
                    (b.cols, b.rows),
                    c0..c0 + panel_cols,
                    depth,
                    NR,
                    packed,
                );
            }
        };
        let mut tile = [[0.0f32; NR]; MR];
        let mut wide = vec![0.0f32; if dot.fma { 2 * kc * MR } else { 0 }];
        // Deeper products keep each tile's sums between blocks, for MC_PANELS row panels at a time
        // (reused, not zeroed: a tile's first block starts from zero sums).
        let kept = if k_blocks > 1 {
            MC_PANELS.min(panels) * col_panels
        } else {
            0
        };
        if sums.len() < kept {
            sums.resize(kept, [[0.0f32; NR]; MR]);
        }
        for first in (0..panels).step_by(MC_PANELS) {
            let panel_range = first..panels.min(first + MC_PANELS);
            for k_block in 0..k_blocks {
                let (p0, np) = (k_block * kc, kc.min(pairs - k_block * kc));
                // A single block is packed once for every group of row panels.
                if k_blocks > 1 || first == 0 {
                    pack_right(right, p0, np);
                }
                let last = k_block + 1 == k_blocks;
                for panel in panel_range.clone() {
                    let lp = &left[(panel * pairs + p0) * MR..(panel * pairs + p0 + np) * MR];
                    if dot.fma {
                        widen_left(lp, np, &mut wide);
                    }
                    for cp in 0..col_panels {
                        let rp = &right[cp * np * NR..(cp + 1) * np * NR];
                        let tile = if k_blocks == 1 {
                            &mut tile
                        } else {
                            &mut sums[(panel - first) * col_panels + cp]
                        };
                        micro_kernel(dot, lp, &wide, rp, np, k_block > 0, tile);
                        if last {
                            let (i0, c0) = (panel * MR, j0 + cp * NR);
                            let (rows, width) = (MR.min(m - i0), NR.min(j0 + cols - c0));
                            out_rows.store_tile(tile, (rows, width), (i0, c0), Placement::Rows);
                        }
                    }
                }
            }
        }
        VECTOR_TASK.set(task);
    });
}

thread_local! {
    /// The right panels (256 KiB) and kept sums (up to 512 KiB) of a task of [`matmul`]'s vector
    /// schedule, kept by each thread: allocated and zeroed per task, they were 3 % of GPT-2 small's
    /// bf16 autocast forward at 128 tokens on a Zen 4 (`memset`). Bounded by [`NC`], [`KC`] and
    /// [`MC_PANELS`], whatever the product.
    static VECTOR_TASK: std::cell::Cell<TaskPanels> = const {
        std::cell::Cell::new(TaskPanels {
            right: Vec::new(),
            sums: Vec::new(),
        })
    };
}

/// What a task of the vector schedule packs and accumulates into ([`VECTOR_TASK`]).
#[derive(Default)]
struct TaskPanels {
    /// Right panels of one `k` block.
    right: Vec<u32>,
    /// Tiles' sums kept between `k` blocks.
    sums: Vec<[[f32; NR]; MR]>,
}

/// The columns per task of the vector schedule for `n` columns on `threads` threads: of the
/// multiples of [`NR`] from [`NC`] down to half of it, the one whose tasks end soonest when the
/// threads take them in rounds (the largest among equals: longer runs of each weight row to pack).
/// With `NC` always, a product of 768 columns was 3 tasks on 2 threads and a third of its time
/// one thread's alone (GPT-2's projections: a third of its layers' products); 192 makes 4.
fn column_block(n: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    // The columns of the thread that takes the most blocks (all of them, when there is one).
    let rounds_of = |nc: usize| (n.div_ceil(nc).div_ceil(threads) * nc).min(n);
    (NC / 2..=NC)
        .rev()
        .step_by(NR)
        .min_by_key(|&nc| rounds_of(nc))
        .unwrap_or(NC)
}

/// Memory a product packs its operands into, from the caller: `rows` (`bf16`: the tile schedule's
/// left rows) and `panels` (`u32` pairs: the tile schedule's right panels, the vector schedule's
/// left panels, the weight-stationary schedule's token panels), each at least [`Scratch::lens`]
/// long. Its contents on entry do not matter (every element the product reads into a stored result
/// is written first, padding included). A product without it allocates its own, which for a
/// weight-sized operand is fresh pages from the kernel on every call: the bf16 GPT-2 step spent
/// about a tenth of its time in page faults that way, and the Llama-1B head's backward products
/// fault in 65 MB each.
pub(super) struct Scratch<'a> {
    pub(super) rows: &'a mut [bf16],
    pub(super) panels: &'a mut [u32],
}

impl Scratch<'_> {
    /// The lengths `(rows, panels)` [`matmul`] packs into for `a b` (`(m, k, n)`; the left operand
    /// is packed whatever its strides, so only `b`'s count), or `None` when it packs nothing there
    /// (a few tokens: the weight is read in place, the tokens' pairs are a few KiB).
    pub(super) fn lens<E: Packed>(
        dot: Bf16Dot,
        b: Matrix<'_, E>,
        (m, k, n): (usize, usize, usize),
    ) -> Option<(usize, usize)> {
        if m == 0 || n == 0 || k == 0 {
            return None;
        }
        if b.rows == 1 && k.is_multiple_of(2) && m <= FEW_TOKENS {
            return None;
        }
        if dot.tiles.is_some() {
            return Some(tiled_lens(b, (m, k, n)));
        }
        if b.rows == 1 && k.is_multiple_of(2) {
            // [`weight_stationary`]'s token panels.
            return Some((0, m.div_ceil(NR) * (k / 2) * NR));
        }
        // The vector schedule's left panels.
        Some((0, m.div_ceil(MR) * k.div_ceil(2) * MR))
    }
}

/// The first `len` of the scratch's `u32` panels, or of `own` (allocated here) without scratch or
/// with too little.
fn panels_in<'a>(scratch: Option<Scratch<'a>>, len: usize, own: &'a mut Vec<u32>) -> &'a mut [u32] {
    match scratch {
        Some(s) if s.panels.len() >= len => &mut s.panels[..len],
        _ => {
            *own = vec![0u32; len];
            own
        }
    }
}

/// [`Scratch::lens`] of a product that [`tiled`] computes.
fn tiled_lens<E: Packed>(b: Matrix<'_, E>, (m, k, n): (usize, usize, usize)) -> (usize, usize) {
    let (depth, panel_len) = tiled_depth(k);
    if b.rows == 1 && k == depth {
        // The weight read in place as the left rows; the tokens packed as right panels.
        (0, m.div_ceil(BLOCK) * panel_len)
    } else {
        (
            LeftRows::packed_len(m, depth),
            n.div_ceil(BLOCK) * panel_len,
        )
    }
}

/// `k` padded to whole steps of [`tiled`] (`depth`), and the `u32` length of one right panel of
/// 32 columns over it.
fn tiled_depth(k: usize) -> (usize, usize) {
    let steps = k.div_ceil(2 * STEP_PAIRS);
    (steps * 2 * STEP_PAIRS, steps * STEP_PAIRS * BLOCK)
}

/// Steps of `k` (32 each) per chunk of [`tiled`]: 32 rows of a chunk are 16 KiB, a third of L1.
const CHUNK_STEPS: usize = 8;

/// Right panels of 32 columns per task of [`tiled`]: 256 columns.
const TILE_TASK_PANELS: usize = 8;
/// Blocks of 32 left rows per task of [`tiled`] at most: each chunk of the task's panels (8 × 16 KiB)
/// is read from L2 by every block, instead of from L3 by one (measured: a 1,024³ product went from
/// 400 to 450-460 GFLOP/s on two cores of the AMX machine).
const TILE_TASK_BLOCKS: usize = 4;

/// `out = a b` on AMX tiles, in 32 × 32 blocks. The right operand is packed into `[pair][column]`
/// panels of 32 columns with `k` padded to whole steps of 32 (the padding zero); the left one is read
/// as rows along `k`. A `Linear`'s product (the weight `[n, k]` used transposed, `k` in whole steps)
/// is computed as `outᵀ = bᵀ aᵀ`: the weight's rows are the left tiles as they are stored (only a
/// last partial block of rows is copied), the activations the packed panels. Anything else packs
/// `a`'s rows, padded. Tasks take up to [`TILE_TASK_BLOCKS`] blocks of rows and
/// [`TILE_TASK_PANELS`] panels of columns.
fn tiled(
    amx: Amx,
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
    scratch: Option<Scratch<'_>>,
) {
    let (depth, _) = tiled_depth(k);
    let out_rows = OutRows::new(out, n);
    let (left_len, right_len) = tiled_lens(b, (m, k, n));
    let mut own: (Vec<bf16>, Vec<u32>);
    let scratch = match scratch {
        Some(s) if s.rows.len() >= left_len && s.panels.len() >= right_len => s,
        _ => {
            own = (vec![bf16::ZERO; left_len], vec![0u32; right_len]);
            Scratch {
                rows: &mut own.0,
                panels: &mut own.1,
            }
        }
    };
    let right = &mut scratch.panels[..right_len];
    if b.rows == 1 && k == depth {
        // Rows of the product: the weight's n rows; columns: the m tokens.
        let left = LeftRows::in_place(b.data, b.cols, n, depth);
        tiled_blocks(
            amx,
            &left,
            a.transposed(),
            (n, k, m),
            right,
            |r0, c0, sums| {
                let (rows, width) = (BLOCK.min(n - r0), BLOCK.min(m - c0));
                out_rows.store_tile(sums, (rows, width), (c0, r0), Placement::Transposed);
            },
        );
    } else {
        let left = LeftRows::packed(a, m, k, depth, &mut scratch.rows[..left_len]);
        tiled_blocks(amx, &left, b, (m, k, n), right, |r0, c0, sums| {
            let (rows, width) = (BLOCK.min(m - r0), BLOCK.min(n - c0));
            out_rows.store_tile(sums, (rows, width), (r0, c0), Placement::Rows);
        });
    }
}

/// The 32 × 32 blocks of `left · right` (`rows × k` by `k × cols`), each handed to `store` with its
/// first row and column (`store` clips the blocks at the matrix's edges).
fn tiled_blocks(
    amx: Amx,
    left: &LeftRows<'_>,
    right: Matrix<'_>,
    (rows, k, cols): (usize, usize, usize),
    packed: &mut [u32],
    store: impl Fn(usize, usize, &[[f32; BLOCK]; BLOCK]) + Sync,
) {
    let pairs = k.div_ceil(2);
    let steps = pairs.div_ceil(STEP_PAIRS);
    let (_, panel_len) = tiled_depth(k);
    let col_panels = cols.div_ceil(BLOCK);
    // Right panels: [panel][pair][column], the pairs past `k` and the columns past `cols` zero.
    assert_eq!(
        packed.len(),
        col_panels * panel_len,
        "bf16 tiles: right panels' length"
    );
    packed
        .par_chunks_mut(panel_len)
        .enumerate()
        .for_each(|(cp, panel)| {
            let (c0, width) = (cp * BLOCK, BLOCK.min(cols - cp * BLOCK));
            let (lines, padding) = panel.split_at_mut(pairs * BLOCK);
            padding.fill(0);
            if width < BLOCK {
                lines.fill(0);
            }
            pack_panel(
                right.data,
                (right.cols, right.rows),
                c0..c0 + width,
                k,
                BLOCK,
                lines,
            );
        });
    let (row_blocks, groups) = (rows.div_ceil(BLOCK), col_panels.div_ceil(TILE_TASK_PANELS));
    // Blocks of rows per task: up to TILE_TASK_BLOCKS, fewer where that would leave a thread
    // fewer than four tasks to balance with.
    let per_task =
        (row_blocks * groups / (4 * rayon::current_num_threads())).clamp(1, TILE_TASK_BLOCKS);
    (0..row_blocks.div_ceil(per_task) * groups)
        .into_par_iter()
        .for_each(|task| {
            let (first, group) = (task / groups * per_task, task % groups);
            let blocks = first..row_blocks.min(first + per_task);
            let panels = group * TILE_TASK_PANELS..col_panels.min((group + 1) * TILE_TASK_PANELS);
            let mut tiles = Tiles::configure(amx);
            SUMS.with_borrow_mut(|sums| {
                // Reused, not zeroed: the first chunk of every block starts its sums from zero tiles.
                if sums.len() < blocks.len() * panels.len() {
                    sums.resize(blocks.len() * panels.len(), [[0.0; BLOCK]; BLOCK]);
                }
                let sums = &mut sums[..blocks.len() * panels.len()];
                // `k` in chunks: a chunk of each block of rows stays in L1 while it meets every panel,
                // and the panels' chunks in L2 while every block meets them.
                for s0 in (0..steps).step_by(CHUNK_STEPS) {
                    let chunk = CHUNK_STEPS.min(steps - s0);
                    for (block, sums) in blocks.clone().zip(sums.chunks_exact_mut(panels.len())) {
                        let (a, stride) = left.block(block);
                        for (sums, cp) in sums.iter_mut().zip(panels.clone()) {
                            let right = &packed[cp * panel_len + s0 * STEP_PAIRS * BLOCK..];
                            tiles.block(
                                &a[s0 * 2 * STEP_PAIRS..],
                                stride,
                                right,
                                chunk,
                                s0 > 0,
                                sums,
                            );
                        }
                    }
                }
                for (block, sums) in blocks.zip(sums.chunks_exact(panels.len())) {
                    for (sums, cp) in sums.iter().zip(panels.clone()) {
                        store(block * BLOCK, cp * BLOCK, sums);
                    }
                }
            });
        });
}

thread_local! {
    /// The 32 × 32 blocks of sums a task of [`tiled_blocks`] accumulates (up to 128 KiB), kept by
    /// each thread: allocating and zeroing them per task was 3-4 % of the Llama-1B-shaped bf16
    /// forward on the AMX machine.
    static SUMS: std::cell::RefCell<Vec<[[f32; BLOCK]; BLOCK]>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The left operand of [`tiled_blocks`]: rows along `k`, `stride` elements apart, read in blocks of
/// 32 rows; `tail` holds the last block's 32 rows, padded, one after another (empty when the rows
/// fill their blocks).
struct LeftRows<'a> {
    data: &'a [bf16],
    stride: usize,
    whole_blocks: usize,
    tail: Vec<bf16>,
}

impl<'a> LeftRows<'a> {
    /// Rows `0..rows` of `data`, `stride` apart, each with `depth` elements (whole steps): read where
    /// they are, but for a last partial block, copied.
    fn in_place(data: &'a [bf16], stride: usize, rows: usize, depth: usize) -> LeftRows<'a> {
        let whole_blocks = rows / BLOCK;
        let mut tail = Vec::new();
        if !rows.is_multiple_of(BLOCK) {
            tail = vec![bf16::ZERO; BLOCK * depth];
            for (r, dst) in (whole_blocks * BLOCK..rows).zip(tail.chunks_exact_mut(depth)) {
                dst.copy_from_slice(&data[r * stride..][..depth]);
            }
        }
        LeftRows {
            data,
            stride,
            whole_blocks,
            tail,
        }
    }

    /// The `m` rows of `a` (`k` long), packed with zero padding in whole blocks, rows `depth` and
    /// one cache line apart: at a stride of a power of two's cache lines, a tile's 16 rows fell
    /// into two of L1's 64 sets and evicted each other (a 1,024-deep block ran 13 % slower).
    fn packed(
        a: Matrix<'_>,
        m: usize,
        k: usize,
        depth: usize,
        data: &'a mut [bf16],
    ) -> LeftRows<'a> {
        let (blocks, stride) = (m.div_ceil(BLOCK), depth + 2 * STEP_PAIRS);
        assert_eq!(
            data.len(),
            Self::packed_len(m, depth),
            "bf16 tiles: left rows' length"
        );
        data.par_chunks_mut(BLOCK * stride)
            .enumerate()
            .for_each(|(block, packed)| {
                let (r0, count) = (block * BLOCK, BLOCK.min(m - block * BLOCK));
                // Padding past `k` and rows past `m` zero; the rows' `k` elements written below.
                for row in packed.chunks_exact_mut(stride).take(count) {
                    row[k..].fill(bf16::ZERO);
                }
                packed[count * stride..].fill(bf16::ZERO);
                pack_rows(a, r0..r0 + count, k, stride, packed);
            });
        LeftRows {
            data,
            stride,
            whole_blocks: blocks,
            tail: Vec::new(),
        }
    }

    /// The length [`packed`](Self::packed) packs `m` rows of `depth` into.
    fn packed_len(m: usize, depth: usize) -> usize {
        m.div_ceil(BLOCK) * BLOCK * (depth + 2 * STEP_PAIRS)
    }

    /// Block `block`'s first row onwards and its row stride.
    fn block(&self, block: usize) -> (&[bf16], usize) {
        if block < self.whole_blocks {
            (&self.data[block * BLOCK * self.stride..], self.stride)
        } else {
            (&self.tail, self.tail.len() / BLOCK)
        }
    }
}

/// Rows `rows` of `a` (`k` long) into `out`, row `i` at `out[i · stride..]` (the rest left zero):
/// copied where rows are contiguous along `k`; where they lie side by side (a transposed operand),
/// `k` by `k` across them, so that every read runs along memory.
fn pack_rows(
    a: Matrix<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
    stride: usize,
    out: &mut [bf16],
) {
    let (first, count) = (rows.start, rows.len());
    if a.cols == 1 {
        for (r, dst) in rows.zip(out.chunks_exact_mut(stride)) {
            dst[..k].copy_from_slice(&a.data[r * a.rows..][..k]);
        }
    } else if a.rows == 1 {
        for i in 0..k {
            let src = &a.data[i * a.cols + first..][..count];
            for (r, &v) in src.iter().enumerate() {
                out[r * stride + i] = v;
            }
        }
    } else {
        for (r, dst) in rows.zip(out.chunks_exact_mut(stride)) {
            for (i, d) in dst[..k].iter_mut().enumerate() {
                *d = a.data[r * a.rows + i * a.cols];
            }
        }
    }
}

/// The lines `lines` of an operand, element `i < k` of line `l` at `data[l · line + i · depth]`
/// (`strides` = `(line, depth)`), as a panel `[pair][lane]` in `out` (`lanes` ≥ the lines; lanes
/// past them are left as they are, the high half past an odd `k` is written zero). Every packing of both
/// products (and of the attention on tiles) goes through here: lines contiguous along `k` ([`transpose_pairs`]), lines side by side
/// (a transposed operand, or a weight `[k, n]` as stored: [`interleave_pairs`] of two runs), or
/// neither (element by element).
pub(super) fn pack_panel<E: Packed>(
    data: &[E],
    strides: (usize, usize),
    lines: std::ops::Range<usize>,
    k: usize,
    lanes: usize,
    out: &mut [u32],
) {
    E::pack_panel(data, strides, lines, k, lanes, out);
}

/// [`pack_panel`]'s body, inlined into each element type's version.
#[inline(always)]
fn pack_panel_of<E: Packed>(
    data: &[E],
    (line, depth): (usize, usize),
    lines: std::ops::Range<usize>,
    k: usize,
    lanes: usize,
    out: &mut [u32],
) {
    let (first, count) = (lines.start, lines.len());
    if depth == 1 {
        // The next panel's lines (a weight's next rows) while these are packed.
        if E::READ_AHEAD {
            for l in lines.clone() {
                prefetch(data, (l + count) * line, k);
            }
        }
        let rows: Vec<&[E]> = lines.map(|l| &data[l * line..][..k]).collect();
        E::transpose_pairs(&rows, lanes, out);
    } else if line == 1 {
        for (p, dst) in out.chunks_exact_mut(lanes).enumerate() {
            let lo = &data[2 * p * depth + first..][..count];
            let hi = (2 * p + 1 < k).then(|| &data[(2 * p + 1) * depth + first..][..count]);
            interleave_pairs(lo, hi, &mut dst[..count]);
        }
    } else {
        let at = |l: usize, i: usize| u32::from(data[l * line + i * depth].bits());
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
/// to another cache line, a panel apart. With AVX-512, blocks of 16 rows × 16 pairs are transposed
/// in registers ([`transpose_blocks_avx512`]); one pair at a time, the stores were 8 % of a GPT-2
/// bf16 forward+backward on a Zen 4 (`dX = dY Wᵀ` packs `Wᵀ` this way).
#[inline(always)]
fn transpose_pairs(rows: &[&[bf16]], lanes: usize, out: &mut [u32]) {
    let Some(len) = rows.first().map(|r| r.len()) else {
        return;
    };
    assert!(rows.len() <= lanes && rows.iter().all(|r| r.len() == len));
    let whole = len / 2;
    // Rows `..done.0` of pairs `..done.1` are written in blocks; the loop below writes the rest.
    #[allow(unused_mut)]
    let mut done = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if rows.len() == MR
        && lanes == MR
        && whole >= BLOCK_LINES
        && HalfUnit::detect() == HalfUnit::Avx512
    {
        done = (MR, whole / BLOCK_LINES * BLOCK_LINES);
        assert!(
            out.len() >= done.1 * lanes,
            "bf16 packing: a panel too short"
        );
        // SAFETY: the CPU has AVX-512F; the 8 rows hold `len >= 2 · done.1` elements each, and
        // `out` holds `done.1` pairs of 8 lanes (both checked above): the function's contract.
        unsafe { transpose_eights_avx512(rows, done.1, out) };
    } else if rows.len() >= BLOCK_LINES
        && whole >= BLOCK_LINES
        && HalfUnit::detect() == HalfUnit::Avx512
    {
        done = (
            rows.len() / BLOCK_LINES * BLOCK_LINES,
            whole / BLOCK_LINES * BLOCK_LINES,
        );
        assert!(
            out.len() >= done.1 * lanes,
            "bf16 packing: a panel too short"
        );
        // SAFETY: the CPU has AVX-512F; rows `..done.0` hold `len >= 2 · done.1` elements each,
        // and `out` holds `done.1` pairs of `lanes >= done.0` lanes (both checked above): the
        // function's contract.
        unsafe { transpose_blocks_avx512(&rows[..done.0], done.1, lanes, out) };
    }
    for (p, dst) in out.chunks_exact_mut(lanes).take(whole).enumerate() {
        let from = if p < done.1 { done.0 } else { 0 };
        for (d, row) in dst[from..].iter_mut().zip(&rows[from..]) {
            let pair = &row[2 * p..2 * p + 2];
            *d = u32::from(pair[0].bits()) | u32::from(pair[1].bits()) << 16;
        }
    }
    if len % 2 == 1 {
        for (d, row) in out[whole * lanes..][..lanes].iter_mut().zip(rows) {
            *d = u32::from(row[len - 1].bits());
        }
    }
}

/// [`transpose_pairs`] of pairs `..pairs` of 8 rows into panels of 8 lanes (a multiple of 16
/// pairs; the weight-stationary schedule's weight panels): two pairs of the 8 rows are one
/// register's 16 lanes, so each row's 16 pairs are read as 8 `u64` of two pairs, transposed as an
/// 8 × 8 block of `u64` (64-bit interleaves, then two rounds of 128-bit lane shuffles), and each
/// result's lanes put in order, `[row][pair of two]` to `[pair of two][row]`, by one permutation.
///
/// # Safety
/// The CPU must have AVX-512F; `rows` are 8 rows of at least `2 · pairs` elements each and `out`
/// holds at least `8 · pairs` (the loads and stores are unchecked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_eights_avx512(rows: &[&[bf16]], pairs: usize, out: &mut [u32]) {
    use std::arch::x86_64::{
        __m512i, _mm512_loadu_si512, _mm512_permutexvar_epi32, _mm512_setr_epi32,
        _mm512_storeu_si512, _mm512_unpackhi_epi64, _mm512_unpacklo_epi64,
    };
    // A transposed register holds (row j's pair 2q, its pair 2q + 1) at lanes 2j, 2j + 1.
    let order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for p0 in (0..pairs).step_by(BLOCK_LINES) {
        // SAFETY: each of the 8 rows holds `2 · pairs` elements (the contract), so the 64 bytes
        // of its pairs `p0..p0 + 16` are inside.
        let e: [__m512i; 8] = std::array::from_fn(|r| unsafe {
            _mm512_loadu_si512(rows[r].as_ptr().add(2 * p0).cast())
        });
        // t[2k + h], 128-bit lane l: `u64` 2l + h of rows 2k and 2k + 1.
        let t: [__m512i; 8] = std::array::from_fn(|i| {
            let (x, y) = (e[i & !1], e[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi64(x, y)
            } else {
                _mm512_unpackhi_epi64(x, y)
            }
        });
        for h in 0..2 {
            // `u64` q = 2l + h of the 8 rows (pairs 2q and 2q + 1 of the block), for l = 0..4.
            let columns = lanes_gathered([t[h], t[2 + h], t[4 + h], t[6 + h]]);
            for (l, column) in columns.into_iter().enumerate() {
                let p = p0 + 2 * (2 * l + h);
                // SAFETY: `p + 1 < pairs`, so the 16 lanes of pairs `p` and `p + 1` at `8 p` are
                // inside `out` (the contract).
                unsafe {
                    _mm512_storeu_si512(
                        out.as_mut_ptr().add(p * MR).cast(),
                        _mm512_permutexvar_epi32(order, column),
                    )
                };
            }
        }
    }
}

/// Rows and pairs of a block [`transpose_blocks_avx512`] transposes: 16 `u32` a register.
const BLOCK_LINES: usize = 16;

/// [`transpose_pairs`] of pairs `..pairs` of every row, `rows.len()` and `pairs` multiples of
/// [`BLOCK_LINES`]: each block of 16 rows × 16 pairs is loaded as 16 registers (a row's 16 pairs
/// each), transposed with the usual network (32-bit and 64-bit interleaves within 128-bit lanes,
/// then two rounds of 128-bit lane shuffles) and stored as 16 runs of 16 lanes.
///
/// # Safety
/// The CPU must have AVX-512F; every row holds at least `2 · pairs` elements and `out` at least
/// `pairs · lanes` with `lanes >= rows.len()` (the loads and stores are unchecked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_blocks_avx512(rows: &[&[bf16]], pairs: usize, lanes: usize, out: &mut [u32]) {
    use std::arch::x86_64::{
        __m512i, _mm512_loadu_si512, _mm512_storeu_si512, _mm512_unpackhi_epi32,
        _mm512_unpackhi_epi64, _mm512_unpacklo_epi32, _mm512_unpacklo_epi64,
    };
    for (g, group) in rows.chunks_exact(BLOCK_LINES).enumerate() {
        for p0 in (0..pairs).step_by(BLOCK_LINES) {
            // SAFETY: row `r` holds `2 · pairs` elements (the contract), so the 64 bytes of its
            // pairs `p0..p0 + 16` (elements `2 p0..2 p0 + 32`) are inside.
            let r: [__m512i; 16] = std::array::from_fn(|i| unsafe {
                _mm512_loadu_si512(group[i].as_ptr().add(2 * p0).cast())
            });
            // a[2k], a[2k + 1]: rows 2k and 2k + 1 interleaved, pairs 0-1 and 2-3 of each lane.
            let a: [__m512i; 16] = std::array::from_fn(|i| {
                let (x, y) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm512_unpacklo_epi32(x, y)
                } else {
                    _mm512_unpackhi_epi32(x, y)
                }
            });
            // b[4k + c], 128-bit lane l: pair 4l + c of rows 4k..4k + 4.
            let b: [__m512i; 16] = std::array::from_fn(|i| {
                let (k, c) = (i / 4, i % 4);
                let (x, y) = (a[4 * k + c / 2], a[4 * k + 2 + c / 2]);
                if c % 2 == 0 {
                    _mm512_unpacklo_epi64(x, y)
                } else {
                    _mm512_unpackhi_epi64(x, y)
                }
            });
            for c in 0..4 {
                // Pair 4l + c of the 16 rows, for lanes l = 0..4.
                let columns = lanes_gathered([b[c], b[4 + c], b[8 + c], b[12 + c]]);
                for (l, column) in columns.into_iter().enumerate() {
                    let p = p0 + 4 * l + c;
                    // SAFETY: `p < pairs` and the group's lanes `16 g..16 g + 16` are within
                    // `lanes`, so the 64 bytes at `p · lanes + 16 g` are inside `out` (the
                    // contract).
                    unsafe {
                        _mm512_storeu_si512(
                            out.as_mut_ptr().add(p * lanes + BLOCK_LINES * g).cast(),
                            column,
                        )
                    };
                }
            }
        }
    }
}

/// The last stage of both transposes: register `l` of the result holds 128-bit lane `l` of each
/// of `x`, `y`, `z`, `w`, in that order (a 4 × 4 transpose of 128-bit lanes, in two rounds of lane
/// shuffles).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn lanes_gathered(
    [x, y, z, w]: [std::arch::x86_64::__m512i; 4],
) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::_mm512_shuffle_i32x4;
    // Lanes 0 and 1 of x then y (and of z then w); lanes 2 and 3 likewise.
    let low = (
        _mm512_shuffle_i32x4::<0x44>(x, y),
        _mm512_shuffle_i32x4::<0x44>(z, w),
    );
    let high = (
        _mm512_shuffle_i32x4::<0xEE>(x, y),
        _mm512_shuffle_i32x4::<0xEE>(z, w),
    );
    [
        _mm512_shuffle_i32x4::<0x88>(low.0, low.1),
        _mm512_shuffle_i32x4::<0xDD>(low.0, low.1),
        _mm512_shuffle_i32x4::<0x88>(high.0, high.1),
        _mm512_shuffle_i32x4::<0xDD>(high.0, high.1),
    ]
}

/// Columns `columns` of a `k × n` operand whose rows lie `stride` apart along memory (a `[k, n]`
/// weight as stored) as the vector schedule's right panels: [panel][pair][column], [`NR`] columns a
/// panel, `k.div_ceil(2)` pairs each, panels one after another in `out` (lanes past the columns
/// left as they are). Pair by pair across every panel, so that each pair's two rows are read once,
/// along memory: panel by panel they were read 128 bytes at a time, a row apart, which for an
/// `f32` weight read from memory was slower than rounding it to a copy first.
#[inline(always)]
fn pack_across<E: Packed>(
    data: &[E],
    stride: usize,
    columns: std::ops::Range<usize>,
    k: usize,
    out: &mut [u32],
) {
    let (first, cols) = (columns.start, columns.len());
    let pairs = k.div_ceil(2);
    for p in 0..pairs {
        // The rows a few pairs ahead, asked for now: each pair's runs are a few cache lines of
        // rows far apart, which the hardware's prefetchers do not see coming.
        for row in 2 * (p + PREFETCH_PAIRS)..(2 * (p + PREFETCH_PAIRS + 1)).min(k) {
            prefetch(data, row * stride + first, cols);
        }
        let lo = &data[2 * p * stride + first..][..cols];
        let hi = (2 * p + 1 < k).then(|| &data[(2 * p + 1) * stride + first..][..cols]);
        for (cp, c0) in (0..cols).step_by(NR).enumerate() {
            let width = NR.min(cols - c0);
            let dst = &mut out[(cp * pairs + p) * NR..][..width];
            interleave_pairs(&lo[c0..c0 + width], hi.map(|h| &h[c0..c0 + width]), dst);
        }
    }
}

/// Pairs ahead whose rows [`pack_across`] prefetches.
const PREFETCH_PAIRS: usize = 8;

/// Asks for `data[start..start + len]` (what of it lies in `data`) to be brought into L2: packing
/// reads short runs of rows far apart (a panel's lines, a pair's rows), which the hardware's
/// prefetchers do not see coming. Measured on a Zen 4, GPT-2 small's autocast forward at 128
/// tokens: the packing of its `f32` weights 16 % → 9.5 % of the samples.
#[inline(always)]
fn prefetch<E>(data: &[E], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let run = data.get(start..).unwrap_or_default();
        for line in (0..len.min(run.len())).step_by(64 / size_of::<E>().max(1)) {
            let at = run[line..].as_ptr().cast::<i8>();
            // SAFETY: a prefetch reads nothing the program sees and cannot fault; `at` points into
            // `data`.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(at) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, start, len);
}

/// `out[i] = lo[i] | hi[i] << 16` (`hi` zero when absent): two runs of `bf16` as a panel's pairs
/// (the layout of both operands' panels).
/// Slices and zipped iterators, so the packing is checked once per run rather than per element.
#[inline(always)]
fn interleave_pairs<E: Packed>(lo: &[E], hi: Option<&[E]>, out: &mut [u32]) {
    match hi {
        Some(hi) => {
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = u32::from(l.bits()) | u32::from(h.bits()) << 16;
            }
        }
        None => {
            for (o, l) in out.iter_mut().zip(lo) {
                *o = u32::from(l.bits());
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
fn weight_stationary<E: Packed>(
    dot: Bf16Dot,
    a: Matrix<'_>,
    b: Matrix<'_, E>,
    (m, k, n): (usize, usize, usize),
    out: &mut [bf16],
    scratch: Option<Scratch<'_>>,
) {
    let pairs = k / 2;
    let token_panels = m.div_ceil(NR);
    // aᵀ as right panels: [panel][pair][token], each the u32 of (a[t][2p], a[t][2p + 1]). Tokens
    // past `m` (whatever scratch held) only reach output columns that are never stored.
    let mut own = Vec::new();
    let right = panels_in(scratch, token_panels * pairs * NR, &mut own);
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
            let mut wide = vec![0.0f32; if dot.fma { 2 * pairs * MR } else { 0 }];
            let end = n.min((task + 1) * ROWS_PER_TASK);
            for j0 in (task * ROWS_PER_TASK..end).step_by(MR) {
                let rows = MR.min(n - j0);
                // The weight rows' pairs as the kernel's left panel ([pair][row]); rows past `n` stay 0.
                if rows < MR {
                    left.fill(0);
                }
                pack_panel(b.data, (b.cols, 1), j0..j0 + rows, k, MR, &mut left);
                if dot.fma {
                    widen_left(&left, pairs, &mut wide);
                }
                for tp in 0..token_panels {
                    let rp = &right[tp * pairs * NR..(tp + 1) * pairs * NR];
                    micro_kernel(dot, &left, &wide, rp, pairs, false, &mut tile);
                    let width = NR.min(m - tp * NR);
                    out_rows.store_tile(&tile, (rows, width), (tp * NR, j0), Placement::Transposed);
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
    // With several tokens, the kernel asks for the weight this far on: the same position of rows
    // whole groups further on ([`super::few_rows_ahead`]); one token's walk is left to the hardware.
    let ahead = super::few_rows_ahead(m, GROUP, b.cols, size_of::<bf16>());
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
                let all = dot_rows(dot, &x, pairs, m, rows, ahead);
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

/// Every token's dot product with each of [`GROUP`] weight rows of `2 · pairs` `bf16`, asking for
/// each row's element `ahead` further on as it walks (0: no prefetch).
fn dot_rows(
    dot: Bf16Dot,
    x: &[u32],
    pairs: usize,
    m: usize,
    w: [&[bf16]; GROUP],
    ahead: usize,
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
                unsafe { dot_rows_avx512::<$t, $r>(x, pairs, w, s, ahead) }
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
    ahead: usize,
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _MM_HINT_T1, _mm_prefetch, _mm512_dpbf16_ps, _mm512_loadu_si512,
        _mm512_reduce_add_ps, _mm512_setzero_ps,
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
            // A prefetch cannot fault, wherever `ahead` points (past the weight's end too), so
            // the address is formed with `wrapping_add` and needs no bounds.
            if ahead > 0 {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(2 * p + ahead).cast());
            }
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

/// How [`OutRows::store_tile`] lays a tile into the output.
#[derive(Clone, Copy)]
enum Placement {
    /// The tile's rows are the output's.
    Rows,
    /// The tile is of `outᵀ`: its rows are the output's columns.
    Transposed,
}

/// The output, written by the tasks: each writes only its own block of rows and columns. It holds
/// the exclusive borrow of the output for `'a`, so it cannot outlive it.
#[derive(Clone, Copy)]
struct OutRows<'a> {
    ptr: *mut bf16,
    len: usize,
    n: usize,
    _out: PhantomData<&'a mut [bf16]>,
}

// SAFETY: the tasks that share an `OutRows` write disjoint elements of it (see `store`), and the
// borrow of the output outlives them (`'a`; `matmul`, `weight_stationary`, `few_tokens` and
// `tiled` return after their parallel loops).
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

    /// Stores rows `0..rows`, columns `0..width` of a tile: as rows `first..first + rows`, columns
    /// `col..col + width` of the output ([`Placement::Rows`]), or, a tile of `outᵀ`, transposed:
    /// as rows `first..first + width`, columns `col..col + rows` ([`Placement::Transposed`]).
    fn store_tile<const R: usize>(
        &self,
        tile: &[[f32; NR]; R],
        (rows, width): (usize, usize),
        (first, col): (usize, usize),
        placement: Placement,
    ) {
        #[cfg(target_arch = "x86_64")]
        if HalfUnit::detect() == HalfUnit::Avx512 {
            // SAFETY: the CPU has AVX-512 F and BW, all the function is compiled for.
            return unsafe { self.store_tile_avx512(tile, (rows, width), (first, col), placement) };
        }
        self.store_tile_inline(tile, (rows, width), (first, col), placement);
    }

    /// [`store_tile`](Self::store_tile) compiled for AVX-512, the rounding loop inlined: a call of
    /// the run conversion per row of 32 values spent half its time at the call.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F and BW.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store_tile_avx512<const R: usize>(
        &self,
        tile: &[[f32; NR]; R],
        shape: (usize, usize),
        at: (usize, usize),
        placement: Placement,
    ) {
        if let (Placement::Transposed, (MR, width)) = (placement, shape)
            && let Ok(tile) = <&[[f32; NR]; MR]>::try_from(&tile[..])
        {
            // SAFETY: the CPU has AVX-512 F and BW (this function's contract).
            return unsafe { self.store_eight_transposed_avx512(tile, width, at) };
        }
        self.store_tile_inline(tile, shape, at, placement);
    }

    /// A whole tile of `MR = 8` rows of `outᵀ`, columns `0..width`, stored as rows `first..first +
    /// width`, columns `col..col + 8` of the output: rounded row by row, then transposed eight
    /// columns at a time in registers (an 8 × 8 transpose of 16-bit lanes, three rounds of
    /// unpacking), each column one 16-byte store. The general path moved the 256 values one by one
    /// and copied each column with a call of `memcpy`: 3.7 % of the Llama-1B-shaped bf16 forward's
    /// samples on a Zen 4, where every weight-stationary tile ends here; 2.4 % after.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F and BW.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store_eight_transposed_avx512(
        &self,
        tile: &[[f32; NR]; MR],
        width: usize,
        (first, col): (usize, usize),
    ) {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi16, _mm_unpackhi_epi32,
            _mm_unpackhi_epi64, _mm_unpacklo_epi16, _mm_unpacklo_epi32, _mm_unpacklo_epi64,
        };
        const { assert!(MR == 8 && NR.is_multiple_of(8)) };
        let mut rounded = [[bf16::ZERO; NR]; MR];
        for (row, into) in tile.iter().zip(&mut rounded) {
            bf16_rounded(row, into);
        }
        for c in 0..width.min(NR).div_ceil(8) {
            // Row r's eight values of columns 8c..8c + 8: `r[i]` = [a0 .. a7], [b0 .. b7], ...
            let r: [__m128i; MR] = std::array::from_fn(|i| {
                let eight: &[bf16; 8] = rounded[i][8 * c..8 * c + 8].try_into().unwrap();
                // SAFETY: 16 bytes read from an array of eight `bf16`; `loadu` takes any
                // alignment.
                unsafe { _mm_loadu_si128(eight.as_ptr().cast()) }
            });
            // Pairs of rows interleaved: [a0 b0 a1 b1 a2 b2 a3 b3], [a4 b4 .. a7 b7], ...
            let t = [
                _mm_unpacklo_epi16(r[0], r[1]),
                _mm_unpackhi_epi16(r[0], r[1]),
                _mm_unpacklo_epi16(r[2], r[3]),
                _mm_unpackhi_epi16(r[2], r[3]),
                _mm_unpacklo_epi16(r[4], r[5]),
                _mm_unpackhi_epi16(r[4], r[5]),
                _mm_unpacklo_epi16(r[6], r[7]),
                _mm_unpackhi_epi16(r[6], r[7]),
            ];
            // Fours: [a0 b0 c0 d0 a1 b1 c1 d1], [a2 .. d3], [a4 .. d5], [a6 .. d7], then e..h.
            let u = [
                _mm_unpacklo_epi32(t[0], t[2]),
                _mm_unpackhi_epi32(t[0], t[2]),
                _mm_unpacklo_epi32(t[1], t[3]),
                _mm_unpackhi_epi32(t[1], t[3]),
                _mm_unpacklo_epi32(t[4], t[6]),
                _mm_unpackhi_epi32(t[4], t[6]),
                _mm_unpacklo_epi32(t[5], t[7]),
                _mm_unpackhi_epi32(t[5], t[7]),
            ];
            // Columns: [a0 b0 c0 d0 e0 f0 g0 h0], [a1 .. h1], ...
            let columns = [
                _mm_unpacklo_epi64(u[0], u[4]),
                _mm_unpackhi_epi64(u[0], u[4]),
                _mm_unpacklo_epi64(u[1], u[5]),
                _mm_unpackhi_epi64(u[1], u[5]),
                _mm_unpacklo_epi64(u[2], u[6]),
                _mm_unpackhi_epi64(u[2], u[6]),
                _mm_unpacklo_epi64(u[3], u[7]),
                _mm_unpackhi_epi64(u[3], u[7]),
            ];
            for (i, column) in columns.into_iter().enumerate().take(width - 8 * c) {
                self.write(first + 8 * c + i, col, MR, |dst| {
                    // SAFETY: `dst` is eight `bf16`, 16 bytes; `storeu` takes any alignment.
                    unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), column) }
                });
            }
        }
    }

    /// The body of [`store_tile`](Self::store_tile), inlined into each version.
    #[inline(always)]
    fn store_tile_inline<const R: usize>(
        &self,
        tile: &[[f32; NR]; R],
        (rows, width): (usize, usize),
        (first, col): (usize, usize),
        placement: Placement,
    ) {
        match placement {
            Placement::Rows => {
                for (r, row) in tile.iter().enumerate().take(rows) {
                    self.write(first + r, col, width, |dst| {
                        bf16_rounded(&row[..width], dst)
                    });
                }
            }
            Placement::Transposed => {
                // The tile's rows are rounded where they lie, 32 lanes at a time, and the `bf16`
                // then transposed: rounding the transposed columns of 8 ran lane by lane in
                // scalar code (5 % of GPT-2 small's bf16 forward at 1,024 tokens on a Zen 4, its
                // head's stores). Gathering one column and rounding it at once had made the vector
                // loads wait on the scalar stores just before them (no store forwarding across
                // them), 16 % of the Llama-1B-shaped bf16 forward on the AMX machine.
                let mut rounded = [[bf16::ZERO; NR]; R];
                for (row, into) in tile.iter().zip(&mut rounded) {
                    bf16_rounded(row, into);
                }
                let mut columns = [[bf16::ZERO; R]; NR];
                for (r, row) in rounded.iter().enumerate() {
                    for (column, &x) in columns.iter_mut().zip(row) {
                        column[r] = x;
                    }
                }
                for (t, column) in columns.iter().enumerate().take(width) {
                    self.write(first + t, col, rows, |dst| {
                        dst.copy_from_slice(&column[..rows])
                    });
                }
            }
        }
    }

    /// Hands `fill` row `row`, columns `col..col + len` of the output, which must lie inside the
    /// row (checked). The callers give each block of the output (columns; rows and columns on
    /// tiles) to one task.
    #[inline(always)]
    fn write(&self, row: usize, col: usize, len: usize, fill: impl FnOnce(&mut [bf16])) {
        assert!(
            col + len <= self.n && (row * self.n + col + len) <= self.len,
            "bf16 matmul: a store outside the output"
        );
        // SAFETY: the range is inside the borrowed output (checked above); each block of it
        // belongs to one task, so no other thread touches these elements meanwhile, and the
        // slice lives only through `fill`.
        fill(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(row * self.n + col), len) })
    }

    /// Rounds `values` into row `row`, columns `col..col + values.len()` (inside the row).
    fn store(&self, row: usize, col: usize, values: &[f32]) {
        // A run at a time in vector registers (the same bits as `bf16_of_f32`).
        self.write(row, col, values.len(), |dst| bf16::narrow(values, dst));
    }
}

/// `tile = left_panel · right_panel` over `pairs` k-pairs (`left` `[pair][row]`, `right`
/// `[pair][column]`, each element a `u32` of two `bf16`), or `tile +=` it when `accumulate` (a
/// product computed a block of `k` at a time: the sums continue from the tile's, so the result is
/// the same bits as one call over the whole depth).
///
/// On the FMA path `wide` is the left panel widened once by the caller ([`widen_left`]); the
/// other path ignores it.
fn micro_kernel(
    dot: Bf16Dot,
    left: &[u32],
    wide: &[f32],
    right: &[u32],
    pairs: usize,
    accumulate: bool,
    tile: &mut [[f32; NR]; MR],
) {
    assert!(left.len() >= pairs * MR && right.len() >= pairs * NR);
    #[cfg(target_arch = "x86_64")]
    if dot.fma {
        assert!(wide.len() >= 2 * pairs * MR);
        // SAFETY: `dot` exists, so `Bf16Dot::detect` found AVX-512F on this CPU; the assertions
        // are the kernel's contract.
        unsafe { micro_kernel_fma(wide, right, pairs, accumulate, tile) }
    } else {
        // SAFETY: `dot` exists, so `Bf16Dot::detect` found AVX-512F and AVX-512 BF16 on this CPU;
        // the assertion is the kernel's contract.
        unsafe { micro_kernel_avx512(left, right, pairs, accumulate, tile) }
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
    accumulate: bool,
    tile: &mut [[f32; NR]; MR],
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32,
        _mm512_storeu_ps,
    };
    let mut acc = start_sums(tile, accumulate);
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

/// A micro-kernel's sixteen accumulators at the start: the tile's sums when `accumulate`, else zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn start_sums(tile: &[[f32; NR]; MR], accumulate: bool) -> [[std::arch::x86_64::__m512; 2]; MR] {
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_setzero_ps};
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if accumulate {
        for (acc, row) in acc.iter_mut().zip(tile) {
            // SAFETY: each row of the tile holds NR = 32 floats: two 16-float loads.
            unsafe {
                *acc = [
                    _mm512_loadu_ps(row.as_ptr()),
                    _mm512_loadu_ps(row.as_ptr().add(16)),
                ];
            }
        }
    }
    acc
}

/// The left panel `[pair][row]` as `f32`, `[k][row]`: element `2p · MR + r` the low half of pair
/// `(p, r)`, `(2p + 1) · MR + r` its high half (exact: a `bf16` is its `f32`'s high half). Sized
/// `2 · pairs · MR`; done once per panel, so that [`micro_kernel_fma`] broadcasts straight from it.
fn widen_left(left: &[u32], pairs: usize, wide: &mut [f32]) {
    for (pair, out) in left[..pairs * MR]
        .chunks_exact(MR)
        .zip(wide.chunks_exact_mut(2 * MR))
    {
        let (lo, hi) = out.split_at_mut(MR);
        for ((l, h), &p) in lo.iter_mut().zip(hi).zip(pair) {
            *l = f32::from_bits(p << 16);
            *h = f32::from_bits(p & 0xffff_0000);
        }
    }
}

/// [`micro_kernel_avx512`]'s product with `f32` multiply-adds: each right pair widened in
/// registers (a shift for the low half, a mask for the high one), the left halves broadcast from
/// the widened panel; two multiply-adds per pair and accumulator where `vdpbf16ps` has one, each
/// product exact and each sum rounded once, subnormals kept.
///
/// # Safety
/// The CPU must have AVX-512F; `wide` holds `2 · pairs · MR` elements and `right` `pairs · NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel_fma(
    wide: &[f32],
    right: &[u32],
    pairs: usize,
    accumulate: bool,
    tile: &mut [[f32; NR]; MR],
) {
    use std::arch::x86_64::{
        _mm512_and_si512, _mm512_castsi512_ps, _mm512_fmadd_ps, _mm512_loadu_si512,
        _mm512_set1_epi32, _mm512_set1_ps, _mm512_slli_epi32, _mm512_storeu_ps,
    };
    let mut acc = start_sums(tile, accumulate);
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let (wide, right) = (wide.as_ptr(), right.as_ptr());
    for p in 0..pairs {
        // SAFETY: the caller's contract: `right` holds `pairs · NR` pairs, so the two 64-byte
        // loads of 16 pairs at `p · NR` and `p · NR + 16` stay inside; `loadu` needs no alignment.
        let (b0, b1) = unsafe {
            let at = right.add(p * NR);
            (
                _mm512_loadu_si512(at.cast()),
                _mm512_loadu_si512(at.add(16).cast()),
            )
        };
        let (b0_lo, b0_hi) = (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b0)),
            _mm512_castsi512_ps(_mm512_and_si512(b0, high)),
        );
        let (b1_lo, b1_hi) = (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b1)),
            _mm512_castsi512_ps(_mm512_and_si512(b1, high)),
        );
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `wide` holds `2 · pairs · MR` elements and `r < MR` (the caller's contract).
            let (a_lo, a_hi) = unsafe {
                (
                    _mm512_set1_ps(*wide.add(2 * p * MR + r)),
                    _mm512_set1_ps(*wide.add((2 * p + 1) * MR + r)),
                )
            };
            acc[0] = _mm512_fmadd_ps(a_hi, b0_hi, _mm512_fmadd_ps(a_lo, b0_lo, acc[0]));
            acc[1] = _mm512_fmadd_ps(a_hi, b1_hi, _mm512_fmadd_ps(a_lo, b1_lo, acc[1]));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector schedule's column blocks: balanced across the threads where `NC` is not.
    #[test]
    fn column_blocks_balance_the_threads() {
        // GPT-2 small's products on 2 threads: 768 and 2,304 columns in 4 and 12 tasks.
        assert_eq!(column_block(768, 2), 192);
        assert_eq!(column_block(2304, 2), 192);
        // Already balanced, or one block whatever its width: the widest.
        assert_eq!(column_block(3072, 2), NC);
        assert_eq!(column_block(40, 2), NC);
        assert_eq!(column_block(2048, 1), NC);
        // More threads than blocks of `NC`: narrower blocks, down to half of it.
        assert_eq!(column_block(768, 16), NC / 2);
        for (n, threads) in [(1, 1), (33, 3), (1000, 7), (50257, 2)] {
            let nc = column_block(n, threads);
            assert!(
                nc.is_multiple_of(NR) && (NC / 2..=NC).contains(&nc),
                "{n} on {threads}: {nc}"
            );
        }
    }

    /// The pairs of rows as a panel, blocks in registers or not, against a plain loop: row counts
    /// around a block's 16, lengths around its 32 elements (odd ones too), panels wider than the
    /// rows (their extra lanes untouched).
    #[test]
    fn transposed_pairs_match_a_plain_loop() {
        let mut rng = crate::rng::Rng::new(9);
        for rows in [1, 5, 8, 15, 16, 17, 31, 32] {
            for len in [1usize, 2, 31, 32, 33, 64, 65, 100, 257] {
                // Panels as wide as the rows (8: the weight-stationary panels), and wider.
                let lanes = if rows % 2 == 0 { rows } else { 32 };
                let data: Vec<Vec<bf16>> = (0..rows)
                    .map(|_| {
                        (0..len)
                            .map(|_| bf16::from_bits(rng.next_u64() as u16))
                            .collect()
                    })
                    .collect();
                let views: Vec<&[bf16]> = data.iter().map(|r| &r[..]).collect();
                let mut got = vec![0xDEAD_BEEFu32; len.div_ceil(2) * lanes];
                transpose_pairs(&views, lanes, &mut got);
                for (p, lanes_of_pair) in got.chunks_exact(lanes).enumerate() {
                    for (i, &g) in lanes_of_pair.iter().enumerate() {
                        let want = if i >= rows {
                            0xDEAD_BEEF
                        } else {
                            let hi = data[i].get(2 * p + 1).map_or(0, |h| u32::from(h.to_bits()));
                            u32::from(data[i][2 * p].to_bits()) | hi << 16
                        };
                        assert_eq!(g, want, "{rows} rows of {len}: pair {p}, lane {i}");
                    }
                }
            }
        }
    }

    /// A bf16 operand in a buffer of its own: `rows × cols` at the given strides.
    struct Operand {
        data: Vec<bf16>,
        strides: (usize, usize),
    }

    impl Operand {
        /// Values in [-2, 2) from a small generator, laid out `(row, col)` at `strides` in a buffer
        /// just long enough; unused elements (of strided layouts) are NaN, which no kernel may read
        /// into a result.
        fn new(seed: u64, (rows, cols): (usize, usize), strides: (usize, usize)) -> Operand {
            let len = (rows - 1) * strides.0 + (cols - 1) * strides.1 + 1;
            let mut data = vec![bf16::from_f32(f32::NAN); len];
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for r in 0..rows {
                for c in 0..cols {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
                    data[r * strides.0 + c * strides.1] = bf16::from_f32(4.0 * unit - 2.0);
                }
            }
            Operand { data, strides }
        }

        fn matrix(&self) -> Matrix<'_> {
            Matrix {
                data: &self.data,
                rows: self.strides.0,
                cols: self.strides.1,
            }
        }
    }

    /// Each path's products against f64 sums of the same bf16 values, within one bf16 rounding of
    /// the result plus `f32` accumulation in another order: few tokens, a `Linear`'s product with
    /// and without whole tile steps and blocks of rows, plain, transposed and strided operands, odd
    /// depths, depths in several blocks, tails of every tile.
    #[test]
    fn every_path_matches_f64_products() {
        let paths = Bf16Dot::paths();
        if paths.iter().all(|(name, _)| *name != "amx") {
            eprintln!("not run: the AMX path (this CPU or kernel has no AMX tiles)");
        }
        if paths.is_empty() {
            eprintln!("not run: the AVX-512 BF16 paths (this CPU lacks AVX-512 BF16)");
        }
        // (m, k, n, a's layout, b's layout): "rows" contiguous along k, "cols" transposed (rows
        // side by side), "gap" rows contiguous with a row stride past k, "strided" neither.
        let cases: &[(usize, usize, usize, &str, &str)] = &[
            (1, 64, 9, "rows", "weight"),
            (5, 302, 70, "rows", "weight"),
            (8, 64, 9, "gap", "weight"),
            (9, 32, 33, "rows", "weight"),
            (37, 320, 130, "rows", "weight"),
            (64, 320, 64, "rows", "weight"),
            (70, 96, 100, "gap", "weight"),
            (37, 300, 130, "rows", "weight"),
            (37, 301, 300, "rows", "rows"),
            (33, 301, 37, "cols", "cols"),
            (100, 96, 70, "cols", "rows"),
            (40, 50, 45, "strided", "strided"),
            (3, 5, 4, "rows", "rows"),
            // Deeper than a `k` block of the vector schedule: two blocks with more row panels
            // than a task keeps sums for, three with an odd depth, and several column tasks.
            (520, 600, 33, "rows", "rows"),
            (37, 1029, 70, "cols", "rows"),
            (9, 1200, 300, "rows", "cols"),
        ];
        for (name, dot) in paths {
            for (i, &(m, k, n, la, lb)) in cases.iter().enumerate() {
                let layout = |kind: &str, rows: usize, cols: usize| match kind {
                    "rows" => (cols, 1),
                    "gap" => (cols + 3, 1),
                    "cols" => (1, rows),
                    "weight" => (1, rows),
                    _ => (2 * cols + 1, 2),
                };
                let a = Operand::new(2 * i as u64, (m, k), layout(la, m, k));
                let b = Operand::new(2 * i as u64 + 1, (k, n), layout(lb, k, n));
                let mut out = vec![bf16::ZERO; m * n];
                matmul(dot, a.matrix(), b.matrix(), (m, k, n), &mut out, None);
                // Packed into reused memory full of NaNs and other garbage: the same bits (every
                // padding element the tiles read is written).
                if let Some((l, r)) = Scratch::lens(dot, b.matrix(), (m, k, n)) {
                    let (mut rows, mut panels) = (vec![bf16::NAN; l + 5], vec![0xffc1_dead; r + 7]);
                    let scratch = Scratch {
                        rows: &mut rows,
                        panels: &mut panels,
                    };
                    let mut again = vec![bf16::ZERO; m * n];
                    matmul(
                        dot,
                        a.matrix(),
                        b.matrix(),
                        (m, k, n),
                        &mut again,
                        Some(scratch),
                    );
                    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&out), bits(&again), "{name}, case {i}: with scratch");
                }
                let (am, bm) = (a.matrix(), b.matrix());
                for r in 0..m {
                    for c in 0..n {
                        let terms = (0..k).map(|i| {
                            f64::from(f32::from(am.at_value(r, i)))
                                * f64::from(f32::from(bm.at_value(i, c)))
                        });
                        let (want, size) = terms.fold((0.0, 0.0), |(s, z), t| (s + t, z + t.abs()));
                        let got = f64::from(f32::from(out[r * n + c]));
                        let slack = want.abs() / 256.0 + k as f64 * size / (1u64 << 23) as f64;
                        assert!(
                            (got - want).abs() <= slack,
                            "{name}, case {i} ({m}x{k}x{n}, {la} by {lb}): out[{r}][{c}] = {got}, \
                             want {want}"
                        );
                    }
                }
            }
        }
    }

    /// An `f32` right operand is rounded as it is packed to the bits of its rounded copy: every
    /// schedule and packing (a `[k, n]` weight across panels, a transposed weight in runs, strided,
    /// a few tokens), depths in several runs and blocks, odd depths, into garbage-filled scratch;
    /// values between `bf16`s, ties of both parities, subnormals and huge ones.
    #[test]
    fn f32_right_operands_round_as_they_pack() {
        let paths = Bf16Dot::paths();
        if paths.is_empty() {
            eprintln!("not run: the AVX-512 BF16 paths (this CPU lacks AVX-512 BF16)");
        }
        let cases: &[(usize, usize, usize, (usize, usize))] = &[
            (37, 600, 130, (130, 1)), // [k, n] as stored: across the panels, three blocks
            (64, 1029, 300, (300, 1)), // an odd depth across the panels
            (37, 600, 70, (1, 600)),  // a transposed weight: rounded in runs of 256
            (33, 301, 40, (1, 301)),  // transposed with an odd depth: the vector schedule
            (40, 50, 45, (2 * 45 + 1, 2)), // neither
            (3, 514, 20, (1, 514)),   // a few tokens: the weight rounded whole
        ];
        for (name, dot) in paths {
            for (i, &(m, k, n, strides)) in cases.iter().enumerate() {
                let a = Operand::new(3 * i as u64, (m, k), (k, 1));
                let len = (k - 1) * strides.0 + (n - 1) * strides.1 + 1;
                let mut state = 0x2545_f491_4f6c_dd1d_u64 ^ i as u64;
                let wide: Vec<f32> = (0..len)
                    .map(|j| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        let bits = 0x3f00_0000 + (state as u32 & 0x00ff_ffff);
                        let sign = if state >> 63 == 1 { -1.0 } else { 1.0 };
                        match j % 61 {
                            0 => f32::from_bits(0x3f80_8000), // a tie, even kept part
                            1 => f32::from_bits(0x3f81_8000), // a tie, odd kept part
                            2 => 1.0e-40,                     // subnormal
                            3 => -3.0e38,                     // huge: rounds to infinity
                            _ => sign * f32::from_bits(bits),
                        }
                    })
                    .collect();
                let mut rounded = vec![bf16::ZERO; len];
                bf16::narrow(&wide, &mut rounded);
                let b = |data| Matrix {
                    data,
                    rows: strides.0,
                    cols: strides.1,
                };
                let mut want = vec![bf16::ZERO; m * n];
                matmul(dot, a.matrix(), b(&rounded), (m, k, n), &mut want, None);
                let wide_b = Matrix {
                    data: &wide[..],
                    rows: strides.0,
                    cols: strides.1,
                };
                let mut got = vec![bf16::ZERO; m * n];
                matmul(dot, a.matrix(), wide_b, (m, k, n), &mut got, None);
                let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name}, case {i} ({m}x{k}x{n})");
                if let Some((l, r)) = Scratch::lens(dot, wide_b, (m, k, n)) {
                    let (mut rows, mut panels) = (vec![bf16::NAN; l], vec![0xffc1_dead; r]);
                    let scratch = Scratch {
                        rows: &mut rows,
                        panels: &mut panels,
                    };
                    matmul(dot, a.matrix(), wide_b, (m, k, n), &mut got, Some(scratch));
                    assert_eq!(bits(&got), bits(&want), "{name}, case {i}: with scratch");
                }
            }
        }
    }
}
