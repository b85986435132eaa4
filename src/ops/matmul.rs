//! Matrix products with NumPy semantics (batch broadcasting, vector operands).

use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Shape, broadcast_shapes};
use crate::ops::{require_float, same_device, same_dtype, scratch};
use crate::tensor::Tensor;

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
        same_dtype("matmul", self, other)?;
        self.product(other, false)
    }

    /// The matrix product computed in `dtype`, [`matmul`](Self::matmul)'s rules otherwise: the
    /// result of `self.to_dtype(dtype)?.matmul(&other.to_dtype(dtype)?)`, bit for bit. Autocast's
    /// products are this op: where the backend rounds an `f32` right operand as it packs it (the
    /// host's `bf16` products on AVX-512 BF16), no rounded copy of it is written, which for a
    /// weight is a copy of the weight every step.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// use ndscope::{DType, bf16};
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?.to_dtype(DType::BF16)?;
    /// // An f32 weight: 1.001 is not a bf16; the product reads it rounded, to 1.0.
    /// let w = s.from_slice(&[0.5f32, 1.001, 1.5, 2.0], &[2, 2])?;
    /// let y = x.matmul_as(&w, DType::BF16)?;
    /// assert_eq!(y.dtype(), DType::BF16);
    /// assert_eq!(y.to_vec::<bf16>()?, x.matmul(&w.to_dtype(DType::BF16)?)?.to_vec::<bf16>()?);
    /// assert_eq!(y.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![3.5, 5.0, 7.5, 11.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`matmul`](Self::matmul) and [`to_dtype`](Self::to_dtype);
    /// [`Error::UnsupportedDType`] for an integer `dtype`.
    #[track_caller]
    pub fn matmul_as(&self, other: &Tensor<'s>, dtype: DType) -> Result<Tensor<'s>> {
        const OP: &str = "matmul_as";
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype,
                expected: "a float dtype to compute the product in",
            });
        }
        same_device(OP, self, other)?;
        require_float(OP, self)?;
        require_float(OP, other)?;
        let a = if self.dtype() == dtype {
            self.clone()
        } else {
            self.to_dtype(dtype)?
        };
        if other.dtype() == dtype {
            return a.product(other, false);
        }
        if other.dtype() == DType::F32 && other.backend()?.matmul_rounds(dtype) {
            return a.product(other, true);
        }
        a.product(&other.to_dtype(dtype)?, false)
    }

    /// `self @ other` in `self`'s dtype; `other` in it too, or (`rounding`, where the backend
    /// [`matmul_rounds`](crate::backend::Backend::matmul_rounds)) in `f32`, rounded as it is read.
    #[track_caller]
    fn product(&self, other: &Tensor<'s>, rounding: bool) -> Result<Tensor<'s>> {
        const OP: &str = "matmul";
        same_device(OP, self, other)?;
        require_float(OP, self)?;
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
        let backend = self.backend()?;
        // An operand the backend cannot read in place is packed: one matrix contiguous, or a batch
        // of them broadcast to the full batch, contiguous.
        let packed = |t: Tensor<'s>| -> Result<Tensor<'s>> {
            if backend.matmul_reads(t.layout(), &batch) {
                return Ok(t);
            }
            if t.shape()[..t.rank() - 2].iter().product::<usize>() <= 1 {
                return t.contiguous();
            }
            let mut full: Shape = batch.clone();
            full.extend_from_slice(&t.shape()[t.rank() - 2..]);
            t.broadcast_to(&full)?.contiguous()
        };
        let (a, b) = (packed(a)?, packed(b)?);
        let tf32 = out.allows_tf32();
        // Memory the backend packs the operands into: a temporary of this scope, freed (to the
        // pool) when the product returns, so a training step packs into the same blocks each time.
        let scratch_bytes =
            backend.matmul_scratch_bytes(self.dtype(), a.layout(), b.layout(), (m, k, n));
        let mut packing = scratch(&[self, other], scratch_bytes, Location::caller())?;
        let scratch = packing.as_mut().map(|s| s.dst());
        if rounding {
            let mkn = (m, k, n);
            backend.matmul_rounding(
                self.dtype(),
                a.src(),
                b.src(),
                &batch,
                mkn,
                out.dst(),
                scratch,
            )?;
        } else {
            backend.matmul(
                self.dtype(),
                a.src(),
                b.src(),
                &batch,
                (m, k, n),
                out.dst(),
                tf32,
                scratch,
            )?;
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
}
