//! Replayed steps: a training step that runs in a planned workspace and, on a GPU, is captured once
//! as a CUDA graph and replayed with one launch per step ([`StepGraph`] says how and what it
//! guarantees).

use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::backend::{self, Graph, bytes_of};
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::memory::arena::Workspace;
use crate::scope::{Child, Scope};
use crate::tensor::Tensor;

/// Eager cycles in a row that must replay their plan before a step is captured.
const STEADY_CYCLES_BEFORE_CAPTURE: u32 = 2;

/// One input of a step: host data and its shape, copied into the step's workspace on every call.
pub struct Input<'a> {
    data: Box<dyn InputData + 'a>,
    shape: &'a [usize],
}

impl<'a> Input<'a> {
    /// The elements `data` (row-major) of a tensor of shape `shape`.
    pub fn new<T: Element>(data: &'a [T], shape: &'a [usize]) -> Input<'a> {
        Input {
            data: Box::new(Elements(data)),
            shape,
        }
    }

    fn dtype(&self) -> DType {
        self.data.dtype()
    }
}

impl std::fmt::Debug for Input<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Input")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape)
            .finish()
    }
}

/// Host data of any element type, as an input becomes a tensor and bytes.
trait InputData {
    fn dtype(&self) -> DType;
    fn bytes(&self) -> &[u8];
    fn tensor<'c>(&self, scope: &Scope<'c>, shape: &[usize]) -> Result<Tensor<'c>>;
}

/// Elements of one type.
struct Elements<'a, T>(&'a [T]);

impl<T: Element> InputData for Elements<'_, T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn bytes(&self) -> &[u8] {
        bytes_of(self.0)
    }

    fn tensor<'c>(&self, scope: &Scope<'c>, shape: &[usize]) -> Result<Tensor<'c>> {
        scope.from_slice(self.0, shape)
    }
}

/// A step captured on a GPU: the graph, where its inputs and its loss live, and what it was
/// captured with.
struct Captured {
    graph: Graph,
    device: Device,
    /// Each input's planned slot, dtype and shape.
    inputs: Vec<(NonNull<u8>, DType, Vec<usize>)>,
    /// The planned slot of the `f32` loss.
    loss: NonNull<u8>,
}

impl Captured {
    fn matches(&self, device: Device, inputs: &[Input<'_>]) -> bool {
        self.device == device
            && self.inputs.len() == inputs.len()
            && self
                .inputs
                .iter()
                .zip(inputs)
                .all(|((_, dtype, shape), i)| *dtype == i.dtype() && shape == i.shape)
    }
}

/// A training step run in a planned workspace, and captured as a CUDA graph on a GPU.
///
/// A step of a training loop launches the same kernels on the same addresses every time once its
/// workspace replays a plan: the inputs land in the same slots, every temporary gets the offset the
/// plan gave it, and the parameters are updated in place. [`StepGraph`] uses that. It runs the step
/// eagerly in a [planned workspace](crate::Workspace::planned) until the plan replays steadily, then
/// (on a GPU) records one step's launches into a CUDA graph. Every later call copies the new inputs
/// into their planned slots, replays the graph, and copies the loss back: the host issues three
/// calls instead of one launch per op. On the host the step always runs eagerly, in the planned
/// workspace, so one training loop serves both devices.
///
/// What the types guarantee: the step closure returns its loss as a tensor of the cycle, which
/// [`run`](StepGraph::run) consumes and turns into an `f32` — no tensor of a captured step survives
/// it, and nothing can read a slot while the next replay writes it. The closure is stored in the
/// graph, so whatever it borrows (the model, the optimizer) stays borrowed, alive and in place, for
/// as long as the graph can replay; drop the graph to use the model otherwise (evaluation,
/// checkpoints), and make a new one to go on training.
///
/// A replay does not call the closure: the GPU repeats the captured launches. Host-side state the
/// closure changes — a step counter, a learning rate it sets from a schedule — advances in eager
/// steps and in the capture only, so keep such state on the device (as [`Adam`](crate::optim::Adam)
/// does with its step count) or use [`without_capture`](StepGraph::without_capture).
///
/// What a captured step cannot do, each an [`Error::InsideCapture`] naming the op: read a GPU tensor
/// on the host (`to_vec`, `to_scalar`, index checks of scatters), copy host data to the GPU (pass
/// batch data as inputs), draw random numbers (dropout), or take GPU memory from outside the planned
/// workspace. Optimizers work: [`Adam`](crate::optim::Adam) keeps its bias corrections' powers on
/// the device, so each replay corrects by its own step. Scalars the step passes to kernels — the
/// learning rate — are fixed at capture (the optimizer is borrowed by the graph, so it cannot be
/// changed from outside meanwhile); drop the graph, change them, and make a new one.
///
/// ```
/// use ndscope::nn::{self, Activation, Init, Mode, Module};
/// use ndscope::optim::{Optimizer, Sgd, SgdConfig};
/// use ndscope::{Device, Input, StepGraph, Tape, root};
///
/// root(Device::Cpu, |s| {
///     s.named_scope("model", |m| {
///         let mut model = nn::mlp(m, &[4, 8, 2], Activation::Relu, Init::KaimingUniform)?;
///         let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1))?;
///         let mut step = StepGraph::new("step", |b, inputs| {
///             let tape = Tape::new(b);
///             let logits = model.forward(&tape.constant(&inputs[0]), Mode::Train)?;
///             let loss = logits.cross_entropy(&inputs[1])?;
///             let grads = tape.backward(&loss)?;
///             opt.step(&mut model, &grads)?;
///             Ok(loss.value().clone())
///         });
///         let (x, y) = ([0.5f32, -1.0, 2.0, 0.0, 1.0, 1.0, -0.5, 0.25], [1i64, 0]);
///         let mut losses = Vec::new();
///         for _ in 0..20 {
///             losses.push(step.run(m, &[Input::new(&x, &[2, 4]), Input::new(&y, &[2])])?);
///         }
///         assert!(losses[19] < losses[0]);
///         assert_eq!(step.workspace().replayed_cycles(), 19); // planned once, then replayed
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct StepGraph<'s, F> {
    step: F,
    ws: Workspace,
    captured: Option<Captured>,
    /// Eager cycles in a row that replayed their plan to the end.
    steady: u32,
    capture: bool,
    eager_steps: u64,
    replays: u64,
    captures: u64,
    _scope: PhantomData<&'s ()>,
}

impl<F> std::fmt::Debug for StepGraph<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("workspace", &self.ws)
            .field("captured", &self.captured.is_some())
            .field("eager_steps", &self.eager_steps)
            .field("captures", &self.captures)
            .field("replays", &self.replays)
            .finish()
    }
}

impl<'s, F> StepGraph<'s, F>
where
    F: for<'c> FnMut(&'c Child<'c, 's>, &[Tensor<'c>]) -> Result<Tensor<'c>>,
{
    /// A step that runs `step` on the inputs of each [`run`](Self::run) in a planned workspace named
    /// `name`; `step` returns the loss (one element).
    pub fn new(name: &'static str, step: F) -> StepGraph<'s, F> {
        StepGraph {
            step,
            ws: Workspace::planned(name),
            captured: None,
            steady: 0,
            capture: true,
            eager_steps: 0,
            replays: 0,
            captures: 0,
            _scope: PhantomData,
        }
    }

    /// The same step, never captured: every call runs eagerly in the planned workspace (for a step
    /// that needs the host, or to compare with the captured one).
    pub fn without_capture(self) -> StepGraph<'s, F> {
        StepGraph {
            capture: false,
            ..self
        }
    }

    /// Runs one step on `inputs` in a cycle of the workspace under `scope` and returns its loss:
    /// eagerly, or — on a GPU, once the plan replays steadily — by capturing the step, then by
    /// replaying the capture. Inputs of another shape or dtype than the captured ones run eagerly
    /// (and are captured in their turn once steady).
    ///
    /// # Errors
    /// What the step returns; [`Error::InvalidShape`] for a loss of more than one element or of an
    /// integer dtype; [`Error::InsideCapture`] when the step does something a captured step cannot
    /// (the step did not run: nothing of it reached the GPU); [`Error::Cuda`] from the replay.
    pub fn run(&mut self, scope: &Scope<'s>, inputs: &[Input<'_>]) -> Result<f32> {
        let device = scope.device();
        if let Some(captured) = &self.captured {
            if captured.matches(device, inputs) {
                return self.replay(inputs);
            }
            self.captured = None;
            self.steady = 0;
        }
        if self.capture
            && matches!(device, Device::Cuda(_))
            && self.steady >= STEADY_CYCLES_BEFORE_CAPTURE
        {
            return self.capture(scope, inputs);
        }
        let step = &mut self.step;
        let loss = scope.workspace(&mut self.ws, |c| {
            let tensors = upload(c, inputs)?;
            loss_of(step(c, &tensors)?)?.to_scalar::<f32>()
        })?;
        self.eager_steps += 1;
        self.steady = if self.ws.last_cycle_replayed() {
            self.steady + 1
        } else {
            0
        };
        Ok(loss)
    }

    /// Steps run eagerly (all of them on the host).
    pub fn eager_steps(&self) -> u64 {
        self.eager_steps
    }

    /// Steps run by capturing them (each capture also runs its step once).
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// Steps run by replaying a capture.
    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// The planned workspace the step's cycles run in.
    pub fn workspace(&self) -> &Workspace {
        &self.ws
    }

    /// Captures one step in a cycle that replays the plan, then runs the capture once.
    fn capture(&mut self, scope: &Scope<'s>, inputs: &[Input<'_>]) -> Result<f32> {
        let device = scope.device();
        let step = &mut self.step;
        let captured = scope.workspace(&mut self.ws, |c| -> Result<Captured> {
            // Uploaded before the capture starts, into the slots the plan gives the inputs.
            let tensors = upload(c, inputs)?;
            let slots = tensors
                .iter()
                .map(|t| t.arena_address().ok_or_else(not_planned))
                .collect::<Result<Vec<_>>>()?;
            let recording = Recording::start(device)?;
            let loss = step(c, &tensors).and_then(loss_of);
            let graph = recording.finish();
            let loss = loss?;
            Ok(Captured {
                graph: graph?,
                device,
                inputs: slots
                    .into_iter()
                    .zip(inputs)
                    .map(|(slot, i)| (slot, i.dtype(), i.shape.to_vec()))
                    .collect(),
                loss: loss.arena_address().ok_or_else(not_planned)?,
            })
        });
        let captured = match captured {
            Ok(captured) => captured,
            Err(e) => {
                // A step that cannot be captured runs eagerly from now on (the error says why).
                if matches!(e, Error::InsideCapture { .. }) {
                    self.capture = false;
                }
                return Err(e);
            }
        };
        self.captures += 1;
        // The capture recorded the step without running it: the first launch runs it.
        let loss = launch(&captured)?;
        self.captured = Some(captured);
        Ok(loss)
    }

    /// Copies the inputs into their slots and replays the capture.
    fn replay(&mut self, inputs: &[Input<'_>]) -> Result<f32> {
        let captured = self.captured.as_ref().expect("replay follows a capture");
        for ((slot, _, _), input) in captured.inputs.iter().zip(inputs) {
            // SAFETY: the slot is a planned slot of this graph's workspace arena, which holds the
            // input's dtype and shape (`matches`); the arena is not reallocated while a capture is
            // kept (only an eager cycle can grow it, and it drops the capture first), and no tensor
            // uses it between cycles.
            unsafe { backend::copy_to_device(captured.device, *slot, input.data.bytes())? };
        }
        let loss = launch(captured)?;
        self.replays += 1;
        Ok(loss)
    }
}

/// The inputs as tensors of the cycle `c`, in order (the cycle's first allocations).
fn upload<'c>(c: &Scope<'c>, inputs: &[Input<'_>]) -> Result<Vec<Tensor<'c>>> {
    inputs.iter().map(|i| i.data.tensor(c, i.shape)).collect()
}

/// The loss as a contiguous one-element `f32` tensor.
fn loss_of(loss: Tensor<'_>) -> Result<Tensor<'_>> {
    if loss.numel() != 1 || !loss.dtype().is_float() {
        return Err(Error::InvalidShape {
            op: "StepGraph::run",
            shape: loss.shape().to_vec(),
            reason: format!(
                "the step must return its loss as one float element, got a {} tensor of {} elements",
                loss.dtype(),
                loss.numel()
            ),
        });
    }
    loss.to_dtype(DType::F32)?.contiguous()
}

fn not_planned() -> Error {
    Error::InsideCapture {
        op: "StepGraph::run",
        device: "the GPU".into(),
        what: "placing an input or the loss outside the step's planned workspace",
    }
}

/// Replays `captured` once and reads its loss.
fn launch(captured: &Captured) -> Result<f32> {
    captured.graph.launch()?;
    let mut loss = [0u8; 4];
    // SAFETY: the loss slot holds one `f32` in the graph's workspace arena (see `replay`); the copy
    // is ordered after the replay on the GPU's stream and waits for it.
    unsafe { backend::copy_from_device(captured.device, captured.loss, &mut loss)? };
    Ok(f32::from_ne_bytes(loss))
}

/// A capture in progress; dropping it ends the capture, so a step that panics or fails leaves the
/// GPU's stream running normally.
struct Recording {
    device: Device,
    open: bool,
}

impl Recording {
    fn start(device: Device) -> Result<Recording> {
        backend::begin_capture(device)?;
        Ok(Recording { device, open: true })
    }

    fn finish(mut self) -> Result<Graph> {
        self.open = false;
        backend::end_capture(self.device)
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if self.open {
            // The step failed or panicked: what was recorded is discarded.
            let _ = backend::end_capture(self.device);
        }
    }
}
