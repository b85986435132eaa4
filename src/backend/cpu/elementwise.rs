//! Host elementwise kernels: unary and binary maps (out of place and in place), `where`, copies and
//! casts, and the host side of uploads and downloads.
//!
//! Maps run in the element type's compute type ([`Math::Compute`]): a 16-bit element is widened to
//! `f32` when loaded and rounded once when stored; for the other types loading and storing are the
//! identity, so their loops are unchanged.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::{CHUNK, PARALLEL_MIN, fill_segments};
use crate::backend::op::{Binary, MapFn, Math, Unary, ZipFn};
use crate::backend::{Dst, Src, bytes_of};
use crate::dtype::{DType, Element, bf16, bf16_of_f32, f16, with_dtype};
use crate::layout::{RowWalk, contiguous_strides};

/// One output row from one operand row.
#[inline(always)]
fn unary_row<T: Copy, U>(out: &mut [U], a: &[T], ia: usize, sa: usize, f: impl Fn(T) -> U) {
    let n = out.len();
    if sa == 1 {
        for (o, &x) in out.iter_mut().zip(&a[ia..ia + n]) {
            *o = f(x);
        }
    } else {
        for (j, o) in out.iter_mut().enumerate() {
            *o = f(a[ia + j * sa]);
        }
    }
}

/// One output row from two operand rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn binary_row<T: Copy, U>(
    out: &mut [U],
    a: &[T],
    ia: usize,
    sa: usize,
    b: &[T],
    ib: usize,
    sb: usize,
    f: impl Fn(T, T) -> U,
) {
    let n = out.len();
    match (sa, sb) {
        (1, 1) => {
            for ((o, &x), &y) in out.iter_mut().zip(&a[ia..ia + n]).zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        (1, 0) => {
            let y = b[ib];
            for (o, &x) in out.iter_mut().zip(&a[ia..ia + n]) {
                *o = f(x, y);
            }
        }
        (0, 1) => {
            let x = a[ia];
            for (o, &y) in out.iter_mut().zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        _ => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = f(a[ia + j * sa], b[ib + j * sb]);
            }
        }
    }
}

/// `out[i] = f(a[i])` over equal-length contiguous slices, on rayon's threads when large.
fn map_contiguous<T: Element, U: Element>(out: &mut [U], a: &[T], f: &(impl Fn(T) -> U + Sync)) {
    if out.len() < PARALLEL_MIN {
        for (o, &x) in out.iter_mut().zip(a) {
            *o = f(x);
        }
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(o, a)| map_contiguous(o, a, f));
}

/// `out[i] = f(a[i], b[i])` over equal-length contiguous slices, on rayon's threads when large.
fn zip_contiguous<T: Element>(out: &mut [T], a: &[T], b: &[T], f: &(impl Fn(T, T) -> T + Sync)) {
    if out.len() < PARALLEL_MIN {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| zip_contiguous(o, a, b, f));
}

/// Runs a unary op's host function from `x` into the fresh contiguous `out`, both of element type `T`.
struct MapInto<'a, T> {
    x: Src<'a>,
    out: Dst<'a>,
    _element: PhantomData<T>,
}

impl<T: Math> MapFn<T::Compute> for MapInto<'_, T> {
    fn call(self, f: impl Fn(T::Compute) -> T::Compute + Sync + Copy) {
        let MapInto { x, out, .. } = self;
        let f = move |v: T| T::store(f(v.load()));
        let out = out.contiguous_host::<T>();
        if x.layout.is_contiguous() {
            map_contiguous(out, x.contiguous_host::<T>(), &f);
            return;
        }
        let a = x.buf.host::<T>();
        let walk = RowWalk::new(x.layout.shape(), [x.layout.strides()], [x.layout.offset()]);
        let [sa] = walk.row_strides();
        fill_segments(&walk, out, |o, [ia]| unary_row(o, a, ia, sa, f));
    }
}

/// Runs a unary op's host function over contiguous elements of type `T` in place.
struct MapInPlace<'a, T>(Dst<'a>, PhantomData<T>);

impl<T: Math> MapFn<T::Compute> for MapInPlace<'_, T> {
    fn call(self, f: impl Fn(T::Compute) -> T::Compute + Sync + Copy) {
        self.0
            .contiguous_host::<T>()
            .iter_mut()
            .for_each(|x| *x = T::store(f(x.load())));
    }
}

/// Runs a binary op's host function from `a` and `b` (laid out with `out`'s shape) into `out`, all
/// of element type `T`.
struct ZipInto<'a, T> {
    a: Src<'a>,
    b: Src<'a>,
    out: Dst<'a>,
    _element: PhantomData<T>,
}

impl<T: Math> ZipFn<T::Compute> for ZipInto<'_, T> {
    fn call(self, f: impl Fn(T::Compute, T::Compute) -> T::Compute + Sync + Copy) {
        let ZipInto { a, b, out, .. } = self;
        let f = move |x: T, y: T| T::store(f(x.load(), y.load()));
        let shape = out.layout.shape();
        let out = out.contiguous_host::<T>();
        if a.layout.is_contiguous() && b.layout.is_contiguous() {
            // The common case, without broadcasting or a strided walk.
            zip_contiguous(out, a.contiguous_host::<T>(), b.contiguous_host::<T>(), &f);
            return;
        }
        let (da, db) = (a.buf.host::<T>(), b.buf.host::<T>());
        let walk = RowWalk::new(
            shape,
            [a.layout.strides(), b.layout.strides()],
            [a.layout.offset(), b.layout.offset()],
        );
        let [sa, sb] = walk.row_strides();
        fill_segments(&walk, out, |o, [ia, ib]| {
            binary_row(o, da, ia, sa, db, ib, sb, f)
        });
    }
}

/// Runs a binary op's host function as `x = f(x, b)` over the contiguous `x`, both of type `T`.
struct ZipInPlace<'a, T> {
    x: Dst<'a>,
    b: Src<'a>,
    _element: PhantomData<T>,
}

impl<T: Math> ZipFn<T::Compute> for ZipInPlace<'_, T> {
    fn call(self, f: impl Fn(T::Compute, T::Compute) -> T::Compute + Sync + Copy) {
        let ZipInPlace { x, b, .. } = self;
        let f = move |x: T, y: T| T::store(f(x.load(), y.load()));
        let shape = x.layout.shape();
        let walk = RowWalk::new(
            shape,
            [&contiguous_strides(shape), b.layout.strides()],
            [0, b.layout.offset()],
        );
        let [_, sb] = walk.row_strides();
        let db = b.buf.host::<T>();
        let data = x.contiguous_host::<T>();
        walk.for_segments(0, data.len(), |pos, [_, ib], len| {
            for (j, v) in data[pos..pos + len].iter_mut().enumerate() {
                *v = f(*v, db[ib + j * sb]);
            }
        });
    }
}

pub(super) fn unary(dtype: DType, op: Unary, params: [f64; 2], x: Src, out: Dst) {
    with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, MapInto::<T> { x, out, _element: PhantomData }));
}

pub(super) fn unary_in_place(dtype: DType, op: Unary, params: [f64; 2], x: Dst) {
    with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, MapInPlace::<T>(x, PhantomData)));
}

pub(super) fn binary(dtype: DType, op: Binary, params: [f64; 2], a: Src, b: Src, out: Dst) {
    with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, ZipInto::<T> { a, b, out, _element: PhantomData }));
}

pub(super) fn binary_in_place(dtype: DType, op: Binary, params: [f64; 2], x: Dst, b: Src) {
    with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, ZipInPlace::<T> { x, b, _element: PhantomData }));
}

pub(super) fn where_cond(dtype: DType, cond: Src, on_true: Src, on_false: Src, out: Dst) {
    let shape = out.layout.shape();
    let (lc, lt, lf) = (cond.layout, on_true.layout, on_false.layout);
    let walk = RowWalk::new(
        shape,
        [lc.strides(), lt.strides(), lf.strides()],
        [lc.offset(), lt.offset(), lf.offset()],
    );
    let [sc, st, sf] = walk.row_strides();
    with_dtype!(dtype, T => {
        let (c, t, f) = (cond.buf.host::<T>(), on_true.buf.host::<T>(), on_false.buf.host::<T>());
        fill_segments(&walk, out.contiguous_host::<T>(), |o, [ic, it, iff]| {
            for (j, v) in o.iter_mut().enumerate() {
                *v = if c[ic + j * sc] != T::zero() { t[it + j * st] } else { f[iff + j * sf] };
            }
        });
    });
}

/// `out = f(x)` element by element in row-major order, `out` contiguous (in parallel when large)
/// or any non-overlapping view.
fn copy_with<S: Element, D: Element>(x: Src, out: Dst, f: impl Fn(S) -> D + Sync + Copy) {
    let a = x.buf.host::<S>();
    let (ls, ld) = (x.layout, out.layout);
    if ld.is_contiguous() {
        let walk = RowWalk::new(ls.shape(), [ls.strides()], [ls.offset()]);
        let [sa] = walk.row_strides();
        fill_segments(&walk, out.contiguous_host::<D>(), |o, [ia]| {
            unary_row(o, a, ia, sa, f)
        });
        return;
    }
    let dst = out.buf.host::<D>();
    let walk = RowWalk::new(
        ls.shape(),
        [ls.strides(), ld.strides()],
        [ls.offset(), ld.offset()],
    );
    let [ss, ds] = walk.row_strides();
    let len = walk.row_len();
    walk.for_rows(0, walk.rows(), |_, [s, d]| {
        for j in 0..len {
            dst[d + j * ds] = f(a[s + j * ss]);
        }
    });
}

pub(super) fn copy(from: DType, to: DType, x: Src, out: Dst) {
    if from == to {
        // A plain copy: never through `f64`, which would round large integers.
        with_dtype!(from, T => copy_with::<T, T>(x, out, |v| v));
        return;
    }
    // Between f32 and the 16-bit types, convert directly (rounding f32 through f64 to 16 bits is the
    // same single rounding, but the f64 path neither vectorises nor runs branch-free).
    match (from, to) {
        (DType::F32, DType::BF16) => copy_with::<f32, bf16>(x, out, bf16_of_f32),
        (DType::BF16, DType::F32) => copy_with::<bf16, f32>(x, out, bf16::to_f32),
        (DType::F32, DType::F16) => copy_with::<f32, f16>(x, out, f16::from_f32),
        (DType::F16, DType::F32) => copy_with::<f16, f32>(x, out, f16::to_f32),
        _ => with_dtype!(from, S => with_dtype!(to, D => {
            copy_with::<S, D>(x, out, |v| D::from_f64(v.to_f64()))
        })),
    }
}

pub(super) fn upload(dtype: DType, data: &[u8], out: Dst) {
    if data.is_empty() {
        return;
    }
    let start = out.layout.offset() * dtype.size();
    let dst = &mut out.buf.bytes()[start..start + data.len()];
    // A large copy (a checkpoint's tensor) is bound by first-touch page faults on both sides as
    // much as by bandwidth: split it across threads.
    const PARALLEL_BYTES: usize = 4 << 20;
    if data.len() < PARALLEL_BYTES {
        dst.copy_from_slice(data);
    } else {
        dst.par_chunks_mut(1 << 20)
            .zip(data.par_chunks(1 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

pub(super) fn download(dtype: DType, x: Src, out: &mut [u8]) {
    if out.is_empty() {
        return;
    }
    let size = dtype.size();
    if x.layout.is_contiguous() {
        let start = x.layout.offset() * size;
        out.copy_from_slice(&x.buf.bytes()[start..start + out.len()]);
        return;
    }
    with_dtype!(dtype, T => {
        let data = x.buf.host::<T>();
        let walk = RowWalk::new(x.layout.shape(), [x.layout.strides()], [x.layout.offset()]);
        let [stride] = walk.row_strides();
        let len = walk.row_len();
        walk.for_rows(0, walk.rows(), |row, [start]| {
            for j in 0..len {
                let at = (row * len + j) * size;
                out[at..at + size].copy_from_slice(bytes_of(std::slice::from_ref(&data[start + j * stride])));
            }
        });
    });
}
