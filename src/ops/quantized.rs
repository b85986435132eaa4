//! Products with block-quantized matrices: a `Linear`'s `x Wᵀ` reading the weight's blocks.

use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::{require_float, same_device, scratch};
use crate::tensor::{QuantTensor, Tensor};

impl<'s> Tensor<'s> {
    /// `self Wᵀ` for `self` `[.., k]` (a float dtype) and the quantized matrix `w` `[n, k]`: the
    /// product a `Linear` layer computes with the weight stored in `[out, in]` layout, reading
    /// `w`'s blocks once for every row of `self`. Computed as llama.cpp computes it: each row of
    /// `self` rounded to 8 bits per block of 32 values (scale `max|x| / 127`, kept in `f16` as
    /// llama.cpp's Q8_0 blocks keep it), then exact integer products per block, summed in `f32` with the blocks' scales. The result has `self`'s dtype
    /// and shape `[.., n]`.
    ///
    /// ```
    /// use ndscope::quant::QuantType;
    /// use ndscope::{Device, QuantTensor, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let w = s.from_slice(&(0..3 * 64).map(|i| ((i % 7) as f32 - 3.0) / 4.0).collect::<Vec<_>>(), &[3, 64])?;
    ///     let x = s.from_slice(&(0..2 * 64).map(|i| ((i % 5) as f32 - 2.0) / 2.0).collect::<Vec<_>>(), &[2, 64])?;
    ///     let q = QuantTensor::quantize(&w, QuantType::Q8_0)?;
    ///     let y = x.matmul_quantized_t(&q)?; // [2, 3]
    ///     let exact = x.matmul(&w.t()?)?;
    ///     // Weights and activations rounded to 8 bits per block: within 1 % of the exact product here.
    ///     for (a, b) in y.to_vec::<f32>()?.iter().zip(exact.to_vec::<f32>()?) {
    ///         assert!((a - b).abs() <= 0.01 * b.abs().max(1.0), "{a} vs {b}");
    ///     }
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `self`'s last dimension is not `w`'s row length;
    /// [`Error::InvalidShape`] for a 0-D `self`; [`Error::UnsupportedDType`] for integers;
    /// [`Error::DeviceMismatch`] across devices.
    #[track_caller]
    pub fn matmul_quantized_t(&self, w: &QuantTensor<'s>) -> Result<Tensor<'s>> {
        const OP: &str = "matmul_quantized_t";
        same_device(OP, self, w.blocks())?;
        require_float(OP, self)?;
        let [n, k] = w.shape();
        if self.rank() == 0 || self.shape()[self.rank() - 1] != k {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: vec![n, k],
                hint: "the left operand's last dimension must be the quantized matrix's row length \
                       (x [.., k] times W [n, k] transposed)",
            });
        }
        let x = if self.dtype() == DType::F32 {
            self.contiguous()?
        } else {
            self.to_dtype(DType::F32)?.contiguous()?
        };
        let m = x.numel() / k;
        let mut shape = self.shape().to_vec();
        *shape.last_mut().expect("rank >= 1") = n;
        let mut out = Tensor::output_of(&[&x, w.blocks()], DType::F32, &shape, Location::caller())?;
        let backend = x.backend()?;
        // A GPU rounds the activations into device memory of the op's own: a temporary of this
        // scope, freed (to the pool) when the product returns.
        let scratch_bytes = backend.quant_scratch_bytes(m, k);
        let mut rounded = scratch(&[&x], scratch_bytes, Location::caller())?;
        backend.quant_matmul(
            w.ty(),
            w.in_strips(),
            x.src(),
            w.blocks().src(),
            (m, k, n),
            out.dst(),
            rounded.as_mut().map(|s| s.dst()),
        )?;
        if self.dtype() == DType::F32 {
            Ok(out)
        } else {
            out.to_dtype(self.dtype())
        }
    }
}
