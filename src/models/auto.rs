//! [`AutoModel`]: the architecture a Hugging Face directory holds, picked from its `config.json`
//! (transformers' `AutoModelForCausalLM`), so a training loop or a server is written once for
//! every model ndscope loads.

use std::path::Path;

use serde_json::Value;

use super::llama_config::LLAMA_MODEL_TYPES;
use super::{Gpt2, Llama, config_error, next_token_loss, read_config, unsupported};
use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::Result;
use crate::kv::{CausalLm, KvShape, KvStep};
use crate::nn::{Mode, Parameters};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::Tensor;

/// A pretrained causal language model of any architecture ndscope loads: GPT-2, or the Llama
/// family (Llama, Mistral, Qwen2). It trains (`forward`, `loss`, recomputation, the optimizers and
/// `DataParallel` through [`Parameters`]), decodes ([`CausalLm`]: `serve::generate`, the engine)
/// and saves back to a directory transformers loads.
///
/// ```
/// use ndscope::models::AutoModel;
/// use ndscope::nn::Mode;
/// use ndscope::{DType, Device, Tape, root};
///
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/data/llama-tiny");
/// root(Device::Cpu, |m| {
///     let mut model = AutoModel::from_pretrained(m, dir, DType::F32)?;
///     assert_eq!(model.architecture(), "llama");
///     model.set_recompute(true); // blocks recomputed in the backward pass
///     m.scope(|batch| {
///         let ids = batch.from_slice(&[1i64, 5, 9, 2], &[1, 4])?;
///         let tape = Tape::new(batch);
///         let loss = AutoModel::loss(&model.forward(&tape, &ids, Mode::Train)?, &ids)?;
///         let grads = tape.backward(&loss)?;
///         assert!(grads.len() > 0);
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
// One value per loaded model: the size difference costs nothing, a `Box` would cost every match.
#[allow(clippy::large_enum_variant)]
pub enum AutoModel<'m> {
    /// `model_type` `gpt2`.
    Gpt2(Gpt2<'m>),
    /// `model_type` `llama`, `mistral` or `qwen2`.
    Llama(Llama<'m>),
}

/// The `model_type`s [`AutoModel`] loads.
const MODEL_TYPES: &str = "gpt2, llama, mistral and qwen2";

impl<'m> AutoModel<'m> {
    /// Loads the Hugging Face directory `dir` (`config.json`, `model.safetensors` or its shards)
    /// as `dtype` in `scope`, with the model its `config.json`'s `model_type` names; a file
    /// (rather than a directory) loads as GGUF ([`from_gguf`](Self::from_gguf)).
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) when `config.json` cannot be read;
    /// [`Error::Format`](crate::Error::Format) when it is not JSON or names no `model_type`;
    /// [`Error::UnsupportedConfig`](crate::Error::UnsupportedConfig) for a `model_type` ndscope
    /// does not load; as for [`Gpt2::from_pretrained`] and [`Llama::from_pretrained`].
    #[track_caller]
    pub fn from_pretrained(
        scope: &Scope<'m>,
        dir: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<AutoModel<'m>> {
        let dir = dir.as_ref();
        if dir.is_file() {
            return AutoModel::from_gguf(scope, dir, dtype);
        }
        let model_type = read_config(&dir.join("config.json"), |text| {
            let raw: Value = serde_json::from_str(text).map_err(|e| config_error(e.to_string()))?;
            match &raw["model_type"] {
                Value::String(t) if t == "gpt2" => Ok("gpt2"),
                Value::String(t) if LLAMA_MODEL_TYPES.contains(&t.as_str()) => Ok("llama"),
                Value::Null => Err(config_error(format!(
                    "\"model_type\" is missing (ndscope loads {MODEL_TYPES})"
                ))),
                other => Err(unsupported(
                    "model_type",
                    other,
                    format!("ndscope loads {MODEL_TYPES}"),
                )),
            }
        })?;
        Ok(if model_type == "gpt2" {
            AutoModel::Gpt2(Gpt2::from_pretrained(scope, dir, dtype)?)
        } else {
            AutoModel::Llama(Llama::from_pretrained(scope, dir, dtype)?)
        })
    }

    /// Loads the GGUF file `path` as `dtype` in `scope`, with the model its
    /// `general.architecture` names (`gpt2`, `llama` or `qwen2`); see [`Gpt2::from_gguf`] and
    /// [`Llama::from_gguf`].
    ///
    /// # Errors
    /// As for [`Gpt2::from_gguf`] and [`Llama::from_gguf`];
    /// [`Error::UnsupportedConfig`](crate::Error::UnsupportedConfig) for another architecture.
    #[track_caller]
    pub fn from_gguf(
        scope: &Scope<'m>,
        path: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<AutoModel<'m>> {
        AutoModel::from_gguf_with(scope, path.as_ref(), dtype, false)
    }

    /// Loads the GGUF file `path` with its block-quantized matrices kept in their blocks (see
    /// [`Llama::from_gguf_quantized`] and [`Gpt2::from_gguf_quantized`]); the rest as `dtype`.
    ///
    /// # Errors
    /// As for [`from_gguf`](Self::from_gguf).
    #[track_caller]
    pub fn from_gguf_quantized(
        scope: &Scope<'m>,
        path: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<AutoModel<'m>> {
        AutoModel::from_gguf_with(scope, path.as_ref(), dtype, true)
    }

    #[track_caller]
    fn from_gguf_with(
        scope: &Scope<'m>,
        path: &Path,
        dtype: DType,
        quantized: bool,
    ) -> Result<AutoModel<'m>> {
        // Opened (and its metadata parsed) once, for the architecture and the model both.
        let weights = crate::weights::Weights::open(path)?;
        match super::gguf::architecture(super::gguf::metadata(&weights)?)? {
            "gpt2" => Ok(AutoModel::Gpt2(Gpt2::from_gguf_weights(
                scope, &weights, dtype, quantized,
            )?)),
            _ => Ok(AutoModel::Llama(Llama::from_gguf_weights(
                scope, &weights, dtype, quantized,
            )?)),
        }
    }

    /// The checkpoint's `model_type`: `gpt2`, `llama`, `mistral` or `qwen2`.
    pub fn architecture(&self) -> &str {
        match self {
            AutoModel::Gpt2(_) => "gpt2",
            AutoModel::Llama(m) => &m.config().model_type,
        }
    }

    /// One line on the model's shape: layers, width, heads, vocabulary, positions.
    pub fn describe(&self) -> String {
        match self {
            AutoModel::Gpt2(m) => {
                let c = m.config();
                format!(
                    "GPT-2 with {} layers of width {}, {} heads, vocabulary {}, {} positions",
                    c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.n_positions
                )
            }
            AutoModel::Llama(m) => {
                let c = m.config();
                format!(
                    "{} with {} layers of width {}, {} query / {} key-value heads of {}, MLP {}, \
                     vocabulary {}, {} positions{}",
                    c.model_type,
                    c.num_hidden_layers,
                    c.hidden_size,
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    c.head_dim,
                    c.intermediate_size,
                    c.vocab_size,
                    c.max_position_embeddings,
                    c.sliding_window
                        .map(|w| format!(", sliding window {w}"))
                        .unwrap_or_default()
                )
            }
        }
    }

    /// The token ids that end a generation by the checkpoint's config (`eos_token_id`; none for
    /// GPT-2, whose `<|endoftext|>` ndscope leaves to the caller).
    pub fn end_tokens(&self) -> &[i64] {
        match self {
            AutoModel::Gpt2(_) => &[],
            AutoModel::Llama(m) => &m.config().eos_token_ids,
        }
    }

    /// The logits `[batch, len, vocab]` of token ids `[batch, len]`: [`Gpt2::forward`],
    /// [`Llama::forward`].
    ///
    /// # Errors
    /// As for the model's `forward`.
    #[track_caller]
    pub fn forward<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
        mode: Mode,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            AutoModel::Gpt2(m) => m.forward(tape, ids, mode),
            AutoModel::Llama(m) => m.forward(tape, ids, mode),
        }
    }

    /// The next-token loss of `logits` against `labels = input_ids`: [`next_token_loss`].
    ///
    /// # Errors
    /// As for [`next_token_loss`].
    #[track_caller]
    pub fn loss<'t, 's>(logits: &Var<'t, 's>, labels: &Tensor<'s>) -> Result<Var<'t, 's>> {
        next_token_loss(logits, labels)
    }

    /// Recomputes every block in the backward pass (activation checkpointing):
    /// [`Gpt2::set_recompute`], [`Llama::set_recompute`].
    pub fn set_recompute(&mut self, on: bool) {
        match self {
            AutoModel::Gpt2(m) => m.set_recompute(on),
            AutoModel::Llama(m) => m.set_recompute(on),
        }
    }

    /// Whether [`set_recompute`](Self::set_recompute) is on.
    pub fn recomputes(&self) -> bool {
        match self {
            AutoModel::Gpt2(m) => m.recomputes(),
            AutoModel::Llama(m) => m.recomputes(),
        }
    }

    /// Writes the model as a Hugging Face directory transformers loads:
    /// [`Gpt2::save_pretrained`], [`Llama::save_pretrained`].
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) when the directory or its files cannot be written.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        match self {
            AutoModel::Gpt2(m) => m.save_pretrained(dir),
            AutoModel::Llama(m) => m.save_pretrained(dir),
        }
    }
}

/// The parameters under transformers' names, as the model's own.
impl<'m> Parameters<'m> for AutoModel<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        match self {
            AutoModel::Gpt2(m) => m.visit(prefix, f),
            AutoModel::Llama(m) => m.visit(prefix, f),
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        match self {
            AutoModel::Gpt2(m) => m.visit_mut(f),
            AutoModel::Llama(m) => m.visit_mut(f),
        }
    }
}

impl<'m> Movable<'m> for AutoModel<'m> {
    type Moved<'b> = AutoModel<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<AutoModel<'b>> {
        Ok(match self {
            AutoModel::Gpt2(m) => AutoModel::Gpt2(m.move_into(target)?),
            AutoModel::Llama(m) => AutoModel::Llama(m.move_into(target)?),
        })
    }
}

/// A model shared by threads: `AutoModel<'static>` is `Sync`.
impl<'m> MoveOut<'m> for AutoModel<'m> {
    fn move_out(self) -> Result<AutoModel<'static>> {
        Ok(match self {
            AutoModel::Gpt2(m) => AutoModel::Gpt2(m.move_out()?),
            AutoModel::Llama(m) => AutoModel::Llama(m.move_out()?),
        })
    }
}

impl<'m> CausalLm<'m> for AutoModel<'m> {
    fn kv_shape(&self) -> KvShape {
        match self {
            AutoModel::Gpt2(m) => m.kv_shape(),
            AutoModel::Llama(m) => m.kv_shape(),
        }
    }

    fn max_positions(&self) -> usize {
        match self {
            AutoModel::Gpt2(m) => m.max_positions(),
            AutoModel::Llama(m) => m.max_positions(),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            AutoModel::Gpt2(m) => m.vocab_size(),
            AutoModel::Llama(m) => m.vocab_size(),
        }
    }

    fn forward_packed<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
        positions: &Tensor<'s>,
        kv: &mut KvStep<'_, '_>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            AutoModel::Gpt2(m) => m.forward_packed(tape, ids, positions, kv),
            AutoModel::Llama(m) => m.forward_packed(tape, ids, positions, kv),
        }
    }

    fn logits<'t, 's>(&self, hidden: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            AutoModel::Gpt2(m) => m.logits(hidden),
            AutoModel::Llama(m) => m.logits(hidden),
        }
    }
}
