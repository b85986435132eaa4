//! 32 × 32 blocks of `bf16` products, the unit of work of the `bf16` attention
//! ([`super::attention_tiles`]), on either of two units: AMX tiles ([`Tiles`], 16 × 16 sums an
//! instruction) or, on CPUs with AVX-512 BF16 and no tiles (AMD's Zen 4 and later), vector registers
//! with `vdpbf16ps` ([`Vectors`], 16 sums of two products an instruction). Both compute
//! [`Tiles::block_into`]'s contract: exact products of `bf16` pairs summed in `f32`; only the
//! order of the additions differs, within `f32`'s rounding.
//!
//! Before the vector unit, a CPU without tiles widened the `bf16` attention to `f32` and multiplied
//! with `gemm` (two `f32` products per block of keys, twice the bytes of every operand).

use super::bf16_tiles::{Amx, BLOCK, STEP_PAIRS, Tiles, check_block};
use crate::dtype::bf16;

/// A unit that computes blocks: a proof that the CPU has it, which each task turns into its
/// [`Blocks`] (AMX: configuring the thread's tiles).
pub(super) trait BlockUnit: Copy + Send + Sync {
    /// What a task computes its blocks with.
    type Blocks: Blocks;

    /// Readies this thread for blocks, until the result is dropped.
    fn start(self) -> Self::Blocks;
}

/// 32 × 32 blocks of sums, as [`Tiles::block_into`] states them.
pub(super) trait Blocks {
    /// `sums = left · right` (or `+=`, with `accumulate`) over `steps` steps of [`STEP_PAIRS`]
    /// pairs: [`Tiles::block_into`]'s operands, layout and panics.
    fn block_into(
        &mut self,
        left: (&[bf16], usize),
        right: &[u32],
        steps: usize,
        accumulate: bool,
        sums: (&mut [f32], usize),
    );
}

impl BlockUnit for Amx {
    type Blocks = Tiles;

    fn start(self) -> Tiles {
        Tiles::configure(self)
    }
}

impl Blocks for Tiles {
    fn block_into(
        &mut self,
        left: (&[bf16], usize),
        right: &[u32],
        steps: usize,
        accumulate: bool,
        sums: (&mut [f32], usize),
    ) {
        Tiles::block_into(self, left, right, steps, accumulate, sums);
    }
}

/// Proof that this CPU has AVX-512F and AVX-512 BF16: only [`detect`](Self::detect) makes one.
#[derive(Clone, Copy, Debug)]
pub(super) struct Vectors {
    _detected: (),
}

impl Vectors {
    /// The proof, where the CPU has AVX-512F and AVX-512 BF16.
    pub(super) fn detect() -> Option<Vectors> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
            return Some(Vectors { _detected: () });
        }
        None
    }
}

impl BlockUnit for Vectors {
    type Blocks = Vectors;

    fn start(self) -> Vectors {
        self
    }
}

/// Rows of a block whose sums one pass keeps in registers: 8 rows × 32 columns are 16 of the 32
/// `zmm` registers, with two for the right operand's pair of 32 columns and one for a left pair.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 8;

impl Blocks for Vectors {
    fn block_into(
        &mut self,
        (left, left_stride): (&[bf16], usize),
        right: &[u32],
        steps: usize,
        accumulate: bool,
        (sums, sums_stride): (&mut [f32], usize),
    ) {
        // The same contract as the tiles' (`Tiles::block_into`).
        check_block((left, left_stride), right, steps, (sums, sums_stride));
        #[cfg(target_arch = "x86_64")]
        for first in (0..BLOCK).step_by(ROWS) {
            // SAFETY: a `Vectors` exists only where the CPU has AVX-512F and AVX-512 BF16
            // (`detect`); the assertion above keeps every read and write of rows
            // `first..first + ROWS` inside the slices (`block_avx512`'s contract).
            unsafe {
                block_avx512(
                    (left, left_stride),
                    right,
                    steps * STEP_PAIRS,
                    accumulate,
                    (sums, sums_stride),
                    first,
                )
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("a Vectors is only made on x86-64 with AVX-512 BF16")
    }
}

/// Rows `first..first + ROWS` of a block over `pairs` pairs: per pair, the right operand's 32
/// columns in two registers, each row's pair broadcast and multiplied into its two accumulators.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512 BF16. Rows `first..first + ROWS` of `left` hold `2 ·
/// pairs` elements at `r · left_stride`, `right` holds `pairs · 32` pairs, and rows of `sums` hold
/// 32 floats at `r · sums_stride`, for those rows (the loads and stores are unchecked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block_avx512(
    (left, left_stride): (&[bf16], usize),
    right: &[u32],
    pairs: usize,
    accumulate: bool,
    (sums, sums_stride): (&mut [f32], usize),
    first: usize,
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_loadu_si512,
        _mm512_set1_epi32, _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let out = sums.as_mut_ptr().wrapping_add(first * sums_stride);
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    if accumulate {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row `first + r` of `sums` holds 32 floats (the caller's contract).
            unsafe {
                let row = out.add(r * sums_stride);
                *acc = [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))];
            }
        }
    }
    let rows = left.as_ptr().wrapping_add(first * left_stride);
    for p in 0..pairs {
        // SAFETY: `right` holds `pairs · 32` pairs (the caller's contract), so the two 64-byte
        // loads at `32 p` and `32 p + 16` stay inside; the casts reread 512 bits as 32 bf16.
        let (b0, b1) = unsafe {
            let at = right.as_ptr().add(p * BLOCK);
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(16).cast())),
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row `first + r` holds `2 · pairs` elements (the caller's contract), so the
            // 4 bytes of pair `p` (elements 2p and 2p + 1, the even one in the low half as the
            // panels hold them) are inside; a `bf16` row is 2-aligned, hence the unaligned read.
            let a = unsafe {
                let pair = rows.add(r * left_stride + 2 * p).cast::<u32>();
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    pair.read_unaligned() as i32
                ))
            };
            acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row `first + r` of `sums` holds 32 floats (the caller's contract).
        unsafe {
            let row = out.add(r * sums_stride);
            _mm512_storeu_ps(row, acc[0]);
            _mm512_storeu_ps(row.add(16), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::bf16_of_f32;

    /// Blocks of every unit this CPU has against `f64` sums of the same `bf16` values: strided
    /// rows, one and three steps, stored and accumulated, into a wider matrix of sums.
    #[test]
    fn blocks_match_f64_sums() {
        let (vectors, amx) = (Vectors::detect(), Amx::detect());
        if let Some(vectors) = vectors {
            check_against_f64("avx512-bf16", vectors);
        }
        if let Some(amx) = amx {
            check_against_f64("amx", amx);
        }
        if vectors.is_none() && amx.is_none() {
            eprintln!("bf16 blocks: not run (this CPU has neither AVX-512 BF16 nor AMX)");
        }
    }

    /// `unit`'s blocks against f64 sums.
    fn check_against_f64(name: &str, unit: impl BlockUnit) {
        let mut rng = crate::rng::Rng::new(5);
        let mut value =
            || bf16_of_f32((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0);
        for (steps, left_stride, sums_stride) in [(1, 40, 32), (3, 3 * 32 + 5, 70)] {
            let depth = steps * 2 * STEP_PAIRS;
            let left: Vec<bf16> = (0..BLOCK * left_stride).map(|_| value()).collect();
            let right: Vec<u32> = (0..depth / 2 * BLOCK)
                .map(|_| u32::from(value().to_bits()) | u32::from(value().to_bits()) << 16)
                .collect();
            let initial: Vec<f32> = (0..BLOCK * sums_stride).map(|_| value().to_f32()).collect();
            let half = |pair: u32, i: usize| {
                f64::from(bf16::from_bits((pair >> (16 * (i % 2))) as u16).to_f32())
            };
            for accumulate in [false, true] {
                let mut sums = initial.clone();
                let mut blocks = unit.start();
                blocks.block_into(
                    (&left, left_stride),
                    &right,
                    steps,
                    accumulate,
                    (&mut sums, sums_stride),
                );
                for r in 0..BLOCK {
                    for c in 0..sums_stride {
                        let got = sums[r * sums_stride + c];
                        if c >= BLOCK {
                            assert_eq!(got, initial[r * sums_stride + c], "{name}: outside");
                            continue;
                        }
                        let mut want = if accumulate {
                            f64::from(initial[r * sums_stride + c])
                        } else {
                            0.0
                        };
                        for i in 0..depth {
                            let a = f64::from(left[r * left_stride + i].to_f32());
                            want += a * half(right[i / 2 * BLOCK + c], i);
                        }
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-5 * (depth as f64 + 1.0),
                            "{name}, {steps} steps, accumulate {accumulate}, ({r}, {c}): \
                                 {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
