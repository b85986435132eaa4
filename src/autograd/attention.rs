//! Fused attention on the tape: the forward pass keeps only its output and each query's log-sum
//! (`O(queries)` per head beside the operands), and the backward pass recomputes the weights from them.

use smallvec::smallvec;

use super::Var;
use crate::error::Result;
use crate::ops::AttentionSpec;
use crate::tensor::Tensor;

impl<'t, 's> Var<'t, 's> {
    /// Fused scaled dot-product attention of these queries over `k` and `v`: [`Tensor::attention`]
    /// on the tape. No `[queries, keys]` tensor is kept for the backward pass: it recomputes the
    /// weights tile by tile from the output and each query's log-sum, so attention's saved state is
    /// `O(queries)` per head. Under autocast the operands are computed in the autocast dtype (with
    /// `f32` accumulation), as products are.
    ///
    /// ```
    /// use ndscope::{AttentionSpec, Device, Tape, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let tape = Tape::new(s);
    ///     let w = s.randn(&[1, 2, 6, 4])?; // batch 1, 2 heads, 6 positions, width 4
    ///     let x = tape.param(&w);
    ///     let y = x.attention(&x, &x, AttentionSpec::CAUSAL, None)?;
    ///     let grads = tape.backward(&y.sum_all()?)?;
    ///     assert_eq!(grads.get(&w).unwrap().shape(), &[1, 2, 6, 4]);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`Tensor::attention`].
    #[track_caller]
    pub fn attention(
        &self,
        k: &Var<'t, 's>,
        v: &Var<'t, 's>,
        spec: AttentionSpec,
        key_lengths: Option<&Tensor<'s>>,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([q, k, v]) = Var::autocast_operands([self, k, v])? {
            return q.attention(&k, &v, spec, key_lengths);
        }
        let (out, lse) = self
            .value
            .attention_with_lse(&k.value, &v.value, spec, key_lengths)?;
        let saved = (
            self.value.clone(),
            k.value.clone(),
            v.value.clone(),
            out.clone(),
            key_lengths.cloned(),
        );
        Var::record(&[self, k, v], "attention", out, move |g, _| {
            let (q, k, v, out, key_lengths) = saved;
            let [dq, dk, dv] =
                q.attention_backward(&k, &v, &out, &lse, g, spec, key_lengths.as_ref())?;
            Ok(smallvec![Some(dq), Some(dk), Some(dv)])
        })
    }
}
