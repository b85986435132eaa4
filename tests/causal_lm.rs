//! A model of one's own decodes through the library's driver: it writes its forward pass over
//! packed rows (`CausalLm::forward_packed`) and its head, built from `nn`'s layers and their cached
//! paths, and `CausalLm::decode`, `serve::generate` and the engine do the rest. The cached result
//! must equal re-running the model over the whole window; a forward pass that skips a layer's cache
//! is a typed error that leaves the caches as they were.

use ndscope::kv::{CausalLm, KvPool, KvShape, KvStep};
use ndscope::nn::{
    AttentionOptions, Embedding, GroupedQueryAttention, Init, Linear, Mode, Module,
    MultiHeadAttention, RmsNorm, RopeScaling, RotaryEmbedding, WeightLayout,
};
use ndscope::serve::{GenerateOptions, generate};
use ndscope::{DType, Device, Error, Result, Scope, Tape, Tensor, Var, root};

const WIDTH: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 4;
const VOCAB: usize = 11;
const LAYERS: usize = 2;
const POSITIONS: usize = 32;

/// Two pre-norm blocks of grouped-query attention with rotary positions (no MLP), a final norm and
/// an untied head.
struct Tiny<'m> {
    embed: Embedding<'m>,
    rope: RotaryEmbedding<'m>,
    blocks: Vec<(RmsNorm<'m>, GroupedQueryAttention<'m>)>,
    norm: RmsNorm<'m>,
    head: Linear<'m>,
    /// A layer whose cache the paged forward pass forgets (a model's bug).
    skip: Option<usize>,
}

impl<'m> Tiny<'m> {
    fn new(m: &Scope<'m>, skip: Option<usize>) -> Result<Tiny<'m>> {
        let linear =
            |i, o| Linear::with_layout(m, i, o, false, WeightLayout::OutIn, Init::XavierUniform);
        let mut blocks = Vec::new();
        for _ in 0..LAYERS {
            blocks.push((
                RmsNorm::new(m, WIDTH)?,
                GroupedQueryAttention::from_parts(
                    linear(WIDTH, HEADS * HEAD_DIM)?,
                    linear(WIDTH, KV_HEADS * HEAD_DIM)?,
                    linear(WIDTH, KV_HEADS * HEAD_DIM)?,
                    linear(HEADS * HEAD_DIM, WIDTH)?,
                    HEADS,
                    KV_HEADS,
                )?,
            ));
        }
        Ok(Tiny {
            embed: Embedding::new(m, VOCAB, WIDTH, Init::Normal(1.0))?,
            rope: RotaryEmbedding::new(
                m,
                HEAD_DIM,
                POSITIONS,
                10_000.0,
                &RopeScaling::None,
                DType::F32,
            )?,
            blocks,
            norm: RmsNorm::new(m, WIDTH)?,
            head: linear(WIDTH, VOCAB)?,
            skip,
        })
    }

    /// The uncached model: logits `[len, vocab]` of one whole sequence.
    fn full<'s>(&self, s: &'s Scope<'s>, ids: &[i64]) -> Result<Vec<f32>>
    where
        'm: 's,
    {
        let tape = Tape::no_grad(s);
        let len = ids.len();
        let positions: Vec<i64> = (0..len as i64).collect();
        let positions = s.from_slice(&positions, &[len])?;
        let ids = s.from_slice(ids, &[1, len])?;
        let mut x = self.embed.forward(&tape, &ids)?;
        for (norm, attn) in &self.blocks {
            let a = attn.forward(
                &norm.forward(&x, Mode::Eval)?,
                &self.rope,
                &positions,
                Mode::Eval,
            )?;
            x = x.add(&a)?;
        }
        let x = x.reshape(&[len, WIDTH])?;
        self.logits(&x)?.value().to_vec::<f32>()
    }
}

impl<'m> CausalLm<'m> for Tiny<'m> {
    fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: LAYERS,
            heads: KV_HEADS,
            head_width: HEAD_DIM,
            dtype: DType::F32,
        }
    }

    fn max_positions(&self) -> usize {
        POSITIONS
    }

    fn vocab_size(&self) -> usize {
        VOCAB
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
        let mut x = self.embed.forward(tape, ids)?;
        for (layer, (norm, attn)) in self.blocks.iter().enumerate() {
            if Some(layer) == self.skip {
                continue;
            }
            let h = norm.forward(&x, Mode::Eval)?;
            x = x.add(&attn.forward_paged(&h, &self.rope, positions, kv, layer)?)?;
        }
        Ok(x)
    }

    fn logits<'t, 's>(&self, hidden: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.head
            .forward(&self.norm.forward(hidden, Mode::Eval)?, Mode::Eval)
    }
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Two sequences of different lengths in one forward pass, then a token each, on blocks of 4
/// tokens: each sequence's logits equal the uncached model's last row over its whole window.
#[test]
fn cached_decoding_through_the_driver_equals_rerunning_the_window() {
    root(Device::Cpu, |m| {
        let model = Tiny::new(m, None)?;
        let pool = KvPool::new(m, model.kv_shape(), 4, 16)?;
        let a: Vec<i64> = vec![3, 1, 4, 1, 5, 9, 2];
        let b: Vec<i64> = vec![6, 5];
        m.scope(|request| {
            let mut ca = pool.cache(request, 16)?;
            let mut cb = pool.cache(request, 16)?;
            let mut windows = [a.clone(), b.clone()];
            let mut next = [a.clone(), b.clone()];
            for step in 0..3 {
                let logits = request.scope(|s| {
                    let tokens: [&[i64]; 2] = [&next[0], &next[1]];
                    model
                        .decode(s, &pool, &mut [&mut ca, &mut cb], &tokens)?
                        .to_vec::<f32>()
                })?;
                assert_eq!(logits.len(), 2 * VOCAB);
                for (i, window) in windows.iter().enumerate() {
                    let full = request.scope(|s| model.full(s, window))?;
                    let last = &full[(window.len() - 1) * VOCAB..];
                    let d = max_difference(&logits[i * VOCAB..(i + 1) * VOCAB], last);
                    assert!(
                        d < 1e-5,
                        "step {step}, sequence {i}: cached logits differ by {d}"
                    );
                }
                next = [vec![(step + 1) as i64], vec![(step + 7) as i64]];
                for (w, n) in windows.iter_mut().zip(&next) {
                    w.extend(n);
                }
            }
            assert_eq!((ca.len(), cb.len()), (a.len() + 2, b.len() + 2));
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// `serve::generate` runs a model of one's own: greedy decoding through the cache picks what the
/// uncached model's argmax picks at every step.
#[test]
fn generate_runs_a_model_of_ones_own() {
    root(Device::Cpu, |m| {
        let model = Tiny::new(m, None)?;
        let pool = KvPool::new(m, model.kv_shape(), 4, 16)?;
        let prompt = [2i64, 7, 1];
        let out = generate(&model, m, &pool, &prompt, &GenerateOptions::greedy(6))?;
        let mut window = prompt.to_vec();
        for &token in &out.tokens {
            let full = m.scope(|s| model.full(s, &window))?;
            let last = &full[(window.len() - 1) * VOCAB..];
            let argmax = (0..VOCAB)
                .max_by(|&i, &j| last[i].total_cmp(&last[j]))
                .unwrap() as i64;
            assert_eq!(token, argmax, "after {window:?}");
            window.push(token);
        }
        assert_eq!(out.tokens.len(), 6);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// A forward pass that never writes a layer's cache would leave garbage that later tokens read:
/// the driver refuses its result, names the layer, and the caches count none of the tokens.
#[test]
fn a_forward_pass_that_skips_a_layers_cache_is_refused() {
    root(Device::Cpu, |m| {
        let model = Tiny::new(m, Some(1))?;
        let pool = KvPool::new(m, model.kv_shape(), 4, 16)?;
        m.scope(|request| {
            let mut cache = pool.cache(request, 16)?;
            let err = request
                .scope(|s| {
                    model
                        .decode(s, &pool, &mut [&mut cache], &[&[1, 2, 3]])
                        .map(|_| ())
                })
                .unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains("layer 1"), "{text}");
            assert_eq!(cache.len(), 0, "the failed step counted its tokens");
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// Attention that lets a token see later ones cannot decode token by token: a typed error.
#[test]
fn non_causal_attention_has_no_cached_path() {
    root(Device::Cpu, |m| {
        let options = AttentionOptions {
            causal: false,
            dropout: 0.0,
        };
        let attn = MultiHeadAttention::new(m, 8, 2, options, Init::XavierUniform)?;
        let shape = KvShape {
            layers: 1,
            heads: 2,
            head_width: 4,
            dtype: DType::F32,
        };
        let pool = KvPool::new(m, shape, 4, 4)?;
        m.scope(|request| {
            let mut cache = pool.cache(request, 4)?;
            let mut kv = KvStep::new(&pool, vec![&mut cache], &[2])?;
            let tape = Tape::no_grad(request);
            let x = tape.constant(&request.randn(&[2, 8])?);
            let err = attn.forward_paged(&x, &mut kv, 0).unwrap_err();
            assert!(err.to_string().contains("not causal"), "{err}");
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}
