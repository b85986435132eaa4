//! Host matrix products through the `gemm` crate, which reads any strides (so transposed views need
//! no copy) and runs its own cache-blocked, SIMD kernels.
//!
//! 16-bit products accumulate in `f32`: `f16` through `gemm`'s own `f16` kernels (which widen to
//! `f32` while packing), `bf16` in [`bf16_gemm`] where the CPU has AVX-512 BF16, otherwise by
//! widening both operands to `f32` scratch (exact), multiplying in `f32` and rounding each output
//! element once. The scratch is host memory of the backend's own, as
//! `gemm`'s packing buffers are; it never holds a tensor.

use gemm::Parallelism;

use super::narrow::Narrow;
use super::widen::Widen;
use super::{bf16_gemm, convert_chunks, few_rows, few_rows_in_out, transposed_weight};

use crate::backend::{Dst, Src, split_bytes};
use crate::dtype::{DType, Element, bf16};
use crate::layout::{Layout, RowWalk, Shape, contiguous_strides};

/// Products with fewer multiply-adds than this run on one thread.
const PARALLEL_FLOPS: usize = 48 * 48 * 48;

pub(super) fn matmul(
    dtype: DType,
    a: Src,
    b: Src,
    batch: &[usize],
    mkn: (usize, usize, usize),
    out: Dst,
    scratch: Option<Dst>,
) {
    match dtype {
        DType::F32 if let Some((weight, ldx, ldw)) = streamed(a.layout, b.layout, mkn) => {
            let (da, db) = (a.buf.host::<f32>(), b.buf.host::<f32>());
            let out = out.contiguous_host::<f32>();
            let (m, _, n) = mkn;
            let product = match weight {
                Streamed::Transposed => few_rows::product,
                Streamed::AlongOutputs => few_rows_in_out::product,
            };
            each_product(a.layout, b.layout, batch, (m, n), |ia, ib, io| {
                product(
                    &da[ia..],
                    ldx,
                    &db[ib..],
                    ldw,
                    mkn,
                    &mut out[io..io + m * n],
                );
            });
        }
        DType::F32 => f32_product(a, b, batch, mkn, out, scratch),
        DType::F64 => direct::<f64>(a, b, batch, mkn, out),
        DType::F16 => direct::<gemm::f16>(a, b, batch, mkn, out),
        DType::BF16 => match rounds(dtype) {
            Some(dot) => bf16_product::<bf16>(dot, a, b, batch, mkn, out, scratch),
            None => {
                let (wa, la) = widen(a);
                let (wb, lb) = widen(b);
                let out = out.contiguous_host::<bf16>();
                let mut wide = vec![0.0f32; out.len()];
                matmul_into::<f32>((&wa, &la), (&wb, &lb), batch, mkn, &mut wide);
                convert_chunks(&wide, out, bf16::narrow);
            }
        },
        DType::I64 => unreachable!("matmul refuses integer dtypes before computing"),
    }
}

/// The kernel with which this CPU's `dtype` products run in [`bf16_gemm`], which also reads an
/// `f32` right operand, rounding it as it packs ([`bf16_product`]); `None` where they do not.
pub(super) fn rounds(dtype: DType) -> Option<bf16_gemm::Bf16Dot> {
    bf16_gemm::Bf16Dot::detect().filter(|_| dtype == DType::BF16)
}

/// A `bf16` product in [`bf16_gemm`] with the kernel [`rounds`] gave: `a` in `bf16`, `b` in
/// `bf16` or in `f32` (rounded as it is packed).
pub(super) fn bf16_product<E: bf16_gemm::Packed + Element>(
    dot: bf16_gemm::Bf16Dot,
    a: Src,
    b: Src,
    batch: &[usize],
    mkn: (usize, usize, usize),
    out: Dst,
    scratch: Option<Dst>,
) {
    let (la, lb) = (a.layout, b.layout);
    let (da, db) = (a.buf.host::<bf16>(), b.buf.host::<E>());
    let ((a_rs, a_cs), (b_rs, b_cs)) = (matrix_strides(la), matrix_strides(lb));
    let out = out.contiguous_host::<bf16>();
    let (m, _, n) = mkn;
    // One product at a time, so one scratch serves the whole batch.
    let lens = bf16_gemm::Scratch::lens(dot, matrix(db, b_rs, b_cs), mkn);
    let mut scratch = scratch
        .zip(lens)
        .map(|(s, (rows, _))| s.buf.host_split::<bf16, u32>(rows));
    each_product(la, lb, batch, (m, n), |ia, ib, io| {
        let scratch = scratch
            .as_mut()
            .map(|(rows, panels)| bf16_gemm::Scratch { rows, panels });
        bf16_gemm::matmul(
            dot,
            matrix(&da[ia..], a_rs, a_cs),
            matrix(&db[ib..], b_rs, b_cs),
            mkn,
            &mut out[io..io + m * n],
            scratch,
        );
    });
}

/// A matrix of [`bf16_gemm`] at `data` with the strides of its rows and columns.
fn matrix<E>(data: &[E], rows: isize, cols: isize) -> bf16_gemm::Matrix<'_, E> {
    bf16_gemm::Matrix {
        data,
        rows: rows as usize,
        cols: cols as usize,
    }
}

/// The smallest packing that asks the op for scratch: the size from which host blocks are mapped
/// from the kernel (`memory::raw`'s 1 MiB, as glibc's `malloc` does above its threshold), so that a
/// packing of its own would take fresh pages on every call. Smaller packings come from the heap
/// without faults and stay out of the step's memory (a planned step's arena): the digits MLP's
/// bf16 arena was 0.84x its `f32` one with every packing in scratch.
const SCRATCH_MIN: usize = 1 << 20;

/// [`Backend::matmul_scratch_bytes`](crate::backend::Backend::matmul_scratch_bytes) on the host:
/// the packed operands of a bf16 product ([`bf16_gemm::Scratch`]), or the transposed chunk of an
/// `f32` product by a transposed weight ([`transposed_weight`]), when they take at least
/// [`SCRATCH_MIN`], one product of the batch at a time. The left operand is packed
/// whatever its strides, so only the right one's layout counts.
pub(super) fn scratch_bytes(dtype: DType, b: &Layout, mkn: (usize, usize, usize)) -> usize {
    if dtype == DType::F32 {
        let (b_rs, b_cs) = matrix_strides(b);
        let bytes = transposed_weight::scratch_len(b_rs, b_cs, mkn).map_or(0, |len| len * 4);
        return if bytes >= SCRATCH_MIN { bytes } else { 0 };
    }
    if dtype != DType::BF16 {
        return 0;
    }
    let Some(dot) = bf16_gemm::Bf16Dot::detect() else {
        return 0;
    };
    let (b_rs, b_cs) = matrix_strides(b);
    let b = matrix::<bf16>(&[], b_rs, b_cs);
    let lens = bf16_gemm::Scratch::lens(dot, b, mkn);
    let bytes = lens.map_or(0, |(rows, panels)| {
        split_bytes::<bf16>(rows) + panels * size_of::<u32>()
    });
    if bytes >= SCRATCH_MIN { bytes } else { 0 }
}

/// How a product of a few rows streams its right operand, the weight.
enum Streamed {
    /// A `[n, k]` weight read as `Wᵀ`, its columns contiguous along `k`: [`few_rows::product`].
    Transposed,
    /// A `[k, n]` weight, its rows contiguous along `n`: [`few_rows_in_out::product`].
    AlongOutputs,
}

/// Whether `a b` is a few rows by a weight that one of the streamed products reads, and with which
/// row strides `(ldx, ldw)`: at most `MAX_ROWS` rows of `a`, each contiguous along `k`, and `b`
/// contiguous along `k` ([`Streamed::Transposed`], preferred) or along `n`
/// ([`Streamed::AlongOutputs`]), rows apart by at least their length (a single row's stride is never
/// read: its length stands for it).
fn streamed(
    a: &Layout,
    b: &Layout,
    (m, k, n): (usize, usize, usize),
) -> Option<(Streamed, usize, usize)> {
    let ((a_rs, a_cs), (b_rs, b_cs)) = (matrix_strides(a), matrix_strides(b));
    let stride = |rows: usize, stride: isize, len: usize| match rows {
        1 => Some(len),
        _ => usize::try_from(stride).ok().filter(|&s| s >= len),
    };
    let shaped = (1..=few_rows::MAX_ROWS).contains(&m) && k >= 1 && n >= 1 && (a_cs == 1 || k == 1);
    if !shaped {
        return None;
    }
    let ldx = stride(m, a_rs, k)?;
    if (b_rs == 1 || k == 1)
        && let Some(ldw) = stride(n, b_cs, k)
    {
        return Some((Streamed::Transposed, ldx, ldw));
    }
    if b_cs == 1 || n == 1 {
        return Some((Streamed::AlongOutputs, ldx, stride(k, b_rs, n)?));
    }
    None
}

/// An `f32` product: by a transposed weight a chunk at a time where [`transposed_weight`] takes it
/// (in `scratch` when the op gave it, else in a buffer of its own), otherwise one `gemm` call.
fn f32_product(
    a: Src,
    b: Src,
    batch: &[usize],
    mkn: (usize, usize, usize),
    out: Dst,
    scratch: Option<Dst>,
) {
    let ((a_rs, a_cs), (b_rs, b_cs)) = (matrix_strides(a.layout), matrix_strides(b.layout));
    let Some(len) = transposed_weight::scratch_len(b_rs, b_cs, mkn) else {
        return direct::<f32>(a, b, batch, mkn, out);
    };
    let (da, db) = (a.buf.host::<f32>(), b.buf.host::<f32>());
    let out = out.contiguous_host::<f32>();
    let mut own = Vec::new();
    let chunk = match scratch {
        Some(s) if s.layout.numel() >= len => &mut s.contiguous_host::<f32>()[..len],
        _ => {
            own.resize(len, 0.0f32);
            &mut own[..]
        }
    };
    let (m, k, n) = mkn;
    each_product(a.layout, b.layout, batch, (m, n), |ia, ib, io| {
        // SAFETY: `a`'s layout keeps every element `ia + r*a_rs + c*a_cs` (r < m, c < k) inside
        // its block (layouts are checked against the block when created), likewise the weight's
        // rows from `ib`, `b_cs` apart; `scratch_len` said the product runs here, which it says
        // only where the CPU has AVX-512 F.
        unsafe {
            transposed_weight::product(
                &da[ia..],
                (a_rs, a_cs),
                &db[ib..],
                b_cs as usize,
                mkn,
                &mut out[io..io + m * n],
                chunk,
                parallelism(m, k, n),
            )
        };
    });
}

/// On how many threads `gemm` runs an `m × k × n` product.
fn parallelism(m: usize, k: usize, n: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FLOPS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// A product in the operands' own type (`gemm` widens `f16` itself).
fn direct<T: Element>(a: Src, b: Src, batch: &[usize], mkn: (usize, usize, usize), out: Dst) {
    let (da, db) = (a.buf.host::<T>(), b.buf.host::<T>());
    matmul_into::<T>(
        (da, a.layout),
        (db, b.layout),
        batch,
        mkn,
        out.contiguous_host(),
    );
}

/// The elements `x` views, widened from `bf16` to `f32` in row-major order, and their layout.
fn widen(x: Src<'_>) -> (Vec<f32>, Layout) {
    let (layout, data) = (x.layout, x.buf.host::<bf16>());
    let mut wide = vec![0.0f32; layout.numel()];
    if layout.is_contiguous() {
        let from = &data[layout.offset()..layout.offset() + wide.len()];
        convert_chunks(from, &mut wide, bf16::widen);
        return (wide, Layout::contiguous(layout.shape()));
    }
    let walk = RowWalk::new(layout.shape(), [layout.strides()], [layout.offset()]);
    let [stride] = walk.row_strides();
    let len = walk.row_len();
    walk.for_rows(0, walk.rows(), |row, [start]| {
        for (j, w) in wide[row * len..(row + 1) * len].iter_mut().enumerate() {
            *w = data[start + j * stride].to_f32();
        }
    });
    (wide, Layout::contiguous(layout.shape()))
}

/// The row and column strides of a matrix operand (its last two dimensions).
fn matrix_strides(layout: &Layout) -> (isize, isize) {
    let (r, s) = (layout.rank(), layout.strides());
    (s[r - 2] as isize, s[r - 1] as isize)
}

/// Calls `product(ia, ib, io)` for every index of `batch`: where that product's operands start in
/// their blocks and where its `m×n` output starts in the contiguous output.
fn each_product(
    a_layout: &Layout,
    b_layout: &Layout,
    batch: &[usize],
    (m, n): (usize, usize),
    mut product: impl FnMut(usize, usize, usize),
) {
    let (ar, br) = (a_layout.rank(), b_layout.rank());
    let batch_layout = |t: &Layout, r: usize| {
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
    let (sa, sb) = (batch_layout(a_layout, ar), batch_layout(b_layout, br));
    let so = contiguous_strides(batch)
        .iter()
        .map(|s| s * m * n)
        .collect::<Shape>();
    let walk = RowWalk::new(
        batch,
        [&sa, &sb, &so],
        [a_layout.offset(), b_layout.offset(), 0],
    );
    let [rsa, rsb, rso] = walk.row_strides();
    let total: usize = batch.iter().product();
    walk.for_segments(0, total, |_, [oa, ob, oo], len| {
        for j in 0..len {
            product(oa + j * rsa, ob + j * rsb, oo + j * rso);
        }
    });
}

/// `out[b] = a[b] @ b[b]` for every batch index; each operand is its block's elements and the
/// layout through which the product reads them.
fn matmul_into<T: Element>(
    (da, a_layout): (&[T], &Layout),
    (db, b_layout): (&[T], &Layout),
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
    let (a_rs, a_cs) = matrix_strides(a_layout);
    let (b_rs, b_cs) = matrix_strides(b_layout);
    let parallelism = parallelism(m, k, n);
    each_product(a_layout, b_layout, batch, (m, n), |ia, ib, io| {
        debug_assert!(io + m * n <= out.len());
        {
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

/// A block of a matrix in a slice: element `(r, c)` is `data[r * rows + c * cols]`.
#[derive(Clone, Copy)]
pub(super) struct Strided<'a, T> {
    pub(super) data: &'a [T],
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// Whether an `m×k` by `k×n` product (each at least 1) reads only elements inside `a` and `b`, and
/// writes only inside the `c` of `c_len` elements whose rows, `n` wide, are `ldc` apart.
pub(super) fn tile_fits<T: Copy>(
    (m, n, k): (usize, usize, usize),
    a: Strided<'_, T>,
    b: Strided<'_, T>,
    c_len: usize,
    ldc: usize,
) -> bool {
    let last =
        |s: Strided<'_, T>, rows: usize, cols: usize| (rows - 1) * s.rows + (cols - 1) * s.cols;
    last(a, m, k) < a.data.len()
        && last(b, k, n) < b.data.len()
        && (m - 1) * ldc + n <= c_len
        && n <= ldc
}

/// `c = scale · a b` (or `c += scale · a b` when `accumulate`) on the calling thread, for `a` `m×k`,
/// `b` `k×n` and the `m×n` block `c` whose rows are `ldc` apart: the small products of the fused
/// kernels, which parallelise over their own tasks.
///
/// # Panics
/// When an operand's last element lies outside its slice (a kernel bug: callers pass in-range tiles).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_tile<T: Element>(
    (m, n, k): (usize, usize, usize),
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
    a: Strided<'_, T>,
    b: Strided<'_, T>,
    scale: T,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.chunks_mut(ldc)
                .take(m)
                .for_each(|row| row[..n].fill(T::zero()));
        }
        return;
    }
    assert!(
        tile_fits((m, n, k), a, b, c.len(), ldc),
        "ndscope bug: a matrix tile outside its slice"
    );
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32
        && b.cols == 1
        && let Some(unit) = super::tile_product::Avx512::detect()
    {
        let f32s = |s: &[T]| {
            // SAFETY: `T::DTYPE` is `F32`, so `T` is `f32` (each dtype has one element type): the
            // same length, layout and lifetime.
            unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<f32>(), s.len()) }
        };
        let (a, b) = (
            Strided {
                data: f32s(a.data),
                rows: a.rows,
                cols: a.cols,
            },
            Strided {
                data: f32s(b.data),
                rows: b.rows,
                cols: b.cols,
            },
        );
        // SAFETY: as above; `c` stays borrowed mutably for the product and no longer.
        let c = unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast::<f32>(), c.len()) };
        let scale = scale.to_f64() as f32;
        return super::tile_product::product(unit, (m, n, k), c, ldc, accumulate, a, b, scale);
    }
    // SAFETY: the `tile_fits` assertion above keeps every element the product reads (`a`: rows
    // below m, columns below k; `b`: rows below k, columns below n) inside its slice and every
    // element it writes inside `c`, whose rows (n <= ldc elements apart) do not overlap; `c` is
    // borrowed mutably, so it overlaps neither input. With `read_dst = false` the old contents of
    // `c` are not read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cols as isize,
            a.rows as isize,
            b.data.as_ptr(),
            b.cols as isize,
            b.rows as isize,
            T::one(),
            scale,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}
