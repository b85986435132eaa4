//! Strided copies: gathering a view into contiguous memory.

use crate::dtype::Element;
use crate::layout::RowWalk;
use crate::ops::fill_segments;
use crate::tensor::Tensor;

/// Copies `src`'s elements in row-major order into the contiguous `dst` (of `src.numel()` elements).
pub(crate) fn copy_strided<T: Element>(src: &Tensor<'_>, dst: &mut [T]) {
    let data = src.block_data::<T>();
    let walk = RowWalk::new(src.shape(), [src.strides()], [src.layout().offset()]);
    let [stride] = walk.row_strides();
    fill_segments(&walk, dst, |out, [start]| {
        if stride == 1 {
            out.copy_from_slice(&data[start..start + out.len()]);
        } else {
            for (j, o) in out.iter_mut().enumerate() {
                *o = data[start + j * stride];
            }
        }
    });
}

/// Copies `src` (already broadcast to `dst_shape`) into `dst`, a block viewed through `dst_strides`
/// from `dst_offset`. The destination elements must not overlap each other.
pub(crate) fn copy_into_view<T: Element>(
    src: &Tensor<'_>,
    dst: &mut [T],
    dst_strides: &[usize],
    dst_offset: usize,
) {
    let data = src.block_data::<T>();
    let walk = RowWalk::new(
        src.shape(),
        [src.strides(), dst_strides],
        [src.layout().offset(), dst_offset],
    );
    let [ss, ds] = walk.row_strides();
    let len = walk.row_len();
    walk.for_rows(0, walk.rows(), |_, [s, d]| {
        for j in 0..len {
            dst[d + j * ds] = data[s + j * ss];
        }
    });
}
