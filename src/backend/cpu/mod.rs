//! The host backend: kernels over host memory, written as plain slice loops that the compiler
//! vectorises, with rayon for outputs large enough to pay for threads.
//!
//! Each kernel walks its operands row by row (`RowWalk`) and picks a loop by the row strides
//! (contiguous, broadcast scalar, or strided), so the common cases are plain slice loops.

mod attention;
mod attention_tiles;
mod attention_tiles_backward;
mod bf16_blocks;
mod bf16_gemm;
mod bf16_tiles;
mod elementwise;
mod few_rows;
mod few_rows_in_out;
mod fused;
mod index;
pub(crate) mod logits;
mod matmul;
mod narrow;
mod paged;
#[cfg(target_arch = "x86_64")]
mod quant_gemm;
pub(crate) mod quant_product;
#[cfg(target_arch = "x86_64")]
mod quant_strips;
#[cfg(target_arch = "x86_64")]
mod quant_strips_avx2;
#[cfg(target_arch = "x86_64")]
mod quant_tiles;
#[cfg(target_arch = "x86_64")]
mod quant_vnni;
mod reduce;
mod rotary;
mod rows;
#[cfg(target_arch = "x86_64")]
mod tile_product;
mod transposed_weight;
mod warm;
mod widen;
mod window;

use rayon::prelude::*;
use smallvec::SmallVec;

use crate::backend::op::{
    Attention, Binary, FusedUpdate, Math, PagedAttention, Reduce, Unary, Window2d,
};
use crate::backend::{AttentionInputs, Backend, Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::DType;
use crate::dtype::{Element, with_dtype};
use crate::error::Result;
use crate::layout::{Layout, RowWalk};
use crate::rng::Distribution;

/// Outputs with fewer elements than this are computed on the calling thread: below it, waking rayon's
/// workers costs more than the work (measured on the 2-core CI machine; see BENCHMARKS.md).
pub(crate) const PARALLEL_MIN: usize = 1 << 16;
/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// Whether this CPU has AVX-512 F, all that the kernels asking it are compiled for (the paged
/// attention's 16-bit rows, the transposed weights' chunks).
fn avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has AVX2 and F16C, what the 8-lane kernels asking it are compiled for (the
/// paged attention's 16-bit rows on CPUs without AVX-512).
fn avx2_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// How far ahead of their walk the few-row products (`few_rows` and `few_rows_in_out` in `f32`,
/// `bf16_gemm::few_tokens`) ask for the weight, in bytes, when they multiply two or more tokens.
/// Eight tokens' arithmetic takes about as long as the weight's reads, and the two overlap only if
/// the lines are requested that far ahead, into L2 (`prefetcht1`). On Zen 4 (two threads, eight
/// `[8192, 2048]` `f32` weights from memory) eight tokens took 28-29 ms with no prefetch, 28-34 ms
/// with the 1 KiB `prefetcht0` this replaced, 23-25 ms with this (BENCHMARKS.md, issue 33, the
/// engine's eight requests); the AVX2 kernel, on the same CPU, streamed 12.0 GiB/s without and
/// 17.9 with it, the `[in, out]` kernels 23.0 / 26-28 (AVX-512) and 20.7 / 23.3 (AVX2)
/// (BENCHMARKS.md, issue 35). One token's walk is left to the hardware prefetcher.
const FEW_ROWS_AHEAD_BYTES: usize = 64 << 10;

/// The prefetch distance, in elements, of `tokens` walking groups of `group` weight rows `stride`
/// elements apart, `element_bytes` each: 0 (no prefetch) for one token, else
/// [`FEW_ROWS_AHEAD_BYTES`] rounded up to whole groups, so that the line asked for lies at the same
/// position of a row whole groups further on — the rows walked after these, in memory order.
fn few_rows_ahead(tokens: usize, group: usize, stride: usize, element_bytes: usize) -> usize {
    if tokens < 2 {
        return 0;
    }
    let group_len = group * stride;
    group_len * FEW_ROWS_AHEAD_BYTES.div_ceil(group_len * element_bytes)
}

/// `convert(from, to)` a chunk of the two runs at a time: in parallel when long, on the calling
/// thread when short (the casts between `f32` and the 16-bit types, [`widen`], [`narrow`]).
fn convert_chunks<S: Sync, D: Send>(from: &[S], to: &mut [D], convert: fn(&[S], &mut [D])) {
    if to.len() < PARALLEL_MIN {
        convert(from, to);
        return;
    }
    to.par_chunks_mut(CHUNK)
        .zip(from.par_chunks(CHUNK))
        .for_each(|(t, f)| convert(f, t));
}

/// CPUID leaf 0's vendor string (EBX, EDX, ECX): `GenuineIntel`, `AuthenticAMD`, ... The kernels
/// whose best schedule differs between vendors' cores ask it (`bf16_gemm`, `quant_strips`).
#[cfg(target_arch = "x86_64")]
fn cpu_vendor() -> [u8; 12] {
    let leaf = std::arch::x86_64::__cpuid(0);
    let mut name = [0u8; 12];
    for (bytes, register) in name.chunks_exact_mut(4).zip([leaf.ebx, leaf.edx, leaf.ecx]) {
        bytes.copy_from_slice(&register.to_le_bytes());
    }
    name
}

/// Asks for the cache lines of the `len` bytes from `start`, for a kernel that will read them soon
/// (the kernels that stream weights or caches faster than the hardware prefetcher follows). A
/// prefetch reads nothing the program sees and never faults, so `start..start + len` may reach past
/// any allocation: form such addresses with `wrapping_add`.
#[inline(always)]
fn prefetch_lines(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(64) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: SSE, the prefetch's only feature, is part of every x86-64 CPU; a prefetch of
        // any address is defined.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// Fills the contiguous `out` from a walk over the same elements: `f(out_piece, starts)` computes one
/// row piece, reading operand `k` from `starts[k]` with the walk's row strides. Large outputs are split
/// across rayon's threads.
fn fill_segments<T: Send, const N: usize>(
    walk: &RowWalk<N>,
    out: &mut [T],
    f: impl Fn(&mut [T], [usize; N]) + Sync,
) {
    if out.len() < PARALLEL_MIN {
        walk.for_segments(0, out.len(), |pos, starts, len| {
            f(&mut out[pos..pos + len], starts)
        });
        return;
    }
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let base = i * CHUNK;
            walk.for_segments(base, chunk.len(), |pos, starts, len| {
                f(&mut chunk[pos - base..pos - base + len], starts)
            });
        });
}

/// The host backend.
#[derive(Debug)]
pub(crate) struct Cpu;

impl Backend for Cpu {
    fn unary(&self, dtype: DType, op: Unary, params: [f64; 2], x: Src, out: Dst) -> Result<()> {
        elementwise::unary(dtype, op, params, x, out);
        Ok(())
    }

    fn unary_in_place(&self, dtype: DType, op: Unary, params: [f64; 2], x: Dst) -> Result<()> {
        elementwise::unary_in_place(dtype, op, params, x);
        Ok(())
    }

    fn binary(
        &self,
        dtype: DType,
        op: Binary,
        params: [f64; 2],
        a: Src,
        b: Src,
        out: Dst,
    ) -> Result<()> {
        elementwise::binary(dtype, op, params, a, b, out);
        Ok(())
    }

    fn binary_in_place(
        &self,
        dtype: DType,
        op: Binary,
        params: [f64; 2],
        x: Dst,
        b: Src,
    ) -> Result<()> {
        elementwise::binary_in_place(dtype, op, params, x, b);
        Ok(())
    }

    fn where_cond(
        &self,
        dtype: DType,
        cond: Src,
        on_true: Src,
        on_false: Src,
        out: Dst,
    ) -> Result<()> {
        elementwise::where_cond(dtype, cond, on_true, on_false, out);
        Ok(())
    }

    fn copy(&self, from: DType, to: DType, x: Src, out: Dst) -> Result<()> {
        elementwise::copy(from, to, x, out);
        Ok(())
    }

    fn reads_any_layout(&self) -> bool {
        true
    }

    fn reduce(&self, dtype: DType, op: Reduce, x: Src, axes: &[usize], out: Dst) -> Result<()> {
        reduce::reduce(dtype, op, x, axes, out);
        Ok(())
    }

    fn argmax(&self, dtype: DType, x: Src, axis: usize, out: Dst) -> Result<()> {
        reduce::argmax(dtype, x, axis, out);
        Ok(())
    }

    fn attention(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Dst,
        lse: Dst,
    ) -> Result<()> {
        attention::forward(dtype, math, inputs, out, lse);
        Ok(())
    }

    fn attention_backward(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Src,
        dout: Src,
        lse: Src,
        _scratch: Dst,
        grads: [Dst; 3],
    ) -> Result<()> {
        // Each task keeps its head's D_i on its own; the shared scratch is not needed.
        attention::backward(dtype, math, inputs, [out, dout, lse], grads);
        Ok(())
    }

    fn paged_attention(
        &self,
        dtype: DType,
        math: &PagedAttention,
        geometry: PageGeometry,
        q: Src,
        seqs: PagedSeqs,
        out: Dst,
    ) -> Result<()> {
        paged::attention(dtype, math, geometry, q, seqs, out);
        Ok(())
    }

    fn write_pages(
        &self,
        dtype: DType,
        geometry: PageGeometry,
        layer: usize,
        kv: Src,
        rows: PageRows,
    ) -> Result<()> {
        paged::write(dtype, geometry, layer, kv, rows);
        Ok(())
    }

    fn softmax(&self, dtype: DType, x: Src, log: bool, out: Dst) -> Result<()> {
        reduce::softmax(dtype, x, log, out);
        Ok(())
    }

    fn rms_norm(
        &self,
        dtype: DType,
        x: Src,
        weight: Option<Src>,
        eps: f64,
        out: Dst,
    ) -> Result<()> {
        reduce::rms_norm(dtype, x, weight, eps, out);
        Ok(())
    }

    fn rotary(
        &self,
        dtype: DType,
        x: Src,
        cos: Src,
        sin: Src,
        positions: Src,
        inverse: bool,
        out: Dst,
    ) -> Result<()> {
        rotary::rotary(dtype, x, [cos, sin, positions], inverse, out);
        Ok(())
    }

    fn logsumexp(&self, dtype: DType, x: Src, out: Dst) -> Result<()> {
        reduce::logsumexp(dtype, x, out);
        Ok(())
    }

    fn cross_entropy_grad(
        &self,
        dtype: DType,
        logits: Src,
        lse: Src,
        labels: Src,
        weight: Src,
        smoothing: f64,
        out: Dst,
    ) -> Result<()> {
        reduce::cross_entropy_grad(dtype, [logits, lse, labels, weight], smoothing, out);
        Ok(())
    }

    fn gather(&self, dtype: DType, src: Src, axis: usize, index: Src, out: Dst) -> Result<()> {
        index::gather(dtype, src, axis, index, out);
        Ok(())
    }

    fn scatter_add(
        &self,
        _op: &'static str,
        dtype: DType,
        target: Dst,
        axis: usize,
        index: Src,
        src: Src,
    ) -> Result<()> {
        index::scatter_add(dtype, target, axis, index, src);
        Ok(())
    }

    fn cumsum(&self, dtype: DType, x: Src, reverse: bool, out: Dst) -> Result<()> {
        let len = x.layout.shape().last().copied().unwrap_or(1);
        if len == 0 {
            return Ok(());
        }
        with_dtype!(dtype, T => {
            let x = x.contiguous_host::<T>();
            out.contiguous_host::<T>()
                .par_chunks_mut(len)
                .zip(x.par_chunks(len))
                .for_each(|(out, row)| {
                    // Running sums in the compute type, each rounded once when stored.
                    let mut acc = <T as Math>::Compute::zero();
                    let mut step = |(o, &v): (&mut T, &T)| {
                        acc = acc.add(v.load());
                        *o = T::store(acc);
                    };
                    if reverse {
                        out.iter_mut().zip(row).rev().for_each(&mut step);
                    } else {
                        out.iter_mut().zip(row).for_each(&mut step);
                    }
                });
        });
        Ok(())
    }

    fn random(
        &self,
        dtype: DType,
        dist: Distribution,
        seed: u64,
        offset: u64,
        out: Dst,
    ) -> Result<()> {
        with_dtype!(dtype, T => {
            out.contiguous_host::<T>()
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let first = offset.wrapping_add((c * CHUNK) as u64);
                    for (i, v) in chunk.iter_mut().enumerate() {
                        *v = T::from_f64(dist.sample(seed, first.wrapping_add(i as u64)));
                    }
                });
        });
        Ok(())
    }

    fn unfold2d(&self, dtype: DType, window: &Window2d, pad: f64, x: Src, out: Dst) -> Result<()> {
        window::unfold2d(dtype, window, pad, x, out);
        Ok(())
    }

    fn fold2d(&self, dtype: DType, window: &Window2d, cols: Src, out: Dst) -> Result<()> {
        window::fold2d(dtype, window, cols, out);
        Ok(())
    }

    fn matmul_reads(&self, _layout: &Layout, _batch: &[usize]) -> bool {
        true // gemm reads any strides, and batch strides broadcast with 0
    }

    fn matmul_scratch_bytes(
        &self,
        dtype: DType,
        _a: &Layout,
        b: &Layout,
        mkn: (usize, usize, usize),
    ) -> usize {
        matmul::scratch_bytes(dtype, b, mkn)
    }

    fn matmul(
        &self,
        dtype: DType,
        a: Src,
        b: Src,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: Dst,
        _tf32: bool, // the host has no TF32 units: products are full f32
        scratch: Option<Dst>,
    ) -> Result<()> {
        matmul::matmul(dtype, a, b, batch, mkn, out, scratch);
        Ok(())
    }

    fn matmul_rounds(&self, dtype: DType) -> bool {
        matmul::rounds(dtype).is_some()
    }

    fn matmul_rounding(
        &self,
        dtype: DType,
        a: Src,
        b: Src,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: Dst,
        scratch: Option<Dst>,
    ) -> Result<()> {
        let Some(dot) = matmul::rounds(dtype) else {
            return Err(crate::Error::UnsupportedDType {
                op: "matmul_rounding",
                dtype,
                expected: "bf16 on a CPU with AVX-512 BF16",
            });
        };
        matmul::bf16_product::<f32>(dot, a, b, batch, mkn, out, scratch);
        Ok(())
    }

    fn quant_strips(&self, ty: crate::quant::QuantType) -> bool {
        quant_product::Kernel::detect().reads_strips(ty)
    }

    fn quant_matmul(
        &self,
        ty: crate::quant::QuantType,
        in_strips: bool,
        x: Src,
        w: Src,
        mkn: (usize, usize, usize),
        out: Dst,
        _scratch: Option<Dst>,
    ) -> Result<()> {
        // The blocks are held as 16-bit words: their view's bytes.
        let (at, words) = (w.layout.offset(), w.layout.numel());
        quant_product::product(
            quant_product::Kernel::detect(),
            ty,
            in_strips,
            x.contiguous_host::<f32>(),
            &w.buf.bytes()[2 * at..2 * (at + words)],
            mkn,
            out.contiguous_host::<f32>(),
        );
        Ok(())
    }

    fn fused_update(
        &self,
        dtype: DType,
        update: FusedUpdate,
        targets: SmallVec<[Dst; 3]>,
        grad: Src,
        powers: Option<Src>,
    ) -> Result<()> {
        fused::update(dtype, update, targets, grad, powers);
        Ok(())
    }

    fn upload(&self, dtype: DType, data: &[u8], out: Dst) -> Result<()> {
        elementwise::upload(dtype, data, out);
        Ok(())
    }

    fn download(&self, dtype: DType, x: Src, out: &mut [u8]) -> Result<()> {
        elementwise::download(dtype, x, out);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
