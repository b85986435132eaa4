//! Host elementwise kernels: unary and binary maps (out of place and in place), `where`, copies and
//! casts, and the host side of uploads and downloads.
//!
//! Maps run in the element type's compute type ([`Math::Compute`]): a 16-bit element is widened to
//! `f32` when loaded and rounded once when stored; for the other types loading and storing are the
//! identity, so their loops are unchanged. Casts between `f32` and the 16-bit types of contiguous
//! tensors convert whole runs ([`super::widen`], [`super::narrow`]).
//!
//! The maps' row loops (out of place and in place) run in a twin compiled for the CPU's vector
//! unit, AVX-512 or AVX2 with FMA (detected at run time, [`vector_unit`], [`unary_rows`],
//! [`binary_rows`]): the loops are generic over the op's closure, and the baseline x86-64 build
//! vectorises them 4 lanes wide in 16 registers; on an Intel Xeon with AMX the bf16 GPT-2 forward
//! spent 10 % of its time in GELU's `tanh` that way, and on an AVX2-only Zen 3 eight requests'
//! decoding of GPT-2 small spent 4 % in GELU's 4-lane `exp`. The choice is made once per op, as
//! the visitor's `UNIT` parameter, so that the op's closure (a distinct type per visitor) is
//! inlined into the one loop that calls it: with several loops calling one closure, the AVX-512
//! loop called it per element. The twins run the same IEEE operations in the same order per
//! element (Rust never fuses a multiply and an add it was not asked to), so all give the same bits
//! (unit-tested).

use std::marker::PhantomData;

use rayon::prelude::*;

use super::narrow::Narrow;
use super::widen::Widen;
use super::{CHUNK, PARALLEL_MIN, convert_chunks, fill_segments};
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

/// The vector units the row loops have twins for: [`vector_unit`]'s answers, and the visitors'
/// `UNIT` parameter.
const BASELINE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// The widest twin this CPU runs: AVX-512F with BW (the 16-bit elements' byte and word shuffles),
/// else AVX2 with FMA, else the baseline. `std` caches the detection.
fn vector_unit() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
            return AVX512;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return AVX2;
        }
    }
    BASELINE
}

/// `$body`'s function compiled twice more: as `$avx2` for AVX2 with FMA and as `$avx512` for
/// AVX-512 (the callers run a twin only where [`vector_unit`] found its features).
macro_rules! twins {
    ($avx2:ident, $avx512:ident, $($body:tt)*) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        fn $avx2 $($body)*

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
        #[allow(clippy::too_many_arguments)]
        fn $avx512 $($body)*
    };
}

/// [`unary_row`], in the twin for `UNIT` (which the caller sets only where [`vector_unit`] found
/// it).
fn unary_rows<const UNIT: u8, T: Copy, U>(
    out: &mut [U],
    a: &[T],
    ia: usize,
    sa: usize,
    f: impl Fn(T) -> U,
) {
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX512 {
        // SAFETY: `vector_unit()` found the features the twin is compiled for on this CPU; the twin
        // is `unary_row` itself (safe code, bounds-checked).
        return unsafe { unary_row_avx512(out, a, ia, sa, f) };
    }
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX2 {
        // SAFETY: as for the AVX-512 twin.
        return unsafe { unary_row_avx2(out, a, ia, sa, f) };
    }
    unary_row(out, a, ia, sa, f)
}

twins!(unary_row_avx2, unary_row_avx512,
    <T: Copy, U>(out: &mut [U], a: &[T], ia: usize, sa: usize, f: impl Fn(T) -> U) {
        unary_row(out, a, ia, sa, f)
    }
);

/// [`binary_row`], in the twin for `UNIT` (as [`unary_rows`]).
#[allow(clippy::too_many_arguments)]
fn binary_rows<const UNIT: u8, T: Copy, U>(
    out: &mut [U],
    a: &[T],
    ia: usize,
    sa: usize,
    b: &[T],
    ib: usize,
    sb: usize,
    f: impl Fn(T, T) -> U,
) {
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX512 {
        // SAFETY: as in `unary_rows`: the CPU has what the twin is compiled for, and the twin is
        // `binary_row` (safe code).
        return unsafe { binary_row_avx512(out, a, ia, sa, b, ib, sb, f) };
    }
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX2 {
        // SAFETY: as for the AVX-512 twin.
        return unsafe { binary_row_avx2(out, a, ia, sa, b, ib, sb, f) };
    }
    binary_row(out, a, ia, sa, b, ib, sb, f)
}

twins!(binary_row_avx2, binary_row_avx512,
    <T: Copy, U>(
        out: &mut [U],
        a: &[T],
        ia: usize,
        sa: usize,
        b: &[T],
        ib: usize,
        sb: usize,
        f: impl Fn(T, T) -> U,
    ) {
        binary_row(out, a, ia, sa, b, ib, sb, f)
    }
);

/// `x[i] = f(x[i])` over one contiguous run, in the twin for `UNIT` (as [`unary_rows`]).
fn map_rows_in_place<const UNIT: u8, T: Copy>(x: &mut [T], f: impl Fn(T) -> T) {
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX512 {
        // SAFETY: as in `unary_rows`: the CPU has what the twin is compiled for, and the twin is
        // `map_row_in_place` (safe code).
        return unsafe { map_row_in_place_avx512(x, f) };
    }
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX2 {
        // SAFETY: as for the AVX-512 twin.
        return unsafe { map_row_in_place_avx2(x, f) };
    }
    map_row_in_place(x, f)
}

#[inline(always)]
fn map_row_in_place<T: Copy>(x: &mut [T], f: impl Fn(T) -> T) {
    for v in x {
        *v = f(*v);
    }
}

twins!(map_row_in_place_avx2, map_row_in_place_avx512,
    <T: Copy>(x: &mut [T], f: impl Fn(T) -> T) {
        map_row_in_place(x, f)
    }
);

/// `x[j] = f(x[j], b[ib + j * sb])` over one contiguous run of `x`, in the twin for `UNIT` (as
/// [`unary_rows`]).
fn zip_rows_in_place<const UNIT: u8, T: Copy>(
    x: &mut [T],
    b: &[T],
    ib: usize,
    sb: usize,
    f: impl Fn(T, T) -> T,
) {
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX512 {
        // SAFETY: as in `unary_rows`: the CPU has what the twin is compiled for, and the twin is
        // `zip_row_in_place` (safe code).
        return unsafe { zip_row_in_place_avx512(x, b, ib, sb, f) };
    }
    #[cfg(target_arch = "x86_64")]
    if UNIT == AVX2 {
        // SAFETY: as for the AVX-512 twin.
        return unsafe { zip_row_in_place_avx2(x, b, ib, sb, f) };
    }
    zip_row_in_place(x, b, ib, sb, f)
}

#[inline(always)]
fn zip_row_in_place<T: Copy>(x: &mut [T], b: &[T], ib: usize, sb: usize, f: impl Fn(T, T) -> T) {
    let n = x.len();
    match sb {
        1 => {
            for (v, &y) in x.iter_mut().zip(&b[ib..ib + n]) {
                *v = f(*v, y);
            }
        }
        0 => {
            let y = b[ib];
            for v in x {
                *v = f(*v, y);
            }
        }
        _ => {
            for (j, v) in x.iter_mut().enumerate() {
                *v = f(*v, b[ib + j * sb]);
            }
        }
    }
}

twins!(zip_row_in_place_avx2, zip_row_in_place_avx512,
    <T: Copy>(x: &mut [T], b: &[T], ib: usize, sb: usize, f: impl Fn(T, T) -> T) {
        zip_row_in_place(x, b, ib, sb, f)
    }
);

/// The fewest elements a unary map splits across rayon's threads: [`PARALLEL_MIN`] for the maps
/// that cost about as much as a copy, fewer for those whose elements cost more, so that a thread's
/// share is always worth waking it for (about 5 µs of work or more). Measured on the 2-core Zen 4,
/// AVX-512, `f32`, one thread (BENCHMARKS.md, "Costly maps on both threads"): `abs` 0.08 ns an
/// element; `exp`, `silu`, `sigmoid` 0.45-0.6; `tanh` and `gelu` 0.8-1.0; `sin`, `log`,
/// `gelu_exact` (scalar library calls) 3-5.6. GPT-2's GELU over eight decoding rows (24,576
/// elements) ran on one thread for 24 µs while the other waited.
fn unary_parallel_min(op: Unary) -> usize {
    match op {
        Unary::Exp | Unary::Tanh | Unary::Sigmoid | Unary::Gelu | Unary::Silu => PARALLEL_MIN / 8,
        Unary::Log
        | Unary::Sin
        | Unary::Cos
        | Unary::Log1p
        | Unary::Expm1
        | Unary::Erf
        | Unary::GeluExact
        | Unary::Powf => PARALLEL_MIN / 32,
        _ => PARALLEL_MIN,
    }
}

/// The elements of each task when `len` elements are split across rayon's threads: [`CHUNK`], or
/// fewer for short runs, so that every thread gets about two tasks (a run of 24,576 in tasks of
/// 16,384 would leave one thread a third of the work).
fn map_chunk(len: usize) -> usize {
    len.div_ceil(2 * rayon::current_num_threads())
        .next_multiple_of(64)
        .min(CHUNK)
}

/// `out[i] = f(a[i])` over equal-length contiguous slices, on rayon's threads from `parallel_min`
/// elements.
fn map_contiguous<const UNIT: u8, T: Element, U: Element>(
    out: &mut [U],
    a: &[T],
    f: &(impl Fn(T) -> U + Sync),
    parallel_min: usize,
) {
    if out.len() < parallel_min {
        unary_rows::<UNIT, _, _>(out, a, 0, 1, f);
        return;
    }
    let chunk = map_chunk(out.len());
    out.par_chunks_mut(chunk)
        .zip(a.par_chunks(chunk))
        .for_each(|(o, a)| unary_rows::<UNIT, _, _>(o, a, 0, 1, f));
}

/// `out[i] = f(a[i], b[i])` over equal-length contiguous slices, on rayon's threads when large.
fn zip_contiguous<const UNIT: u8, T: Element>(
    out: &mut [T],
    a: &[T],
    b: &[T],
    f: &(impl Fn(T, T) -> T + Sync),
) {
    if out.len() < PARALLEL_MIN {
        binary_rows::<UNIT, _, _>(out, a, 0, 1, b, 0, 1, f);
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| zip_contiguous::<UNIT, _>(o, a, b, f));
}

/// Runs a unary op's host function from `x` into the fresh contiguous `out`, both of element type `T`
/// (on rayon's threads from `parallel_min` elements, where contiguous).
struct MapInto<'a, T, const UNIT: u8> {
    x: Src<'a>,
    out: Dst<'a>,
    parallel_min: usize,
    _element: PhantomData<T>,
}

impl<T: Math, const UNIT: u8> MapFn<T::Compute> for MapInto<'_, T, UNIT> {
    fn call(self, f: impl Fn(T::Compute) -> T::Compute + Sync + Copy) {
        let MapInto {
            x,
            out,
            parallel_min,
            ..
        } = self;
        let f = move |v: T| T::store(f(v.load()));
        let out = out.contiguous_host::<T>();
        if x.layout.is_contiguous() {
            map_contiguous::<UNIT, _, _>(out, x.contiguous_host::<T>(), &f, parallel_min);
            return;
        }
        let a = x.buf.host::<T>();
        let walk = RowWalk::new(x.layout.shape(), [x.layout.strides()], [x.layout.offset()]);
        let [sa] = walk.row_strides();
        fill_segments(&walk, out, |o, [ia]| {
            unary_rows::<UNIT, _, _>(o, a, ia, sa, f)
        });
    }
}

/// Runs a unary op's host function over contiguous elements of type `T` in place, on rayon's
/// threads from the given number of elements.
struct MapInPlace<'a, T, const UNIT: u8>(Dst<'a>, usize, PhantomData<T>);

impl<T: Math, const UNIT: u8> MapFn<T::Compute> for MapInPlace<'_, T, UNIT> {
    fn call(self, f: impl Fn(T::Compute) -> T::Compute + Sync + Copy) {
        let f = move |v: T| T::store(f(v.load()));
        let (x, parallel_min) = (self.0.contiguous_host::<T>(), self.1);
        if x.len() < parallel_min {
            map_rows_in_place::<UNIT, _>(x, f);
            return;
        }
        x.par_chunks_mut(map_chunk(x.len()))
            .for_each(|run| map_rows_in_place::<UNIT, _>(run, f));
    }
}

/// Runs a binary op's host function from `a` and `b` (laid out with `out`'s shape) into `out`, all
/// of element type `T`.
struct ZipInto<'a, T, const UNIT: u8> {
    a: Src<'a>,
    b: Src<'a>,
    out: Dst<'a>,
    _element: PhantomData<T>,
}

impl<T: Math, const UNIT: u8> ZipFn<T::Compute> for ZipInto<'_, T, UNIT> {
    fn call(self, f: impl Fn(T::Compute, T::Compute) -> T::Compute + Sync + Copy) {
        let ZipInto { a, b, out, .. } = self;
        let f = move |x: T, y: T| T::store(f(x.load(), y.load()));
        let shape = out.layout.shape();
        let out = out.contiguous_host::<T>();
        if a.layout.is_contiguous() && b.layout.is_contiguous() {
            // The common case, without broadcasting or a strided walk.
            zip_contiguous::<UNIT, _>(out, a.contiguous_host::<T>(), b.contiguous_host::<T>(), &f);
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
            binary_rows::<UNIT, _, _>(o, da, ia, sa, db, ib, sb, f)
        });
    }
}

/// Runs a binary op's host function as `x = f(x, b)` over the contiguous `x`, both of type `T`
/// (`b` laid out with `x`'s shape), on rayon's threads when large.
struct ZipInPlace<'a, T, const UNIT: u8> {
    x: Dst<'a>,
    b: Src<'a>,
    _element: PhantomData<T>,
}

impl<T: Math, const UNIT: u8> ZipFn<T::Compute> for ZipInPlace<'_, T, UNIT> {
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
        fill_segments(&walk, x.contiguous_host::<T>(), |run, [_, ib]| {
            zip_rows_in_place::<UNIT, _>(run, db, ib, sb, f)
        });
    }
}

/// `$run` with `$unit` a constant: the CPU's [`vector_unit`]. One visitor type per unit, so that
/// the op's closure is a different type in each and is inlined into its one loop (shared by the
/// loops, it was called per element from the AVX-512 one).
macro_rules! on_vector_unit {
    ($unit:ident => $run:expr) => {
        match vector_unit() {
            AVX512 => {
                const $unit: u8 = AVX512;
                $run
            }
            AVX2 => {
                const $unit: u8 = AVX2;
                $run
            }
            _ => {
                const $unit: u8 = BASELINE;
                $run
            }
        }
    };
}

pub(super) fn unary(dtype: DType, op: Unary, params: [f64; 2], x: Src, out: Dst) {
    let parallel_min = unary_parallel_min(op);
    on_vector_unit!(U => with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, MapInto::<T, U> { x, out, parallel_min, _element: PhantomData })))
}

pub(super) fn unary_in_place(dtype: DType, op: Unary, params: [f64; 2], x: Dst) {
    let parallel_min = unary_parallel_min(op);
    on_vector_unit!(U => with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, MapInPlace::<T, U>(x, parallel_min, PhantomData))))
}

pub(super) fn binary(dtype: DType, op: Binary, params: [f64; 2], a: Src, b: Src, out: Dst) {
    on_vector_unit!(U => with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, ZipInto::<T, U> { a, b, out, _element: PhantomData })))
}

pub(super) fn binary_in_place(dtype: DType, op: Binary, params: [f64; 2], x: Dst, b: Src) {
    on_vector_unit!(U => with_dtype!(dtype, T => op.host::<<T as Math>::Compute>(params, ZipInPlace::<T, U> { x, b, _element: PhantomData })))
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

/// A conversion of a run of consecutive elements in vector registers, bit for bit the element-wise
/// one.
type RunConversion<S, D> = fn(&[S], &mut [D]);

/// `out = f(x)` element by element in row-major order, `out` contiguous (in parallel when large)
/// or any non-overlapping view. With `runs` (a vector conversion of `f`'s bits), a contiguous
/// output takes each of the walk's runs of consecutive elements through it (a head's slice of packed
/// rows, rounded for a 16-bit cache): element by element it was 3 % of eight requests' decoding of
/// GPT-2 small.
fn copy_with<S: Element, D: Element>(
    x: Src,
    out: Dst,
    f: impl Fn(S) -> D + Sync + Copy,
    runs: Option<RunConversion<S, D>>,
) {
    let a = x.buf.host::<S>();
    let (ls, ld) = (x.layout, out.layout);
    if ld.is_contiguous() {
        let walk = RowWalk::new(ls.shape(), [ls.strides()], [ls.offset()]);
        let [sa] = walk.row_strides();
        fill_segments(&walk, out.contiguous_host::<D>(), |o, [ia]| match runs {
            Some(convert) if sa == 1 => convert(&a[ia..ia + o.len()], o),
            _ => unary_row(o, a, ia, sa, f),
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

/// `out = x` converted by `convert`, a run of contiguous elements at a time (in parallel when
/// large); both layouts contiguous.
fn convert_runs<S: Element, D: Element>(x: Src, out: Dst, convert: fn(&[S], &mut [D])) {
    let out = out.contiguous_host::<D>();
    let from = &x.buf.host::<S>()[x.layout.offset()..x.layout.offset() + out.len()];
    convert_chunks(from, out, convert);
}

pub(super) fn copy(from: DType, to: DType, x: Src, out: Dst) {
    if from == to {
        // A plain copy: never through `f64`, which would round large integers.
        with_dtype!(from, T => copy_with::<T, T>(x, out, |v| v, None));
        return;
    }
    // Between f32 and the 16-bit types, convert directly (rounding f32 through f64 to 16 bits is the
    // same single rounding, but the f64 path neither vectorises nor runs branch-free).
    // Contiguous runs (autocast's weights, a cache's keys) convert a chunk at once, in vector
    // registers: the same bits as the element-wise closures.
    // A view converts its runs so too (`copy_with`).
    let runs = x.layout.is_contiguous() && out.layout.is_contiguous();
    match (from, to) {
        (DType::F32, DType::BF16) if runs => convert_runs::<f32, bf16>(x, out, bf16::narrow),
        (DType::BF16, DType::F32) if runs => convert_runs::<bf16, f32>(x, out, bf16::widen),
        (DType::F32, DType::F16) if runs => convert_runs::<f32, f16>(x, out, f16::narrow),
        (DType::F16, DType::F32) if runs => convert_runs::<f16, f32>(x, out, f16::widen),
        (DType::F32, DType::BF16) => copy_with(x, out, bf16_of_f32, Some(bf16::narrow)),
        (DType::BF16, DType::F32) => copy_with(x, out, bf16::to_f32, Some(bf16::widen)),
        (DType::F32, DType::F16) => copy_with(x, out, f16::from_f32, Some(f16::narrow)),
        (DType::F16, DType::F32) => copy_with(x, out, f16::to_f32, Some(f16::widen)),
        _ => with_dtype!(from, S => with_dtype!(to, D => {
            copy_with::<S, D>(x, out, |v| D::from_f64(v.to_f64()), None)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs an op's host function over `x` (and `y`, for binary ops) with the baseline loop and with
    /// the row loops for `UNIT` (its twin), and asserts the same bits (any NaN for any NaN). Built
    /// only for a unit [`vector_unit`] found.
    struct Twins<'a, T, const UNIT: u8> {
        x: &'a [T],
        y: &'a [T],
        op: &'a str,
    }

    fn assert_same<T: Element>(base: &[T], wide: &[T], op: &str, unit: u8) {
        for (i, (b, w)) in base.iter().zip(wide).enumerate() {
            let (b, w) = (b.to_f64(), w.to_f64());
            assert!(
                b.to_bits() == w.to_bits() || (b.is_nan() && w.is_nan()),
                "{op} {}: element {i}: {b} (baseline) vs {w} (vector unit {unit})",
                T::DTYPE
            );
        }
    }

    impl<T: Math, const UNIT: u8> MapFn<T::Compute> for Twins<'_, T, UNIT> {
        fn call(self, f: impl Fn(T::Compute) -> T::Compute + Sync + Copy) {
            let f = move |v: T| T::store(f(v.load()));
            let (mut base, mut wide) =
                (vec![T::zero(); self.x.len()], vec![T::zero(); self.x.len()]);
            unary_row(&mut base, self.x, 0, 1, f);
            unary_rows::<UNIT, _, _>(&mut wide, self.x, 0, 1, f);
            assert_same(&base, &wide, self.op, UNIT);
            // In place: the baseline out-of-place bits.
            let mut in_place = self.x.to_vec();
            map_rows_in_place::<UNIT, _>(&mut in_place, f);
            assert_same(&base, &in_place, self.op, UNIT);
        }
    }

    impl<T: Math, const UNIT: u8> ZipFn<T::Compute> for Twins<'_, T, UNIT> {
        fn call(self, f: impl Fn(T::Compute, T::Compute) -> T::Compute + Sync + Copy) {
            let f = move |x: T, y: T| T::store(f(x.load(), y.load()));
            let (mut base, mut wide) =
                (vec![T::zero(); self.x.len()], vec![T::zero(); self.x.len()]);
            binary_row(&mut base, self.x, 0, 1, self.y, 0, 1, f);
            binary_rows::<UNIT, _, _>(&mut wide, self.x, 0, 1, self.y, 0, 1, f);
            assert_same(&base, &wide, self.op, UNIT);
            let mut in_place = self.x.to_vec();
            zip_rows_in_place::<UNIT, _>(&mut in_place, self.y, 0, 1, f);
            assert_same(&base, &in_place, self.op, UNIT);
            // A broadcast `b` (stride 0) against the baseline's.
            binary_row(&mut base, self.x, 0, 1, self.y, 5, 0, f);
            let mut in_place = self.x.to_vec();
            zip_rows_in_place::<UNIT, _>(&mut in_place, self.y, 5, 0, f);
            assert_same(&base, &in_place, self.op, UNIT);
        }
    }

    /// Values across the ranges the maps branch on: small, large, signed zeros, infinities.
    fn values<T: Element>(len: usize, seed: u64) -> Vec<T> {
        let mut rng = crate::rng::Rng::new(seed);
        let mut v: Vec<T> = (0..len)
            .map(|_| {
                let u = (rng.next_u64() >> 40) as f64 / (1u64 << 24) as f64;
                T::from_f64((u * 2.0 - 1.0) * 12.0)
            })
            .collect();
        for (slot, special) in v
            .iter_mut()
            .zip([0.0, -0.0, 1e-30, -100.0, 100.0, f64::INFINITY])
        {
            *slot = T::from_f64(special);
        }
        v
    }

    fn both_paths<T: Math, const UNIT: u8>() {
        let (x, y) = (values::<T>(1003, 1), values::<T>(1003, 2));
        for op in [
            Unary::Gelu,
            Unary::GeluExact,
            Unary::Tanh,
            Unary::Exp,
            Unary::Sigmoid,
            Unary::Silu,
            Unary::Log,
            Unary::Sqrt,
            Unary::Relu,
            Unary::Erf,
            Unary::Clamp,
            Unary::Powf,
        ] {
            let op_name = format!("{op:?}");
            op.host::<T::Compute>(
                [-0.5, 2.5],
                Twins::<T, UNIT> {
                    x: &x,
                    y: &y,
                    op: &op_name,
                },
            );
        }
        for op in [Binary::Add, Binary::Mul, Binary::Div, Binary::GeluGrad] {
            let op_name = format!("{op:?}");
            op.host::<T::Compute>(
                [0.0, 0.0],
                Twins::<T, UNIT> {
                    x: &x,
                    y: &y,
                    op: &op_name,
                },
            );
        }
    }

    /// Cutting a map across the threads changes no element: with any threshold (1: every length
    /// split) the tasks give the single loop's bits, at lengths around the tasks' sizes.
    #[test]
    fn a_map_split_across_threads_gives_the_single_loops_bits() {
        struct Split<'a>(&'a [f32]);
        impl MapFn<f32> for Split<'_> {
            fn call(self, f: impl Fn(f32) -> f32 + Sync + Copy) {
                let mut whole = vec![0.0f32; self.0.len()];
                unary_row(&mut whole, self.0, 0, 1, f);
                for parallel_min in [1, 2048, 8192] {
                    let mut split = vec![f32::NAN; self.0.len()];
                    map_contiguous::<BASELINE, _, _>(&mut split, self.0, &f, parallel_min);
                    assert_same(&whole, &split, "split map", BASELINE);
                }
            }
        }
        for len in [1, 63, 64, 65, 2048, 8193, 24_576, 65_537] {
            let x = values::<f32>(len, len as u64);
            for op in [Unary::Gelu, Unary::Sin, Unary::Abs] {
                op.host::<f32>([0.0, 0.0], Split(&x));
            }
            let chunk = map_chunk(len);
            assert!(
                chunk.is_multiple_of(64) && (64..=CHUNK).contains(&chunk),
                "{len}: {chunk}"
            );
        }
    }

    /// The costlier a map's element, the fewer elements it takes to use the threads; the cheap
    /// maps keep the copy-sized threshold.
    #[test]
    fn costly_maps_split_sooner() {
        assert_eq!(unary_parallel_min(Unary::Abs), PARALLEL_MIN);
        assert_eq!(unary_parallel_min(Unary::AddScalar), PARALLEL_MIN);
        assert!(unary_parallel_min(Unary::Gelu) < PARALLEL_MIN);
        assert!(unary_parallel_min(Unary::GeluExact) < unary_parallel_min(Unary::Gelu));
    }

    /// The maps' AVX-512 and AVX2 twins, out of place and in place, give the baseline's bits, for
    /// `f32`, `bf16` (widened and rounded around the op) and `f64` elements.
    #[test]
    fn the_vector_twins_give_the_baseline_bits() {
        let unit = vector_unit();
        if unit >= AVX512 {
            both_paths::<f32, AVX512>();
            both_paths::<bf16, AVX512>();
            both_paths::<f64, AVX512>();
        } else {
            println!("elementwise: the AVX-512 twins not run (this CPU lacks AVX-512F or BW)");
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            both_paths::<f32, AVX2>();
            both_paths::<bf16, AVX2>();
            both_paths::<f64, AVX2>();
            return;
        }
        println!("elementwise: the AVX2 twins not run (this CPU lacks AVX2 or FMA)");
    }
}
