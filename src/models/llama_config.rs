//! The configuration of the Llama family's checkpoints (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`): what a loader needs from `config.json`, read from both forms published
//! checkpoints use, and every key whose value ndscope does not compute refused by name.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::{config_error, read_config, torch_dtype_name, unsupported};
use crate::dtype::DType;
use crate::error::Result;
use crate::nn::RopeScaling;

/// The `model_type`s `LlamaConfig` reads (and `AutoModel` loads as a `Llama`).
pub(super) const LLAMA_MODEL_TYPES: [&str; 3] = ["llama", "mistral", "qwen2"];

/// A Llama-family model's hyper-parameters, as `config.json` names them.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `"llama"`, `"mistral"` or `"qwen2"` (`model_type`).
    pub model_type: String,
    /// Tokens in the vocabulary (`vocab_size`).
    pub vocab_size: usize,
    /// The model width (`hidden_size`).
    pub hidden_size: usize,
    /// The SwiGLU MLP's inner width (`intermediate_size`).
    pub intermediate_size: usize,
    /// Transformer blocks (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key and value heads (`num_key_value_heads`; the query heads when absent): fewer is
    /// grouped-query attention.
    pub num_key_value_heads: usize,
    /// Each head's width (`head_dim`; `hidden_size / num_attention_heads` when absent).
    pub head_dim: usize,
    /// The longest sequence (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// What RMSNorm adds to the mean square (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// RoPE's base (`rope_theta`, in `rope_parameters` or at the top level).
    pub rope_theta: f64,
    /// RoPE's frequency scaling (`rope_parameters` or `rope_scaling`).
    pub rope_scaling: RopeScaling,
    /// Whether q, k and v projections have biases (`attention_bias`; always for Qwen2).
    pub attention_bias: bool,
    /// Keys beyond this many positions back are not attended (Mistral's `sliding_window`, Qwen2's
    /// with `use_sliding_window`); `None`: every earlier position.
    pub sliding_window: Option<usize>,
    /// Whether the output head is the token embedding (`tie_word_embeddings`; false when absent).
    pub tie_word_embeddings: bool,
    /// The token a sequence starts with (`bos_token_id`), if any.
    pub bos_token_id: Option<i64>,
    /// The tokens that end generation (`eos_token_id`, one or a list).
    pub eos_token_ids: Vec<i64>,
}

/// A key whose value this implementation does not compute.
/// The fields of one JSON object, read with typed errors naming the key.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn size(&self, key: &str) -> Result<usize> {
        self.size_or(key, None)
    }

    fn size_or(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match (self.get(key), default) {
            (None, Some(d)) => Ok(d),
            (v, _) => v
                .and_then(Value::as_u64)
                .and_then(|v| usize::try_from(v).ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| {
                    config_error(format!("\"{key}\" must be a positive integer, found {v:?}"))
                }),
        }
    }

    fn number_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                config_error(format!("\"{key}\" must be a finite number, found {v}"))
            }),
        }
    }

    fn flag_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| config_error(format!("\"{key}\" must be true or false, found {v}"))),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        config_error(format!("\"{key}\" must hold token ids, found {v}"))
                    })
                })
                .collect(),
            Some(v) => v.as_i64().map(|id| vec![id]).ok_or_else(|| {
                config_error(format!("\"{key}\" must be a token id or a list, found {v}"))
            }),
        }
    }
}

impl LlamaConfig {
    /// Reads a `config.json` of `model_type` `llama`, `mistral` or `qwen2`. RoPE settings are read
    /// from transformers 5's `rope_parameters` or from the top-level `rope_theta` and
    /// `rope_scaling` of checkpoints published earlier.
    ///
    /// ```
    /// let config = ndscope::models::LlamaConfig::from_file("data/llama-tiny/config.json")?;
    /// assert_eq!((config.num_attention_heads, config.num_key_value_heads), (4, 2));
    /// assert_eq!(config.eos_token_ids, vec![1, 4]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Format`](crate::Error::Format) for text that is not JSON or a missing or mistyped field;
    /// [`Error::UnsupportedConfig`](crate::Error::UnsupportedConfig) naming the key for what ndscope does not compute: another
    /// model type, an activation other than `silu`, `rope_type`s other than `default`, `linear`,
    /// `llama3` and `yarn`, `pretraining_tp` above 1, MLP biases, partial rotary dimensions, a sliding
    /// window on some layers only (Qwen2's `max_window_layers` below the layer count, a
    /// `layer_types` list mixing `sliding_attention` and `full_attention`).
    pub fn from_json(text: &str) -> Result<LlamaConfig> {
        let raw: Map<String, Value> =
            serde_json::from_str(text).map_err(|e| config_error(e.to_string()))?;
        let f = Fields(&raw);
        let model_type = match f.get("model_type") {
            Some(Value::String(t)) if LLAMA_MODEL_TYPES.contains(&t.as_str()) => t.clone(),
            Some(other) => {
                return Err(unsupported(
                    "model_type",
                    other,
                    "this reads the Llama family: llama, mistral and qwen2",
                ));
            }
            None => return Err(config_error("\"model_type\" is missing")),
        };
        if let Some(act) = f.get("hidden_act").filter(|a| a.as_str() != Some("silu")) {
            return Err(unsupported(
                "hidden_act",
                act,
                "the Llama family's MLP is SwiGLU, with silu",
            ));
        }
        if let Some(tp) = f.get("pretraining_tp").filter(|v| v.as_u64() != Some(1)) {
            return Err(unsupported(
                "pretraining_tp",
                tp,
                "only 1 (the plain projections) is computed",
            ));
        }
        if f.flag_or("mlp_bias", false)? {
            return Err(unsupported(
                "mlp_bias",
                &Value::from(true),
                "the MLP's projections have no biases here",
            ));
        }
        let hidden_size = f.size("hidden_size")?;
        let num_attention_heads = f.size("num_attention_heads")?;
        let num_key_value_heads = f.size_or("num_key_value_heads", Some(num_attention_heads))?;
        if !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(config_error(format!(
                "\"num_attention_heads\" ({num_attention_heads}) must be a multiple of \
                 \"num_key_value_heads\" ({num_key_value_heads})"
            )));
        }
        let head_dim = match f.get("head_dim") {
            Some(_) => f.size("head_dim")?,
            None if hidden_size.is_multiple_of(num_attention_heads) => {
                hidden_size / num_attention_heads
            }
            None => {
                return Err(config_error(format!(
                    "\"hidden_size\" ({hidden_size}) is not a multiple of \"num_attention_heads\" \
                     ({num_attention_heads}) and no \"head_dim\" is given"
                )));
            }
        };
        if !head_dim.is_multiple_of(2) {
            return Err(config_error(format!(
                "\"head_dim\" ({head_dim}) must be even for RoPE"
            )));
        }
        let (rope_theta, rope_scaling) = rope(&raw)?;
        let layers = f.size("num_hidden_layers")?;
        let mut sliding_window = match model_type.as_str() {
            "qwen2" if !f.flag_or("use_sliding_window", false)? => None,
            _ => match f.get("sliding_window") {
                None => None,
                Some(_) => Some(f.size("sliding_window")?),
            },
        };
        // Qwen2 windows only the layers from `max_window_layers` on; ndscope windows all or none.
        if model_type == "qwen2" && sliding_window.is_some() {
            // transformers' default is 28.
            let from = match f.get("max_window_layers") {
                None => 28,
                Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    config_error(format!(
                        "\"max_window_layers\" must be a whole number, found {v}"
                    ))
                })?,
            };
            if from >= layers {
                sliding_window = None;
            } else if from > 0 {
                return Err(unsupported(
                    "max_window_layers",
                    &Value::from(from),
                    "a sliding window on some layers only is not computed; every layer or none",
                ));
            }
        }
        // transformers 5 lists each layer's kind; a mix is a window on some layers only.
        if let Some(Value::Array(kinds)) = f.get("layer_types") {
            let windowed = kinds
                .iter()
                .filter(|k| k.as_str() == Some("sliding_attention"))
                .count();
            if windowed != 0 && windowed != kinds.len() {
                return Err(unsupported(
                    "layer_types",
                    &Value::Array(kinds.clone()),
                    "a sliding window on some layers only is not computed; every layer or none",
                ));
            }
            if windowed == 0 && model_type == "qwen2" {
                sliding_window = None;
            }
        }
        Ok(LlamaConfig {
            vocab_size: f.size("vocab_size")?,
            hidden_size,
            intermediate_size: f.size("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: f.size("max_position_embeddings")?,
            rms_norm_eps: f.number_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            attention_bias: model_type == "qwen2" || f.flag_or("attention_bias", false)?,
            sliding_window,
            tie_word_embeddings: f.flag_or("tie_word_embeddings", false)?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            model_type,
        })
    }

    /// The configuration as a `config.json` transformers reads: the keys [`from_json`](Self::from_json)
    /// reads, `architectures` from `model_type`, and RoPE in both forms (transformers 5's
    /// `rope_parameters`, and the top-level `rope_theta` and `rope_scaling` that earlier versions
    /// and other tools read). Keys a loaded file had that change nothing computed (`use_cache`,
    /// `initializer_range`, ...) are not kept.
    ///
    /// ```
    /// use ndscope::models::LlamaConfig;
    ///
    /// let config = LlamaConfig::from_file("data/llama-tiny/config.json")?;
    /// assert_eq!(LlamaConfig::from_json(&config.to_json())?, config);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn to_json(&self) -> String {
        let architecture = match self.model_type.as_str() {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut scaling = match &self.rope_scaling {
            RopeScaling::None => json!({ "rope_type": "default" }),
            RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": factor }),
            RopeScaling::Dynamic { factor, .. } => {
                json!({ "rope_type": "dynamic", "factor": factor })
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_positions,
            }),
            RopeScaling::Yarn {
                factor,
                original_max_positions,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_max_positions,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "truncate": truncate,
                "attention_factor": attention_factor,
            }),
        };
        let legacy_scaling = match self.rope_scaling {
            RopeScaling::None => Value::Null,
            _ => scaling.clone(),
        };
        scaling["rope_theta"] = json!(self.rope_theta);
        let eos = match self.eos_token_ids.as_slice() {
            [one] => json!(one),
            many => json!(many),
        };
        let mut config = json!({
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "mlp_bias": false,
            "rope_parameters": scaling,
            "rope_theta": self.rope_theta,
            "rope_scaling": legacy_scaling,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        });
        if self.model_type == "qwen2" {
            config["use_sliding_window"] = json!(self.sliding_window.is_some());
        }
        serde_json::to_string_pretty(&config).expect("a JSON value always serialises")
    }

    /// [`to_json`](Self::to_json) with `dtype` (and the older `torch_dtype`) naming `stored`, the
    /// dtype the weights are written in.
    pub(crate) fn to_json_stored_as(&self, stored: DType) -> String {
        let mut config: Value =
            serde_json::from_str(&self.to_json()).expect("to_json writes valid JSON");
        config["dtype"] = json!(torch_dtype_name(stored));
        config["torch_dtype"] = json!(torch_dtype_name(stored));
        serde_json::to_string_pretty(&config).expect("a JSON value always serialises")
    }

    /// Reads `path`, a `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) for a file that cannot be read; as for [`from_json`](Self::from_json), with
    /// the path in the message.
    pub fn from_file(path: impl AsRef<Path>) -> Result<LlamaConfig> {
        read_config(path.as_ref(), LlamaConfig::from_json)
    }
}

/// RoPE's base and scaling from `rope_parameters` (transformers 5) or from the top-level
/// `rope_theta` and `rope_scaling` (earlier checkpoints; `type` is the older name of
/// `rope_type`).
fn rope(raw: &Map<String, Value>) -> Result<(f64, RopeScaling)> {
    let empty = Map::new();
    let (params, theta_from, where_) = match raw.get("rope_parameters").and_then(Value::as_object) {
        Some(p) => (p, p, "rope_parameters"),
        None => (
            raw.get("rope_scaling")
                .and_then(Value::as_object)
                .unwrap_or(&empty),
            raw,
            "rope_scaling",
        ),
    };
    let p = Fields(params);
    let theta = Fields(theta_from).number_or("rope_theta", 10_000.0)?;
    if theta <= 1.0 {
        return Err(config_error(format!(
            "\"rope_theta\" must be above 1, found {theta}"
        )));
    }
    if let Some(partial) = p
        .get("partial_rotary_factor")
        .or_else(|| raw.get("partial_rotary_factor"))
        .filter(|v| v.as_f64() != Some(1.0))
    {
        return Err(unsupported(
            "partial_rotary_factor",
            partial,
            "RoPE turns the whole head here",
        ));
    }
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || {
        p.number_or("factor", f64::NAN).and_then(|x| {
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err(config_error(format!(
                    "\"{where_}\" needs a positive \"factor\""
                )))
            }
        })
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        // transformers scales against `max_position_embeddings` (the config's, not a key of the
        // rope parameters).
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max_positions: Fields(raw).size("max_position_embeddings")?,
        },
        "llama3" => {
            // No defaults: transformers requires each, and a guessed one would be another model.
            let required = |key: &str| {
                p.get(key).and_then(Value::as_f64).ok_or_else(|| {
                    config_error(format!("llama3 scaling in \"{where_}\" needs \"{key}\""))
                })
            };
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: required("low_freq_factor")?,
                high_freq_factor: required("high_freq_factor")?,
                original_max_positions: p.size("original_max_position_embeddings")?,
            }
        }
        "yarn" => {
            let factor = factor()?;
            let number = |key: &str, default: f64| p.number_or(key, default);
            // transformers' get_mscale: 0.1 · mscale · ln(factor) + 1 above a factor of 1.
            let mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match p.get("attention_factor") {
                Some(_) => number("attention_factor", f64::NAN)?,
                None => match (number("mscale", 0.0)?, number("mscale_all_dim", 0.0)?) {
                    (m, all) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                    _ => mscale(1.0),
                },
            };
            let truncate = match p.get("truncate") {
                None => true,
                Some(v) => v.as_bool().ok_or_else(|| {
                    config_error(format!(
                        "\"truncate\" in \"{where_}\" must be true or false"
                    ))
                })?,
            };
            RopeScaling::Yarn {
                factor,
                original_max_positions: p.size("original_max_position_embeddings")?,
                // transformers treats 0 and a missing value alike (`or 32`, `or 1`).
                beta_fast: Some(number("beta_fast", 0.0)?)
                    .filter(|&b| b != 0.0)
                    .unwrap_or(32.0),
                beta_slow: Some(number("beta_slow", 0.0)?)
                    .filter(|&b| b != 0.0)
                    .unwrap_or(1.0),
                truncate,
                attention_factor,
            }
        }
        other => {
            return Err(unsupported(
                "rope_type",
                &Value::from(other),
                "ndscope computes the default, linear, dynamic, llama3 and yarn RoPE scalings",
            ));
        }
    };
    Ok((theta, scaling))
}
