//! Host fused updates: one pass that rewrites several contiguous tensors from one source, as
//! optimizers need (a parameter and its moment estimates from a gradient) without a temporary per
//! term.

use std::marker::PhantomData;

use rayon::prelude::*;
use smallvec::SmallVec;

use super::{CHUNK, PARALLEL_MIN};
use crate::backend::op::{FusedUpdate, Math, UpdateFn};
use crate::backend::{Dst, Src};
use crate::dtype::{DType, Element, with_float_dtype};
use crate::layout::RowWalk;

pub(super) fn update(
    dtype: DType,
    update: FusedUpdate,
    targets: SmallVec<[Dst; 3]>,
    grad: Src,
    powers: Option<Src>,
) {
    let powers = powers.map_or([0.0; 2], |p| {
        let p = p.contiguous_host::<f64>();
        [p[0], p[1]]
    });
    with_float_dtype!(dtype, T => update.host::<<T as Math>::Compute>(
            powers,
            Update::<T> { targets, grad, _element: PhantomData },
        ), else unreachable!("optimizers refuse integer parameters before updating"));
}

/// Runs an update's host function over its targets, all of element type `T`: each element is loaded
/// into the compute type, updated there and stored back (one rounding per target for 16-bit ones).
struct Update<'a, 'b, T> {
    targets: SmallVec<[Dst<'a>; 3]>,
    grad: Src<'b>,
    _element: PhantomData<T>,
}

impl<T: Math> UpdateFn<T::Compute> for Update<'_, '_, T> {
    fn call<const M: usize>(self, f: impl Fn([&mut T::Compute; M], T::Compute) + Sync + Copy) {
        let Update { targets, grad, .. } = self;
        let f = move |targets: [&mut T; M], g: T| {
            let mut wide = targets.map(|t| (t.load(), t));
            f(wide.each_mut().map(|(w, _)| w), g.load());
            for (w, t) in wide {
                *t = T::store(w);
            }
        };
        assert_eq!(
            targets.len(),
            M,
            "an update gets the targets its function rewrites"
        );
        let mut targets = targets.into_iter();
        let slices: [&mut [T]; M] = std::array::from_fn(|_| {
            targets
                .next()
                .expect("counted above")
                .contiguous_host::<T>()
        });
        if grad.layout.is_contiguous() {
            update_contiguous(slices, grad.contiguous_host::<T>(), &f);
            return;
        }
        let mut slices = slices;
        let (src, n) = (grad.buf.host::<T>(), grad.layout.numel());
        let walk = RowWalk::new(
            grad.layout.shape(),
            [grad.layout.strides()],
            [grad.layout.offset()],
        );
        let [ss] = walk.row_strides();
        walk.for_segments(0, n, |pos, [is], len| {
            for j in 0..len {
                let at = pos + j;
                f(slices.each_mut().map(|s| &mut s[at]), src[is + j * ss]);
            }
        });
    }
}

/// The update over contiguous elements: split into chunks that rayon's threads take when there are
/// enough elements (an optimizer step over a large weight), on the calling thread otherwise.
fn update_contiguous<T: Element, const M: usize>(
    targets: [&mut [T]; M],
    source: &[T],
    f: &(impl Fn([&mut T; M], T) + Sync),
) {
    if source.len() < PARALLEL_MIN {
        update_chunk(targets, source, f);
        return;
    }
    let mut pieces = Vec::with_capacity(source.len().div_ceil(CHUNK));
    let (mut rest, mut src) = (targets, source);
    while !src.is_empty() {
        let take = CHUNK.min(src.len());
        let mut halves = rest.map(|s| s.split_at_mut(take));
        // `&mut [T]` defaults to an empty slice, so the heads can be taken out of the pairs.
        let heads = halves.each_mut().map(|(head, _)| std::mem::take(head));
        rest = halves.map(|(_, tail)| tail);
        pieces.push((heads, &src[..take]));
        src = &src[take..];
    }
    pieces
        .into_par_iter()
        .for_each(|(targets, source)| update_chunk(targets, source, f));
}

/// One pass over a chunk; every target has the source's length.
#[inline]
fn update_chunk<T: Element, const M: usize>(
    mut targets: [&mut [T]; M],
    source: &[T],
    f: &impl Fn([&mut T; M], T),
) {
    let n = source.len();
    // Re-slicing to exactly `n` lets the compiler drop the bounds checks in the loop.
    let mut targets = targets.each_mut().map(|t| &mut t[..n]);
    for (j, &g) in source.iter().enumerate() {
        f(targets.each_mut().map(|t| &mut t[j]), g);
    }
}
