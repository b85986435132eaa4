//! A GGUF file's embedded tokenizer (`tokenizer.ggml.*`) as the `tokenizer.json` Hugging Face's
//! `tokenizers` reads, so one implementation tokenizes both kinds of checkpoint.
//!
//! GGUF keeps a byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`, which Llama 3, Qwen2,
//! SmolLM and GPT-2 use) as its tokens, their types (3 = control, 4 = user-defined: the special
//! tokens, matched before BPE), its merges, and the name of its pre-tokenizer
//! (`tokenizer.ggml.pre`), whose splitting regex llama.cpp knows by name. The pre-tokenizers written
//! here are those names' regexes as llama.cpp's `llama-vocab.cpp` and the models' own
//! `tokenizer.json`s state them; another name is an error naming it, never a tokenizer that splits
//! text differently.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::gguf;

/// Llama 3's split.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with single digits.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn unsupported(key: &str, value: &str, reason: &str) -> Error {
    Error::UnsupportedConfig {
        file: "GGUF metadata".into(),
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

fn missing(key: &str) -> Error {
    Error::Format {
        format: "GGUF",
        reason: format!("the tokenizer metadata lacks \"{key}\" (or it has the wrong type)"),
    }
}

/// The `tokenizer.json` text of the tokenizer `metadata` describes.
pub(crate) fn tokenizer_json(metadata: &BTreeMap<String, gguf::Value>) -> Result<String> {
    let get = |key: &str| metadata.get(key);
    let model = get("tokenizer.ggml.model")
        .and_then(gguf::Value::as_str)
        .ok_or_else(|| missing("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(unsupported(
            "tokenizer.ggml.model",
            model,
            "ndscope reads GGUF's byte-level BPE tokenizers (\"gpt2\": Llama 3, Qwen2, GPT-2); \
             for a SentencePiece model (\"llama\"), use the Hugging Face directory's \
             tokenizer.json",
        ));
    }
    let pre = get("tokenizer.ggml.pre")
        .and_then(gguf::Value::as_str)
        .unwrap_or("default");
    // `None`: GPT-2's split, which `tokenizers`' `ByteLevel` applies itself (`use_regex`).
    let split = match pre {
        "default" | "gpt-2" | "gpt2" => None,
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => Some(LLAMA3),
        "qwen2" | "deepseek-r1-qwen" => Some(QWEN2),
        other => {
            return Err(unsupported(
                "tokenizer.ggml.pre",
                other,
                "ndscope knows the pre-tokenizers gpt-2, llama-bpe and qwen2; use the Hugging Face \
                 directory's tokenizer.json for this model",
            ));
        }
    };
    let strings = |key: &str| -> Result<Vec<&str>> {
        get(key)
            .and_then(gguf::Value::as_array)
            .ok_or_else(|| missing(key))?
            .iter()
            .map(|v| v.as_str().ok_or_else(|| missing(key)))
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match get("tokenizer.ggml.token_type").and_then(gguf::Value::as_array) {
        Some(t) => t.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.to_string(), json!(id)))
        .collect();
    // Control (3) and user-defined (4) tokens are matched whole before the model splits text.
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(**ty, 3 | 4))
        .map(|(id, (t, ty))| {
            json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": *ty == 3,
            })
        })
        .collect();
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let pre_tokenizer = match split {
        None => byte_level(true),
        Some(pattern) => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ],
        }),
    };
    let id = |key: &str| get(key).and_then(gguf::Value::as_i64);
    let add_bos = matches!(
        get("tokenizer.ggml.add_bos_token"),
        Some(gguf::Value::Bool(true))
    );
    let post_processor = match id("tokenizer.ggml.bos_token_id") {
        Some(bos) if add_bos => {
            let bos_text = tokens
                .get(usize::try_from(bos).unwrap_or(usize::MAX))
                .ok_or_else(|| missing("tokenizer.ggml.bos_token_id"))?;
            let special = json!({"SpecialToken": {"id": bos_text, "type_id": 0}});
            json!({
                "type": "TemplateProcessing",
                "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                         special, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {*bos_text: {"id": bos_text, "ids": [bos], "tokens": [bos_text]}},
            })
        }
        _ => Value::Null,
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            // Llama 3's tokenizer takes a whole word found in the vocabulary before merging.
            "ignore_merges": split == Some(LLAMA3),
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}
