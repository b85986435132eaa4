//! What every choice of a token needs of a row of logits on the host: the first largest logit and
//! the softmax's denominator below it. Sampling (`serve`) computes them for every row a model
//! decodes, so the loops are also compiled for AVX-512 and for AVX2 and picked at run time, as the
//! elementwise loops are: sixteen lanes in one register (two of AVX2's) rather than four of SSE2's,
//! the same operations in the same order (the compiler vectorises across the independent lanes and
//! never reassociates or fuses a sum), so the results do not depend on the CPU. Eight rows of GPT-2
//! small's 50,257 logits took 5 % of a batched decoding step as SSE2 code (on an AVX2-only Zen 3,
//! the sum alone still 1.9 % before its AVX2 twin).

/// The first largest logit and its index, NaN skipped (`(0, −inf)` when none is above `−inf`): the
/// largest by 16 lanes, then the first group of lanes holding it, then its place in the group.
pub(crate) fn first_largest(logits: &[f32]) -> (usize, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, the only feature the version is compiled for.
        return unsafe { first_largest_avx512(logits) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the version is compiled for.
        return unsafe { first_largest_avx2(logits) };
    }
    first_largest_with(logits)
}

/// `Σ e^(x − best)` over the logits (NaN counting as `−inf`) for a finite `best` no smaller than
/// any of them: the softmax's denominator. Each term is `fastmath`'s vectorised `exp` of the `f32`
/// difference (within 2 ulp, and the difference is exact where `x` is within a factor of two of
/// `best`, the terms that matter), summed in `f32` within 16 lanes of at most 4096 terms each, those
/// sums in `f64`: about 2^-20 relative at worst, against 0.6 ms a token for `f64`'s `exp` on
/// Llama 3's 128,256 logits.
pub(crate) fn log_sum_exp_below(logits: &[f32], best: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, the only feature the version is compiled for.
        return unsafe { sum_below_avx512(logits, best) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the version is compiled for.
        return unsafe { sum_below_avx2(logits, best) };
    }
    sum_below_with(logits, best)
}

/// Lanes of the loops: one AVX-512 register of `f32`.
const LANES: usize = 16;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn first_largest_avx512(logits: &[f32]) -> (usize, f32) {
    first_largest_with(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_below_avx512(logits: &[f32], best: f32) -> f64 {
    sum_below_with(logits, best)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn first_largest_avx2(logits: &[f32]) -> (usize, f32) {
    first_largest_with(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_below_avx2(logits: &[f32], best: f32) -> f64 {
    sum_below_with(logits, best)
}

#[inline(always)]
fn first_largest_with(logits: &[f32]) -> (usize, f32) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut groups = logits.chunks_exact(LANES);
    for group in &mut groups {
        for (lane, &x) in lanes.iter_mut().zip(group) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let largest = groups
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if largest == f32::NEG_INFINITY {
        return (0, largest);
    }
    // Whole groups compared at once (an element-by-element search was an eighth of the work).
    let group = logits
        .chunks(LANES)
        .position(|g| g.iter().fold(false, |seen, &x| seen | (x == largest)))
        .expect("the largest is one of the logits");
    let at = logits[group * LANES..]
        .iter()
        .position(|&x| x == largest)
        .expect("the largest is in its group");
    (group * LANES + at, largest)
}

#[inline(always)]
fn sum_below_with(logits: &[f32], best: f32) -> f64 {
    let term = |x: f32| {
        let e = crate::fastmath::exp_f32(x - best);
        if x.is_nan() { 0.0 } else { e }
    };
    let mut total = 0.0f64;
    for chunk in logits.chunks(LANES * 4096) {
        let mut lanes = [0.0f32; LANES];
        let mut groups = chunk.chunks_exact(LANES);
        for group in &mut groups {
            for (lane, &x) in lanes.iter_mut().zip(group) {
                *lane += term(x);
            }
        }
        let tail: f64 = groups.remainder().iter().map(|&x| f64::from(term(x))).sum();
        total += lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail;
    }
    total
}

/// `n` logits over a vocabulary's range with NaN, `−inf` and ties, and (for most `n`) a tail past
/// the lanes: the row the summaries' tests here and the sampler's share.
#[cfg(test)]
pub(crate) fn awkward_logits(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 1000 {
            7 => f32::NAN,
            8 => f32::NEG_INFINITY,
            _ => ((i as f32 * 0.618).sin() * 30.0) - (i % 13) as f32,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vector_versions_give_the_portable_bits() {
        for n in [0, 1, 15, 16, 17, 1000, 65_536 + 5, 128_257] {
            let logits = awkward_logits(n);
            let want = first_largest_with(&logits);
            assert_eq!(first_largest(&logits), want, "{n} logits");
            let sum = want.1.is_finite().then(|| sum_below_with(&logits, want.1));
            if let Some(sum) = sum {
                assert_eq!(log_sum_exp_below(&logits, want.1).to_bits(), sum.to_bits());
            }
            // The AVX2 twins by name: on an AVX-512 CPU the dispatch above never picks them.
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, the only feature the twins are compiled for.
                unsafe {
                    assert_eq!(first_largest_avx2(&logits), want, "{n} logits, AVX2");
                    if let Some(sum) = sum {
                        assert_eq!(sum_below_avx2(&logits, want.1).to_bits(), sum.to_bits());
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        for (feature, present) in [
            ("AVX-512F", std::is_x86_feature_detected!("avx512f")),
            ("AVX2", std::is_x86_feature_detected!("avx2")),
        ] {
            if !present {
                eprintln!("not run: the {feature} versions (this CPU has no {feature})");
            }
        }
    }
}
