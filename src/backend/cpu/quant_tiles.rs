//! Intel AMX-INT8 for the quantized products of many tokens (a prompt's pass): the weight decoded
//! 16 rows at a time into a [`Panel`], whose levels are already in the tiles' layout (for each 4
//! values, the 16 rows' 4 levels side by side: one tile row), then, per scale block, `TDPBSSD`
//! multiplies 16 tokens' signed levels by the panel's into 16 × 16 exact integer sums, and AVX-512
//! scales them into `f32` accumulators. The integers, their scaling and the order of the additions
//! are `quant_gemm`'s VNNI kernel's, so the two paths give the same bits.
//!
//! Why: per 16 tokens, 16 rows and 32 values the VNNI kernel issues 128 `vpdpbusd` (each 4 values
//! of 16 rows for one token) before three instructions of scaling per token; here one tile product
//! does the 8,192 multiply-adds and only the scaling is left to the vector unit. A tile product
//! covers one scale block of `k` (32 values, 16 for Q6_K, Q3_K and Q2_K): the blocks' integer sums
//! are scaled apart, so a longer `k` per product would mix them.
//!
//! The tile instructions are written with `asm!` (Rust's AMX intrinsics are unstable), as in
//! [`super::bf16_tiles`], whose detection this shares: tiles are used only where CPUID lists
//! AMX-INT8 and Linux granted the tile state.

use std::arch::x86_64::*;

use super::bf16_tiles::{AMX_INT8, Config, Configured, granted, listed};
use super::quant_gemm::{LANES, Panel, panel_product};
use super::quant_product::{Activations, BLOCK, Row};
use crate::quant::QuantType;

/// Tokens per tile product: one per row of an accumulator tile.
const TOKENS: usize = 16;
/// Scale blocks whose integer sums one call of [`Int8Tiles::sums`] leaves for the scaling (16 KiB).
const CHUNK: usize = 16;
/// Values per activation sum (`Activations::sums`).
const HALF: usize = 16;

/// Proof that this CPU runs AMX-INT8 tiles and AVX-512 F, BW and VNNI (the scaling, and
/// `quant_gemm`'s kernel for the tokens past the last 16), and that Linux granted this process the
/// tile state: only [`detect`](Self::detect) makes one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AmxInt8 {
    _detected: (),
}

impl AmxInt8 {
    /// The proof, where this CPU and kernel run int8 tiles.
    pub(crate) fn detect() -> Option<AmxInt8> {
        (std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
            && listed(AMX_INT8)
            && granted())
        .then_some(AmxInt8 { _detected: () })
    }
}

/// The configuration for scale blocks of `sub` values (palette 1): tiles 0 and 1 hold 16 tokens'
/// sums for 16 rows (`i32`, 64 bytes a row); tiles 2 and 4, 16 tokens' `sub` levels; tiles 3 and
/// 5, the panel's `sub / 4` groups of 16 rows × 4 levels. Two of each, so that one block's product
/// runs while the next block's operands load.
const fn config(sub: u8) -> Config {
    let mut bytes_per_row = [0u16; 16];
    let mut rows = [0u8; 16];
    let shapes = [
        (64, 16),
        (64, 16),
        (sub as u16, 16),
        (64, sub / 4),
        (sub as u16, 16),
        (64, sub / 4),
    ];
    let mut t = 0;
    while t < shapes.len() {
        bytes_per_row[t] = shapes[t].0;
        rows[t] = shapes[t].1;
        t += 1;
    }
    Config {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row,
        rows,
    }
}

static CONFIG_32: Config = config(32);
static CONFIG_16: Config = config(16);

/// This thread's tiles, configured for scale blocks of `sub` values until dropped (which releases
/// them). Not `Send`: the configuration belongs to the thread that loaded it.
struct Int8Tiles {
    sub: usize,
    _configured: Configured,
}

impl Int8Tiles {
    /// Configures this thread's tiles for scale blocks of `sub` (16 or 32) values.
    fn configure(amx: AmxInt8, sub: usize) -> Int8Tiles {
        let _ = amx;
        let config = match sub {
            32 => &CONFIG_32,
            16 => &CONFIG_16,
            _ => panic!("int8 tiles: scale blocks of {sub} values"),
        };
        Int8Tiles {
            sub,
            // SAFETY: `amx` exists, so the CPU has AMX-TILE and the kernel granted the tile
            // state; `config` is a valid palette-1 configuration.
            _configured: unsafe { Configured::load(config) },
        }
    }

    /// `sums[i][t][r] = Σ_j levels[t · stride + i · sub + j] · ŵ_r[i · sub + j]` for scale
    /// blocks `i < blocks`, tokens `t < 16` (their signed levels, rows `stride` bytes apart) and
    /// the panel's rows `r < 16` (`panel`: its levels from the first of these blocks on, `sub / 4`
    /// words of 16 rows per block).
    ///
    /// # Panics
    /// When a slice is too short for the blocks it is read at.
    fn sums(
        &mut self,
        (levels, stride): (&[i8], usize),
        panel: &[u32],
        blocks: usize,
        sums: &mut [[[i32; LANES]; TOKENS]; CHUNK],
    ) {
        let sub = self.sub;
        let words = sub / 4 * LANES;
        assert!(
            blocks > 0
                && blocks <= CHUNK
                && stride >= blocks * sub
                && levels.len() >= (TOKENS - 1) * stride + blocks * sub
                && panel.len() >= blocks * words,
            "int8 tiles: operands too short for their blocks"
        );
        // SAFETY: an `Int8Tiles` exists only after `LDTILECFG` configured this thread's tiles for
        // blocks of `sub` values (it is not `Send`). Per block `i`, the loads read 16 rows of `sub`
        // bytes of `levels` at `i · sub + t · stride` and `sub / 4` rows of 64 bytes of `panel`
        // at `i · words` words, inside both slices by the assertion; the stores write block `i`'s
        // 16 rows of 64 bytes at `sums[i]`, `i < blocks <= CHUNK`. The pair loop runs
        // `blocks / 2` times, the single block once more when `blocks` is odd.
        unsafe {
            std::arch::asm!(
                "2:",
                "cmp {n}, 2",
                "jb 3f",
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm2, [{a} + {sa}*1]",
                "tileloadd tmm3, [{b} + {s64}*1]",
                "tileloadd tmm4, [{a2} + {sa}*1]",
                "tileloadd tmm5, [{b2} + {s64}*1]",
                "tdpbssd tmm0, tmm2, tmm3",
                "tdpbssd tmm1, tmm4, tmm5",
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c} + {s64}*1 + 1024], tmm1",
                "add {a}, {step_a}",
                "add {a2}, {step_a}",
                "add {b}, {step_b}",
                "add {b2}, {step_b}",
                "add {c}, 2048",
                "sub {n}, 2",
                "jmp 2b",
                "3:",
                "test {n}, {n}",
                "jz 4f",
                "tilezero tmm0",
                "tileloadd tmm2, [{a} + {sa}*1]",
                "tileloadd tmm3, [{b} + {s64}*1]",
                "tdpbssd tmm0, tmm2, tmm3",
                "tilestored [{c} + {s64}*1], tmm0",
                "4:",
                a = inout(reg) levels.as_ptr() => _,
                a2 = inout(reg) levels.as_ptr().add(sub) => _,
                sa = in(reg) stride,
                b = inout(reg) panel.as_ptr() => _,
                b2 = inout(reg) panel.as_ptr().add(words) => _,
                s64 = in(reg) 64usize,
                step_a = in(reg) 2 * sub,
                step_b = in(reg) 2 * words * 4,
                c = inout(reg) sums.as_mut_ptr() => _,
                n = inout(reg) blocks => _,
                options(nostack),
            );
        }
    }
}

/// `out[t][r] = x̂_{t0 + t} · ŵ_r` for the 16 tokens from `t0` and the panel's 16 rows (`sums`:
/// the task's scratch for the integer sums, every element written before it is read).
///
/// # Safety
/// The CPU must have AVX-512 F (an [`AmxInt8`] says so); `tiles` are configured for the panel's
/// scale blocks, tokens `t0..t0 + 16` lie in `a`, whose rows are `k` values, and the panel holds
/// `k` values per row.
#[target_feature(enable = "avx512f")]
unsafe fn tokens(
    tiles: &mut Int8Tiles,
    panel: &Panel,
    a: &Activations,
    k: usize,
    t0: usize,
    sums: &mut [[[i32; LANES]; TOKENS]; CHUNK],
    out: &mut [[f32; LANES]; TOKENS],
) {
    let sub = panel.sub;
    let blocks = k / sub;
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for b0 in (0..blocks).step_by(CHUNK) {
        let n = CHUNK.min(blocks - b0);
        tiles.sums(
            (&a.q[t0 * k + b0 * sub..], k),
            &panel.levels[b0 * sub / 4 * LANES..],
            n,
            sums,
        );
        for (i, block) in sums[..n].iter().enumerate() {
            let b = b0 + i;
            // SAFETY: the panel holds `k / sub` scale blocks of 16 lanes, and the tokens'
            // scales (one per 32 values) and sums (one per 16) lie in `a` by the caller's
            // contract; `loadu` takes any alignment.
            unsafe {
                let sc = _mm512_loadu_ps(panel.scale.as_ptr().add(b * LANES));
                let offset = _mm512_loadu_ps(panel.offset.as_ptr().add(b * LANES));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let first = (t0 + t) * k + b * sub;
                    let dp = _mm512_loadu_si512(block[t].as_ptr().cast());
                    let d = _mm512_set1_ps(*a.d.get_unchecked(first / BLOCK));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sc, d), *acc);
                    if panel.offsets {
                        let halves = a.sums.as_ptr().add(first / HALF);
                        let sum = if sub == 2 * HALF {
                            *halves + *halves.add(1)
                        } else {
                            *halves
                        };
                        *acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(sum), *acc);
                    }
                }
            }
        }
    }
    for (out, acc) in out.iter_mut().zip(acc) {
        // SAFETY: a row of `out` holds 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), acc) };
    }
}

/// Where a product's weight rows are stored: in row order, or in strips of 16
/// (`crate::quant::strips`) with the rows past the last whole strip in row order after them.
#[derive(Clone, Copy)]
pub(super) enum Stored<'w> {
    Rows(&'w [u8]),
    Strips(&'w [u8]),
}

/// `out = x̂ Ŵᵀ` on the tiles for `a` (`m` tokens of `k`), the `n` weight rows of `ty` in `w`
/// (`row_bytes` each in row order), `out` `m × n`: the tasks of [`super::few_rows::by_weight_rows`]
/// (`rows_per_task` rounded up to whole panels), each decoding its rows into panels once and multiplying
/// every 16 tokens into them; the tokens past the last 16 go through `quant_gemm`'s VNNI kernel,
/// which computes the same bits.
///
/// # Panics
/// When the operands do not fit their shape.
pub(super) fn product(
    amx: AmxInt8,
    ty: QuantType,
    w: Stored<'_>,
    a: &Activations,
    (m, k, n): (usize, usize, usize),
    (rows_per_task, parallel): (usize, bool),
    out: &mut [f32],
) {
    use crate::quant::strips::{STRIP_ROWS, strip_row, strips_len};
    let row_bytes = ty.bytes_for(k).expect("whole blocks per row");
    let strip_bytes = strips_len(ty, STRIP_ROWS, k);
    let strip_rows = match (w, strip_bytes) {
        (Stored::Strips(w), Some(_)) => {
            assert_eq!(strips_len(ty, n, k), Some(w.len()), "int8 tiles: strips");
            n / STRIP_ROWS * STRIP_ROWS
        }
        (Stored::Rows(w), _) => {
            assert_eq!(w.len(), n * row_bytes, "int8 tiles: rows");
            0
        }
        (Stored::Strips(_), None) => panic!("{ty} has no strips"),
    };
    assert!(
        a.q.len() >= m * k,
        "int8 tiles: operands do not fit their shape"
    );
    let rows_per_task = rows_per_task.div_ceil(LANES) * LANES;
    let whole = m / TOKENS * TOKENS;
    let unsigned = (whole < m).then(|| a.unsigned(m * k));
    super::few_rows::by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
        let (j0, task_rows) = (columns.first(), columns.len());
        let mut row = Row::new(k);
        let mut decoded = vec![0u8; LANES * row_bytes];
        // The task's rows decoded once, then every 16 tokens through all of them: a token group's
        // activations are read from L1 and L2 once per panel, the panels from L2.
        let panels: Vec<(Panel, usize)> = (0..task_rows)
            .step_by(LANES)
            .map(|c| {
                let (first, rows) = (j0 + c, LANES.min(task_rows - c));
                let stored = match w {
                    Stored::Rows(w) => &w[first * row_bytes..(first + rows) * row_bytes],
                    Stored::Strips(w) if first < strip_rows => {
                        let size = strip_bytes.expect("strips");
                        let strip = &w[first / STRIP_ROWS * size..][..size];
                        for (r, dst) in decoded.chunks_exact_mut(row_bytes).enumerate() {
                            strip_row(ty, strip, k, r, dst);
                        }
                        &decoded[..]
                    }
                    Stored::Strips(w) => {
                        let at = strip_rows / STRIP_ROWS * strip_bytes.expect("strips")
                            + (first - strip_rows) * row_bytes;
                        &w[at..at + rows * row_bytes]
                    }
                };
                let mut panel = Panel::new(k);
                panel.fill(ty, stored, row_bytes, &mut row);
                (panel, rows)
            })
            .collect();
        if whole > 0 {
            let sub = panels.first().map_or(2 * HALF, |(p, _)| p.sub);
            let mut tiles = Int8Tiles::configure(amx, sub);
            let mut sums = [[0.0f32; LANES]; TOKENS];
            let mut scratch = Box::new([[[0i32; LANES]; TOKENS]; CHUNK]);
            for t0 in (0..whole).step_by(TOKENS) {
                for (p, (panel, rows)) in panels.iter().enumerate() {
                    // SAFETY: `amx` says the CPU has AVX-512 F; the tiles are configured for the
                    // panels' scale blocks (one format, one `sub`); tokens `t0..t0 + 16 <= m`
                    // lie in `a` (asserted: `m` rows of `k`), and each panel holds `k` values
                    // per row.
                    unsafe { tokens(&mut tiles, panel, a, k, t0, &mut scratch, &mut sums) };
                    for (t, s) in sums.iter().enumerate() {
                        columns.set_run(t0 + t, p * LANES, &s[..*rows]);
                    }
                }
            }
        }
        if let Some(unsigned) = &unsigned {
            for (p, (panel, rows)) in panels.iter().enumerate() {
                panel_product(
                    panel,
                    a,
                    unsigned,
                    (m, k),
                    whole..m,
                    &mut columns,
                    (p * LANES, *rows),
                );
            }
        }
    });
}
