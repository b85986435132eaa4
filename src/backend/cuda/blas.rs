//! Matrix products through cuBLAS's strided batched GEMM. cuBLAS is column-major; a row-major
//! product `C = A B` is computed as `Cᵀ = Bᵀ Aᵀ`, which reads ndscope's row-major (or transposed)
//! operands in place: only operands whose matrices are neither row- nor column-major, or whose batch
//! dimensions are not one uniform stride, are packed first.
//!
//! `f32` and `f64` use cuBLAS's `sgemm`/`dgemm` (full precision); 16-bit products and `f32` products
//! in a scope that allows TF32 use `cublasGemmStridedBatchedEx` with `f32` accumulation
//! (`CUBLAS_COMPUTE_32F`, or `CUBLAS_COMPUTE_32F_FAST_TF32`), which runs on the tensor cores.

use cudarc::cublas::{result, sys};

use crate::backend::cuda::{Gpu, cuda_error};
use crate::backend::op::Unary;
use crate::backend::{Dst, Src};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;

/// How one operand reaches cuBLAS: its address, whether its matrices are stored transposed
/// (column-major), the leading dimension, and the stride between batch matrices.
struct Operand {
    address: u64,
    transposed: bool,
    ld: usize,
    batch_stride: usize,
}

/// Row- or column-major form of an `r x c` matrix with strides `(rs, cs)`: `(transposed, ld)`.
fn matrix_form(r: usize, c: usize, rs: usize, cs: usize) -> Option<(bool, usize)> {
    if (c == 1 || cs == 1) && (r == 1 || rs >= c.max(1)) {
        return Some((false, if r == 1 { c.max(1) } else { rs }));
    }
    if (r == 1 || rs == 1) && (c == 1 || cs >= r.max(1)) {
        return Some((true, if c == 1 { r.max(1) } else { cs }));
    }
    None
}

/// The matrix dimensions of `layout` (`[.., r, c]`) and whether it holds more than one matrix.
fn dims(layout: &Layout) -> (usize, usize, bool) {
    let (shape, rank) = (layout.shape(), layout.rank());
    let batched = shape[..rank - 2].iter().product::<usize>() > 1;
    (shape[rank - 2], shape[rank - 1], batched)
}

/// Whether cuBLAS reads an operand laid out as `layout` in a product over `batch` in place: one
/// matrix broadcast over the batch in row- or column-major form, or the contiguous
/// `[batch.., r, c]` form (one matrix per batch index at a uniform stride).
pub(crate) fn reads(layout: &Layout, batch: &[usize]) -> bool {
    let (r, c, batched) = dims(layout);
    let rank = layout.rank();
    if batched {
        return layout.is_contiguous() && layout.shape()[..rank - 2] == *batch;
    }
    let strides = layout.strides();
    matrix_form(r, c, strides[rank - 2], strides[rank - 1]).is_some()
}

/// The cuBLAS form of an operand that [`reads`] accepted.
fn operand(x: Src, dtype: DType) -> Operand {
    let layout = x.layout;
    let (r, c, batched) = dims(layout);
    let rank = layout.rank();
    let (rs, cs) = (layout.strides()[rank - 2], layout.strides()[rank - 1]);
    let (transposed, ld) = matrix_form(r, c, rs, cs).unwrap_or((false, c.max(1)));
    Operand {
        address: x.buf.address() + (layout.offset() * dtype.size()) as u64,
        transposed,
        ld,
        batch_stride: if batched { r * c } else { 0 },
    }
}

fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidShape {
        op,
        shape: vec![v],
        reason: "cuBLAS takes dimensions, strides and batch counts below 2^31".into(),
    })
}

/// `out[b] = a[b] @ b[b]` for every batch index (`a`: `[.., m, k]`, `b`: `[.., k, n]`, batch
/// dimensions broadcasting to `batch`, each in a form [`reads`] accepts); `out` is a fresh contiguous
/// `[batch.., m, n]` tensor.
pub(crate) fn matmul(
    gpu: &Gpu,
    dtype: DType,
    (a, b): (Src, Src),
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
    out: Dst,
    tf32: bool,
) -> Result<()> {
    const OP: &str = "matmul";
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return gpu.launch_unary(
            dtype,
            out.layout.numel(),
            (out.buf.address(), out.layout),
            None,
            Unary::Fill,
            [0.0; 2],
        );
    }
    let count: usize = batch.iter().product();
    if count == 0 {
        return Ok(());
    }
    debug_assert!(reads(a.layout, batch) && reads(b.layout, batch));
    let (oa, ob) = (operand(a, dtype), operand(b, dtype));
    let blas = gpu.blas()?;
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Column-major view: Cᵀ (n x m) = Bᵀ (n x k) · Aᵀ (k x m).
    let (mm, nn, kk) = (int(OP, n)?, int(OP, m)?, int(OP, k)?);
    let (lda, ldb, ldc) = (int(OP, ob.ld)?, int(OP, oa.ld)?, int(OP, n)?);
    let (sa, sb, sc) = (
        ob.batch_stride as i64,
        oa.batch_stride as i64,
        (m * n) as i64,
    );
    let batches = int(OP, count)?;
    let (pa, pb, pc) = (ob.address, oa.address, out.buf.address());
    let (ta, tb) = (op(ob.transposed), op(oa.transposed));
    gpu.bind()?;
    // The tensor-core path: 16-bit operands (or f32 read as TF32) with f32 accumulation and scale.
    let tensor_cores = match dtype {
        DType::BF16 => Some((
            sys::cudaDataType::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )),
        DType::F16 => Some((
            sys::cudaDataType::CUDA_R_16F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )),
        DType::F32 if tf32 => Some((
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        )),
        _ => None,
    };
    let status = match (dtype, tensor_cores) {
        (_, Some((data, compute))) => {
            let (alpha, beta) = (1.0f32, 0.0f32);
            // SAFETY: as for f32 below, with elements of `dtype` (`data` names it to cuBLAS) and the
            // f32 scalars that CUBLAS_COMPUTE_32F* take.
            unsafe {
                result::gemm_strided_batched_ex(
                    *blas.handle(),
                    ta,
                    tb,
                    mm,
                    nn,
                    kk,
                    (&alpha as *const f32).cast(),
                    pa as *const std::ffi::c_void,
                    data,
                    lda,
                    sa,
                    pb as *const std::ffi::c_void,
                    data,
                    ldb,
                    sb,
                    (&beta as *const f32).cast(),
                    pc as *mut std::ffi::c_void,
                    data,
                    ldc,
                    sc,
                    batches,
                    compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        }
        (DType::F32, None) => {
            let (alpha, beta) = (1.0f32, 0.0f32);
            // SAFETY: the three addresses are live GPU blocks of f32 on the handle's stream; for
            // each of the `batches` products, the column-major shapes (n x k, k x m, n x m), leading
            // dimensions and batch strides computed above stay inside their blocks (checked by
            // `matrix_form`, or the operand was packed); alpha and beta are host scalars.
            unsafe {
                result::sgemm_strided_batched(
                    *blas.handle(),
                    ta,
                    tb,
                    mm,
                    nn,
                    kk,
                    &alpha,
                    pa as *const f32,
                    lda,
                    sa,
                    pb as *const f32,
                    ldb,
                    sb,
                    &beta,
                    pc as *mut f32,
                    ldc,
                    sc,
                    batches,
                )
            }
        }
        (DType::F64, None) => {
            let (alpha, beta) = (1.0f64, 0.0f64);
            // SAFETY: as for f32, with f64 tensors.
            unsafe {
                result::dgemm_strided_batched(
                    *blas.handle(),
                    ta,
                    tb,
                    mm,
                    nn,
                    kk,
                    &alpha,
                    pa as *const f64,
                    lda,
                    sa,
                    pb as *const f64,
                    ldb,
                    sb,
                    &beta,
                    pc as *mut f64,
                    ldc,
                    sc,
                    batches,
                )
            }
        }
        (dtype, None) => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype,
                expected: "a float dtype (f32, f64, bf16 or f16)",
            });
        }
    };
    status.map_err(|e| cuda_error("cuBLAS gemm", e))
}

/// cuBLAS's workspace (what PyTorch gives it on Hopper: 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Gives the new handle `blas` a workspace of its own, so that no product allocates memory: one
/// captured into a CUDA graph must not, and every product then runs the same way captured or not.
pub(super) fn give_workspace(
    gpu: &Gpu,
    blas: &cudarc::cublas::CudaBlas,
) -> std::result::Result<(), String> {
    let memory = crate::backend::cuda::alloc(gpu.ordinal, WORKSPACE_BYTES)
        .ok_or("the GPU refused memory for cuBLAS's workspace")?;
    // SAFETY: the handle belongs to this GPU's context; the workspace is memory of this GPU that is
    // never freed (the handle lives as long as the process) and that nothing else uses.
    let status = unsafe {
        sys::cublasSetWorkspace_v2(*blas.handle(), memory.as_ptr().cast(), WORKSPACE_BYTES)
    };
    status
        .result()
        .map_err(|e| format!("cublasSetWorkspace: {e}"))
}

#[cfg(test)]
mod tests {
    use super::matrix_form;

    #[test]
    fn matrix_forms_name_row_and_column_major_and_refuse_the_rest() {
        assert_eq!(matrix_form(3, 4, 4, 1), Some((false, 4))); // row-major
        assert_eq!(matrix_form(3, 4, 8, 1), Some((false, 8))); // rows of a wider block
        assert_eq!(matrix_form(3, 4, 1, 3), Some((true, 3))); // a transposed view
        assert_eq!(matrix_form(1, 4, 0, 1), Some((false, 4))); // one row: its stride is irrelevant
        assert_eq!(matrix_form(3, 1, 1, 0), Some((false, 1))); // one column
        assert_eq!(matrix_form(3, 4, 4, 2), None); // every other column
        assert_eq!(matrix_form(3, 4, 2, 1), None); // overlapping rows
    }
}
