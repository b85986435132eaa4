//! Matrix products through the `gemm` crate, which reads any strides (so transposed views need no
//! copy) and runs its own cache-blocked, SIMD kernels.

use std::panic::Location;

use gemm::Parallelism;

use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{RowWalk, Shape, broadcast_shapes, contiguous_strides};
use crate::ops::{same_device, same_dtype};
use crate::tensor::Tensor;

/// Products with fewer multiply-adds than this run on one thread.
const PARALLEL_FLOPS: usize = 48 * 48 * 48;

impl<'s> Tensor<'s> {
    /// Matrix product with NumPy semantics: `[.., m, k] @ [.., k, n] -> [.., m, n]`, batch dimensions
    /// broadcast; a 1-D operand is a row (left) or column (right) vector whose axis is removed from the
    /// result.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let a = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let i = s.from_slice(&[1.0f32, 0.0, 0.0, 1.0], &[2, 2])?;
    /// assert_eq!(a.matmul(&i)?.to_vec::<f32>()?, a.to_vec::<f32>()?);
    /// assert_eq!(a.matmul(&a.t()?)?.to_vec::<f32>()?, vec![5.0, 11.0, 11.0, 25.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the inner dimensions differ or the batch dimensions do not
    /// broadcast; [`Error::UnsupportedDType`] for integers; [`Error::InvalidShape`] for 0-D operands.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
        const OP: &str = "matmul";
        same_dtype(OP, self, other)?;
        same_device(OP, self, other)?;
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                expected: "a float dtype (f32 or f64)",
            });
        }
        for t in [self, other] {
            if t.rank() == 0 {
                return Err(Error::InvalidShape {
                    op: OP,
                    shape: vec![],
                    reason: "matmul needs operands of rank 1 or more; multiply scalars with mul"
                        .into(),
                });
            }
        }
        let a = if self.rank() == 1 {
            self.unsqueeze(0)?
        } else {
            self.clone()
        };
        let b = if other.rank() == 1 {
            other.unsqueeze(1)?
        } else {
            other.clone()
        };
        let (ar, br) = (a.rank(), b.rank());
        let (m, k) = (a.shape()[ar - 2], a.shape()[ar - 1]);
        let (k2, n) = (b.shape()[br - 2], b.shape()[br - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
                hint: "the last dimension of the left operand must equal the second-to-last of the right",
            });
        }
        let batch = broadcast_shapes(OP, &a.shape()[..ar - 2], &b.shape()[..br - 2])?;
        let mut out_shape: Shape = batch.clone();
        out_shape.extend_from_slice(&[m, n]);
        let mut out =
            Tensor::output_of(&[self, other], self.dtype(), &out_shape, Location::caller())?;
        match out.device() {
            Device::Cpu => Self::matmul_on_host(&a, &b, &batch, (m, k, n), &mut out),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => crate::cuda::matmul(&a, &b, &batch, (m, k, n), &mut out)?,
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => unreachable!("no GPU tensor exists without the CUDA backend"),
        }
        // Remove the vector axes: the row of a 1-D left operand first (at -2), then the column of a 1-D
        // right operand (at -1 whichever came before).
        let mut out = out;
        if self.rank() == 1 {
            out = out.squeeze(-2)?;
        }
        if other.rank() == 1 {
            out = out.squeeze(-1)?;
        }
        Ok(out)
    }

    /// The host product into the fresh contiguous `out` (float dtypes, checked by `matmul`).
    fn matmul_on_host(
        a: &Tensor<'_>,
        b: &Tensor<'_>,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: &mut Tensor<'_>,
    ) {
        match out.dtype() {
            DType::F32 => matmul_into::<f32>(a, b, batch, mkn, out.fresh_mut::<f32>()),
            DType::F64 => matmul_into::<f64>(a, b, batch, mkn, out.fresh_mut::<f64>()),
            DType::I64 => unreachable!("matmul refuses integer dtypes before computing"),
        }
    }
}

/// `out[b] = a[b] @ b[b]` for every batch index.
fn matmul_into<T: Element>(
    a: &Tensor<'_>,
    b: &Tensor<'_>,
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
    out: &mut [T],
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(T::zero());
        return;
    }
    let (ar, br) = (a.rank(), b.rank());
    let batch_layout = |t: &Tensor<'_>, r: usize| {
        let mut shape: Shape = t.shape()[..r - 2].iter().copied().collect();
        let mut strides: Shape = t.strides()[..r - 2].iter().copied().collect();
        // Broadcast the batch part alone.
        let lead = batch.len() - shape.len();
        for _ in 0..lead {
            shape.insert(0, 1);
            strides.insert(0, 0);
        }
        for i in 0..batch.len() {
            if shape[i] == 1 && batch[i] != 1 {
                strides[i] = 0;
            }
        }
        strides
    };
    let (sa, sb) = (batch_layout(a, ar), batch_layout(b, br));
    let so = contiguous_strides(batch)
        .iter()
        .map(|s| s * m * n)
        .collect::<Shape>();
    let walk = RowWalk::new(
        batch,
        [&sa, &sb, &so],
        [a.layout().offset(), b.layout().offset(), 0],
    );
    let [rsa, rsb, rso] = walk.row_strides();
    let (a_rs, a_cs) = (a.strides()[ar - 2] as isize, a.strides()[ar - 1] as isize);
    let (b_rs, b_cs) = (b.strides()[br - 2] as isize, b.strides()[br - 1] as isize);
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FLOPS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    let (da, db) = (a.block_data::<T>(), b.block_data::<T>());
    let total: usize = batch.iter().product();
    walk.for_segments(0, total, |_, [oa, ob, oo], len| {
        for j in 0..len {
            let (ia, ib, io) = (oa + j * rsa, ob + j * rsb, oo + j * rso);
            debug_assert!(io + m * n <= out.len());
            // SAFETY: `a`'s layout keeps every element `ia + r*a_rs + c*a_cs` (r < m, c < k) inside its
            // block (layouts are checked against the block when created), likewise `b`; `out` is a
            // fresh contiguous block of `batch * m * n` elements, so rows `io..io + m*n` are in bounds
            // and it overlaps neither input. With `read_dst = false` the old contents are not read.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    out.as_mut_ptr().add(io),
                    1,
                    n as isize,
                    false,
                    da.as_ptr().add(ia),
                    a_cs,
                    a_rs,
                    db.as_ptr().add(ib),
                    b_cs,
                    b_rs,
                    T::zero(),
                    T::one(),
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
        }
    });
}
