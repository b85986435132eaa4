//! Every differentiable op's backward pass against central finite differences, in f64.
//!
//! Each check projects the op's output onto fixed random weights (so every output element counts),
//! differentiates that scalar with the tape, and compares each input element's gradient with
//! `(L(x + h) - L(x - h)) / 2h`.

use ndscope::{
    AttentionSpec, Causal, DType, Device, Error, Result, Scope, Tape, Tensor, Var, root,
};

/// A function of the watched inputs, producing the output to check.
type Op = for<'t, 's> fn(&[Var<'t, 's>]) -> Result<Var<'t, 's>>;

/// A deterministic spread of values in `lo..hi`.
fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (hi - lo) * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

struct Input {
    data: Vec<f64>,
    shape: Vec<usize>,
}

fn input(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Input {
    Input {
        data: values(shape.iter().product(), seed, lo, hi),
        shape: shape.to_vec(),
    }
}

/// `sum(op(inputs) * weights)` and, when `grads` is set, its gradient for every input.
fn projected(
    s: &Scope<'_>,
    inputs: &[Input],
    op: Op,
    with_grads: bool,
) -> Result<(f64, Vec<Vec<f64>>)> {
    s.scope(|batch| {
        let params = inputs
            .iter()
            .map(|i| batch.from_slice(&i.data, &i.shape))
            .collect::<Result<Vec<_>>>()?;
        let tape = Tape::new(batch);
        let vars: Vec<Var> = params.iter().map(|p| tape.param(p)).collect();
        let out = op(&vars)?;
        let weights = batch.from_slice(&values(out.value().numel(), 99, -1.0, 1.0), out.shape())?;
        let loss = out.mul(&tape.constant(&weights))?.sum_all()?;
        let value = loss.value().to_scalar::<f64>()?;
        if !with_grads {
            return Ok((value, Vec::new()));
        }
        let grads = tape.backward(&loss)?;
        let grads = params
            .iter()
            .map(|p| match grads.get(p) {
                Some(g) => g.to_vec::<f64>(),
                None => Ok(vec![0.0; p.numel()]),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((value, grads))
    })
}

/// Checks `op`'s gradients at `inputs` against finite differences.
#[track_caller]
fn check(name: &str, inputs: Vec<Input>, op: Op) {
    let h = 1e-6;
    root(Device::Cpu, |s| {
        let (_, analytic) = projected(s, &inputs, op, true)?;
        let mut probe: Vec<Input> = inputs
            .iter()
            .map(|i| Input {
                data: i.data.clone(),
                shape: i.shape.clone(),
            })
            .collect();
        for (k, (input, grads)) in inputs.iter().zip(&analytic).enumerate() {
            for (j, (&x, &got)) in input.data.iter().zip(grads).enumerate() {
                probe[k].data[j] = x + h;
                let (up, _) = projected(s, &probe, op, false)?;
                probe[k].data[j] = x - h;
                let (down, _) = projected(s, &probe, op, false)?;
                probe[k].data[j] = x;
                let numeric = (up - down) / (2.0 * h);
                assert!(
                    (got - numeric).abs() <= 1e-5 * (1.0 + numeric.abs()),
                    "{name}: d/d input {k}[{j}] is {got}, finite differences give {numeric}"
                );
            }
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn unary_ops() {
    let any = || vec![input(&[3, 4], 1, -2.0, 2.0)];
    let positive = || vec![input(&[3, 4], 2, 0.5, 3.0)];
    check("neg", any(), |v| v[0].neg());
    check("abs", any(), |v| v[0].abs());
    check("square", any(), |v| v[0].square());
    check("log", positive(), |v| v[0].log());
    check("sin", any(), |v| v[0].sin());
    check("cos", any(), |v| v[0].cos());
    check("relu", any(), |v| v[0].relu());
    check("gelu", any(), |v| v[0].gelu());
    check("exp", any(), |v| v[0].exp());
    check("sqrt", positive(), |v| v[0].sqrt());
    check("recip", positive(), |v| v[0].recip());
    check("tanh", any(), |v| v[0].tanh());
    check("sigmoid", any(), |v| v[0].sigmoid());
    check("log1p", positive(), |v| v[0].log1p());
    check("expm1", any(), |v| v[0].expm1());
}

#[test]
fn scalar_ops() {
    let any = || vec![input(&[2, 5], 3, -2.0, 2.0)];
    check("add_scalar", any(), |v| v[0].add_scalar(1.5));
    check("mul_scalar", any(), |v| v[0].mul_scalar(-3.0));
    check("div_scalar", any(), |v| v[0].div_scalar(4.0));
    check("powf", vec![input(&[2, 5], 4, 0.5, 2.0)], |v| {
        v[0].powf(2.5)
    });
    check("clamp", any(), |v| v[0].clamp(-1.0, 1.0));
}

#[test]
fn binary_ops_with_broadcasting() {
    let pair = || {
        vec![
            input(&[2, 3, 4], 5, -2.0, 2.0),
            input(&[3, 1], 6, -2.0, 2.0),
        ]
    };
    check("add", pair(), |v| v[0].add(&v[1]));
    check("sub", pair(), |v| v[0].sub(&v[1]));
    check("mul", pair(), |v| v[0].mul(&v[1]));
    check("maximum", pair(), |v| v[0].maximum(&v[1]));
    check("minimum", pair(), |v| v[0].minimum(&v[1]));
    let positive = || vec![input(&[2, 3], 7, 0.5, 2.0), input(&[3], 8, 0.5, 2.0)];
    check("div", positive(), |v| v[0].div(&v[1]));
    check("pow", positive(), |v| v[0].pow(&v[1]));
    check("same operand twice", positive(), |v| v[0].mul(&v[0]));
}

#[test]
fn where_cond_routes_gradients_by_the_condition() {
    let inputs = vec![input(&[2, 3], 9, -2.0, 2.0), input(&[2, 3], 10, -2.0, 2.0)];
    check("where_cond", inputs, |v| {
        let cond = v[0].value().gt(v[1].value())?;
        Var::where_cond(&cond, &v[0], &v[1])
    });
}

#[test]
fn matmul_in_every_rank_combination() {
    check(
        "matmul 2-D",
        vec![input(&[3, 4], 11, -1.0, 1.0), input(&[4, 2], 12, -1.0, 1.0)],
        |v| v[0].matmul(&v[1]),
    );
    check(
        "matmul batched with a broadcast matrix",
        vec![
            input(&[2, 3, 4], 13, -1.0, 1.0),
            input(&[4, 5], 14, -1.0, 1.0),
        ],
        |v| v[0].matmul(&v[1]),
    );
    check(
        "matmul vector-matrix",
        vec![input(&[4], 15, -1.0, 1.0), input(&[4, 3], 16, -1.0, 1.0)],
        |v| v[0].matmul(&v[1]),
    );
    check(
        "matmul matrix-vector",
        vec![input(&[3, 4], 17, -1.0, 1.0), input(&[4], 18, -1.0, 1.0)],
        |v| v[0].matmul(&v[1]),
    );
    check(
        "matmul dot",
        vec![input(&[4], 19, -1.0, 1.0), input(&[4], 20, -1.0, 1.0)],
        |v| v[0].matmul(&v[1]),
    );
}

#[test]
fn matmul_with_transposed_weights() {
    // Linear layers multiply by `W.t()`; the gradient is computed in W's own layout.
    check(
        "x @ w.t()",
        vec![input(&[3, 4], 41, -1.0, 1.0), input(&[5, 4], 42, -1.0, 1.0)],
        |v| v[0].matmul(&v[1].t()?),
    );
    check(
        "w.t() @ x",
        vec![input(&[4, 3], 43, -1.0, 1.0), input(&[4, 2], 44, -1.0, 1.0)],
        |v| v[0].t()?.matmul(&v[1]),
    );
    root(Device::Cpu, |s| {
        let w = s.randn(&[5, 4])?;
        let tape = Tape::new(s);
        let x = tape.constant(&s.randn(&[3, 4])?);
        let loss = x.matmul(&tape.param(&w).t()?)?.sum_all()?;
        let grads = tape.backward(&loss)?;
        assert!(
            grads.get(&w).unwrap().is_contiguous(),
            "the gradient has the weight's layout"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn reductions() {
    let x = || vec![input(&[2, 3, 4], 21, -2.0, 2.0)];
    check("sum keepdim", x(), |v| v[0].sum(&[1], true));
    check("sum two axes", x(), |v| v[0].sum(&[0, -1], false));
    check("mean", x(), |v| v[0].mean(&[2], false));
    check("mean keepdim", x(), |v| v[0].mean(&[0, 2], true));
    check("sum_all", x(), |v| v[0].sum_all());
    check("mean_all", x(), |v| v[0].mean_all());
    check("max", x(), |v| v[0].max(&[1], false));
    check("min", x(), |v| v[0].min(&[-1], true));
}

#[test]
fn max_shares_the_gradient_between_ties() {
    root(Device::Cpu, |s| {
        let x = s.from_slice(&[1.0f64, 3.0, 3.0, 2.0], &[4])?;
        let tape = Tape::new(s);
        let loss = tape.param(&x).max(&[0], false)?;
        let grads = tape.backward(&loss)?;
        assert_eq!(
            grads.get(&x).unwrap().to_vec::<f64>()?,
            vec![0.0, 0.5, 0.5, 0.0]
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn softmax_family() {
    let x = || vec![input(&[3, 5], 22, -3.0, 3.0)];
    check("softmax", x(), |v| v[0].softmax(-1));
    check("softmax axis 0", x(), |v| v[0].softmax(0));
    check("log_softmax", x(), |v| v[0].log_softmax(1));
    check("cross_entropy", x(), |v| {
        let labels = v[0].tape().scope().from_slice(&[4i64, 0, 2], &[3])?;
        v[0].cross_entropy(&labels)
    });
}

#[test]
fn views() {
    let x = || vec![input(&[2, 3, 4], 23, -2.0, 2.0)];
    check("reshape", x(), |v| v[0].reshape(&[6, 4]));
    check("flatten", x(), |v| v[0].flatten());
    check("transpose", x(), |v| v[0].transpose(0, 2));
    check("permute", x(), |v| v[0].permute(&[1, 2, 0]));
    check("narrow", x(), |v| v[0].narrow(2, 1, 2));
    check("slice", x(), |v| v[0].slice(1, 0..2));
    check("squeeze", vec![input(&[3, 1, 2], 24, -1.0, 1.0)], |v| {
        v[0].squeeze(1)
    });
    check("unsqueeze", x(), |v| v[0].unsqueeze(-1));
    check("broadcast_to", vec![input(&[3, 1], 25, -1.0, 1.0)], |v| {
        v[0].broadcast_to(&[2, 3, 4])
    });
    check(
        "t then contiguous",
        vec![input(&[3, 4], 26, -1.0, 1.0)],
        |v| v[0].t()?.contiguous(),
    );
    check("to_dtype", x(), |v| v[0].to_dtype(DType::F64));
}

#[test]
fn a_gradient_through_a_dtype_conversion_comes_back_in_the_parameters_dtype() {
    root(Device::Cpu, |s| {
        let w = s.from_slice(&[1.0f32, -2.0], &[2])?;
        let tape = Tape::new(s);
        let loss = tape.param(&w).to_dtype(DType::F64)?.square()?.sum_all()?;
        let grads = tape.backward(&loss)?;
        assert_eq!(grads.get(&w).unwrap().to_vec::<f32>()?, vec![2.0, -4.0]);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn indexing_and_joining() {
    check(
        "index_select with repeats",
        vec![input(&[4, 3], 27, -1.0, 1.0)],
        |v| {
            let idx = v[0].tape().scope().from_slice(&[3i64, 0, 3], &[3])?;
            v[0].index_select(0, &idx)
        },
    );
    check("gather", vec![input(&[3, 4], 28, -1.0, 1.0)], |v| {
        let idx = v[0]
            .tape()
            .scope()
            .from_slice(&[1i64, 1, 0, 3, 2, 2], &[3, 2])?;
        v[0].gather(1, &idx)
    });
    let pair = || vec![input(&[2, 3], 29, -1.0, 1.0), input(&[2, 2], 30, -1.0, 1.0)];
    check("concat", pair(), |v| Var::concat(&[&v[0], &v[1]], 1));
    let same = || vec![input(&[2, 3], 31, -1.0, 1.0), input(&[2, 3], 32, -1.0, 1.0)];
    check("stack", same(), |v| Var::stack(&[&v[0], &v[1]], 1));
}

#[test]
fn a_small_network_end_to_end() {
    let inputs = vec![
        input(&[4, 3], 33, -1.0, 1.0), // weights 1
        input(&[3], 34, -0.5, 0.5),    // bias 1
        input(&[3, 2], 35, -1.0, 1.0), // weights 2
    ];
    check("mlp", inputs, |v| {
        let x = v[0]
            .tape()
            .scope()
            .from_slice(&values(20, 36, -1.0, 1.0), &[5, 4])?;
        let labels = v[0].tape().scope().from_slice(&[0i64, 1, 1, 0, 1], &[5])?;
        let x = v[0].tape().constant(&x);
        let h = x.matmul(&v[0])?.add(&v[1])?.tanh()?;
        h.matmul(&v[2])?.cross_entropy(&labels)
    });
}

#[test]
fn a_parameter_watched_twice_gets_the_sum_of_both_uses() {
    root(Device::Cpu, |s| {
        let w = s.from_slice(&[2.0f32, 3.0], &[2])?;
        s.scope(|batch| {
            let tape = Tape::new(batch);
            let a = tape.param(&w).sum_all()?;
            let b = tape.param(&w).square()?.sum_all()?;
            let grads = tape.backward(&a.add(&b)?)?;
            assert_eq!(grads.len(), 1);
            assert_eq!(grads.get(&w).unwrap().to_vec::<f32>()?, vec![5.0, 7.0]);
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn gradients_and_saved_tensors_live_in_the_batch_scope() {
    root(Device::Cpu, |model| {
        let w = model.randn(&[64, 32])?;
        let before = model.stats();
        model.scope(|batch| {
            let tape = Tape::new(batch);
            let x = tape.constant(&batch.randn(&[16, 64])?);
            let loss = x.matmul(&tape.param(&w))?.relu()?.mean_all()?;
            let grads = tape.backward(&loss)?;
            assert_eq!(grads.get(&w).unwrap().shape(), &[64, 32]);
            assert!(batch.stats().live_tensors >= 1);
            // Nothing of the step landed in the model scope.
            assert_eq!(model.stats().allocations, before.allocations);
            assert_eq!(model.stats().live_bytes, before.live_bytes);
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn backward_errors_say_what_to_do() {
    root(Device::Cpu, |s| {
        let w = s.ones(&[3])?;
        let tape = Tape::new(s);
        let y = tape.param(&w).mul_scalar(2.0)?;
        let err = tape.backward(&y).unwrap_err();
        assert!(matches!(err, Error::Autograd { .. }), "{err}");
        assert!(err.to_string().contains("mean_all"), "{err}");

        let constant = tape.constant(&w).sum_all()?;
        let err = tape.backward(&constant).unwrap_err();
        assert!(err.to_string().contains("tape.param"), "{err}");

        let other = Tape::new(s);
        let foreign = other.param(&w).sum_all()?;
        let err = tape.backward(&foreign).unwrap_err();
        assert!(err.to_string().contains("another tape"), "{err}");
        let err = y.add(&other.param(&w)).unwrap_err();
        assert!(err.to_string().contains("different tapes"), "{err}");

        let loss = y.sum_all()?;
        tape.backward(&loss)?;
        let err = tape.backward(&loss).unwrap_err();
        assert!(err.to_string().contains("already ran backward"), "{err}");

        let ints = s.from_slice(&[1i64, 2], &[2])?;
        let err = Tape::new(s).param(&ints).exp().unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType { .. }), "{err}");
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn scatter_ops_reject_bad_indices_and_shapes() {
    root(Device::Cpu, |s| {
        let base = s.zeros(&[2, 3])?;
        let src = s.ones(&[2, 1])?;
        let bad = s.from_slice(&[0i64, 3], &[2, 1])?;
        assert!(matches!(
            base.scatter_add(1, &bad, &src).unwrap_err(),
            Error::IndexOutOfRange {
                index: 3,
                size: 3,
                ..
            }
        ));
        let wrong_shape = s.from_slice(&[0i64, 1, 2], &[3, 1])?;
        assert!(matches!(
            base.scatter_add(1, &wrong_shape, &src).unwrap_err(),
            Error::ShapeMismatch { .. }
        ));
        let rows = s.from_slice(&[1i64, 1], &[2])?;
        let added = base.index_add(0, &rows, &s.ones(&[2, 3])?)?;
        assert_eq!(added.to_vec::<f32>()?, vec![0.0, 0.0, 0.0, 2.0, 2.0, 2.0]);
        assert!(matches!(
            base.index_add(0, &rows, &s.ones(&[3, 3])?).unwrap_err(),
            Error::ShapeMismatch { .. }
        ));
        let _: &Tensor = &added;
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn transformer_ops() {
    let any = || vec![input(&[3, 4], 21, -2.5, 2.5)];
    check("erf", any(), |v| v[0].erf());
    check("gelu_exact", any(), |v| v[0].gelu_exact());
    check("silu", any(), |v| v[0].silu());
    check("tril", any(), |v| v[0].tril(0));
    check("cumsum", any(), |v| v[0].cumsum(1));
    check("cumsum along the first axis", any(), |v| v[0].cumsum(0));
    check("triu", any(), |v| v[0].triu(1));
    check("masked_fill", any(), |v| {
        let mask = v[0].value().gt(&v[0].value().mul_scalar(0.0)?)?;
        v[0].masked_fill(&mask, 3.0)
    });
    let affine = || {
        vec![
            input(&[2, 3, 5], 22, -2.0, 2.0),
            input(&[5], 23, 0.5, 1.5),
            input(&[5], 24, -1.0, 1.0),
        ]
    };
    check("layer_norm", affine(), |v| {
        v[0].layer_norm(Some(&v[1]), Some(&v[2]), 1e-5)
    });
    check("layer_norm without affine parameters", affine(), |v| {
        v[0].layer_norm(None, None, 1e-5)
    });
    check("rms_norm", affine(), |v| v[0].rms_norm(Some(&v[1]), 1e-6));
    check("rms_norm without a weight", affine(), |v| {
        v[0].rms_norm(None, 1e-6)
    });
    let qkv = || {
        vec![
            input(&[2, 4, 3], 25, -1.5, 1.5),
            input(&[2, 4, 3], 26, -1.5, 1.5),
            input(&[2, 4, 2], 27, -1.5, 1.5),
        ]
    };
    for causal in [false, true] {
        let op: Op = if causal {
            |v| attention(v, true)
        } else {
            |v| attention(v, false)
        };
        check("scaled_dot_product_attention", qkv(), op);
    }
    // Fused attention, every mask: 5 queries against 7 keys, 2 heads, and key lengths 7 and 4.
    let heads = || {
        vec![
            input(&[2, 2, 5, 3], 28, -1.5, 1.5),
            input(&[2, 2, 7, 3], 29, -1.5, 1.5),
            input(&[2, 2, 7, 2], 30, -1.5, 1.5),
        ]
    };
    check("fused attention", heads(), |v| {
        v[0].attention(&v[1], &v[2], AttentionSpec::default(), None)
    });
    check("fused attention, causal from the top left", heads(), |v| {
        v[0].attention(&v[1], &v[2], AttentionSpec::CAUSAL, None)
    });
    check(
        "fused attention, causal from the bottom right",
        heads(),
        |v| {
            let spec = AttentionSpec {
                causal: Causal::BottomRight,
                scale: Some(0.7),
                window: None,
            };
            v[0].attention(&v[1], &v[2], spec, None)
        },
    );
    check(
        "fused attention in a sliding window of 3, bottom right",
        heads(),
        |v| {
            let spec = AttentionSpec {
                causal: Causal::BottomRight,
                scale: None,
                window: Some(3),
            };
            v[0].attention(&v[1], &v[2], spec, None)
        },
    );
    check(
        "fused attention in a window of 2, with key lengths",
        heads(),
        |v| {
            let lengths = v[0].tape().scope().from_slice(&[7i64, 4], &[2])?;
            let spec = AttentionSpec {
                window: Some(2),
                ..AttentionSpec::CAUSAL
            };
            v[0].attention(&v[1], &v[2], spec, Some(&lengths))
        },
    );
    check("fused attention with key lengths", heads(), |v| {
        let lengths = v[0].tape().scope().from_slice(&[7i64, 4], &[2])?;
        v[0].attention(&v[1], &v[2], AttentionSpec::CAUSAL, Some(&lengths))
    });
}

fn attention<'t, 's>(v: &[Var<'t, 's>], causal: bool) -> Result<Var<'t, 's>> {
    use ndscope::nn::{AttentionOptions, Mode, scaled_dot_product_attention};
    let options = AttentionOptions {
        causal,
        dropout: 0.0,
    };
    Ok(scaled_dot_product_attention(&v[0], &v[1], &v[2], options, Mode::Train)?.output)
}

/// Checks the gradients of a layer's parameters and of its input against finite differences: the
/// layer (of type `$layer`) is built by `$build` (in scope `$s`), converted to f64, and applied by `$forward` to an
/// input `$x` of shape `$shape`.
macro_rules! check_layer {
    ($layer:ident, $shape:expr, |$s:ident| $build:expr, |$model:ident, $x:ident| $forward:expr) => {{
        let name = stringify!($layer);
        use ndscope::nn::Parameters;
        root(Device::Cpu, |$s| {
            let mut model = $build;
            model.visit_mut(&mut |p| {
                *p = p.to_dtype(DType::F64)?;
                Ok(())
            })?;
            let shape: Vec<usize> = $shape.to_vec();
            let mut x_data = values(shape.iter().product(), 31, -1.0, 1.0);
            // The projected output and, with `grads`, the gradients of the input and each parameter.
            let model = std::cell::RefCell::new(model);
            let eval = |x_data: &[f64], grads: bool| -> Result<(f64, Vec<Vec<f64>>)> {
                let $model = model.borrow();
                $s.scope(|b| {
                    let tape = Tape::new(b);
                    let x_value = b.from_slice(x_data, &shape)?;
                    let $x = tape.param(&x_value);
                    let out: Var = $forward?;
                    let w = b.from_slice(&values(out.value().numel(), 99, -1.0, 1.0), out.shape())?;
                    let loss = out.mul(&tape.constant(&w))?.sum_all()?;
                    let value = loss.value().to_scalar::<f64>()?;
                    let mut found = Vec::new();
                    if grads {
                        let g = tape.backward(&loss)?;
                        let of = |t: &Tensor<'_>| match g.get(t) {
                            Some(g) => g.to_vec::<f64>().unwrap(),
                            None => vec![0.0; t.numel()],
                        };
                        found.push(of(&x_value));
                        $model.visit("", &mut |_, p| found.push(of(p)));
                    }
                    Ok((value, found))
                })
            };
            let (_, analytic) = eval(&x_data, true)?;
            let h = 1e-6;
            let compare = |what: &str, j: usize, got: f64, up: f64, down: f64| {
                let numeric = (up - down) / (2.0 * h);
                assert!(
                    (got - numeric).abs() <= 1e-5 * (1.0 + numeric.abs()),
                    "{name}: d/d {what}[{j}] is {got}, finite differences give {numeric}"
                );
            };
            for j in 0..x_data.len() {
                let x = x_data[j];
                x_data[j] = x + h;
                let (up, _) = eval(&x_data, false)?;
                x_data[j] = x - h;
                let (down, _) = eval(&x_data, false)?;
                x_data[j] = x;
                compare("input", j, analytic[0][j], up, down);
            }
            let mut names = Vec::new();
            model.borrow().visit("", &mut |n, _| names.push(n.to_string()));
            for (k, name) in names.iter().enumerate() {
                let mut data = Vec::new();
                model.borrow().visit("", &mut |n, p| {
                    if n == name {
                        data = p.to_vec::<f64>().unwrap();
                    }
                });
                // Every other element of large parameters, to keep the test quick.
                let stride = if data.len() > 64 { 3 } else { 1 };
                for j in (0..data.len()).step_by(stride) {
                    let at = |value: f64| -> Result<()> {
                        let mut i = 0;
                        model.borrow_mut().visit_mut(&mut |p| {
                            if i == k {
                                let mut d = p.to_vec::<f64>()?;
                                d[j] = value;
                                p.copy_from_slice_(&d)?;
                            }
                            i += 1;
                            Ok(())
                        })
                    };
                    at(data[j] + h)?;
                    let (up, _) = eval(&x_data, false)?;
                    at(data[j] - h)?;
                    let (down, _) = eval(&x_data, false)?;
                    at(data[j])?;
                    compare(name, j, analytic[k + 1][j], up, down);
                }
            }
            Ok::<_, Error>(())
        })
        .unwrap();
    }};
}

#[test]
fn transformer_layers() {
    use ndscope::nn::{
        AttentionOptions, Init, LayerNorm, Mode, Module, MultiHeadAttention, PositionalEmbedding,
        Recomputed, RmsNorm, TransformerBlock,
    };
    let opts = AttentionOptions {
        causal: true,
        dropout: 0.0,
    };
    check_layer!(LayerNorm, [2, 3, 4], |s| LayerNorm::new(s, 4)?, |m, x| m
        .forward(&x, Mode::Train));
    check_layer!(RmsNorm, [2, 3, 4], |s| RmsNorm::new(s, 4)?, |m, x| m
        .forward(&x, Mode::Train));
    check_layer!(
        PositionalEmbedding,
        [2, 3, 4],
        |s| PositionalEmbedding::new(s, 5, 4, Init::Normal(1.0))?,
        |m, x| m.forward(&x)
    );
    check_layer!(
        MultiHeadAttention,
        [2, 3, 4],
        |s| MultiHeadAttention::new(s, 4, 2, opts, Init::XavierUniform)?,
        |m, x| m.forward(&x, Mode::Train)
    );
    check_layer!(
        TransformerBlock,
        [1, 3, 4],
        |s| TransformerBlock::new(s, 4, 2, opts, Init::XavierUniform)?,
        |m, x| m.forward(&x, Mode::Train)
    );
    // The recomputing backward pass of a checkpointed block.
    check_layer!(
        Recomputed,
        [1, 3, 4],
        |s| Recomputed::new(TransformerBlock::new(s, 4, 2, opts, Init::XavierUniform)?),
        |m, x| m.forward(&x, Mode::Train)
    );
}

#[test]
fn embedding_gradients_add_up_over_repeated_ids() {
    use ndscope::nn::{Embedding, Init};
    root(Device::Cpu, |s| {
        let table = Embedding::new(s, 4, 3, Init::Normal(1.0))?;
        s.scope(|b| {
            let tape = Tape::new(b);
            let ids = b.from_slice(&[2i64, 0, 2, 2], &[2, 2])?;
            let out = table.forward(&tape, &ids)?;
            assert_eq!(out.shape(), &[2, 2, 3]);
            let rows = table.weight.to_vec::<f32>()?;
            assert_eq!(&out.value().to_vec::<f32>()?[..3], &rows[6..9]);
            let grads = tape.backward(&out.sum_all()?)?;
            let g = grads
                .get(&table.weight)
                .expect("the table is watched")
                .to_vec::<f32>()?;
            assert_eq!(
                g,
                vec![1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0]
            );
            let bad = b.from_slice(&[4i64], &[1])?;
            assert!(matches!(
                table.forward(&tape, &bad),
                Err(Error::IndexOutOfRange { .. })
            ));
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn convolution_and_pooling() {
    use ndscope::Conv2dOptions;
    let conv = |x: [usize; 4], w: [usize; 4]| {
        vec![
            input(&x, 41, -1.0, 1.0),
            input(&w, 42, -1.0, 1.0),
            input(&[w[0]], 43, -1.0, 1.0),
        ]
    };
    check("conv2d", conv([2, 2, 5, 4], [3, 2, 3, 2]), |v| {
        v[0].conv2d(&v[1], Some(&v[2]), &Conv2dOptions::default())
    });
    check(
        "conv2d with stride, padding and dilation",
        conv([1, 2, 7, 6], [2, 2, 2, 3]),
        |v| {
            let o = Conv2dOptions {
                stride: [2, 1],
                padding: [1, 2],
                dilation: [2, 1],
                groups: 1,
            };
            v[0].conv2d(&v[1], Some(&v[2]), &o)
        },
    );
    check("conv2d in groups", conv([2, 4, 4, 4], [4, 2, 3, 3]), |v| {
        let o = Conv2dOptions {
            padding: [1, 1],
            groups: 2,
            ..Conv2dOptions::default()
        };
        v[0].conv2d(&v[1], Some(&v[2]), &o)
    });
    let image = || vec![input(&[2, 2, 6, 5], 44, -2.0, 2.0)];
    check("max_pool2d", image(), |v| {
        v[0].max_pool2d([2, 2], [2, 2], [1, 0])
    });
    check("max_pool2d overlapping", image(), |v| {
        v[0].max_pool2d([3, 3], [1, 2], [1, 1])
    });
    check("avg_pool2d", image(), |v| {
        v[0].avg_pool2d([3, 2], [2, 1], [1, 1])
    });
    check("adaptive_avg_pool2d", image(), |v| {
        v[0].adaptive_avg_pool2d([4, 3])
    });
    check("unfold2d", image(), |v| {
        v[0].unfold2d([2, 3], &Conv2dOptions::default())
    });
}

#[test]
fn convolution_layers() {
    use ndscope::Conv2dOptions;
    use ndscope::nn::{BatchNorm2d, Conv2d, Init, Mode, Module};
    let same = Conv2dOptions {
        padding: [1, 1],
        ..Conv2dOptions::default()
    };
    check_layer!(
        Conv2d,
        [2, 2, 4, 3],
        |s| Conv2d::new(s, 2, 3, [3, 3], same, Init::XavierUniform)?,
        |m, x| m.forward(&x, Mode::Train)
    );
    check_layer!(
        BatchNorm2d,
        [3, 2, 2, 3],
        |s| BatchNorm2d::new(s, 2)?,
        |m, x| { m.forward(&x, Mode::Train) }
    );
}

#[test]
fn batch_norm_updates_its_running_statistics_in_place_and_uses_them_in_evaluation() {
    use ndscope::nn::{BatchNorm2d, Mode, Module};
    root(Device::Cpu, |m| {
        let bn = BatchNorm2d::new(m, 2)?;
        let data: Vec<f64> = values(2 * 2 * 3, 51, -1.0, 3.0);
        m.scope(|b| {
            let tape = Tape::new(b);
            let x = tape.constant(&b.from_slice(&data, &[2, 2, 3, 1])?.to_dtype(DType::F32)?);
            // The batch's events join the model scope's counters when it closes: a change now is an
            // allocation in the model scope itself.
            let before = m.stats().allocations;
            bn.forward(&x, Mode::Train)?;
            assert_eq!(
                m.stats().allocations,
                before,
                "the update allocated in the model scope"
            );
            Ok::<_, Error>(())
        })?;
        // Channel c holds data[n*6 + c*3 + i] for n in 0..2, i in 0..3.
        for c in 0..2 {
            let xs: Vec<f64> = (0..2)
                .flat_map(|n| (0..3).map(move |i| n * 6 + c * 3 + i))
                .map(|k| data[k])
                .collect();
            let mean = xs.iter().sum::<f64>() / 6.0;
            let unbiased = xs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
            let rm = bn.running_mean.borrow().to_vec_f64()?[c];
            let rv = bn.running_var.borrow().to_vec_f64()?[c];
            assert!((rm - 0.1 * mean).abs() < 1e-6, "running mean {rm}");
            assert!(
                (rv - (0.9 + 0.1 * unbiased)).abs() < 1e-5,
                "running var {rv}"
            );
        }
        // Evaluation normalises with the running statistics.
        m.scope(|b| {
            let tape = Tape::no_grad(b);
            let x = tape.constant(&b.full(&[1, 2, 1, 1], 2.0)?);
            let y = bn.forward(&x, Mode::Eval)?.value().to_vec_f64()?;
            for (c, got) in y.iter().enumerate() {
                let rm = bn.running_mean.borrow().to_vec_f64()?[c];
                let rv = bn.running_var.borrow().to_vec_f64()?[c];
                assert!((got - (2.0 - rm) / (rv + 1e-5).sqrt()).abs() < 1e-5);
            }
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn cross_entropy_options() {
    use ndscope::nn::{CrossEntropy, Reduction};
    let x = || vec![input(&[2, 3, 5], 23, -3.0, 3.0)];
    // Labels [2, 3] with two ignored (-100) positions.
    fn labels<'s>(v: &Var<'_, 's>) -> Result<Tensor<'s>> {
        v.tape()
            .scope()
            .from_slice(&[4i64, -100, 2, 0, 1, -100], &[2, 3])
    }
    check("cross_entropy [.., C] mean", x(), |v| {
        v[0].cross_entropy(&labels(&v[0])?.abs()?.clamp(0.0, 4.0)?)
    });
    check("cross_entropy ignore_index mean", x(), |v| {
        v[0].cross_entropy_with(&labels(&v[0])?, CrossEntropy::ignoring(-100))
    });
    check("cross_entropy ignore_index sum", x(), |v| {
        let options = CrossEntropy {
            reduction: Reduction::Sum,
            ..CrossEntropy::ignoring(-100)
        };
        v[0].cross_entropy_with(&labels(&v[0])?, options)
    });
    check("cross_entropy ignore_index none", x(), |v| {
        let options = CrossEntropy {
            reduction: Reduction::None,
            ..CrossEntropy::ignoring(-100)
        };
        v[0].cross_entropy_with(&labels(&v[0])?, options)
    });
    check("cross_entropy label smoothing, ignore, none", x(), |v| {
        let options = CrossEntropy {
            reduction: Reduction::None,
            label_smoothing: 0.2,
            ..CrossEntropy::ignoring(-100)
        };
        v[0].cross_entropy_with(&labels(&v[0])?, options)
    });
    check("cross_entropy label smoothing mean", x(), |v| {
        let options = CrossEntropy {
            label_smoothing: 0.1,
            ..CrossEntropy::default()
        };
        v[0].cross_entropy_with(&labels(&v[0])?.abs()?.clamp(0.0, 4.0)?, options)
    });
}

#[test]
fn a_parameter_watched_through_views_gets_the_gradient_of_its_storage() {
    // loss = Σ w∘A + Σ wᵀ∘B + Σ w[1..3, :]∘C + Σ broadcast(w[:, 0:1])∘D, each use watched on its own:
    // d/dw = A + Bᵀ + C placed in rows 1..3 + (row sums of D) in column 0.
    let (a, b, c, d) = (
        values(12, 1, -1.0, 1.0),
        values(12, 2, -1.0, 1.0),
        values(8, 3, -1.0, 1.0),
        values(15, 4, -1.0, 1.0),
    );
    let mut want = a.clone();
    for i in 0..3 {
        for j in 0..4 {
            want[i * 4 + j] += b[j * 3 + i];
        }
    }
    for (k, v) in c.iter().enumerate() {
        want[4 + k] += v;
    }
    for i in 0..3 {
        want[i * 4] += d[i * 5..i * 5 + 5].iter().sum::<f64>();
    }
    root(Device::Cpu, |s| {
        let w = s.from_slice(&values(12, 5, -1.0, 1.0), &[3, 4])?;
        s.scope(|batch| {
            let tape = Tape::new(batch);
            let constant = |data: &[f64], shape: &[usize]| batch.from_slice(data, shape);
            let loss = tape
                .param(&w)
                .mul(&tape.constant(&constant(&a, &[3, 4])?))?
                .sum_all()?
                .add(
                    &tape
                        .param(&w.t()?)
                        .mul(&tape.constant(&constant(&b, &[4, 3])?))?
                        .sum_all()?,
                )?
                .add(
                    &tape
                        .param(&w.narrow(0, 1, 2)?)
                        .mul(&tape.constant(&constant(&c, &[2, 4])?))?
                        .sum_all()?,
                )?
                .add(
                    &tape
                        .param(&w.narrow(1, 0, 1)?.broadcast_to(&[3, 5])?)
                        .mul(&tape.constant(&constant(&d, &[3, 5])?))?
                        .sum_all()?,
                )?;
            let grads = tape.backward(&loss)?;
            assert_eq!(grads.len(), 1, "one parameter, however many views");
            let got = grads.get(&w).unwrap().to_vec::<f64>()?;
            for (g, e) in got.iter().zip(&want) {
                assert!((g - e).abs() < 1e-12, "{got:?} vs {want:?}");
            }
            // Each view reads its own part of the one gradient.
            assert_eq!(grads.get(&w.t()?).unwrap().to_vec::<f64>()?, w_t(&got));
            assert_eq!(
                grads.get(&w.narrow(0, 1, 2)?).unwrap().to_vec::<f64>()?,
                got[4..].to_vec()
            );
            Ok::<_, Error>(())
        })?;
        // Watched only through a view: the base still gets its (partly zero) gradient.
        s.scope(|batch| {
            let tape = Tape::new(batch);
            let loss = tape.param(&w.narrow(1, 2, 2)?).sum_all()?;
            let grads = tape.backward(&loss)?;
            let got = grads.get(&w).unwrap().to_vec::<f64>()?;
            assert_eq!(got, [0.0, 0.0, 1.0, 1.0].repeat(3));
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// The transpose of a row-major 3x4 matrix, row-major.
fn w_t(m: &[f64]) -> Vec<f64> {
    (0..4)
        .flat_map(|j| (0..3).map(move |i| m[i * 4 + j]))
        .collect()
}
