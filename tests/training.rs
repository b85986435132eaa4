//! nn, optimizers, checkpoints and data: behaviour against hand-computed references and every error
//! path.

mod common;

use common::idx;

use ndscope::data::{Dataset, Loader};
use ndscope::nn::{
    self, Activation, Dropout, Init, Layer, Linear, Mode, Module, Parameters, Sequential,
};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ndscope::{DType, Device, Error, Movable, Result, Scope, Tape, Tensor, checkpoint, root};

/// Runs `steps` optimizer steps on a one-parameter model with gradients `grads[k]`, returning the
/// parameter after each step.
fn run_optimizer(
    start: &[f64],
    grads: &[[f64; 2]],
    make: impl for<'m> Fn(&Scope<'m>, &Tensor<'m>) -> Result<Box<dyn StepOnce<'m> + 'm>>,
) -> Vec<Vec<f64>> {
    root(Device::Cpu, |m| {
        let mut p = m.from_slice(start, &[2])?;
        let mut opt = make(m, &p)?;
        let mut trace = Vec::new();
        for g in grads {
            m.scope(|b| {
                // Loss g . p has gradient g for p.
                let tape = Tape::new(b);
                let loss = tape
                    .param(&p)
                    .mul(&tape.constant(&b.from_slice(g, &[2])?))?
                    .sum_all()?;
                let grads = tape.backward(&loss)?;
                opt.step_once(&mut p, &grads)
            })?;
            trace.push(p.to_vec::<f64>()?);
        }
        Ok::<_, Error>(trace)
    })
    .unwrap()
}

/// An object-safe view of an optimizer over a single tensor, for the table-driven tests.
trait StepOnce<'m> {
    fn step_once(&mut self, p: &mut Tensor<'m>, grads: &ndscope::Gradients<'_>) -> Result<()>;
}

impl<'m, O: Optimizer<'m>> StepOnce<'m> for O {
    fn step_once(&mut self, p: &mut Tensor<'m>, grads: &ndscope::Gradients<'_>) -> Result<()> {
        self.step(p, grads)
    }
}

const GRADS: [[f64; 2]; 3] = [[0.5, -1.0], [0.25, 2.0], [-0.75, 0.5]];

fn assert_close(got: &[Vec<f64>], want: &[Vec<f64>]) {
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() < 1e-12, "got {got:?}, want {want:?}");
        }
    }
}

#[test]
fn sgd_with_momentum_and_weight_decay_matches_its_definition() {
    let (lr, mu, wd) = (0.1, 0.9, 0.01);
    for nesterov in [false, true] {
        let got = run_optimizer(&[1.0, -2.0], &GRADS, |m, p| {
            let config = SgdConfig {
                lr,
                momentum: mu,
                weight_decay: wd,
                nesterov,
            };
            Ok(Box::new(Sgd::new(m, p, config)?))
        });
        let (mut p, mut v) = ([1.0f64, -2.0], [0.0f64; 2]);
        let mut want = Vec::new();
        for g in GRADS {
            for i in 0..2 {
                let d = g[i] + wd * p[i];
                v[i] = mu * v[i] + d;
                p[i] -= lr * if nesterov { d + mu * v[i] } else { v[i] };
            }
            want.push(p.to_vec());
        }
        assert_close(&got, &want);
    }
}

#[test]
fn adam_and_adamw_match_their_definitions() {
    for decoupled in [false, true] {
        let (lr, wd, b1, b2, eps) = (0.01, 0.1, 0.9, 0.999, 1e-8);
        let config = AdamConfig {
            lr,
            betas: (b1, b2),
            eps,
            weight_decay: wd,
            decoupled_weight_decay: decoupled,
        };
        let got = run_optimizer(&[1.0, -2.0], &GRADS, |m, p| {
            Ok(Box::new(Adam::new(m, p, config)?))
        });
        let (mut p, mut mo, mut v) = ([1.0f64, -2.0], [0.0f64; 2], [0.0f64; 2]);
        let mut want = Vec::new();
        for (t, g) in GRADS.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..2 {
                let mut g = g[i];
                if decoupled {
                    p[i] *= 1.0 - lr * wd;
                } else {
                    g += wd * p[i];
                }
                mo[i] = b1 * mo[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let m_hat = mo[i] / (1.0 - b1.powi(t));
                let v_hat = v[i] / (1.0 - b2.powi(t));
                p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
            }
            want.push(p.to_vec());
        }
        assert_close(&got, &want);
    }
}

#[test]
fn optimizers_refuse_bad_settings_and_a_foreign_parameter_set() {
    root(Device::Cpu, |m| {
        let model = nn::mlp(m, &[3, 4, 2], Activation::Relu, Init::KaimingNormal)?;
        assert!(matches!(
            Sgd::new(m, &model, SgdConfig::new(-1.0)),
            Err(Error::InvalidArgument { .. })
        ));
        let bad_betas = AdamConfig {
            betas: (1.0, 0.9),
            ..AdamConfig::adam(0.1)
        };
        assert!(matches!(
            Adam::new(m, &model, bad_betas),
            Err(Error::InvalidArgument { .. })
        ));

        let mut opt = Adam::new(m, &model, AdamConfig::adam(0.1))?;
        let mut other = nn::mlp(m, &[3, 2], Activation::Relu, Init::KaimingNormal)?;
        m.scope(|b| {
            let tape = Tape::new(b);
            let x = tape.constant(&b.randn(&[2, 3])?);
            let loss = other.forward(&x, Mode::Train)?.sum_all()?;
            let grads = tape.backward(&loss)?;
            let err = opt.step(&mut other, &grads).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { .. })
                    && err.to_string().contains("created for 4 parameters"),
                "{err}"
            );
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn a_parameter_without_a_gradient_is_refused_unless_frozen() {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[2, 3, 2], Activation::Tanh, Init::XavierNormal)?;
        let values = |model: &nn::Sequential<'_>| {
            let mut v = Vec::new();
            model.visit("", &mut |_, t| v.push(t.to_vec::<f32>().unwrap()));
            v
        };
        let before = values(&model);
        let mut opt = Sgd::new(m, &model, SgdConfig::new(0.5))?;
        // Only the first layer takes part in the loss: the second gets no gradient.
        fn step<'m>(m: &Scope<'m>, model: &mut nn::Sequential<'m>, opt: &mut Sgd<'m>) -> Result<()> {
            m.scope(|b| {
                let tape = Tape::new(b);
                let Layer::Linear(first) = &model.layers()[0] else {
                    unreachable!()
                };
                let x = tape.constant(&b.ones(&[1, 2])?);
                let loss = first.forward(&x, Mode::Train)?.sum_all()?;
                let grads = tape.backward(&loss)?;
                opt.step(model, &grads)
            })
        }
        let refused = step(m, &mut model, &mut opt);
        assert!(
            matches!(&refused, Err(Error::MissingGradient { parameter, .. }) if parameter == "2.weight"),
            "{refused:?}"
        );
        assert!(refused.unwrap_err().to_string().contains("freeze"));
        assert_eq!(values(&model), before, "a refused step writes nothing");

        opt.freeze(&model, "2.weight", true)?;
        opt.freeze(&model, "2.bias", true)?;
        step(m, &mut model, &mut opt)?;
        let after = values(&model);
        assert_ne!(after[0], before[0]);
        assert_eq!(after[2..], before[2..], "frozen parameters stay as they were");

        assert!(matches!(
            opt.freeze(&model, "7.weight", true),
            Err(Error::InvalidArgument { .. })
        ));
        opt.freeze(&model, "2.weight", false)?;
        assert!(matches!(
            step(m, &mut model, &mut opt),
            Err(Error::MissingGradient { parameter, .. }) if parameter == "2.weight"
        ));
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn stepping_with_another_models_gradients_is_an_error() {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[2, 2], Activation::Tanh, Init::XavierNormal)?;
        let other = nn::mlp(m, &[2, 2], Activation::Tanh, Init::XavierNormal)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 0.0))?;
        let result = m.scope(|b| {
            let tape = Tape::new(b);
            let x = tape.constant(&b.ones(&[1, 2])?);
            let loss = other.forward(&x, Mode::Train)?.sum_all()?;
            opt.step(&mut model, &tape.backward(&loss)?)
        });
        assert!(matches!(result, Err(Error::MissingGradient { parameter, .. }) if parameter == "0.weight"));
        assert_eq!(opt.steps(), 0);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_model_moves_between_scopes_in_one_call() {
    root(Device::Cpu, |outer| {
        let model = outer.scope(|init| {
            let model = nn::mlp(init, &[4, 8, 2], Activation::Gelu, Init::KaimingUniform)?;
            init.ret(model)
        })?;
        assert_eq!(outer.stats().live_tensors, 4);
        assert_eq!(model.parameter_count(), 4);
        assert_eq!(model.parameter_elements(), 4 * 8 + 8 + 8 * 2 + 2);
        let moved = outer.scope(|inner| -> Result<usize> {
            let here: Sequential = model.move_into(inner)?;
            assert_eq!(inner.stats().live_tensors, 4);
            Ok(here.parameter_count())
        })?;
        assert_eq!(moved, 4);
        assert_eq!(outer.stats().live_tensors, 0);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn linear_layers_compute_x_w_transpose_plus_b() {
    root(Device::Cpu, |s| {
        let mut layer = Linear::new(s, 2, 3, Init::Constant(0.0))?;
        layer
            .weight
            .copy_from_slice_(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
        layer
            .bias
            .as_mut()
            .expect("a bias")
            .copy_from_slice_(&[0.5f32, 0.0, -0.5])?;
        let tape = Tape::no_grad(s);
        let y = layer.forward(
            &tape.constant(&s.from_slice(&[1.0f32, 1.0], &[1, 2])?),
            Mode::Eval,
        )?;
        assert_eq!(y.value().to_vec::<f32>()?, vec![3.5, 7.0, 10.5]);
        assert_eq!((layer.in_features(), layer.out_features()), (2, 3));
        assert!(matches!(
            Linear::new(s, 0, 3, Init::KaimingUniform),
            Err(Error::InvalidShape { .. })
        ));
        assert!(matches!(
            nn::mlp(s, &[3], Activation::Relu, Init::KaimingUniform),
            Err(Error::InvalidShape { .. })
        ));
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn initialisers_respect_their_bounds_and_the_seed() {
    root(Device::Cpu, |s| {
        s.set_seed(3);
        let a = Init::KaimingUniform
            .tensor(s, &[100, 50])?
            .to_vec::<f32>()?;
        let bound = (6.0f32 / 50.0).sqrt();
        assert!(a.iter().all(|v| v.abs() <= bound));
        assert!(a.iter().any(|v| v.abs() > 0.9 * bound));
        s.set_seed(3);
        assert_eq!(
            Init::KaimingUniform
                .tensor(s, &[100, 50])?
                .to_vec::<f32>()?,
            a
        );
        let n = Init::XavierNormal.tensor(s, &[200, 300])?.to_vec::<f32>()?;
        let var = n.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n.len() as f64;
        assert!((var / (2.0 / 500.0) - 1.0).abs() < 0.05, "variance {var}");
        assert!(Init::KaimingNormal.tensor(s, &[]).is_err());
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn dropout_drops_in_training_and_passes_through_in_evaluation() {
    root(Device::Cpu, |s| {
        let drop = Dropout::new(0.25)?;
        let x = s.ones(&[10_000])?;
        let tape = Tape::new(s);
        let train = <Dropout as Module<'_>>::forward(&drop, &tape.constant(&x), Mode::Train)?;
        let values = train.value().to_vec::<f32>()?;
        let zeros = values.iter().filter(|v| **v == 0.0).count();
        assert!((2_200..2_800).contains(&zeros), "{zeros} of 10000 dropped");
        assert!(
            values
                .iter()
                .all(|v| *v == 0.0 || (*v - 4.0 / 3.0).abs() < 1e-6)
        );
        let eval = <Dropout as Module<'_>>::forward(&drop, &tape.constant(&x), Mode::Eval)?;
        assert!(eval.value().shares_storage(&x));
        assert!(Dropout::new(1.0).is_err());
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn mse_has_the_gradient_2_over_n_times_the_error() {
    root(Device::Cpu, |s| {
        let p = s.from_slice(&[1.0f64, 2.0], &[2])?;
        let t = s.from_slice(&[0.0f64, 4.0], &[2])?;
        let tape = Tape::new(s);
        let loss = nn::mse(&tape.param(&p), &tape.constant(&t))?;
        assert_eq!(loss.value().to_scalar::<f64>()?, 2.5);
        let grads = tape.backward(&loss)?;
        assert_eq!(grads.get(&p).unwrap().to_vec::<f64>()?, vec![1.0, -2.0]);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn gradients_clip_to_a_global_norm() {
    root(Device::Cpu, |s| {
        let p = s.from_slice(&[3.0f32, 4.0], &[2])?;
        let tape = Tape::new(s);
        let loss = tape.param(&p).square()?.sum_all()?.mul_scalar(0.5)?;
        let mut grads = tape.backward(&loss)?;
        assert_eq!(grads.clip_global_norm(1.0)?, 5.0);
        assert!((grads.global_norm()? - 1.0).abs() < 1e-6);
        Ok::<_, Error>(())
    })
    .unwrap();
}

// ---- checkpoints ----

#[test]
fn checkpoints_round_trip_and_other_readers_see_the_names() {
    root(Device::Cpu, |s| {
        let trained = nn::mlp(s, &[3, 4, 2], Activation::Relu, Init::KaimingUniform)?;
        let dir = std::env::temp_dir().join(format!("ndscope-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        checkpoint::save(&trained, &path)?;
        let mut fresh = nn::mlp(s, &[3, 4, 2], Activation::Relu, Init::Constant(0.0))?;
        checkpoint::load(&mut fresh, &path)?;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        trained.visit("", &mut |n, t| {
            a.push((n.to_string(), t.to_vec::<f32>().unwrap()))
        });
        fresh.visit("", &mut |n, t| {
            b.push((n.to_string(), t.to_vec::<f32>().unwrap()))
        });
        assert_eq!(a, b);
        let names: Vec<String> = checkpoint::read_bytes(s, &std::fs::read(&path).unwrap())?
            .into_iter()
            .map(|(n, t)| format!("{n}{:?}", t.shape()))
            .collect();
        assert_eq!(
            names,
            ["0.bias[4]", "0.weight[4, 3]", "2.bias[2]", "2.weight[2, 4]"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
        Ok::<_, Error>(())
    })
    .unwrap();
}

ndscope::model! {
    /// Bare tensors beside a layer, to check their checkpoint names.
    struct Inner<'m> {
        w: Tensor<'m>,
        layer: Linear<'m>,
    }
}

ndscope::model! {
    /// An outer struct with a nested model, a bare tensor and a list of tensors.
    struct Outer<'m> {
        a: Inner<'m>,
        scale: Tensor<'m>,
        ws: Vec<Tensor<'m>>,
    }
}

#[test]
fn model_fields_that_are_bare_tensors_are_named_without_a_trailing_dot() {
    root(Device::Cpu, |s| {
        let mut model = Outer {
            a: Inner {
                w: s.ones(&[2])?,
                layer: Linear::new(s, 2, 1, Init::Constant(0.5))?,
            },
            scale: s.ones(&[1])?,
            ws: vec![s.zeros(&[3])?, s.ones(&[3])?],
        };
        let mut names = Vec::new();
        model.visit("", &mut |name, _| names.push(name.to_string()));
        assert_eq!(
            names,
            [
                "a.w",
                "a.layer.weight",
                "a.layer.bias",
                "scale",
                "ws.0",
                "ws.1"
            ]
        );
        // The names a checkpoint written elsewhere would use load back.
        let bytes = checkpoint::to_bytes(&model)?;
        let read: Vec<String> = checkpoint::read_bytes(s, &bytes)?
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            read,
            [
                "a.layer.bias",
                "a.layer.weight",
                "a.w",
                "scale",
                "ws.0",
                "ws.1"
            ]
        );
        checkpoint::load_bytes(&mut model, &bytes)?;
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_bad_checkpoint_is_refused_without_touching_the_model() {
    root(Device::Cpu, |s| {
        let saved = checkpoint::to_bytes(&nn::mlp(s, &[3, 4, 2], Activation::Relu, Init::KaimingUniform)?)?;
        let mut model = nn::mlp(s, &[3, 5, 2], Activation::Relu, Init::Constant(0.25))?;
        let err = checkpoint::load_bytes(&mut model, &saved).unwrap_err();
        assert!(matches!(&err, Error::TensorMismatch { name, .. } if name == "0.weight"), "{err}");
        assert!(err.to_string().contains("is f32 [4, 3], the model expects f32 [5, 3]"), "{err}");
        let mut untouched = true;
        model.visit("", &mut |_, t| untouched &= t.to_vec::<f32>().unwrap().iter().all(|v| *v == 0.25 || *v == 0.0));
        assert!(untouched, "a refused load wrote into the model");

        let mut deeper = nn::mlp(s, &[3, 4, 4, 2], Activation::Relu, Init::KaimingUniform)?;
        let err = checkpoint::load_bytes(&mut deeper, &saved).unwrap_err();
        assert!(matches!(err, Error::TensorMismatch { .. }), "{err}");
        let mut single = Linear::new(s, 3, 4, Init::KaimingUniform)?;
        let err = checkpoint::load_bytes(&mut single, &saved).unwrap_err();
        assert!(matches!(&err, Error::MissingTensor { name, nearest, held: 4 } if name == "weight" && nearest[0] == "0.weight" && nearest[1] == "2.weight"), "{err}");
        assert!(err.to_string().contains("\"0.weight\""), "{err}");

        let mut f64_model = Linear::new(s, 3, 4, Init::KaimingUniform)?;
        f64_model.weight = f64_model.weight.to_dtype(DType::F64)?;
        let one_layer = checkpoint::to_bytes(&Linear::new(s, 3, 4, Init::KaimingUniform)?)?;
        assert!(matches!(checkpoint::load_bytes(&mut f64_model, &one_layer), Err(Error::TensorMismatch { .. })));

        for corrupt in [&saved[..saved.len() - 3], &saved[..4], b"not a checkpoint at all".as_slice()] {
            let err = checkpoint::load_bytes(&mut model, corrupt).unwrap_err();
            assert!(matches!(err, Error::Format { format: "safetensors", .. }), "{err}");
        }
        let err = checkpoint::load(&mut model, "/nonexistent/ndscope.safetensors").unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        Ok::<_, Error>(())
    })
    .unwrap();
}

// ---- data ----

#[test]
fn the_bundled_digits_load_with_scaled_pixels() {
    let digits = Dataset::digits().unwrap();
    assert_eq!(
        (digits.len(), digits.dim(), digits.classes()),
        (1797, 64, 10)
    );
    assert!(digits.features().iter().all(|v| (0.0..=1.0).contains(v)));
    assert!(digits.features().contains(&1.0));
    for class in 0..10 {
        assert!(digits.labels().iter().filter(|l| **l == class).count() > 150);
    }
}

#[test]
fn splits_are_seeded_and_partition_the_examples() {
    let digits = Dataset::digits().unwrap();
    let (train, test) = digits.split(0.2, 1).unwrap();
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!(digits.split(0.2, 1).unwrap(), (train.clone(), test.clone()));
    assert_ne!(digits.split(0.2, 2).unwrap().1, test);
    let mut sums: Vec<f32> = train
        .features()
        .chunks(64)
        .chain(test.features().chunks(64))
        .map(|r| r.iter().sum())
        .collect();
    let mut all: Vec<f32> = digits
        .features()
        .chunks(64)
        .map(|r| r.iter().sum())
        .collect();
    sums.sort_by(f32::total_cmp);
    all.sort_by(f32::total_cmp);
    assert_eq!(sums, all);
    assert!(digits.split(0.0, 1).is_err());
    assert!(digits.split(1.0, 1).is_err());
}

#[test]
fn csv_errors_name_the_line() {
    let ok = "0,1,2\n3,4,1\n";
    assert_eq!(Dataset::from_csv(ok, 2, 3, 1.0).unwrap().len(), 2);
    for (text, needle) in [
        ("0,1,2\n3,4\n", "line 2: 2 fields"),
        ("0,x,2\n", "line 1: field 2"),
        ("0,1,7\n", "label 7 is outside 0..3"),
        ("0,1,-1\n", "label -1"),
        ("0,1,1.5\n", "not an integer"),
        ("0,inf,1\n", "not finite"),
        ("", "no rows"),
    ] {
        let err = Dataset::from_csv(text, 2, 3, 1.0).unwrap_err();
        assert!(matches!(err, Error::Format { format: "CSV", .. }), "{err}");
        assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
    }
}

#[test]
fn the_loader_covers_every_example_once_per_epoch_in_a_seeded_order() {
    let data = Dataset::new(
        (0..20).map(|v| v as f32).collect(),
        (0..10).map(|v| v % 3).collect(),
        2,
        3,
    )
    .unwrap();
    let loader = Loader::new(&data, 4).unwrap().shuffle(9);
    assert_eq!(loader.batches_per_epoch(), 3);
    let epoch = |e: u64, background: bool| {
        let mut seen = Vec::new();
        loader
            .for_each_batch(e, background, |b| {
                assert_eq!(b.features().len(), b.rows() * 2);
                seen.extend(b.features().chunks(2).map(|r| r[0] as usize / 2));
                Ok(())
            })
            .unwrap();
        seen
    };
    let first = epoch(0, false);
    let mut sorted = first.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    assert_eq!(
        epoch(0, true),
        first,
        "the background thread yields the same batches"
    );
    assert_ne!(epoch(1, false), first, "each epoch has its own order");
    assert_eq!(
        Loader::new(&data, 4)
            .unwrap()
            .drop_last(true)
            .batches_per_epoch(),
        2
    );
    assert!(Loader::new(&data, 0).is_err());
    // An error stops the epoch, also with the background thread.
    let mut calls = 0;
    let err = loader.for_each_batch(0, true, |_| {
        calls += 1;
        Err(Error::Empty { op: "stop" })
    });
    assert!(err.is_err());
    assert_eq!(calls, 1);
}

#[test]
fn sharded_loaders_split_each_epoch_across_ranks_as_distributed_sampler_does() {
    let data = Dataset::new((0..10).map(|v| v as f32).collect(), vec![0; 10], 1, 1).unwrap();
    let epoch = |loader: &Loader<'_>, e: u64| {
        let mut seen = Vec::new();
        loader
            .for_each_batch(e, false, |b| {
                seen.extend(b.features().iter().map(|&f| f as usize));
                Ok(())
            })
            .unwrap();
        seen
    };
    for world in [1usize, 2, 3, 4] {
        let whole = epoch(&Loader::new(&data, 3).unwrap().shuffle(5), 2);
        let shards: Vec<Vec<usize>> = (0..world)
            .map(|rank| {
                let shard = Loader::new(&data, 3)
                    .unwrap()
                    .shuffle(5)
                    .shard(rank, world)
                    .unwrap();
                assert_eq!(
                    shard.batches_per_epoch(),
                    10usize.div_ceil(world).div_ceil(3)
                );
                epoch(&shard, 2)
            })
            .collect();
        // Rank r takes positions r, r + world, … of the epoch's order, padded from its start.
        let per_rank = 10usize.div_ceil(world);
        for (rank, shard) in shards.iter().enumerate() {
            assert_eq!(shard.len(), per_rank, "world {world}: equal shards");
            for (k, &example) in shard.iter().enumerate() {
                assert_eq!(
                    example,
                    whole[(rank + k * world) % 10],
                    "world {world} rank {rank}"
                );
            }
        }
        let mut all: Vec<usize> = shards.concat();
        // The padding repeats the epoch's first examples, once each.
        let pad = per_rank * world - 10;
        for (i, example) in whole.iter().enumerate() {
            let times = all.iter().filter(|&&e| e == *example).count();
            assert_eq!(
                times,
                if i < pad { 2 } else { 1 },
                "world {world}: example {example}"
            );
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all,
            (0..10).collect::<Vec<_>>(),
            "world {world}: every example"
        );
    }
    let err = Loader::new(&data, 3).unwrap().shard(3, 3).unwrap_err();
    assert!(err.to_string().contains("rank 3 of 3"), "{err}");
    assert!(Loader::new(&data, 3).unwrap().shard(0, 0).is_err());
}

#[test]
fn datasets_check_their_arguments() {
    assert!(matches!(
        Dataset::new(vec![0.0; 5], vec![0, 1], 2, 2),
        Err(Error::DataLength { .. })
    ));
    assert!(matches!(
        Dataset::new(vec![0.0; 4], vec![0, 2], 2, 2),
        Err(Error::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        Dataset::new(vec![], vec![0], 0, 2),
        Err(Error::InvalidShape { .. })
    ));
}

fn write_mnist(dir: &std::path::Path, images: &[u8], labels: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    for (prefix, n) in [("train", 3u32), ("t10k", 2u32)] {
        std::fs::write(
            dir.join(format!("{prefix}-images-idx3-ubyte")),
            idx(&[n, 2, 2], &images[..4 * n as usize]),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("{prefix}-labels-idx1-ubyte")),
            idx(&[n], &labels[..n as usize]),
        )
        .unwrap();
    }
}

#[test]
fn mnist_idx_files_are_read_and_corrupt_ones_refused() {
    let dir = std::env::temp_dir().join(format!("ndscope-idx-{}", std::process::id()));
    let images: Vec<u8> = (0..12).map(|v| v * 20).collect();
    write_mnist(&dir, &images, &[3, 1, 4]);
    let (train, test) = Dataset::mnist(&dir).unwrap();
    assert_eq!((train.len(), train.dim(), test.len()), (3, 4, 2));
    assert_eq!(train.labels(), &[3, 1, 4]);
    assert_eq!(
        train.row(1),
        &[80.0 / 255.0, 100.0 / 255.0, 120.0 / 255.0, 140.0 / 255.0]
    );

    let labels = dir.join("train-labels-idx1-ubyte");
    let images_file = dir.join("train-images-idx3-ubyte");
    let cases: [(&std::path::Path, Vec<u8>, &str); 6] = [
        (
            &images_file,
            idx(&[3, 2, 2], &images[..11]),
            "need 12 bytes",
        ),
        (&images_file, vec![0, 0, 0x08], "shorter than"),
        (&images_file, vec![1, 0, 0x08, 3, 0, 0, 0, 1], "magic"),
        (&images_file, idx(&[3, 4], &images), "rank 2, expected 3"),
        (&labels, idx(&[2], &[1, 2]), "2 labels for 3 images"),
        (&labels, idx(&[3], &[1, 2, 12]), "label 12"),
    ];
    for (file, bytes, needle) in cases {
        write_mnist(&dir, &images, &[3, 1, 4]);
        std::fs::write(file, bytes).unwrap();
        let err = Dataset::mnist(&dir).unwrap_err();
        assert!(matches!(err, Error::Format { format: "IDX", .. }), "{err}");
        assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let err = Dataset::mnist(&dir).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(err.to_string().contains(".gz"), "{err}");
}

/// A training step that panics after backward, with the tape and the gradients alive, when `fail`.
fn step_that_may_panic<'m>(
    m: &Scope<'m>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
    fail: bool,
) -> Result<f32> {
    m.scope(|b| {
        let tape = Tape::new(b);
        let x = tape.constant(&b.randn(&[5, 8])?);
        let y = b.from_slice(&[0i64, 1, 2, 3, 0], &[5])?;
        let loss = model.forward(&x, Mode::Train)?.cross_entropy(&y)?;
        let grads = tape.backward(&loss)?;
        assert!(!fail, "injected failure with the tape and gradients alive");
        opt.step(model, &grads)?;
        loss.value().to_scalar::<f32>()
    })
}

#[test]
fn a_panic_in_a_training_step_returns_every_byte_and_the_next_step_runs() {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[8, 16, 4], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adam(1e-2))?;
        let model_bytes = m.stats().live_bytes;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            step_that_may_panic(m, &mut model, &mut opt, true)
        }));
        assert!(caught.is_err());
        let st = m.stats();
        assert_eq!(
            st.live_bytes, model_bytes,
            "the failed step left bytes in the model scope"
        );
        assert_eq!(
            st.subtree_bytes, model_bytes,
            "the failed step's batch scope kept bytes"
        );
        assert!(step_that_may_panic(m, &mut model, &mut opt, false)?.is_finite());
        assert_eq!(opt.steps(), 1);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn accumulated_micro_batches_step_like_one_large_batch() {
    use ndscope::optim::{GradientAccumulator, Sgd, SgdConfig};
    let x: Vec<f64> = (0..32 * 4)
        .map(|i| ((i * 37 % 23) as f64 - 11.0) / 7.0)
        .collect();
    let labels: Vec<i64> = (0..32).map(|i| (i * 5 % 3) as i64).collect();
    let train = |micro: usize| -> Vec<f64> {
        root(Device::Cpu, |m| {
            m.set_seed(3);
            let mut model = nn::mlp(m, &[4, 6, 3], Activation::Tanh, Init::XavierUniform)?;
            model.visit_mut(&mut |p| {
                *p = p.to_dtype(DType::F64)?;
                Ok(())
            })?;
            let mut opt = Sgd::new(m, &model, SgdConfig::new(0.5).momentum(0.9))?;
            let mut sums = GradientAccumulator::new(m, &model)?;
            let rows = 32 / micro;
            for k in 0..micro {
                m.scope(|b| {
                    let xs = b.from_slice(&x[k * rows * 4..(k + 1) * rows * 4], &[rows, 4])?;
                    let ys = b.from_slice(&labels[k * rows..(k + 1) * rows], &[rows])?;
                    let tape = Tape::new(b);
                    let loss = model
                        .forward(&tape.constant(&xs), Mode::Train)?
                        .cross_entropy(&ys)?;
                    let grads = tape.backward(&loss)?;
                    let before = m.stats().allocations;
                    sums.add(&grads)?;
                    assert_eq!(
                        m.stats().allocations,
                        before,
                        "accumulating allocated in the model scope"
                    );
                    Ok::<_, Error>(())
                })?;
            }
            sums.step(&mut opt, &mut model)?;
            assert!(
                sums.step(&mut opt, &mut model).is_err(),
                "a step needs a micro-batch"
            );
            let mut out = Vec::new();
            model.visit("", &mut |_, p| out.extend(p.to_vec::<f64>().unwrap()));
            Ok::<_, Error>(out)
        })
        .unwrap()
    };
    let whole = train(1);
    let pieces = train(4);
    for (a, b) in whole.iter().zip(&pieces) {
        assert!(
            (a - b).abs() < 1e-12,
            "one batch of 32 gives {a}, four of 8 give {b}"
        );
    }
}
