//! The one error type of ndscope.
//!
//! Every fallible operation returns [`Result<T>`]. Each variant carries what a user needs to fix the
//! call: both shapes of a mismatch, the dtype that was expected, the scope that refused an
//! allocation and how much it holds. The `Display` text says what was wrong and what to do.

use std::fmt;

use crate::dtype::DType;

/// Shorthand for `std::result::Result<T, ndscope::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in ndscope.
///
/// Every variant names the operation (`op`) that failed where there is one, and carries the values a
/// caller needs to report or fix the problem.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// Two operands whose shapes cannot be combined (broadcast, matmul, concat, ...).
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// Shape of the first operand.
        lhs: Vec<usize>,
        /// Shape of the second operand.
        rhs: Vec<usize>,
        /// The rule the shapes broke.
        hint: &'static str,
    },
    /// Two operands of different element types.
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// Element type of the first operand (or of the tensor).
        lhs: DType,
        /// Element type of the second operand (or the one asked for).
        rhs: DType,
    },
    /// Elements read as a Rust type that is not the tensor's dtype (`to_vec::<f64>()` of an `f32`
    /// tensor).
    ElementType {
        /// The accessor.
        op: &'static str,
        /// The tensor's element type.
        dtype: DType,
        /// The element type asked for.
        requested: DType,
    },
    /// An op that does not support this element type (for example `exp` of an integer tensor).
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The element type given.
        dtype: DType,
        /// What the operation accepts.
        expected: &'static str,
    },
    /// Operands that live on different devices.
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// Device of the first operand.
        lhs: String,
        /// Device of the second operand.
        rhs: String,
    },
    /// A device that cannot be used (not compiled in, no driver, no such ordinal).
    DeviceUnavailable {
        /// The device asked for, as `cpu` or `cuda:N`.
        device: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A device name that is not `cpu`, `cuda` or `cuda:N`.
    InvalidDevice {
        /// The text that was parsed.
        text: String,
    },
    /// An optimizer step whose gradients miss a parameter the optimizer updates.
    MissingGradient {
        /// The operation.
        op: &'static str,
        /// The parameter's name (its `Parameters::visit` path).
        parameter: String,
    },
    /// A host-only access (a borrowed slice) to a tensor in GPU memory.
    NotOnHost {
        /// The operation.
        op: &'static str,
        /// Where the tensor lives.
        device: String,
    },
    /// An op the device's backend has no kernel for.
    UnsupportedOnDevice {
        /// The operation.
        op: &'static str,
        /// The device, as `cuda:N`.
        device: String,
    },
    /// The CUDA driver, NVRTC or cuBLAS reported an error while running an op.
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The library's error.
        reason: String,
    },
    /// An argument that is not valid for the op and is not a shape: a negative temperature, a
    /// cache used with a KV pool that did not make it.
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// A shape that is not valid for the op (wrong rank, wrong element count for a reshape, ...).
    InvalidShape {
        /// The operation.
        op: &'static str,
        /// The shape concerned (empty where the problem is an argument, not a shape).
        shape: Vec<usize>,
        /// What is wrong with it.
        reason: String,
    },
    /// An axis outside `-rank..rank` (negative axes count from the end).
    AxisOutOfRange {
        /// The operation.
        op: &'static str,
        /// The axis given.
        axis: isize,
        /// The rank of the tensor.
        rank: usize,
    },
    /// An index outside the dimension it indexes.
    IndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The first offending index.
        index: i64,
        /// The size of the indexed dimension.
        size: usize,
    },
    /// A slice whose length does not match the shape it is meant to fill.
    DataLength {
        /// The operation.
        op: &'static str,
        /// Elements the shape holds.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A shape whose element or byte count does not fit in memory addresses.
    SizeOverflow {
        /// The shape.
        shape: Vec<usize>,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// An allocation that would push a scope (or one of its ancestors) over its byte budget,
    /// or that the device's allocator refused even after every idle cached block on the device went
    /// back to it.
    OutOfMemory {
        /// The scope whose budget (or whose request) was refused.
        scope: String,
        /// The device of the refused memory (`cpu`, `cuda:0`).
        device: String,
        /// Bytes requested.
        requested: usize,
        /// Bytes live in that scope's subtree (budget), or in the tree's tensors on the device
        /// (allocator refusal).
        live: usize,
        /// The budget, or `None` when the device's allocator refused.
        budget: Option<usize>,
        /// Bytes of idle blocks the tree's pool still held on the device (idle space inside segments
        /// that also hold live tensors, which cannot go back to the device).
        cached: usize,
        /// Bytes of idle blocks released (by this tree and by other trees on the device) before the
        /// request was refused for good.
        released: usize,
        /// The scope tree at the time, as `Scope::dump` prints it.
        dump: String,
    },
    /// An allocation into a scope on which `cap()` was called.
    Capped {
        /// The capped scope.
        scope: String,
        /// Bytes requested.
        requested: usize,
    },
    /// An allocation in a strict scope (see [`Scope::set_strict`](crate::Scope::set_strict)) while one of
    /// its child scopes was open.
    OuterAllocation {
        /// The strict scope.
        scope: String,
        /// Its open child.
        child: String,
        /// The refused tensor's element type.
        dtype: DType,
        /// The refused tensor's shape.
        shape: Vec<usize>,
        /// Where the tensor was being made: `file:line:column`.
        at: String,
    },
    /// Integer division by zero.
    DivisionByZero {
        /// The operation.
        op: &'static str,
    },
    /// A borrowed view was requested from a tensor that is not laid out contiguously.
    NotContiguous {
        /// The operation.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's strides, in elements.
        strides: Vec<usize>,
    },
    /// An empty list where at least one tensor is needed (concat, stack).
    Empty {
        /// The operation.
        op: &'static str,
    },
    /// A gradient that cannot be computed: a variable from another tape, a non-scalar loss, an op
    /// without a derivative for this input.
    Autograd {
        /// The operation.
        op: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// Something a step captured as a CUDA graph cannot do: the host does not run during a replay, so
    /// nothing in the step may wait for the GPU, copy host data, draw host-seeded random numbers or
    /// allocate outside the step's plan.
    InsideCapture {
        /// The operation.
        op: &'static str,
        /// The GPU being captured.
        device: String,
        /// What the operation would have done.
        what: &'static str,
    },
    /// A file that could not be read or written.
    Io {
        /// The file.
        path: String,
        /// The operating system's reason.
        reason: String,
    },
    /// A model configuration that asks for something ndscope does not compute (another attention
    /// variant, an activation or a rotary scaling it lacks): loading it would give a silently
    /// different model, so it is refused, naming the key.
    UnsupportedConfig {
        /// The file (`config.json` and its path, when read from one).
        file: String,
        /// The key.
        key: String,
        /// Its value in the file.
        value: String,
        /// What ndscope computes instead, or why the value is refused.
        reason: String,
    },
    /// Bytes that are not valid in the format they claim (a corrupt or truncated safetensors, IDX or
    /// CSV file).
    Format {
        /// The format: `safetensors`, `IDX`, `CSV`.
        format: &'static str,
        /// What is wrong, and where.
        reason: String,
    },
    /// A KV cache that its pool cannot hold: more blocks than the pool has unpromised now (or at all).
    KvCapacity {
        /// Tokens the cache was asked to hold.
        tokens: usize,
        /// Blocks those tokens need beyond what the cache already holds or was promised.
        needed: usize,
        /// Blocks free and not promised to another cache.
        available: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A request refused because the engine's queue is full: overload is refused at once instead
    /// of making every request wait longer.
    Overloaded {
        /// Requests waiting.
        waiting: usize,
        /// The most that may wait.
        limit: usize,
    },
    /// A checkpoint that does not hold a tensor the model needs.
    MissingTensor {
        /// The name looked up, in the checkpoint's naming.
        name: String,
        /// Up to five names the checkpoint holds, nearest to `name` first.
        nearest: Vec<String>,
        /// How many tensors the checkpoint holds.
        held: usize,
    },
    /// A checkpoint tensor whose shape or dtype is not what the model declares.
    TensorMismatch {
        /// The tensor's name in the checkpoint.
        name: String,
        /// The dtype and shape the model declares.
        expected: String,
        /// The dtype and shape the checkpoint holds.
        found: String,
        /// What to do.
        hint: String,
    },
    /// A distributed operation that cannot run as asked: the process group cannot start, a root
    /// rank out of range, tensors that differ between ranks where they must agree.
    Distributed {
        /// The operation.
        op: &'static str,
        /// What was wrong and what to do.
        reason: String,
    },
    /// Another rank of the process group failed; this rank stops at the same step with its message.
    PeerFailed {
        /// The operation at which the ranks agreed to stop.
        op: &'static str,
        /// The lowest rank that failed.
        rank: usize,
        /// That rank's error, as it printed it.
        message: String,
    },
    /// A collective that did not complete in the process group's timeout: a peer that never joined
    /// (it died, hangs, or runs a different step).
    CollectiveTimeout {
        /// The collective.
        op: &'static str,
        /// This process's rank.
        rank: usize,
        /// The timeout, in seconds.
        seconds: f64,
    },
    /// Ranks at different points of the program met in one of the library's exchanges: a rank
    /// skipped or repeated a step, took another branch, or left while the others went on.
    CollectiveMismatch {
        /// What this rank was doing.
        op: &'static str,
        /// This process's rank.
        rank: usize,
        /// This rank's count of the library's exchanges so far (`op` is number `exchange`).
        exchange: u64,
        /// The lowest rank that was elsewhere.
        peer: usize,
        /// What that rank was doing.
        peer_op: String,
        /// That rank's count of exchanges.
        peer_exchange: u64,
    },
    /// Ranks whose models differ where data parallelism needs them equal.
    ParameterMismatch {
        /// The lowest rank whose parameters differ from rank 0's.
        rank: usize,
        /// The first difference: the parameter's name, and what each rank holds.
        difference: String,
    },
}

impl Error {
    /// [`Error::Io`] for `path`, with `reason` (an `std::io::Error`, or a sentence).
    pub(crate) fn io(path: &std::path::Path, reason: impl fmt::Display) -> Error {
        Error::Io {
            path: path.display().to_string(),
            reason: reason.to_string(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ShapeMismatch { op, lhs, rhs, hint } => {
                write!(f, "{op}: shapes {lhs:?} and {rhs:?} do not match; {hint}")
            }
            Error::DTypeMismatch { op, lhs, rhs } => write!(
                f,
                "{op}: dtypes {lhs} and {rhs} differ; convert one operand first, e.g. with `.to_dtype(DType::{lhs:?})`"
            ),
            Error::ElementType {
                op,
                dtype,
                requested,
            } => write!(
                f,
                "{op}: the tensor holds {dtype} elements, not {requested}; read them as {dtype} \
                 (`{op}::<{dtype}>()`) or convert first with `.to_dtype(DType::{requested:?})`"
            ),
            Error::UnsupportedDType {
                op,
                dtype,
                expected,
            } => {
                let to = if expected.contains("i64") {
                    "I64"
                } else {
                    "F32"
                };
                write!(
                    f,
                    "{op}: dtype {dtype} is not supported, it needs {expected}; convert first, e.g. with \
                     `.to_dtype(DType::{to})`"
                )
            }
            Error::DeviceMismatch { op, lhs, rhs } => write!(
                f,
                "{op}: operands live on different devices ({lhs} and {rhs}); copy one with `.to_device(..)` first"
            ),
            Error::DeviceUnavailable { device, reason } => {
                write!(f, "device {device} cannot be used: {reason}")
            }
            Error::InvalidDevice { text } => write!(
                f,
                "{text:?} is not a device name; write `cpu`, `cuda` (the first GPU) or `cuda:N`"
            ),
            Error::MissingGradient { op, parameter } => write!(
                f,
                "{op}: the gradients hold nothing for parameter `{parameter}`; were they computed for \
                 this model? Freeze parameters you mean to leave unchanged with `freeze(..)`"
            ),
            Error::NotOnHost { op, device } => write!(
                f,
                "{op}: the tensor lives on {device}, not in host memory; read it with `.to_vec()` or copy it \
                 with `.to_device(Device::Cpu)` first"
            ),
            Error::UnsupportedOnDevice { op, device } => write!(
                f,
                "{op}: the {device} backend has no kernel for this op; copy the operands to the host with \
                 `.to_device(Device::Cpu)` (the README lists the ops that run on a GPU)"
            ),
            Error::Cuda { op, reason } => write!(f, "{op}: CUDA error: {reason}"),
            Error::InvalidArgument { op, reason } => write!(f, "{op}: {reason}"),
            Error::InvalidShape { op, shape, reason } => {
                write!(f, "{op}: shape {shape:?} is not valid here: {reason}")
            }
            Error::AxisOutOfRange { op, axis, rank } => write!(
                f,
                "{op}: axis {axis} is out of range for a tensor of rank {rank} (valid axes are 0..{rank}, or -{rank}..-1 from the end)"
            ),
            Error::IndexOutOfRange { op, index, size } => write!(
                f,
                "{op}: index {index} is out of range for a dimension of size {size} (valid indices are 0..{size})"
            ),
            Error::DataLength { op, expected, got } => write!(
                f,
                "{op}: the shape holds {expected} elements but the data has {got}; pass exactly {expected} values"
            ),
            Error::SizeOverflow {
                shape,
                element_bytes,
            } => write!(
                f,
                "shape {shape:?} of {element_bytes}-byte elements has more bytes than fit in memory addresses; \
                 check the dimensions for a mistake"
            ),
            Error::OutOfMemory {
                scope,
                device,
                requested,
                live,
                budget,
                cached,
                released,
                ..
            } => match budget {
                Some(budget) => write!(
                    f,
                    "out of memory in scope \"{scope}\": {requested} bytes requested with {live} bytes live \
                     against a budget of {budget} bytes; drop tensors you no longer need, open a child scope \
                     for temporaries, or raise the budget (the tree dump is in the error's `dump` field)"
                ),
                None => write!(
                    f,
                    "out of memory in scope \"{scope}\": the {device} allocator refused {requested} bytes, \
                     also after {released} bytes of idle cached blocks (this tree's and other trees' on \
                     {device}) went back to it; the tree holds {live} bytes of live tensors and {cached} \
                     cached bytes that cannot be returned while their segments hold live tensors; drop \
                     tensors you no longer need or use smaller ones (the tree dump is in the error's `dump` \
                     field)"
                ),
            },
            Error::Capped { scope, requested } => write!(
                f,
                "scope \"{scope}\" is capped and refuses new tensors ({requested} bytes requested); allocate in \
                 a child scope and `ret` only what must outlive it, or call `uncap()`"
            ),
            Error::OuterAllocation {
                scope,
                child,
                dtype,
                shape,
                at,
            } => write!(
                f,
                "scope \"{scope}\" is strict and refuses a new {dtype} tensor of shape {shape:?} (made at \
                 {at}) while its child scope \"{child}\" is open: an op's result goes to the innermost \
                 owner of its operands, so a step whose inputs were created in \"{scope}\" computes \
                 there; create the step's inputs in the step's scope (`batch.from_slice(..)`), compute \
                 through the step's tape, and `ret` what must outlive the step"
            ),
            Error::DivisionByZero { op } => {
                write!(
                    f,
                    "{op}: integer division by zero; mask zero divisors or divide in a float dtype"
                )
            }
            Error::NotContiguous { op, shape, strides } => write!(
                f,
                "{op}: the tensor (shape {shape:?}, strides {strides:?}) is not contiguous; call `.contiguous()` first"
            ),
            Error::Empty { op } => write!(f, "{op}: needs at least one tensor, got none"),
            Error::Autograd { op, reason } => write!(f, "{op}: {reason}"),
            Error::InsideCapture { op, device, what } => write!(
                f,
                "{op}: {what} inside a step being captured as a CUDA graph on {device}; a replayed step \
                 runs without the host, so read results from the loss the step returns, pass batch data \
                 as the step's inputs, and keep host-side work (logging, checks, random draws) out of the \
                 captured closure"
            ),
            Error::Io { path, reason } => write!(f, "cannot access {path}: {reason}"),
            Error::UnsupportedConfig {
                file,
                key,
                value,
                reason,
            } => write!(f, "{file}: unsupported: {key} = {value}; {reason}"),
            Error::Format { format, reason } => write!(
                f,
                "not a valid {format} file: {reason}; the file may be truncated or of another format"
            ),
            Error::MissingTensor {
                name,
                nearest,
                held,
            } => {
                write!(f, "the checkpoint has no tensor named \"{name}\"")?;
                match nearest.as_slice() {
                    [] => write!(f, " (it holds no tensor)")?,
                    names => {
                        let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
                        write!(f, " (it holds {held}; nearest: {})", names.join(", "))?
                    }
                }
                write!(
                    f,
                    "; was it saved from a model of the same architecture, under the same names?"
                )
            }
            Error::Overloaded { waiting, limit } => write!(
                f,
                "the engine is overloaded: {waiting} requests wait and at most {limit} may; retry \
                 later, or let more wait (CoreConfig::max_waiting)"
            ),
            Error::KvCapacity {
                tokens,
                needed,
                available,
                total,
            } => {
                write!(
                    f,
                    "the KV pool cannot hold {tokens} tokens: they need {needed} more blocks and \
                     {available} of its {total} blocks are free and unpromised; "
                )?;
                if needed > total {
                    write!(f, "ask for fewer tokens or make a pool of more blocks")
                } else {
                    write!(
                        f,
                        "wait until other requests finish (the serving engine queues such a \
                         request), ask for fewer tokens, or make a pool of more blocks"
                    )
                }
            }
            Error::TensorMismatch {
                name,
                expected,
                found,
                hint,
            } => write!(
                f,
                "the checkpoint's tensor \"{name}\" is {found}, the model expects {expected}; {hint}"
            ),
            Error::Distributed { op, reason } => write!(f, "{op}: {reason}"),
            Error::PeerFailed { op, rank, message } => write!(
                f,
                "{op}: rank {rank} failed, so every rank stops here; its error: {message}"
            ),
            Error::CollectiveTimeout { op, rank, seconds } => write!(
                f,
                "{op}: rank {rank} waited {seconds} s and a peer did not join; it may have died, hung \
                 or be running another step. Look at the other ranks' output, or raise the timeout \
                 with ProcessGroup::set_timeout when steps are that slow"
            ),
            Error::CollectiveMismatch {
                op,
                rank,
                exchange,
                peer,
                peer_op,
                peer_exchange,
            } => write!(
                f,
                "{op}: rank {rank} was here (its exchange #{exchange}) while rank {peer} was at \
                 {peer_op} (its exchange #{peer_exchange}): the ranks are not making the same \
                 collective calls in the same order (a rank skipped or repeated a step, took \
                 another branch, or finished early); every rank must run the same steps"
            ),
            Error::ParameterMismatch { rank, difference } => write!(
                f,
                "rank {rank}'s model differs from rank 0's: {difference}; every rank must build the \
                 same model (same code, same configuration) before data-parallel training"
            ),
        }
    }
}

impl std::error::Error for Error {}
