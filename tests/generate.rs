//! Generation with paged KV caches against transformers' `generate` on the bundled tiny GPT-2, and
//! cached decoding against re-running the whole window.

use ndscope::kv::{CausalLm, KvPool, KvShape};
use ndscope::models::Gpt2;
use ndscope::nn::Mode;
use ndscope::serve::{
    Completion, Engine, EngineConfig, Finish, GenerateOptions, Request, Sampling, generate,
};
use ndscope::{DType, Device, Error, Tape, root};

mod common;
use common::reference::{DIR, reference};

fn token_ids(values: &[f64]) -> Vec<i64> {
    values.iter().map(|&v| v as i64).collect()
}

/// The two prompts, transformers' 24 greedy tokens after each, and the logits each step chose from.
/// Transformers generated them with `min_new_tokens = 24`: its end-of-text token (0) is masked to
/// `-inf` in every step's logits.
struct Reference {
    prompts: [Vec<i64>; 2],
    generated: [Vec<i64>; 2],
    step_logits: [Vec<f64>; 2],
}

fn greedy_reference() -> Reference {
    let r = reference();
    let get = |name: &str| r[name].1.clone();
    let prompts = [
        token_ids(&get("prompt0_ids")),
        token_ids(&get("prompt1_ids")),
    ];
    let full = [
        token_ids(&get("generated0_ids")),
        token_ids(&get("generated1_ids")),
    ];
    let generated = [0, 1].map(|i| full[i][prompts[i].len()..].to_vec());
    Reference {
        generated,
        step_logits: [get("step_logits0"), get("step_logits1")],
        prompts,
    }
}

/// Transformers' options: 24 greedy tokens, end-of-text (0) masked until then.
fn as_transformers() -> GenerateOptions {
    GenerateOptions::greedy(24)
        .stopping_at(0)
        .with_min_new_tokens(24)
}

/// The largest difference between our raw logits and transformers' processed ones, over the tokens
/// transformers did not mask (only the end-of-text token is masked).
fn max_difference(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|&(i, (_, w))| {
            assert!(w.is_finite() || i == 0, "token {i} masked");
            w.is_finite()
        })
        .fold(0.0f64, |m, (_, (&g, &w))| m.max((f64::from(g) - w).abs()))
}

#[test]
fn greedy_generation_reproduces_transformers_token_for_token() {
    let want = greedy_reference();
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        // Blocks of 4 tokens: every prompt spans several, and decoding crosses block edges.
        let pool = KvPool::new(m, gpt2.kv_shape(), 4, 64)?;
        for i in 0..2 {
            let out = generate(&gpt2, m, &pool, &want.prompts[i], &as_transformers())?;
            assert_eq!(out.tokens, want.generated[i], "prompt {i}");
            assert_eq!(out.finish, Finish::Length);
            assert_eq!(out.kv.tokens, want.prompts[i].len() + 23);
            assert_eq!(
                pool.stats().blocks_free,
                64,
                "the request's blocks are back"
            );
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// The largest difference from transformers' of any step's logits of prompt `i`, decoded against a
/// cache from `pool` (transformers' tokens fed back).
fn step_logits_difference<'m>(
    m: &ndscope::Scope<'m>,
    gpt2: &Gpt2<'m>,
    pool: &KvPool<'m>,
    want: &Reference,
    i: usize,
) -> ndscope::Result<f64> {
    m.scope(|request| {
        let mut cache = pool.cache(request, 128)?;
        let mut next = want.prompts[i].clone();
        let mut worst = 0.0f64;
        for (step, &token) in want.generated[i].iter().enumerate() {
            let logits = request.scope(|s| {
                gpt2.decode(s, pool, &mut [&mut cache], &[&next])?
                    .to_vec::<f32>()
            })?;
            let reference = &want.step_logits[i][step * 1000..(step + 1) * 1000];
            worst = worst.max(max_difference(&logits, reference));
            next = vec![token];
        }
        Ok(worst)
    })
}

/// Every step's logits, decoded against the cache, equal transformers' within 1e-4.
#[test]
fn step_logits_match_transformers() {
    let want = greedy_reference();
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 32)?;
        for i in 0..2 {
            let d = step_logits_difference(m, &gpt2, &pool, &want, i)?;
            assert!(d < 1e-4, "prompt {i}: logits differ by {d}");
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// A 16-bit cache under the f32 model (llama.cpp's default `f16` cache; `bf16`): transformers'
/// greedy tokens still, every step's logits within the cache's rounding of transformers'.
#[test]
fn sixteen_bit_caches_keep_transformers_greedy_tokens() {
    let want = greedy_reference();
    for (dtype, bound) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        root(Device::Cpu, |m| {
            let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
            let shape = KvShape {
                dtype,
                ..gpt2.kv_shape()
            };
            let pool = KvPool::new(m, shape, 16, 32)?;
            assert_eq!(
                pool.shape().token_bytes() * 2,
                gpt2.kv_shape().token_bytes()
            );
            for i in 0..2 {
                let out = generate(&gpt2, m, &pool, &want.prompts[i], &as_transformers())?;
                assert_eq!(out.tokens, want.generated[i], "{dtype} cache, prompt {i}");
                let d = step_logits_difference(m, &gpt2, &pool, &want, i)?;
                assert!(d < bound, "{dtype} cache, prompt {i}: logits differ by {d}");
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

/// At every step the cached logits equal those of the whole window run again without a cache.
#[test]
fn cached_decoding_equals_rerunning_the_window() {
    let want = greedy_reference();
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 32)?;
        let prompt = &want.prompts[1];
        m.scope(|request| {
            let mut cache = pool.cache(request, 128)?;
            let mut window = prompt.clone();
            let mut next = prompt.clone();
            for &token in &want.generated[1] {
                let (cached, full) = request.scope(|s| {
                    let cached = gpt2.decode(s, &pool, &mut [&mut cache], &[&next])?;
                    let tape = Tape::no_grad(s);
                    let ids = s.from_slice(&window, &[1, window.len()])?;
                    let full = gpt2.forward(&tape, &ids, Mode::Eval)?;
                    let last = full.value().narrow(1, window.len() - 1, 1)?;
                    Ok::<_, Error>((cached.to_vec::<f32>()?, last.to_vec::<f32>()?))
                })?;
                let d = cached
                    .iter()
                    .zip(&full)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    d < 1e-5,
                    "at {} tokens the logits differ by {d}",
                    window.len()
                );
                window.push(token);
                next = vec![token];
            }
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// Both reference prompts in one engine, batched with other requests of other lengths that arrive at
/// other steps: each still gets transformers' tokens.
#[test]
fn batched_requests_each_reproduce_their_own_generation() {
    let want = greedy_reference();
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 16, 64)?;
        let mut engine = Engine::new(&gpt2, &pool, EngineConfig { max_batch: 4 });
        let others = [
            (vec![5i64, 6, 7], 10, 0),
            (vec![42; 40], 30, 3),
            (vec![9], 5, 7),
        ];
        let mut ids = Vec::new();
        for (prompt, new, arrival) in others {
            engine.submit(Request {
                prompt,
                options: GenerateOptions::sampled(new, Sampling::with_temperature(0.8), 3),
                arrival,
            })?;
        }
        for (i, arrival) in [(0, 2), (1, 5)] {
            ids.push(engine.submit(Request {
                prompt: want.prompts[i].clone(),
                options: as_transformers(),
                arrival,
            })?);
        }
        let mut largest_batch = 0;
        let done: Vec<Completion> =
            engine.run(m, |r| largest_batch = largest_batch.max(r.batch))?;
        assert_eq!(done.len(), 5);
        assert!(largest_batch >= 3, "requests ran together: {largest_batch}");
        for (i, id) in ids.into_iter().enumerate() {
            let c = done.iter().find(|c| c.id == id).expect("completed");
            assert_eq!(c.generation.tokens, want.generated[i], "prompt {i}");
        }
        assert_eq!(pool.stats().blocks_free, 64);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Samples of one prompt share its full blocks; each writes only blocks of its own.
#[test]
fn forks_share_the_prompt_blocks_copy_on_write() {
    let want = greedy_reference();
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 4, 64)?;
        let prompt = &want.prompts[0]; // not a multiple of 4 tokens: the last block is partial
        assert!(!prompt.len().is_multiple_of(4));
        m.scope(|request| {
            let mut first = pool.cache(request, 64)?;
            let first_logits = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut first], &[prompt])?
                    .to_vec::<f32>()
            })?;
            let full = prompt.len() / 4;
            let mut second = first.fork(request, &pool, 64)?;
            assert_eq!(first.blocks()[..full], second.blocks()[..full]);
            assert_ne!(
                first.blocks()[full],
                second.blocks()[full],
                "the partial block is copied"
            );
            assert_eq!(pool.stats().blocks_shared, full);
            // Both continue from the prompt with different tokens; each sees its own.
            let token = want.generated[0][0];
            let a = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut first], &[&[token]])?
                    .to_vec::<f32>()
            })?;
            let b = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut second], &[&[7]])?
                    .to_vec::<f32>()
            })?;
            let mut fresh = pool.cache(request, 64)?;
            let mut with_seven = prompt.clone();
            with_seven.push(7);
            let c = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut fresh], &[&with_seven])?
                    .to_vec::<f32>()
            })?;
            assert_eq!(b, c, "the fork equals a cache that never shared");
            assert_ne!(a, b);
            assert_eq!(first_logits.len(), 1000);
            drop((first, second, fresh));
            assert_eq!(pool.stats().blocks_free, 64);
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// `KvCache::truncate` rolls a cache back: decoding on from the cut equals decoding the kept prefix
/// and the new tokens in a fresh cache, the blocks past the cut go back to the pool, and a fork
/// that shares the cut blocks keeps its own tokens (the shared block is copied before the rolled
/// back cache writes into it).
#[test]
fn a_truncated_cache_decodes_as_a_fresh_one() {
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
        let pool = KvPool::new(m, gpt2.kv_shape(), 4, 32)?;
        let seq: Vec<i64> = (0..16).map(|i| (i * 37 + 5) % 1000).collect();
        let other: Vec<i64> = vec![11, 22, 33, 44, 55];
        let fresh = |tokens: &[i64]| {
            m.scope(|request| {
                let mut cache = pool.cache(request, tokens.len())?;
                request.scope(|s| {
                    gpt2.decode(s, &pool, &mut [&mut cache], &[tokens])?
                        .to_vec::<f32>()
                })
            })
        };
        let max_difference = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max)
        };
        m.scope(|request| {
            let mut cache = pool.cache(request, 0)?;
            request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut cache], &[&seq[..15]])
                    .map(drop)
            })?;
            assert_eq!(pool.stats().blocks_free, 32 - 4);
            let mut fork = cache.fork(request, &pool, 16)?;
            let err = cache.truncate(16).unwrap_err();
            assert!(err.to_string().contains("holds 15 tokens"), "{err}");
            cache.truncate(6)?;
            assert_eq!((cache.len(), cache.blocks().len()), (6, 2));
            let rolled_back = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut cache], &[&other])?
                    .to_vec::<f32>()
            })?;
            let mut kept = seq[..6].to_vec();
            kept.extend(&other);
            let d = max_difference(&rolled_back, &fresh(&kept)?);
            assert!(d < 1e-4, "decoding after the cut differs by {d}");
            let forked = request.scope(|s| {
                gpt2.decode(s, &pool, &mut [&mut fork], &[&seq[15..16]])?
                    .to_vec::<f32>()
            })?;
            let d = max_difference(&forked, &fresh(&seq)?);
            assert!(d < 1e-4, "the fork lost its tokens: {d}");
            Ok::<_, Error>(())
        })?;
        assert_eq!(pool.stats().blocks_free, 32);
        Ok::<_, Error>(())
    })
    .unwrap();
}
