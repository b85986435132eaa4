//! Cross-entropy: logits `[..., classes]` against integer labels `[...]`, with PyTorch's
//! `ignore_index`, reductions and label smoothing, fused with its log-softmax.

use smallvec::smallvec;

use super::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How a loss turns its per-element values into its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// The mean over the elements that count (for cross-entropy: the labels not ignored).
    #[default]
    Mean,
    /// The sum over the elements.
    Sum,
    /// No reduction: one value per element (per label).
    None,
}

/// Options of [`Var::cross_entropy_with`]. The default is the plain mean over every label.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CrossEntropy {
    /// Labels equal to this value add nothing to the loss or the gradient, and are not counted by
    /// the mean (Hugging Face pads labels with `-100`). `None`: every label must be a class.
    pub ignore_index: Option<i64>,
    /// How the per-label losses are reduced.
    pub reduction: Reduction,
    /// `ε` in `[0, 1]`: the target puts `1 - ε` on the label and spreads `ε` evenly over all classes
    /// (Szegedy et al., 2016; PyTorch's `label_smoothing`).
    pub label_smoothing: f64,
}

impl CrossEntropy {
    /// Hugging Face's convention: labels of `-100` are ignored, the mean is over the rest.
    pub fn ignoring(index: i64) -> CrossEntropy {
        CrossEntropy {
            ignore_index: Some(index),
            ..CrossEntropy::default()
        }
    }
}

impl<'t, 's> Var<'t, 's> {
    /// Mean cross-entropy of `self` (logits, `[..., classes]`) against integer `labels` (`[...]`,
    /// `i64`, one class per row of logits): [`cross_entropy_with`](Self::cross_entropy_with) with
    /// the default options.
    ///
    /// # Errors
    /// As for [`cross_entropy_with`](Self::cross_entropy_with).
    #[track_caller]
    pub fn cross_entropy(&self, labels: &Tensor<'s>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        self.cross_entropy_with(labels, CrossEntropy::default())
    }

    /// Cross-entropy of `self` (logits, `[..., classes]`) against integer `labels` (`[...]`, `i64`):
    /// per row, `-(1 - ε) log p[label] - ε mean_c log p[c]` with `p = softmax(row)`, zero for an
    /// ignored label, then reduced as `options.reduction` says ([`Reduction::None`] gives the
    /// labels' shape). The mean of a batch whose labels are all ignored is NaN (0 / 0, as PyTorch).
    /// Fused with its log-softmax: each row's log-sum-exp is computed in one pass over the logits
    /// and only it (`[rows]`) is kept for the backward pass, which writes the derivative
    /// `(p - (1 - ε) one_hot - ε / classes) · weight` straight from the logits. Everything per row is
    /// computed in the compute type, so the loss of 16-bit logits is `f32` (as under autocast) and
    /// no 16-bit intermediate rounds or overflows.
    ///
    /// ```
    /// use ndscope::nn::{CrossEntropy, Reduction};
    /// use ndscope::{Device, Tape, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let tape = Tape::no_grad(s);
    ///     let logits = tape.constant(&s.zeros(&[2, 3, 4])?); // batch 2, 3 positions, 4 classes
    ///     let labels = s.from_slice(&[1i64, -100, 3, 0, -100, -100], &[2, 3])?;
    ///     let per_label = logits.cross_entropy_with(
    ///         &labels,
    ///         CrossEntropy { reduction: Reduction::None, ..CrossEntropy::ignoring(-100) },
    ///     )?;
    ///     assert_eq!(per_label.shape(), &[2, 3]);
    ///     let ln4 = 4f32.ln();
    ///     assert_eq!(per_label.value().to_vec::<f32>()?, vec![ln4, 0.0, ln4, ln4, 0.0, 0.0]);
    ///     let mean = logits.cross_entropy_with(&labels, CrossEntropy::ignoring(-100))?;
    ///     assert!((mean.value().to_scalar::<f32>()? - ln4).abs() < 1e-6); // over 3 labels
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless the labels' shape is the logits' without the last dimension,
    /// or for `label_smoothing` outside `[0, 1]`; [`Error::UnsupportedDType`] for non-`i64` labels
    /// or integer logits; [`Error::IndexOutOfRange`] for a label outside `0..classes` that is not
    /// ignored.
    #[track_caller]
    pub fn cross_entropy_with(
        &self,
        labels: &Tensor<'s>,
        options: CrossEntropy,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        const OP: &str = "cross_entropy";
        let logits = &self.value;
        let Some((&classes, rows_shape)) = logits.shape().split_last() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: Vec::new(),
                reason: "needs logits of shape [..., classes]; got a scalar".into(),
            });
        };
        if labels.shape() != rows_shape {
            return Err(Error::InvalidShape {
                op: OP,
                shape: logits.shape().to_vec(),
                reason: format!(
                    "needs labels of shape {rows_shape:?} (the logits' shape without the classes) \
                     for logits of shape {:?}, got labels of shape {:?}",
                    logits.shape(),
                    labels.shape()
                ),
            });
        }
        if labels.dtype() != DType::I64 || !logits.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: if labels.dtype() != DType::I64 {
                    labels.dtype()
                } else {
                    logits.dtype()
                },
                expected: "float logits and i64 labels",
            });
        }
        let eps = options.label_smoothing;
        if !(0.0..=1.0).contains(&eps) {
            return Err(Error::InvalidShape {
                op: OP,
                shape: logits.shape().to_vec(),
                reason: format!("label_smoothing must be in [0, 1], got {eps}"),
            });
        }
        let rows: usize = rows_shape.iter().product();
        let x = logits.reshape(&[rows, classes])?;
        let labels = labels.reshape(&[rows])?;
        let scope = self.tape().scope();
        // Per-row values are computed in the compute type (f32 for 16-bit logits, rounded nowhere):
        // the logits are read in place, and no [rows, classes] tensor is made or kept.
        let lse = x.row_logsumexp()?;
        let compute = lse.dtype();
        // Ignored labels read class 0 and are weighted by 0.
        let (labels, kept) = match options.ignore_index {
            None => (labels, None),
            Some(ignored) => {
                let ignored = scope.full_dtype(&[], ignored as f64, DType::I64)?;
                let kept = labels.ne(&ignored)?;
                let safe = Tensor::where_cond(&kept, &labels, &ignored.mul_scalar(0.0)?)?;
                (safe, Some(kept.to_dtype(compute)?))
            }
        };
        // Each row's log-likelihood of its target, x[label] - lse; the loss is its negated
        // reduction.
        let target = x.gather(1, &labels.unsqueeze(-1)?)?.reshape(&[rows])?;
        let mut per_row = target.to_dtype(compute)?.sub(&lse)?;
        if eps > 0.0 {
            // The mean log-probability of the row, mean(x) - lse (a 16-bit row is averaged in the
            // compute type, through a transient copy).
            let mean = if x.dtype() == compute {
                x.mean(&[-1], false)?
            } else {
                x.to_dtype(compute)?.mean(&[-1], false)?
            };
            per_row = per_row
                .mul_scalar(1.0 - eps)?
                .add(&mean.sub(&lse)?.mul_scalar(eps)?)?;
        }
        if let Some(kept) = &kept {
            per_row = per_row.mul(kept)?;
        }
        // What the mean divides by: the labels that count.
        let count = match &kept {
            Some(kept) => Some(kept.sum_all()?),
            None => None,
        };
        let out = match (options.reduction, &count) {
            (Reduction::None, _) => per_row.neg()?.reshape(rows_shape)?,
            (Reduction::Sum, _) => per_row.sum_all()?.neg()?,
            (Reduction::Mean, Some(count)) => per_row.sum_all()?.div(count)?.neg()?,
            (Reduction::Mean, None) => per_row.mean_all()?.neg()?,
        };
        let (reduction, shape) = (options.reduction, logits.shape().to_vec());
        Var::record(&[self], OP, out, move |g, _| {
            // d loss / d row's term, one per row, kept on the device: no host read per step.
            let g = g.to_dtype(compute)?;
            let weight = match (reduction, &count) {
                (Reduction::None, _) => g.reshape(&[rows])?,
                (Reduction::Sum, _) => g.broadcast_to(&[rows])?,
                (Reduction::Mean, Some(count)) => g.div(count)?.broadcast_to(&[rows])?,
                (Reduction::Mean, None) => g
                    .mul_scalar(1.0 / rows.max(1) as f64)?
                    .broadcast_to(&[rows])?,
            };
            let weight = match &kept {
                Some(kept) => weight.mul(kept)?,
                None => weight,
            };
            let grad = x.cross_entropy_grad(&lse, &labels, &weight, eps)?;
            Ok(smallvec![Some(grad.reshape(&shape)?)])
        })
    }
}
