//! Published architectures with their checkpoints' names and layouts: load a model another library
//! trained, check it, fine-tune it, save it back for that library.

mod gpt2;
mod llama;
mod llama_config;

pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::Llama;
pub use llama_config::LlamaConfig;

use std::path::Path;

use crate::error::{Error, Result};

/// A `config.json` key whose value the model does not compute.
fn unsupported(key: &str, value: &serde_json::Value, reason: impl Into<String>) -> Error {
    Error::UnsupportedConfig {
        file: "config.json".into(),
        key: key.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// A `config.json` that is not valid JSON, or a field missing or mistyped.
fn config_error(reason: impl Into<String>) -> Error {
    Error::Format {
        format: "config.json",
        reason: reason.into(),
    }
}

/// Reads the `config.json` at `path` with `parse`, putting the path into its errors.
fn read_config<C>(path: &Path, parse: impl FnOnce(&str) -> Result<C>) -> Result<C> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse(&text).map_err(|e| match e {
        Error::Format { format, reason } => Error::Format {
            format,
            reason: format!("{}: {reason}", path.display()),
        },
        Error::UnsupportedConfig {
            key, value, reason, ..
        } => Error::UnsupportedConfig {
            file: path.display().to_string(),
            key,
            value,
            reason,
        },
        other => other,
    })
}
