//! Runs of stored elements widened to their compute type, in vector registers where the CPU has
//! them.
//!
//! `Math::load` widens one element. For `f16` that is `half`'s conversion, which checks the CPU
//! for F16C on every element and so keeps a loop over a row scalar: a paged KV cache of `f16`
//! widened that way cost more than reading it. [`Widen::widen`] converts a whole run: `f16`
//! through `vcvtph2ps` (AVX-512 F, or F16C on 8 at a time), `bf16` by its shift (which the
//! compiler vectorises), the wider types by a copy. Every path gives `Math::load`'s bits: widening
//! to `f32` is exact (a signalling NaN is quieted, as `half` does).

use crate::backend::op::Math;
use crate::dtype::{bf16, f16};

/// Element types that widen a run at once.
pub(super) trait Widen: Math {
    /// `into[i] = xs[i].load()` for every `i`; the slices have one length.
    fn widen(xs: &[Self], into: &mut [Self::Compute]);
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(xs: &[f32], into: &mut [f32]) {
        into.copy_from_slice(xs);
    }
}

impl Widen for f64 {
    #[inline(always)]
    fn widen(xs: &[f64], into: &mut [f64]) {
        into.copy_from_slice(xs);
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn widen(xs: &[bf16], into: &mut [f32]) {
        assert_eq!(xs.len(), into.len(), "widen: runs of one length");
        for (w, x) in into.iter_mut().zip(xs) {
            // A bf16 is the high half of the f32 it widens to; a NaN is quieted, as `to_f32`
            // does (a select, which the loop keeps vectorised).
            let bits = u32::from(x.to_bits()) << 16;
            let nan = bits & 0x7fff_ffff > 0x7f80_0000;
            *w = f32::from_bits(if nan { bits | 0x0040_0000 } else { bits });
        }
    }
}

/// The vector unit that converts runs between `f32` and the 16-bit types here and in
/// [`super::narrow`], the best this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HalfUnit {
    /// AVX-512 F, BW and VL: 16 lanes, masked tails.
    Avx512,
    /// F16C and AVX: 8 lanes (`f16` only).
    F16c,
    /// Neither: element by element.
    Portable,
}

impl HalfUnit {
    /// The best unit this CPU has.
    #[inline]
    pub(super) fn detect() -> HalfUnit {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                return HalfUnit::Avx512;
            }
            if has!("f16c") && has!("avx") {
                return HalfUnit::F16c;
            }
        }
        HalfUnit::Portable
    }
}

/// A vector version of a run conversion: `unsafe` for its target features.
pub(super) type VectorRun<A, B> = unsafe fn(&[A], &mut [B]);

/// A run conversion in its versions, one per [`HalfUnit`]; [`Versions::run`] calls the best this
/// CPU has.
pub(super) struct Versions<A, B> {
    /// Needs at most AVX-512 F, BW and VL, and runs of one length (`None` off x86-64).
    pub(super) avx512: Option<VectorRun<A, B>>,
    /// Needs at most F16C and AVX, and runs of one length; `None` off x86-64 or where the
    /// portable version is as good.
    pub(super) f16c: Option<VectorRun<A, B>>,
    /// Any CPU.
    pub(super) portable: fn(&[A], &mut [B]),
}

impl<A, B> Versions<A, B> {
    /// `versions(xs, into)` on this CPU's best unit.
    ///
    /// # Panics
    /// When the runs' lengths differ.
    #[inline]
    pub(super) fn run(&self, xs: &[A], into: &mut [B]) {
        assert_eq!(xs.len(), into.len(), "conversion: runs of one length");
        match (HalfUnit::detect(), self.avx512, self.f16c) {
            // SAFETY: the CPU has AVX-512 F, BW and VL, all the version may need (its field's
            // contract); the lengths agree (asserted).
            (HalfUnit::Avx512, Some(avx512), _) => unsafe { avx512(xs, into) },
            // SAFETY: the CPU has F16C and AVX, all the version may need; the lengths agree.
            (HalfUnit::F16c, _, Some(f16c)) => unsafe { f16c(xs, into) },
            _ => (self.portable)(xs, into),
        }
    }
}

impl Widen for f16 {
    #[inline]
    fn widen(xs: &[f16], into: &mut [f32]) {
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

/// [`Widen::widen`] of `f16` one element at a time, on any CPU.
fn f16_portable(xs: &[f16], into: &mut [f32]) {
    for (w, x) in into.iter_mut().zip(xs) {
        *w = x.to_f32();
    }
}

/// [`Widen::widen`] of `f16`, 16 elements a `vcvtph2ps`, the tail through a masked load and store.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL (the masked tail); `into.len() == xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn f16_avx512(xs: &[f16], into: &mut [f32]) {
    use std::arch::x86_64::{
        _mm256_loadu_si256, _mm256_maskz_loadu_epi16, _mm512_cvtph_ps, _mm512_mask_storeu_ps,
        _mm512_storeu_ps,
    };
    let len = xs.len();
    let full = len / 16 * 16;
    let (from, to) = (xs.as_ptr().cast::<u16>(), into.as_mut_ptr());
    for at in (0..full).step_by(16) {
        // SAFETY: elements `at..at + 16` lie in both runs (`at + 16 <= full <= len`); `loadu` and
        // `storeu` take any alignment.
        unsafe {
            let halves = _mm256_loadu_si256(from.add(at).cast());
            _mm512_storeu_ps(to.add(at), _mm512_cvtph_ps(halves));
        }
    }
    if full < len {
        let mask = ((1u32 << (len - full)) - 1) as u16;
        // SAFETY: the mask selects elements `full..len` of both runs; masked-off lanes touch no
        // memory.
        unsafe {
            let halves = _mm256_maskz_loadu_epi16(mask, from.add(full).cast());
            _mm512_mask_storeu_ps(to.add(full), mask, _mm512_cvtph_ps(halves));
        }
    }
}

/// [`Widen::widen`] of `f16`, 8 elements a `vcvtph2ps`, the tail one by one.
///
/// # Safety
/// The CPU must have F16C and AVX; `into.len() == xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_f16c(xs: &[f16], into: &mut [f32]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let len = xs.len();
    let full = len / 8 * 8;
    let (from, to) = (xs.as_ptr().cast::<u16>(), into.as_mut_ptr());
    for at in (0..full).step_by(8) {
        // SAFETY: elements `at..at + 8` lie in both runs; `loadu` and `storeu` take any alignment.
        unsafe {
            _mm256_storeu_ps(
                to.add(at),
                _mm256_cvtph_ps(_mm_loadu_si128(from.add(at).cast())),
            )
        };
    }
    f16_portable(&xs[full..], &mut into[full..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each version this CPU runs, by name.
    #[allow(clippy::type_complexity)]
    fn f16_versions() -> Vec<(&'static str, fn(&[f16], &mut [f32]))> {
        let mut versions: Vec<(&'static str, fn(&[f16], &mut [f32]))> =
            vec![("portable", f16_portable), ("dispatched", f16::widen)];
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
        versions
    }

    /// Every f16 bit pattern (NaNs, infinities, subnormals, both zeros), in runs of every tail
    /// length, widens to what `to_f32` gives, bit for bit, in every version this CPU runs.
    #[test]
    fn every_f16_widens_to_the_bits_of_to_f32() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for (name, widen) in f16_versions() {
            for len in [1, 7, 8, 15, 16, 17, 31, 33, 64, 65_536] {
                for start in [0, 3, 40_000] {
                    let end = (start + len).min(all.len());
                    let xs = &all[start..end];
                    let mut got = vec![0.0f32; xs.len()];
                    widen(xs, &mut got);
                    for (x, g) in xs.iter().zip(&got) {
                        let want = x.to_f32().to_bits();
                        assert_eq!(g.to_bits(), want, "{name}: {:#06x}", x.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn every_bf16_widens_to_the_bits_of_to_f32() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut got = vec![0.0f32; all.len()];
        bf16::widen(&all, &mut got);
        for (x, g) in all.iter().zip(&got) {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "{:#06x}", x.to_bits());
        }
    }
}
