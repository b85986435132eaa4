//! Published architectures with their checkpoints' names and layouts: load a model another library
//! trained, check it, fine-tune it, save it back for that library.

mod gpt2;
mod llama;
mod llama_config;

pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::Llama;
pub use llama_config::LlamaConfig;
