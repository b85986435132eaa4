//! Published architectures with their checkpoints' names and layouts: load a model another library
//! trained, check it, fine-tune it, save it back for that library.

mod gpt2;

pub use gpt2::{Gpt2, Gpt2Config};
