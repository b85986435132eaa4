//! The Llama family's decoder (Llama 2/3, and the Mistral and Qwen2 variants' shared shape):
//! token embedding, blocks of pre-norm grouped-query attention with rotary positions and a SwiGLU
//! MLP, a final RMSNorm and the output head, loaded from a Hugging Face directory under
//! transformers' names: the training forward pass, and cached decoding through the KV pages
//! (`CausalLm`), so `serve::generate` and the engine run it as they run GPT-2.

use std::panic::Location;
use std::path::Path;

use super::token_table::{self, TokenTable};
use super::{next_token_loss, output_head};
use crate::autograd::{Segment, Tape, Var};
use crate::checkpoint;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvShape, KvStep};
use crate::models::LlamaConfig;
use crate::nn::{
    Embedding, GatedMlp, GroupedQueryAttention, Linear, Mode, Module, Parameters, RmsNorm,
    RopeScaling, RotaryEmbedding, WeightLayout, dynamic_theta, inverse_frequencies, layer_parts,
};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::{QuantTensor, Tensor};
use crate::weights::Weights;

/// One decoder block: `h = x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
struct Block<'m> {
    input_layernorm: RmsNorm<'m>,
    self_attn: GroupedQueryAttention<'m>,
    post_attention_layernorm: RmsNorm<'m>,
    mlp: GatedMlp<'m>,
}

impl<'m> Block<'m> {
    /// The block with its attention computed by `attend` from the normalised input.
    fn forward_with<'t, 's>(
        &self,
        x: &Var<'t, 's>,
        mode: Mode,
        attend: impl FnOnce(&Var<'t, 's>) -> Result<Var<'t, 's>>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let x = x.add(&attend(&self.input_layernorm.forward(x, mode)?)?)?;
        let h = self.post_attention_layernorm.forward(&x, mode)?;
        x.add(&self.mlp.forward(&h, mode)?)
    }

    /// The block over whole sequences, its attention rotating by `rope` at `positions`.
    fn run<'t, 's, 'r>(
        &self,
        x: &Var<'t, 's>,
        rope: &RotaryEmbedding<'r>,
        positions: &Tensor<'s>,
        mode: Mode,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
        'r: 's,
    {
        self.forward_with(x, mode, |h| {
            self.self_attn.forward(h, rope, positions, mode)
        })
    }
}

layer_parts!(Block {
    tensors: [],
    layers: [input_layernorm, self_attn, post_attention_layernorm, mlp],
    plain: []
});

/// A Llama-family causal language model with its parameters in the model scope `'m`.
#[derive(Debug, Clone)]
pub struct Llama<'m> {
    /// The token table; an empty one when it is kept in `embed_blocks`.
    embed: Embedding<'m>,
    /// The token table's blocks, when a GGUF file's is kept quantized.
    embed_blocks: Option<QuantTensor<'m>>,
    blocks: Vec<Block<'m>>,
    norm: RmsNorm<'m>,
    /// The output head; `None` when tied to the embedding.
    lm_head: Option<Linear<'m>>,
    rope: RotaryEmbedding<'m>,
    config: LlamaConfig,
    /// Whether [`forward`](Llama::forward) recomputes each block in the backward pass.
    recompute: bool,
    /// Whether some weights are block-quantized (loaded by
    /// [`from_gguf_quantized`](Llama::from_gguf_quantized)): frozen, and not saved as safetensors.
    quantized: bool,
}

impl<'m> Llama<'m> {
    /// Loads a Hugging Face directory (`config.json` and `model.safetensors` or its shards) as
    /// `dtype` in `scope`; a file (rather than a directory) loads as GGUF
    /// ([`from_gguf`](Self::from_gguf)).
    ///
    /// # Errors
    /// As for [`LlamaConfig::from_file`] and [`load`](Self::load); [`Error::Io`].
    #[track_caller]
    pub fn from_pretrained(
        scope: &Scope<'m>,
        dir: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<Llama<'m>> {
        let dir = dir.as_ref();
        if dir.is_file() {
            return Llama::from_gguf(scope, dir, dtype);
        }
        let config = LlamaConfig::from_file(dir.join("config.json"))?;
        Llama::load(scope, &Weights::open(dir)?, config, dtype)
    }

    /// Loads a GGUF file of architecture `llama` (Llama 2 and 3, Mistral, SmolLM, TinyLlama) or
    /// `qwen2`, as llama.cpp's converter and `llama-quantize` write them, as `dtype` in `scope`:
    /// its metadata as the config (see [`config`](Self::config)), block-quantized tensors decoded
    /// to `dtype` on load, names and layouts mapped back to transformers'. The tokenizer is
    /// [`Tokenizer::from_gguf`](crate::data::Tokenizer::from_gguf).
    ///
    /// ```
    /// use ndscope::models::Llama;
    /// use ndscope::{DType, Device, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let llama = Llama::from_gguf(m, "data/gguf/llama-tiny-Q8_0.gguf", DType::F32)?;
    ///     assert_eq!(llama.config().num_key_value_heads, 2);
    ///     assert_eq!(llama.config().eos_token_ids, [1, 4]); // eos, and <|eot_id|> as llama.cpp
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Io`] and [`Error::Format`](crate::Error::Format) for a file that cannot be read
    /// or is not GGUF; [`Error::UnsupportedConfig`](crate::Error::UnsupportedConfig) naming a
    /// metadata key the model does not compute; as for [`load`](Self::load).
    #[track_caller]
    pub fn from_gguf(scope: &Scope<'m>, path: impl AsRef<Path>, dtype: DType) -> Result<Llama<'m>> {
        Llama::from_gguf_weights(scope, &Weights::open(path)?, dtype, false)
    }

    /// Loads a GGUF file as [`from_gguf`](Self::from_gguf) does, but keeps every block-quantized
    /// matrix (the projections, the token table, the output head) in its blocks: a Q4_0 model
    /// holds about an eighth of the bytes of `f32`, and its products read them
    /// ([`Linear::from_quantized`]). Tensors stored as plain floats (the norms; a matrix whose rows
    /// are not whole blocks, which llama-quantize leaves in F16) load as `dtype`, the dtype the
    /// model computes in. The quantized weights are frozen: the model runs inference, or trains
    /// the layers that are not quantized; [`save_pretrained`](Self::save_pretrained) refuses it.
    ///
    /// ```
    /// use ndscope::models::Llama;
    /// use ndscope::nn::Parameters;
    /// use ndscope::{DType, Device, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let decoded = Llama::from_gguf(m, "data/gguf/llama-tiny-Q8_0.gguf", DType::F32)?;
    ///     let llama = Llama::from_gguf_quantized(m, "data/gguf/llama-tiny-Q8_0.gguf", DType::F32)?;
    ///     // What remains parameters: the norms, and the two MLP matrices whose rows (176 values)
    ///     // are not whole blocks, which the converter stored in F16; the rest are Q8_0 blocks.
    ///     assert_eq!(llama.parameter_elements(), 22_848);
    ///     assert!(decoded.parameter_elements() > 8 * 22_848);
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
    ) -> Result<Llama<'m>> {
        Llama::from_gguf_weights(scope, &Weights::open(path)?, dtype, true)
    }

    /// [`from_gguf`](Self::from_gguf) of a GGUF file already open as `weights`, its quantized
    /// matrices kept in their blocks if `quantized`.
    #[track_caller]
    pub(crate) fn from_gguf_weights(
        scope: &Scope<'m>,
        weights: &Weights,
        dtype: DType,
        quantized: bool,
    ) -> Result<Llama<'m>> {
        let config = super::gguf::llama_config(weights)?;
        let weights = super::gguf::llama_weights(weights, &config);
        Llama::load_with(scope, &weights, config, dtype, quantized)
    }

    /// The model of `config` with its parameters from `weights` (transformers' names), as `dtype`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] and [`Error::TensorMismatch`] for a checkpoint that does not fit;
    /// allocation errors.
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        config: LlamaConfig,
        dtype: DType,
    ) -> Result<Llama<'m>> {
        Llama::load_with(scope, weights, config, dtype, false)
    }

    /// [`load`](Self::load), keeping block-quantized matrices in their blocks if `quantized`.
    #[track_caller]
    fn load_with(
        scope: &Scope<'m>,
        weights: &Weights,
        config: LlamaConfig,
        dtype: DType,
        quantized: bool,
    ) -> Result<Llama<'m>> {
        // A window as long as the context changes nothing: computed as no window.
        let window = config
            .sliding_window
            .filter(|&w| w < config.max_position_embeddings);
        let weights = &weights.loaded_from(Location::caller());
        let c = &config;
        let (hidden, heads, kv_heads, d) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let body = weights.prefix("model");
        // Whether the matrix `name` (under `w`) stays in its blocks.
        let kept = std::cell::Cell::new(false);
        let keep = |w: &Weights, name: &str| -> Result<bool> {
            let keep = quantized && w.quantized(name)?.is_some();
            kept.set(kept.get() || keep);
            Ok(keep)
        };
        let linear = |w: &Weights, name: &str, inputs: usize, outputs: usize, bias: bool| {
            let w = w.prefix(name);
            let layout = WeightLayout::OutIn;
            let keep = keep(&w, "weight")?;
            Linear::load_keeping_blocks(scope, &w, inputs, outputs, bias, layout, dtype, keep)
        };
        let norm = |w: &Weights, name: &str| {
            RmsNorm::load(scope, &w.prefix(name), hidden, c.rms_norm_eps, dtype)
        };
        let table = body.prefix("embed_tokens");
        let keep_table = keep(&table, "weight")?;
        let (embed, embed_blocks) =
            token_table::load(scope, &table, (c.vocab_size, hidden), dtype, keep_table)?;
        let mut blocks = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let b = body.prefix(&format!("layers.{i}"));
            let attn = b.prefix("self_attn");
            let mlp = b.prefix("mlp");
            blocks.push(Block {
                input_layernorm: norm(&b, "input_layernorm")?,
                self_attn: GroupedQueryAttention::from_parts(
                    linear(&attn, "q_proj", hidden, heads * d, c.attention_bias)?,
                    linear(&attn, "k_proj", hidden, kv_heads * d, c.attention_bias)?,
                    linear(&attn, "v_proj", hidden, kv_heads * d, c.attention_bias)?,
                    linear(&attn, "o_proj", heads * d, hidden, false)?,
                    heads,
                    kv_heads,
                )?
                .with_window(window)?,
                post_attention_layernorm: norm(&b, "post_attention_layernorm")?,
                mlp: GatedMlp::from_parts(
                    linear(&mlp, "gate_proj", hidden, c.intermediate_size, false)?,
                    linear(&mlp, "up_proj", hidden, c.intermediate_size, false)?,
                    linear(&mlp, "down_proj", c.intermediate_size, hidden, false)?,
                )?,
            });
        }
        let final_norm = norm(&body, "norm")?;
        let rope = rotary_tables(scope, c, dtype)?;
        let vocab = c.vocab_size;
        let mut config = config;
        // A file holding an output head of its own is untied; a quantized file's converter writes
        // no copy of a tied table, a safetensors checkpoint may (compared by `output_head`).
        let head_kept = weights.contains("lm_head.weight") && keep(weights, "lm_head.weight")?;
        let lm_head = if embed_blocks.is_none() && !head_kept {
            output_head(
                scope,
                weights,
                "lm_head.weight",
                &embed.weight,
                &mut config.tie_word_embeddings,
                dtype,
            )?
            .map(|w| Linear::from_tensors(w, None, WeightLayout::OutIn))
            .transpose()?
        } else if weights.contains("lm_head.weight") {
            config.tie_word_embeddings = false;
            Some(linear(weights, "lm_head", hidden, vocab, false)?)
        } else {
            None
        };

        Ok(Llama {
            embed,
            embed_blocks,
            blocks,
            norm: final_norm,
            lm_head,
            rope,
            config,
            recompute: false,
            quantized: kept.get(),
        })
    }

    /// Writes the model as a Hugging Face directory: `model.safetensors` (transformers' names, a
    /// tied head not stored) and `config.json` ([`LlamaConfig::to_json`], with `dtype` the dtype
    /// the weights are stored in). transformers' `AutoModelForCausalLM.from_pretrained(dir)` loads
    /// it; so does [`from_pretrained`](Self::from_pretrained). Tokenizer files are not the model's:
    /// copy them beside it.
    ///
    /// Each file is replaced atomically ([`checkpoint::write_atomically`]): a crash or a full disk
    /// during the save leaves each file whole, old or new.
    ///
    /// # Errors
    /// [`Error::Io`] when the directory or its files cannot be written.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        super::refuse_quantized_save("Llama::save_pretrained", self.quantized)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        // A crash between the two files leaves one old and one new, each whole; `from_pretrained`
        // checks every tensor's shape against the config, so a mismatch is an error, not a mix.
        checkpoint::save(self, dir.join("model.safetensors"))?;
        let config = self.config.to_json_stored_as(self.embed.weight.dtype());
        checkpoint::write_atomically(dir.join("config.json"), config.as_bytes())
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Activation checkpointing: with `on`, [`forward`](Self::forward) keeps only each block's
    /// input on a recording tape and recomputes the block during the backward pass (see
    /// [`Var::recompute`]), so a training step holds one block's activations instead of all of
    /// them, for about one more forward pass of compute. Gradients are the same.
    pub fn set_recompute(&mut self, on: bool) {
        self.recompute = on;
    }

    /// Whether [`set_recompute`](Self::set_recompute) is on.
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    /// Keeps the rotary rows (RoPE cosines and sines) of the first `positions` positions, at most
    /// `max_position_embeddings`, in `scope` (the model's): a pass whose tokens reach further
    /// computes the rows it needs, the same bits, each time. A model keeps 8,192 positions when
    /// loaded (2 MiB at 64-wide heads; Llama 3's 131,072 would be 34 MB): keep more where long
    /// contexts are the rule, fewer to save memory.
    ///
    /// ```
    /// # use ndscope::{root, DType, Device, Tape, models::Llama, nn::Mode};
    /// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/data/llama-tiny");
    /// root(Device::Cpu, |m| {
    ///     let mut llama = Llama::from_pretrained(m, dir, DType::F32)?;
    ///     llama.keep_rotary_rows(m, 16)?;
    ///     assert_eq!(llama.rotary_rows(), 16);
    ///     // 40 tokens pass the table: the rows past 16 are computed for the pass.
    ///     let ids = m.from_slice(&[1i64; 40], &[1, 40])?;
    ///     let tape = Tape::no_grad(m);
    ///     let logits = llama.forward(&tape, &ids, Mode::Eval)?;
    ///     assert_eq!(logits.shape(), &[1, 40, llama.config().vocab_size]);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<_, ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// Allocation errors.
    pub fn keep_rotary_rows(&mut self, scope: &Scope<'m>, positions: usize) -> Result<()> {
        let rows = positions.min(self.config.max_position_embeddings);
        self.rope = self.rope_angles()?.table(scope, rows)?;
        Ok(())
    }

    /// The positions whose rotary rows the model keeps ([`keep_rotary_rows`](Self::keep_rotary_rows)).
    pub fn rotary_rows(&self) -> usize {
        self.rope.max_positions()
    }

    /// The next-token loss of `logits` `[batch, len, vocab]` against `labels = input_ids`
    /// (`[batch, len]`), as transformers computes it: see [`next_token_loss`].
    ///
    /// # Errors
    /// As for [`next_token_loss`].
    #[track_caller]
    pub fn loss<'t, 's>(logits: &Var<'t, 's>, labels: &Tensor<'s>) -> Result<Var<'t, 's>> {
        next_token_loss(logits, labels)
    }

    /// The logits `[batch, len, vocab]` of token ids `[batch, len]` (`i64`), every sequence
    /// starting at position 0, each position seeing itself and the earlier ones.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for ids that are not `[batch, len]` or longer than the position
    /// table; [`Error::IndexOutOfRange`] for an id outside the vocabulary.
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
                op: "Llama::forward",
                shape: ids.shape().to_vec(),
                reason: "token ids must be [batch, len]".into(),
            });
        };
        if len > self.max_positions() {
            return Err(Error::InvalidShape {
                op: "Llama::forward",
                shape: ids.shape().to_vec(),
                reason: format!(
                    "{len} tokens do not fit the model's {} positions (max_position_embeddings, \
                     times a dynamic RoPE factor)",
                    self.max_positions()
                ),
            });
        }
        let mut x = self.token_table().forward(tape, ids)?;
        let dynamic = self.dynamic_rope();
        let past = match len > self.rope.max_positions() {
            true => Some(self.rope_angles()?),
            false => None,
        };
        for block in &self.blocks {
            x = if self.recompute {
                // The segment outlives this call (the backward pass runs it): counted handles.
                x.recompute(InSequence {
                    block: block.clone(),
                    rope: self.rope.clone(),
                    dynamic,
                    past: past.clone(),
                    mode,
                })?
            } else {
                InSequence {
                    block,
                    rope: &self.rope,
                    dynamic,
                    past: past.clone(),
                    mode,
                }
                .forward(&x)?
            };
        }
        let x = self.norm.forward(&x, mode)?;
        let rows = x.reshape(&[batch * len, self.config.hidden_size])?;
        self.head(&rows, mode)?
            .reshape(&[batch, len, self.config.vocab_size])
    }

    /// The angles of the model's rotary rows, for rows past its table.
    fn rope_angles(&self) -> Result<RopeAngles> {
        RopeAngles::of(&self.config, self.rope.cos().dtype())
    }

    /// One rotary row per packed new token (sequence `s` has `new[s]` tokens from position
    /// `starts[s]`) and the positions `0..rows` that read them, when a token's position is past
    /// the model's table; `None` when the table serves.
    fn rows_past_table<'s>(
        &self,
        scope: &Scope<'s>,
        starts: &[usize],
        new: &[usize],
    ) -> Result<Option<(RotaryEmbedding<'s>, Tensor<'s>)>> {
        let end = starts.iter().zip(new).map(|(s, n)| s + n).max();
        if end.is_none_or(|end| end <= self.rope.max_positions()) {
            return Ok(None);
        }
        let positions: Vec<usize> = starts
            .iter()
            .zip(new)
            .flat_map(|(&s, &n)| s..s + n)
            .collect();
        let rope = self.rope_angles()?.rows(scope, &positions)?;
        let read: Vec<i64> = (0..positions.len() as i64).collect();
        Ok(Some((rope, scope.from_slice(&read, &[read.len()])?)))
    }

    /// What a pass needs to recompute dynamic RoPE frequencies, when the config asks for them.
    fn dynamic_rope(&self) -> Option<DynamicRope> {
        let c = &self.config;
        match c.rope_scaling {
            RopeScaling::Dynamic {
                factor,
                original_max_positions,
            } => Some(DynamicRope {
                theta: c.rope_theta,
                head_dim: c.head_dim,
                factor,
                original_max_positions,
                dtype: self.rope.cos().dtype(),
            }),
            _ => None,
        }
    }

    /// One rotary table row per packed new token (sequence `s` has `new[s]` tokens from position
    /// `starts[s]`), each at its sequence's frequencies, and the positions `0..rows` that read
    /// them; `None` when no sequence passes the original context (the model's tables serve).
    fn rows_for<'s>(
        &self,
        scope: &Scope<'s>,
        d: &DynamicRope,
        starts: &[usize],
        new: &[usize],
    ) -> Result<Option<(RotaryEmbedding<'s>, Tensor<'s>)>> {
        let lengths: Vec<usize> = starts.iter().zip(new).map(|(s, n)| s + n).collect();
        if !lengths.iter().any(|&len| d.rescales(len)) {
            return Ok(None);
        }
        let per_sequence = lengths
            .iter()
            .map(|&len| d.frequencies(len))
            .collect::<Result<Vec<_>>>()?;
        let mut positions = Vec::new();
        let mut rows: Vec<&[f64]> = Vec::new();
        for ((&start, &len), frequencies) in starts.iter().zip(&lengths).zip(&per_sequence) {
            positions.extend(start..len);
            rows.extend(std::iter::repeat_n(frequencies.as_slice(), len - start));
        }
        let rope = RotaryEmbedding::rows_from_f32_angles(scope, &positions, &rows, d.dtype)?;
        let read: Vec<i64> = (0..positions.len() as i64).collect();
        Ok(Some((rope, scope.from_slice(&read, &[read.len()])?)))
    }

    /// The token table: dense, or its blocks.
    fn token_table(&self) -> TokenTable<'_, 'm> {
        TokenTable {
            dense: &self.embed,
            blocks: self.embed_blocks.as_ref(),
        }
    }

    /// The output head over rows `[n, hidden]` (normalised): the untied head, or the embedding.
    fn head<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match &self.lm_head {
            Some(head) => head.forward(x, mode),
            None => self.token_table().tied_head(x),
        }
    }
}

/// Dynamic NTK scaling's parameters (`RopeScaling::Dynamic`): a pass longer than the original
/// context turns at frequencies of its own length.
#[derive(Debug, Clone, Copy)]
struct DynamicRope {
    theta: f64,
    head_dim: usize,
    factor: f64,
    original_max_positions: usize,
    /// The tables' dtype (`f64` for an `f64` model, `f32` otherwise).
    dtype: DType,
}

impl DynamicRope {
    /// The frequencies of a pass over a sequence of `len` tokens, as transformers computes them:
    /// the model's own within the original context; past it, from the rescaled base (a Python
    /// float, rounded to `float32` where torch raises it to the powers).
    fn frequencies(&self, len: usize) -> Result<Vec<f64>> {
        let theta = if self.rescales(len) {
            let theta = dynamic_theta(
                self.theta,
                self.head_dim,
                self.factor,
                self.original_max_positions,
                len,
            );
            theta as f32 as f64
        } else {
            self.theta
        };
        f32_frequencies(self.head_dim, theta, &RopeScaling::None)
    }

    /// Whether a sequence of `len` tokens turns at other frequencies than the model's tables.
    fn rescales(&self, len: usize) -> bool {
        len > self.original_max_positions
    }
}

/// A block over whole sequences `[batch, len, hidden]` starting at position 0: what
/// [`Llama::forward`] runs, and recomputes in the backward pass when asked to. Generic over
/// owning (`Block`, recomputed later) and borrowing (`&Block`, run now) holders.
struct InSequence<B, R> {
    block: B,
    rope: R,
    dynamic: Option<DynamicRope>,
    /// Set when the sequences pass the model's rotary table.
    past: Option<RopeAngles>,
    mode: Mode,
}

impl<'m, B, R> Segment<'m> for InSequence<B, R>
where
    B: std::borrow::Borrow<Block<'m>>,
    R: std::borrow::Borrow<RotaryEmbedding<'m>>,
{
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let &[batch, len, _] = x.shape() else {
            return Err(Error::InvalidShape {
                op: "Llama block",
                shape: x.shape().to_vec(),
                reason: "needs hidden states [batch, len, hidden]".into(),
            });
        };
        // Positions 0..len of every sequence, made where the block runs (the recomputation runs
        // in a scope of its own).
        let scope = x.tape().scope();
        let positions: Vec<i64> = (0..batch).flat_map(|_| 0..len as i64).collect();
        let positions = scope.from_slice(&positions, &[batch * len])?;
        let block = self.block.borrow();
        match self.dynamic {
            // A pass past the original context: tables of its own length, in the pass's scope.
            Some(d) if d.rescales(len) => {
                let frequencies = d.frequencies(len)?;
                let rope =
                    RotaryEmbedding::from_f32_angles(scope, &frequencies, len, 1.0, d.dtype)?;
                block.run(x, &rope, &positions, self.mode)
            }
            _ => match &self.past {
                // Past the model's table: one of the pass's length, in its scope.
                Some(past) => block.run(x, &past.table(scope, len)?, &positions, self.mode),
                None => block.run(x, self.rope.borrow(), &positions, self.mode),
            },
        }
    }
}

/// RoPE tables as transformers computes them: the inverse frequencies in `f32` (transformers makes
/// `inv_freq` in `float32` when the model is built), each angle `p · θ_i` rounded to `f32` as its
/// `float32` product does, and the cosine and sine of that angle rounded once. A `float64` model in
/// transformers still computes its tables this way (its rotary forward runs in `float32`), so
/// matching its logits to 1e-10 needs the same angles.
///
/// The model keeps the first [`TABLE_POSITIONS`] positions' rows; a pass reaching further computes
/// its own (`RopeAngles`).
fn rotary_tables<'m>(
    scope: &Scope<'m>,
    c: &LlamaConfig,
    dtype: DType,
) -> Result<RotaryEmbedding<'m>> {
    RopeAngles::of(c, dtype)?.table(scope, c.max_position_embeddings.min(TABLE_POSITIONS))
}

/// Positions whose rotary rows a model keeps (2 MiB of `f32` cosines and sines at 64-wide heads).
/// Llama 3 configs name 131,072 positions: a table of them all would be 34 MB, more than 4 % of a
/// 1B model quantized to 4 bits, for contexts most uses never reach.
const TABLE_POSITIONS: usize = 8192;

/// The angles a model's rotary rows are made from: its table when loaded, and the rows a pass past
/// that table computes for itself.
#[derive(Debug, Clone)]
struct RopeAngles {
    frequencies: Vec<f64>,
    attention_scaling: f64,
    dtype: DType,
}

impl RopeAngles {
    /// The angles of config `c`, for tables of `dtype`.
    fn of(c: &LlamaConfig, dtype: DType) -> Result<RopeAngles> {
        Ok(RopeAngles {
            frequencies: f32_frequencies(c.head_dim, c.rope_theta, &c.rope_scaling)?,
            attention_scaling: c.rope_scaling.attention_scaling(),
            dtype,
        })
    }

    /// A table of positions `0..len`, the same bits as the model's table where both reach.
    fn table<'s>(&self, scope: &Scope<'s>, len: usize) -> Result<RotaryEmbedding<'s>> {
        let (f, scaling) = (&self.frequencies, self.attention_scaling);
        RotaryEmbedding::from_f32_angles(scope, f, len, scaling, self.dtype)
    }

    /// The rows of `positions`, to read at `0..rows`.
    fn rows<'s>(&self, scope: &Scope<'s>, positions: &[usize]) -> Result<RotaryEmbedding<'s>> {
        let (f, scaling) = (&self.frequencies, self.attention_scaling);
        RotaryEmbedding::rows_at(scope, positions, f, scaling, self.dtype)
    }
}

/// The inverse frequencies rounded to `f32`, as transformers keeps its `inv_freq`.
fn f32_frequencies(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Vec<f64>> {
    Ok(inverse_frequencies(head_dim, theta, scaling)?
        .into_iter()
        .map(|f| f as f32 as f64)
        .collect())
}

/// Cached decoding: each layer's keys and values go to the KV pages (the key and value heads
/// only), and attention reads them back through `KvStep::attend_grouped`.
impl<'m> CausalLm<'m> for Llama<'m> {
    fn kv_shape(&self) -> KvShape {
        let c = &self.config;
        KvShape {
            layers: c.num_hidden_layers,
            heads: c.num_key_value_heads,
            head_width: c.head_dim,
            dtype: self.embed.weight.dtype(),
        }
    }

    fn max_positions(&self) -> usize {
        let c = &self.config;
        c.rope_scaling.context(c.max_position_embeddings)
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
        let mut x = self.token_table().forward(tape, ids)?;
        // Dynamic RoPE: each sequence whose length passes the original context turns its new
        // tokens at its length's frequencies (the cached tokens keep theirs, as in transformers'
        // cache): one table row per token, read at positions 0..rows.
        let rescaled = match self.dynamic_rope() {
            Some(d) => self.rows_for(tape.scope(), &d, &kv.starts(), kv.new_tokens())?,
            None => None,
        };
        // Positions past the model's table: their own rows, the same angles.
        let rescaled = match rescaled {
            Some(rows) => Some(rows),
            None => self.rows_past_table(tape.scope(), &kv.starts(), kv.new_tokens())?,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            x = block.forward_with(&x, Mode::Eval, |h| match &rescaled {
                Some((rope, rows)) => block.self_attn.forward_paged(h, rope, rows, kv, layer),
                None => block
                    .self_attn
                    .forward_paged(h, &self.rope, positions, kv, layer),
            })?;
        }
        Ok(x)
    }

    fn logits<'t, 's>(&self, hidden: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.head(&self.norm.forward(hidden, Mode::Eval)?, Mode::Eval)
    }
}

/// transformers' names: `model.{embed_tokens,layers.N,norm}...` and, untied, `lm_head.weight`.
impl<'m> Parameters<'m> for Llama<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        if self.embed_blocks.is_none() {
            self.embed.visit(&format!("{prefix}model.embed_tokens."), f);
        }
        for (i, b) in self.blocks.iter().enumerate() {
            b.visit(&format!("{prefix}model.layers.{i}."), f);
        }
        self.norm.visit(&format!("{prefix}model.norm."), f);
        if let Some(head) = &self.lm_head {
            head.visit(&format!("{prefix}lm_head."), f);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        if self.embed_blocks.is_none() {
            self.embed.visit_mut(f)?;
        }
        for b in &mut self.blocks {
            b.visit_mut(f)?;
        }
        self.norm.visit_mut(f)?;
        if let Some(head) = &mut self.lm_head {
            head.visit_mut(f)?;
        }
        Ok(())
    }
}

impl<'m> Movable<'m> for Llama<'m> {
    type Moved<'b> = Llama<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Llama<'b>> {
        Ok(Llama {
            embed: self.embed.move_into(target)?,
            embed_blocks: self.embed_blocks.move_into(target)?,
            blocks: self.blocks.move_into(target)?,
            norm: self.norm.move_into(target)?,
            lm_head: self.lm_head.move_into(target)?,
            rope: self.rope.move_into(target)?,
            config: self.config,
            recompute: self.recompute,
            quantized: self.quantized,
        })
    }
}

/// A model shared by threads: `Llama<'static>` is `Sync`.
impl<'m> MoveOut<'m> for Llama<'m> {
    fn move_out(self) -> Result<Llama<'static>> {
        Ok(Llama {
            embed: self.embed.move_out()?,
            embed_blocks: self.embed_blocks.move_out()?,
            blocks: self.blocks.move_out()?,
            norm: self.norm.move_out()?,
            lm_head: self.lm_head.move_out()?,
            rope: self.rope.move_out()?,
            config: self.config,
            recompute: self.recompute,
            quantized: self.quantized,
        })
    }
}
