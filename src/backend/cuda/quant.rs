//! Quantized products on the GPU (`kernels/quant.cu`): the activations rounded to 8 bits per block of
//! 32 into a scratch block (a warp per block), then one warp per weight row multiplying its decoded
//! blocks into up to [`ROWS`] rows at a time.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::backend::cuda::kernels::elementwise_launch;
use crate::backend::cuda::ops::first;
use crate::backend::cuda::{Gpu, cuda_error};
use crate::backend::{Dst, Src};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::quant::QuantType;

/// Bytes of one rounded block of 32 activations: its `f32` scale and 32 levels (`QX_BYTES`).
pub(super) const ROUNDED_BLOCK_BYTES: usize = 36;
/// Warps per block, one weight row each (`QP_WARPS`).
const WARPS: usize = 4;
/// Rows of `x` one launch's block multiplies into each weight row it decodes (`QP_ROWS`).
const ROWS: usize = 8;
/// The largest grid dimension `y`: a launch covers this many chunks of [`ROWS`] rows.
const MAX_GRID_Y: usize = 65_535;

/// The product kernel for the block format `ty`.
fn product_kernel(ty: QuantType) -> Result<&'static str> {
    Ok(match ty {
        QuantType::Q4_0 => "quant_product_q4_0",
        QuantType::Q4_1 => "quant_product_q4_1",
        QuantType::Q5_0 => "quant_product_q5_0",
        QuantType::Q5_1 => "quant_product_q5_1",
        QuantType::Q8_0 => "quant_product_q8_0",
        QuantType::Q2_K => "quant_product_q2_k",
        QuantType::Q3_K => "quant_product_q3_k",
        QuantType::Q4_K => "quant_product_q4_k",
        QuantType::Q5_K => "quant_product_q5_k",
        QuantType::Q6_K => "quant_product_q6_k",
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {
            return Err(Error::InvalidArgument {
                op: "matmul_quantized",
                reason: format!(
                    "ndscope bug: {} is a float type, which the dense products take",
                    ty.name()
                ),
            });
        }
    })
}

impl Gpu {
    /// `out = x Ŵᵀ` (see `Backend::quant_matmul`), with `scratch` at least
    /// `m · k / 32 ·` [`ROUNDED_BLOCK_BYTES`] bytes for the rounded activations.
    pub(super) fn quant_product(
        &self,
        ty: QuantType,
        x: Src,
        w: Src,
        (m, k, n): (usize, usize, usize),
        out: Dst,
        scratch: Dst,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        // A grid's x dimension holds up to 2^31 - 1 blocks of WARPS weight rows.
        if n.div_ceil(WARPS) > i32::MAX as usize {
            return Err(Error::InvalidShape {
                op: "matmul_quantized",
                shape: vec![n, k],
                reason: format!(
                    "a GPU quantized product takes up to {} weight rows",
                    i32::MAX as usize * WARPS
                ),
            });
        }
        let product = self.function(product_kernel(ty)?)?;
        let blocks = m * k / 32;
        if blocks > 0 && scratch.layout.numel() * DType::F32.size() < blocks * ROUNDED_BLOCK_BYTES {
            return Err(Error::InvalidArgument {
                op: "matmul_quantized",
                reason: "ndscope bug: the scratch block is smaller than the rounded activations"
                    .into(),
            });
        }
        let (xa, wa, oa, qa) = (
            first(x.buf.address(), x.layout, DType::F32),
            // The blocks are held as 16-bit words.
            first(w.buf.address(), w.layout, DType::F16),
            first(out.buf.address(), out.layout, DType::F32),
            first(scratch.buf.address(), scratch.layout, DType::F32),
        );
        if blocks > 0 {
            let round = self.function("quant_rows_q8")?;
            let count = blocks as i64;
            let mut b = self.stream.launch_builder(&round);
            b.arg(&count).arg(&xa).arg(&qa);
            // SAFETY: the arguments match `quant_rows_q8` (i64, const float*, unsigned char*): `x` is
            // a contiguous f32 block of m·k = 32·blocks values, and the scratch holds
            // `blocks · ROUNDED_BLOCK_BYTES` bytes (checked above), written by this kernel alone.
            // One thread per value: a multiple of 32, so every warp is whole.
            unsafe { b.launch(elementwise_launch(blocks * 32)) }
                .map_err(|e| cuda_error("rounding a quantized product's activations", e))?;
        }
        let (mm, kk, nn) = (m as i64, k as i64, n as i64);
        let chunks = m.div_ceil(ROWS);
        for first_chunk in (0..chunks).step_by(MAX_GRID_Y) {
            let t0 = (first_chunk * ROWS) as i64;
            let launch = LaunchConfig {
                grid_dim: (
                    n.div_ceil(WARPS) as u32,
                    (chunks - first_chunk).min(MAX_GRID_Y) as u32,
                    1,
                ),
                block_dim: ((32 * WARPS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&product);
            b.arg(&mm)
                .arg(&kk)
                .arg(&nn)
                .arg(&t0)
                .arg(&wa)
                .arg(&qa)
                .arg(&oa);
            // SAFETY: the arguments match `quant_product_<ty>` (i64 ×4, const unsigned char* ×2,
            // float*): `w` holds n rows of k values in whole blocks of `ty` in row order (the op
            // checked its size; this backend never asks for strips), the scratch the m rounded rows
            // written just before on the same stream, and `out` is a fresh contiguous m × n f32
            // block. Each block's rows start at t0 + blockIdx.y · ROWS < m.
            unsafe { b.launch(launch) }.map_err(|e| cuda_error("quantized product kernel", e))?;
        }
        Ok(())
    }
}
