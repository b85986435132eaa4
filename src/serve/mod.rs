//! Generation and serving: a prompt's continuation with a KV cache of its own ([`generate`]), and many
//! requests decoded together by a continuous-batching [`Engine`]. DJL's inference tree, with the
//! scopes checked by the compiler: the model and its [`KvPool`](crate::kv::KvPool) live in the model's
//! scope; each request's cache lives in the request's scope, each step's temporaries in the step's.
//! What a request returns — token ids, log-probabilities, its cache's figures — is plain data.

mod engine;
mod generate;
mod sample;

pub use engine::{Completion, Engine, EngineConfig, Request, StepReport};
pub use generate::{Finish, GenerateOptions, Generation, generate};
pub use sample::Sampling;
