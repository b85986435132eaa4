//! Host reductions over rows: sum/max/min, argmax, softmax and log-softmax, and the cross-entropy
//! derivative.
//!
//! Reducing trailing axes of a contiguous tensor (the common case: per-row sums, softmax
//! denominators) reduces contiguous rows, in parallel for large inputs. Any other case walks the input
//! once, accumulating into the output through strides that are 0 along the reduced axes.
//!
//! Everything accumulates in the compute type ([`Math::Compute`]): `f32` for 16-bit elements, which
//! are widened as they are read and rounded once when the result is stored.

use rayon::prelude::*;

use super::rows::{self, Real};
use super::widen::Widen;
use super::{PARALLEL_MIN, fill_segments};
use crate::backend::op::{Math, Reduce};
use crate::backend::{Dst, Src};
use crate::dtype::{DType, Element, Float, bf16, f16, with_dtype, with_float_dtype};
use crate::layout::{RowWalk, contiguous_strides};

fn reduce_into<T: Math>(kind: Reduce, x: Src, axes: &[usize], out: Dst) {
    let (layout, kept) = (x.layout, out.layout.shape());
    let data = x.buf.host::<T>();
    let out = out.contiguous_host::<T>();
    let rank = layout.rank();
    let trailing = axes
        .iter()
        .enumerate()
        .all(|(k, &a)| a == rank - axes.len() + k);
    if trailing && layout.is_contiguous() {
        let inner: usize = axes.iter().map(|&a| layout.shape()[a]).product();
        let base = layout.offset();
        let row = |i: usize| {
            T::store(kind.finish(
                reduce_row(kind, &data[base + i * inner..base + (i + 1) * inner]),
                inner,
            ))
        };
        if layout.numel() >= PARALLEL_MIN {
            out.par_iter_mut()
                .enumerate()
                .for_each(|(i, o)| *o = row(i));
        } else {
            out.iter_mut().enumerate().for_each(|(i, o)| *o = row(i));
        }
        return;
    }
    let count: usize = axes.iter().map(|&a| layout.shape()[a]).product();
    let leading = axes.iter().enumerate().all(|(k, &a)| a == k);
    if leading && layout.is_contiguous() {
        let rows = &data[layout.offset()..][..layout.numel()];
        reduce_leading(kind, rows, count, out);
        return;
    }
    if T::DTYPE.is_half() {
        // Partial results in the compute type, rounded once at the end.
        let mut acc = vec![kind.identity::<T::Compute>(); out.len()];
        reduce_walk(kind, x, data, kept, axes, &mut acc);
        out.iter_mut()
            .zip(acc)
            .for_each(|(o, a)| *o = T::store(kind.finish(a, count)));
    } else {
        // The compute type is `T`: partial results go straight into the output.
        reduce_walk(kind, x, data, kept, axes, out);
        if kind == Reduce::Mean {
            out.iter_mut().for_each(|o| *o = kind.finish(*o, count));
        }
    }
}

/// Columns of the output per task of [`reduce_leading`]: their partial results stay in L1.
const COLUMN_RUN: usize = 512;

/// Reduces the leading axes of a contiguous tensor, `rows` rows of `out.len()` elements (a bias's
/// gradient: the sum over the batch's rows): each run of [`COLUMN_RUN`] columns (in parallel for
/// large inputs) walks the rows in order, combining a whole row run at a time in the compute type
/// with the operation chosen once per row rather than per element. Each column combines its rows
/// in the same order as [`reduce_walk`], so the results are the same bits.
fn reduce_leading<T: Math>(kind: Reduce, rows: &[T], count: usize, out: &mut [T]) {
    let width = out.len();
    if width == 0 {
        return;
    }
    let columns = |first: usize, out: &mut [T]| {
        let mut acc = [kind.identity::<T::Compute>(); COLUMN_RUN];
        let acc = &mut acc[..out.len()];
        for row in rows.chunks_exact(width) {
            let run = &row[first..first + out.len()];
            match kind {
                Reduce::Sum | Reduce::Mean => combine_run(acc, run, |a, x| a.add(x)),
                Reduce::Max => combine_run(acc, run, |a, x| a.max_nan(x)),
                Reduce::Min => combine_run(acc, run, |a, x| a.min_nan(x)),
            }
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = T::store(kind.finish(a, count));
        }
    };
    if rows.len() >= PARALLEL_MIN {
        out.par_chunks_mut(COLUMN_RUN)
            .enumerate()
            .for_each(|(c, out)| columns(c * COLUMN_RUN, out));
    } else {
        for (c, out) in out.chunks_mut(COLUMN_RUN).enumerate() {
            columns(c * COLUMN_RUN, out);
        }
    }
}

/// `acc[j] = combine(acc[j], run[j])` along a run, the elements widened to the compute type.
#[inline(always)]
fn combine_run<T: Math>(
    acc: &mut [T::Compute],
    run: &[T],
    combine: impl Fn(T::Compute, T::Compute) -> T::Compute,
) {
    for (a, &x) in acc.iter_mut().zip(run) {
        *a = combine(*a, x.load());
    }
}

/// Reduces `data` (read through `x`'s layout) over `axes` into `acc` (the kept shape, contiguous),
/// whose elements are `T` or its compute type.
fn reduce_walk<T: Math, A: Math<Compute = T::Compute>>(
    kind: Reduce,
    x: Src,
    data: &[T],
    kept: &[usize],
    axes: &[usize],
    acc: &mut [A],
) {
    let layout = x.layout;
    acc.fill(kind.identity());
    let mut out_strides = contiguous_strides(kept);
    for &a in axes {
        out_strides[a] = 0;
    }
    let walk = RowWalk::new(
        layout.shape(),
        [layout.strides(), &out_strides],
        [layout.offset(), 0],
    );
    let [si, so] = walk.row_strides();
    let len = walk.row_len();
    let add = |a: &mut A, v: T::Compute| *a = A::store(kind.combine(a.load(), v));
    walk.for_rows(0, walk.rows(), |_, [i, o]| {
        if so == 0 && si == 1 {
            add(&mut acc[o], reduce_row(kind, &data[i..i + len]));
        } else {
            for j in 0..len {
                add(&mut acc[o + j * so], data[i + j * si].load());
            }
        }
    });
}

/// Reduces a contiguous row in the compute type (a plain slice reduction when that is the element
/// type; in chunks widened on the stack otherwise).
#[inline(always)]
fn reduce_row<T: Math>(kind: Reduce, xs: &[T]) -> T::Compute {
    if !T::DTYPE.is_half() {
        // The compute type is `T` itself: `load` is the identity.
        return kind.slice(xs).load();
    }
    let mut acc = kind.identity::<T::Compute>();
    let mut wide = [T::Compute::zero(); 64];
    for chunk in xs.chunks(64) {
        for (w, &x) in wide.iter_mut().zip(chunk) {
            *w = x.load();
        }
        acc = kind.combine(acc, kind.slice(&wide[..chunk.len()]));
    }
    acc
}

pub(super) fn reduce(dtype: DType, kind: Reduce, x: Src, axes: &[usize], out: Dst) {
    with_dtype!(dtype, T => reduce_into::<T>(kind, x, axes, out));
}

pub(super) fn argmax(dtype: DType, x: Src, axis: usize, out: Dst) {
    let layout = x.layout;
    let size = layout.shape()[axis];
    let step = layout.strides()[axis];
    let walk = RowWalk::new(out.layout.shape(), [layout.strides()], [layout.offset()]);
    let [si] = walk.row_strides();
    with_dtype!(dtype, T => {
        let data = x.buf.host::<T>();
        fill_segments(&walk, out.contiguous_host::<i64>(), |o, [start]| {
            for (j, slot) in o.iter_mut().enumerate() {
                let base = start + j * si;
                let (mut best, mut best_k) = (data[base], 0usize);
                for k in 0..size {
                    let v = data[base + k * step];
                    if v.partial_cmp(&v).is_none() {
                        best_k = k; // NaN wins, as in PyTorch
                        break;
                    }
                    if v > best {
                        best = v;
                        best_k = k;
                    }
                }
                *slot = best_k as i64;
            }
        });
    });
}

/// One row of `f32` or `f64`: `out = softmax(x)` or `log_softmax(x)`.
fn softmax_row<C: Real>(x: &[C], out: &mut [C], log: bool) {
    let m = rows::max(x);
    if m == C::lowest() {
        // Every entry is -inf (a fully masked row): the distribution is undefined; PyTorch gives NaN.
        out.fill(C::from_f64(f64::NAN));
        return;
    }
    if log {
        let lse = Float::ln(rows::exp_sum(x, m));
        out.iter_mut().zip(x).for_each(|(o, &v)| *o = v - m - lse);
    } else {
        // Keep each e^(x - m) in the output and scale it: one exponential per element.
        let inv = Float::recip(rows::exp_into(x, out, m));
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

/// A 16-bit row's maximum `m` in `f32` (NaN if it holds one) and, when `m` is finite, `Σ e^(x - m)`
/// (else 0), over blocks widened on the stack.
fn half_max_exp_sum<T: Widen<Compute = f32>>(x: &[T]) -> (f32, f32) {
    let mut m = f32::NEG_INFINITY;
    rows::widened(x, |_, w| {
        let block = rows::max(w);
        m = if block > m || block.is_nan() {
            block
        } else {
            m
        };
    });
    if m == f32::NEG_INFINITY || m.is_nan() {
        return (m, 0.0);
    }
    let mut sum = 0.0f32;
    rows::widened(x, |_, w| sum += rows::exp_sum(w, m));
    (m, sum)
}

/// One 16-bit row, computed in `f32` in blocks widened on the stack and rounded once per element.
fn softmax_row_half<T: Widen<Compute = f32>>(x: &[T], out: &mut [T], log: bool) {
    let (m, sum) = half_max_exp_sum(x);
    if m == f32::NEG_INFINITY {
        out.fill(T::from_f64(f64::NAN));
        return;
    }
    if log {
        let lse = sum.ln();
        rows::widened(x, |at, w| {
            for (o, &v) in out[at..].iter_mut().zip(w) {
                *o = T::store(v - m - lse);
            }
        });
    } else {
        let inv = sum.recip();
        let mut wide = [0.0f32; rows::WIDE];
        rows::widened(x, |at, w| {
            rows::exp_into(w, &mut wide[..w.len()], m);
            for (o, &e) in out[at..].iter_mut().zip(&wide[..w.len()]) {
                *o = T::store(e * inv);
            }
        });
    }
}

/// Applies `row` to every row of `n` elements of the contiguous `x` and `out`, in parallel for large
/// inputs.
fn each_row<T: Element>(x: Src, out: Dst, n: usize, row: impl Fn(&[T], &mut [T]) + Sync) {
    let (x, o) = (x.contiguous_host::<T>(), out.contiguous_host::<T>());
    if x.len() >= PARALLEL_MIN {
        o.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .for_each(|(o, x)| row(x, o));
    } else {
        o.chunks_mut(n)
            .zip(x.chunks(n))
            .for_each(|(o, x)| row(x, o));
    }
}

pub(super) fn softmax(dtype: DType, x: Src, log: bool, out: Dst) {
    let n = x.layout.shape().last().copied().unwrap_or(1);
    if n == 0 || x.layout.numel() == 0 {
        return;
    }
    match dtype {
        DType::F32 => each_row::<f32>(x, out, n, |x, o| softmax_row(x, o, log)),
        DType::F64 => each_row::<f64>(x, out, n, |x, o| softmax_row(x, o, log)),
        DType::BF16 => each_row::<bf16>(x, out, n, |x, o| softmax_row_half(x, o, log)),
        DType::F16 => each_row::<f16>(x, out, n, |x, o| softmax_row_half(x, o, log)),
        DType::I64 => unreachable!("softmax refuses integer dtypes before computing"),
    }
}

/// One row of [`Backend::rms_norm`](crate::backend::Backend::rms_norm): the sum of squares in the
/// compute type, `x · inv` rounded to `T`, then times the weight and rounded again.
fn rms_norm_row<T: Math>(x: &[T], weight: Option<&[T]>, eps: T::Compute, out: &mut [T])
where
    T::Compute: Real,
{
    let mut squares = T::Compute::zero();
    for &v in x {
        let v = v.load();
        squares += v * v;
    }
    let len = T::Compute::from_f64(x.len() as f64);
    let inv = T::Compute::one() / Math::sqrt(squares / len + eps);
    match weight {
        Some(w) => {
            for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
                *o = T::store(T::store(v.load() * inv).load() * w.load());
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = T::store(v.load() * inv);
            }
        }
    }
}

pub(super) fn rms_norm(dtype: DType, x: Src, weight: Option<Src>, eps: f64, out: Dst) {
    let n = x.layout.shape().last().copied().unwrap_or(1);
    if n == 0 || x.layout.numel() == 0 {
        return;
    }
    fn rows<T: Math>(x: Src, weight: Option<Src>, eps: f64, out: Dst, n: usize)
    where
        T::Compute: Real,
    {
        let w = weight.map(|w| w.contiguous_host::<T>());
        let eps = T::Compute::from_f64(eps);
        each_row::<T>(x, out, n, |x, o| rms_norm_row(x, w, eps, o));
    }
    match dtype {
        DType::F32 => rows::<f32>(x, weight, eps, out, n),
        DType::F64 => rows::<f64>(x, weight, eps, out, n),
        DType::BF16 => rows::<bf16>(x, weight, eps, out, n),
        DType::F16 => rows::<f16>(x, weight, eps, out, n),
        DType::I64 => unreachable!("rms_norm refuses integer dtypes before computing"),
    }
}

/// `ln Σ e^x` of a row of `f32` or `f64`.
fn logsumexp_row<C: Real>(x: &[C]) -> C {
    let m = rows::max(x);
    if m == C::lowest() || Float::is_nan(m) {
        return m; // -inf for a row of -inf (or an empty row), NaN for a row holding NaN
    }
    m + Float::ln(rows::exp_sum(x, m))
}

/// `ln Σ e^x` of a 16-bit row, in `f32`.
fn logsumexp_row_half<T: Widen<Compute = f32>>(x: &[T]) -> f32 {
    let (m, sum) = half_max_exp_sum(x);
    if m == f32::NEG_INFINITY || m.is_nan() {
        return m;
    }
    m + sum.ln()
}

/// Applies `row` to every row of `n` elements of the contiguous `x`, one result each.
fn each_row_to<T: Element, C: Element>(x: Src, out: Dst, n: usize, row: impl Fn(&[T]) -> C + Sync) {
    let (x, o) = (x.contiguous_host::<T>(), out.contiguous_host::<C>());
    if x.len() >= PARALLEL_MIN {
        o.par_iter_mut()
            .zip(x.par_chunks(n))
            .for_each(|(o, x)| *o = row(x));
    } else {
        o.iter_mut().zip(x.chunks(n)).for_each(|(o, x)| *o = row(x));
    }
}

pub(super) fn logsumexp(dtype: DType, x: Src, out: Dst) {
    let n = x.layout.shape().last().copied().unwrap_or(1);
    if out.layout.numel() == 0 {
        return;
    }
    if n == 0 {
        // Empty rows: ln 0.
        match dtype {
            DType::F64 => out.contiguous_host::<f64>().fill(f64::NEG_INFINITY),
            _ => out.contiguous_host::<f32>().fill(f32::NEG_INFINITY),
        }
        return;
    }
    match dtype {
        DType::F32 => each_row_to::<f32, f32>(x, out, n, logsumexp_row),
        DType::F64 => each_row_to::<f64, f64>(x, out, n, logsumexp_row),
        DType::BF16 => each_row_to::<bf16, f32>(x, out, n, logsumexp_row_half),
        DType::F16 => each_row_to::<f16, f32>(x, out, n, logsumexp_row_half),
        DType::I64 => unreachable!("logsumexp refuses integer dtypes before computing"),
    }
}

/// One row of the cross-entropy derivative (see `Backend::cross_entropy_grad`).
#[inline]
fn cross_entropy_grad_row<T: Math>(
    x: &[T],
    out: &mut [T],
    (lse, label, weight): (T::Compute, usize, T::Compute),
    (on, off): (T::Compute, T::Compute),
) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = T::store(Math::exp(v.load().sub(lse)).sub(off).mul(weight));
    }
    let p = Math::exp(x[label].load().sub(lse));
    out[label] = T::store(p.sub(off).sub(on).mul(weight));
}

pub(super) fn cross_entropy_grad(
    dtype: DType,
    [logits, lse, labels, weight]: [Src; 4],
    smoothing: f64,
    out: Dst,
) {
    let classes = logits.layout.shape()[1];
    if classes == 0 || out.layout.numel() == 0 {
        return;
    }
    let labels = labels.contiguous_host::<i64>();
    with_float_dtype!(dtype, T => {
        type C = <T as Math>::Compute;
        let (x, o) = (logits.contiguous_host::<T>(), out.contiguous_host::<T>());
        let (lse, weight) = (lse.contiguous_host::<C>(), weight.contiguous_host::<C>());
        let (on, off) = (C::from_f64(1.0 - smoothing), C::from_f64(smoothing / classes as f64));
        let row = |r: usize, (o, x): (&mut [T], &[T])| {
            cross_entropy_grad_row(x, o, (lse[r], labels[r] as usize, weight[r]), (on, off));
        };
        if x.len() >= PARALLEL_MIN {
            o.par_chunks_mut(classes).zip(x.par_chunks(classes)).enumerate().for_each(|(r, p)| row(r, p));
        } else {
            o.chunks_mut(classes).zip(x.chunks(classes)).enumerate().for_each(|(r, p)| row(r, p));
        }
    }, else unreachable!("cross-entropy refuses integer dtypes before computing"));
}
