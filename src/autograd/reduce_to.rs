//! Undoing broadcasting in the backward pass: the gradient of a broadcast operand is the output
//! gradient summed over the axes the operand was stretched along.

use smallvec::SmallVec;

use crate::error::Result;
use crate::tensor::Tensor;

/// Sums `grad` down to `shape`, the shape of an operand that was broadcast to `grad`'s shape.
pub(crate) fn sum_to<'s>(grad: &Tensor<'s>, shape: &[usize]) -> Result<Tensor<'s>> {
    if grad.shape() == shape {
        return Ok(grad.clone());
    }
    let extra = grad.rank() - shape.len();
    let mut axes: SmallVec<[isize; 6]> = (0..extra as isize).collect();
    for (i, &d) in shape.iter().enumerate() {
        if d == 1 && grad.shape()[extra + i] != 1 {
            axes.push((extra + i) as isize);
        }
    }
    grad.sum(&axes, true)?.reshape(shape)
}
