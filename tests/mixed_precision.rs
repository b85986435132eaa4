//! 16-bit floats: every op in `bf16` and `f16` against the `f32` result on the same values, autocast
//! training of the digits MLP against `f32` training, loss scaling, the workspace's bytes, and 16-bit
//! checkpoints.

mod common;

use common::gpt::Gpt;

use ndscope::data::{Batch, Dataset, Loader};
use ndscope::nn::{self, Activation, Init, Mode, Module, Sequential};
use ndscope::optim::{Adam, AdamConfig, LossScaler, Optimizer};
use ndscope::{DType, Device, Result, Scope, Tape, Workspace, bf16, f16, root};

/// How a training run computes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Precision {
    F32,
    /// Autocast to this dtype; `f16` runs with a loss scaler.
    Autocast(DType),
}

/// The batch's features in `dtype` (16-bit inputs: an `f32` input cast inside the step would hold
/// both copies).
fn features<'b>(b: &Scope<'b>, batch: &Batch, dtype: DType) -> Result<ndscope::Tensor<'b>> {
    let shape = batch.feature_shape();
    match dtype {
        DType::BF16 => b.from_slice(
            &batch
                .features()
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect::<Vec<_>>(),
            &shape,
        ),
        DType::F16 => b.from_slice(
            &batch
                .features()
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect::<Vec<_>>(),
            &shape,
        ),
        _ => b.from_slice(batch.features(), &shape),
    }
}

/// One step; returns the loss (unscaled) and whether the optimizer stepped.
fn step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
    scaler: &mut Option<LossScaler>,
    batch: &Batch,
    precision: Precision,
) -> Result<(f32, bool)> {
    let dtype = match precision {
        Precision::F32 => DType::F32,
        Precision::Autocast(d) => {
            b.autocast(d)?;
            d
        }
    };
    let tape = Tape::new(b);
    let x = tape.constant(&features(b, batch, dtype)?);
    let labels = b.from_slice(batch.labels(), &[batch.rows()])?;
    let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
    let value = loss.value().to_scalar::<f32>()?;
    match scaler {
        Some(scaler) => {
            let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
            Ok((value, scaler.step(opt, model, &mut grads)?))
        }
        None => {
            opt.step(model, &tape.backward(&loss)?)?;
            Ok((value, true))
        }
    }
}

/// What a run ended with.
#[derive(Debug)]
struct Run {
    last_epoch_loss: f64,
    accuracy: f64,
    arena: usize,
    skipped: u64,
}

/// Trains the digits MLP for `epochs` in `precision`, in a planned workspace.
fn train_digits(precision: Precision, epochs: u64, batch_size: usize) -> Result<Run> {
    let (train, test) = Dataset::digits()?.split(0.2, 7)?;
    let loader = Loader::new(&train, batch_size)?.shuffle(7);
    let mut ws = Workspace::planned("batch");
    root(Device::Cpu, |s| {
        s.set_seed(7);
        s.scope(|m| {
            let mut model = nn::mlp(m, &[64, 128, 10], Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(3e-3, 1e-4))?;
            let mut scaler = (precision == Precision::Autocast(DType::F16)).then(LossScaler::new);
            let mut last_epoch_loss = 0.0;
            for epoch in 0..epochs {
                let mut sum = 0.0;
                loader.for_each_batch(epoch, true, |batch| {
                    let (loss, _) = m.workspace(&mut ws, |b| {
                        step(b, &mut model, &mut opt, &mut scaler, batch, precision)
                    })?;
                    sum += f64::from(loss);
                    Ok(())
                })?;
                last_epoch_loss = sum / loader.batches_per_epoch() as f64;
            }
            let accuracy = m.scope(|e| {
                let x = e.from_slice(test.features(), &[test.len(), test.dim()])?;
                let tape = Tape::no_grad(e);
                let predicted = model
                    .forward(&tape.constant(&x), Mode::Eval)?
                    .value()
                    .argmax(-1, false)?
                    .to_vec::<i64>()?;
                let correct = predicted.iter().zip(test.labels()).filter(|(p, l)| p == l);
                Ok(correct.count() as f64 / test.len() as f64)
            })?;
            Ok(Run {
                last_epoch_loss,
                accuracy,
                arena: ws.capacity(),
                skipped: scaler.map_or(0, |s| s.skipped_steps()),
            })
        })
    })
}

#[test]
fn autocast_training_of_the_digits_mlp_matches_f32() {
    let f32_run = train_digits(Precision::F32, 12, 64).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let run = train_digits(Precision::Autocast(dtype), 12, 64).unwrap();
        let loss_ratio = run.last_epoch_loss / f32_run.last_epoch_loss;
        assert!(
            (loss_ratio - 1.0).abs() <= 0.02,
            "{dtype}: last epoch's loss {} vs f32 {}",
            run.last_epoch_loss,
            f32_run.last_epoch_loss
        );
        assert!(
            (run.accuracy - f32_run.accuracy).abs() <= 0.01,
            "{dtype}: accuracy {} vs f32 {}",
            run.accuracy,
            f32_run.accuracy
        );
        assert!(run.accuracy > 0.95, "{dtype}: {run:?}");
        assert_eq!(run.skipped, 0, "{dtype}: no overflow at this scale");
        if dtype == DType::BF16 {
            // Activations and the tape's saved tensors in 16 bits, plus the 16-bit casts of the
            // weights, which belong to the step (the tape's scope) like every result of the step.
            let ratio = run.arena as f64 / f32_run.arena as f64;
            assert!(
                ratio <= 0.7,
                "bf16 arena {} B is {ratio:.2}x the f32 arena {} B",
                run.arena,
                f32_run.arena
            );
        }
    }
}

/// The mean loss of the last ten of `steps` steps of the tests' small GPT (two pre-norm blocks with
/// causal attention and dropout) in `precision`, AdamW, from one seed.
fn train_gpt(precision: Precision, steps: u64) -> Result<f64> {
    root(Device::Cpu, |s| {
        s.set_seed(5);
        s.scope(|m| {
            let mut model = Gpt::new(m)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-2))?;
            let mut scaler = (precision == Precision::Autocast(DType::F16)).then(LossScaler::new);
            let mut last = Vec::new();
            for step in 0..steps {
                let loss = m.scope(|b| {
                    if let Precision::Autocast(d) = precision {
                        b.autocast(d)?;
                    }
                    let tape = Tape::new(b);
                    let loss = model.loss(&tape, b, step)?;
                    match &mut scaler {
                        Some(scaler) => {
                            let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
                            scaler.step(&mut opt, &mut model, &mut grads)?;
                        }
                        None => opt.step(&mut model, &tape.backward(&loss)?)?,
                    }
                    loss.value().to_scalar::<f32>()
                })?;
                last.push(f64::from(loss));
            }
            Ok(last[last.len() - 10..].iter().sum::<f64>() / 10.0)
        })
    })
}

#[test]
fn autocast_training_of_a_small_gpt_matches_f32() {
    // Measured: bf16 within 0.18 % of the f32 run's loss (0.0153), f16 within 0.05 %.
    let f32_loss = train_gpt(Precision::F32, 60).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let loss = train_gpt(Precision::Autocast(dtype), 60).unwrap();
        assert!(
            (loss / f32_loss - 1.0).abs() <= 0.02,
            "{dtype}: the last steps' loss {loss} vs f32 {f32_loss}"
        );
    }
}

/// Values that every dtype holds exactly: `values` (in `[-2, 2)`, or `[0.5, 2.5)` for ops that
/// need positive inputs) rounded to `dtype` (and through it to `f32`).
fn exact_values(n: usize, seed: u64, dtype: DType, positive: bool) -> Vec<f32> {
    common::values(n, seed)
        .into_iter()
        .map(|v| if positive { v.abs() + 0.5 } else { v })
        .map(|v| match dtype {
            DType::BF16 => bf16::from_f64(v).to_f32(),
            DType::F16 => f16::from_f64(v).to_f32(),
            _ => v as f32,
        })
        .collect()
}

/// `got` (a 16-bit result) against `want` (the `f32` result on the same values): within `ulps`
/// roundings of the dtype plus `f32` rounding `slack` (reductions may add in another order).
fn assert_near(name: &str, dtype: DType, got: &[f64], want: &[f64], ulps: f64, slack: f64) {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = ulps * dtype.epsilon() * w.abs() + slack;
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol;
        assert!(
            ok,
            "{name} in {dtype}: element {i} is {g}, the f32 result {w} (tolerance {tol})"
        );
    }
}

/// `f32` values rounded once to `dtype`, as `f64`.
fn rounded(dtype: DType, values: &[f64]) -> Vec<f64> {
    values
        .iter()
        .map(|&v| match dtype {
            DType::BF16 => bf16::from_f64(v).to_f64(),
            _ => f16::from_f64(v).to_f64(),
        })
        .collect()
}

type Op = for<'a> fn(&[ndscope::Tensor<'a>]) -> Result<ndscope::Tensor<'a>>;

/// Runs `op` on inputs of `shapes` (values exact in both dtypes; positive ones for the ops that need
/// them) in `dtype` and in `f32`.
fn both(
    s: &Scope<'_>,
    dtype: DType,
    shapes: &[&[usize]],
    positive: bool,
    op: Op,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut wide = Vec::new();
    let mut narrow = Vec::new();
    for (k, shape) in shapes.iter().enumerate() {
        let n = shape.iter().product();
        let t = s.from_slice(&exact_values(n, 31 + k as u64, dtype, positive), shape)?;
        narrow.push(t.to_dtype(dtype)?);
        wide.push(t);
    }
    let got = op(&narrow)?;
    assert_eq!(got.dtype(), dtype);
    Ok((got.to_vec_f64()?, op(&wide)?.to_vec_f64()?))
}

/// Elementwise maps compute in `f32` and round once: the 16-bit result is the `f32` result rounded.
#[test]
fn elementwise_ops_in_16_bit_are_the_f32_result_rounded_once() {
    let ops: Vec<(&str, Vec<&[usize]>, Op)> = vec![
        ("neg", vec![&[3, 7]], |t| t[0].neg()),
        ("abs", vec![&[3, 7]], |t| t[0].abs()),
        ("square", vec![&[3, 7]], |t| t[0].square()),
        ("relu", vec![&[3, 7]], |t| t[0].relu()),
        ("exp", vec![&[3, 7]], |t| t[0].exp()),
        ("log", vec![&[3, 7]], |t| t[0].log()),
        ("sqrt", vec![&[3, 7]], |t| t[0].sqrt()),
        ("recip", vec![&[3, 7]], |t| t[0].recip()),
        ("tanh", vec![&[3, 7]], |t| t[0].tanh()),
        ("sin", vec![&[3, 7]], |t| t[0].sin()),
        ("cos", vec![&[3, 7]], |t| t[0].cos()),
        ("sigmoid", vec![&[3, 7]], |t| t[0].sigmoid()),
        ("gelu", vec![&[3, 7]], |t| t[0].gelu()),
        ("gelu_exact", vec![&[3, 7]], |t| t[0].gelu_exact()),
        ("silu", vec![&[3, 7]], |t| t[0].silu()),
        ("erf", vec![&[3, 7]], |t| t[0].erf()),
        ("log1p", vec![&[3, 7]], |t| t[0].log1p()),
        ("expm1", vec![&[3, 7]], |t| t[0].expm1()),
        ("add_scalar", vec![&[3, 7]], |t| t[0].add_scalar(0.3)),
        ("mul_scalar", vec![&[3, 7]], |t| t[0].mul_scalar(1.7)),
        ("div_scalar", vec![&[3, 7]], |t| t[0].div_scalar(3.0)),
        ("powf", vec![&[3, 7]], |t| t[0].powf(1.5)),
        ("clamp", vec![&[3, 7]], |t| t[0].clamp(-0.5, 0.7)),
        ("add", vec![&[3, 7], &[7]], |t| t[0].add(&t[1])),
        ("sub", vec![&[3, 7], &[3, 1]], |t| t[0].sub(&t[1])),
        ("mul", vec![&[3, 7], &[3, 7]], |t| t[0].mul(&t[1])),
        ("div", vec![&[3, 7], &[7]], |t| t[0].div(&t[1])),
        ("maximum", vec![&[3, 7], &[7]], |t| t[0].maximum(&t[1])),
        ("minimum", vec![&[3, 7], &[7]], |t| t[0].minimum(&t[1])),
        ("pow", vec![&[3, 7], &[7]], |t| t[0].pow(&t[1])),
        ("gt", vec![&[3, 7], &[7]], |t| t[0].gt(&t[1])),
        ("where_cond", vec![&[3, 7], &[3, 7], &[7]], |t| {
            ndscope::Tensor::where_cond(&t[0].gt(&t[1])?, &t[1], &t[2])
        }),
        ("strided add", vec![&[7, 3], &[3, 7]], |t| {
            t[0].t()?.add(&t[1])
        }),
        ("in-place axpy", vec![&[3, 7], &[3, 7]], |t| {
            let mut y = t[0].deep_copy()?;
            y.axpy_(0.25, &t[1])?;
            Ok(y)
        }),
        ("cast round trip", vec![&[3, 7]], |t| {
            t[0].to_dtype(DType::F64)?.to_dtype(t[0].dtype())
        }),
        ("tril", vec![&[4, 4]], |t| t[0].tril(0)),
    ];
    root(Device::Cpu, |s| {
        for dtype in [DType::BF16, DType::F16] {
            for (name, shapes, op) in &ops {
                let positive = ["log", "sqrt", "log1p", "powf", "pow"].contains(name);
                let (got, want) = both(s, dtype, shapes, positive, *op)?;
                assert_near(name, dtype, &got, &rounded(dtype, &want), 0.0, 0.0);
            }
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// Reductions, softmax, products and window ops accumulate in `f32` and round once: within one
/// rounding of the `f32` result, plus `f32` roundings for a different order of the additions.
#[test]
fn reductions_products_and_windows_in_16_bit_accumulate_in_f32() {
    let eps32 = f64::from(f32::EPSILON);
    // (name, input shapes, terms added per output element, op)
    let ops: Vec<(&str, Vec<&[usize]>, usize, Op)> = vec![
        ("sum of rows", vec![&[4, 300]], 300, |t| {
            t[0].sum(&[-1], false)
        }),
        ("sum of columns", vec![&[300, 4]], 300, |t| {
            t[0].sum(&[0], false)
        }),
        ("sum_all", vec![&[30, 40]], 1200, |t| t[0].sum_all()),
        ("mean", vec![&[3, 5, 40]], 200, |t| t[0].mean(&[0, 2], true)),
        ("max", vec![&[6, 50]], 0, |t| t[0].max(&[-1], false)),
        ("min of columns", vec![&[50, 6]], 0, |t| {
            t[0].min(&[0], false)
        }),
        ("cumsum", vec![&[3, 100]], 100, |t| t[0].cumsum(-1)),
        ("softmax", vec![&[5, 64]], 64, |t| t[0].softmax(-1)),
        ("log_softmax", vec![&[5, 64]], 64, |t| t[0].log_softmax(-1)),
        ("softmax of columns", vec![&[64, 5]], 64, |t| {
            t[0].softmax(0)
        }),
        ("matmul", vec![&[9, 200], &[200, 7]], 200, |t| {
            t[0].matmul(&t[1])
        }),
        ("matmul transposed", vec![&[200, 9], &[7, 200]], 200, |t| {
            t[0].t()?.matmul(&t[1].t()?)
        }),
        // Past the bf16 kernel's tiles (8 rows, 32 columns, 256-column blocks) with an odd depth.
        (
            "matmul over several tiles",
            vec![&[37, 301], &[301, 300]],
            301,
            |t| t[0].matmul(&t[1]),
        ),
        (
            "transposed matmul over several tiles",
            vec![&[301, 37], &[300, 301]],
            301,
            |t| t[0].t()?.matmul(&t[1].t()?),
        ),
        // A Linear's product (the weight [out, in] used transposed, even depth): more tokens than a
        // tile's 32 and more outputs than a task's 64.
        (
            "matmul by a transposed weight",
            vec![&[37, 300], &[130, 300]],
            300,
            |t| t[0].matmul(&t[1].t()?),
        ),
        // The same with a depth of whole 32-element steps: on AMX, the weight's rows are read in
        // place as tiles, with a last partial block of rows.
        (
            "matmul by a transposed weight in whole steps",
            vec![&[37, 320], &[130, 320]],
            320,
            |t| t[0].matmul(&t[1].t()?),
        ),
        // Decoding's products (at most 8 tokens: one dot product per token and weight row), with a
        // depth of whole 32-element steps and one with a tail of 7 pairs.
        (
            "one token by a transposed weight",
            vec![&[1, 320], &[130, 320]],
            320,
            |t| t[0].matmul(&t[1].t()?),
        ),
        (
            "five tokens by a transposed weight, a tail of pairs",
            vec![&[5, 302], &[70, 302]],
            302,
            |t| t[0].matmul(&t[1].t()?),
        ),
        (
            "three tokens by a transposed weight, one pair past the steps",
            vec![&[3, 34], &[11, 34]],
            34,
            |t| t[0].matmul(&t[1].t()?),
        ),
        (
            "eight tokens by a transposed weight",
            vec![&[8, 64], &[9, 64]],
            64,
            |t| t[0].matmul(&t[1].t()?),
        ),
        ("batched matmul", vec![&[3, 5, 64], &[64, 6]], 64, |t| {
            t[0].matmul(&t[1])
        }),
        ("matmul of vectors", vec![&[128], &[128]], 128, |t| {
            t[0].matmul(&t[1])
        }),
        ("fold2d", vec![&[2, 3 * 9, 16]], 9, |t| {
            t[0].fold2d([6, 6], [3, 3], &ndscope::Conv2dOptions::default())
        }),
        ("unfold2d", vec![&[2, 3, 6, 6]], 0, |t| {
            let padded = ndscope::Conv2dOptions {
                padding: [1, 1],
                ..Default::default()
            };
            t[0].unfold2d([3, 3], &padded)
        }),
    ];
    root(Device::Cpu, |s| {
        for dtype in [DType::BF16, DType::F16] {
            for (name, shapes, terms, op) in &ops {
                let (got, want) = both(s, dtype, shapes, false, *op)?;
                // Inputs are at most 2 in magnitude; products of two at most 4.
                let slack = 8.0 * eps32 * *terms as f64 * 4.0;
                assert_near(
                    name,
                    dtype,
                    &got,
                    &want,
                    1.0,
                    slack + dtype.epsilon() * 1e-3,
                );
            }
            // Indices and argmax: exact.
            let x = s.from_slice(&exact_values(40, 3, dtype, false), &[5, 8])?;
            let h = x.to_dtype(dtype)?;
            assert_eq!(
                h.argmax(-1, false)?.to_vec::<i64>()?,
                x.argmax(-1, false)?.to_vec::<i64>()?
            );
            let i = s.from_slice(&[4i64, 0, 4, 2], &[4])?;
            assert_eq!(
                h.index_select(0, &i)?.to_vec_f64()?,
                x.index_select(0, &i)?.to_vec_f64()?
            );
            let acc = s
                .zeros(&[5, 8])?
                .to_dtype(dtype)?
                .index_add(0, &i, &h.narrow(0, 0, 4)?)?;
            let acc32 = s.zeros(&[5, 8])?.index_add(0, &i, &x.narrow(0, 0, 4)?)?;
            assert_near(
                "index_add",
                dtype,
                &acc.to_vec_f64()?,
                &acc32.to_vec_f64()?,
                2.0,
                0.0,
            );
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// Backward passes in 16 bits: the gradients of products, GELU, layer norm, softmax, a convolution
/// with max pooling, causal attention and cross-entropy, all on `bf16` (or `f16`) tensors, stay
/// within a few roundings of the `f32` gradients on the same values.
#[test]
fn gradients_of_16_bit_tensors_follow_the_f32_gradients() {
    root(Device::Cpu, |s| {
        for dtype in [DType::BF16, DType::F16] {
            let run = |d: DType| -> Result<Vec<Vec<f64>>> {
                s.scope(|b| {
                    let tape = Tape::new(b);
                    let t = |n: usize, shape: &[usize], seed: u64| -> Result<_> {
                        b.from_slice(&exact_values(n, seed, dtype, false), shape)?
                            .to_dtype(d)
                    };
                    let (x, w, g) = (t(24, &[4, 6], 1)?, t(30, &[6, 5], 2)?, t(5, &[5], 3)?);
                    let (image, kernel) = (
                        t(2 * 2 * 36, &[2, 2, 6, 6], 4)?,
                        t(3 * 2 * 9, &[3, 2, 3, 3], 5)?,
                    );
                    let seq = t(2 * 4 * 8, &[2, 4, 8], 6)?;
                    let watched = [&x, &w, &g, &image, &kernel, &seq];
                    let [xv, wv, gv, iv, kv, sv] = watched.map(|p| tape.param(p));
                    // A product, GELU and a layer norm; a softmax-weighted sum.
                    let h = xv.matmul(&wv)?.gelu()?.layer_norm(Some(&gv), None, 1e-5)?;
                    let dense = h.softmax(-1)?.mul(&h)?.sum_all()?;
                    // A convolution and a max pool.
                    let conv = iv
                        .conv2d(&kv, None, &ndscope::Conv2dOptions::default())?
                        .max_pool2d([2, 2], [2, 2], [0, 0])?
                        .square()?
                        .mean_all()?;
                    // Causal attention of a sequence on itself, and a cross-entropy.
                    let causal = nn::AttentionOptions {
                        causal: true,
                        dropout: 0.0,
                    };
                    let attended =
                        nn::scaled_dot_product_attention(&sv, &sv, &sv, causal, Mode::Train)?;
                    let labels = b.from_slice(&[1i64, 7, 0, 3, 3, 5, 2, 6], &[8])?;
                    let xent = attended.output.reshape(&[8, 8])?.cross_entropy(&labels)?;
                    let loss = dense.add(&conv)?.add(&xent.to_dtype(d)?)?;
                    let grads = tape.backward(&loss)?;
                    watched
                        .iter()
                        .map(|p| grads.get(p).expect("a gradient").to_vec_f64())
                        .collect()
                })
            };
            let (narrow, wide) = (run(dtype)?, run(DType::F32)?);
            for (k, (got, want)) in narrow.iter().zip(&wide).enumerate() {
                let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                // Measured: at most 1.35 roundings of the largest gradient (f16), 0.95 (bf16).
                assert_near(
                    &format!("gradient {k}"),
                    dtype,
                    got,
                    want,
                    0.0,
                    4.0 * dtype.epsilon() * scale,
                );
            }
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

#[test]
fn autocast_casts_products_keeps_losses_in_f32_and_returns_parameter_dtype_gradients() {
    root(Device::Cpu, |m| {
        let model = nn::mlp(m, &[6, 8, 3], Activation::Relu, Init::KaimingUniform)?;
        let conv = nn::Conv2d::new(m, 2, 4, [3, 3], Default::default(), Init::KaimingUniform)?;
        m.scope(|b| {
            assert_eq!(b.autocast_dtype(), None);
            b.autocast(DType::BF16)?;
            b.scope(|inner| {
                assert_eq!(inner.autocast_dtype(), Some(DType::BF16), "inherited");
                Ok(())
            })?;
            let tape = Tape::new(b);
            let x = tape.constant(&b.randn(&[5, 6])?);
            let logits = model.forward(&x, Mode::Train)?;
            assert_eq!(logits.value().dtype(), DType::BF16);
            assert_eq!(logits.softmax(-1)?.value().dtype(), DType::F32);
            assert_eq!(
                logits.layer_norm(None, None, 1e-5)?.value().dtype(),
                DType::F32
            );
            let labels = b.from_slice(&[0i64, 1, 2, 0, 1], &[5])?;
            let loss = logits.cross_entropy(&labels)?;
            assert_eq!(loss.value().dtype(), DType::F32);
            let image = tape.constant(&b.randn(&[1, 2, 5, 5])?);
            let features = conv.forward(&image, Mode::Train)?;
            assert_eq!(features.value().dtype(), DType::BF16);
            let total = loss.add(&features.sum_all()?)?;
            let grads = tape.backward(&total)?;
            assert_eq!(grads.len(), 6);
            assert!(grads.iter().all(|g| g.dtype() == DType::F32));
            assert!(b.dump().contains("[autocast bf16]"), "{}", b.dump());
            b.no_autocast();
            let plain = model.forward(&tape.constant(&b.randn(&[5, 6])?), Mode::Train)?;
            assert_eq!(plain.value().dtype(), DType::F32);
            Ok(())
        })?;
        // Only 16-bit dtypes autocast; mixing dtypes without autocast stays an error.
        let err = m.autocast(DType::F64).unwrap_err().to_string();
        assert!(err.contains("DType::BF16"), "{err}");
        let tape = Tape::new(m);
        let a = tape.constant(&m.ones(&[2])?);
        let h = tape.constant(&m.ones(&[2])?.to_dtype(DType::BF16)?);
        let err = a.add(&h).unwrap_err().to_string();
        assert!(err.contains("dtypes f32 and bf16 differ"), "{err}");
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// Every parameter of `model` by name, as `f64`, sorted by name.
fn parameters(model: &Sequential<'_>) -> Vec<(String, Vec<f64>)> {
    let mut all = Vec::new();
    ndscope::nn::Parameters::visit(model, "", &mut |name, p| {
        all.push((
            name.to_string(),
            p.to_vec_f64().expect("a host parameter reads back"),
        ))
    });
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// One f16 autocast step of `model` with loss scaling; whether the optimizer stepped.
fn scaled_step<'m>(
    m: &Scope<'m>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
    scaler: &mut LossScaler,
) -> Result<bool> {
    m.scope(|b| {
        b.autocast(DType::F16)?;
        let tape = Tape::new(b);
        let x = tape.constant(&b.randn(&[6, 4])?);
        let labels = b.from_slice(&[0i64, 1, 2, 0, 1, 2], &[6])?;
        let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
        let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
        scaler.step(opt, model, &mut grads)
    })
}

#[test]
fn an_overflowing_f16_step_is_skipped_and_lowers_the_scale() {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[4, 8, 3], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adam(1e-2))?;
        // 2^40 overflows the f16 gradients (the largest finite f16 is 65504); the backoff of 2^-30
        // brings the scale to 2^10, where they fit, and two good steps in a row double it.
        let mut scaler = LossScaler::with(2f64.powi(40), 2.0, 2f64.powi(-30), 2)?;
        let before = parameters(&model);
        assert!(
            !scaled_step(m, &mut model, &mut opt, &mut scaler)?,
            "an overflow skips the step"
        );
        assert_eq!(
            parameters(&model),
            before,
            "a skipped step leaves the parameters alone"
        );
        assert_eq!(scaler.skipped_steps(), 1);
        assert_eq!(scaler.scale(), 2f64.powi(10), "lowered by the backoff");
        assert!(scaled_step(m, &mut model, &mut opt, &mut scaler)?);
        assert_ne!(parameters(&model), before);
        assert!(scaled_step(m, &mut model, &mut opt, &mut scaler)?);
        assert_eq!(scaler.scale(), 2f64.powi(11), "raised after two good steps");
        assert!(LossScaler::with(0.0, 2.0, 0.5, 1).is_err());
        assert!(LossScaler::with(1.0, 2.0, 1.5, 1).is_err());
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

#[test]
fn checkpoints_hold_16_bit_tensors_and_cast_on_load_when_asked() {
    use ndscope::checkpoint;
    root(Device::Cpu, |s| {
        let model = nn::mlp(s, &[5, 4, 3], Activation::Relu, Init::KaimingUniform)?;
        for dtype in [DType::BF16, DType::F16] {
            let bytes = checkpoint::to_bytes_in(&model, dtype)?;
            let read = checkpoint::read_bytes(s, &bytes)?;
            assert!(read.iter().all(|(_, t)| t.dtype() == dtype));
            let mut restored = nn::mlp(s, &[5, 4, 3], Activation::Relu, Init::Constant(0.0))?;
            let err = checkpoint::load_bytes(&mut restored, &bytes)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("is {dtype} [4, 5], the model expects f32 [4, 5]"))
                    && err.contains("load_cast"),
                "{err}"
            );
            checkpoint::load_bytes_cast(&mut restored, &bytes)?;
            let (restored, original) = (parameters(&restored), parameters(&model));
            for (((name, got), (_, want)), (read_name, saved)) in
                restored.iter().zip(&original).zip(&read)
            {
                // Rounded once on saving; exact on loading (every 16-bit value is an f32 value).
                assert_near(name, dtype, got, want, 1.0, 0.0);
                assert_eq!((name, got), (read_name, &saved.to_vec_f64()?));
            }
        }
        assert!(checkpoint::to_bytes_in(&model, DType::I64).is_err());
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// A 16-bit mean divides in `f32` and rounds once: the f16 mean of values between 8 and 16 over
/// 6,000 elements is about 12 although their sum (about 72,000) is past f16's largest value, and
/// each 16-bit mean is the f32 mean rounded once. Composite losses (cross-entropy's mean) keep it.
#[test]
fn sixteen_bit_means_divide_before_rounding() {
    root(Device::Cpu, |s| {
        let n = 6000;
        let data: Vec<f64> = common::values(4 * n, 77)
            .into_iter()
            .map(|v| 12.0 + 2.0 * v) // [8, 16)
            .collect();
        let x = s.from_slice(&data, &[4, n])?;
        for dtype in [DType::F16, DType::BF16] {
            let narrow = x.to_dtype(dtype)?;
            let exact: Vec<f64> = narrow.to_vec_f64()?;
            let want: Vec<f64> = exact
                .chunks(n)
                .map(|row| (row.iter().sum::<f64>() / n as f64) as f32 as f64)
                .collect();
            for (name, got) in [
                ("mean of rows", narrow.mean(&[-1], false)?),
                (
                    "mean of columns",
                    narrow.t()?.contiguous()?.mean(&[0], false)?,
                ),
            ] {
                assert_eq!(got.dtype(), dtype);
                let got = got.to_vec_f64()?;
                assert_eq!(got, rounded(dtype, &want), "{name} in {dtype}");
                assert!(got.iter().all(|m| (11.0..13.0).contains(m)), "{got:?}");
            }
            let all = narrow.mean_all()?.to_vec_f64()?[0];
            let want_all = (exact.iter().sum::<f64>() / exact.len() as f64) as f32 as f64;
            assert_eq!(all, rounded(dtype, &[want_all])[0], "mean_all in {dtype}");
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// `matmul_as` is the product of the operands rounded to the dtype, bit for bit, whichever operand
/// is `f32` and however it is laid out (the host rounds an `f32` right operand as it packs it where
/// it has AVX-512 BF16, and casts it first elsewhere); an integer dtype is refused.
#[test]
fn matmul_as_is_the_product_of_the_rounded_operands() {
    root(Device::Cpu, |s| {
        s.set_seed(11);
        // (a's shape, b's shape, b transposed from a [n, k] tensor): decode's few rows, a
        // Linear's product of both weight layouts, depths in several blocks, a batch.
        let cases: &[(&[usize], &[usize], bool)] = &[
            (&[3, 64], &[64, 20], false),
            (&[3, 64], &[64, 20], true),
            (&[37, 600], &[600, 130], false),
            (&[37, 600], &[600, 70], true),
            (&[33, 301], &[301, 40], true),
            (&[2, 5, 16], &[16, 9], false),
            (&[16], &[16, 9], false),
        ];
        for &(ash, bsh, transposed) in cases {
            let a = s.randn(ash)?.to_dtype(DType::BF16)?;
            let b = if transposed {
                s.randn(&[bsh[1], bsh[0]])?.t()?
            } else {
                s.randn(bsh)?
            };
            let got = a.matmul_as(&b, DType::BF16)?;
            let want = a.matmul(&b.to_dtype(DType::BF16)?)?;
            assert_eq!(got.dtype(), DType::BF16);
            assert_eq!(got.shape(), want.shape());
            assert_eq!(
                got.to_vec::<bf16>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                want.to_vec::<bf16>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                "{ash:?} by {bsh:?} (transposed: {transposed})"
            );
            // An f32 left operand is rounded too.
            let wide = a.to_dtype(DType::F32)?.matmul_as(&b, DType::BF16)?;
            assert_eq!(wide.to_vec::<bf16>()?, got.to_vec::<bf16>()?);
        }
        let ints = s.from_slice(&[1i64, 2], &[1, 2])?;
        let err = ints
            .matmul_as(&ints.t()?, DType::I64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("float dtype"), "{err}");
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}

/// Autocast's products of `f32` weights (no rounded copy recorded) give the values and gradients
/// of the explicit casts they replace, bit for bit, for both weight layouts.
#[test]
fn autocast_products_equal_the_explicit_casts() {
    root(Device::Cpu, |s| {
        s.set_seed(5);
        let x = s.randn(&[20, 96])?;
        let w_in_out = s.randn(&[96, 40])?;
        let w_out_in = s.randn(&[40, 96])?;
        let run = |autocast: bool, out_in: bool| -> Result<Vec<Vec<f32>>> {
            s.scope(|b| {
                if autocast {
                    b.autocast(DType::BF16)?;
                }
                let tape = Tape::new(b);
                let (xv, wv) = (
                    tape.param(&x),
                    tape.param(if out_in { &w_out_in } else { &w_in_out }),
                );
                let w = if out_in { wv.t()? } else { wv.clone() };
                let y = if autocast {
                    xv.matmul(&w)?
                } else {
                    xv.to_dtype(DType::BF16)?
                        .matmul(&w.to_dtype(DType::BF16)?)?
                };
                assert_eq!(y.value().dtype(), DType::BF16);
                let loss = y.to_dtype(DType::F32)?.square()?.sum_all()?;
                let grads = tape.backward(&loss)?;
                let (gx, gw) = (
                    grads.get(&x).expect("x"),
                    grads
                        .get(if out_in { &w_out_in } else { &w_in_out })
                        .expect("w"),
                );
                assert_eq!((gx.dtype(), gw.dtype()), (DType::F32, DType::F32));
                Ok(vec![
                    y.value().to_dtype(DType::F32)?.to_vec()?,
                    gx.to_vec()?,
                    gw.to_vec()?,
                ])
            })
        };
        for out_in in [false, true] {
            let (fused, cast) = (run(true, out_in)?, run(false, out_in)?);
            for (name, (got, want)) in ["value", "x's gradient", "w's gradient"]
                .iter()
                .zip(fused.iter().zip(&cast))
            {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(want), "{name} (weight [out, in]: {out_in})");
            }
        }
        Ok::<_, ndscope::Error>(())
    })
    .unwrap();
}
