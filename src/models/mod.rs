//! Published architectures with their checkpoints' names and layouts: load a model another library
//! trained, check it, fine-tune it, save it back for that library.

mod auto;
mod gguf;
mod gpt2;
mod llama;
mod llama_config;
mod token_table;

pub use auto::AutoModel;
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::Llama;
pub use llama_config::LlamaConfig;

use std::path::Path;

use crate::autograd::{CrossEntropy, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;
use crate::weights::Weights;

/// The language-modelling loss as transformers' causal LMs compute it from `labels = input_ids`:
/// the mean cross-entropy of each position's logits against the next position's label, over labels
/// that are not `-100`. `logits` `[batch, len, vocab]`, `labels` `[batch, len]` (`i64`).
///
/// # Errors
/// [`Error::InvalidShape`] when the shapes do not match or `len < 2`; as for
/// [`Var::cross_entropy_with`].
#[track_caller]
pub fn next_token_loss<'t, 's>(logits: &Var<'t, 's>, labels: &Tensor<'s>) -> Result<Var<'t, 's>> {
    let (&[batch, len, _], &[b, l]) = (logits.shape(), labels.shape()) else {
        return Err(Error::InvalidShape {
            op: "next_token_loss",
            shape: labels.shape().to_vec(),
            reason: format!(
                "needs logits [batch, len, vocab] and labels [batch, len], got logits {:?}",
                logits.shape()
            ),
        });
    };
    if (b, l) != (batch, len) || len < 2 {
        return Err(Error::InvalidShape {
            op: "next_token_loss",
            shape: labels.shape().to_vec(),
            reason: format!(
                "needs labels [{batch}, {len}] with len >= 2 for logits {:?}",
                logits.shape()
            ),
        });
    }
    let predicted = logits.narrow(1, 0, len - 1)?;
    let next = labels.narrow(1, 1, len - 1)?;
    predicted.cross_entropy_with(&next, CrossEntropy::ignoring(-100))
}

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

/// transformers' name of a dtype (`config.json`'s `dtype` and `torch_dtype`).
fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::I64 => "int64",
    }
}

/// The output head `[vocab, width]` stored as `name`, for a model whose token embedding is
/// `embedding` and whose config says `tied`: `None` when the head is the embedding. A tied config
/// with a *different* head in the file computes with the file's head, as transformers does (it
/// warns); ndscope says so on stderr and unties `tied`, so that `save_pretrained` writes the head.
/// A copy equal to the embedding stays tied.
fn output_head<'m>(
    scope: &Scope<'m>,
    weights: &Weights,
    name: &str,
    embedding: &Tensor<'m>,
    tied: &mut bool,
    dtype: DType,
) -> Result<Option<Tensor<'m>>> {
    let shape = embedding.shape().to_vec();
    if !*tied {
        return Ok(Some(weights.tensor(scope, name, &shape, dtype)?));
    }
    if !weights.contains(name) {
        return Ok(None);
    }
    let head = weights.tensor(scope, name, &shape, dtype)?;
    if head.to_vec_f64()? == embedding.to_vec_f64()? {
        return Ok(None);
    }
    eprintln!(
        "ndscope: config.json ties the output head to the token embedding, but the checkpoint \
         holds a different {name}; using the checkpoint's head (as transformers does), and the \
         model saves untied"
    );
    *tied = false;
    Ok(Some(head))
}

/// A model holding block-quantized weights cannot be written as safetensors (which has no block
/// formats) without decoding them, which would silently grow the file four to eight times.
fn refuse_quantized_save(op: &'static str, quantized: bool) -> Result<()> {
    if quantized {
        return Err(Error::InvalidArgument {
            op,
            reason: "the model holds block-quantized weights (loaded by `from_gguf_quantized`), \
                     which safetensors cannot store; load the file with `from_gguf` (decoded) to \
                     save it"
                .into(),
        });
    }
    Ok(())
}
