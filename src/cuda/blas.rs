//! Matrix products through cuBLAS's strided batched GEMM. cuBLAS is column-major; a row-major
//! product `C = A B` is computed as `Cᵀ = Bᵀ Aᵀ`, which reads ndscope's row-major (or transposed)
//! operands in place: only operands whose matrices are neither row- nor column-major, or whose batch
//! dimensions are not one uniform stride, are packed first.

use cudarc::cublas::{result, sys};

use crate::cuda::{cuda_error, gpu_of};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Shape;
use crate::ops::op_code::Unary;
use crate::tensor::Tensor;

/// How one operand reaches cuBLAS: its address, whether its matrices are stored transposed
/// (column-major), the leading dimension, and the stride between batch matrices.
struct Operand<'a> {
    /// Keeps a packed copy alive until the product is queued.
    tensor: Tensor<'a>,
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

/// Prepares `t` (`[.., r, c]`) for a product whose batch shape is `batch`.
fn operand<'a>(t: &Tensor<'a>, batch: &[usize]) -> Result<Operand<'a>> {
    let rank = t.rank();
    let (r, c) = (t.shape()[rank - 2], t.shape()[rank - 1]);
    let batched = t.shape()[..rank - 2].iter().product::<usize>() > 1;
    let (tensor, batch_stride) = if batched {
        // One matrix per batch index at a uniform stride: the contiguous `[batch.., r, c]` form.
        let mut full: Shape = batch.iter().copied().collect();
        full.extend_from_slice(&[r, c]);
        (t.broadcast_to(&full)?.contiguous()?, r * c)
    } else {
        (t.clone(), 0)
    };
    let rank = tensor.rank();
    let (rs, cs) = (tensor.strides()[rank - 2], tensor.strides()[rank - 1]);
    if let Some((transposed, ld)) = matrix_form(r, c, rs, cs) {
        return Ok(Operand {
            tensor,
            transposed,
            ld,
            batch_stride,
        });
    }
    Ok(Operand {
        tensor: tensor.contiguous()?,
        transposed: false,
        ld: c.max(1),
        batch_stride,
    })
}

fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidShape {
        op,
        shape: vec![v],
        reason: "cuBLAS takes dimensions, strides and batch counts below 2^31".into(),
    })
}

/// `out[b] = a[b] @ b[b]` for every batch index (`a`: `[.., m, k]`, `b`: `[.., k, n]`, batch
/// dimensions broadcasting to `batch`); `out` is a fresh contiguous `[batch.., m, n]` tensor.
pub(crate) fn matmul(
    a: &Tensor<'_>,
    b: &Tensor<'_>,
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
    out: &mut Tensor<'_>,
) -> Result<()> {
    const OP: &str = "matmul";
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return crate::cuda::ops::unary_in_place(out, Unary::Fill, [0.0, 0.0]);
    }
    let count: usize = batch.iter().product();
    if count == 0 {
        return Ok(());
    }
    let (oa, ob) = (operand(a, batch)?, operand(b, batch)?);
    let gpu = gpu_of(out.device())?;
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
    let (pa, pb, pc) = (
        ob.tensor.device_ptr(),
        oa.tensor.device_ptr(),
        out.device_ptr(),
    );
    let (ta, tb) = (op(ob.transposed), op(oa.transposed));
    gpu.bind()?;
    let status = match out.dtype() {
        DType::F32 => {
            let (alpha, beta) = (1.0f32, 0.0f32);
            // SAFETY: the three addresses are live GPU tensors of f32 on the handle's stream; for
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
        DType::F64 => {
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
        DType::I64 => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: DType::I64,
                expected: "a float dtype (f32 or f64)",
            });
        }
    };
    status.map_err(|e| cuda_error("cuBLAS gemm", e))
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
