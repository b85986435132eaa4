//! The GPU kernels behind [`Backend`]: each method queues one kernel (or a cuBLAS call) on the GPU's
//! stream, over the blocks and layouts the op gave it. The op checked shapes, dtypes and indices and
//! allocated the output before calling here.
//!
//! Every launch passes device addresses of blocks that the op's tensors keep alive until the call
//! returns; the stream orders the kernel before any later reuse of those bytes, so a kernel never
//! reads memory that was handed to another tensor.

use cudarc::driver::{DeviceRepr, PushKernelArg};
use smallvec::SmallVec;

use crate::backend::cuda::kernels::{
    Geo, cast_kernel, elementwise_launch, family, float_family, float_kernel, kernel, rows_launch,
};
use crate::backend::cuda::{Gpu, blas, cuda_error, transfer};
use crate::backend::op::{
    Attention, Binary, FusedUpdate, Math, PagedAttention, Reduce, Unary, Window2d,
};
use crate::backend::{AttentionInputs, Backend, Dst, PageGeometry, PageRows, PagedSeqs, Src};
use crate::dtype::{DType, Element, with_dtype, with_float_dtype};
use crate::error::Result;
use crate::layout::Layout;
use crate::rng::Distribution;

/// A [`Window2d`] as the kernels take it (`struct Window` in `kernels/window.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct WindowArg([i64; 13]);

// SAFETY: `WindowArg` is `repr(C)` plain data: thirteen 8-byte integers, the layout of the kernels'
// `struct Window`, so it can be passed by value as a kernel argument.
unsafe impl DeviceRepr for WindowArg {}

impl WindowArg {
    fn of(w: &Window2d) -> WindowArg {
        let v = [
            w.planes,
            w.input[0],
            w.input[1],
            w.kernel[0],
            w.kernel[1],
            w.stride[0],
            w.stride[1],
            w.padding[0],
            w.padding[1],
            w.dilation[0],
            w.dilation[1],
            w.output[0],
            w.output[1],
        ];
        WindowArg(v.map(|x| x as i64))
    }
}

/// Partial results the GPU's scratch block holds for a split reduction (8 bytes each: 32 KiB).
pub(super) const REDUCE_PARTIALS: usize = 4096;

/// Elements each block of a split reduction folds, about: enough to hide the launch, small enough
/// that a whole-tensor sum of a few million elements spreads over every multiprocessor.
const ELEMENTS_PER_PART: usize = 8192;

/// Into how many parts the `reduce` kernels split each of `rows` rows of `len` elements: 1 (one
/// block per row) when there are enough rows to fill the GPU or the rows are short, else as many
/// parts of about [`ELEMENTS_PER_PART`] as the partials block holds.
fn reduce_parts(rows: usize, len: usize) -> usize {
    if rows >= 128 {
        return 1;
    }
    (len / ELEMENTS_PER_PART).min(REDUCE_PARTIALS / rows).max(1)
}

/// The device address of the first element an operand's layout names (for kernels that read packed
/// rows rather than a geometry).
pub(super) fn first(address: u64, layout: &Layout, dtype: DType) -> u64 {
    address + (layout.offset() * dtype.size()) as u64
}

impl Gpu {
    /// `out[go] = op(a[ga])` over `n` elements of `dtype` (`a` may be `out`, for in-place maps; `None`
    /// reads nothing, for fills).
    pub(crate) fn launch_unary(
        &self,
        dtype: DType,
        n: usize,
        (out, lo): (u64, &Layout),
        a: Option<(u64, &Layout)>,
        op: Unary,
        params: [f64; 2],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("unary"), dtype))?;
        let go = Geo::of("unary", lo)?;
        let (a, ga) = match a {
            Some((a, la)) => (a, Geo::of("unary", la)?),
            None => (out, go),
        };
        let (code, count) = (op.code(), n as i64);
        with_dtype!(dtype, T => {
            let [p0, p1] = params.map(<T as Math>::Compute::from_f64);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&code).arg(&count).arg(&out).arg(&go).arg(&a).arg(&ga).arg(&p0).arg(&p1);
            // SAFETY: the arguments match `unary_<dtype>` in kernels/elementwise.cu (int, i64, T*, Geo,
            // const T*, Geo, C, C with C the compute type); `out` and `a` are block addresses holding
            // `dtype` whose geometries stay inside their blocks for the `n` elements.
            unsafe { b.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("unary kernel", e))?;
        });
        Ok(())
    }

    /// `out[go] = op(a[ga], b[gb], p0, p1)` over `n` elements of `dtype`.
    fn launch_binary(
        &self,
        dtype: DType,
        n: usize,
        [out, a, b]: [(u64, Geo); 3],
        op: Binary,
        params: [f64; 2],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("binary"), dtype))?;
        let (code, count) = (op.code(), n as i64);
        with_dtype!(dtype, T => {
            let [p0, p1] = params.map(<T as Math>::Compute::from_f64);
            let mut l = self.stream.launch_builder(&f);
            l.arg(&code).arg(&count).arg(&out.0).arg(&out.1).arg(&a.0).arg(&a.1).arg(&b.0).arg(&b.1);
            l.arg(&p0).arg(&p1);
            // SAFETY: the arguments match `binary_<dtype>` (int, i64, T*, Geo, const T*, Geo, const T*,
            // Geo, C, C with C the compute type); the addresses are blocks holding `dtype`, and each geometry describes `n`
            // elements inside its block.
            unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("binary kernel", e))?;
        });
        Ok(())
    }
}

impl Backend for Gpu {
    fn unary(&self, dtype: DType, op: Unary, params: [f64; 2], x: Src, out: Dst) -> Result<()> {
        let n = out.layout.numel();
        let a = Some((x.buf.address(), x.layout));
        self.launch_unary(dtype, n, (out.buf.address(), out.layout), a, op, params)
    }

    fn unary_in_place(&self, dtype: DType, op: Unary, params: [f64; 2], x: Dst) -> Result<()> {
        let at = (x.buf.address(), x.layout);
        self.launch_unary(dtype, x.layout.numel(), at, Some(at), op, params)
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
        let operands = [
            (out.buf.address(), Geo::of("binary", out.layout)?),
            (a.buf.address(), Geo::of("binary", a.layout)?),
            (b.buf.address(), Geo::of("binary", b.layout)?),
        ];
        self.launch_binary(dtype, out.layout.numel(), operands, op, params)
    }

    fn binary_in_place(
        &self,
        dtype: DType,
        op: Binary,
        params: [f64; 2],
        x: Dst,
        b: Src,
    ) -> Result<()> {
        let own = (x.buf.address(), Geo::of("binary", x.layout)?);
        let operands = [own, own, (b.buf.address(), Geo::of("binary", b.layout)?)];
        self.launch_binary(dtype, x.layout.numel(), operands, op, params)
    }

    fn where_cond(
        &self,
        dtype: DType,
        cond: Src,
        on_true: Src,
        on_false: Src,
        out: Dst,
    ) -> Result<()> {
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let func = self.function(kernel(family!("where"), dtype))?;
        let (count, o) = (n as i64, out.buf.address());
        let (pc, pt, pf) = (
            cond.buf.address(),
            on_true.buf.address(),
            on_false.buf.address(),
        );
        let (gc, gt, gf) = (
            Geo::of("where_cond", cond.layout)?,
            Geo::of("where_cond", on_true.layout)?,
            Geo::of("where_cond", on_false.layout)?,
        );
        let mut l = self.stream.launch_builder(&func);
        l.arg(&count)
            .arg(&o)
            .arg(&pc)
            .arg(&gc)
            .arg(&pt)
            .arg(&gt)
            .arg(&pf)
            .arg(&gf);
        // SAFETY: the arguments match `where_<dtype>` (i64, T*, then three (const T*, Geo) pairs); the
        // output is a fresh contiguous block of `n` elements, the operands' geometries stay inside
        // their blocks, and all three hold the output's dtype.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("where kernel", e))?;
        Ok(())
    }

    fn copy(&self, from: DType, to: DType, x: Src, out: Dst) -> Result<()> {
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(cast_kernel(from, to))?;
        let (count, a, dst) = (n as i64, x.buf.address(), out.buf.address());
        let (go, ga) = (Geo::of("copy", out.layout)?, Geo::of("copy", x.layout)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&count).arg(&dst).arg(&go).arg(&a).arg(&ga);
        // SAFETY: the arguments match `cast_<src>_<dst>` (i64, D*, Geo, const S*, Geo); `dst` is a
        // block holding `to` laid out by `go`, `a` a block holding `from` laid out by `ga`, and both
        // layouts cover the same `n` elements.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("copy kernel", e))?;
        Ok(())
    }

    fn reads_any_layout(&self) -> bool {
        false // the row kernels read contiguous rows with the reduced axes last
    }

    fn reduce(&self, dtype: DType, op: Reduce, x: Src, axes: &[usize], out: Dst) -> Result<()> {
        let rows = out.layout.numel();
        if rows == 0 {
            return Ok(());
        }
        let len: usize = axes.iter().map(|&a| x.layout.shape()[a]).product();
        let (code, r, n) = (op.code(), rows as i64, len as i64);
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        let parts = reduce_parts(rows, len);
        if parts > 1 {
            let p = parts as i64;
            let f = self.function(kernel(family!("reduce_part"), dtype))?;
            let mut l = self.stream.launch_builder(&f);
            l.arg(&code)
                .arg(&r)
                .arg(&n)
                .arg(&p)
                .arg(&self.partials)
                .arg(&i);
            // SAFETY: the arguments match `reduce_part_<dtype>` (int, i64, i64, i64, C*, const T*);
            // the input is contiguous, `rows * len` elements from its first; `rows * parts` partial
            // values of at most 8 bytes fit the GPU's partials block (`reduce_parts`), which only
            // this stream uses, one reduction after another.
            unsafe { l.launch(rows_launch(rows * parts)) }
                .map_err(|e| cuda_error("reduce kernel", e))?;
            let f = self.function(kernel(family!("reduce_join"), dtype))?;
            let mut l = self.stream.launch_builder(&f);
            l.arg(&code)
                .arg(&r)
                .arg(&n)
                .arg(&p)
                .arg(&o)
                .arg(&self.partials);
            // SAFETY: the arguments match `reduce_join_<dtype>` (int, i64, i64, i64, T*, const C*);
            // the partials were all written by the launch before on the same stream, and `out` is a
            // fresh block of `rows`.
            unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("reduce kernel", e))?;
            return Ok(());
        }
        let f = self.function(kernel(family!("reduce"), dtype))?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&code).arg(&r).arg(&n).arg(&o).arg(&i);
        // SAFETY: the arguments match `reduce_<dtype>` (int, i64, i64, T*, const T*); the input is
        // contiguous with the reduced axes last (`reads_any_layout` is false), `rows * len` elements
        // from its first, and `out` a fresh block of `rows`.
        unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("reduce kernel", e))?;
        Ok(())
    }

    fn argmax(&self, dtype: DType, x: Src, axis: usize, out: Dst) -> Result<()> {
        let rows = out.layout.numel();
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("argmax"), dtype))?;
        let (r, n) = (rows as i64, x.layout.shape()[axis] as i64);
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        let mut l = self.stream.launch_builder(&f);
        l.arg(&r).arg(&n).arg(&o).arg(&i);
        // SAFETY: the arguments match `argmax_<dtype>` (i64, i64, i64*, const T*); the input is
        // contiguous with `axis` last, `rows * len` elements, and `out` a fresh i64 block of `rows`.
        unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("argmax kernel", e))?;
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
        self.attention_forward(dtype, math, inputs, out, lse)
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
        self.paged_attention_kernel(dtype, math, geometry, q, seqs, out)
    }

    fn write_pages(
        &self,
        dtype: DType,
        geometry: PageGeometry,
        layer: usize,
        kv: Src,
        rows: PageRows,
    ) -> Result<()> {
        self.write_pages_kernel(dtype, geometry, layer, kv, rows)
    }

    fn attention_backward(
        &self,
        dtype: DType,
        math: &Attention,
        inputs: AttentionInputs,
        out: Src,
        dout: Src,
        lse: Src,
        scratch: Dst,
        grads: [Dst; 3],
    ) -> Result<()> {
        self.attention_backward_kernels(dtype, math, inputs, [out, dout, lse], scratch, grads)
    }

    fn softmax(&self, dtype: DType, x: Src, log: bool, out: Dst) -> Result<()> {
        let len = x.layout.shape().last().copied().unwrap_or(1);
        let total = out.layout.numel();
        if total == 0 || len == 0 {
            return Ok(());
        }
        let rows = total / len;
        let f = self.function(float_kernel("softmax", float_family!("softmax"), dtype)?)?;
        let (r, n, flag) = (rows as i64, len as i64, i32::from(log));
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        let mut l = self.stream.launch_builder(&f);
        l.arg(&r).arg(&n).arg(&o).arg(&i).arg(&flag);
        // SAFETY: the arguments match `softmax_<dtype>` (i64, i64, T*, const T*, int) for a float
        // dtype (the op refused integers); both are contiguous with `rows * len` elements.
        unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("softmax kernel", e))?;
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
        let len = x.layout.shape().last().copied().unwrap_or(1);
        let total = out.layout.numel();
        if total == 0 || len == 0 {
            return Ok(());
        }
        let rows = total / len;
        let f = self.function(float_kernel("rms_norm", float_family!("rms_norm"), dtype)?)?;
        let (r, n) = (rows as i64, len as i64);
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        // Null when there is no weight: the kernel leaves the normalised value unscaled.
        let w = weight.map_or(0, |w| first(w.buf.address(), w.layout, dtype));
        let mut l = self.stream.launch_builder(&f);
        l.arg(&r).arg(&n).arg(&o).arg(&i).arg(&w);
        let (eps64, eps32) = (eps, eps as f32);
        if dtype == DType::F64 {
            l.arg(&eps64);
        } else {
            l.arg(&eps32);
        }
        // SAFETY: the arguments match `rms_norm_<dtype>` (i64, i64, T*, const T*, const T*, C) for
        // a float dtype (the op refused integers), C being double for f64 and float otherwise; `x`
        // and `out` are contiguous with `rows * len` elements, the weight (or null) with `len`.
        unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("rms_norm kernel", e))?;
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
        let shape = x.layout.shape();
        let (tokens, heads, half) = (shape[0], shape[1], shape[2] / 2);
        let planes = tokens * heads * half;
        if planes == 0 {
            return Ok(());
        }
        let f = self.function(float_kernel("rotary", float_family!("rotary"), dtype)?)?;
        let (t, h, n, p) = (
            tokens as i64,
            heads as i64,
            half as i64,
            cos.layout.shape()[0] as i64,
        );
        let table = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        let (c, s) = (
            first(cos.buf.address(), cos.layout, table),
            first(sin.buf.address(), sin.layout, table),
        );
        let at = first(positions.buf.address(), positions.layout, DType::I64);
        let flag = i32::from(inverse);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&t).arg(&h).arg(&n).arg(&p).arg(&o).arg(&i);
        l.arg(&c).arg(&s).arg(&at).arg(&flag);
        // SAFETY: the arguments match `rotary_<dtype>` (i64 x4, T*, const T*, const C* x2, const
        // i64*, int) for a float dtype; x and out are contiguous `[tokens, heads, 2 * half]`, the
        // tables contiguous `[p, half]` in C (checked by the op), `positions` `tokens` i64 values,
        // and a position out of range is not read through.
        unsafe { l.launch(elementwise_launch(planes)) }
            .map_err(|e| cuda_error("rotary kernel", e))?;
        Ok(())
    }

    fn logsumexp(&self, dtype: DType, x: Src, out: Dst) -> Result<()> {
        let rows = out.layout.numel();
        if rows == 0 {
            return Ok(());
        }
        let len = x.layout.shape().last().copied().unwrap_or(1);
        let f = self.function(float_kernel(
            "logsumexp",
            float_family!("logsumexp"),
            dtype,
        )?)?;
        let (r, n) = (rows as i64, len as i64);
        let (o, i) = (out.buf.address(), first(x.buf.address(), x.layout, dtype));
        let mut l = self.stream.launch_builder(&f);
        l.arg(&r).arg(&n).arg(&o).arg(&i);
        // SAFETY: the arguments match `logsumexp_<dtype>` (i64, i64, C*, const T*) for a float dtype
        // (the op refused integers); the input is contiguous `[rows, len]`, the output a fresh
        // contiguous block of `rows` elements of the compute type.
        unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("logsumexp kernel", e))?;
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
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let shape = logits.layout.shape();
        let (rows, classes) = (shape[0] as i64, shape[1] as i64);
        let f = self.function(float_kernel(
            "cross_entropy",
            float_family!("xent_grad"),
            dtype,
        )?)?;
        let compute = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let (o, x, ls, lb, w) = (
            out.buf.address(),
            first(logits.buf.address(), logits.layout, dtype),
            first(lse.buf.address(), lse.layout, compute),
            first(labels.buf.address(), labels.layout, DType::I64),
            first(weight.buf.address(), weight.layout, compute),
        );
        with_float_dtype!(dtype, T => {
            type C = <T as Math>::Compute;
            let (on, off) = (C::from_f64(1.0 - smoothing), C::from_f64(smoothing / classes as f64));
            let mut l = self.stream.launch_builder(&f);
            l.arg(&rows).arg(&classes).arg(&o).arg(&x).arg(&ls).arg(&lb).arg(&w).arg(&on).arg(&off);
            // SAFETY: the arguments match `xent_grad_<dtype>` (i64, i64, T*, const T*, const C*,
            // const i64*, const C*, C, C) for a float dtype; `logits` and `out` are contiguous
            // `[rows, classes]`, `lse` and `weight` contiguous `[rows]` of the compute type, `labels`
            // contiguous i64 `[rows]` with values in `0..classes` (checked by the op).
            unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("cross-entropy kernel", e))?;
        }, else unreachable!("float_kernel refused integers"));
        Ok(())
    }

    fn gather(&self, dtype: DType, src: Src, axis: usize, index: Src, out: Dst) -> Result<()> {
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("gather"), dtype))?;
        let (count, axis) = (n as i64, axis as i32);
        let (o, s, i) = (out.buf.address(), src.buf.address(), index.buf.address());
        let (gs, gi) = (
            Geo::of("gather", src.layout)?,
            Geo::of("gather", index.layout)?,
        );
        let mut l = self.stream.launch_builder(&f);
        l.arg(&count)
            .arg(&o)
            .arg(&s)
            .arg(&gs)
            .arg(&i)
            .arg(&gi)
            .arg(&axis);
        // SAFETY: the arguments match `gather_<dtype>` (i64, T*, const T*, Geo, const i64*, Geo, int);
        // the index layout has the output's shape and no larger size than `src` on any axis but
        // `axis`, and every index is in `0..src.shape()[axis]`, so every read stays inside `src`.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("gather kernel", e))?;
        Ok(())
    }

    fn scatter_add(
        &self,
        op: &'static str,
        dtype: DType,
        target: Dst,
        axis: usize,
        index: Src,
        src: Src,
    ) -> Result<()> {
        let n = src.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("scatter_add"), dtype))?;
        let (count, axis) = (n as i64, axis as i32);
        let (t, s, i) = (target.buf.address(), src.buf.address(), index.buf.address());
        let (gt, gs, gi) = (
            Geo::of(op, target.layout)?,
            Geo::of(op, src.layout)?,
            Geo::of(op, index.layout)?,
        );
        let mut l = self.stream.launch_builder(&f);
        l.arg(&count)
            .arg(&t)
            .arg(&gt)
            .arg(&s)
            .arg(&gs)
            .arg(&i)
            .arg(&gi)
            .arg(&axis);
        // SAFETY: the arguments match `scatter_add_<dtype>` (i64, T*, Geo, const T*, Geo, const i64*,
        // Geo, int); the index layout has `src`'s shape, no larger than the target's on any axis but
        // `axis`, and every index is in `0..target.shape()[axis]` (checked by the op), so every write
        // stays inside the target, which nothing else reads or writes while the kernel runs.
        unsafe { l.launch(elementwise_launch(n)) }
            .map_err(|e| cuda_error("scatter-add kernel", e))?;
        Ok(())
    }

    fn cumsum(&self, dtype: DType, x: Src, reverse: bool, out: Dst) -> Result<()> {
        let len = x.layout.shape().last().copied().unwrap_or(1);
        let n = out.layout.numel();
        if n == 0 || len == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("cumsum"), dtype))?;
        let (rows, len, rev) = ((n / len) as i64, len as i64, i32::from(reverse));
        let (o, i) = (
            first(out.buf.address(), out.layout, dtype),
            first(x.buf.address(), x.layout, dtype),
        );
        let mut l = self.stream.launch_builder(&f);
        l.arg(&rows).arg(&len).arg(&o).arg(&i).arg(&rev);
        // SAFETY: the arguments match `cumsum_<dtype>` (i64, i64, T*, const T*, int); `x` and `out`
        // are contiguous with `rows * len` elements, and each thread walks one row of both.
        unsafe { l.launch(elementwise_launch(rows as usize)) }
            .map_err(|e| cuda_error("cumsum kernel", e))?;
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
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        debug_assert!(dtype.is_float(), "creation ops draw floats only");
        let f = self.function(float_kernel("random", float_family!("random"), dtype)?)?;
        let (count, code) = (n as i64, dist.code());
        let o = first(out.buf.address(), out.layout, dtype);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&count).arg(&o).arg(&code).arg(&seed).arg(&offset);
        // SAFETY: the arguments match `random_<dtype>` (i64, T*, int, unsigned long long,
        // unsigned long long); `out` is contiguous with `n` elements, each written once.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("random kernel", e))?;
        Ok(())
    }

    fn unfold2d(&self, dtype: DType, window: &Window2d, pad: f64, x: Src, out: Dst) -> Result<()> {
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("unfold2d"), dtype))?;
        let (count, w) = (n as i64, WindowArg::of(window));
        let (o, i) = (
            first(out.buf.address(), out.layout, dtype),
            first(x.buf.address(), x.layout, dtype),
        );
        with_dtype!(dtype, T => {
            let pad = <T as Math>::Compute::from_f64(pad);
            let mut l = self.stream.launch_builder(&f);
            l.arg(&count).arg(&o).arg(&i).arg(&w).arg(&pad);
            // SAFETY: the arguments match `unfold2d_<dtype>` (i64, T*, const T*, Window, C); `x` is
            // contiguous `[planes, rows, cols]` and `out` contiguous with `n` elements
            // `[planes, kh, kw, oh, ow]`, and every read is bounds-checked against the plane.
            unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("unfold2d kernel", e))?;
        });
        Ok(())
    }

    fn fold2d(&self, dtype: DType, window: &Window2d, cols: Src, out: Dst) -> Result<()> {
        let n = out.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(kernel(family!("fold2d"), dtype))?;
        let (count, w) = (n as i64, WindowArg::of(window));
        let (o, c) = (
            first(out.buf.address(), out.layout, dtype),
            first(cols.buf.address(), cols.layout, dtype),
        );
        let mut l = self.stream.launch_builder(&f);
        l.arg(&count).arg(&o).arg(&c).arg(&w);
        // SAFETY: the arguments match `fold2d_<dtype>` (i64, T*, const T*, Window); `out` is
        // contiguous `[planes, rows, cols]` with `n` elements, `cols` contiguous
        // `[planes, kh, kw, oh, ow]`, and every column index is checked against `oh` and `ow`.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("fold2d kernel", e))?;
        Ok(())
    }

    fn matmul_reads(&self, layout: &Layout, batch: &[usize]) -> bool {
        blas::reads(layout, batch)
    }

    fn matmul(
        &self,
        dtype: DType,
        a: Src,
        b: Src,
        batch: &[usize],
        mkn: (usize, usize, usize),
        out: Dst,
        tf32: bool,
        _scratch: Option<Dst>, // cuBLAS packs nothing of ours: no scratch asked for
    ) -> Result<()> {
        blas::matmul(self, dtype, (a, b), batch, mkn, out, tf32)
    }

    fn quant_scratch_bytes(&self, m: usize, k: usize) -> usize {
        m * k / 32 * super::quant::ROUNDED_BLOCK_BYTES
    }

    fn quant_matmul(
        &self,
        ty: crate::quant::QuantType,
        in_strips: bool,
        x: Src,
        w: Src,
        mkn: (usize, usize, usize),
        out: Dst,
        scratch: Option<Dst>,
    ) -> Result<()> {
        let scratch = match (in_strips, scratch) {
            (false, Some(scratch)) => scratch,
            _ => {
                return Err(crate::error::Error::InvalidArgument {
                    op: "matmul_quantized",
                    reason: "ndscope bug: a GPU product takes blocks in row order and a scratch \
                             block"
                        .into(),
                });
            }
        };
        self.quant_product(ty, x, w, mkn, out, scratch)
    }

    fn fused_update(
        &self,
        dtype: DType,
        update: FusedUpdate,
        targets: SmallVec<[Dst; 3]>,
        grad: Src,
        powers: Option<Src>,
    ) -> Result<()> {
        let n = grad.layout.numel();
        if n == 0 {
            return Ok(());
        }
        let count = n as i64;
        let powers = powers.map_or(0, |p| first(p.buf.address(), p.layout, DType::F64));
        let gp = first(grad.buf.address(), grad.layout, dtype);
        let ptrs: SmallVec<[u64; 3]> = targets
            .iter()
            .map(|t| first(t.buf.address(), t.layout, dtype))
            .collect();
        with_dtype!(dtype, T => match (update, ptrs.as_slice()) {
            (FusedUpdate::Sgd { lr, momentum, weight_decay, nesterov }, [pp, vp]) => {
                let f = self.function(float_kernel("sgd", float_family!("sgd"), dtype)?)?;
                let [lr, mu, wd] = [lr, momentum, weight_decay].map(<T as Math>::Compute::from_f64);
                let nesterov = i32::from(nesterov);
                let mut l = self.stream.launch_builder(&f);
                l.arg(&count).arg(pp).arg(vp).arg(&gp).arg(&lr).arg(&mu).arg(&wd).arg(&nesterov);
                // SAFETY: the arguments match `sgd_<dtype>` (i64, T*, T*, const T*, C, C, C, int) for
                // a float dtype; the three are contiguous with `n` elements, and the targets are
                // unique handles, so no other tensor sees the writes.
                unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("sgd kernel", e))?;
            }
            (FusedUpdate::Adam { b1, b2, eps, lr, l2, decay }, [pp, mp, vp]) => {
                let f = self.function(float_kernel("adam", float_family!("adam"), dtype)?)?;
                let [b1, b2, eps, l2, decay] =
                    [b1, b2, eps, l2, decay].map(<T as Math>::Compute::from_f64);
                let mut l = self.stream.launch_builder(&f);
                l.arg(&count).arg(pp).arg(mp).arg(vp).arg(&gp).arg(&powers);
                l.arg(&b1).arg(&b2).arg(&eps).arg(&lr).arg(&l2).arg(&decay);
                // SAFETY: the arguments match `adam_<dtype>` (i64, four T pointers, const double*,
                // then b1, b2, eps as C, lr as double, l2, decay as C) for a float dtype; the four are
                // contiguous with `n` elements, the three targets are unique handles, and `powers`
                // is the contiguous f64 pair the op checked.
                unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("adam kernel", e))?;
            }
            _ => unreachable!("an update gets the {} targets its kernel rewrites", update.targets()),
        });
        Ok(())
    }

    fn upload(&self, dtype: DType, data: &[u8], out: Dst) -> Result<()> {
        transfer::upload(self, first(out.buf.address(), out.layout, dtype), data)
    }

    fn download(&self, dtype: DType, x: Src, out: &mut [u8]) -> Result<()> {
        debug_assert!(x.layout.is_contiguous(), "the op packs a GPU tensor first");
        transfer::download(self, first(x.buf.address(), x.layout, dtype), out)
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.wait()
    }

    fn capturing(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Acquire)
    }
}
