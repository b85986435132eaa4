//! AMX-INT8 for the K formats' strips (Q4_K, Q5_K, Q6_K) at 16 tokens: the strip kernels' chunk of
//! a prompt's tokens with the integer dot products on tiles.
//!
//! A strip's nibble groups, decoded in registers as [`super::tokens_k4`] decodes them, are already
//! a tile's right operand: in group `g`, row `r`'s 4 bytes are the levels of values `4g..4g + 4`,
//! one tile row of 16 rows × 4 levels. So per sub-block (32 values; 16 for Q6_K) the decoded groups
//! go to a buffer as one tile, the 16 tokens' signed levels load as another straight from the
//! activations (rows `k` bytes apart), and `TDPBSUD` (signed tokens × unsigned levels) gives the
//! 16 × 16 exact integer sums that 128 `vpdpbusd` give the VNNI kernel (32 for a Q6_K half). The
//! scaling is the VNNI kernel's, in its order, so both paths give the same bits; what is left to
//! the vector unit per sub-block and 16 tokens is the decoding (8 stores) and the scaling (a load,
//! a conversion and three multiplies per token), not the 128 dot products.
//!
//! The tile instructions are written with `asm!` (Rust's AMX intrinsics are unstable); the
//! detection is [`AmxInt8`]'s.

use std::arch::x86_64::*;

use super::super::bf16_tiles::{Config, Configured};
use super::super::quant_tiles::AmxInt8;
use super::{Activations, BLOCK, BlockSums, STRIP_ROWS, TOKENS};
use super::{SEVERAL_TOKENS_PREFETCH, prefetch_ahead};
use crate::quant::strips::strip_block_bytes;
use crate::quant::{QK_K, QuantType};

/// Sub-blocks the tiles multiply per call at most: a Q6_K block's 16 halves.
const MOST_SUBS: usize = 16;
/// Bytes of one tile row.
const ROW: usize = 64;

/// The decoded levels of one block of the strip (the right operands of its sub-blocks, one after
/// the other: `sub / 4` tile rows each) and their integer sums with 16 tokens (`[sub-block][token]
/// [row]`).
#[repr(C, align(64))]
struct Scratch {
    levels: [[u8; ROW]; QK_K / 4],
    sums: [[[i32; STRIP_ROWS]; TOKENS]; MOST_SUBS],
}

/// The configuration for sub-blocks of `sub` values (palette 1): tiles 0-3 hold 16 tokens' sums
/// for 16 rows (`i32`, 64 bytes a row); tiles 4 and 5, 16 tokens' `sub` levels; tiles 6 and 7, a
/// sub-block's `sub / 4` rows of 16 rows × 4 levels. Four accumulators, so that four sub-blocks'
/// products are in flight before the first is stored.
const fn config(sub: u8) -> Config {
    let mut bytes_per_row = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        (bytes_per_row[t], rows[t]) = match t {
            0..4 => (ROW as u16, 16),
            4 | 5 => (sub as u16, 16),
            _ => (ROW as u16, sub / 4),
        };
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

/// This thread's tiles, configured for sub-blocks of `sub` values until dropped (which releases
/// them), with the buffers their operands and sums pass through (20 KiB, allocated once per
/// configuration). Not `Send`: the configuration belongs to the thread that loaded it.
pub(in crate::backend::cpu) struct StripTiles {
    sub: usize,
    scratch: Box<Scratch>,
    _configured: Configured,
}

impl StripTiles {
    /// Values per sub-block (per scale) of the formats the tiles take: the K formats.
    fn sub_block(ty: QuantType) -> Option<usize> {
        match ty {
            QuantType::Q4_K | QuantType::Q5_K => Some(32),
            QuantType::Q6_K => Some(16),
            _ => None,
        }
    }

    /// Whether the strip kernels of `ty` multiply on the tiles.
    pub(in crate::backend::cpu) fn take(ty: QuantType) -> bool {
        StripTiles::sub_block(ty).is_some()
    }

    /// Configures this thread's tiles for `ty`'s sub-blocks; `None` for a format the tiles do not
    /// [`take`](Self::take).
    pub(in crate::backend::cpu) fn configure(amx: AmxInt8, ty: QuantType) -> Option<StripTiles> {
        let _ = amx;
        let sub = StripTiles::sub_block(ty)?;
        let config = if sub == 32 { &CONFIG_32 } else { &CONFIG_16 };
        Some(StripTiles {
            sub,
            scratch: Box::new(Scratch {
                levels: [[0; ROW]; QK_K / 4],
                sums: [[[0; STRIP_ROWS]; TOKENS]; MOST_SUBS],
            }),
            // SAFETY: `amx` exists, so the CPU has AMX-TILE and AMX-INT8 and the kernel granted
            // the tile state; `config` is a valid palette-1 configuration.
            _configured: unsafe { Configured::load(config) },
        })
    }

    /// `scratch.sums[s][t][r] = Σ_j x[t · stride + s · sub + j] · levels_s[r][j]` for the `QK_K /
    /// sub` sub-blocks `s` of one block, 16 tokens `t` (their signed levels, rows `stride` bytes
    /// apart) and the 16 rows `r` whose decoded levels `scratch.levels` holds (the kernels store
    /// them there first).
    ///
    /// # Panics
    /// When `x` is too short for 16 rows of one block.
    fn sums(&mut self, x: &[i8], stride: usize) {
        let (subs, scratch) = (QK_K / self.sub, &mut *self.scratch);
        assert!(
            stride >= QK_K && x.len() >= (TOKENS - 1) * stride + QK_K,
            "int8 strip tiles: the tokens are too short for a block"
        );
        // SAFETY: a `StripTiles` exists only after `LDTILECFG` configured this thread's tiles for
        // sub-blocks of `sub` values (it is not `Send`). Each of the `subs / 4` rounds loads, per
        // sub-block `s`, 16 rows of `sub` bytes of `x` at `s · sub + t · stride` (inside `x` by
        // the assertion: `subs · sub = QK_K`) and `sub / 4` rows of 64 bytes of `levels` at
        // `s · 16 · sub` (inside its `QK_K / 4` rows), and stores 16 rows of 64 bytes at
        // `sums[s]`, `s < subs <= MOST_SUBS`.
        unsafe {
            std::arch::asm!(
                "2:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{x} + {stride}*1]",
                "tileloadd tmm6, [{b} + {row}*1]",
                "tdpbsud tmm0, tmm4, tmm6",
                "add {x}, {sub}",
                "add {b}, {step_b}",
                "tileloadd tmm5, [{x} + {stride}*1]",
                "tileloadd tmm7, [{b} + {row}*1]",
                "tdpbsud tmm1, tmm5, tmm7",
                "add {x}, {sub}",
                "add {b}, {step_b}",
                "tileloadd tmm4, [{x} + {stride}*1]",
                "tileloadd tmm6, [{b} + {row}*1]",
                "tdpbsud tmm2, tmm4, tmm6",
                "add {x}, {sub}",
                "add {b}, {step_b}",
                "tileloadd tmm5, [{x} + {stride}*1]",
                "tileloadd tmm7, [{b} + {row}*1]",
                "tdpbsud tmm3, tmm5, tmm7",
                "add {x}, {sub}",
                "add {b}, {step_b}",
                "tilestored [{c} + {row}*1], tmm0",
                "tilestored [{c} + {row}*1 + 1024], tmm1",
                "tilestored [{c} + {row}*1 + 2048], tmm2",
                "tilestored [{c} + {row}*1 + 3072], tmm3",
                "add {c}, 4096",
                "sub {n}, 1",
                "jnz 2b",
                x = inout(reg) x.as_ptr() => _,
                stride = in(reg) stride,
                b = inout(reg) scratch.levels.as_ptr() => _,
                row = in(reg) ROW,
                sub = in(reg) self.sub,
                step_b = in(reg) self.sub / 4 * ROW,
                c = inout(reg) scratch.sums.as_mut_ptr() => _,
                n = inout(reg) subs / 4 => _,
                options(nostack),
            );
        }
    }
}

/// The Q4_K (`FIVE` false) or Q5_K strip times the 16 tokens from `t0` into `out`:
/// [`super::tokens_k4`]'s sums and scaling, with the dot products on the tiles.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI (an [`AmxInt8`] says so); `tiles` are configured for
/// the format; the strip holds `k / 256` strip blocks of its format; tokens `t0..t0 + 16` lie in
/// `a` and `sums.values`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tokens_k4<const FIVE: bool>(
    tiles: &mut StripTiles,
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let ty = if FIVE {
        QuantType::Q5_K
    } else {
        QuantType::Q4_K
    };
    let bytes = strip_block_bytes(ty);
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract, as `super::tokens_k4`'s: strip block `i` is `bytes` bytes
        // at `i · bytes`, and values `256 · i..256 · (i + 1)` of each token, their scales and
        // sums, lie in `a` and `sums`; sub-block `s`'s 8 groups go to rows `8s..8s + 8` of the
        // 64 rows of `scratch.levels`; `loadu`/`storeu` take any alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            for s in 0..QK_K / BLOCK {
                prefetch_ahead(
                    SEVERAL_TOKENS_PREFETCH,
                    block.add(s * bytes / 8),
                    bytes / 8 + 1,
                );
                for (g, w) in super::k4_groups::<FIVE>(block, s).into_iter().enumerate() {
                    _mm512_storeu_si512(tiles.scratch.levels[8 * s + g].as_mut_ptr().cast(), w);
                }
            }
            tiles.sums(&a.q[t0 * k + i * QK_K..], k);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(32).cast()));
            let bytes16 = |at: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(at).cast())))
            };
            // `(d · sc)` and `dmin · m` of the 16 rows per sub-block, as the dequantizer forms them.
            let scale: [__m512; QK_K / BLOCK] =
                std::array::from_fn(|s| _mm512_mul_ps(d, bytes16(64 + 16 * s)));
            let min: [__m512; QK_K / BLOCK] =
                std::array::from_fn(|s| _mm512_mul_ps(dmin, bytes16(192 + 16 * s)));
            // Token by token, so that its accumulator stays in a register over the sub-blocks:
            // each accumulator sees the VNNI kernel's operations in its order.
            for (t, acc) in acc.iter_mut().enumerate() {
                let first = (t0 + t) * k + i * QK_K;
                let xd = a.d.as_ptr().add(first / BLOCK);
                let xsum = sums.values.as_ptr().add(first / BLOCK);
                for s in 0..QK_K / BLOCK {
                    let dot = _mm512_loadu_si512(tiles.scratch.sums[s][t].as_ptr().cast());
                    let scale = _mm512_mul_ps(scale[s], _mm512_set1_ps(*xd.add(s)));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
                    *acc = _mm512_fnmadd_ps(min[s], _mm512_set1_ps(*xsum.add(s)), *acc);
                }
            }
        }
    }
    super::store(acc, out);
}

/// The Q6_K strip times the 16 tokens from `t0` into `out`: [`super::tokens_q6_k`]'s sums and
/// scaling, with the dot products on the tiles.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI (an [`AmxInt8`] says so); `tiles` are configured for
/// Q6_K; the strip holds `k / 256` Q6_K strip blocks; tokens `t0..t0 + 16` lie in `a` and
/// `sums.starts` (per 16 values).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tokens_q6_k(
    tiles: &mut StripTiles,
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let bytes = strip_block_bytes(QuantType::Q6_K);
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract, as `super::tokens_q6_k`'s: strip block `i` is `bytes`
        // bytes at `i · bytes`, and values `256 · i..256 · (i + 1)` of each token, their scales
        // and sums, lie in `a` and `sums`; chunk `c`'s 8 groups (its two halves' 4 each) go to
        // rows `8c..8c + 8` of the 64 rows of `scratch.levels`; `loadu`/`storeu` take any
        // alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            for c in 0..QK_K / BLOCK {
                prefetch_ahead(
                    SEVERAL_TOKENS_PREFETCH,
                    block.add(c * bytes / 8),
                    bytes / 8 + 1,
                );
                for (g, w) in super::q6_k_groups(block, c).into_iter().enumerate() {
                    _mm512_storeu_si512(tiles.scratch.levels[8 * c + g].as_mut_ptr().cast(), w);
                }
            }
            tiles.sums(&a.q[t0 * k + i * QK_K..], k);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let scale: [__m512; QK_K / 16] = std::array::from_fn(|h| {
                let sc = _mm_loadu_si128(block.add(32 + 16 * h).cast());
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)))
            });
            // Token by token, so that its accumulator stays in a register over the halves: each
            // accumulator sees the VNNI kernel's operations in its order.
            for (t, acc) in acc.iter_mut().enumerate() {
                let first = (t0 + t) * k + i * QK_K;
                let (xd, starts) = (a.d.as_ptr().add(first / BLOCK), sums.starts.as_ptr());
                for c in 0..QK_K / BLOCK {
                    // The VNNI kernel's integers: `−32 · Σ x` of each half, plus the levels' dot.
                    let dots = [2 * c, 2 * c + 1].map(|h| {
                        _mm512_add_epi32(
                            _mm512_set1_epi32(*starts.add(first / 16 + h)),
                            _mm512_loadu_si512(tiles.scratch.sums[h][t].as_ptr().cast()),
                        )
                    });
                    let xd = _mm512_set1_ps(*xd.add(c));
                    *acc = super::q6_k_chunk(*acc, dots, [scale[2 * c], scale[2 * c + 1]], xd);
                }
            }
        }
    }
    super::store(acc, out);
}
