//! Fused attention (`Tensor::attention`, `Var::attention`) against a plain f64 loop and against the
//! unfused composition (`nn::scaled_dot_product_attention`): every mask, lengths on both sides of the
//! kernels' tiles (64 queries, 128 keys), one query against a long cache, strided operands, every
//! float dtype, and the errors. Its derivative is checked by finite differences in `autograd.rs`.

mod common;

use common::{assert_close, values};
use ndscope::nn::{AttentionOptions, Mode, scaled_dot_product_attention};
use ndscope::{AttentionSpec, Causal, DType, Device, Error, Scope, Tape, Tensor, root};

/// One head's attention in f64: `q` `[tq, d]`, `k` `[tk, d]`, `v` `[tk, dv]`, query `i` seeing the
/// keys `seen(i)`; a query that sees none gets zeros.
fn reference_head(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (tq, tk, d, dv): (usize, usize, usize, usize),
    scale: f64,
    seen: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<f64> {
    let mut out = vec![0.0; tq * dv];
    for i in 0..tq {
        let keys = seen(i);
        let keys = keys.start..keys.end.min(tk);
        if keys.is_empty() {
            continue;
        }
        let s: Vec<f64> = keys
            .clone()
            .map(|j| scale * (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum::<f64>())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let total: f64 = e.iter().sum();
        for (j, w) in keys.zip(&e) {
            for c in 0..dv {
                out[i * dv + c] += w / total * v[j * dv + c];
            }
        }
    }
    out
}

/// `[b, h, tq, d]` queries over `[b, h, tk, d]` keys and `[b, h, tk, dv]` values in f64.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    [b, h, tq, tk, d, dv]: [usize; 6],
    causal: Causal,
    window: Option<usize>,
    lengths: Option<&[i64]>,
) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Vec::new();
    for bi in 0..b {
        let keys = lengths.map_or(tk, |l| l[bi].clamp(0, tk as i64) as usize);
        for hi in 0..h {
            let head = bi * h + hi;
            let seen = |i: usize| {
                let limit = match causal {
                    Causal::None => keys,
                    Causal::TopLeft => i + 1,
                    Causal::BottomRight => (i + tk + 1).saturating_sub(tq),
                };
                // A sliding window: the last `window` positions up to the causal limit.
                let first = window.map_or(0, |w| limit.saturating_sub(w));
                first..limit.min(keys)
            };
            out.extend(reference_head(
                &q[head * tq * d..][..tq * d],
                &k[head * tk * d..][..tk * d],
                &v[head * tk * dv..][..tk * dv],
                (tq, tk, d, dv),
                scale,
                seen,
            ));
        }
    }
    out
}

#[test]
fn fused_attention_matches_an_f64_loop_for_every_mask_and_tile_edge() {
    root(Device::Cpu, |s| {
        let shapes: [[usize; 6]; 7] = [
            [1, 1, 1, 1, 4, 4],       // one query, one key
            [2, 3, 5, 7, 8, 6],       // value width differs from the key width
            [1, 2, 63, 63, 16, 16],   // just below a query tile
            [1, 2, 65, 130, 16, 8],   // just above a query tile and a key tile
            [1, 1, 1, 300, 32, 32],   // one query against a long cache (decoding)
            [2, 1, 130, 129, 8, 8],   // more queries than keys
            [1, 1, 200, 257, 64, 64], // several tiles each way at GPT-2's head width
        ];
        for (n, dims @ [b, h, tq, tk, d, dv]) in shapes.into_iter().enumerate() {
            let q = values(b * h * tq * d, 10 + n as u64);
            let k = values(b * h * tk * d, 20 + n as u64);
            let v = values(b * h * tk * dv, 30 + n as u64);
            let (qt, kt, vt) = (
                s.from_slice(&q, &[b, h, tq, d])?,
                s.from_slice(&k, &[b, h, tk, d])?,
                s.from_slice(&v, &[b, h, tk, dv])?,
            );
            let lengths: Vec<i64> = (0..b).map(|i| (tk as i64) - 3 * i as i64).collect();
            let lt = s.from_slice(&lengths, &[b])?;
            let masks = [
                (Causal::None, None),
                (Causal::TopLeft, None),
                (Causal::BottomRight, None),
                // Sliding windows: one key, a few, and more than a key tile.
                (Causal::TopLeft, Some(1)),
                (Causal::TopLeft, Some(7)),
                (Causal::BottomRight, Some(7)),
                (Causal::BottomRight, Some(150)),
            ];
            for (causal, window) in masks {
                for with_lengths in [false, true] {
                    let spec = AttentionSpec {
                        causal,
                        scale: None,
                        window,
                    };
                    let l = with_lengths.then_some(&lt);
                    let got = qt.attention(&kt, &vt, spec, l)?;
                    assert_eq!(got.shape(), &[b, h, tq, dv]);
                    let want = reference(
                        &q,
                        &k,
                        &v,
                        dims,
                        causal,
                        window,
                        with_lengths.then_some(&lengths[..]),
                    );
                    assert_close(&got.to_vec::<f64>()?, &want, 1e-12);
                    // The same in f32, within f32 rounding.
                    let got32 = qt.to_dtype(DType::F32)?.attention(
                        &kt.to_dtype(DType::F32)?,
                        &vt.to_dtype(DType::F32)?,
                        spec,
                        l,
                    )?;
                    assert_close(&got32.to_vec_f64()?, &want, 2e-5);
                }
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn fused_attention_equals_the_unfused_composition_in_value_and_gradient() {
    root(Device::Cpu, |s| {
        let x = s.from_slice(&values(2 * 3 * 70 * 8, 5), &[2, 3, 70, 8])?;
        let y = s.from_slice(&values(2 * 3 * 70 * 8, 6), &[2, 3, 70, 8])?;
        let z = s.from_slice(&values(2 * 3 * 70 * 8, 7), &[2, 3, 70, 8])?;
        let w = s.from_slice(&values(2 * 3 * 70 * 8, 8), &[2, 3, 70, 8])?;
        for causal in [false, true] {
            let run = |fused: bool| {
                s.scope(|batch| {
                    let tape = Tape::new(batch);
                    let (q, k, v) = (tape.param(&x), tape.param(&y), tape.param(&z));
                    let out = if fused {
                        let spec = AttentionSpec {
                            causal: if causal {
                                Causal::TopLeft
                            } else {
                                Causal::None
                            },
                            scale: None,
                            window: None,
                        };
                        q.attention(&k, &v, spec, None)?
                    } else {
                        let options = AttentionOptions {
                            causal,
                            dropout: 0.0,
                        };
                        scaled_dot_product_attention(&q, &k, &v, options, Mode::Train)?.output
                    };
                    let loss = out.mul(&tape.constant(&w))?.sum_all()?;
                    let grads = tape.backward(&loss)?;
                    let mut all = out.value().to_vec::<f64>()?;
                    for p in [&x, &y, &z] {
                        all.extend(grads.get(p).expect("a gradient").to_vec::<f64>()?);
                    }
                    Ok::<_, Error>(all)
                })
            };
            assert_close(&run(true)?, &run(false)?, 1e-12);
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn fused_attention_reads_strided_heads_and_every_rank() {
    root(Device::Cpu, |s| {
        // Heads as permuted views of one [batch, len, 3, heads, width] projection, as a layer makes
        // them: no copy is asked for, and the result is that of contiguous operands.
        let (b, t, h, d) = (2, 9, 3, 4);
        let qkv = s
            .from_slice(&values(b * t * 3 * h * d, 40), &[b, t, 3, h, d])?
            .permute(&[2, 0, 3, 1, 4])?;
        let part = |i: usize| qkv.narrow(0, i, 1)?.squeeze(0);
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let strided = q.attention(&k, &v, AttentionSpec::CAUSAL, None)?;
        let packed = q.contiguous()?.attention(
            &k.contiguous()?,
            &v.contiguous()?,
            AttentionSpec::CAUSAL,
            None,
        )?;
        assert_eq!(strided.to_vec::<f64>()?, packed.to_vec::<f64>()?);
        // Its heads merge into [batch, len, width] without a copy.
        let merged = strided.permute(&[0, 2, 1, 3])?;
        assert!(merged.is_contiguous());
        // Rank 3 ([batch, len, width]) and rank 2 ([len, width]) are one head.
        let q3 = q.narrow(1, 0, 1)?.squeeze(1)?;
        let (k3, v3) = (
            k.narrow(1, 0, 1)?.squeeze(1)?,
            v.narrow(1, 0, 1)?.squeeze(1)?,
        );
        let out3 = q3.attention(&k3, &v3, AttentionSpec::CAUSAL, None)?;
        assert_eq!(out3.shape(), &[b, t, d]);
        assert_eq!(
            out3.to_vec::<f64>()?,
            strided.narrow(1, 0, 1)?.squeeze(1)?.to_vec::<f64>()?
        );
        let q2 = q3.narrow(0, 1, 1)?.squeeze(0)?;
        let (k2, v2) = (
            k3.narrow(0, 1, 1)?.squeeze(0)?,
            v3.narrow(0, 1, 1)?.squeeze(0)?,
        );
        let out2 = q2.attention(&k2, &v2, AttentionSpec::CAUSAL, None)?;
        assert_eq!(
            out2.to_vec::<f64>()?,
            out3.narrow(0, 1, 1)?.squeeze(0)?.to_vec::<f64>()?
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn sixteen_bit_attention_is_within_one_step_of_the_rounded_result() {
    root(Device::Cpu, |s| {
        let dims = [1, 2, 70, 150, 16, 16];
        let [b, h, tq, tk, d, dv] = dims;
        let q = s.from_slice(&values(b * h * tq * d, 1), &[b, h, tq, d])?;
        let k = s.from_slice(&values(b * h * tk * d, 2), &[b, h, tk, d])?;
        let v = s.from_slice(&values(b * h * tk * dv, 3), &[b, h, tk, dv])?;
        for dtype in [DType::BF16, DType::F16] {
            let (q16, k16, v16) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
            // The reference is computed from the 16-bit values, in f64, then rounded once.
            let want = reference(
                &q16.to_vec_f64()?,
                &k16.to_vec_f64()?,
                &v16.to_vec_f64()?,
                dims,
                Causal::BottomRight,
                None,
                None,
            );
            let spec = AttentionSpec {
                causal: Causal::BottomRight,
                scale: None,
                window: None,
            };
            let got = q16.attention(&k16, &v16, spec, None)?;
            assert_eq!(got.dtype(), dtype);
            let rounded = s.from_slice(&want, &[want.len()])?.to_dtype(dtype)?;
            let (got, rounded) = (got.to_vec_f64()?, rounded.to_vec_f64()?);
            // Within one 16-bit step of the correctly rounded result: f32 accumulation (and on
            // AMX tiles, weights carried in 16 bits) may land on the other side of a rounding
            // boundary.
            let step = if dtype == DType::BF16 {
                1.0 / 128.0
            } else {
                1.0 / 1024.0
            };
            for (g, r) in got.iter().zip(&rounded) {
                assert!(
                    (g - r).abs() <= step * r.abs().max(1.0),
                    "{dtype}: {g} vs {r}"
                );
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// The gradients `[dq, dk, dv]` of `Σ w · attention(q, k, v)` with `[q, k, v, w]` = `inputs` cast
/// to `dtype`, as f64.
fn gradients<'s>(
    s: &Scope<'s>,
    inputs: [&Tensor<'s>; 4],
    dtype: DType,
    spec: AttentionSpec,
) -> Result<Vec<Vec<f64>>, Error> {
    s.scope(|g| {
        let tape = Tape::new(g);
        let [q, k, v, w] = inputs.map(|x| x.to_dtype(dtype));
        let (q, k, v, w) = (q?, k?, v?, w?);
        let (vq, vk, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
        let out = vq.attention(&vk, &vv, spec, None)?;
        let grads = tape.backward(&out.mul(&tape.constant(&w))?.sum_all()?)?;
        [&q, &k, &v]
            .map(|x| grads.get(x).expect("a gradient").to_vec_f64())
            .into_iter()
            .collect()
    })
}

/// The 16-bit gradients (on a CPU with AMX or AVX-512 BF16, `bf16`'s run on bf16 blocks with the
/// weights and `ds` rounded to bf16; elsewhere widened to f32) against f64 gradients of the same
/// 16-bit values: every element within 2⁻⁶ of its tensor's largest, for grouped heads, a window and
/// lengths past the kernels' tiles.
#[test]
fn sixteen_bit_attention_gradients_are_close_to_the_f64_ones() {
    root(Device::Cpu, |s| {
        let [b, h, kh, tq, tk, d] = [1, 4, 2, 150, 300, 64];
        let q = s.from_slice(&values(b * h * tq * d, 21), &[b, h, tq, d])?;
        let k = s.from_slice(&values(b * kh * tk * d, 22), &[b, kh, tk, d])?;
        let v = s.from_slice(&values(b * kh * tk * d, 23), &[b, kh, tk, d])?;
        let w = s.from_slice(&values(b * h * tq * d, 24), &[b, h, tq, d])?;
        for (dtype, window) in [
            (DType::BF16, None),
            (DType::BF16, Some(100)),
            (DType::F16, None),
        ] {
            let spec = AttentionSpec {
                causal: Causal::BottomRight,
                scale: None,
                window,
            };
            let got = gradients(s, [&q, &k, &v, &w], dtype, spec)?;
            // The f64 gradients of the 16-bit values.
            let [q16, k16, v16, w16] = [&q, &k, &v, &w].map(|x| x.to_dtype(dtype));
            let (q16, k16, v16, w16) = (q16?, k16?, v16?, w16?);
            let want = gradients(s, [&q16, &k16, &v16, &w16], DType::F64, spec)?;
            for ((g, w), name) in got.iter().zip(&want).zip(["dq", "dk", "dv"]) {
                let largest = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                assert!(largest > 0.0, "{dtype} {window:?}: {name} is all zeros");
                for (e, (g, w)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (g - w).abs() <= largest / 64.0,
                        "{dtype} {window:?}: {name}[{e}] {g} vs {w} (largest {largest})"
                    );
                }
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_query_that_sees_no_key_gets_zeros_and_zero_gradients() {
    root(Device::Cpu, |s| {
        let x = s.from_slice(&values(2 * 4 * 3, 9), &[2, 4, 3])?;
        let lengths = s.from_slice(&[0i64, 2], &[2])?;
        let tape = Tape::new(s);
        let q = tape.param(&x);
        let out = q.attention(&q, &q, AttentionSpec::default(), Some(&lengths))?;
        let got = out.value().to_vec::<f64>()?;
        assert!(
            got[..12].iter().all(|&v| v == 0.0),
            "batch 0 holds no key: {got:?}"
        );
        assert!(got[12..].iter().all(|v| v.is_finite()));
        let grads = tape.backward(&out.sum_all()?)?;
        let g = grads.get(&x).expect("a gradient").to_vec::<f64>()?;
        assert!(g[..12].iter().all(|&v| v == 0.0));
        // Keys past batch 1's length get no gradient through keys or values; its queries do.
        assert!(g[12..].iter().all(|v| v.is_finite()));
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Grouped-query attention: 6 query heads over 2 key and value heads (3 each) give what the same
/// queries give over keys and values repeated per query head, in value and in every gradient (the
/// repeat's gradient sums each group), for every mask, key lengths and strided heads.
#[test]
fn grouped_query_attention_equals_attention_over_repeated_heads() {
    let (b, h, kh, len, w) = (2, 6, 2, 37, 8);
    root(Device::Cpu, |s| {
        let x = s.from_slice(&values(b * h * len * w, 11), &[b, h, len, w])?;
        // Keys and values as one projection's halves: strided heads.
        let kv = s.from_slice(&values(b * len * 2 * kh * w, 12), &[b, len, 2, kh, w])?;
        let y = kv.narrow(2, 0, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])?;
        let z = kv.narrow(2, 1, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])?;
        let wt = s.from_slice(&values(b * h * len * w, 13), &[b, h, len, w])?;
        let lengths = s.from_slice(&[37i64, 20], &[2])?;
        let repeat = s.from_slice(&[0i64, 0, 0, 1, 1, 1], &[6])?;
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            for key_lengths in [None, Some(&lengths)] {
                let run = |grouped: bool| {
                    s.scope(|batch| {
                        let tape = Tape::new(batch);
                        let (q, k, v) = (tape.param(&x), tape.param(&y), tape.param(&z));
                        let spec = AttentionSpec {
                            causal,
                            scale: None,
                            window: None,
                        };
                        let out = if grouped {
                            q.attention(&k, &v, spec, key_lengths)?
                        } else {
                            let (k, v) = (k.index_select(1, &repeat)?, v.index_select(1, &repeat)?);
                            q.attention(&k, &v, spec, key_lengths)?
                        };
                        let loss = out.mul(&tape.constant(&wt))?.sum_all()?;
                        let grads = tape.backward(&loss)?;
                        let mut all = out.value().to_vec::<f64>()?;
                        for p in [&x, &kv] {
                            all.extend(grads.get(p).expect("a gradient").to_vec::<f64>()?);
                        }
                        Ok::<_, Error>(all)
                    })
                };
                assert_close(&run(true)?, &run(false)?, 1e-12);
            }
        }
        // A key head count that does not divide the query heads is refused.
        let four = s.zeros(&[b, 4, len, w])?.to_dtype(DType::F64)?;
        let err = x
            .attention(&four, &four, AttentionSpec::default(), None)
            .unwrap_err();
        assert!(err.to_string().contains("grouped-query"), "{err}");
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn bad_attention_operands_are_typed_errors() {
    root(Device::Cpu, |s| {
        let q = s.zeros(&[2, 3, 5, 4])?;
        let k = s.zeros(&[2, 3, 6, 4])?;
        let spec = AttentionSpec::default();
        let is_shape = |r: ndscope::Result<Tensor>| {
            matches!(
                r,
                Err(Error::ShapeMismatch { .. } | Error::InvalidShape { .. })
            )
        };
        assert!(is_shape(q.attention(
            &k,
            &s.zeros(&[2, 3, 5, 4])?,
            spec,
            None
        )));
        assert!(is_shape(q.attention(
            &s.zeros(&[2, 3, 6, 5])?,
            &k,
            spec,
            None
        )));
        let vector = s.zeros(&[4])?;
        assert!(is_shape(vector.attention(&vector, &vector, spec, None)));
        assert!(is_shape(q.attention(&s.zeros(&[3, 6, 4])?, &k, spec, None)));
        let five = s.zeros(&[1, 2, 3, 5, 4])?;
        let err = five.attention(&five, &five, spec, None).unwrap_err();
        assert!(err.to_string().contains("reshape"), "{err}");
        let bad_lengths = s.from_slice(&[1.0f32, 2.0], &[2])?;
        assert!(is_shape(q.attention(&k, &k, spec, Some(&bad_lengths))));
        let nan_scale = AttentionSpec {
            causal: Causal::None,
            scale: Some(f64::NAN),
            window: None,
        };
        assert!(is_shape(q.attention(&k, &k, nan_scale, None)));
        let ints = s.from_slice(&[1i64; 8], &[2, 4])?;
        assert!(matches!(
            ints.attention(&ints, &ints, spec, None),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            q.attention(&k.to_dtype(DType::F64)?, &k, spec, None),
            Err(Error::DTypeMismatch { .. })
        ));
        // A sliding window counts back from a causal position, and must hold a key.
        for (causal, window, says) in [
            (Causal::None, Some(4), "only a causal mask"),
            (Causal::TopLeft, Some(0), "window of 0"),
        ] {
            let spec = AttentionSpec {
                causal,
                scale: None,
                window,
            };
            let err = q.attention(&k, &k, spec, None).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
            assert!(err.to_string().contains(says), "{err}");
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// What the tape keeps between the forward and the backward pass: fused attention keeps its output
/// and one log-sum per query (`O(T)` per head); the unfused composition keeps at least
/// its `[T, T]` weights per head.
#[test]
fn fused_attention_keeps_o_of_t_state_per_head() {
    root(Device::Cpu, |s| {
        let (b, h, t, d) = (1, 4, 256, 32);
        let (q, k, v) = (
            s.randn(&[b, h, t, d])?,
            s.randn(&[b, h, t, d])?,
            s.randn(&[b, h, t, d])?,
        );
        // Outputs go to the innermost owner of their operands (here `s`, which holds q, k, v), so
        // what the forward pass added is measured over the whole tree.
        let kept = |fused: bool| {
            let before = s.stats().subtree_bytes;
            s.scope(|batch| {
                let tape = Tape::new(batch);
                let (qv, kv, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
                let out = if fused {
                    qv.attention(&kv, &vv, AttentionSpec::CAUSAL, None)?
                } else {
                    let options = AttentionOptions {
                        causal: true,
                        dropout: 0.0,
                    };
                    scaled_dot_product_attention(&qv, &kv, &vv, options, Mode::Train)?.output
                };
                let added = s.stats().subtree_bytes - before;
                tape.backward(&out.sum_all()?)?;
                Ok::<_, Error>(added)
            })
        };
        let (fused, unfused) = (kept(true)?, kept(false)?);
        let output = b * h * t * d * 4;
        let lse = b * h * t * 4;
        assert!(
            fused >= output + lse && fused <= output + lse + 4096,
            "fused attention keeps {fused} B; its output and log-sums are {} B",
            output + lse
        );
        assert!(
            unfused >= b * h * t * t * 4,
            "the unfused composition keeps {unfused} B"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}
