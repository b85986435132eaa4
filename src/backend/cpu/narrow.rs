//! Runs of `f32` rounded to a 16-bit type, in vector registers where the CPU has them: the other
//! direction of [`super::widen`].
//!
//! Autocast rounds every weight to `bf16` or `f16` once a step, and a 16-bit KV cache rounds each
//! step's keys and values, so these runs are long. One element at a time they were a tenth of a
//! `bf16` forward pass on an AVX-512 CPU (the baseline build's 4-lane SSE2, through a closure per
//! element); [`Narrow::narrow`] converts a run at once. `bf16`: the branch-free round to nearest
//! even of [`bf16_bits_of_f32`], compiled for AVX-512 where the CPU has it (the same code, so the
//! same bits). `f16`: `vcvtps2ph`, IEEE's round to nearest even with subnormals kept (AVX-512 F on
//! 16 at a time, F16C on 8), which is what `f16::from_f32` computes; a NaN stays a quiet NaN with
//! its payload's high bits, as there.

use super::widen::Versions;
use crate::dtype::{bf16, f16};
use crate::fastmath::bf16_bits_of_f32;

/// 16-bit element types that round a run of `f32` at once.
pub(super) trait Narrow: Sized {
    /// `into[i]` = `xs[i]` rounded to nearest, ties to even; the slices have one length.
    fn narrow(xs: &[f32], into: &mut [Self]);
}

impl Narrow for bf16 {
    #[inline]
    fn narrow(xs: &[f32], into: &mut [bf16]) {
        Versions {
            #[cfg(target_arch = "x86_64")]
            avx512: Some(bf16_avx512),
            #[cfg(not(target_arch = "x86_64"))]
            avx512: None,
            // The portable loop is already vectorised for the baseline.
            f16c: None,
            portable: bf16_rounded,
        }
        .run(xs, into);
    }
}

impl Narrow for f16 {
    #[inline]
    fn narrow(xs: &[f32], into: &mut [f16]) {
        Versions {
            #[cfg(target_arch = "x86_64")]
            avx512: Some(f16_avx512),
            #[cfg(target_arch = "x86_64")]
            f16c: Some(f16_f16c),
            #[cfg(not(target_arch = "x86_64"))]
            avx512: None,
            #[cfg(not(target_arch = "x86_64"))]
            f16c: None,
            portable: f16_portable,
        }
        .run(xs, into);
    }
}

/// [`Narrow::narrow`] to `bf16` on any CPU (the loop vectorises to the build's baseline, or to the
/// target features of a function it is inlined into: the bf16 products' stores of their tiles).
#[inline(always)]
pub(super) fn bf16_rounded(xs: &[f32], into: &mut [bf16]) {
    for (n, &x) in into.iter_mut().zip(xs) {
        *n = bf16::from_bits(bf16_bits_of_f32(x));
    }
}

/// [`bf16_rounded`] compiled for AVX-512: the same code, 16 lanes wide.
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_avx512(xs: &[f32], into: &mut [bf16]) {
    bf16_rounded(xs, into);
}

/// [`Narrow::narrow`] to `f16` one element at a time, on any CPU.
fn f16_portable(xs: &[f32], into: &mut [f16]) {
    for (n, &x) in into.iter_mut().zip(xs) {
        *n = f16::from_f32(x);
    }
}

/// `vcvtps2ph`'s rounding: to nearest, ties to even (not MXCSR's mode); AVX-512's form also
/// suppresses exceptions, which F16C's three-bit immediate cannot say.
#[cfg(target_arch = "x86_64")]
const NEAREST: i32 =
    std::arch::x86_64::_MM_FROUND_TO_NEAREST_INT | std::arch::x86_64::_MM_FROUND_NO_EXC;

/// [`Narrow::narrow`] to `f16`, 16 elements a `vcvtps2ph`, the tail through a masked load and
/// store.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL (the masked tail); `into.len() == xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn f16_avx512(xs: &[f32], into: &mut [f16]) {
    use std::arch::x86_64::{
        _mm256_storeu_si256, _mm512_cvtps_ph, _mm512_loadu_ps, _mm512_mask_cvtps_ph,
        _mm512_maskz_loadu_ps,
    };
    let len = xs.len();
    let full = len / 16 * 16;
    let (from, to) = (xs.as_ptr(), into.as_mut_ptr().cast::<u16>());
    for at in (0..full).step_by(16) {
        // SAFETY: elements `at..at + 16` lie in both runs (`at + 16 <= full <= len`); `loadu` and
        // `storeu` take any alignment.
        unsafe {
            let halves = _mm512_cvtps_ph::<NEAREST>(_mm512_loadu_ps(from.add(at)));
            _mm256_storeu_si256(to.add(at).cast(), halves);
        }
    }
    if full < len {
        let mask = ((1u32 << (len - full)) - 1) as u16;
        // SAFETY: the mask selects elements `full..len` of both runs; masked-off lanes touch no
        // memory.
        unsafe {
            let wide = _mm512_maskz_loadu_ps(mask, from.add(full));
            let halves = _mm512_mask_cvtps_ph::<NEAREST>(
                std::arch::x86_64::_mm256_setzero_si256(),
                mask,
                wide,
            );
            std::arch::x86_64::_mm256_mask_storeu_epi16(to.add(full).cast(), mask, halves);
        }
    }
}

/// [`Narrow::narrow`] to `f16`, 8 elements a `vcvtps2ph`, the tail one by one.
///
/// # Safety
/// The CPU must have F16C and AVX; `into.len() == xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_f16c(xs: &[f32], into: &mut [f16]) {
    use std::arch::x86_64::{_mm_storeu_si128, _mm256_cvtps_ph, _mm256_loadu_ps};
    let len = xs.len();
    let full = len / 8 * 8;
    let (from, to) = (xs.as_ptr(), into.as_mut_ptr().cast::<u16>());
    for at in (0..full).step_by(8) {
        // SAFETY: elements `at..at + 8` lie in both runs; `loadu` and `storeu` take any alignment.
        unsafe {
            let halves = _mm256_cvtps_ph::<{ std::arch::x86_64::_MM_FROUND_TO_NEAREST_INT }>(
                _mm256_loadu_ps(from.add(at)),
            );
            _mm_storeu_si128(to.add(at).cast(), halves);
        }
    }
    f16_portable(&xs[full..], &mut into[full..]);
}

#[cfg(test)]
mod tests {
    use super::super::widen::HalfUnit;
    use super::*;

    /// `f32` patterns that reach every rounding case of both types: every upper half (sign,
    /// exponent, `bf16`'s mantissa) with lower halves below, at and above the halfway points of
    /// `bf16` (bit 15) and of normal `f16` (bit 12), odd and even kept bits, plus a spread of all
    /// other patterns. Under a million, so memcheck runs it in seconds.
    fn patterns() -> Vec<f32> {
        let lows = [
            0u32, 1, 0x0fff, 0x1000, 0x1001, 0x2fff, 0x3000, 0x3001, 0x7fff, 0x8000, 0x8001,
            0xf000, 0xffff,
        ];
        let mut xs: Vec<f32> = (0..=u32::from(u16::MAX))
            .flat_map(|high| lows.map(|low| f32::from_bits(high << 16 | low)))
            .collect();
        xs.extend((0..u32::MAX).step_by(65_537).map(f32::from_bits));
        xs
    }

    /// A version of a conversion, by name.
    type Version<T> = (&'static str, fn(&[f32], &mut [T]));

    /// Rounds `xs` with `narrow` in runs of every tail length and compares each element's bits
    /// with `scalar`'s.
    fn agrees<T: Copy + Default>(
        name: &str,
        xs: &[f32],
        narrow: fn(&[f32], &mut [T]),
        scalar: impl Fn(f32) -> T,
        bits: impl Fn(T) -> u16,
    ) {
        let mut got = vec![T::default(); xs.len()];
        narrow(xs, &mut got);
        for (&x, &g) in xs.iter().zip(&got) {
            assert_eq!(bits(g), bits(scalar(x)), "{name}: {:#010x}", x.to_bits());
        }
        for len in [1, 7, 8, 15, 16, 17, 31, 33] {
            let run = &xs[1000..1000 + len];
            let mut got = vec![T::default(); len];
            narrow(run, &mut got);
            for (&x, &g) in run.iter().zip(&got) {
                assert_eq!(
                    bits(g),
                    bits(scalar(x)),
                    "{name}, {len}: {:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn bf16_rounds_as_bf16_of_f32_in_every_version() {
        let mut versions: Vec<Version<bf16>> =
            vec![("dispatched", bf16::narrow), ("portable", bf16_rounded)];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
            versions.push(("avx512", |xs, into| {
                // SAFETY: the CPU has AVX-512 F and BW (checked above).
                unsafe { bf16_avx512(xs, into) }
            }));
        }
        let xs = patterns();
        for (name, narrow) in versions {
            agrees(
                name,
                &xs,
                narrow,
                |x| bf16::from_bits(bf16_bits_of_f32(x)),
                bf16::to_bits,
            );
        }
    }

    #[test]
    fn f16_rounds_as_from_f32_in_every_version() {
        let mut versions: Vec<Version<f16>> =
            vec![("dispatched", f16::narrow), ("portable", f16_portable)];
        #[cfg(target_arch = "x86_64")]
        {
            if HalfUnit::detect() == HalfUnit::Avx512 {
                versions.push(("avx512", |xs, into| {
                    // SAFETY: the CPU has AVX-512 F, BW and VL (checked above); callers pass one
                    // length.
                    unsafe { f16_avx512(xs, into) }
                }));
            }
            if std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx") {
                versions.push(("f16c", |xs, into| {
                    // SAFETY: the CPU has F16C and AVX (checked above); callers pass one length.
                    unsafe { f16_f16c(xs, into) }
                }));
            }
        }
        let xs = patterns();
        for (name, narrow) in versions {
            agrees(name, &xs, narrow, f16::from_f32, f16::to_bits);
        }
    }
}
