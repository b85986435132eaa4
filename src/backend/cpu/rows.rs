//! Vectorised loops over one row of floats in the compute type: maxima, sums of exponentials and
//! scaling, each kept in [`LANES`] independent partial results so that the compiler turns the loop
//! into SIMD code (a single running sum or maximum is a dependency chain it must not reorder).
//! Softmax, log-softmax, log-sum-exp and fused attention are built from these. The ones paged
//! attention calls in its loops are `inline(always)`, so that its versions compiled for wider
//! vector units (`#[target_feature]`) compile them for those units too.

use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub};

use super::widen::Widen;
use crate::backend::op::Math;
use crate::dtype::{Element, Float};

/// Independent partial results per loop.
pub(super) const LANES: usize = 16;

/// The compute types, `f32` and `f64`, with operators.
pub(super) trait Real:
    Float
    + Math<Compute = Self>
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + AddAssign
    + MulAssign
{
}
impl Real for f32 {}
impl Real for f64 {}

/// `b` if it is larger than `a` or NaN, else `a`: a NaN, once taken, stays.
#[inline(always)]
pub(super) fn larger_or_nan<C: Real>(a: C, b: C) -> C {
    if b > a || Float::is_nan(b) { b } else { a }
}

/// The largest element (`-inf` for an empty row), NaN if any element is NaN.
#[inline(always)]
pub(super) fn max<C: Real>(xs: &[C]) -> C {
    // NaN travels in the lanes themselves (a flag per lane beside them kept the compiler from
    // vectorising the loop: it shuffled lanes between registers instead).
    let mut lanes = [C::lowest(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for l in 0..LANES {
            lanes[l] = larger_or_nan(lanes[l], chunk[l]);
        }
    }
    let m = tail.iter().fold(C::lowest(), |m, &x| larger_or_nan(m, x));
    lanes.iter().fold(m, |m, &x| larger_or_nan(m, x))
}

/// `Σ e^(x - shift)`.
#[inline]
pub(super) fn exp_sum<C: Real>(xs: &[C], shift: C) -> C {
    let mut lanes = [C::zero(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for l in 0..LANES {
            lanes[l] += Float::exp(chunk[l] - shift);
        }
    }
    let sum = tail
        .iter()
        .fold(C::zero(), |s, &x| s + Float::exp(x - shift));
    lanes.iter().fold(sum, |a, &b| a + b)
}

/// `out = e^(x - shift)` for each element; returns the sum of `out`.
#[inline]
pub(super) fn exp_into<C: Real>(xs: &[C], out: &mut [C], shift: C) -> C {
    let mut lanes = [C::zero(); LANES];
    let mut chunks = out.chunks_exact_mut(LANES);
    let mut inputs = xs.chunks_exact(LANES);
    for (o, x) in (&mut chunks).zip(&mut inputs) {
        for l in 0..LANES {
            o[l] = Float::exp(x[l] - shift);
            lanes[l] += o[l];
        }
    }
    let mut sum = C::zero();
    for (o, &x) in chunks.into_remainder().iter_mut().zip(inputs.remainder()) {
        *o = Float::exp(x - shift);
        sum += *o;
    }
    lanes.iter().fold(sum, |a, &b| a + b)
}

/// Replaces each `x` with `e^(x - shift)`; returns their sum.
#[inline(always)]
pub(super) fn exp_in_place<C: Real>(xs: &mut [C], shift: C) -> C {
    let mut lanes = [C::zero(); LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            chunk[l] = Float::exp(chunk[l] - shift);
            lanes[l] += chunk[l];
        }
    }
    let mut sum = C::zero();
    for x in chunks.into_remainder() {
        *x = Float::exp(*x - shift);
        sum += *x;
    }
    lanes.iter().fold(sum, |a, &b| a + b)
}

/// `Σ a_i b_i`.
#[inline(always)]
pub(super) fn dot<C: Real>(a: &[C], b: &[C]) -> C {
    let mut lanes = [C::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(C::zero(), |s, (&x, &y)| s + x * y);
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().fold(tail, |a, &b| a + b)
}

/// Elements widened per block when a 16-bit row is computed in `f32` on the stack.
pub(super) const WIDE: usize = 256;

/// Calls `f` on consecutive blocks of the row widened to its compute type (at most [`WIDE`]
/// elements each, on the stack), with each block's offset.
#[inline]
pub(super) fn widened<T: Widen>(xs: &[T], mut f: impl FnMut(usize, &[T::Compute])) {
    let mut wide = [T::Compute::zero(); WIDE];
    for (k, chunk) in xs.chunks(WIDE).enumerate() {
        T::widen(chunk, &mut wide[..chunk.len()]);
        f(k * WIDE, &wide[..chunk.len()]);
    }
}
