//! Paged KV caches: attention through page tables against a plain f64 reference, the pool's block
//! accounting (promises, sharing, return on drop, error and panic), and the errors of bad input.

use ndscope::kv::{KvPool, KvShape, KvStep};
use ndscope::{DType, Device, Error, Tensor, root};

const SHAPE: KvShape = KvShape {
    layers: 2,
    heads: 3,
    head_width: 8,
    dtype: DType::F32,
};

/// `softmax(q kᵀ · scale) v` per head for each query, which sees the tokens up to its own position
/// (the last `window` of them, with a sliding window): `q` `[queries, heads, w]` at the last
/// `queries` of `keys.len()` positions; keys and values `[tokens][heads][w]`.
fn reference(
    q: &[f64],
    keys: &[f64],
    values: &[f64],
    heads: usize,
    w: usize,
    window: Option<usize>,
) -> Vec<f64> {
    let queries = q.len() / (heads * w);
    let tokens = keys.len() / (heads * w);
    let scale = 1.0 / (w as f64).sqrt();
    let mut out = vec![0.0; q.len()];
    for i in 0..queries {
        let visible = tokens - queries + i + 1;
        let first = window.map_or(0, |n| visible.saturating_sub(n));
        for h in 0..heads {
            let qi = &q[(i * heads + h) * w..][..w];
            let scores: Vec<f64> = (first..visible)
                .map(|j| {
                    let k = &keys[(j * heads + h) * w..][..w];
                    scale * qi.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (j, wt) in (first..visible).zip(&weights) {
                let v = &values[(j * heads + h) * w..][..w];
                for d in 0..w {
                    out[(i * heads + h) * w + d] += wt / total * v[d];
                }
            }
        }
    }
    out
}

/// Sequences of different lengths fed in chunks (a prompt, then single tokens, then a chunk) through
/// one pool in one step per round: every layer's output equals the reference over the history.
fn paged_attention_matches_reference(dtype: DType, block_tokens: usize, tolerance: f64) {
    let shape = KvShape { dtype, ..SHAPE };
    let (heads, w) = (shape.heads, shape.head_width);
    root(Device::Cpu, |m| {
        m.set_seed(11);
        let pool = KvPool::new(m, shape, block_tokens, 64)?;
        m.scope(|request| {
            let mut caches = [
                pool.cache(request, 40)?,
                pool.cache(request, 40)?,
                pool.cache(request, 40)?,
            ];
            // History per layer and sequence: keys and values as f64 (as stored, after rounding).
            let mut history = vec![vec![(Vec::new(), Vec::new()); 3]; shape.layers];
            let rounds: [[usize; 3]; 4] = [[5, 1, 17], [1, 1, 1], [1, 9, 1], [3, 1, 2]];
            for counts in rounds {
                let rows: usize = counts.iter().sum();
                request.scope(|s| {
                    let mut step = KvStep::new(&pool, caches.iter_mut().collect(), &counts)?;
                    for (layer, sequences) in history.iter_mut().enumerate() {
                        let qkv = s.randn(&[rows, 3, heads, w])?.to_dtype(dtype)?;
                        let out = step.attend(layer, &qkv, 1.0 / (w as f64).sqrt())?;
                        assert_eq!(out.shape(), &[rows, heads, w]);
                        let qkv = qkv.to_vec_f64()?;
                        let got = out.to_vec_f64()?;
                        let mut row = 0;
                        for (seq, &n) in counts.iter().enumerate() {
                            let (keys, values) = &mut sequences[seq];
                            let mut q = Vec::new();
                            for r in row..row + n {
                                let part = |i: usize| &qkv[((r * 3 + i) * heads) * w..][..heads * w];
                                q.extend_from_slice(part(0));
                                keys.extend_from_slice(part(1));
                                values.extend_from_slice(part(2));
                            }
                            let want = reference(&q, keys, values, heads, w, None);
                            let got = &got[row * heads * w..(row + n) * heads * w];
                            for (g, w) in got.iter().zip(&want) {
                                assert!(
                                    (g - w).abs() <= tolerance * (1.0 + w.abs()),
                                    "{dtype} blocks of {block_tokens}: sequence {seq} layer {layer}: {g} vs {w}"
                                );
                            }
                            row += n;
                        }
                    }
                    step.finish();
                    Ok::<_, Error>(())
                })?;
            }
            assert_eq!(
                caches.iter().map(|c| c.len()).collect::<Vec<_>>(),
                vec![10, 12, 21]
            );
            Ok::<_, Error>(())
        })?;
        assert_eq!(pool.stats().blocks_free, 64);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Grouped-query attention through the pages: 6 query heads over the cache's 2 key and value
/// heads (query head `h` reads `h / 3`), against the f64 reference over each key head's history;
/// with no window, and with sliding windows shorter and longer than a block of 4.
#[test]
fn grouped_paged_attention_matches_the_reference() {
    grouped_paged_attention(4, &[[7, 2], [1, 1], [3, 5]], &[None, Some(3), Some(6)]);
}

/// Prompts longer than the host kernel's tiles (64 queries, 128 keys): a first chunk of 150 queries
/// spans three query tiles and two key tiles, a later chunk of 140 attends over 291 cached tokens;
/// with no window, with a window of 20 (the last query tile's rows start in both key tiles) and one
/// of 100.
#[test]
fn long_prompts_through_the_pages_match_the_reference() {
    grouped_paged_attention(
        16,
        &[[150, 3], [1, 140], [2, 1]],
        &[None, Some(20), Some(100)],
    );
}

/// A token's output is the same bits however its prompt arrives: whole (150 queries: three query
/// tiles, two key tiles), in chunks, or one token at a time, beside another sequence or alone; with
/// and without sliding windows, and rows 72 wide (a whole register block and a tail). The whole
/// prompt also matches the f64 reference.
#[test]
fn a_tokens_output_does_not_depend_on_how_its_prompt_is_cut() {
    let (q_heads, kv_heads, w, tokens) = (2, 1, 72, 150);
    let shape = KvShape {
        layers: 1,
        heads: kv_heads,
        head_width: w,
        dtype: DType::F32,
    };
    let cuts: [&[usize]; 3] = [&[150], &[70, 1, 79], &[1; 150]];
    // A window of 130 makes late rows' windows cross a key tile's end: tiles must start at the same
    // tokens whoever asks.
    for window in [None, Some(20), Some(130)] {
        root(Device::Cpu, |m| {
            m.set_seed(5);
            let q = m.randn(&[tokens, q_heads, w])?;
            let kv = m.randn(&[tokens, 2, kv_heads, w])?;
            let pool = KvPool::new(m, shape, 16, 4 * tokens.div_ceil(16))?;
            let mut outputs = Vec::new();
            for cut in cuts {
                let (mut cache, mut other) = (pool.cache(m, tokens)?, pool.cache(m, tokens)?);
                let mut got: Vec<f32> = Vec::new();
                let mut at = 0;
                for &n in cut {
                    m.scope(|_| {
                        // A one-token neighbour in the same call when the prompt comes in chunks.
                        let beside = usize::from(cut.len() > 1);
                        let mut step =
                            KvStep::new(&pool, vec![&mut cache, &mut other], &[n, beside])?;
                        let (qn, kvn) = (q.narrow(0, at, n)?, kv.narrow(0, at, n)?);
                        let (q, kv) = if beside == 1 {
                            (
                                Tensor::concat(&[&qn, &q.narrow(0, 0, 1)?], 0)?,
                                Tensor::concat(&[&kvn, &kv.narrow(0, 0, 1)?], 0)?,
                            )
                        } else {
                            (qn, kvn)
                        };
                        let out =
                            step.attend_in_window(0, &q, &kv, 1.0 / (w as f64).sqrt(), window)?;
                        got.extend(out.narrow(0, 0, n)?.to_vec::<f32>()?);
                        step.finish();
                        Ok::<_, Error>(())
                    })?;
                    at += n;
                }
                outputs.push(got);
            }
            for (cut, got) in cuts.iter().zip(&outputs).skip(1) {
                assert!(
                    got == &outputs[0],
                    "window {window:?}: cut into {} pieces differs from the whole prompt",
                    cut.len()
                );
            }
            let (qs, kvs) = (q.to_vec_f64()?, kv.to_vec_f64()?);
            let pick = |x: &[f64], which: usize| -> Vec<f64> {
                x.chunks(kv_heads * w)
                    .skip(which)
                    .step_by(2)
                    .flatten()
                    .copied()
                    .collect()
            };
            let (keys, values) = (pick(&kvs, 0), pick(&kvs, 1));
            for h in 0..q_heads {
                let qh: Vec<f64> = qs
                    .chunks(w)
                    .skip(h)
                    .step_by(q_heads)
                    .flatten()
                    .copied()
                    .collect();
                let want = reference(&qh, &keys, &values, 1, w, window);
                let got = outputs[0].chunks(w).skip(h).step_by(q_heads).flatten();
                for (g, x) in got.zip(&want) {
                    assert!(
                        (f64::from(*g) - x).abs() <= 1e-5 * (1.0 + x.abs()),
                        "window {window:?} head {h}: {g} vs {x}"
                    );
                }
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

/// Rounds of `[first, second]` sequence's new tokens, in blocks of `block_tokens`, with each window.
fn grouped_paged_attention(block_tokens: usize, rounds: &[[usize; 2]], windows: &[Option<usize>]) {
    let (q_heads, kv_heads, w) = (6, 2, 8);
    let group = q_heads / kv_heads;
    let cases = windows
        .iter()
        .flat_map(|&window| [(DType::F64, 1e-12), (DType::F32, 1e-5)].map(|(d, t)| (d, t, window)));
    let longest = rounds.iter().map(|r| r[0].max(r[1])).sum::<usize>();
    for (dtype, tolerance, window) in cases {
        let shape = KvShape {
            layers: 1,
            heads: kv_heads,
            head_width: w,
            dtype,
        };
        root(Device::Cpu, |m| {
            let pool = KvPool::new(m, shape, block_tokens, 2 * longest.div_ceil(block_tokens))?;
            let mut caches = [pool.cache(m, longest)?, pool.cache(m, longest)?];
            let mut history = vec![(Vec::new(), Vec::new()); 2];
            for &counts in rounds {
                let rows: usize = counts.iter().sum();
                m.scope(|s| {
                    let mut step = KvStep::new(&pool, caches.iter_mut().collect(), &counts)?;
                    let q = s.randn(&[rows, q_heads, w])?.to_dtype(dtype)?;
                    let kv = s.randn(&[rows, 2, kv_heads, w])?.to_dtype(dtype)?;
                    let got = step
                        .attend_in_window(0, &q, &kv, 1.0 / (w as f64).sqrt(), window)?
                        .to_vec_f64()?;
                    let (q, kv) = (q.to_vec_f64()?, kv.to_vec_f64()?);
                    let mut row = 0;
                    for (seq, &n) in counts.iter().enumerate() {
                        let (keys, values) = &mut history[seq];
                        for r in row..row + n {
                            keys.extend_from_slice(&kv[(r * 2) * kv_heads * w..][..kv_heads * w]);
                            values.extend_from_slice(
                                &kv[(r * 2 + 1) * kv_heads * w..][..kv_heads * w],
                            );
                        }
                        // Each query head against its key head's history, as one-head references.
                        for h in 0..q_heads {
                            let pick = |x: &[f64], heads: usize, head: usize| -> Vec<f64> {
                                x.chunks(w)
                                    .skip(head)
                                    .step_by(heads)
                                    .flatten()
                                    .copied()
                                    .collect()
                            };
                            let qh =
                                pick(&q[row * q_heads * w..(row + n) * q_heads * w], q_heads, h);
                            let want = reference(
                                &qh,
                                &pick(keys, kv_heads, h / group),
                                &pick(values, kv_heads, h / group),
                                1,
                                w,
                                window,
                            );
                            let got =
                                pick(&got[row * q_heads * w..(row + n) * q_heads * w], q_heads, h);
                            for (g, x) in got.iter().zip(&want) {
                                assert!(
                                    (g - x).abs() <= tolerance * (1.0 + x.abs()),
                                    "{dtype} window {window:?}: sequence {seq} head {h}: {g} vs {x}"
                                );
                            }
                        }
                        row += n;
                    }
                    step.finish();
                    Ok::<_, Error>(())
                })?;
            }
            // Query heads that are not a multiple of the cache's are refused.
            let mut step = KvStep::new(&pool, caches.iter_mut().collect(), &[1, 0])?;
            let err = step
                .attend_grouped(
                    0,
                    &m.randn(&[1, 5, w])?.to_dtype(dtype)?,
                    &m.randn(&[1, 2, kv_heads, w])?.to_dtype(dtype)?,
                    1.0,
                )
                .unwrap_err();
            assert!(err.to_string().contains("a multiple of 2 heads"), "{err}");
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}

#[test]
fn paged_attention_f32_matches_the_f64_reference() {
    paged_attention_matches_reference(DType::F32, 4, 1e-5);
    paged_attention_matches_reference(DType::F32, 16, 1e-5);
}

#[test]
fn paged_attention_f64_matches_the_f64_reference() {
    paged_attention_matches_reference(DType::F64, 2, 1e-12);
}

#[test]
fn paged_attention_16_bit_matches_the_reference_of_its_rounded_inputs() {
    // Inputs are rounded to 16 bits before the reference sees them; the kernel computes in f32 and
    // rounds the output once.
    paged_attention_matches_reference(DType::BF16, 8, 1e-2);
    paged_attention_matches_reference(DType::F16, 8, 2e-3);
}

/// The outputs of `rounds` steps (new tokens per sequence, three sequences) of every layer's
/// attention through a pool of `cache` dtype, fed queries, keys and values drawn in `f32` (seed
/// `seed`), rounded to `rounded`, given to the step as `fed`; each output rounded to `out_as`.
fn attention_outputs(
    shape: KvShape,
    cache: DType,
    [rounded, fed]: [DType; 2],
    out_as: Option<DType>,
    rounds: &[[usize; 3]],
    seed: u64,
) -> Vec<Vec<f64>> {
    let (heads, w) = (shape.heads, shape.head_width);
    let shape = KvShape {
        dtype: cache,
        ..shape
    };
    root(Device::Cpu, |m| {
        m.set_seed(seed);
        let pool = KvPool::for_tokens(m, shape, 16, 3 * 400)?;
        let mut outputs = Vec::new();
        m.scope(|request| {
            let mut caches = [
                pool.cache(request, 400)?,
                pool.cache(request, 400)?,
                pool.cache(request, 400)?,
            ];
            for counts in rounds {
                let rows: usize = counts.iter().sum();
                request.scope(|s| {
                    let mut step = KvStep::new(&pool, caches.iter_mut().collect(), counts)?;
                    for layer in 0..shape.layers {
                        let qkv = s
                            .randn(&[rows, 3, heads, w])?
                            .to_dtype(rounded)?
                            .to_dtype(fed)?;
                        let out = step.attend(layer, &qkv, 1.0 / (w as f64).sqrt())?;
                        assert_eq!(out.dtype(), fed);
                        let out = out.to_dtype(out_as.unwrap_or(fed))?;
                        outputs.push(out.to_vec_f64()?);
                    }
                    step.finish();
                    Ok::<_, Error>(())
                })?;
            }
            Ok::<_, Error>(())
        })?;
        Ok::<_, Error>(outputs)
    })
    .unwrap()
}

/// Prompts past one key tile (128 tokens), single tokens, a chunk; heads of 64 and of 72 (a
/// partial 16 and a partial 64 in the kernels' loops).
const HALF_ROUNDS: [[usize; 3]; 4] = [[150, 1, 37], [1, 1, 1], [1, 20, 1], [3, 1, 200]];

#[test]
fn sixteen_bit_pages_give_the_bits_of_their_widened_f32_copy() {
    // A 16-bit page is scored and summed in f32, each element widened exactly: the same bits as
    // the f32 kernels over the widened values, rounded to 16 bits once at the end.
    for head_width in [64, 72] {
        let shape = KvShape {
            layers: 2,
            heads: 2,
            head_width,
            dtype: DType::F32,
        };
        for dtype in [DType::F16, DType::BF16] {
            let half = attention_outputs(shape, dtype, [dtype; 2], None, &HALF_ROUNDS, 5);
            // The same draws rounded to 16 bits, widened into an f32 pool, the output rounded to
            // 16 bits as the 16-bit kernel stores it.
            let wide = attention_outputs(
                shape,
                DType::F32,
                [dtype, DType::F32],
                Some(dtype),
                &HALF_ROUNDS,
                5,
            );
            assert_eq!(half.len(), wide.len());
            for (i, (h, w)) in half.iter().zip(&wide).enumerate() {
                let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(h) == bits(w),
                    "{dtype} pages, heads of {head_width}: output {i} differs"
                );
            }
        }
    }
}

#[test]
fn a_16_bit_cache_under_an_f32_model_rounds_its_inputs_and_output() {
    // The step rounds the f32 queries, keys and values to the cache's dtype, attends there and
    // widens the output back: the bits of feeding it the rounded inputs.
    let shape = KvShape {
        layers: 2,
        heads: 2,
        head_width: 64,
        dtype: DType::F32,
    };
    let rounds = [[20, 1, 5], [1, 1, 1]];
    for dtype in [DType::F16, DType::BF16] {
        let from_f32 = attention_outputs(shape, dtype, [DType::F32; 2], None, &rounds, 9);
        let rounded = attention_outputs(shape, dtype, [dtype; 2], None, &rounds, 9);
        for (i, (a, b)) in from_f32.iter().zip(&rounded).enumerate() {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.to_bits(), y.to_bits(), "{dtype} cache: output {i}");
            }
        }
        // And within the 16-bit rounding of the f32 cache's attention.
        let exact = attention_outputs(shape, DType::F32, [DType::F32; 2], None, &rounds, 9);
        let tolerance = if dtype == DType::F16 { 1e-2 } else { 5e-2 };
        for (a, b) in from_f32.iter().zip(&exact) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= tolerance * (1.0 + y.abs()),
                    "{dtype}: {x} vs {y}"
                );
            }
        }
    }
}

#[test]
fn promises_are_kept_and_everything_goes_back() {
    root(Device::Cpu, |m| {
        let pool = KvPool::new(m, SHAPE, 4, 10)?;
        m.scope(|request| {
            let a = pool.cache(request, 17)?; // 5 blocks promised
            let stats = pool.stats();
            assert_eq!((stats.blocks_free, stats.blocks_promised), (10, 5));
            let b = pool.cache(request, 20)?; // 5 more: the pool is fully promised
            let err = pool.cache(request, 1).unwrap_err();
            assert!(matches!(
                err,
                Error::KvCapacity {
                    needed: 1,
                    available: 0,
                    total: 10,
                    ..
                }
            ));
            assert!(
                err.to_string().contains("wait until other requests finish"),
                "{err}"
            );
            drop(b);
            let c = pool.cache(request, 8)?;
            assert_eq!(pool.stats().blocks_promised, 7);
            drop((a, c));
            Ok::<_, Error>(())
        })?;
        let err = pool.cache(m, 41).unwrap_err();
        assert!(
            err.to_string().contains("make a pool of more blocks"),
            "{err}"
        );
        assert_eq!(pool.stats().blocks_promised, 0);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// A cache grows past its promise while unpromised blocks are free, and fails with a typed error
/// (leaving its tokens as they were) when none is.
#[test]
fn growth_past_the_promise_takes_free_blocks_or_fails_cleanly() {
    root(Device::Cpu, |m| {
        let pool = KvPool::new(m, SHAPE, 4, 3)?;
        m.scope(|request| {
            let mut cache = pool.cache(request, 4)?;
            let other = pool.cache(request, 4)?;
            request.scope(|s| {
                let qkv = s.randn(&[8, 3, 3, 8])?;
                let mut step = KvStep::new(&pool, vec![&mut cache], &[8])?;
                step.attend(0, &qkv, 0.3)?;
                step.finish();
                Ok::<_, Error>(())
            })?;
            assert_eq!(cache.usage().blocks, 2);
            // The third block is promised to `other`.
            let err = KvStep::new(&pool, vec![&mut cache], &[1]).unwrap_err();
            assert!(matches!(err, Error::KvCapacity { .. }), "{err}");
            assert_eq!(cache.len(), 8);
            drop(other);
            KvStep::new(&pool, vec![&mut cache], &[1])?.finish();
            assert_eq!((cache.len(), cache.usage().blocks), (9, 3));
            Ok::<_, Error>(())
        })?;
        assert_eq!(pool.stats().blocks_free, 3);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_panicking_request_gives_its_blocks_back() {
    root(Device::Cpu, |m| {
        let pool = KvPool::new(m, SHAPE, 4, 8)?;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.scope(|request| {
                let mut cache = pool.cache(request, 32).unwrap();
                KvStep::new(&pool, vec![&mut cache], &[6]).unwrap().finish();
                assert_eq!(pool.stats().blocks_used(), 2);
                panic!("the request fails halfway");
            })
        }));
        assert!(caught.is_err());
        let stats = pool.stats();
        assert_eq!((stats.blocks_free, stats.blocks_promised), (8, 0));
        assert_eq!(stats.tokens_cached, 0);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn bad_input_is_refused_with_a_typed_error() {
    root(Device::Cpu, |m| {
        // A block of 1 token of f16 with width 2 is 8 bytes: not a multiple of 64.
        let odd = KvShape {
            layers: 1,
            heads: 1,
            head_width: 2,
            dtype: DType::F16,
        };
        let err = KvPool::new(m, odd, 1, 4).unwrap_err();
        assert!(err.to_string().contains("use a block of 8 tokens"), "{err}");
        assert!(
            KvPool::new(
                m,
                KvShape {
                    dtype: DType::I64,
                    ..SHAPE
                },
                4,
                4
            )
            .is_err()
        );
        assert!(KvPool::new(m, SHAPE, 0, 4).is_err());
        let pool = KvPool::new(m, SHAPE, 4, 4)?;
        let other = KvPool::new(m, SHAPE, 4, 4)?;
        m.scope(|request| {
            let mut cache = pool.cache(request, 4)?;
            let err = KvStep::new(&other, vec![&mut cache], &[1]).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { .. })
                    && err.to_string().contains("another KV pool"),
                "{err}"
            );
            let mut step = KvStep::new(&pool, vec![&mut cache], &[2])?;
            let wrong: Tensor<'_> = request.zeros(&[2, 3, 3, 4])?;
            let err = step.attend(0, &wrong, 1.0).unwrap_err();
            assert!(err.to_string().contains("[2, 3, 3, 8]"), "{err}");
            let f64s = request.zeros(&[2, 3, 3, 8])?.to_dtype(DType::F64)?;
            assert!(matches!(
                step.attend(0, &f64s, 1.0),
                Err(Error::DTypeMismatch { .. })
            ));
            let layer = request.zeros(&[2, 3, 3, 8])?;
            assert!(step.attend(2, &layer, 1.0).is_err());
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// An engine whose pool is held by a cache outside it answers `KvCapacity` instead of waiting forever.
#[test]
fn an_engine_starved_by_an_outside_cache_is_a_typed_error() {
    use ndscope::models::{Gpt2, Gpt2Config};
    use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request};
    root(Device::Cpu, |m| {
        let gpt2 = Gpt2::new(m, Gpt2Config::new(64, 64, 16, 1, 2))?;
        let pool = KvPool::new(m, ndscope::kv::CausalLm::kv_shape(&gpt2), 16, 2)?;
        let outside = pool.cache(m, 32)?; // both blocks promised
        let mut engine = Engine::new(&gpt2, &pool, EngineConfig::default());
        engine.submit(Request {
            prompt: vec![1, 2],
            options: GenerateOptions::greedy(4),
            arrival: 0,
        })?;
        let err = engine.run(m, |_| {}).unwrap_err();
        assert!(matches!(err, Error::KvCapacity { .. }), "{err}");
        drop(outside);
        engine.submit(Request {
            prompt: vec![1, 2],
            options: GenerateOptions::greedy(4),
            arrival: 0,
        })?;
        assert_eq!(engine.run(m, |_| {})?.len(), 1);
        Ok::<_, Error>(())
    })
    .unwrap();
}
