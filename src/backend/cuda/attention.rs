//! Fused attention on the GPU (`kernels/attention.cu`): the launches and the geometry they take.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use crate::backend::cuda::kernels::{float_family, float_kernel};
use crate::backend::cuda::ops::first;
use crate::backend::cuda::{Gpu, cuda_error};
use crate::backend::op::{Attention, Math};
use crate::backend::{AttentionInputs, Dst, Src};
use crate::dtype::{DType, Element, with_float_dtype};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// Warps per block, one query (or key) row each (`ATTN_WARPS`).
const WARPS: usize = 4;
/// The widest head the kernels keep in registers (`ATTN_MAX_WIDTH`).
const MAX_WIDTH: usize = 256;
/// The largest grid dimension `y` (one block row per batch and head).
const MAX_GRID_Y: usize = 65_535;

/// Where each operand's strides sit in [`AttnGeo::strides`] (`A_Q` ... `A_DV`).
#[derive(Clone, Copy)]
enum Slot {
    Q = 0,
    K = 1,
    V = 2,
    Out = 3,
    Dout = 4,
    Dq = 5,
    Dk = 6,
    Dv = 7,
}

/// The kernels' `struct AttnGeo`: `[batch, heads, queries, keys, width, value width]`, the causal
/// flag and offset, the query heads per key head, the sliding window, and the batch, head and row strides of every
/// operand.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnGeo {
    dims: [i64; 6],
    causal: i64,
    offset: i64,
    group: i64,
    /// The sliding window (0: none).
    window: i64,
    strides: [[i64; 3]; 8],
}

// SAFETY: `AttnGeo` is `repr(C)` plain data, 34 eight-byte integers in the field order of the
// kernels' `struct AttnGeo`, so it can be passed by value as a kernel argument.
unsafe impl DeviceRepr for AttnGeo {}

impl AttnGeo {
    fn new(math: &Attention, inputs: &AttentionInputs) -> Result<AttnGeo> {
        let (q, k, v) = (
            inputs.q.layout.shape(),
            inputs.k.layout.shape(),
            inputs.v.layout.shape(),
        );
        if q[3] > MAX_WIDTH || v[3] > MAX_WIDTH || q[0] * q[1] > MAX_GRID_Y {
            return Err(Error::InvalidShape {
                op: "attention",
                shape: q.to_vec(),
                reason: format!(
                    "GPU attention takes head widths up to {MAX_WIDTH} and up to {MAX_GRID_Y} \
                     batches x heads; split the batch or use narrower heads"
                ),
            });
        }
        let mut geo = AttnGeo {
            dims: [q[0], q[1], q[2], k[2], q[3], v[3]].map(|d| d as i64),
            causal: i64::from(math.causal.is_some()),
            offset: math.causal.unwrap_or(0),
            group: math.group as i64,
            window: math.window.map_or(0, |w| w as i64),
            strides: [[0; 3]; 8],
        };
        geo.set(Slot::Q, inputs.q.layout);
        geo.set(Slot::K, inputs.k.layout);
        geo.set(Slot::V, inputs.v.layout);
        Ok(geo)
    }

    fn set(&mut self, slot: Slot, layout: &Layout) {
        let s = layout.strides();
        self.strides[slot as usize] = [s[0] as i64, s[1] as i64, s[2] as i64];
    }

    /// One warp per row of `rows` rows of every batch and head.
    fn launch(&self, rows: i64) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (rows as usize).div_ceil(WARPS) as u32,
                (self.dims[0] * self.dims[1]) as u32,
                1,
            ),
            block_dim: ((32 * WARPS) as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The key lengths' address, or 0 (a null pointer: every key counts).
fn lengths(inputs: &AttentionInputs) -> u64 {
    inputs
        .key_lengths
        .map_or(0, |l| first(l.buf.address(), l.layout, DType::I64))
}

impl Gpu {
    pub(super) fn attention_forward(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Dst,
        lse: Dst,
    ) -> Result<()> {
        let mut geo = AttnGeo::new(math, &inputs)?;
        geo.set(Slot::Out, out.layout);
        if out.layout.numel() == 0 {
            return Ok(());
        }
        let f = self.function(float_kernel(
            "attention",
            float_family!("attention_fwd"),
            dtype,
        )?)?;
        let (o, l) = (
            first(out.buf.address(), out.layout, dtype),
            first(lse.buf.address(), lse.layout, dtype.compute()),
        );
        let (q, k, v, n) = (
            first(inputs.q.buf.address(), inputs.q.layout, dtype),
            first(inputs.k.buf.address(), inputs.k.layout, dtype),
            first(inputs.v.buf.address(), inputs.v.layout, dtype),
            lengths(&inputs),
        );
        with_float_dtype!(dtype, T => {
            let scale = <T as Math>::Compute::from_f64(math.scale);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&geo).arg(&o).arg(&l).arg(&q).arg(&k).arg(&v).arg(&n).arg(&scale);
            // SAFETY: the arguments match `attention_fwd_<dtype>` (AttnGeo, T*, C*, const T* x3,
            // const i64*, C). The geometry's dimensions and strides are those of the operands' and
            // output's layouts, which stay inside their blocks; `lse` is a fresh contiguous
            // [batch, heads, queries] block of the compute type; lengths is null or [batch] i64.
            unsafe { b.launch(geo.launch(geo.dims[2])) }
                .map_err(|e| cuda_error("attention kernel", e))?;
        }, else unreachable!("float_kernel refused integers"));
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_kernels(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        [out, dout, lse]: [Src; 3],
        delta: Dst,
        [dq, dk, dv]: [Dst; 3],
    ) -> Result<()> {
        let mut geo = AttnGeo::new(math, &inputs)?;
        geo.set(Slot::Out, out.layout);
        geo.set(Slot::Dout, dout.layout);
        geo.set(Slot::Dq, dq.layout);
        geo.set(Slot::Dk, dk.layout);
        geo.set(Slot::Dv, dv.layout);
        if geo.dims[0] * geo.dims[1] == 0 {
            return Ok(());
        }
        let c = dtype.compute();
        let dq_kernel = self.function(float_kernel(
            "attention",
            float_family!("attention_bwd_dq"),
            dtype,
        )?)?;
        let dkv_kernel = self.function(float_kernel(
            "attention",
            float_family!("attention_bwd_dkv"),
            dtype,
        )?)?;
        let (q, k, v, n) = (
            first(inputs.q.buf.address(), inputs.q.layout, dtype),
            first(inputs.k.buf.address(), inputs.k.layout, dtype),
            first(inputs.v.buf.address(), inputs.v.layout, dtype),
            lengths(&inputs),
        );
        let (o, g, l, d) = (
            first(out.buf.address(), out.layout, dtype),
            first(dout.buf.address(), dout.layout, dtype),
            first(lse.buf.address(), lse.layout, c),
            first(delta.buf.address(), delta.layout, c),
        );
        let (gq, gk, gv) = (
            first(dq.buf.address(), dq.layout, dtype),
            first(dk.buf.address(), dk.layout, dtype),
            first(dv.buf.address(), dv.layout, dtype),
        );
        with_float_dtype!(dtype, T => {
            let scale = <T as Math>::Compute::from_f64(math.scale);
            if geo.dims[2] > 0 {
                let mut b = self.stream.launch_builder(&dq_kernel);
                b.arg(&geo).arg(&gq).arg(&d).arg(&q).arg(&k).arg(&v).arg(&o).arg(&g).arg(&l)
                    .arg(&n).arg(&scale);
                // SAFETY: the arguments match `attention_bwd_dq_<dtype>` (AttnGeo, T*, C*, const T*
                // x5, const C*, const i64*, C); every layout in the geometry stays inside its block;
                // `delta` and `lse` are contiguous [batch, heads, queries] blocks of the compute
                // type; the gradients are fresh blocks no other operand shares.
                unsafe { b.launch(geo.launch(geo.dims[2])) }
                    .map_err(|e| cuda_error("attention backward kernel", e))?;
            }
            if geo.dims[3] > 0 {
                let mut b = self.stream.launch_builder(&dkv_kernel);
                b.arg(&geo).arg(&gk).arg(&gv).arg(&q).arg(&k).arg(&v).arg(&g).arg(&l).arg(&d)
                    .arg(&n).arg(&scale);
                // SAFETY: the arguments match `attention_bwd_dkv_<dtype>` (AttnGeo, T* x2, const T*
                // x4, const C* x2, const i64*, C), as above; the stream runs it after the dq kernel
                // has stored every D_i in `delta`.
                unsafe { b.launch(geo.launch(geo.dims[3])) }
                    .map_err(|e| cuda_error("attention backward kernel", e))?;
            }
        }, else unreachable!("float_kernel refused integers"));
        Ok(())
    }
}
