//! `models::LlamaConfig` against the configuration of `data/llama-tiny` (made by transformers), its
//! older published form, the Mistral and Qwen2 variants, and every unsupported key refused by name.

use ndscope::Error;
use ndscope::models::LlamaConfig;
use ndscope::nn::RopeScaling;
use serde_json::{Value, json};

fn tiny() -> Value {
    serde_json::from_str(&std::fs::read_to_string("data/llama-tiny/config.json").unwrap()).unwrap()
}

fn parse(v: &Value) -> ndscope::Result<LlamaConfig> {
    LlamaConfig::from_json(&v.to_string())
}

#[test]
fn the_tiny_llama_config_reads_as_transformers_wrote_it() {
    let c = LlamaConfig::from_file("data/llama-tiny/config.json").unwrap();
    assert_eq!(c.model_type, "llama");
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers
        ),
        (1000, 64, 176, 2)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (4, 2, 16)
    );
    assert_eq!((c.max_position_embeddings, c.rms_norm_eps), (128, 1e-5));
    assert_eq!(c.rope_theta, 10_000.0);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 32,
        }
    );
    assert!(!c.tie_word_embeddings && !c.attention_bias);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone(), c.sliding_window),
        (Some(0), vec![1, 4], None)
    );
}

#[test]
fn the_older_top_level_rope_form_reads_the_same() {
    let mut old = tiny();
    let params = old["rope_parameters"].take();
    let map = old.as_object_mut().unwrap();
    map.remove("rope_parameters");
    map.insert("rope_theta".into(), params["rope_theta"].clone());
    let mut scaling = params.clone();
    scaling.as_object_mut().unwrap().remove("rope_theta");
    map.insert("rope_scaling".into(), scaling.clone());
    assert_eq!(parse(&old).unwrap(), parse(&tiny()).unwrap());
    // Even older: `type` instead of `rope_type`.
    let kind = scaling["rope_type"].take();
    scaling.as_object_mut().unwrap().insert("type".into(), kind);
    scaling.as_object_mut().unwrap().remove("rope_type");
    old["rope_scaling"] = scaling;
    assert_eq!(parse(&old).unwrap(), parse(&tiny()).unwrap());
    // No scaling at all, a single end token.
    let mut plain = tiny();
    plain["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 500000.0});
    plain["eos_token_id"] = json!(1);
    let c = parse(&plain).unwrap();
    assert_eq!(
        (c.rope_theta, c.rope_scaling, c.eos_token_ids),
        (500_000.0, RopeScaling::None, vec![1])
    );
}

#[test]
fn mistral_and_qwen2_variants_read_their_own_keys() {
    let mut mistral = tiny();
    mistral["model_type"] = json!("mistral");
    mistral["sliding_window"] = json!(4096);
    assert_eq!(parse(&mistral).unwrap().sliding_window, Some(4096));
    let mut qwen = tiny();
    qwen["model_type"] = json!("qwen2");
    qwen["sliding_window"] = json!(4096);
    qwen["use_sliding_window"] = json!(false);
    let c = parse(&qwen).unwrap();
    assert!(c.attention_bias, "Qwen2 projects q, k and v with biases");
    assert_eq!(
        c.sliding_window, None,
        "Qwen2 slides only with use_sliding_window"
    );
    // Qwen2 windows the layers from max_window_layers on (transformers' default: 28).
    qwen["use_sliding_window"] = json!(true);
    assert_eq!(
        parse(&qwen).unwrap().sliding_window,
        None,
        "2 layers, none of them from the 28th on"
    );
    qwen["max_window_layers"] = json!(0);
    assert_eq!(parse(&qwen).unwrap().sliding_window, Some(4096));
    let mut no_kv = tiny();
    no_kv.as_object_mut().unwrap().remove("num_key_value_heads");
    no_kv.as_object_mut().unwrap().remove("head_dim");
    let c = parse(&no_kv).unwrap();
    assert_eq!(
        (c.num_key_value_heads, c.head_dim),
        (4, 16),
        "defaults: every head, hidden / heads"
    );
}

/// Dynamic NTK scaling in both forms: its original context is `max_position_embeddings`, the
/// context it computes `factor` times that, and `to_json` writes it back.
#[test]
fn dynamic_reads_from_both_forms() {
    let mut c = tiny();
    c["max_position_embeddings"] = json!(16);
    c["rope_parameters"] = json!({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0});
    let config = parse(&c).unwrap();
    let want = RopeScaling::Dynamic {
        factor: 4.0,
        original_max_positions: 16,
    };
    assert_eq!(config.rope_scaling, want);
    assert_eq!(config.rope_scaling.context(16), 64);
    assert_eq!(LlamaConfig::from_json(&config.to_json()).unwrap(), config);
    c.as_object_mut().unwrap().remove("rope_parameters");
    c["rope_theta"] = json!(10000.0);
    c["rope_scaling"] = json!({"type": "dynamic", "factor": 4.0});
    assert_eq!(parse(&c).unwrap().rope_scaling, want);
    c["rope_scaling"] = json!({"type": "dynamic"});
    let err = parse(&c).unwrap_err();
    assert!(err.to_string().contains("factor"), "{err}");
}

/// YaRN in the older top-level form of Qwen2.5's long-context configs (`"type": "yarn"`), with the
/// attention factor from `mscale` and `mscale_all_dim`, and written back by `to_json`.
#[test]
fn yarn_reads_from_both_forms() {
    let mut c = tiny();
    c.as_object_mut().unwrap().remove("rope_parameters");
    c["rope_theta"] = json!(1_000_000.0);
    c["rope_scaling"] =
        json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32});
    let config = parse(&c).unwrap();
    assert_eq!(
        config.rope_scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_positions: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
        }
    );
    assert_eq!(LlamaConfig::from_json(&config.to_json()).unwrap(), config);
    c["rope_scaling"]["mscale"] = json!(0.5);
    c["rope_scaling"]["mscale_all_dim"] = json!(1.0);
    let want = (0.05 * 4f64.ln() + 1.0) / (0.1 * 4f64.ln() + 1.0);
    assert!((parse(&c).unwrap().rope_scaling.attention_scaling() - want).abs() < 1e-15);
    c["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("original_max_position_embeddings");
    let err = parse(&c).unwrap_err();
    assert!(
        err.to_string().contains("original_max_position_embeddings"),
        "{err}"
    );
}

/// A change to a configuration.
type Alter = Box<dyn Fn(&mut Value)>;

#[test]
fn what_ndscope_does_not_compute_is_refused_by_name() {
    let cases: Vec<(Alter, &str)> = vec![
        (
            Box::new(|c| c["rope_parameters"]["rope_type"] = json!("longrope")),
            "unsupported: rope_type = \"longrope\"",
        ),
        (
            Box::new(|c| c["hidden_act"] = json!("gelu")),
            "unsupported: hidden_act = \"gelu\"",
        ),
        (
            Box::new(|c| c["model_type"] = json!("gemma")),
            "unsupported: model_type = \"gemma\"",
        ),
        (
            Box::new(|c| c["mlp_bias"] = json!(true)),
            "unsupported: mlp_bias = true",
        ),
        (
            Box::new(|c| c["pretraining_tp"] = json!(2)),
            "unsupported: pretraining_tp = 2",
        ),
        (
            Box::new(|c| c["rope_parameters"]["partial_rotary_factor"] = json!(0.5)),
            "unsupported: partial_rotary_factor = 0.5",
        ),
        (
            Box::new(|c| {
                c["model_type"] = json!("qwen2");
                c["use_sliding_window"] = json!(true);
                c["sliding_window"] = json!(16);
                c["max_window_layers"] = json!(1);
            }),
            "unsupported: max_window_layers = 1",
        ),
        (
            Box::new(|c| {
                c["sliding_window"] = json!(16);
                c["layer_types"] = json!(["full_attention", "sliding_attention"]);
            }),
            "unsupported: layer_types = [\"full_attention\",\"sliding_attention\"]",
        ),
    ];
    for (alter, says) in cases {
        let mut c = tiny();
        alter(&mut c);
        let err = parse(&c).unwrap_err();
        assert!(matches!(err, Error::UnsupportedConfig { .. }), "{err}");
        assert!(err.to_string().contains(says), "{err} should say {says}");
    }
    // Malformed values are format errors naming the key.
    let mut bad = tiny();
    bad["num_key_value_heads"] = json!(3);
    let err = parse(&bad).unwrap_err();
    assert!(
        matches!(err, Error::Format { .. }) && err.to_string().contains("num_key_value_heads"),
        "{err}"
    );
    let mut bad = tiny();
    bad["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("low_freq_factor");
    let err = parse(&bad).unwrap_err();
    assert!(err.to_string().contains("low_freq_factor"), "{err}");
    // The file's path is in the message.
    let err = LlamaConfig::from_file("data/gpt2-tiny/config.json").unwrap_err();
    assert!(
        err.to_string()
            .contains("data/gpt2-tiny/config.json: unsupported: model_type = \"gpt2\""),
        "{err}"
    );
}
