//! Host indexing kernels: `gather` (and `index_select`, a gather with a broadcast index) and
//! `scatter_add` (and `index_add`). Indices were checked by the op.

use super::fill_segments;
use crate::backend::{Dst, Src};
use crate::dtype::{DType, Element, with_dtype};
use crate::layout::{RowWalk, Shape};

pub(super) fn gather(dtype: DType, src: Src, axis: usize, index: Src, out: Dst) {
    let mut src_strides: Shape = src.layout.strides().into();
    let step = src_strides[axis];
    src_strides[axis] = 0;
    let walk = RowWalk::new(
        index.layout.shape(),
        [index.layout.strides(), &src_strides],
        [index.layout.offset(), src.layout.offset()],
    );
    let [si, ss] = walk.row_strides();
    let idx = index.buf.host::<i64>();
    with_dtype!(dtype, T => {
        let from = src.buf.host::<T>();
        fill_segments(&walk, out.contiguous_host::<T>(), |o, [ii, is]| {
            for (j, v) in o.iter_mut().enumerate() {
                *v = from[is + j * ss + idx[ii + j * si] as usize * step];
            }
        });
    });
}

pub(super) fn scatter_add(dtype: DType, target: Dst, axis: usize, index: Src, src: Src) {
    let mut dst_strides: Shape = target.layout.strides().into();
    let step = dst_strides[axis];
    dst_strides[axis] = 0;
    let walk = RowWalk::new(
        src.layout.shape(),
        [index.layout.strides(), src.layout.strides(), &dst_strides],
        [
            index.layout.offset(),
            src.layout.offset(),
            target.layout.offset(),
        ],
    );
    let [si, ss, sd] = walk.row_strides();
    let len = walk.row_len();
    let idx = index.buf.host::<i64>();
    with_dtype!(dtype, T => {
        let from = src.buf.host::<T>();
        let dst = target.buf.host::<T>();
        // Serial on purpose: two source elements may land on the same destination.
        walk.for_rows(0, walk.rows(), |_, [ii, is, id]| {
            for j in 0..len {
                let at = id + j * sd + idx[ii + j * si] as usize * step;
                dst[at] = dst[at].add(from[is + j * ss]);
            }
        });
    });
}
