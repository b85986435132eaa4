#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_debug_implementations, missing_docs)]

mod autograd;
mod backend;
pub mod checkpoint;
pub mod data;
mod device;
pub mod dist;
mod dtype;
mod error;
mod fastmath;
pub mod gguf;
pub mod kv;
mod layout;
mod memory;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
pub mod quant;
mod replay;
mod rng;
mod scope;
pub mod serve;
mod tensor;
pub mod threads;
pub mod weights;

pub use autograd::{Gradients, Segment, Tape, Var};
pub use backend::{GpuMemory, gpu_memory, reset_gpu_memory_peak};
pub use device::Device;
pub use dtype::{DType, Element, Float, ParseDTypeError, bf16, f16};
pub use error::{Error, Result};
pub use layout::{Layout, Shape};
pub use memory::arena::Workspace;
pub use memory::lazy_free::{lazily_freed_host_bytes, release_lazily_freed_host_memory};
pub use memory::plan::{Plan, PlannedSlot};
pub use memory::stats::{MemoryStats, ScopeStats};
pub use ops::{AttentionSpec, Causal, Conv2dOptions};
pub use replay::{Input, StepGraph};
pub use rng::DEFAULT_SEED;
pub use scope::{
    Child, EventKind, Fault, MemoryEvent, Movable, MoveOut, Scope, Timeline, root, system_stats,
};
pub use tensor::{QuantTensor, Tensor};
