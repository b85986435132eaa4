//! Generation and serving: a prompt's continuation with a KV cache of its own ([`generate`]), and many
//! requests decoded together by a continuous-batching [`Engine`]. DJL's inference tree, with the
//! scopes checked by the compiler: the model and its [`KvPool`](crate::kv::KvPool) live in the model's
//! scope; [`generate`]'s cache lives in the scope it is given, while the [`Engine`] keeps every
//! running request's cache in one scope of its own (`engine`, all caches of one brand), each
//! request's blocks going back to the pool when it ends; each step's temporaries live in the step's.
//! What a request returns — token ids, log-probabilities, its cache's figures — is plain data.

mod core;
mod engine;
mod generate;
mod sample;

pub use core::{CoreConfig, EngineCore, Event, RequestId, StepReport, Timing};
pub use engine::{Completion, Engine, EngineConfig, Request};
pub use generate::{Finish, GenerateOptions, Generation, generate, generate_in};
pub use sample::Sampling;
