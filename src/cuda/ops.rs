//! The GPU side of ndscope's ops. The public op ran its checks (shapes, dtypes, devices, indices)
//! before calling here; these functions allocate the result where the host kernel would (the
//! innermost operand owner) and queue the kernel on the GPU's stream.
//!
//! Every launch passes device addresses of blocks that the operands' handles keep alive until the
//! call returns; the stream orders the kernel before any later free of those blocks' bytes is
//! reused, so a kernel never reads memory that was handed to another tensor.

use std::panic::Location;

use cudarc::driver::PushKernelArg;

use crate::cuda::kernels::{Geo, elementwise_launch, family, kernel, rows_launch};
use crate::cuda::{cuda_error, gpu_of};
use crate::dtype::{DType, Element, with_dtype};
use crate::error::Result;
use crate::layout::Layout;
use crate::ops::fused::FusedKernel;
use crate::ops::op_code::{Binary, Reduction, Unary};
use crate::tensor::Tensor;

/// `out[go] = op(a[ga])` over `n` elements of `t`'s dtype, on `t`'s GPU.
#[allow(clippy::too_many_arguments)]
fn launch_unary(
    t: &Tensor<'_>,
    n: usize,
    out: u64,
    go: Geo,
    a: u64,
    ga: Geo,
    op: Unary,
    params: [f64; 2],
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let gpu = gpu_of(t.device())?;
    let f = gpu.function(kernel(family!("unary"), t.dtype()))?;
    let (code, count) = (op.code(), n as i64);
    with_dtype!(t.dtype(), T => {
        let [p0, p1] = params.map(T::from_f64);
        let mut b = gpu.stream.launch_builder(&f);
        b.arg(&code).arg(&count).arg(&out).arg(&go).arg(&a).arg(&ga).arg(&p0).arg(&p1);
        // SAFETY: the arguments match `unary_<dtype>` in kernels/elementwise.cu (int, i64, T*, Geo,
        // const T*, Geo, T, T); `out` and `a` are block addresses of live tensors of `dtype` whose
        // geometries stay inside their blocks for the `n` elements.
        unsafe { b.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("unary kernel", e))?;
    });
    Ok(())
}

/// `op(x)` into a new tensor.
pub(crate) fn unary<'s>(
    x: &Tensor<'s>,
    op: Unary,
    params: [f64; 2],
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[x], x.dtype(), x.shape(), at)?;
    launch_unary(
        x,
        x.numel(),
        out.device_block_ptr(),
        Geo::of("unary", out.layout())?,
        x.device_block_ptr(),
        Geo::of("unary", x.layout())?,
        op,
        params,
    )?;
    Ok(out)
}

/// `x = op(x)` in place; `x` is the unique handle to its contiguous elements.
pub(crate) fn unary_in_place(x: &mut Tensor<'_>, op: Unary, params: [f64; 2]) -> Result<()> {
    debug_assert!(x.is_unique() && x.is_contiguous());
    let g = Geo::of("unary", x.layout())?;
    let ptr = x.device_block_ptr();
    launch_unary(x, x.numel(), ptr, g, ptr, g, op, params)
}

/// `out[go] = op(a[ga], b[gb], p0, p1)` over `n` elements of `t`'s dtype, on `t`'s GPU.
fn launch_binary(
    t: &Tensor<'_>,
    n: usize,
    out: (u64, Geo),
    a: (u64, Geo),
    b: (u64, Geo),
    op: Binary,
    params: [f64; 2],
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let gpu = gpu_of(t.device())?;
    let f = gpu.function(kernel(family!("binary"), t.dtype()))?;
    let (code, count) = (op.code(), n as i64);
    with_dtype!(t.dtype(), T => {
        let [p0, p1] = params.map(T::from_f64);
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&code).arg(&count).arg(&out.0).arg(&out.1).arg(&a.0).arg(&a.1).arg(&b.0).arg(&b.1);
        l.arg(&p0).arg(&p1);
        // SAFETY: the arguments match `binary_<dtype>` (int, i64, T*, Geo, const T*, Geo, const T*,
        // Geo, T, T); the addresses are blocks of live tensors of `dtype`, and each geometry
        // describes `n` elements inside its block.
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("binary kernel", e))?;
    });
    Ok(())
}

/// `op(a, b)` over `shape`, each operand viewed through its layout broadcast to `shape`.
pub(crate) fn binary<'s>(
    [(a, la), (b, lb)]: [(&Tensor<'s>, &Layout); 2],
    shape: &[usize],
    op: Binary,
    params: [f64; 2],
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[a, b], a.dtype(), shape, at)?;
    launch_binary(
        a,
        out.numel(),
        (out.device_block_ptr(), Geo::of("binary", out.layout())?),
        (a.device_block_ptr(), Geo::of("binary", la)?),
        (b.device_block_ptr(), Geo::of("binary", lb)?),
        op,
        params,
    )?;
    Ok(out)
}

/// `x = op(x, other, p)` in place, `other` viewed through `lb` (broadcast to `x`'s shape); `x` is the
/// unique handle to its contiguous elements.
pub(crate) fn binary_in_place(
    x: &mut Tensor<'_>,
    other: &Tensor<'_>,
    lb: &Layout,
    op: Binary,
    p: f64,
) -> Result<()> {
    debug_assert!(x.is_unique() && x.is_contiguous());
    let g = Geo::of("binary", x.layout())?;
    let ptr = x.device_block_ptr();
    launch_binary(
        x,
        x.numel(),
        (ptr, g),
        (ptr, g),
        (other.device_block_ptr(), Geo::of("binary", lb)?),
        op,
        [p, 0.0],
    )
}

/// `cond ? on_true : on_false` over `shape`; every operand viewed through its broadcast layout.
/// `cond` has the branches' dtype (the caller converts it).
pub(crate) fn where_cond<'s>(
    operands: [(&Tensor<'s>, &Layout); 3],
    shape: &[usize],
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let [(c, lc), (t, lt), (f, lf)] = operands;
    let out = Tensor::output_of(&[c, t, f], t.dtype(), shape, at)?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let gpu = gpu_of(t.device())?;
    let func = gpu.function(kernel(family!("where"), t.dtype()))?;
    let (count, o) = (n as i64, out.device_block_ptr());
    let (pc, pt, pf) = (
        c.device_block_ptr(),
        t.device_block_ptr(),
        f.device_block_ptr(),
    );
    let (gc, gt, gf) = (
        Geo::of("where_cond", lc)?,
        Geo::of("where_cond", lt)?,
        Geo::of("where_cond", lf)?,
    );
    let mut l = gpu.stream.launch_builder(&func);
    l.arg(&count)
        .arg(&o)
        .arg(&pc)
        .arg(&gc)
        .arg(&pt)
        .arg(&gt)
        .arg(&pf)
        .arg(&gf);
    // SAFETY: the arguments match `where_<dtype>` (i64, T*, then three (const T*, Geo) pairs); the
    // output is a fresh contiguous block of `n` elements, the operands' geometries stay inside their
    // blocks, and all three have the output's dtype.
    unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("where kernel", e))?;
    Ok(out)
}

/// Converts `src` (through `ls`) into `dst` (through `ld`), element by element in row-major order.
fn launch_cast(src: &Tensor<'_>, ls: &Layout, dst: u64, ld: &Layout, dtype: DType) -> Result<()> {
    let n = ld.numel();
    if n == 0 {
        return Ok(());
    }
    let gpu = gpu_of(src.device())?;
    let name = match (src.dtype(), dtype) {
        (DType::F32, DType::F32) => "cast_f32_f32",
        (DType::F32, DType::F64) => "cast_f32_f64",
        (DType::F32, DType::I64) => "cast_f32_i64",
        (DType::F64, DType::F32) => "cast_f64_f32",
        (DType::F64, DType::F64) => "cast_f64_f64",
        (DType::F64, DType::I64) => "cast_f64_i64",
        (DType::I64, DType::F32) => "cast_i64_f32",
        (DType::I64, DType::F64) => "cast_i64_f64",
        (DType::I64, DType::I64) => "cast_i64_i64",
    };
    let f = gpu.function(name)?;
    let (count, a) = (n as i64, src.device_block_ptr());
    let (go, ga) = (Geo::of("copy", ld)?, Geo::of("copy", ls)?);
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&count).arg(&dst).arg(&go).arg(&a).arg(&ga);
    // SAFETY: the arguments match `cast_<src>_<dst>` (i64, D*, Geo, const S*, Geo); `dst` is the block
    // of a live tensor of `dtype` laid out by `ld`, `src`'s block holds its dtype laid out by `ls`,
    // and both layouts cover the same `n` elements.
    unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("copy kernel", e))?;
    Ok(())
}

/// `x` converted to `dtype`, in a new tensor.
pub(crate) fn cast<'s>(
    x: &Tensor<'s>,
    dtype: DType,
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[x], dtype, x.shape(), at)?;
    launch_cast(x, x.layout(), out.device_block_ptr(), out.layout(), dtype)?;
    Ok(out)
}

/// Copies `src`'s elements in row-major order into `dst`, a fresh contiguous tensor of its shape and
/// dtype on the same GPU.
pub(crate) fn copy_into(src: &Tensor<'_>, dst: &mut Tensor<'_>) -> Result<()> {
    launch_cast(
        src,
        src.layout(),
        dst.device_block_ptr(),
        dst.layout(),
        src.dtype(),
    )
}

/// Copies `src` (viewed through `ls`, which has `ld`'s shape) into the elements of `dst`'s block
/// that `ld` names; they must not overlap one another.
pub(crate) fn copy_into_view(
    src: &Tensor<'_>,
    ls: &Layout,
    dst: &mut Tensor<'_>,
    ld: &Layout,
) -> Result<()> {
    launch_cast(src, ls, dst.device_block_ptr(), ld, src.dtype())
}

/// `x` with the sorted `axes` moved last, packed contiguously: rows of the moved axes.
fn axes_last<'s>(x: &Tensor<'s>, axes: &[usize]) -> Result<Tensor<'s>> {
    let perm: Vec<usize> = (0..x.rank())
        .filter(|a| !axes.contains(a))
        .chain(axes.iter().copied())
        .collect();
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return x.contiguous();
    }
    x.permute(&perm)?.contiguous()
}

/// Reduces `x` over the sorted `axes` into a new tensor of shape `kept` (the reduced axes as 1).
pub(crate) fn reduce<'s>(
    x: &Tensor<'s>,
    kind: Reduction,
    axes: &[usize],
    kept: &[usize],
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let len: usize = axes.iter().map(|&a| x.shape()[a]).product();
    let out = Tensor::output_of(&[x], x.dtype(), kept, at)?;
    let rows = out.numel();
    if rows == 0 {
        return Ok(out);
    }
    let input = axes_last(x, axes)?;
    let gpu = gpu_of(x.device())?;
    let f = gpu.function(kernel(family!("reduce"), x.dtype()))?;
    let (code, r, n) = (kind.code(), rows as i64, len as i64);
    let (o, i) = (out.device_block_ptr(), input.device_ptr());
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&code).arg(&r).arg(&n).arg(&o).arg(&i);
    // SAFETY: the arguments match `reduce_<dtype>` (int, i64, i64, T*, const T*); `input` is a live
    // contiguous tensor of `rows * len` elements from its address, `out` a fresh one of `rows`.
    unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("reduce kernel", e))?;
    Ok(out)
}

/// Index of the largest element along `axis` (non-empty), as `i64` of shape `kept` (`axis` as 1).
pub(crate) fn argmax<'s>(
    x: &Tensor<'s>,
    axis: usize,
    kept: &[usize],
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[x], DType::I64, kept, at)?;
    let rows = out.numel();
    if rows == 0 {
        return Ok(out);
    }
    let input = axes_last(x, &[axis])?;
    let gpu = gpu_of(x.device())?;
    let f = gpu.function(kernel(family!("argmax"), x.dtype()))?;
    let (r, n) = (rows as i64, x.shape()[axis] as i64);
    let (o, i) = (out.device_block_ptr(), input.device_ptr());
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&r).arg(&n).arg(&o).arg(&i);
    // SAFETY: the arguments match `argmax_<dtype>` (i64, i64, i64*, const T*); `input` is contiguous
    // with `rows * len` elements, `out` a fresh i64 tensor of `rows`.
    unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("argmax kernel", e))?;
    Ok(out)
}

/// Softmax or log-softmax of the rows of `moved` (contiguous, the axis last) into a new tensor of
/// its shape, owned like `x`'s results.
pub(crate) fn softmax_rows<'s>(
    x: &Tensor<'s>,
    moved: &Tensor<'s>,
    log: bool,
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[x], x.dtype(), moved.shape(), at)?;
    let len = moved.shape().last().copied().unwrap_or(1);
    if out.numel() == 0 {
        return Ok(out);
    }
    let rows = out.numel() / len;
    let gpu = gpu_of(x.device())?;
    let f = gpu.function(kernel(family!("softmax"), x.dtype()))?;
    let (r, n, flag) = (rows as i64, len as i64, i32::from(log));
    let (o, i) = (out.device_block_ptr(), moved.device_ptr());
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&r).arg(&n).arg(&o).arg(&i).arg(&flag);
    // SAFETY: the arguments match `softmax_<dtype>` (i64, i64, T*, const T*, int) for a float dtype
    // (the caller refused integers); both tensors are contiguous with `rows * len` elements.
    unsafe { l.launch(rows_launch(rows)) }.map_err(|e| cuda_error("softmax kernel", e))?;
    Ok(out)
}

/// The derivative of the mean cross-entropy with respect to the logits, `(exp(log_p) - one_hot) *
/// scale`, from the log-probabilities `[batch, classes]` and the checked labels `[batch]`.
pub(crate) fn cross_entropy_grad<'s>(
    log_p: &Tensor<'s>,
    labels: &Tensor<'s>,
    scale: f64,
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let (log_p, labels) = (log_p.contiguous()?, labels.contiguous()?);
    let out = Tensor::output_of(&[&log_p], log_p.dtype(), log_p.shape(), at)?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let (rows, classes) = (log_p.shape()[0] as i64, log_p.shape()[1] as i64);
    let gpu = gpu_of(log_p.device())?;
    let f = gpu.function(kernel(family!("xent_grad"), log_p.dtype()))?;
    let (o, lp, lb) = (
        out.device_block_ptr(),
        log_p.device_ptr(),
        labels.device_ptr(),
    );
    with_dtype!(log_p.dtype(), T => {
        let scale = T::from_f64(scale);
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&rows).arg(&classes).arg(&o).arg(&lp).arg(&lb).arg(&scale);
        // SAFETY: the arguments match `xent_grad_<dtype>` (i64, i64, T*, const T*, const i64*, T) for
        // a float dtype; `log_p` and `out` are contiguous `[rows, classes]`, `labels` contiguous i64
        // `[rows]` with values in `0..classes` (checked by the caller's gather).
        unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("cross-entropy kernel", e))?;
    });
    Ok(out)
}

/// `out[p] = src[p with coordinate axis replaced by index[p]]` for every position `p` of the output
/// shape, which `index_layout` has (a broadcast layout for `index_select`). The indices are checked.
pub(crate) fn gather<'s>(
    src: &Tensor<'s>,
    axis: usize,
    index: &Tensor<'s>,
    index_layout: &Layout,
    at: &'static Location<'static>,
) -> Result<Tensor<'s>> {
    let out = Tensor::output_of(&[src, index], src.dtype(), index_layout.shape(), at)?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let gpu = gpu_of(src.device())?;
    let f = gpu.function(kernel(family!("gather"), src.dtype()))?;
    let (count, axis) = (n as i64, axis as i32);
    let (o, s, i) = (
        out.device_block_ptr(),
        src.device_block_ptr(),
        index.device_block_ptr(),
    );
    let (gs, gi) = (
        Geo::of("gather", src.layout())?,
        Geo::of("gather", index_layout)?,
    );
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&count)
        .arg(&o)
        .arg(&s)
        .arg(&gs)
        .arg(&i)
        .arg(&gi)
        .arg(&axis);
    // SAFETY: the arguments match `gather_<dtype>` (i64, T*, const T*, Geo, const i64*, Geo, int);
    // `index_layout` has the output's shape and no larger size than `src` on any axis but `axis`, and
    // every index is in `0..src.shape()[axis]`, so every read stays inside `src`'s block.
    unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("gather kernel", e))?;
    Ok(out)
}

/// One fused optimizer update on the GPU: `targets` are unique contiguous tensors of the gradient
/// `g`'s shape and dtype (`[param, velocity]` for SGD, `[param, m, v]` for Adam); `g` is contiguous.
pub(crate) fn fused_update(
    op: &'static str,
    kernel_kind: FusedKernel,
    targets: &mut [&mut Tensor<'_>],
    g: &Tensor<'_>,
) -> Result<()> {
    let n = g.numel();
    if n == 0 {
        return Ok(());
    }
    // Only float parameters reach here: the optimizers dispatch with `with_float_dtype!`.
    let dtype = g.dtype();
    let gpu = gpu_of(g.device())?;
    let count = n as i64;
    let gp = g.device_ptr();
    let ptrs: Vec<u64> = targets.iter().map(|t| t.device_ptr()).collect();
    with_dtype!(dtype, T => match (kernel_kind, ptrs.as_slice()) {
        (FusedKernel::Sgd { lr, momentum, weight_decay, nesterov }, [pp, vp]) => {
            let f = gpu.function(kernel(family!("sgd"), dtype))?;
            let [lr, mu, wd] = [lr, momentum, weight_decay].map(T::from_f64);
            let nesterov = i32::from(nesterov);
            let mut l = gpu.stream.launch_builder(&f);
            l.arg(&count).arg(pp).arg(vp).arg(&gp).arg(&lr).arg(&mu).arg(&wd).arg(&nesterov);
            // SAFETY: the arguments match `sgd_<dtype>` (i64, T*, T*, const T*, T, T, T, int) for a
            // float dtype; the three tensors are contiguous with `n` elements, and the two targets
            // are unique handles, so no other tensor sees the writes.
            unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("sgd kernel", e))?;
        }
        (FusedKernel::Adam { b1, b2, eps, step_size, v_scale, l2, decay }, [pp, mp, vp]) => {
            let f = gpu.function(kernel(family!("adam"), dtype))?;
            let scalars = [b1, b2, eps, step_size, v_scale, l2, decay].map(T::from_f64);
            let mut l = gpu.stream.launch_builder(&f);
            l.arg(&count).arg(pp).arg(mp).arg(vp).arg(&gp);
            for s in &scalars {
                l.arg(s);
            }
            // SAFETY: the arguments match `adam_<dtype>` (i64, four T pointers, then b1, b2, eps,
            // step_size, v_scale, l2, decay as T) for a float dtype; the four tensors are contiguous
            // with `n` elements, and the three targets are unique handles.
            unsafe { l.launch(elementwise_launch(n)) }.map_err(|e| cuda_error("adam kernel", e))?;
        }
        _ => unreachable!("{op}: an optimizer passes the targets its kernel updates"),
    });
    Ok(())
}
