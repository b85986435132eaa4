//! The Llama family's decoder (Llama 2/3, and the Mistral and Qwen2 variants' shared shape):
//! token embedding, blocks of pre-norm grouped-query attention with rotary positions and a SwiGLU
//! MLP, a final RMSNorm and the output head, loaded from a Hugging Face directory under
//! transformers' names: the training forward pass, and cached decoding through the KV pages
//! (`CausalLm`), so `serve::generate` and the engine run it as they run GPT-2.

use std::panic::Location;
use std::path::Path;

use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvCache, KvPool, KvShape, KvStep, decode_inputs};
use crate::models::LlamaConfig;
use crate::nn::{
    Embedding, Linear, Mode, Module, Parameters, RmsNorm, RotaryEmbedding, WeightLayout,
    inverse_frequencies,
};
use crate::ops::{AttentionSpec, Causal};
use crate::scope::{Child, Scope};
use crate::tensor::Tensor;
use crate::weights::Weights;

/// One decoder block: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
struct Block<'m> {
    input_norm: RmsNorm<'m>,
    q: Linear<'m>,
    k: Linear<'m>,
    v: Linear<'m>,
    o: Linear<'m>,
    post_norm: RmsNorm<'m>,
    gate: Linear<'m>,
    up: Linear<'m>,
    down: Linear<'m>,
}

/// A Llama-family causal language model with its parameters in the model scope `'m`.
#[derive(Debug, Clone)]
pub struct Llama<'m> {
    embed: Embedding<'m>,
    blocks: Vec<Block<'m>>,
    norm: RmsNorm<'m>,
    /// The output head; `None` when tied to the embedding.
    lm_head: Option<Linear<'m>>,
    rope: RotaryEmbedding<'m>,
    config: LlamaConfig,
}

impl<'m> Llama<'m> {
    /// Loads a Hugging Face directory (`config.json` and `model.safetensors` or its shards) as
    /// `dtype` in `scope`.
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
        let config = LlamaConfig::from_file(dir.join("config.json"))?;
        Llama::load(scope, &Weights::open(dir)?, config, dtype)
    }

    /// The model of `config` with its parameters from `weights` (transformers' names), as `dtype`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] and [`Error::TensorMismatch`] for a checkpoint that does not fit;
    /// [`Error::UnsupportedConfig`] for a sliding window (not computed yet); allocation errors.
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        config: LlamaConfig,
        dtype: DType,
    ) -> Result<Llama<'m>> {
        if let Some(window) = config
            .sliding_window
            .filter(|&w| w < config.max_position_embeddings)
        {
            return Err(Error::UnsupportedConfig {
                file: "config.json".into(),
                key: "sliding_window".into(),
                value: window.to_string(),
                reason: "sliding-window attention is not computed yet; a window of at least \
                         max_position_embeddings is the same model"
                    .into(),
            });
        }
        let weights = &weights.loaded_from(Location::caller());
        let c = &config;
        let (hidden, heads, kv_heads, d) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let body = weights.prefix("model");
        let linear = |w: &Weights, name: &str, inputs: usize, outputs: usize, bias: bool| {
            Linear::load(
                scope,
                &w.prefix(name),
                inputs,
                outputs,
                bias,
                WeightLayout::OutIn,
                dtype,
            )
        };
        let norm = |w: &Weights, name: &str| {
            RmsNorm::load(scope, &w.prefix(name), hidden, c.rms_norm_eps, dtype)
        };
        let embed = Embedding::load(
            scope,
            &body.prefix("embed_tokens"),
            c.vocab_size,
            hidden,
            dtype,
        )?;
        let mut blocks = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let b = body.prefix(&format!("layers.{i}"));
            let attn = b.prefix("self_attn");
            let mlp = b.prefix("mlp");
            blocks.push(Block {
                input_norm: norm(&b, "input_layernorm")?,
                q: linear(&attn, "q_proj", hidden, heads * d, c.attention_bias)?,
                k: linear(&attn, "k_proj", hidden, kv_heads * d, c.attention_bias)?,
                v: linear(&attn, "v_proj", hidden, kv_heads * d, c.attention_bias)?,
                o: linear(&attn, "o_proj", heads * d, hidden, false)?,
                post_norm: norm(&b, "post_attention_layernorm")?,
                gate: linear(&mlp, "gate_proj", hidden, c.intermediate_size, false)?,
                up: linear(&mlp, "up_proj", hidden, c.intermediate_size, false)?,
                down: linear(&mlp, "down_proj", c.intermediate_size, hidden, false)?,
            });
        }
        let final_norm = norm(&body, "norm")?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(linear(weights, "lm_head", hidden, c.vocab_size, false)?)
        };
        let rope = rotary_tables(scope, c, dtype)?;
        Ok(Llama {
            embed,
            blocks,
            norm: final_norm,
            lm_head,
            rope,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
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
        if len > self.rope.max_positions() {
            return Err(Error::InvalidShape {
                op: "Llama::forward",
                shape: ids.shape().to_vec(),
                reason: format!(
                    "{len} tokens do not fit the {} positions of max_position_embeddings",
                    self.rope.max_positions()
                ),
            });
        }
        let scope = tape.scope();
        let positions: Vec<i64> = (0..batch).flat_map(|_| 0..len as i64).collect();
        let positions = scope.from_slice(&positions, &[batch * len])?;
        let mut x = self.embed.forward(tape, ids)?;
        for block in &self.blocks {
            x = self.block(block, &x, &positions, [batch, len], mode)?;
        }
        let x = self.norm.forward(&x, mode)?;
        match &self.lm_head {
            Some(head) => head.forward(&x, mode),
            None => {
                let w = tape.param(&self.embed.weight);
                let rows = x.reshape(&[batch * len, self.config.hidden_size])?;
                rows.matmul(&w.t()?)?
                    .reshape(&[batch, len, self.config.vocab_size])
            }
        }
    }

    fn block<'t, 's>(
        &self,
        b: &Block<'m>,
        x: &Var<'t, 's>,
        positions: &Tensor<'s>,
        [batch, len]: [usize; 2],
        mode: Mode,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let h = b.input_norm.forward(x, mode)?;
        // [batch, len, heads * d] -> rotated [batch * len, heads, d] -> [batch, heads, len, d].
        let heads_of = |y: Var<'t, 's>, n: usize, rotate: bool| -> Result<Var<'t, 's>> {
            let y = y.reshape(&[batch * len, n, d])?;
            let y = if rotate {
                self.rope.apply(&y, positions)?
            } else {
                y
            };
            y.reshape(&[batch, len, n, d])?.permute(&[0, 2, 1, 3])
        };
        let q = heads_of(b.q.forward(&h, mode)?, heads, true)?;
        let k = heads_of(b.k.forward(&h, mode)?, kv_heads, true)?;
        let v = heads_of(b.v.forward(&h, mode)?, kv_heads, false)?;
        let spec = AttentionSpec {
            causal: Causal::TopLeft,
            scale: None,
        };
        let attended = q
            .attention(&k, &v, spec, None)?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[batch, len, heads * d])?;
        let x = x.add(&b.o.forward(&attended, mode)?)?;
        let h = b.post_norm.forward(&x, mode)?;
        let mlp = b
            .gate
            .forward(&h, mode)?
            .silu()?
            .mul(&b.up.forward(&h, mode)?)?;
        x.add(&b.down.forward(&mlp, mode)?)
    }
}

/// RoPE tables as transformers computes them: the inverse frequencies in `f32` (transformers makes
/// `inv_freq` in `float32` when the model is built), each angle `p · θ_i` rounded to `f32` as its
/// `float32` product does, and the cosine and sine of that angle rounded once. A `float64` model in
/// transformers still computes its tables this way (its rotary forward runs in `float32`), so
/// matching its logits to 1e-10 needs the same angles.
fn rotary_tables<'m>(
    scope: &Scope<'m>,
    c: &LlamaConfig,
    dtype: DType,
) -> Result<RotaryEmbedding<'m>> {
    let frequencies: Vec<f64> = inverse_frequencies(c.head_dim, c.rope_theta, &c.rope_scaling)?
        .into_iter()
        .map(|f| f as f32 as f64)
        .collect();
    RotaryEmbedding::from_f32_angles(scope, &frequencies, c.max_position_embeddings, dtype)
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
        self.config.max_position_embeddings
    }

    #[track_caller]
    fn decode<'s, 'r>(
        &self,
        step: &'s Child<'s, 'r>,
        pool: &KvPool<'_>,
        caches: &mut [&mut KvCache<'r>],
        tokens: &[&[i64]],
    ) -> Result<Tensor<'s>>
    where
        'm: 's,
    {
        let c = &self.config;
        let (ids, counts, last) = decode_inputs(
            "Llama::decode",
            caches,
            tokens,
            c.max_position_embeddings,
            c.vocab_size,
        )?;
        let rows: usize = counts.iter().sum();
        let mut kv = KvStep::new(pool, caches.iter_mut().map(|c| &mut **c).collect(), &counts)?;
        let positions: Vec<i64> = kv
            .starts()
            .iter()
            .zip(&counts)
            .flat_map(|(&s, &n)| (s..s + n).map(|p| p as i64))
            .collect();
        let tape = Tape::no_grad(step);
        let ids = step.from_slice(&ids, &[rows])?;
        let positions = step.from_slice(&positions, &[rows])?;
        let mut x = tape.constant(&self.embed.weight.index_select(0, &ids)?);
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let scale = 1.0 / (d as f64).sqrt();
        let (cos, sin) = (self.rope.cos(), self.rope.sin());
        for (layer, b) in self.blocks.iter().enumerate() {
            let h = b.input_norm.forward(&x, Mode::Eval)?;
            let project = |l: &Linear<'m>, n: usize| -> Result<Tensor<'s>> {
                l.forward(&h, Mode::Eval)?.value().reshape(&[rows, n, d])
            };
            let q = project(&b.q, heads)?.rotary(cos, sin, &positions)?;
            let k = project(&b.k, kv_heads)?.rotary(cos, sin, &positions)?;
            let v = project(&b.v, kv_heads)?;
            let kv_rows = Tensor::concat(&[&k.unsqueeze(1)?, &v.unsqueeze(1)?], 1)?;
            let attended = kv
                .attend_grouped(layer, &q, &kv_rows, scale)?
                .reshape(&[rows, heads * d])?;
            x = x.add(&b.o.forward(&tape.constant(&attended), Mode::Eval)?)?;
            let h = b.post_norm.forward(&x, Mode::Eval)?;
            let mlp = b
                .gate
                .forward(&h, Mode::Eval)?
                .silu()?
                .mul(&b.up.forward(&h, Mode::Eval)?)?;
            x = x.add(&b.down.forward(&mlp, Mode::Eval)?)?;
        }
        kv.finish();
        // Only each sequence's last new token is scored.
        let last = step.from_slice(&last, &[last.len()])?;
        let x = tape.constant(&x.value().index_select(0, &last)?);
        let x = self.norm.forward(&x, Mode::Eval)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x, Mode::Eval)?,
            None => x.matmul(&tape.param(&self.embed.weight).t()?)?,
        };
        Ok(logits.value().clone())
    }
}

impl<'m> Parameters<'m> for Llama<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        self.embed.visit(&format!("{prefix}model.embed_tokens."), f);
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("{prefix}model.layers.{i}.");
            b.input_norm.visit(&format!("{p}input_layernorm."), f);
            b.q.visit(&format!("{p}self_attn.q_proj."), f);
            b.k.visit(&format!("{p}self_attn.k_proj."), f);
            b.v.visit(&format!("{p}self_attn.v_proj."), f);
            b.o.visit(&format!("{p}self_attn.o_proj."), f);
            b.post_norm
                .visit(&format!("{p}post_attention_layernorm."), f);
            b.gate.visit(&format!("{p}mlp.gate_proj."), f);
            b.up.visit(&format!("{p}mlp.up_proj."), f);
            b.down.visit(&format!("{p}mlp.down_proj."), f);
        }
        self.norm.visit(&format!("{prefix}model.norm."), f);
        if let Some(head) = &self.lm_head {
            head.visit(&format!("{prefix}lm_head."), f);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        self.embed.visit_mut(f)?;
        for b in &mut self.blocks {
            b.input_norm.visit_mut(f)?;
            for linear in [&mut b.q, &mut b.k, &mut b.v, &mut b.o] {
                linear.visit_mut(f)?;
            }
            b.post_norm.visit_mut(f)?;
            for linear in [&mut b.gate, &mut b.up, &mut b.down] {
                linear.visit_mut(f)?;
            }
        }
        self.norm.visit_mut(f)?;
        if let Some(head) = &mut self.lm_head {
            head.visit_mut(f)?;
        }
        Ok(())
    }
}
