//! Chat templates and special tokens against transformers: `data/llama-tiny`'s `chat_text` is what
//! `apply_chat_template(conversation, add_generation_prompt=True)` rendered, `chat_ids` its tokens,
//! and the prompts' ids start with the `<|begin_of_text|>` its post-processor adds.

mod common;
use common::reference::reference_of;

use ndscope::Error;
use ndscope::data::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::Value;

const DIR: &str = "data/llama-tiny";

fn reference_ids(name: &str) -> Vec<i64> {
    reference_of(DIR)[name]
        .1
        .iter()
        .map(|&v| v as i64)
        .collect()
}

fn reference_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/reference.json")).unwrap())
        .unwrap()
}

#[test]
fn the_chat_template_renders_and_tokenizes_as_transformers() {
    let reference = reference_json();
    let conversation: Vec<ChatMessage> = reference["conversation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let template = ChatTemplate::from_dir(DIR).unwrap();
    let text = template.apply(&conversation, true).unwrap();
    assert_eq!(text, reference["chat_text"].as_str().unwrap());
    let tokenizer = Tokenizer::from_file(format!("{DIR}/tokenizer.json")).unwrap();
    // The template writes the special tokens itself: tokenize without adding more.
    assert_eq!(tokenizer.encode(&text).unwrap(), reference_ids("chat_ids"));
    // Without the generation prompt the text ends with the last turn.
    let text = template.apply(&conversation, false).unwrap();
    assert!(text.ends_with("What owns a tensor?<|eot_id|>"), "{text:?}");
}

#[test]
fn prompts_start_with_the_post_processors_special_tokens() {
    let reference = reference_json();
    let tokenizer = Tokenizer::from_file(format!("{DIR}/tokenizer.json")).unwrap();
    let prompts: Vec<String> = reference["greedy"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    // reference.json's `greedy` maps each prompt to its continuation; the ids are prompt0/1_ids.
    let ids = [reference_ids("prompt0_ids"), reference_ids("prompt1_ids")];
    for prompt in &prompts {
        let with = tokenizer.encode_with_special_tokens(prompt).unwrap();
        assert_eq!(with[0], 0, "<|begin_of_text|> first");
        assert_eq!(with[1..], tokenizer.encode(prompt).unwrap()[..]);
        assert!(
            ids.contains(&with),
            "{prompt:?} gives {with:?}, not a reference prompt"
        );
    }
}

#[test]
fn a_directory_without_a_template_says_what_it_is() {
    let err = ChatTemplate::from_dir("data/gpt2-tiny").unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
    assert!(err.to_string().contains("no chat format"), "{err}");
}
