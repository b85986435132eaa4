//! Products with frozen block-quantized matrices: a quantized `Linear`'s `x Wᵀ`, differentiable in
//! `x` so that trainable layers can sit under quantized ones (the quantized weight itself has no
//! gradient: its blocks are not parameters).

use smallvec::smallvec;

use super::Var;
use crate::error::Result;
use crate::tensor::QuantTensor;

impl<'t, 's> Var<'t, 's> {
    /// `self Wᵀ` for the quantized matrix `w` `[n, k]`, as [`Tensor::matmul_quantized_t`]
    /// computes it. The gradient reaching `self` is `g W` with `W` decoded (exactly: the blocks'
    /// values), in `g`'s dtype; `w` is a constant.
    ///
    /// [`Tensor::matmul_quantized_t`]: crate::Tensor::matmul_quantized_t
    ///
    /// # Errors
    /// As for [`Tensor::matmul_quantized_t`](crate::Tensor::matmul_quantized_t).
    #[track_caller]
    pub fn matmul_quantized_t(&self, w: &QuantTensor<'s>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.matmul_quantized_t(w)?;
        let w = w.clone();
        Var::record(&[self], "matmul_quantized_t", out, move |g, _| {
            // Decoded in a child scope would not outlive it; the decoded matrix is a temporary of
            // the backward pass, dropped when this closure returns.
            let [n, k] = w.shape();
            let rows = g.numel() / n;
            let decoded = w.dequantize(g.dtype())?;
            let gx = g.reshape(&[rows, n])?.matmul(&decoded)?;
            let mut shape = g.shape().to_vec();
            *shape.last_mut().expect("the product has rank >= 1") = k;
            Ok(smallvec![Some(gx.reshape(&shape)?)])
        })
    }
}

impl<'s> super::Tape<'s> {
    /// Rows `ids` (`i64`, 1-D) of the quantized table, decoded to `dtype`, as a constant: a frozen
    /// quantized embedding's lookup (see [`QuantTensor::index_select`]).
    #[track_caller]
    pub(crate) fn quantized_rows<'t>(
        &'t self,
        table: &QuantTensor<'s>,
        ids: &crate::tensor::Tensor<'s>,
        dtype: crate::dtype::DType,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.scope.place_results();
        Ok(self.constant(&table.index_select(ids, dtype)?))
    }
}
