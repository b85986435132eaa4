//! Branch-free `f32` `exp` and `tanh` that the compiler vectorises.
//!
//! The platform's `expf`/`tanhf` are scalar calls (~8 ns each), so any elementwise loop that uses
//! them runs an order of magnitude slower than plain arithmetic. These versions use only arithmetic,
//! comparisons-as-selects and bit operations available in baseline SSE2, so a loop over a slice
//! becomes SIMD code. Accuracy, measured against `f64` by the tests over the whole range: `exp` within
//! 2 ulp of the correctly rounded result, `tanh` within 3 ulp (2.14 at worst in the test's samples);
//! results below `f32::MIN_POSITIVE` (`exp(x)` for `x < -87.33`) flush to zero. `f64` keeps the
//! platform's functions.

/// `1.5 * 2^23`: adding it rounds a float of magnitude below `2^22` to an integer, which then sits in
/// the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `k * LN2_HI` is exact for the `k` that occur (Cody and Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Above this, `e^x` overflows `f32`.
const EXP_MAX: f32 = 88.722_83;
/// Below this, `e^x` is subnormal; it is flushed to zero.
const EXP_MIN: f32 = -87.336_55;

/// `e^x`.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let xc = x.clamp(EXP_MIN, EXP_MAX); // keeps NaN
    // x = k ln2 + r with |r| <= ln2 / 2, and e^x = 2^k e^r.
    let shifted = xc * LOG2_E + ROUND_MAGIC;
    let k = shifted - ROUND_MAGIC;
    let k_int = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // e^r by its Taylor series to degree 7: the first omitted term is below 2^-27 for |r| <= ln2 / 2.
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^k from its exponent bits; k is in -126..=128 after the clamp.
    let k_half = k_int >> 1; // split so that each factor's exponent stays in range (k = 128)
    let scale_a = f32::from_bits((k_half.wrapping_add(127) as u32) << 23);
    let scale_b = f32::from_bits((k_int.wrapping_sub(k_half).wrapping_add(127) as u32) << 23);
    let y = p * scale_a * scale_b;
    let y = if x > EXP_MAX { f32::INFINITY } else { y };
    if x < EXP_MIN { 0.0 } else { y }
}

/// The bits of the `bf16` nearest `x` (ties to even; NaN stays NaN, quiet): the same value as
/// `half::bf16::from_f32`, without branches, so a loop of conversions becomes SIMD code.
#[inline(always)]
pub(crate) fn bf16_bits_of_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    // Adding 0x7fff plus the kept part's lowest bit carries into it exactly when the dropped half
    // is above a tie, or a tie with an odd kept part.
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x40;
    (if x.is_nan() { quiet_nan } else { rounded }) as u16
}

/// `tanh x`.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    // Small |x|: the odd Taylor series through x^15 (the first omitted term is below 2^-26 of the
    // result for |x| < 0.5), which keeps full relative precision where `1 - e^-2x` would cancel.
    let a2 = a * a;
    let series = -1.0 / 3.0
        + a2 * (2.0 / 15.0
            + a2 * (-17.0 / 315.0
                + a2 * (62.0 / 2835.0
                    + a2 * (-1382.0 / 155_925.0
                        + a2 * (21_844.0 / 6_081_075.0 + a2 * (-929_569.0 / 638_512_875.0))))));
    let small = a + a * a2 * series;
    // Otherwise tanh a = (1 - t) / (1 + t) with t = e^-2a in (0, 0.37], where the error of t is damped.
    let t = exp_f32(-2.0 * a);
    let large = (1.0 - t) / (1.0 + t);
    let y = if a < 0.5 { small } else { large };
    y.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_halfs() {
        // Every 16-bit pattern of the kept half with dropped halves at and around each tie, plus a
        // sweep of all patterns 2^10 apart.
        let dropped = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff];
        let sweep = (0..1u32 << 22).map(|i| i << 10);
        for bits in (0..1u32 << 16)
            .flat_map(|hi| dropped.iter().map(move |&lo| (hi << 16) | lo))
            .chain(sweep)
        {
            let x = f32::from_bits(bits);
            assert_eq!(
                bf16_bits_of_f32(x),
                half::bf16::from_f32(x).to_bits(),
                "{bits:#010x}"
            );
        }
    }

    /// Distance in units in the last place between `got` and the correctly rounded `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w || (got.is_nan() && w.is_nan()) {
            return 0.0;
        }
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    /// `count + 1` evenly spaced values from `lo` to `hi`.
    fn samples(lo: f32, hi: f32, count: u32) -> impl Iterator<Item = f32> {
        (0..=count).map(move |i| lo + (hi - lo) * (i as f32 / count as f32))
    }

    /// The largest error in ulp of `f` against the `f64` `reference` over `xs`, and where it occurs.
    fn worst_ulps(
        xs: impl Iterator<Item = f32>,
        f: fn(f32) -> f32,
        reference: fn(f64) -> f64,
    ) -> (f64, f32) {
        xs.map(|x| (ulps(f(x), reference(x as f64)), x))
            .fold((0.0, 0.0), |worst, e| if e.0 > worst.0 { e } else { worst })
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let xs = samples(EXP_MIN, EXP_MAX, 2_000_000).chain(samples(-1.0, 1.0, 200_000));
        let worst = worst_ulps(xs, exp_f32, f64::exp);
        assert!(worst.0 <= 2.0, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn exp_edge_cases() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert!(exp_f32(88.7).is_finite());
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1000.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(1.0), std::f32::consts::E);
    }

    #[test]
    fn tanh_is_within_three_ulp() {
        let tiny = (1..2000).map(|i| i as f32 * 1e-7);
        let xs = samples(-12.0, 12.0, 2_000_000)
            .chain(samples(-0.6, 0.6, 200_000))
            .chain(tiny);
        let worst = worst_ulps(xs, tanh_f32, f64::tanh);
        assert!(worst.0 <= 3.0, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn tanh_edge_cases() {
        assert_eq!(tanh_f32(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh_f32(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_f32(100.0), 1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
        assert_eq!(tanh_f32(1e-30), 1e-30);
    }
}
