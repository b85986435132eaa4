//! Models from GGUF files: the `llama`, `qwen2` and `gpt2` architectures' metadata as the configs
//! their Hugging Face directories would hold, and GGUF's tensor names and layouts mapped back to
//! transformers' — so a GGUF file loads through the same `Llama::load` and `Gpt2::load` as a
//! directory does, and computes the same model.
//!
//! What llama.cpp's converter changes, undone here:
//! - **names**: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight`, …;
//! - **Llama's Q and K rows**: the converter reorders each head's rows from transformers' rotary
//!   layout (the first half of a head's dimensions paired with the second) to ggml's (adjacent
//!   pairs), `LlamaModel.permute`; loading puts them back (Qwen2 is stored unpermuted);
//! - **GPT-2's matrices**: stored `[out, in]` where transformers' `Conv1D` keeps `[in, out]`;
//! - **Llama 3's RoPE scaling**: stored as per-dimension divisors (`rope_freqs.weight`) instead of
//!   `rope_parameters`; read back as the `llama3` scaling whose divisors they are (see
//!   [`llama3_from_factors`]);
//! - **end tokens**: GGUF names one eos (and maybe an eot); like llama.cpp, the control tokens that
//!   end a turn (`<|eot_id|>`, `<|im_end|>`, …) end generation too.
//!
//! A metadata key whose value the models do not compute (a mixture of experts, partial rotary
//! dimensions, another RoPE scaling) is an [`Error::UnsupportedConfig`] naming it.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::gguf;
use crate::models::{Gpt2Config, LlamaConfig};
use crate::weights::{Adapt, Weights};

type Metadata = BTreeMap<String, gguf::Value>;

/// Control tokens llama.cpp treats as ending generation besides the eos (`llama-vocab.cpp`).
const END_OF_TURN: [&str; 8] = [
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
];

fn unsupported(key: &str, value: impl std::fmt::Display, reason: &str) -> Error {
    Error::UnsupportedConfig {
        file: "GGUF metadata".into(),
        key: key.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn missing(key: &str) -> Error {
    Error::Format {
        format: "GGUF",
        reason: format!("the metadata lacks \"{key}\" (or it is not a number)"),
    }
}

/// The metadata of a GGUF checkpoint, or the error a non-GGUF one gets.
pub(crate) fn metadata(weights: &Weights) -> Result<&Metadata> {
    weights.gguf_metadata().ok_or_else(|| Error::Format {
        format: "GGUF",
        reason: format!(
            "{} is not a GGUF file (it does not start with the magic \"GGUF\")",
            weights
                .files()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// The file's `general.architecture`.
pub(crate) fn architecture(metadata: &Metadata) -> Result<&str> {
    metadata
        .get("general.architecture")
        .and_then(gguf::Value::as_str)
        .ok_or_else(|| Error::Format {
            format: "GGUF",
            reason: "the metadata lacks \"general.architecture\"".into(),
        })
}

/// A metadata number as JSON; an `f32` as the shortest decimal that rounds to it (the value the
/// converter was given: `1e-5`, not `9.99999974e-6`).
fn number(value: &gguf::Value) -> Option<Value> {
    match *value {
        gguf::Value::F32(v) => format!("{v}").parse::<f64>().ok().map(Value::from),
        gguf::Value::F64(v) => Some(Value::from(v)),
        _ => value.as_i64().map(Value::from),
    }
}

/// Reads `{arch}.…` keys.
struct Keys<'a> {
    metadata: &'a Metadata,
    arch: &'a str,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&gguf::Value> {
        self.metadata.get(&format!("{}.{key}", self.arch))
    }

    fn number(&self, key: &str) -> Result<Value> {
        self.get(key)
            .and_then(number)
            .ok_or_else(|| missing(&format!("{}.{key}", self.arch)))
    }

    fn number_or(&self, key: &str, default: Value) -> Result<Value> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.number(key),
        }
    }

    fn size(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(gguf::Value::as_i64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| missing(&format!("{}.{key}", self.arch)))
    }

    /// Refuses keys that would make another model than the one loaded.
    fn refuse_unknown_structure(&self) -> Result<()> {
        if let Some(n) = self.get("expert_count").and_then(gguf::Value::as_i64)
            && n > 0
        {
            return Err(unsupported(
                &format!("{}.expert_count", self.arch),
                n,
                "mixture-of-experts models are not computed by ndscope",
            ));
        }
        Ok(())
    }
}

/// The token ids that end generation: the eos, eot and eom ids, and the control tokens that end
/// a turn.
fn end_tokens(metadata: &Metadata) -> Vec<i64> {
    let mut ids: Vec<i64> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| metadata.get(*k).and_then(gguf::Value::as_i64))
    .collect();
    let tokens = metadata
        .get("tokenizer.ggml.tokens")
        .and_then(gguf::Value::as_array);
    let types = metadata
        .get("tokenizer.ggml.token_type")
        .and_then(gguf::Value::as_array);
    if let (Some(tokens), Some(types)) = (tokens, types) {
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            let control = matches!(ty.as_i64(), Some(3 | 4));
            if control && t.as_str().is_some_and(|t| END_OF_TURN.contains(&t)) {
                ids.push(id as i64);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The Llama 3 scaling whose per-dimension divisors are `factors` (`rope_freqs.weight`, as
/// llama.cpp's converter computes them from `rope_parameters`), if there is one with Llama 3's
/// published `low_freq_factor` 1 and `high_freq_factor` 4: `factor` is the largest divisor and the
/// original context follows from a divisor between 1 and `factor` (or is Llama 3.1's 8,192 when
/// none lies between). Returned only when recomputing every divisor from it gives the stored ones
/// (to `f32` rounding): the frequencies are then exactly the file's.
pub(crate) fn llama3_from_factors(factors: &[f64], theta: f64, head_dim: usize) -> Option<Value> {
    let (low, high) = (1.0, 4.0);
    let factor = factors.iter().copied().fold(1.0f64, f64::max);
    // The converter's frequencies: f32 powers, as torch computes them.
    let frequency = |i: usize| {
        let exponent = (2 * i) as f32 / head_dim as f32;
        f64::from(1.0f32 / (theta as f32).powf(exponent))
    };
    let wavelength = |i: usize| 2.0 * std::f64::consts::PI / frequency(i);
    let divisors = |original: f64| -> Vec<f64> {
        (0..factors.len())
            .map(|i| {
                let w = wavelength(i);
                if w < original / high {
                    1.0
                } else if w > original / low {
                    factor
                } else {
                    let smooth = (original / w - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect()
    };
    let original = factors
        .iter()
        .enumerate()
        .find(|(_, f)| **f > 1.0 && **f < factor)
        .map(|(i, f)| {
            let smooth = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor);
            (wavelength(i) * (smooth * (high - low) + low)).round()
        })
        .unwrap_or(8192.0);
    let same = divisors(original)
        .iter()
        .zip(factors)
        .all(|(a, b)| (a - b).abs() <= 1e-6 * b.abs());
    (factor > 1.0 && same).then(|| {
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original as u64,
            "rope_theta": theta,
        })
    })
}

/// RoPE's parameters (`rope_parameters`) from the metadata and `rope_freqs.weight`.
fn rope_parameters(k: &Keys<'_>, weights: &Weights, head_dim: usize) -> Result<Value> {
    let theta = k.number_or("rope.freq_base", json!(10_000.0))?;
    let theta_f = theta.as_f64().unwrap_or(10_000.0);
    let scaling = k
        .get("rope.scaling.type")
        .and_then(gguf::Value::as_str)
        .unwrap_or("none");
    let key = |s: &str| format!("{}.{s}", k.arch);
    let mut params = match scaling {
        "none" => json!({"rope_type": "default"}),
        "linear" => json!({"rope_type": "linear", "factor": k.number("rope.scaling.factor")?}),
        "yarn" => {
            let mut p = json!({
                "rope_type": "yarn",
                "factor": k.number("rope.scaling.factor")?,
                "original_max_position_embeddings": k.number("rope.scaling.original_context_length")?,
            });
            for (ours, theirs) in [
                ("attention_factor", "rope.scaling.attn_factor"),
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                if k.get(theirs).is_some() {
                    p[ours] = k.number(theirs)?;
                }
            }
            p
        }
        other => {
            return Err(unsupported(
                &key("rope.scaling.type"),
                other,
                "ndscope computes the none, linear and yarn scalings (and Llama 3's, from \
                 rope_freqs.weight)",
            ));
        }
    };
    if weights.contains("rope_freqs.weight") {
        let factors = weights.values_f64("rope_freqs.weight")?;
        params = llama3_from_factors(&factors, theta_f, head_dim).ok_or_else(|| {
            unsupported(
                "rope_freqs.weight",
                format!("{factors:?}"),
                "per-dimension RoPE divisors that are not Llama 3's scaling (low_freq_factor 1, \
                 high_freq_factor 4); ndscope computes that one",
            )
        })?;
    }
    params["rope_theta"] = theta;
    Ok(params)
}

/// The Llama-family config (`llama`: Llama 2/3, Mistral, SmolLM, TinyLlama; `qwen2`) of a GGUF
/// file, as its `config.json` would state it.
pub(crate) fn llama_config(weights: &Weights) -> Result<LlamaConfig> {
    let metadata = metadata(weights)?;
    let arch = architecture(metadata)?;
    if !matches!(arch, "llama" | "qwen2") {
        return Err(unsupported(
            "general.architecture",
            arch,
            "the Llama loader reads the llama and qwen2 architectures",
        ));
    }
    let k = Keys { metadata, arch };
    k.refuse_unknown_structure()?;
    let hidden = k.size("embedding_length")?;
    let heads = k.size("attention.head_count")?;
    let head_dim = match k.get("attention.key_length") {
        Some(_) => k.size("attention.key_length")?,
        None => hidden / heads.max(1),
    };
    for key in ["attention.value_length", "rope.dimension_count"] {
        if let Some(v) = k.get(key)
            && v.as_i64() != Some(head_dim as i64)
        {
            return Err(unsupported(
                &format!("{arch}.{key}"),
                v,
                &format!("ndscope's Llama rotates and attends over whole heads of {head_dim}"),
            ));
        }
    }
    let vocab = weights.info("token_embd.weight")?.1[0];
    let mut raw = Map::new();
    raw.insert("model_type".into(), json!(arch));
    raw.insert("vocab_size".into(), json!(vocab));
    raw.insert("hidden_size".into(), json!(hidden));
    raw.insert(
        "intermediate_size".into(),
        json!(k.size("feed_forward_length")?),
    );
    raw.insert("num_hidden_layers".into(), json!(k.size("block_count")?));
    raw.insert("num_attention_heads".into(), json!(heads));
    raw.insert(
        "num_key_value_heads".into(),
        json!(match k.get("attention.head_count_kv") {
            Some(_) => k.size("attention.head_count_kv")?,
            None => heads,
        }),
    );
    raw.insert("head_dim".into(), json!(head_dim));
    raw.insert(
        "max_position_embeddings".into(),
        json!(k.size("context_length")?),
    );
    raw.insert(
        "rms_norm_eps".into(),
        k.number("attention.layer_norm_rms_epsilon")?,
    );
    raw.insert(
        "rope_parameters".into(),
        rope_parameters(&k, weights, head_dim)?,
    );
    raw.insert(
        "attention_bias".into(),
        json!(weights.contains("blk.0.attn_q.bias")),
    );
    if let Some(window) = k.get("attention.sliding_window") {
        raw.insert(
            "sliding_window".into(),
            number(window).unwrap_or(Value::Null),
        );
        raw.insert("use_sliding_window".into(), json!(true));
    }
    raw.insert(
        "tie_word_embeddings".into(),
        json!(!weights.contains("output.weight")),
    );
    raw.insert(
        "bos_token_id".into(),
        json!(
            metadata
                .get("tokenizer.ggml.bos_token_id")
                .and_then(gguf::Value::as_i64)
        ),
    );
    raw.insert("eos_token_id".into(), json!(end_tokens(metadata)));
    LlamaConfig::from_json(&Value::Object(raw).to_string())
}

/// The GGUF name of a transformers parameter: a block's (`{layers}N.{theirs}…`) as
/// `blk.N.{ours}…` through `block`, any other through `top`, and a name neither maps unchanged.
fn gguf_name(name: &str, layers: &str, block: &[(&str, &str)], top: &[(&str, &str)]) -> String {
    if let Some((i, rest)) = name.strip_prefix(layers).and_then(|r| r.split_once('.')) {
        for (theirs, ours) in block {
            if let Some(suffix) = rest.strip_prefix(theirs) {
                return format!("blk.{i}.{ours}{suffix}");
            }
        }
    }
    top.iter()
        .find(|(theirs, _)| *theirs == name)
        .map_or_else(|| name.to_string(), |(_, ours)| ours.to_string())
}

/// The GGUF name of a transformers Llama parameter.
fn llama_name(name: &str) -> String {
    const BLOCK: [(&str, &str); 9] = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    const TOP: [(&str, &str); 3] = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    gguf_name(name, "model.layers.", &BLOCK, &TOP)
}

/// The stored row of each row of a Q or K projection in transformers' order: within a head of
/// `head_dim` rows, transformers' row `p·(d/2) + j` is the converter's `2j + p`.
fn unpermuted_rows(rows: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..rows)
        .map(|r| {
            let (head, within) = (r / head_dim, r % head_dim);
            let (p, j) = (within / half, within % half);
            head * head_dim + 2 * j + p
        })
        .collect()
}

/// `weights` (a GGUF file) under transformers' Llama names, Q and K rows in transformers' order.
pub(crate) fn llama_weights(weights: &Weights, config: &LlamaConfig) -> Weights {
    let head_dim = config.head_dim;
    // Qwen2's converter stores Q and K as transformers does (ggml's NEOX rotation).
    let permuted = config.model_type != "qwen2";
    weights
        .adapted(move |name, shape| {
            let projection = name.contains(".attn_q.") || name.contains(".attn_k.");
            (permuted && projection && name.starts_with("blk."))
                .then(|| Adapt::Rows(unpermuted_rows(shape[0], head_dim)))
        })
        .renamed(llama_name)
}

/// The GPT-2 config of a GGUF file of architecture `gpt2`.
pub(crate) fn gpt2_config(weights: &Weights) -> Result<Gpt2Config> {
    let metadata = metadata(weights)?;
    let arch = architecture(metadata)?;
    if arch != "gpt2" {
        return Err(unsupported(
            "general.architecture",
            arch,
            "the GPT-2 loader reads the gpt2 architecture",
        ));
    }
    let k = Keys { metadata, arch };
    k.refuse_unknown_structure()?;
    let raw = json!({
        "model_type": "gpt2",
        "vocab_size": weights.info("token_embd.weight")?.1[0],
        "n_positions": k.size("context_length")?,
        "n_ctx": k.size("context_length")?,
        "n_embd": k.size("embedding_length")?,
        "n_layer": k.size("block_count")?,
        "n_head": k.size("attention.head_count")?,
        "n_inner": k.size("feed_forward_length")?,
        "layer_norm_epsilon": k.number("attention.layer_norm_epsilon")?,
        // llama.cpp computes GPT-2's GELU in its tanh form, as transformers' gelu_new.
        "activation_function": "gelu_new",
        "tie_word_embeddings": !weights.contains("output.weight"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id").and_then(gguf::Value::as_i64),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id").and_then(gguf::Value::as_i64),
    });
    Gpt2Config::from_json(&raw.to_string())
}

/// The GGUF name of a transformers GPT-2 parameter.
fn gpt2_name(name: &str) -> String {
    const BLOCK: [(&str, &str); 6] = [
        ("ln_1", "attn_norm"),
        ("attn.c_attn", "attn_qkv"),
        ("attn.c_proj", "attn_output"),
        ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"),
        ("mlp.c_proj", "ffn_down"),
    ];
    const TOP: [(&str, &str); 5] = [
        ("transformer.wte.weight", "token_embd.weight"),
        ("transformer.wpe.weight", "position_embd.weight"),
        ("transformer.ln_f.weight", "output_norm.weight"),
        ("transformer.ln_f.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
    ];
    gguf_name(name, "transformer.h.", &BLOCK, &TOP)
}

/// `weights` (a GGUF file) under transformers' GPT-2 names, its block matrices transposed back
/// to `Conv1D`'s `[in, out]`.
pub(crate) fn gpt2_weights(weights: &Weights) -> Weights {
    weights
        .adapted(|name, shape| {
            (name.starts_with("blk.") && name.ends_with(".weight") && shape.len() == 2)
                .then_some(Adapt::Transpose)
        })
        .renamed(gpt2_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_permuted_by_the_converter_come_back_in_transformers_order() {
        // The converter: w.reshape(heads, 2, d/2, ...).swapaxes(1, 2): stored row h·d + 2j + p
        // holds transformers' row h·d + p·d/2 + j.
        let (heads, d) = (2, 4);
        let hf: Vec<usize> = (0..heads * d).collect();
        let stored: Vec<usize> = (0..heads * d)
            .map(|s| {
                let (h, w) = (s / d, s % d);
                hf[h * d + (w % 2) * (d / 2) + w / 2]
            })
            .collect();
        let order = unpermuted_rows(heads * d, d);
        let back: Vec<usize> = order.iter().map(|&r| stored[r]).collect();
        assert_eq!(back, hf);
    }

    #[test]
    fn llama3_divisors_give_back_their_parameters() {
        // Llama 3.2's: factor 32, low 1, high 4, original context 8192, theta 500000, d 64.
        let theta = 500_000.0;
        let d = 64;
        let (factor, low, high, original) = (32.0, 1.0, 4.0, 8192.0);
        let factors: Vec<f64> = (0..d / 2)
            .map(|i| {
                let f = f64::from(1.0f32 / (theta as f32).powf((2 * i) as f32 / d as f32));
                let w = 2.0 * std::f64::consts::PI / f;
                let r = if w < original / high {
                    1.0
                } else if w > original / low {
                    factor
                } else {
                    let s = (original / w - low) / (high - low);
                    1.0 / ((1.0 - s) / factor + s)
                };
                f64::from(r as f32)
            })
            .collect();
        let p = llama3_from_factors(&factors, theta, d).unwrap();
        assert_eq!(p["original_max_position_embeddings"], 8192);
        assert_eq!(p["factor"], 32.0);
        let mut other = factors.clone();
        other[d / 4] *= 1.01;
        assert!(llama3_from_factors(&other, theta, d).is_none());
    }

    #[test]
    fn names_map_to_gguf_and_back_to_nothing_else() {
        assert_eq!(
            llama_name("model.layers.11.self_attn.k_proj.weight"),
            "blk.11.attn_k.weight"
        );
        assert_eq!(
            llama_name("model.layers.0.post_attention_layernorm.weight"),
            "blk.0.ffn_norm.weight"
        );
        assert_eq!(llama_name("lm_head.weight"), "output.weight");
        assert_eq!(
            gpt2_name("transformer.h.3.mlp.c_proj.bias"),
            "blk.3.ffn_down.bias"
        );
        assert_eq!(gpt2_name("transformer.wpe.weight"), "position_embd.weight");
    }
}
