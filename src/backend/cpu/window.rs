//! Host sliding-window kernels: `unfold2d` (im2col) and its adjoint `fold2d` (col2im), one plane
//! per rayon task.

use rayon::prelude::*;

use crate::backend::op::{Math, Window2d};
use crate::backend::{Dst, Src};
use crate::dtype::{DType, Element, with_dtype};

pub(super) fn unfold2d(dtype: DType, w: &Window2d, pad: f64, x: Src, out: Dst) {
    let [rows, cols] = w.input;
    let plane = rows * cols;
    let [oh, ow] = w.output;
    with_dtype!(dtype, T => {
        let pad = T::from_f64(pad);
        let x = &x.contiguous_host::<T>()[..w.planes * plane];
        let out = out.contiguous_host::<T>();
        if w.planes == 0 {
            return;
        }
        // The op refuses empty planes and windows that do not fit, so both chunk sizes are positive.
        out.par_chunks_mut(w.columns_per_plane())
            .zip(x.par_chunks(plane))
            .for_each(|(columns, x)| {
                let mut at = 0;
                for ki in 0..w.kernel[0] {
                    for kj in 0..w.kernel[1] {
                        for oy in 0..oh {
                            let row = &mut columns[at..at + ow];
                            at += ow;
                            let Some(iy) = w.source(0, oy, ki) else {
                                row.fill(pad);
                                continue;
                            };
                            let line = &x[iy * cols..(iy + 1) * cols];
                            for (ox, v) in row.iter_mut().enumerate() {
                                *v = w.source(1, ox, kj).map_or(pad, |ix| line[ix]);
                            }
                        }
                    }
                }
            });
    });
}

pub(super) fn fold2d(dtype: DType, w: &Window2d, cols: Src, out: Dst) {
    if w.planes == 0 {
        return;
    }
    with_dtype!(dtype, T => {
        let cols = &cols.contiguous_host::<T>()[..w.planes * w.columns_per_plane()];
        let out = out.contiguous_host::<T>();
        let plane = w.input[0] * w.input[1];
        out.par_chunks_mut(plane)
            .zip(cols.par_chunks(w.columns_per_plane()))
            .for_each(|(out, columns)| {
                if T::DTYPE.is_half() {
                    // Sums of overlapping windows accumulate in `f32`, rounded once at the end.
                    let mut acc = vec![<T as Math>::Compute::zero(); plane];
                    fold_plane(w, &mut acc, columns);
                    out.iter_mut().zip(acc).for_each(|(o, a)| *o = T::store(a));
                } else {
                    fold_plane(w, out, columns);
                }
            });
    });
}

/// Sums one plane's columns into `acc` (of element type `A`, the columns' type or its compute type).
fn fold_plane<T: Math, A: Math<Compute = T::Compute>>(w: &Window2d, acc: &mut [A], columns: &[T]) {
    let width = w.input[1];
    let [oh, ow] = w.output;
    acc.fill(A::zero());
    let mut at = 0;
    for ki in 0..w.kernel[0] {
        for kj in 0..w.kernel[1] {
            for oy in 0..oh {
                let row = &columns[at..at + ow];
                at += ow;
                let Some(iy) = w.source(0, oy, ki) else {
                    continue;
                };
                let line = &mut acc[iy * width..(iy + 1) * width];
                for (ox, &v) in row.iter().enumerate() {
                    if let Some(ix) = w.source(1, ox, kj) {
                        line[ix] = A::store(line[ix].load().add(v.load()));
                    }
                }
            }
        }
    }
}
