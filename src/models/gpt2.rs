//! GPT-2 (Radford et al., 2019) as Hugging Face's `GPT2LMHeadModel` computes it, with its parameter
//! names and layouts, so a model directory written by `save_pretrained` loads here and a model
//! saved here loads in transformers.

use std::path::Path;

use serde_json::{Map, Value};

use super::token_table::{self, TokenTable};
use super::{
    config_error, next_token_loss, output_head, read_config, torch_dtype_name, unsupported,
};
use crate::autograd::{Tape, Var};
use crate::checkpoint;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvShape, KvStep};
use crate::nn::{
    Activation, Embedding, Init, LayerNorm, Mode, Module, Parameters, PositionalEmbedding,
    Recomputed, TransformerBlock, TransformerConfig,
};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::{QuantTensor, Tensor};
use crate::weights::Weights;

/// GPT-2's hyper-parameters, as `config.json` names them.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary (`vocab_size`).
    pub vocab_size: usize,
    /// The longest sequence (`n_positions`).
    pub n_positions: usize,
    /// The model width (`n_embd`).
    pub n_embd: usize,
    /// Transformer blocks (`n_layer`).
    pub n_layer: usize,
    /// Attention heads (`n_head`).
    pub n_head: usize,
    /// The feed-forward width (`n_inner`; `4 n_embd` when null).
    pub n_inner: usize,
    /// The feed-forward activation (`activation_function`: `gelu_new` is GELU's tanh form).
    pub activation: Activation,
    /// What the layer norms add to the variance (`layer_norm_epsilon`).
    pub layer_norm_epsilon: f64,
    /// Whether the output head is the token embedding (`tie_word_embeddings`, true for GPT-2).
    pub tie_word_embeddings: bool,
    /// Every field of the file, written back by [`Gpt2Config::to_json`].
    raw: Map<String, Value>,
}

/// A key whose value ndscope's GPT-2 does not compute.
impl Gpt2Config {
    /// A configuration with Hugging Face's GPT-2 defaults for everything but the sizes.
    pub fn new(
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Gpt2Config {
        Gpt2Config {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: 4 * n_embd,
            activation: Activation::Gelu,
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
            raw: Map::new(),
        }
    }

    /// Reads a `config.json` of `model_type` `gpt2`.
    ///
    /// # Errors
    /// [`Error::Format`] for text that is not JSON, a missing or mistyped field, another model
    /// type, sizes that do not fit together, or a GPT-2 variant this implementation does not
    /// compute (cross-attention, attention scaled by the layer index or not at all, reordered
    /// upcast attention).
    pub fn from_json(text: &str) -> Result<Gpt2Config> {
        let raw: Map<String, Value> =
            serde_json::from_str(text).map_err(|e| config_error(e.to_string()))?;
        let size = |key: &str| -> Result<usize> {
            raw.get(key)
                .and_then(Value::as_u64)
                .and_then(|v| usize::try_from(v).ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| {
                    config_error(format!(
                        "\"{key}\" must be a positive integer, found {:?}",
                        raw.get(key)
                    ))
                })
        };
        let flag = |key: &str, default: bool| -> Result<bool> {
            match raw.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_bool().ok_or_else(|| {
                    config_error(format!("\"{key}\" must be true or false, found {v}"))
                }),
            }
        };
        match raw.get("model_type") {
            Some(Value::String(t)) if t == "gpt2" => {}
            Some(other) => {
                return Err(unsupported(
                    "model_type",
                    other,
                    "this loader reads GPT-2 (\"gpt2\") directories",
                ));
            }
            None => return Err(config_error("\"model_type\" is missing")),
        }
        let n_embd = size("n_embd")?;
        let n_inner = match raw.get("n_inner") {
            None | Some(Value::Null) => 4 * n_embd,
            Some(_) => size("n_inner")?,
        };
        let activation = match raw.get("activation_function").and_then(Value::as_str) {
            None | Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => Activation::Gelu,
            Some("gelu") => Activation::GeluExact,
            Some("relu") => Activation::Relu,
            Some("silu" | "swish") => Activation::Silu,
            Some("tanh") => Activation::Tanh,
            Some("sigmoid") => Activation::Sigmoid,
            Some(_) => {
                return Err(unsupported(
                    "activation_function",
                    &raw["activation_function"],
                    "ndscope computes gelu_new, gelu, relu, silu, tanh and sigmoid",
                ));
            }
        };
        let layer_norm_epsilon = match raw.get("layer_norm_epsilon") {
            None => 1e-5,
            Some(v) => v
                .as_f64()
                .filter(|e| e.is_finite() && *e >= 0.0)
                .ok_or_else(|| {
                    config_error(format!(
                        "\"layer_norm_epsilon\" must be a number >= 0, found {v}"
                    ))
                })?,
        };
        for (key, unsupported_when, what) in [
            ("add_cross_attention", true, "cross-attention"),
            (
                "scale_attn_by_inverse_layer_idx",
                true,
                "attention scaled by the layer index",
            ),
            (
                "reorder_and_upcast_attn",
                true,
                "reordered, upcast attention",
            ),
            ("scale_attn_weights", false, "unscaled attention scores"),
        ] {
            if flag(key, !unsupported_when)? == unsupported_when {
                return Err(unsupported(
                    key,
                    &Value::from(unsupported_when),
                    format!("{what} is a GPT-2 variant ndscope does not compute"),
                ));
            }
        }
        let config = Gpt2Config {
            vocab_size: size("vocab_size")?,
            n_positions: size("n_positions")?,
            n_embd,
            n_layer: size("n_layer")?,
            n_head: size("n_head")?,
            n_inner,
            activation,
            layer_norm_epsilon,
            tie_word_embeddings: flag("tie_word_embeddings", true)?,
            raw,
        };
        if !config.n_embd.is_multiple_of(config.n_head) {
            return Err(config_error(format!(
                "\"n_embd\" ({}) must be a multiple of \"n_head\" ({})",
                config.n_embd, config.n_head
            )));
        }
        Ok(config)
    }

    /// Reads `path`, a `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; as for [`from_json`](Self::from_json).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Gpt2Config> {
        read_config(path.as_ref(), Gpt2Config::from_json)
    }

    /// The configuration as `config.json` text: every field the file it was read from held, with
    /// the sizes set to this configuration's.
    pub fn to_json(&self) -> String {
        let mut raw = self.raw.clone();
        let activation = match self.activation {
            Activation::Gelu => "gelu_new",
            Activation::GeluExact => "gelu",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
            Activation::Tanh => "tanh",
            Activation::Sigmoid => "sigmoid",
        };
        let fields = [
            ("model_type", Value::from("gpt2")),
            ("architectures", Value::from(vec!["GPT2LMHeadModel"])),
            ("vocab_size", Value::from(self.vocab_size)),
            ("n_positions", Value::from(self.n_positions)),
            ("n_embd", Value::from(self.n_embd)),
            ("n_layer", Value::from(self.n_layer)),
            ("n_head", Value::from(self.n_head)),
            // Null is transformers' way of saying four times the width.
            (
                "n_inner",
                if self.n_inner == 4 * self.n_embd {
                    Value::Null
                } else {
                    Value::from(self.n_inner)
                },
            ),
            ("activation_function", Value::from(activation)),
            ("layer_norm_epsilon", Value::from(self.layer_norm_epsilon)),
            ("tie_word_embeddings", Value::from(self.tie_word_embeddings)),
        ];
        for (key, value) in fields {
            raw.insert(key.to_string(), value);
        }
        serde_json::to_string_pretty(&Value::Object(raw)).expect("a JSON map serialises")
    }

    /// [`to_json`](Self::to_json) saying that the weights are stored as `stored` (`"dtype"`, and
    /// `"torch_dtype"` when the file had that older key): transformers loads a model in the dtype
    /// its config names, so a model loaded from bf16 and saved in f32 must not keep `"bfloat16"`.
    fn to_json_stored_as(&self, stored: DType) -> String {
        let name = torch_dtype_name(stored);
        let mut config = self.clone();
        config.raw.insert("dtype".into(), Value::from(name));
        if config.raw.contains_key("torch_dtype") {
            config.raw.insert("torch_dtype".into(), Value::from(name));
        }
        config.to_json()
    }

    /// The configuration of each block.
    pub fn block(&self) -> TransformerConfig {
        TransformerConfig {
            hidden: self.n_inner,
            activation: self.activation,
            norm_eps: self.layer_norm_epsilon,
            ..TransformerConfig::gpt2(self.n_embd, self.n_head)
        }
    }
}

/// A block parameter's name in Hugging Face's `GPT2Block` (`ln_1`, `attn.c_attn`, `attn.c_proj`,
/// `ln_2`, `mlp.c_fc`, `mlp.c_proj`) from [`TransformerBlock`]'s own.
fn hf_block_name(name: &str) -> String {
    const NAMES: [(&str, &str); 6] = [
        ("ln1", "ln_1"),
        ("attn.qkv", "attn.c_attn"),
        ("attn.proj", "attn.c_proj"),
        ("ln2", "ln_2"),
        ("fc1", "mlp.c_fc"),
        ("fc2", "mlp.c_proj"),
    ];
    for (ours, theirs) in NAMES {
        if let Some(rest) = name.strip_prefix(ours)
            && (rest.is_empty() || rest.starts_with('.'))
        {
            return format!("{theirs}{rest}");
        }
    }
    name.to_string()
}

/// GPT-2's language model: token and position embeddings, pre-norm blocks, a final layer norm, and
/// a head that is the token embedding (tied) or its own `[vocab, width]` matrix. Parameters are
/// named and laid out as in Hugging Face's `GPT2LMHeadModel` (`transformer.h.0.attn.c_attn.weight`,
/// `[in, out]`), so [`checkpoint::save`] writes a file transformers loads.
///
/// The tied head watches the embedding itself: its gradient is summed into the embedding's, and an
/// optimizer step updates the one tensor.
///
/// ```
/// use ndscope::models::Gpt2;
/// use ndscope::nn::Mode;
/// use ndscope::{DType, Device, Tape, root};
///
/// root(Device::Cpu, |model_scope| {
///     let gpt2 = Gpt2::from_pretrained(model_scope, "data/gpt2-tiny", DType::F32)?;
///     let loss = model_scope.scope(|batch| {
///         let tape = Tape::new(batch);
///         let ids = batch.from_slice(&[33i64, 292, 482, 308], &[1, 4])?;
///         let logits = gpt2.forward(&tape, &ids, Mode::Eval)?; // [1, 4, 1000]
///         let loss = Gpt2::loss(&logits, &ids)?;
///         let grads = tape.backward(&loss)?;
///         assert!(grads.get(&gpt2.wte.weight).is_some()); // embedding and tied head together
///         loss.value().to_scalar::<f32>()
///     })?;
///     assert!(loss > 0.0);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
pub struct Gpt2<'m> {
    /// Token embedding `[vocab, width]` (and the tied head). Empty (`[0]`) in a model loaded by
    /// [`from_gguf_quantized`](Gpt2::from_gguf_quantized) whose file stores the table
    /// block-quantized: see [`wte_blocks`](Gpt2::wte_blocks).
    pub wte: Embedding<'m>,
    /// The token table's blocks, when a GGUF file's is kept quantized (frozen: no parameter).
    wte_blocks: Option<QuantTensor<'m>>,
    /// Position embedding `[n_positions, width]`.
    pub wpe: PositionalEmbedding<'m>,
    /// The blocks.
    pub blocks: Vec<TransformerBlock<'m>>,
    /// The final layer norm.
    pub ln_f: LayerNorm<'m>,
    /// The head `[vocab, width]` when it is not tied to `wte`.
    pub lm_head: Option<Tensor<'m>>,
    config: Gpt2Config,
    /// Whether [`forward`](Gpt2::forward) recomputes each block on a recording tape.
    recompute: bool,
    /// Whether some block matrices are block-quantized
    /// ([`from_gguf_quantized`](Gpt2::from_gguf_quantized)): frozen, and not saved as safetensors.
    quantized: bool,
}

impl<'m> Gpt2<'m> {
    /// A model of `config` in `scope` with Hugging Face's initialisation (normal, std 0.02;
    /// layer norms at one and zero; zero biases).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for sizes that do not fit; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, config: Gpt2Config) -> Result<Gpt2<'m>> {
        let init = Init::Normal(0.02);
        let c = &config;
        let blocks = (0..c.n_layer)
            .map(|_| TransformerBlock::with_config(scope, &c.block(), init))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt2 {
            wte: Embedding::new(scope, c.vocab_size, c.n_embd, init)?,
            wte_blocks: None,
            wpe: PositionalEmbedding::new(scope, c.n_positions, c.n_embd, init)?,
            blocks,
            ln_f: LayerNorm::with_options(scope, c.n_embd, c.layer_norm_epsilon, true)?,
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(
                    init.tensor(scope, &[c.vocab_size, c.n_embd])?
                        .named("lm_head"),
                )
            },
            config,
            recompute: false,
            quantized: false,
        })
    }

    /// The model of a Hugging Face GPT-2 directory (`config.json` and `model.safetensors`, or a
    /// sharded checkpoint's index), its parameters as `dtype` in `scope`. Each tensor is copied
    /// once from the memory-mapped file.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Format`] for the files; [`Error::MissingTensor`] and
    /// [`Error::TensorMismatch`] for a checkpoint that does not fit the configuration.
    #[track_caller]
    pub fn from_pretrained(
        scope: &Scope<'m>,
        dir: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<Gpt2<'m>> {
        let dir = dir.as_ref();
        let config = Gpt2Config::from_file(dir.join("config.json"))?;
        Gpt2::load(scope, &Weights::open(dir)?, config, dtype)
    }

    /// Loads a GGUF file of architecture `gpt2` (llama.cpp's converter and `llama-quantize`
    /// write them) as `dtype` in `scope`: its metadata as the config, block-quantized tensors
    /// decoded to `dtype` on load, names and layouts mapped back to transformers'.
    ///
    /// ```
    /// use ndscope::models::Gpt2;
    /// use ndscope::{DType, Device, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let gpt2 = Gpt2::from_gguf(m, "data/gguf/gpt2-tiny-Q4_0.gguf", DType::F32)?;
    ///     assert_eq!(gpt2.config().n_layer, 2);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Io`] and [`Error::Format`] for a file that cannot be read or is not GGUF;
    /// [`Error::UnsupportedConfig`](crate::Error::UnsupportedConfig) naming a metadata key the
    /// model does not compute; as for [`load`](Self::load).
    #[track_caller]
    pub fn from_gguf(scope: &Scope<'m>, path: impl AsRef<Path>, dtype: DType) -> Result<Gpt2<'m>> {
        Gpt2::from_gguf_weights(scope, &Weights::open(path)?, dtype, false)
    }

    /// Loads a GGUF file as [`from_gguf`](Self::from_gguf) does, but keeps the blocks' quantized
    /// matrices in their blocks ([`Linear::from_quantized`](crate::nn::Linear::from_quantized));
    /// the embeddings (looked up row by row, and the tied output head), norms and biases load as
    /// `dtype`. The quantized matrices are frozen; [`save_pretrained`](Self::save_pretrained)
    /// refuses the model.
    ///
    /// ```
    /// use ndscope::models::Gpt2;
    /// use ndscope::{DType, Device, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let gpt2 = Gpt2::from_gguf_quantized(m, "data/gguf/gpt2-tiny-Q8_0.gguf", DType::F32)?;
    ///     assert!(gpt2.blocks[0].fc1.quantized_weight().is_some());
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`from_gguf`](Self::from_gguf).
    #[track_caller]
    pub fn from_gguf_quantized(
        scope: &Scope<'m>,
        path: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<Gpt2<'m>> {
        Gpt2::from_gguf_weights(scope, &Weights::open(path)?, dtype, true)
    }

    /// [`from_gguf`](Self::from_gguf) of a GGUF file already open as `weights`, its blocks'
    /// quantized matrices kept in their blocks if `quantized`.
    #[track_caller]
    pub(crate) fn from_gguf_weights(
        scope: &Scope<'m>,
        weights: &Weights,
        dtype: DType,
        quantized: bool,
    ) -> Result<Gpt2<'m>> {
        let config = super::gguf::gpt2_config(weights)?;
        let weights = super::gguf::gpt2_weights(weights);
        Gpt2::load_with(scope, &weights, config, dtype, quantized)
    }

    /// The model of `config` with its parameters from `weights` (named as Hugging Face names
    /// them), as `dtype` in `scope`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] and [`Error::TensorMismatch`] for a checkpoint that does not fit
    /// the configuration; allocation errors.
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        config: Gpt2Config,
        dtype: DType,
    ) -> Result<Gpt2<'m>> {
        Gpt2::load_with(scope, weights, config, dtype, false)
    }

    /// [`load`](Self::load), keeping the blocks' quantized matrices in their blocks if
    /// `quantized`.
    #[track_caller]
    fn load_with(
        scope: &Scope<'m>,
        weights: &Weights,
        config: Gpt2Config,
        dtype: DType,
        quantized: bool,
    ) -> Result<Gpt2<'m>> {
        let c = &config;
        // Dumps list the parameters at the caller's line, each under its checkpoint name.
        let weights = &weights.loaded_from(std::panic::Location::caller());
        // Some exporters write the names without the "transformer." prefix.
        let body = if weights.contains("transformer.wte.weight") || !weights.contains("wte.weight")
        {
            weights.prefix("transformer")
        } else {
            weights.clone()
        };
        // In the checkpoint's order, so a mismatch names the first tensor that differs.
        let (wte, wte_blocks) = token_table::load(
            scope,
            &body.prefix("wte"),
            (c.vocab_size, c.n_embd),
            dtype,
            quantized,
        )?;
        let wpe =
            PositionalEmbedding::load(scope, &body.prefix("wpe"), c.n_positions, c.n_embd, dtype)?;
        let blocks = (0..c.n_layer)
            .map(|i| {
                let block = body.prefix(&format!("h.{i}")).renamed(hf_block_name);
                TransformerBlock::load_keeping_blocks(scope, &block, &c.block(), dtype, quantized)
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::load(
            scope,
            &body.prefix("ln_f"),
            c.n_embd,
            c.layer_norm_epsilon,
            true,
            dtype,
        )?;
        let head_shape = [c.vocab_size, c.n_embd];
        let mut config = config;
        let lm_head = if wte_blocks.is_none() {
            output_head(
                scope,
                weights,
                "lm_head.weight",
                &wte.weight,
                &mut config.tie_word_embeddings,
                dtype,
            )?
        } else if weights.contains("lm_head.weight") {
            // A quantized file's converter writes no copy of a tied table: this head is untied
            // (and decoded: the public field is a dense tensor).
            config.tie_word_embeddings = false;
            Some(weights.tensor(scope, "lm_head.weight", &head_shape, dtype)?)
        } else {
            None
        };
        let quantized =
            wte_blocks.is_some() || blocks.iter().any(TransformerBlock::holds_quantized_weights);
        Ok(Gpt2 {
            wte,
            wte_blocks,
            wpe,
            blocks,
            ln_f,
            lm_head,
            config,
            recompute: false,
            quantized,
        })
    }

    /// Writes a Hugging Face model directory: `config.json` and `model.safetensors` (HF's names
    /// and layouts; a tied head is not stored, as `save_pretrained` does). Transformers'
    /// `GPT2LMHeadModel.from_pretrained(dir)` loads it; so does [`from_pretrained`](Self::from_pretrained).
    ///
    /// Each file is replaced atomically ([`checkpoint::write_atomically`]): a crash or a full disk
    /// during the save leaves each file whole, old or new.
    ///
    /// # Errors
    /// [`Error::Io`] when the directory or its files cannot be written.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        super::refuse_quantized_save("Gpt2::save_pretrained", self.quantized)?;
        let io = |e: std::io::Error| Error::io(dir, e);
        std::fs::create_dir_all(dir).map_err(io)?;
        // A crash between the two files leaves one old and one new, each whole; `from_pretrained`
        // checks every tensor's shape against the config, so a mismatch is an error, not a mix.
        checkpoint::save(self, dir.join("model.safetensors"))?;
        let stored = self.config.to_json_stored_as(self.wte.weight.dtype());
        checkpoint::write_atomically(dir.join("config.json"), stored.as_bytes())
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// Recomputes every block in [`forward`](Self::forward) on a recording tape (off by default;
    /// activation checkpointing, in PyTorch's words): a block's activations are freed when it
    /// returns and recomputed during the backward pass (see [`Var::recompute`]), so a training
    /// step keeps one block's activations at a time plus
    /// the blocks' inputs, for about one more forward pass of compute. The loss and gradients are
    /// the same bit for bit on the host.
    pub fn set_recompute(&mut self, on: bool) {
        self.recompute = on;
    }

    /// Whether [`set_recompute`](Self::set_recompute) is on.
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    /// The former name of [`set_recompute`](Self::set_recompute).
    #[deprecated(note = "renamed `set_recompute`: \"checkpoint\" names checkpoint files")]
    pub fn set_checkpointing(&mut self, on: bool) {
        self.set_recompute(on);
    }

    /// The former name of [`recomputes`](Self::recomputes).
    #[deprecated(note = "renamed `recomputes`: \"checkpoint\" names checkpoint files")]
    pub fn checkpointing(&self) -> bool {
        self.recomputes()
    }

    /// The logits `[batch, len, vocab]` of token ids `[batch, len]` (`i64`, `len <=
    /// n_positions`), recorded on `tape`. Dropout is off in this implementation whatever `mode`
    /// (GPT-2's checkpoints are fine-tuned without it here); `mode` is passed to the layers.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for ids that are not `[batch, len]` or a sequence longer than the
    /// position table; [`Error::IndexOutOfRange`] for an id outside the vocabulary.
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
        let &[batch, len] = ids.shape() else {
            return Err(Error::InvalidShape {
                op: "Gpt2::forward",
                shape: ids.shape().to_vec(),
                reason: "needs token ids of shape [batch, len]".into(),
            });
        };
        let mut x = self.wpe.forward(&self.token_table().forward(tape, ids)?)?;
        for block in &self.blocks {
            x = if self.recompute {
                Recomputed::new(block.clone()).forward(&x, mode)?
            } else {
                block.forward(&x, mode)?
            };
        }
        let x = self
            .ln_f
            .forward(&x, mode)?
            .reshape(&[batch * len, self.config.n_embd])?;
        self.head(&x)?
            .reshape(&[batch, len, self.config.vocab_size])
    }

    /// The language-modelling loss as transformers computes it from `labels = input_ids`: see
    /// [`next_token_loss`].
    ///
    /// # Errors
    /// As for [`next_token_loss`].
    #[track_caller]
    pub fn loss<'t, 's>(logits: &Var<'t, 's>, labels: &Tensor<'s>) -> Result<Var<'t, 's>> {
        next_token_loss(logits, labels)
    }

    /// `prompt` followed by up to `new_tokens` greedy tokens (the most likely next token each
    /// step), stopping after `stop` if it is given and generated. Each step runs the whole window
    /// (the last `n_positions` tokens) in a scope of its own, so memory stays that of one forward —
    /// and work grows with the square of the length: [`serve::generate`](crate::serve::generate)
    /// decodes against a KV cache instead (one token per step) and samples too. This stays as the
    /// cache-free reference the cached path is tested against.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for an empty prompt; as for [`forward`](Self::forward).
    pub fn greedy<'a>(
        &self,
        scope: &Scope<'a>,
        prompt: &[i64],
        new_tokens: usize,
        stop: Option<i64>,
    ) -> Result<Vec<i64>>
    where
        'm: 'a,
    {
        if prompt.is_empty() {
            return Err(Error::InvalidShape {
                op: "Gpt2::greedy",
                shape: vec![0],
                reason: "needs a prompt of at least one token".into(),
            });
        }
        let mut tokens = prompt.to_vec();
        for _ in 0..new_tokens {
            let window = &tokens[tokens.len().saturating_sub(self.config.n_positions)..];
            let next = scope.scope(|step| -> Result<i64> {
                let tape = Tape::no_grad(step);
                let ids = step.from_slice(window, &[1, window.len()])?;
                let logits = self.forward(&tape, &ids, Mode::Eval)?;
                let last = logits.value().narrow(1, window.len() - 1, 1)?;
                last.argmax(-1, false)?
                    .flatten()?
                    .to_vec::<i64>()
                    .map(|v| v[0])
            })?;
            tokens.push(next);
            if Some(next) == stop {
                break;
            }
        }
        Ok(tokens)
    }

    /// The token table's blocks (`[vocab, width]`) in a model loaded by
    /// [`from_gguf_quantized`](Self::from_gguf_quantized) from a file that stores it
    /// block-quantized; `None` when the table is [`wte`](Self::wte).
    pub fn wte_blocks(&self) -> Option<&QuantTensor<'m>> {
        self.wte_blocks.as_ref()
    }

    /// The token table: dense, or its blocks.
    fn token_table(&self) -> TokenTable<'_, 'm> {
        TokenTable {
            dense: &self.wte,
            blocks: self.wte_blocks.as_ref(),
        }
    }

    /// The output head over rows `[n, width]` (normalised): its own matrix, or the embedding
    /// itself (one parameter, one gradient).
    fn head<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match &self.lm_head {
            Some(head) => x.matmul(&x.tape().param(head).t()?),
            None => self.token_table().tied_head(x),
        }
    }
}

/// Decoding against KV caches: only the new tokens run through the model; each layer's attention
/// reads the earlier tokens' keys and values from the caches' blocks. The new tokens of all
/// sequences are packed into one `[rows, width]` batch (layer norms, projections and the MLP act on
/// rows), so sequences of different lengths, prompts and single decoded tokens share one pass.
impl<'m> CausalLm<'m> for Gpt2<'m> {
    fn kv_shape(&self) -> KvShape {
        let c = &self.config;
        KvShape {
            layers: c.n_layer,
            heads: c.n_head,
            head_width: c.n_embd / c.n_head,
            dtype: self.wte.weight.dtype(),
        }
    }

    fn max_positions(&self) -> usize {
        self.config.n_positions
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
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
        let embedded = self
            .token_table()
            .forward(&Tape::no_grad(tape.scope()), ids)?
            .value()
            .add(&self.wpe.weight.index_select(0, positions)?)?;
        let mut x = tape.constant(&embedded);
        for (layer, block) in self.blocks.iter().enumerate() {
            x = block.forward_paged(&x, kv, layer)?;
        }
        Ok(x)
    }

    fn logits<'t, 's>(&self, hidden: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.head(&self.ln_f.forward(hidden, Mode::Eval)?)
    }
}

/// Hugging Face's names: `transformer.{wte,wpe,h.N,ln_f}...` and, untied, `lm_head.weight`.
impl<'m> Parameters<'m> for Gpt2<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        let body = format!("{prefix}transformer.");
        if self.wte_blocks.is_none() {
            self.wte.visit(&format!("{body}wte."), f);
        }
        self.wpe.visit(&format!("{body}wpe."), f);
        for (i, block) in self.blocks.iter().enumerate() {
            block.visit("", &mut |name, t| {
                f(&format!("{body}h.{i}.{}", hf_block_name(name)), t)
            });
        }
        self.ln_f.visit(&format!("{body}ln_f."), f);
        self.lm_head.visit(&format!("{prefix}lm_head.weight"), f);
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        if self.wte_blocks.is_none() {
            self.wte.visit_mut(f)?;
        }
        self.wpe.visit_mut(f)?;
        self.blocks.visit_mut(f)?;
        self.ln_f.visit_mut(f)?;
        self.lm_head.visit_mut(f)
    }
}

impl<'m> Movable<'m> for Gpt2<'m> {
    type Moved<'b> = Gpt2<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Gpt2<'b>> {
        Ok(Gpt2 {
            wte: self.wte.move_into(target)?,
            wte_blocks: self.wte_blocks.move_into(target)?,
            wpe: self.wpe.move_into(target)?,
            blocks: self.blocks.move_into(target)?,
            ln_f: self.ln_f.move_into(target)?,
            lm_head: self.lm_head.move_into(target)?,
            config: self.config,
            recompute: self.recompute,
            quantized: self.quantized,
        })
    }
}

/// A model shared by threads: `Gpt2<'static>` is `Sync`.
impl<'m> MoveOut<'m> for Gpt2<'m> {
    fn move_out(self) -> Result<Gpt2<'static>> {
        Ok(Gpt2 {
            wte: self.wte.move_out()?,
            wte_blocks: self.wte_blocks.move_out()?,
            wpe: self.wpe.move_out()?,
            blocks: self.blocks.move_out()?,
            ln_f: self.ln_f.move_out()?,
            lm_head: self.lm_head.move_out()?,
            config: self.config,
            recompute: self.recompute,
            quantized: self.quantized,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_names_map_to_hugging_face_names() {
        assert_eq!(hf_block_name("ln1.weight"), "ln_1.weight");
        assert_eq!(hf_block_name("attn.qkv.bias"), "attn.c_attn.bias");
        assert_eq!(hf_block_name("attn.proj.weight"), "attn.c_proj.weight");
        assert_eq!(hf_block_name("fc2.weight"), "mlp.c_proj.weight");
        assert_eq!(hf_block_name("fc10.weight"), "fc10.weight");
    }

    #[test]
    fn config_errors_name_the_field() {
        let good = r#"{"model_type": "gpt2", "vocab_size": 10, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}"#;
        let config = Gpt2Config::from_json(good).unwrap();
        assert_eq!((config.n_inner, config.activation), (32, Activation::Gelu));
        assert_eq!(
            Gpt2Config::from_json(&config.to_json()).unwrap(),
            Gpt2Config {
                raw: Gpt2Config::from_json(&config.to_json()).unwrap().raw,
                ..config
            }
        );
        for (text, says) in [
            ("{", "EOF"),
            (
                r#"{"model_type": "llama"}"#,
                "unsupported: model_type = \"llama\"",
            ),
            (
                &good.replace("\"n_head\": 2", "\"n_head\": 3"),
                "multiple of \"n_head\"",
            ),
            (
                &good.replace("\"n_embd\": 8", "\"n_embd\": \"8\""),
                "\"n_embd\" must be a positive integer",
            ),
            (
                &good.replace("}", ", \"activation_function\": \"gelu_10\"}"),
                "gelu_10",
            ),
            (
                &good.replace("}", ", \"scale_attn_by_inverse_layer_idx\": true}"),
                "layer index",
            ),
        ] {
            let err = Gpt2Config::from_json(text).unwrap_err();
            // What ndscope does not compute is named as unsupported; what is malformed, as a format
            // error.
            let unsupported = ["llama", "gelu_10", "layer index"]
                .iter()
                .any(|u| says.contains(u));
            assert!(
                if unsupported {
                    matches!(err, Error::UnsupportedConfig { .. })
                } else {
                    matches!(
                        err,
                        Error::Format {
                            format: "config.json",
                            ..
                        }
                    )
                },
                "{err}"
            );
            assert!(err.to_string().contains(says), "{err} should say {says}");
        }
    }
}
