//! Training the Llama family as GPT-2 trains: activation checkpointing (`Llama::set_recompute`),
//! bf16/f16 autocast, AdamW steps in a planned workspace under a strict model scope, moving a model
//! between scopes and out to threads, and `AutoModel` choosing the architecture from `config.json`.
//! Data parallelism over MPI is in tests/distributed.rs (`a_llama_s_averaged_gradients_...`); the
//! agreement with transformers' logits and gradients is in tests/llama.rs.

use std::collections::BTreeMap;

mod common;
use common::reference::{reference_of, relative_error};

use ndscope::models::{AutoModel, Llama};
use ndscope::nn::{Mode, Parameters};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{DType, Device, Error, MoveOut, Result, Scope, Tape, Tensor, Workspace, root};

const DIR: &str = "data/llama-tiny";
/// Sliding-window attention (16 of 64 positions): recomputation must run the window too.
const MISTRAL: &str = "data/mistral-tiny";
/// Dynamic RoPE past its 16 positions: recomputation must rebuild the pass's own tables.
const DYNAMIC: &str = "data/llama-dynamic-tiny";

/// The reference batch's token ids, `[batch, len]`.
fn input<'s>(b: &Scope<'s>, dir: &str) -> Result<Tensor<'s>> {
    let reference = reference_of(dir);
    let (shape, values) = &reference["input_ids"];
    let ids: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    b.from_slice(&ids, shape)
}

/// A training step's loss, every gradient by name (as bits) and the batch scope's peak bytes.
type Step = (u64, BTreeMap<String, Vec<u64>>, usize);

fn step<'m>(s: &Scope<'m>, model: &Llama<'m>, dir: &str) -> Result<Step> {
    s.scope(|b| {
        let ids = input(b, dir)?;
        let tape = Tape::new(b);
        let loss = Llama::loss(&model.forward(&tape, &ids, Mode::Train)?, &ids)?;
        let grads = tape.backward(&loss)?;
        let mut by_name = BTreeMap::new();
        model.visit("", &mut |name, p| {
            let g = grads.get(p).expect("every parameter has a gradient");
            let bits = g
                .to_vec_f64()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            by_name.insert(name.to_string(), bits);
        });
        let loss = loss.value().to_vec_f64()?[0].to_bits();
        Ok((loss, by_name, b.stats().peak_bytes))
    })
}

#[test]
fn recomputed_blocks_give_the_same_step_bit_for_bit_in_less_memory() -> Result<()> {
    for dir in [DIR, MISTRAL, DYNAMIC] {
        root(Device::Cpu, |s| {
            let mut model = Llama::from_pretrained(s, dir, DType::F32)?;
            let plain = step(s, &model, dir)?;
            model.set_recompute(true);
            assert!(model.recomputes());
            let recomputed = step(s, &model, dir)?;
            assert_eq!(plain.0, recomputed.0, "{dir}: the loss");
            assert_eq!(plain.1.len(), model.parameter_count(), "{dir}");
            for (name, bits) in &plain.1 {
                assert!(recomputed.1[name] == *bits, "{dir}: the gradient of {name}");
            }
            assert!(
                recomputed.2 < plain.2,
                "{dir}: peak {} B recomputed, {} B kept",
                recomputed.2,
                plain.2
            );
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn autocast_logits_and_gradients_stay_near_transformers() -> Result<()> {
    let reference = reference_of(DIR);
    root(Device::Cpu, |s| {
        let model = Llama::from_pretrained(s, DIR, DType::F32)?;
        for (half, logits_tol, grad_tol) in [(DType::BF16, 0.04, 0.08), (DType::F16, 0.005, 0.01)] {
            s.scope(|b| {
                b.autocast(half)?;
                let ids = input(b, DIR)?;
                let tape = Tape::new(b);
                let logits = model.forward(&tape, &ids, Mode::Train)?;
                let err = relative_error(&logits.value().to_vec_f64()?, &reference["logits"].1);
                eprintln!("{half} autocast logits: relative error {err:e}");
                assert!(err <= logits_tol, "{half} logits: relative error {err:e}");
                let grads = tape.backward(&Llama::loss(&logits, &ids)?)?;
                let mut worst = (0.0f64, String::new());
                model.visit("", &mut |name, p| {
                    // Gradients of f32 master weights, in f32, however the step computed.
                    let g = grads.get(p).expect("every parameter has a gradient");
                    assert_eq!(g.dtype(), DType::F32, "{name}");
                    let err = relative_error(
                        &g.to_vec_f64().unwrap(),
                        &reference[&format!("grad/{name}")].1,
                    );
                    if err > worst.0 {
                        worst = (err, name.to_string());
                    }
                });
                eprintln!(
                    "{half} autocast gradients: worst {:e} ({})",
                    worst.0, worst.1
                );
                assert!(
                    worst.0 <= grad_tol,
                    "{half} gradient of {}: relative error {:e}",
                    worst.1,
                    worst.0
                );
                Ok::<_, Error>(())
            })?;
        }
        Ok(())
    })
}

#[test]
fn adamw_steps_replay_a_planned_workspace_in_a_strict_model_scope() -> Result<()> {
    root(Device::Cpu, |s| {
        s.named_scope("model", |m| {
            let mut model = Llama::from_pretrained(m, DIR, DType::F32)?;
            model.set_recompute(true);
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(3e-3, 0.01))?;
            // A tensor made in the model scope while a step runs is now an error, not a leak.
            m.set_strict(true);
            let live = m.stats().live_bytes;
            let mut ws = Workspace::planned("step");
            let mut losses = Vec::new();
            for _ in 0..6 {
                let loss = m.workspace(&mut ws, |b| {
                    let ids = input(b, DIR)?;
                    let tape = Tape::new(b);
                    let loss = Llama::loss(&model.forward(&tape, &ids, Mode::Train)?, &ids)?;
                    opt.step(&mut model, &tape.backward(&loss)?)?;
                    loss.value().to_scalar::<f32>()
                })?;
                losses.push(loss);
            }
            assert!(
                losses.windows(2).all(|w| w[1] < w[0]),
                "AdamW on one batch lowers its loss every step: {losses:?}"
            );
            assert_eq!(m.stats().live_bytes, live, "the model scope did not grow");
            assert_eq!(ws.cycles(), 6);
            assert_eq!(
                ws.replayed_cycles(),
                5,
                "every step after the first replays its plan"
            );
            Ok(())
        })
    })
}

/// The logits of the reference batch, in a scope of their own under `s`.
fn logits<'m: 's, 's>(s: &Scope<'s>, model: &Llama<'m>) -> Result<Vec<f64>> {
    s.scope(|b| {
        let ids = input(b, DIR)?;
        model
            .forward(&Tape::no_grad(b), &ids, Mode::Eval)?
            .value()
            .to_vec_f64()
    })
}

#[test]
fn a_model_returned_to_its_parent_or_moved_out_computes_the_same() -> Result<()> {
    static_assertions::assert_impl_all!(Llama<'static>: Send, Sync);
    static_assertions::assert_impl_all!(AutoModel<'static>: Send, Sync);
    let (want, shared) = root(Device::Cpu, |s| {
        let model = s.scope(|build| build.ret(Llama::from_pretrained(build, DIR, DType::F32)?))?;
        let want = logits(s, &model)?;
        Ok::<_, Error>((want, model.move_out()?))
    })?;
    // `Llama<'static>` outlives the tree it was made in, and threads share it.
    std::thread::scope(|t| {
        let runs: Vec<_> = (0..2)
            .map(|_| t.spawn(|| root(Device::Cpu, |s| logits(s, &shared))))
            .collect();
        for run in runs {
            assert_eq!(run.join().expect("no panic")?, want);
        }
        Ok(())
    })
}

#[test]
fn auto_model_loads_the_architecture_config_json_names() -> Result<()> {
    root(Device::Cpu, |s| {
        for (dir, architecture) in [
            ("data/gpt2-tiny", "gpt2"),
            (DIR, "llama"),
            (MISTRAL, "mistral"),
            ("data/qwen2-tiny", "qwen2"),
        ] {
            let auto = AutoModel::from_pretrained(s, dir, DType::F32)?;
            assert_eq!(auto.architecture(), architecture);
            assert!(auto.describe().contains("layers"), "{}", auto.describe());
            if let AutoModel::Llama(llama) = &auto {
                assert_eq!(auto.end_tokens(), llama.config().eos_token_ids);
                // The same computation as the model itself.
                s.scope(|b| {
                    let ids = input(b, dir)?;
                    let tape = Tape::no_grad(b);
                    let got = auto
                        .forward(&tape, &ids, Mode::Eval)?
                        .value()
                        .to_vec_f64()?;
                    let want = llama
                        .forward(&tape, &ids, Mode::Eval)?
                        .value()
                        .to_vec_f64()?;
                    assert_eq!(got, want, "{dir}");
                    Ok::<_, Error>(())
                })?;
            }
        }
        Ok(())
    })
}

#[test]
fn auto_model_names_what_it_cannot_load() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("ndscope-auto-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.json");
    let result = root(Device::Cpu, |s| {
        for (text, says) in [
            (r#"{"model_type": "bert"}"#, "model_type = \"bert\""),
            (r#"{"vocab_size": 10}"#, "\"model_type\" is missing"),
            ("{", "EOF"),
        ] {
            std::fs::write(&config, text).unwrap();
            let err = AutoModel::from_pretrained(s, &dir, DType::F32).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(says), "{message} should say {says}");
            assert!(message.contains("config.json"), "{message} names the file");
            if says.contains("bert") {
                assert!(matches!(err, Error::UnsupportedConfig { .. }), "{err:?}");
                assert!(
                    message.contains("gpt2, llama, mistral and qwen2"),
                    "{message}"
                );
            }
        }
        std::fs::remove_file(&config).unwrap();
        let err = AutoModel::from_pretrained(s, &dir, DType::F32).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        Ok(())
    });
    std::fs::remove_dir_all(&dir).unwrap();
    result
}
