//! Recomputation (what PyTorch calls activation checkpointing): a segment of the forward pass whose
//! intermediates are not kept for the backward pass but recomputed during it (Chen et al. 2016,
//! "Training deep nets with sublinear memory cost"; PyTorch's `torch.utils.checkpoint`, JAX's
//! `jax.checkpoint`). ndscope calls it recomputation: "checkpoint" names the files of
//! [`checkpoint`](crate::checkpoint).
//!
//! [`Var::recompute`] runs the segment in a child scope of the tape's scope, `"recompute"`, on a
//! tape that records nothing: the child closes when the segment returns, so everything the segment
//! made except its output is freed, and the outer tape records one node that saves only the input.
//! When the backward pass reaches that node it opens another child scope, `"recompute
//! (backward)"`, runs the segment again on a recording tape with the random generator and the
//! autocast setting of the first pass (dropout draws the same mask), pushes the output's gradient
//! through it, and moves the input's and the parameters' gradients out before that scope closes.
//! The recomputation runs the same kernels on the same values, so a recomputed step's loss and
//! gradients equal the plain step's bit for bit on the host.
//!
//! The segment is given by value (a [`Segment`]: any layer through `nn::Recomputed`), because the
//! backward pass runs it again after the forward pass has returned: a borrowed layer would have to
//! outlive the tape's scope, which a model that is a local of the enclosing closure does not. Layers
//! are cheap to clone (their tensors are counted handles).

use smallvec::SmallVec;

use super::{InputGrads, Leaf, Node, Recording, Tape, Var};
use crate::error::{Error, Result};
use crate::scope::node::Placement;
use crate::tensor::Tensor;

/// A part of a forward pass that can run more than once on the same input and compute the same
/// output: what [`Var::recompute`] recomputes during the backward pass. `'m` is the brand of the
/// parameters it reads.
///
/// Any `nn` layer is one through `nn::Recomputed`; implement it for a struct holding what a
/// custom segment needs (clones of layers, settings). The forward must be deterministic given the
/// input, the parameters and the scope tree's random generator (which the recomputation replays),
/// and must watch the same parameters each time.
pub trait Segment<'m> {
    /// Computes the segment's output from `x`, recorded on `x`'s tape.
    ///
    /// # Errors
    /// Whatever the segment's ops return.
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's;
}

impl<'t, 's> Var<'t, 's> {
    /// The former name of [`recompute`](Self::recompute).
    ///
    /// # Errors
    /// As for [`recompute`](Self::recompute).
    #[deprecated(note = "renamed `recompute`: \"checkpoint\" names checkpoint files")]
    pub fn checkpoint<'m, S>(&self, segment: S) -> Result<Var<'t, 's>>
    where
        S: Segment<'m> + 'm,
        'm: 's,
    {
        self.recompute(segment)
    }

    /// `segment` applied to `self`, recomputed: the segment's intermediates are freed when it
    /// returns and recomputed when the backward pass reaches it, so the tape keeps only the
    /// segment's input (and its output, as the next op's input). On a tape that records nothing
    /// (`Tape::no_grad`) it is the plain forward.
    ///
    /// Costs one more forward pass of the segment per backward pass. Random draws (dropout) replay
    /// identically, autocast and TF32 settings are those of the first pass, and the loss and every
    /// gradient equal the plain step's bit for bit on the host. Segments nest. A segment
    /// that updates state as it runs (batch norm's running statistics) would update it twice, which
    /// is why batch norm is no `Segment`.
    ///
    /// ```
    /// use ndscope::{Device, Tape, root};
    /// use ndscope::nn::{Recomputed, Init, Linear, Mode, Module};
    ///
    /// root(Device::Cpu, |model| {
    ///     let layer = Linear::new(model, 4, 4, Init::KaimingUniform)?;
    ///     model.scope(|batch| {
    ///         let tape = Tape::new(batch);
    ///         let x = tape.constant(&batch.rand(&[2, 4])?);
    ///         let y = Recomputed::new(layer.clone()).forward(&x, Mode::Train)?;
    ///         let grads = tape.backward(&y.tanh()?.sum_all()?)?;
    ///         assert!(grads.get(&layer.weight).is_some());
    ///         Ok::<_, ndscope::Error>(())
    ///     })
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// What the segment returns; [`Error::Autograd`] when the recomputation watches other
    /// parameters than the first pass did (a segment that is not deterministic).
    pub fn recompute<'m, S>(&self, segment: S) -> Result<Var<'t, 's>>
    where
        S: Segment<'m> + 'm,
        'm: 's,
    {
        let tape = self.tape;
        if tape.recording != Recording::All {
            // Inference, or the first pass of an enclosing segment: nothing is saved anyway.
            let _user = Placement::cleared();
            return segment.forward(self);
        }
        let scope = tape.scope;
        let random = scope.random_stream();
        let (autocast, tf32) = (scope.autocast_dtype(), scope.allows_tf32());
        let input = self.value.clone();
        let (output, watched) = scope.named_scope("recompute", |c| -> Result<_> {
            let pass = Tape::watching(c);
            let out = {
                let _user = Placement::cleared();
                segment.forward(&pass.constant(&input))?
            };
            let watched = pass.watched.take();
            Ok((c.ret(out.into_value())?, watched))
        })?;
        let mut inputs: SmallVec<[Option<usize>; 2]> = SmallVec::with_capacity(1 + watched.len());
        inputs.push(self.node);
        for key in &watched {
            inputs.push(Some(tape.push_leaf(Leaf::Param(key.clone()))));
        }
        let backward = move |g: &Tensor<'s>, needs: &[bool]| -> Result<InputGrads<'s>> {
            let now = scope.random_stream();
            scope.set_random_stream(random);
            let grads = scope.named_scope("recompute (backward)", |c| {
                match autocast {
                    Some(dtype) => c.autocast(dtype)?,
                    None => c.no_autocast(),
                }
                c.allow_tf32(tf32);
                let tape = Tape::new(c);
                let x = if needs[0] {
                    tape.leaf(&input, Leaf::Input)
                } else {
                    tape.constant(&input)
                };
                let out = {
                    let _user = Placement::cleared();
                    segment.forward(&x)?
                };
                let grads = tape.segment_gradients(&out, g, &watched)?;
                c.ret(grads)
            });
            scope.set_random_stream(now);
            let (input_grad, param_grads) = grads?;
            let mut all = InputGrads::with_capacity(1 + param_grads.len());
            all.push(input_grad);
            all.extend(param_grads);
            Ok(all)
        };
        Ok(Var {
            tape,
            node: Some(tape.push(Node {
                inputs,
                backward: Some(Box::new(backward)),
                leaf: None,
            })),
            value: output,
        })
    }
}

/// The gradient of a recomputed segment's input, and of each parameter it watched, in order.
type SegmentGradients<'s> = (Option<Tensor<'s>>, Vec<Option<Tensor<'s>>>);

impl<'s> Tape<'s> {
    /// Pushes `seed`, the gradient of a recomputed segment's output `out`, back through this tape
    /// (the recomputation's), after checking that it watched the parameters of the first pass,
    /// `watched`, in the same order.
    fn segment_gradients(
        &self,
        out: &Var<'_, 's>,
        seed: &Tensor<'s>,
        watched: &[super::ParamKey],
    ) -> Result<SegmentGradients<'s>> {
        let params: Vec<usize> = {
            let nodes = self.nodes.borrow();
            let leaves: Vec<(usize, &super::ParamKey)> = (nodes.iter().enumerate())
                .filter_map(|(i, n)| match &n.leaf {
                    Some(Leaf::Param(key)) => Some((i, key)),
                    _ => None,
                })
                .collect();
            if !leaves.iter().map(|&(_, key)| key).eq(watched) {
                return Err(Error::Autograd {
                    op: "recompute",
                    reason: format!(
                        "the segment watched {} parameter uses when recomputed for the backward pass \
                         but {} in the forward pass, or others; a recomputed segment must run the \
                         same ops on the same parameters each time",
                        leaves.len(),
                        watched.len()
                    ),
                });
            }
            leaves.iter().map(|&(i, _)| i).collect()
        };
        let mut input_grad = None;
        let mut param_grads: Vec<Option<Tensor<'s>>> = vec![None; params.len()];
        let Some(root) = out.node else {
            return Ok((input_grad, param_grads)); // the output depends on nothing that needs one
        };
        self.propagate(root, seed.clone(), |id, leaf, grad| {
            match leaf {
                Leaf::Input => input_grad = Some(grad),
                Leaf::Param(_) => {
                    let ordinal = params
                        .binary_search(&id)
                        .expect("every parameter leaf of the tape is listed");
                    param_grads[ordinal] = Some(grad);
                }
            }
            Ok(())
        })?;
        Ok((input_grad, param_grads))
    }
}
