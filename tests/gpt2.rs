//! GPT-2 against the reference nobody here wrote: `data/gpt2-tiny` is a Hugging Face model directory
//! made by transformers, and `reference.safetensors` holds what transformers computed from it in
//! float64 (logits, loss, every parameter's gradient) and its greedy generations.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ndscope::data::Tokenizer;
use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::nn::{Mode, Parameters, WeightLayout};
use ndscope::weights::Weights;
use ndscope::{DType, Device, Error, Result, Scope, Tape, Tensor, checkpoint, root};

mod common;
use common::reference::{DIR, reference, relative_error};

fn ids<'s>(
    s: &Scope<'s>,
    reference: &BTreeMap<String, (Vec<usize>, Vec<f64>)>,
    name: &str,
) -> Result<Tensor<'s>> {
    let (shape, values) = &reference[name];
    let ids: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    s.from_slice(&ids, shape)
}

/// Logits, loss and every gradient of the model loaded as `dtype`, against transformers' float64.
fn matches_transformers(dtype: DType, logits_tol: f64, grad_tol: f64) {
    let reference = reference();
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, DIR, dtype)?;
        s.scope(|batch| {
            let tape = Tape::new(batch);
            let input = ids(batch, &reference, "input_ids")?;
            let logits = model.forward(&tape, &input, Mode::Train)?;
            assert_eq!(logits.shape(), reference["logits"].0.as_slice());
            let err = relative_error(&logits.value().to_vec_f64()?, &reference["logits"].1);
            assert!(err <= logits_tol, "{dtype} logits: relative error {err:e}");
            eprintln!("{dtype} logits: relative error {err:e}");
            let loss = Gpt2::loss(&logits, &input)?;
            let (got, want) = (loss.value().to_vec_f64()?[0], reference["loss"].1[0]);
            assert!(
                ((got - want) / want).abs() <= logits_tol,
                "{dtype} loss {got} vs {want}"
            );

            let grads = tape.backward(&loss)?;
            let mut checked = 0;
            let mut failure = None;
            let mut worst = 0.0f64;
            model.visit("", &mut |name, p| {
                let (shape, want) = &reference[&format!("grad/{name}")];
                assert_eq!(p.shape(), shape.as_slice(), "{name}");
                let got = grads
                    .get(p)
                    .expect("every parameter gets a gradient")
                    .to_vec_f64()
                    .unwrap();
                let err = relative_error(&got, want);
                worst = worst.max(err);
                if err > grad_tol {
                    failure.get_or_insert(format!(
                        "{dtype} gradient of {name}: relative error {err:e}"
                    ));
                }
                checked += 1;
            });
            assert_eq!(failure, None);
            eprintln!(
                "{dtype} loss: relative error {:e}; gradients: largest relative error {worst:e}",
                ((got - want) / want).abs()
            );
            // Every gradient the reference holds, the tied embedding's included (no lm_head).
            assert_eq!(
                checked,
                reference.keys().filter(|k| k.starts_with("grad/")).count()
            );
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

#[test]
fn f32_logits_loss_and_gradients_match_transformers() {
    matches_transformers(DType::F32, 1e-5, 1e-4);
}

#[test]
fn f64_logits_loss_and_gradients_match_transformers() {
    // The f32 checkpoint widened to f64 on load: the reference's float64 model exactly.
    matches_transformers(DType::F64, 1e-10, 1e-10);
}

#[test]
fn autocast_logits_stay_near_transformers() {
    let reference = reference();
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        for half in [DType::BF16, DType::F16] {
            s.scope(|batch| {
                batch.autocast(half)?;
                let tape = Tape::no_grad(batch);
                let input = ids(batch, &reference, "input_ids")?;
                let logits = model.forward(&tape, &input, Mode::Eval)?;
                let err = relative_error(&logits.value().to_vec_f64()?, &reference["logits"].1);
                // 8 (bf16) or 11 (f16) significant bits through two blocks.
                let tol = if half == DType::BF16 { 0.05 } else { 0.01 };
                assert!(err <= tol, "{half} autocast logits: relative error {err:e}");
                Ok::<_, Error>(())
            })?;
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn greedy_generation_matches_transformers_generate() {
    // transformers generated 24 tokens with the end-of-text token (0) suppressed (its step logits
    // hold -inf there): each step's logits and choice, then `greedy` stopping at that token.
    let reference = reference();
    let as_ids = |name: &str| -> Vec<i64> { reference[name].1.iter().map(|&v| v as i64).collect() };
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        for i in 0..2 {
            let (prompt, want) = (
                as_ids(&format!("prompt{i}_ids")),
                as_ids(&format!("generated{i}_ids")),
            );
            let (steps, vocab) = (want.len() - prompt.len(), 1000);
            let step_logits = &reference[&format!("step_logits{i}")].1;
            for step in 0..steps {
                let window = &want[..prompt.len() + step];
                let logits = s.scope(|batch| {
                    let tape = Tape::no_grad(batch);
                    let ids = batch.from_slice(window, &[1, window.len()])?;
                    let all = model
                        .forward(&tape, &ids, Mode::Eval)?
                        .value()
                        .to_vec_f64()?;
                    Ok::<_, Error>(all[all.len() - vocab..].to_vec())
                })?;
                let theirs = &step_logits[step * vocab..(step + 1) * vocab];
                assert_eq!(theirs[0], f64::NEG_INFINITY);
                let err = relative_error(&logits[1..], &theirs[1..]);
                assert!(
                    err <= 1e-5,
                    "prompt {i} step {step}: relative error {err:e}"
                );
                let chosen = (1..vocab)
                    .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                    .unwrap();
                assert_eq!(
                    chosen as i64,
                    want[prompt.len() + step],
                    "prompt {i} step {step}"
                );
            }
            let greedy = model.greedy(s, &prompt, steps, Some(0))?;
            let stopped = greedy.last() == Some(&0);
            let kept = greedy.len() - usize::from(stopped);
            assert_eq!(greedy[..kept], want[..kept], "prompt {i}");
            assert!(stopped || greedy == want, "prompt {i}: {greedy:?}");
        }
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn the_tokenizer_reproduces_the_prompts_ids_and_texts() {
    let reference = reference();
    let tokenizer = Tokenizer::from_file(format!("{DIR}/tokenizer.json")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/reference.json")).unwrap())
            .unwrap();
    let greedy = json["greedy"].as_object().unwrap();
    assert_eq!(greedy.len(), 2);
    for (prompt, continuation) in greedy {
        let ids = tokenizer.encode(prompt).unwrap();
        let i = (0..2)
            .find(|i| {
                reference[&format!("prompt{i}_ids")]
                    .1
                    .iter()
                    .map(|&v| v as i64)
                    .eq(ids.iter().copied())
            })
            .unwrap_or_else(|| panic!("{prompt:?} tokenizes to {ids:?}, neither reference prompt"));
        let generated: Vec<i64> = reference[&format!("generated{i}_ids")]
            .1
            .iter()
            .map(|&v| v as i64)
            .collect();
        assert_eq!(
            &tokenizer.decode(&generated).unwrap(),
            continuation.as_str().unwrap()
        );
    }
    assert!(matches!(
        tokenizer.decode(&[5000]),
        Err(Error::IndexOutOfRange { index: 5000, .. })
    ));
    assert!(matches!(
        Tokenizer::from_file(format!("{DIR}/config.json")),
        Err(Error::Format { .. })
    ));
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ndscope-gpt2-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A loaded model's dump names each parameter by its checkpoint name and places it at the line
/// that loaded the model, not at the layer code inside the library.
#[test]
fn a_loaded_models_dump_names_parameters_by_path_at_the_load_call() {
    root(Device::Cpu, |s| {
        let line = line!() + 1;
        let model = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        let dump = s.dump();
        let site = format!("created at {}:{line}:", file!());
        // The names in the file (this one has transformers' "transformer." prefix); the dump
        // shows the 16 newest tensors.
        for name in [
            "transformer.ln_f.bias",
            "transformer.h.1.attn.c_attn.weight",
            "transformer.h.1.mlp.c_proj.bias",
        ] {
            let entry = dump
                .lines()
                .find(|l| l.contains(&format!("tensor \"{name}\" ")))
                .unwrap_or_else(|| panic!("no \"{name}\" in the dump:\n{dump}"));
            assert!(entry.contains(&site), "{entry} (wanted {site})");
        }
        assert!(
            !dump.contains("src/nn/"),
            "a tensor placed in the library:\n{dump}"
        );
        drop(model);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// A model loaded from a bf16 config as f32 and saved says `"dtype": "float32"` (transformers
/// loads a model in the dtype its config names; keeping "bfloat16" reloaded it rounded).
#[test]
fn a_saved_config_names_the_dtype_the_weights_are_stored_in() {
    let dir = temp_dir("dtype-source");
    let config = std::fs::read_to_string(format!("{DIR}/config.json")).unwrap();
    let mut raw: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&config).unwrap();
    raw.insert("dtype".into(), "bfloat16".into());
    raw.insert("torch_dtype".into(), "bfloat16".into());
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&raw).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        format!("{DIR}/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let saved = temp_dir("dtype-saved");
    root(Device::Cpu, |s| {
        Gpt2::from_pretrained(s, &dir, DType::F32)?.save_pretrained(&saved)?;
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["dtype"], "float32");
        assert_eq!(written["torch_dtype"], "float32");
        let (stored, _) = Weights::open(&saved)?
            .info("transformer.wte.weight")
            .map(|(d, s)| (d, s.to_vec()))?;
        assert_eq!(stored, DType::F32);
        Ok::<_, Error>(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&saved).ok();
}

/// The logits of a fixed prompt, in evaluation mode.
fn eval_logits<'m>(s: &Scope<'m>, model: &Gpt2<'m>) -> Result<Vec<f64>> {
    s.scope(|b| {
        let ids = b.from_slice(&[3i64, 14, 15, 92], &[1, 4])?;
        let tape = Tape::no_grad(b);
        model.forward(&tape, &ids, Mode::Eval)?.value().to_vec_f64()
    })
}

/// A config that ties the head while the file holds a different `lm_head.weight`: transformers
/// computes with the file's head, and so does ndscope (saying so); an identical copy stays tied.
#[test]
fn a_tied_config_with_a_different_head_in_the_file_uses_the_files_head() {
    let different = altered("head-different", |s, tensors| {
        let wte = tensors
            .iter()
            .find(|(n, _)| n == "transformer.wte.weight")
            .unwrap()
            .1
            .clone();
        tensors.push(("lm_head.weight".into(), wte.mul_scalar(2.0)?));
        let _ = s;
        Ok(())
    });
    let same = altered("head-same", |_, tensors| {
        let wte = tensors
            .iter()
            .find(|(n, _)| n == "transformer.wte.weight")
            .unwrap()
            .1
            .clone();
        tensors.push(("lm_head.weight".into(), wte));
        Ok(())
    });
    root(Device::Cpu, |s| {
        let tied = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        let plain = eval_logits(s, &tied)?;
        let untied = Gpt2::from_pretrained(s, &different, DType::F32)?;
        assert!(
            !untied.config().tie_word_embeddings,
            "the head is the file's, so untied"
        );
        // The head is twice the embedding: every logit doubles.
        for (u, p) in eval_logits(s, &untied)?.iter().zip(&plain) {
            assert!(
                (u - 2.0 * p).abs() <= 1e-5 * (1.0 + p.abs()),
                "{u} vs 2 x {p}"
            );
        }
        let still_tied = Gpt2::from_pretrained(s, &same, DType::F32)?;
        assert!(still_tied.config().tie_word_embeddings);
        assert_eq!(eval_logits(s, &still_tied)?, plain);
        Ok::<_, Error>(())
    })
    .unwrap();
    std::fs::remove_dir_all(&different).ok();
    std::fs::remove_dir_all(&same).ok();
}

#[test]
fn a_saved_model_loads_back_bit_identically_under_hugging_faces_names() {
    let dir = temp_dir("saved");
    let original = Weights::open(format!("{DIR}/model.safetensors")).unwrap();
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        model.save_pretrained(&dir)?;
        let saved = Weights::open(&dir)?;
        // The same names as transformers' save_pretrained wrote (the tied head is not stored).
        assert_eq!(
            saved.names().collect::<Vec<_>>(),
            original.names().collect::<Vec<_>>()
        );
        for name in original.names() {
            let (dtype, shape) = original.info(name)?;
            let a = original.tensor(s, name, shape, dtype)?.to_vec::<f32>()?;
            let b = saved.tensor(s, name, shape, dtype)?.to_vec::<f32>()?;
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}"
            );
        }
        let config = Gpt2Config::from_file(dir.join("config.json"))?;
        assert_eq!(&config, model.config());
        let again = Gpt2::from_pretrained(s, &dir, DType::F32)?;
        assert_eq!(again.parameter_elements(), 172_288);
        Ok::<_, Error>(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_head_watched_through_a_transposed_view_still_trains_the_embedding() {
    // The trap a user hit: the head watched as `tape.param(&wte.t()?)`. Its gradient now goes to the
    // embedding's storage, so `grads.get(&wte)` holds both parts, as transformers computes it.
    let reference = reference();
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, DIR, DType::F64)?;
        s.scope(|batch| {
            let tape = Tape::new(batch);
            let input = ids(batch, &reference, "input_ids")?;
            let wte = &model.wte.weight;
            let mut x = model.wpe.forward(&model.wte.forward(&tape, &input)?)?;
            for block in &model.blocks {
                x = ndscope::nn::Module::forward(block, &x, Mode::Train)?;
            }
            let x =
                ndscope::nn::Module::forward(&model.ln_f, &x, Mode::Train)?.reshape(&[64, 64])?;
            let logits = x.matmul(&tape.param(&wte.t()?))?.reshape(&[2, 32, 1000])?;
            let grads = tape.backward(&Gpt2::loss(&logits, &input)?)?;
            let got = grads.get(wte).unwrap().to_vec_f64()?;
            let err = relative_error(&got, &reference["grad/transformer.wte.weight"].1);
            assert!(
                err <= 1e-10,
                "tied gradient through a view: relative error {err:e}"
            );
            // Asked through the view, the same gradient comes back transposed.
            let through_view = grads.get(&wte.t()?).unwrap();
            assert_eq!(through_view.shape(), &[64, 1000]);
            assert_eq!(through_view.t()?.to_vec_f64()?, got);
            assert_eq!(grads.len(), model.parameter_count());
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

/// A test module of named tensors, to write altered checkpoints.
struct Named<'m>(Vec<(String, Tensor<'m>)>);

impl<'m> Parameters<'m> for Named<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        self.0
            .iter()
            .for_each(|(n, t)| f(&format!("{prefix}{n}"), t));
    }
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        self.0.iter_mut().try_for_each(|(_, t)| f(t))
    }
}

/// A copy of the tiny model's directory whose checkpoint `alter` rewrites.
fn altered(
    tag: &str,
    alter: impl for<'s> FnOnce(&Scope<'s>, &mut Vec<(String, Tensor<'s>)>) -> Result<()>,
) -> PathBuf {
    let dir = temp_dir(tag);
    std::fs::copy(format!("{DIR}/config.json"), dir.join("config.json")).unwrap();
    root(Device::Cpu, |s| {
        let bytes = std::fs::read(format!("{DIR}/model.safetensors")).unwrap();
        let mut tensors = checkpoint::read_bytes(s, &bytes)?;
        alter(s, &mut tensors)?;
        checkpoint::save(&Named(tensors), dir.join("model.safetensors"))
    })
    .unwrap();
    dir
}

fn load_error(dir: &PathBuf) -> Error {
    root(Device::Cpu, |s| {
        Gpt2::from_pretrained(s, dir, DType::F32).map(|_| ())
    })
    .unwrap_err()
}

#[test]
fn a_transposed_tensor_is_a_typed_error_that_says_so() {
    let dir = altered("transposed", |_, tensors| {
        let (_, t) = tensors
            .iter_mut()
            .find(|(n, _)| n == "transformer.h.1.mlp.c_fc.weight")
            .unwrap();
        *t = t.t()?.contiguous()?;
        Ok(())
    });
    let err = load_error(&dir);
    assert!(
        matches!(&err, Error::TensorMismatch { name, expected, found, .. }
            if name == "transformer.h.1.mlp.c_fc.weight" && expected == "f32 [64, 256]" && found == "f32 [256, 64]"),
        "{err}"
    );
    assert!(err.to_string().contains("holds the transpose"), "{err}");
    std::fs::remove_dir_all(&dir).ok();

    // The same weight asked for in PyTorch's layout points at the layout to declare.
    root(Device::Cpu, |s| {
        let weights = Weights::open(DIR)?.prefix("transformer.h.0.mlp.c_fc");
        let err =
            ndscope::nn::Linear::load(s, &weights, 64, 256, true, WeightLayout::OutIn, DType::F32)
                .unwrap_err();
        assert!(
            err.to_string()
                .contains("declare that layout (`WeightLayout`)"),
            "{err}"
        );
        let linear =
            ndscope::nn::Linear::load(s, &weights, 64, 256, true, WeightLayout::InOut, DType::F32)?;
        assert_eq!((linear.in_features(), linear.out_features()), (64, 256));
        let transposed = weights.tensor_transposed(s, "weight", &[256, 64], DType::F32)?;
        assert_eq!(
            transposed.t()?.to_vec::<f32>()?,
            linear.weight.to_vec::<f32>()?
        );
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_misnamed_tensor_is_a_typed_error_with_the_nearest_names() {
    let dir = altered("misnamed", |_, tensors| {
        let (n, _) = tensors
            .iter_mut()
            .find(|(n, _)| n == "transformer.h.0.attn.c_attn.bias")
            .unwrap();
        *n = "transformer.h.0.attn.c_atn.bias".into();
        Ok(())
    });
    let err = load_error(&dir);
    assert!(
        matches!(&err, Error::MissingTensor { name, nearest, held: 28 }
            if name == "transformer.h.0.attn.c_attn.bias" && nearest[0] == "transformer.h.0.attn.c_atn.bias"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_wrong_config_or_a_truncated_checkpoint_is_a_typed_error() {
    let dir = temp_dir("broken");
    std::fs::copy(
        format!("{DIR}/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(format!("{DIR}/config.json")).unwrap();
    // A config whose sizes disagree with the checkpoint: the checkpoint's error names the tensor.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"n_embd\": 64", "\"n_embd\": 32"),
    )
    .unwrap();
    let err = load_error(&dir);
    assert!(
        matches!(&err, Error::TensorMismatch { name, expected, found, .. }
            if name == "transformer.wte.weight" && expected == "f32 [1000, 32]" && found == "f32 [1000, 64]"),
        "{err}"
    );
    // A config that is not GPT-2's, or not JSON.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"gpt2\"", "\"bert\""),
    )
    .unwrap();
    let err = load_error(&dir);
    assert!(
        matches!(&err, Error::UnsupportedConfig { file, key, value, .. }
            if file.ends_with("config.json") && key == "model_type" && value == "\"bert\""),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("unsupported: model_type = \"bert\""),
        "{err}"
    );
    assert!(!err.to_string().contains("truncated"), "{err}");
    // A GPT-2 variant ndscope does not compute names its key, not a broken file.
    std::fs::write(
        dir.join("config.json"),
        config.replace(
            "\"scale_attn_by_inverse_layer_idx\": false",
            "\"scale_attn_by_inverse_layer_idx\": true",
        ),
    )
    .unwrap();
    let err = load_error(&dir);
    assert!(
        err.to_string()
            .contains("unsupported: scale_attn_by_inverse_layer_idx = true; attention scaled by the layer index"),
        "{err}"
    );
    std::fs::write(dir.join("config.json"), &config[..100]).unwrap();
    let err = load_error(&dir);
    assert!(
        matches!(&err, Error::Format { format: "config.json", reason } if reason.contains("config.json")),
        "{err}"
    );
    // A checkpoint cut short.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let bytes = std::fs::read(format!("{DIR}/model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() - 1000]).unwrap();
    assert!(matches!(
        load_error(&dir),
        Error::Format {
            format: "safetensors",
            ..
        }
    ));
    // No checkpoint at all.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(load_error(&dir), Error::Io { .. }));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_sharded_checkpoint_loads_through_its_index() {
    let dir = temp_dir("sharded");
    std::fs::copy(format!("{DIR}/config.json"), dir.join("config.json")).unwrap();
    root(Device::Cpu, |s| {
        let bytes = std::fs::read(format!("{DIR}/model.safetensors"))?;
        let tensors = checkpoint::read_bytes(s, &bytes)?;
        let (first, second): (Vec<_>, Vec<_>) = tensors
            .into_iter()
            .partition(|(n, _)| n.contains(".h.0.") || n.contains("wte"));
        let mut map = serde_json::Map::new();
        for (file, part) in [
            ("model-00001-of-00002.safetensors", first),
            ("model-00002-of-00002.safetensors", second),
        ] {
            part.iter()
                .for_each(|(n, _)| drop(map.insert(n.clone(), file.into())));
            checkpoint::save(&Named(part), dir.join(file))?;
        }
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;
        let sharded = Gpt2::from_pretrained(s, &dir, DType::F32)?;
        let single = Gpt2::from_pretrained(s, DIR, DType::F32)?;
        let mut same = true;
        let mut mine = Vec::new();
        sharded.visit("", &mut |_, t| mine.push(t.to_vec::<f32>().unwrap()));
        let mut i = 0;
        single.visit("", &mut |_, t| {
            same &= t.to_vec::<f32>().unwrap() == mine[i];
            i += 1;
        });
        assert!(same);
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}
