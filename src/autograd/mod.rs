//! Reverse-mode automatic differentiation whose tape lives in a batch scope.
//!
//! A [`Tape<'s>`] records the ops applied to its [`Var`]s; every value and every saved tensor it
//! holds is branded `'s`, the batch scope's lifetime, so neither the tape nor the [`Gradients`] that
//! [`Tape::backward`] returns can outlive the batch: the borrow checker refuses a program that keeps
//! them. Parameters stay in an outer (model) scope; [`Tape::param`] only watches them.
//!
//! ```
//! use ndscope::{Device, Tape, root};
//!
//! root(Device::Cpu, |model| {
//!     let w = model.from_slice(&[2.0f32, -1.0], &[2])?;
//!     let grad = model.scope(|batch| {
//!         let tape = Tape::new(batch);
//!         let x = tape.constant(&batch.from_slice(&[3.0f32, 4.0], &[2])?);
//!         let loss = tape.param(&w).mul(&x)?.sum_all()?; // w . x
//!         let grads = tape.backward(&loss)?;
//!         grads.get(&w).expect("w was watched").to_vec::<f32>() // d(w . x)/dw = x
//!     })?;
//!     assert_eq!(grad, vec![3.0, 4.0]);
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # Ok::<(), ndscope::Error>(())
//! ```

mod attention;
mod autocast;
mod conv;
mod loss;
mod norm;
mod ops;
mod quantized;
mod recompute;
mod reduce_to;

use std::cell::{Cell, RefCell};
use std::fmt;

use smallvec::SmallVec;

pub use loss::{CrossEntropy, Reduction};
pub use recompute::Segment;

use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::scope::Scope;
use crate::scope::node::Placement;
use crate::tensor::Tensor;

/// The gradients of one op's inputs, in input order; `None` for inputs that need none.
type InputGrads<'s> = SmallVec<[Option<Tensor<'s>>; 2]>;

/// Computes an op's input gradients from its output gradient; `needs[i]` says whether input `i` wants
/// one (a constant input does not, and its gradient is never computed).
type BackwardFn<'s> = Box<dyn FnOnce(&Tensor<'s>, &[bool]) -> Result<InputGrads<'s>> + 's>;

/// One recorded value that needs a gradient.
struct Node<'s> {
    /// The node of each input, or `None` for inputs that need no gradient.
    inputs: SmallVec<[Option<usize>; 2]>,
    /// How to push the gradient to the inputs; `None` for a leaf, and taken once the backward pass
    /// has used it.
    backward: Option<BackwardFn<'s>>,
    /// What a leaf stands for; `None` for an op.
    leaf: Option<Leaf>,
}

/// A node whose gradient the backward pass hands out rather than pushes further.
enum Leaf {
    /// A watched parameter.
    Param(ParamKey),
    /// The input of a checkpointed segment being recomputed (its gradient goes to the outer tape).
    Input,
}

/// What a tape records.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Recording {
    /// Every op on a value that depends on a watched parameter (training).
    All,
    /// Nothing: parameters are constants (inference).
    Nothing,
    /// Nothing, but the parameters watched are listed: the first pass of a checkpointed segment,
    /// whose parameters the outer tape must know.
    Watches,
}

/// A watched parameter: its storage block, and the layout through which the tape watched it (the
/// whole block, or a view of it such as `w.t()` or a slice). Gradients are kept per block, so every
/// view of one parameter adds into the same gradient (a head tied to an embedding).
#[derive(Clone, PartialEq)]
struct ParamKey {
    block: usize,
    block_numel: usize,
    view: Layout,
}

impl ParamKey {
    fn of(t: &Tensor<'_>) -> ParamKey {
        ParamKey {
            block: t.block_id(),
            block_numel: t.block_numel(),
            view: t.layout().clone(),
        }
    }
}

/// The record of the ops of one forward pass, branded with the scope `'s` it lives in.
///
/// Create one per batch with [`Tape::new`], wrap the batch's inputs with [`constant`](Self::constant)
/// and the model's parameters with [`param`](Self::param), compute with [`Var`]'s ops, and call
/// [`backward`](Self::backward) on the loss.
///
/// Every result of a [`Var`] op, and every gradient, is placed in the tape's scope, whatever scope
/// its operands come from: the step's activations belong to the step even if its inputs were created
/// in the model scope. Still, a step's inputs belong in the step's scope (`batch.from_slice(..)`):
/// made in the model scope while the step runs, they are allocations there, which the model scope's
/// [`stats`](Scope::stats) count (`outer_allocations`) and its [`dump`](Scope::dump) shows, and which
/// a strict model scope ([`Scope::set_strict`]) refuses with
/// [`Error::OuterAllocation`]: `scope "model" is strict and refuses a new f32 tensor of shape
/// [32, 784] (made at src/main.rs:40:27) while its child scope "batch" is open: …`. Tensor ops
/// outside a tape keep the general rule (the innermost owner of the operands).
pub struct Tape<'s> {
    scope: &'s Scope<'s>,
    nodes: RefCell<Vec<Node<'s>>>,
    backward_done: Cell<bool>,
    recording: Recording,
    /// The parameters watched, in order, by a [`Recording::Watches`] tape.
    watched: RefCell<Vec<ParamKey>>,
}

impl fmt::Debug for Tape<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tape")
            .field("scope", &self.scope.name())
            .field("nodes", &self.nodes.borrow().len())
            .finish()
    }
}

/// A tensor recorded on a tape: its value, and (when it depends on a watched parameter) the node that
/// lets [`Tape::backward`] reach it. `'t` borrows the tape, `'s` is the tape's scope.
pub struct Var<'t, 's> {
    tape: &'t Tape<'s>,
    node: Option<usize>,
    value: Tensor<'s>,
}

impl Clone for Var<'_, '_> {
    fn clone(&self) -> Self {
        Var {
            tape: self.tape,
            node: self.node,
            value: self.value.clone(),
        }
    }
}

impl fmt::Debug for Var<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Var")
            .field("requires_grad", &self.requires_grad())
            .field("value", &self.value)
            .finish()
    }
}

impl<'s> Tape<'s> {
    /// An empty tape whose saved tensors and gradients belong to `scope` (the batch scope).
    pub fn new(scope: &'s Scope<'s>) -> Tape<'s> {
        Tape {
            scope,
            nodes: RefCell::new(Vec::new()),
            backward_done: Cell::new(false),
            recording: Recording::All,
            watched: RefCell::new(Vec::new()),
        }
    }

    /// A tape for inference (evaluation): [`param`](Self::param) returns constants, nothing is
    /// recorded and no tensor is kept for a backward pass, which it cannot run.
    pub fn no_grad(scope: &'s Scope<'s>) -> Tape<'s> {
        Tape {
            recording: Recording::Nothing,
            ..Tape::new(scope)
        }
    }

    /// A tape that records nothing but lists the parameters watched on it.
    fn watching(scope: &'s Scope<'s>) -> Tape<'s> {
        Tape {
            recording: Recording::Watches,
            ..Tape::new(scope)
        }
    }

    /// The scope the tape's tensors belong to.
    pub fn scope(&self) -> &'s Scope<'s> {
        self.scope
    }

    /// A value that needs no gradient (the batch's inputs and labels).
    pub fn constant<'t>(&'t self, value: &Tensor<'s>) -> Var<'t, 's> {
        Var {
            tape: self,
            node: None,
            value: value.clone(),
        }
    }

    /// Watches a parameter (usually a model-scope tensor): [`backward`](Self::backward) returns its
    /// gradient, which [`Gradients::get`] finds by the parameter itself. Watching the same parameter
    /// twice sums both uses' gradients.
    pub fn param<'t>(&'t self, value: &Tensor<'s>) -> Var<'t, 's> {
        match self.recording {
            Recording::All => self.leaf(value, Leaf::Param(ParamKey::of(value))),
            Recording::Nothing => self.constant(value),
            Recording::Watches => {
                self.watched.borrow_mut().push(ParamKey::of(value));
                self.constant(value)
            }
        }
    }

    /// A variable for `value` that the backward pass treats as `leaf`.
    fn leaf<'t>(&'t self, value: &Tensor<'s>, leaf: Leaf) -> Var<'t, 's> {
        let node = self.push_leaf(leaf);
        Var {
            tape: self,
            node: Some(node),
            value: value.clone(),
        }
    }

    fn push_leaf(&self, leaf: Leaf) -> usize {
        self.push(Node {
            inputs: SmallVec::new(),
            backward: None,
            leaf: Some(leaf),
        })
    }

    /// Number of recorded nodes (watched parameters and ops that depend on them).
    pub fn len(&self) -> usize {
        self.nodes.borrow().len()
    }

    /// Whether nothing has been recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn push(&self, node: Node<'s>) -> usize {
        let mut nodes = self.nodes.borrow_mut();
        nodes.push(node);
        nodes.len() - 1
    }

    /// Computes the gradient of `loss` (a single-element tensor) with respect to every watched
    /// parameter it depends on. The tape's saved tensors are released as the pass goes; a tape runs
    /// backward once.
    ///
    /// # Errors
    /// [`Error::Autograd`] when `loss` has more than one element, comes from another tape, depends on
    /// no watched parameter, or the tape already ran backward; any op error from the derivatives.
    pub fn backward(&self, loss: &Var<'_, 's>) -> Result<Gradients<'s>> {
        const OP: &str = "backward";
        if !std::ptr::eq(loss.tape, self) {
            return Err(Error::Autograd {
                op: OP,
                reason:
                    "the loss was recorded on another tape; call backward on the tape that made it"
                        .into(),
            });
        }
        if self.recording != Recording::All {
            return Err(Error::Autograd {
                op: OP,
                reason: "a `Tape::no_grad` tape records nothing to differentiate; use `Tape::new` for training".into(),
            });
        }
        if loss.value.numel() != 1 {
            return Err(Error::Autograd {
                op: OP,
                reason: format!(
                    "the loss must hold one element, not shape {:?}; reduce it first with `.mean_all()` or `.sum_all()`",
                    loss.value.shape()
                ),
            });
        }
        let Some(root) = loss.node else {
            return Err(Error::Autograd {
                op: OP,
                reason: "the loss depends on no watched parameter; wrap parameters with `tape.param(..)`".into(),
            });
        };
        if self.backward_done.replace(true) {
            return Err(Error::Autograd {
                op: OP,
                reason: "this tape already ran backward and released what it saved; record the forward pass on a new tape".into(),
            });
        }
        let seed = self
            .scope
            .full_dtype(loss.value.shape(), 1.0, loss.value.dtype())?;
        let mut found = Gradients {
            entries: Vec::new(),
        };
        self.propagate(root, seed, |_, leaf, grad| match leaf {
            Leaf::Param(key) => found.accumulate(key, &grad),
            Leaf::Input => Ok(()),
        })?;
        Ok(found)
    }

    /// Pushes `seed`, the gradient of node `root`, back through the tape, handing each leaf's
    /// gradient to `on_leaf` with the leaf's node index, and releases what the tape saved. Results are
    /// placed in the tape's scope (the derivatives are library code whose tensors are all the tape's).
    fn propagate(
        &self,
        root: usize,
        seed: Tensor<'s>,
        mut on_leaf: impl FnMut(usize, &Leaf, Tensor<'s>) -> Result<()>,
    ) -> Result<()> {
        let _placed = self.scope.place_results();
        let mut nodes = self.nodes.borrow_mut();
        let mut grads: Vec<Option<Tensor<'s>>> = Vec::new();
        grads.resize_with(root + 1, || None);
        grads[root] = Some(seed);
        for id in (0..=root).rev() {
            let Some(grad) = grads[id].take() else {
                continue;
            };
            let node = &mut nodes[id];
            if let Some(leaf) = &node.leaf {
                on_leaf(id, leaf, grad)?;
                continue;
            }
            let backward = node
                .backward
                .take()
                .expect("a node that is not a leaf has a derivative until the one backward pass");
            let needs: SmallVec<[bool; 2]> = node.inputs.iter().map(Option::is_some).collect();
            let input_grads = backward(&grad, &needs)?;
            for (input, g) in node.inputs.iter().zip(input_grads) {
                if let (Some(input), Some(g)) = (input, g) {
                    accumulate(&mut grads[*input], g)?;
                }
            }
        }
        // Release what the unreached part of the tape saved, too.
        nodes.iter_mut().for_each(|n| n.backward = None);
        Ok(())
    }
}

/// Adds `g` to the gradient gathered so far in `slot`.
fn accumulate<'s>(slot: &mut Option<Tensor<'s>>, g: Tensor<'s>) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(mut sum) => {
            sum.add_(&g)?;
            sum
        }
    });
    Ok(())
}

/// The gradients of one backward pass, found by parameter. They live in the tape's scope.
///
/// A gradient belongs to a parameter's storage, not to one handle of it: a parameter watched
/// through views (`tape.param(&w.t()?)`, a slice, a reshape) as well as directly gets one gradient,
/// the sum of every use, and [`get`](Self::get) returns it through whichever view asks.
pub struct Gradients<'s> {
    /// Per watched block, the gradient of its elements: shaped as the parameter while only the whole
    /// block was watched (as the backward pass made it, strides and all), contiguous in block order
    /// once a view of it was.
    entries: Vec<(usize, Tensor<'s>)>,
}

impl fmt::Debug for Gradients<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|(_, g)| g.numel()))
            .finish()
    }
}

impl<'s> Gradients<'s> {
    /// Adds the gradient `g` of the leaf `key` (shaped as the view it watched) into its block's.
    /// A block watched only whole keeps its gradient as the backward pass made it (no copy); the
    /// first view of a block turns its gradient into block order, where every view can add to it.
    fn accumulate(&mut self, key: &ParamKey, g: &Tensor<'s>) -> Result<()> {
        let whole = key.view.is_whole(key.block_numel);
        let Some(at) = self.entries.iter().position(|(b, _)| *b == key.block) else {
            let g = if whole {
                g.clone()
            } else {
                g.scatter_into_block(&key.view, key.block_numel)?
            };
            self.entries.push((key.block, g));
            return Ok(());
        };
        let sum = &mut self.entries[at].1;
        if whole && sum.shape() == g.shape() {
            return sum.add_(g);
        }
        let mut flat = sum.scatter_into_block(&Layout::contiguous(sum.shape()), key.block_numel)?;
        flat.add_(&g.scatter_into_block(&key.view, key.block_numel)?)?;
        *sum = flat;
        Ok(())
    }

    /// Zero gradients for `params`, allocated in `scope` (gradient sums that outlive one batch).
    #[track_caller]
    pub(crate) fn zeros_for<'p>(
        scope: &Scope<'s>,
        params: impl IntoIterator<Item = &'p Tensor<'p>>,
    ) -> Result<Gradients<'s>> {
        let mut entries: Vec<(usize, Tensor<'s>)> = Vec::new();
        for p in params {
            if entries.iter().any(|(b, _)| *b == p.block_id()) {
                continue; // two views of one parameter share its gradient
            }
            // In the parameter's shape when it is its block's own tensor (as a backward pass makes
            // them), in block order otherwise.
            let shape = if p.layout().is_whole(p.block_numel()) {
                p.shape().to_vec()
            } else {
                vec![p.block_numel()]
            };
            let zeros = scope.full_dtype(&shape, 0.0, p.dtype())?.named("grad sum");
            entries.push((p.block_id(), zeros));
        }
        Ok(Gradients { entries })
    }

    /// Adds `other` into these gradients in place; `other` may hold only parameters these hold.
    pub(crate) fn add_in_place(&mut self, op: &'static str, other: &Gradients<'_>) -> Result<()> {
        if let Some((_, g)) = other
            .entries
            .iter()
            .find(|(b, _)| !self.entries.iter().any(|(mine, _)| mine == b))
        {
            return Err(Error::InvalidShape {
                op,
                shape: g.shape().to_vec(),
                reason: "the gradients hold a parameter the accumulator was not created for; \
                         accumulate the gradients of the model it was created with"
                    .into(),
            });
        }
        for (block, g) in &other.entries {
            if let Some((_, sum)) = self.entries.iter_mut().find(|(b, _)| b == block) {
                // Both hold the block's elements in block order; only their shapes may differ.
                if sum.shape() == g.shape() {
                    sum.add_(g)?;
                } else {
                    sum.add_(&g.reshape(sum.shape())?)?;
                }
            }
        }
        Ok(())
    }

    /// Multiplies every gradient by `factor` in place.
    pub(crate) fn scale_in_place(&mut self, factor: f64) -> Result<()> {
        self.entries
            .iter_mut()
            .try_for_each(|(_, g)| g.mul_scalar_(factor))
    }

    /// Sets every gradient to zero in place (a NaN sum too).
    pub(crate) fn zero_in_place(&mut self) -> Result<()> {
        self.entries.iter_mut().try_for_each(|(_, g)| g.fill_(0.0))
    }

    /// The gradient of `param`, shaped as `param`, or `None` when the loss does not depend on it (or
    /// it was not watched). `param` may be any view of a watched parameter's storage: the result is
    /// the same view of the storage's gradient, which sums every watched use (a tied head and its
    /// embedding). The result is a cheap alias of the gradient, except for a view of a parameter
    /// that the tape watched only whole, which is copied into block order first (`None` if that
    /// copy cannot be allocated).
    pub fn get(&self, param: &Tensor<'_>) -> Option<Tensor<'s>> {
        let (_, g) = self.entries.iter().find(|(b, _)| *b == param.block_id())?;
        let view = param.layout();
        if view.is_whole(g.numel()) && g.shape() == view.shape() {
            return Some(g.clone());
        }
        // Another view of the block: read it from the gradient in block order. A gradient that was
        // only ever watched whole is in the order the backward pass made it; only a view of a
        // parameter that was watched whole but is read through another view pays this copy.
        let ordered = if g.is_contiguous() {
            g.clone()
        } else {
            g.contiguous().ok()?
        };
        let layout = Layout::from_parts(
            view.shape(),
            view.strides(),
            view.offset() + ordered.layout().offset(),
        );
        Some(ordered.with_layout(layout))
    }

    /// The gradient of `param`'s whole block as the backward pass keeps it (shaped as the
    /// parameter, or flat in block order once a view of it was watched), for code that rewrites
    /// gradients in place: data-parallel averaging.
    pub(crate) fn block_gradient_mut(&mut self, param: &Tensor<'_>) -> Option<&mut Tensor<'s>> {
        let block = param.block_id();
        self.entries
            .iter_mut()
            .find(|(b, _)| *b == block)
            .map(|(_, g)| g)
    }

    /// Number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no parameter got a gradient.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The gradients, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Tensor<'s>> {
        self.entries.iter().map(|(_, g)| g)
    }

    /// Whether every gradient is finite (no inf or NaN). One host read for all of them: each
    /// gradient adds `sum(g * 0)` — 0 when finite, NaN otherwise — to one scalar on its device.
    ///
    /// # Errors
    /// Only allocation errors.
    pub fn all_finite(&self) -> Result<bool> {
        let mut total: Option<Tensor<'s>> = None;
        for g in self.iter() {
            let z = g.mul_scalar(0.0)?.sum_all()?.to_dtype(crate::DType::F32)?;
            total = Some(match total {
                None => z,
                Some(t) => t.add(&z)?,
            });
        }
        match total {
            None => Ok(true),
            Some(t) => Ok(t.to_scalar::<f32>()?.is_finite()),
        }
    }

    /// The L2 norm of all gradients together.
    ///
    /// # Errors
    /// Only allocation errors.
    pub fn global_norm(&self) -> Result<f64> {
        let mut total = 0.0;
        for g in self.iter() {
            total += g
                .square()?
                .sum_all()?
                .to_dtype(crate::DType::F64)?
                .to_scalar::<f64>()?;
        }
        Ok(total.sqrt())
    }

    /// Scales every gradient so that their global norm is at most `max_norm`; returns the norm before
    /// clipping.
    ///
    /// # Errors
    /// Only allocation errors.
    pub fn clip_global_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.global_norm()?;
        if norm > max_norm && norm > 0.0 {
            let scale = max_norm / norm;
            for (_, g) in &mut self.entries {
                g.mul_scalar_(scale)?;
            }
        }
        Ok(norm)
    }
}

impl<'t, 's> Var<'t, 's> {
    /// The value.
    pub fn value(&self) -> &Tensor<'s> {
        &self.value
    }

    /// The value, leaving the tape's record of it in place.
    pub fn into_value(self) -> Tensor<'s> {
        self.value
    }

    /// The value's shape.
    pub fn shape(&self) -> &[usize] {
        self.value.shape()
    }

    /// Whether the value depends on a watched parameter (and so gets a gradient).
    pub fn requires_grad(&self) -> bool {
        self.node.is_some()
    }

    /// The tape this variable is recorded on.
    pub fn tape(&self) -> &'t Tape<'s> {
        self.tape
    }

    /// Places the results of the op being computed in the tape's scope (unless an operand's owner
    /// closes sooner) while the guard lives, whatever scope the operands come from: a step's
    /// activations belong to the step even when its inputs were created in the model scope.
    /// Every differentiable op takes it first thing; its results are all the tape's `Tensor<'s>`.
    fn placing(&self) -> Placement<'s> {
        self.tape.scope.place_results()
    }

    /// The same value, cut off from the tape: no gradient flows through it.
    pub fn detach(&self) -> Var<'t, 's> {
        self.tape.constant(&self.value)
    }

    /// Records `value`, computed from `inputs`, with the derivative `backward`. Nothing is recorded
    /// when no input needs a gradient.
    fn record(
        inputs: &[&Var<'t, 's>],
        op: &'static str,
        value: Tensor<'s>,
        backward: impl FnOnce(&Tensor<'s>, &[bool]) -> Result<InputGrads<'s>> + 's,
    ) -> Result<Var<'t, 's>> {
        let tape = inputs[0].tape;
        if inputs.iter().any(|v| !std::ptr::eq(v.tape, tape)) {
            return Err(Error::Autograd {
                op,
                reason: "the operands were recorded on different tapes; record a forward pass on one tape".into(),
            });
        }
        let ids: SmallVec<[Option<usize>; 2]> = inputs.iter().map(|v| v.node).collect();
        let node = if ids.iter().any(Option::is_some) {
            Some(tape.push(Node {
                inputs: ids,
                backward: Some(Box::new(backward)),
                leaf: None,
            }))
        } else {
            None
        };
        Ok(Var { tape, node, value })
    }
}
