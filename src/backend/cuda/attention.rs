//! Fused attention on the GPU (`kernels/attention.cu`): the launches and the geometry they take.
//!
//! Two kernel sets compute the same function. The tiled kernels (f32, bf16 and f16, heads up to 128
//! wide) share each tile of keys (or queries) among the rows of a block through shared memory; the
//! warp-per-row kernels serve `f64` (whose tiles would not fit in shared memory) and wider heads.

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

/// Which of the three attention kernels a launch runs.
#[derive(Clone, Copy)]
enum Pass {
    Forward = 0,
    /// The query side of the backward pass: `dq` and `D_i`.
    Queries = 1,
    /// The key side of the backward pass: `dk` and `dv`.
    Keys = 2,
}

/// The tiled kernels (`ATTENTION_TILED` in `kernels/attention.cu`) by pass, tile width (64, 128)
/// and dtype (f32, bf16, f16). `.ci/nvrtc-check.py` checks that every name here is compiled.
const TILED: [[[&str; 3]; 2]; 3] = [
    [
        [
            "attention_tiled_fwd_w64_f32",
            "attention_tiled_fwd_w64_bf16",
            "attention_tiled_fwd_w64_f16",
        ],
        [
            "attention_tiled_fwd_w128_f32",
            "attention_tiled_fwd_w128_bf16",
            "attention_tiled_fwd_w128_f16",
        ],
    ],
    [
        [
            "attention_tiled_bwd_dq_w64_f32",
            "attention_tiled_bwd_dq_w64_bf16",
            "attention_tiled_bwd_dq_w64_f16",
        ],
        [
            "attention_tiled_bwd_dq_w128_f32",
            "attention_tiled_bwd_dq_w128_bf16",
            "attention_tiled_bwd_dq_w128_f16",
        ],
    ],
    [
        [
            "attention_tiled_bwd_dkv_w64_f32",
            "attention_tiled_bwd_dkv_w64_bf16",
            "attention_tiled_bwd_dkv_w64_f16",
        ],
        [
            "attention_tiled_bwd_dkv_w128_f32",
            "attention_tiled_bwd_dkv_w128_bf16",
            "attention_tiled_bwd_dkv_w128_f16",
        ],
    ],
];

/// The kernel of `pass` for `dtype` and heads up to `widest` wide, and the rows one block takes: a
/// tiled kernel where one exists (float compute, heads up to 128), else the warp-per-row one.
fn kernel(pass: Pass, dtype: DType, widest: usize) -> Result<(&'static str, usize)> {
    let tiled_dtype = match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    };
    if let (Some(d), true) = (tiled_dtype, widest <= 128) {
        let tile_width = if widest <= 64 { 64 } else { 128 };
        // Rows per warp, as the kernels' macro sets them: `256 / W` forward and on the query
        // side, 2 on the key side.
        let per_warp = match pass {
            Pass::Forward | Pass::Queries => 256 / tile_width,
            Pass::Keys => 2,
        };
        let name = TILED[pass as usize][usize::from(tile_width == 128)][d];
        return Ok((name, WARPS * per_warp));
    }
    let family = match pass {
        Pass::Forward => float_family!("attention_fwd"),
        Pass::Queries => float_family!("attention_bwd_dq"),
        Pass::Keys => float_family!("attention_bwd_dkv"),
    };
    Ok((float_kernel("attention", family, dtype)?, WARPS))
}

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

    /// The widest head (queries and keys, or values).
    fn widest(&self) -> usize {
        self.dims[4].max(self.dims[5]) as usize
    }

    /// `rows` rows of every batch and head, `per_block` rows to a block of `WARPS` warps.
    fn launch(&self, rows: i64, per_block: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (rows as usize).div_ceil(per_block) as u32,
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
        let (name, per_block) = kernel(Pass::Forward, dtype, geo.widest())?;
        let f = self.function(name)?;
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
            // SAFETY: the arguments match `attention_fwd_<dtype>` and `attention_tiled_fwd_*`
            // (AttnGeo, T*, C*, const T* x3, const i64*, C; C is float for the tiled kernels'
            // dtypes). The geometry's dimensions and strides are those of the operands' and
            // output's layouts, which stay inside their blocks; `lse` is a fresh contiguous
            // [batch, heads, queries] block of the compute type; lengths is null or [batch] i64.
            // The kernel takes `per_block` rows per block, as `kernel` says.
            unsafe { b.launch(geo.launch(geo.dims[2], per_block)) }
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
        let (dq_name, dq_rows) = kernel(Pass::Queries, dtype, geo.widest())?;
        let (dkv_name, dkv_rows) = kernel(Pass::Keys, dtype, geo.widest())?;
        let (dq_kernel, dkv_kernel) = (self.function(dq_name)?, self.function(dkv_name)?);
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
                // SAFETY: the arguments match `attention_bwd_dq_<dtype>` and
                // `attention_tiled_bwd_dq_*` (AttnGeo, T*, C*, const T* x5, const C*, const i64*,
                // C); every layout in the geometry stays inside its block; `delta` and `lse` are
                // contiguous [batch, heads, queries] blocks of the compute type; the gradients are
                // fresh blocks no other operand shares; `dq_rows` rows per block, as `kernel` says.
                unsafe { b.launch(geo.launch(geo.dims[2], dq_rows)) }
                    .map_err(|e| cuda_error("attention backward kernel", e))?;
            }
            if geo.dims[3] > 0 {
                let mut b = self.stream.launch_builder(&dkv_kernel);
                b.arg(&geo).arg(&gk).arg(&gv).arg(&q).arg(&k).arg(&v).arg(&g).arg(&l).arg(&d)
                    .arg(&n).arg(&scale);
                // SAFETY: the arguments match `attention_bwd_dkv_<dtype>` and
                // `attention_tiled_bwd_dkv_*` (AttnGeo, T* x2, const T* x4, const C* x2, const i64*,
                // C), as above; the stream runs it after the dq kernel has stored every D_i in
                // `delta`; `dkv_rows` rows per block.
                unsafe { b.launch(geo.launch(geo.dims[3], dkv_rows)) }
                    .map_err(|e| cuda_error("attention backward kernel", e))?;
            }
        }, else unreachable!("float_kernel refused integers"));
        Ok(())
    }
}
