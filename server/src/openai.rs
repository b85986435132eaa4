//! OpenAI's request bodies, read and checked: what a request asks for, or the 400 that says what is
//! wrong with it.

use serde::Deserialize;
use serde_json::{Value, json};

use ndscope::serve::{GenerateOptions, Sampling};

/// An error as OpenAI's API writes it, with its HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `POST /v1/completions`' body (fields OpenAI defines and this server does not read are ignored).
#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingBody,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// A chat message; `content` is text or a list of text parts.
#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/chat/completions`' body.
#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingBody,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// The sampling fields both endpoints share; `top_k` and `min_tokens` as vLLM reads them.
#[derive(Debug, Deserialize)]
pub struct SamplingBody {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stop: Option<Stop>,
    pub seed: Option<i64>,
    pub n: Option<i64>,
    pub min_tokens: Option<i64>,
}

/// What the model can take, for the checks.
pub struct Limits {
    pub max_positions: usize,
    pub max_batch: usize,
    pub end_tokens: Vec<i64>,
}

/// A checked request: the engine's options, the number of samples, the stop strings.
#[derive(Debug)]
pub struct Asked {
    pub options: GenerateOptions,
    pub n: usize,
    pub stops: Vec<String>,
}

/// Parses `body` as JSON of type `T`: a 400 naming what is wrong otherwise.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid(
            "the request has no body; send a JSON object",
            None,
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the body is not valid JSON"
        } else {
            "the body does not fit the request's schema"
        };
        ApiError::invalid(format!("{what}: {e}"), None)
    })
}

/// Checks `model` against the one served.
pub fn check_model(model: &Option<String>, served: &str) -> Result<(), ApiError> {
    match model {
        None => Err(ApiError::invalid(
            "you must provide a model parameter",
            Some("model"),
        )),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError::invalid(
                format!("the model `{m}` does not exist; this server serves `{served}`"),
                Some("model"),
            )
        }),
    }
}

fn bad<T>(message: String, param: &'static str) -> Result<T, ApiError> {
    Err(ApiError::invalid(message, Some(param)))
}

/// Checks the sampling fields and the output length against the prompt's (`prompt_field`: the
/// body's field the prompt came from, named by a prompt past the context): the request.
pub fn asked(
    s: &SamplingBody,
    max_tokens: Option<i64>,
    default_max: Option<usize>,
    prompt_tokens: usize,
    prompt_field: &'static str,
    limits: &Limits,
) -> Result<Asked, ApiError> {
    let context = limits.max_positions;
    if prompt_tokens > context {
        return bad(
            format!(
                "this model's maximum context length is {context} tokens; the prompt has \
                 {prompt_tokens}: shorten it"
            ),
            prompt_field,
        );
    }
    let max_new = match max_tokens {
        Some(m) if m < 0 => {
            return bad(
                format!("max_tokens must be at least 0, got {m}"),
                "max_tokens",
            );
        }
        Some(m) => m as u64,
        None => default_max.unwrap_or(context - prompt_tokens) as u64,
    };
    if prompt_tokens as u64 + max_new > context as u64 {
        return bad(
            format!(
                "this model's maximum context length is {context} tokens; you asked for \
                 {} ({prompt_tokens} in the prompt, {max_new} for the completion): reduce the \
                 prompt or max_tokens",
                prompt_tokens as u64 + max_new
            ),
            "max_tokens",
        );
    }
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return bad(
            format!("temperature must be between 0 and 2, got {temperature}"),
            "temperature",
        );
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {top_p}"), "top_p");
    }
    let top_k = match s.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => k as usize,
        k => {
            return bad(
                format!("top_k must be -1, 0 (all tokens) or positive, got {k}"),
                "top_k",
            );
        }
    };
    let n = s.n.unwrap_or(1);
    if n < 1 || n as usize > limits.max_batch {
        return bad(
            format!(
                "n must be between 1 and {} (the server's batch), got {n}",
                limits.max_batch
            ),
            "n",
        );
    }
    let stops = match &s.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stops.len() > 4 {
        return bad(
            format!("stop takes up to 4 sequences, got {}", stops.len()),
            "stop",
        );
    }
    let min_tokens = s.min_tokens.unwrap_or(0);
    if min_tokens < 0 || min_tokens as u64 > max_new {
        return bad(
            format!("min_tokens must be between 0 and max_tokens ({max_new}), got {min_tokens}"),
            "min_tokens",
        );
    }
    let sampling = Sampling {
        temperature,
        top_k,
        top_p,
    };
    let mut options = GenerateOptions::sampled(
        max_new as usize,
        sampling,
        s.seed.map_or(ndscope_default_seed(), |s| s as u64),
    )
    .with_min_new_tokens(min_tokens as usize);
    options.stop.extend(&limits.end_tokens);
    Ok(Asked {
        options,
        n: n as usize,
        stops,
    })
}

/// Without a seed, each request draws from a seed of its own.
fn ndscope_default_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0x5eed);
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    clock ^ NEXT.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

/// The completion's prompt: text, or token ids checked against the vocabulary.
pub enum PromptInput {
    Text(String),
    Ids(Vec<i64>),
}

pub fn prompt_input(prompt: Option<Prompt>, vocab: usize) -> Result<PromptInput, ApiError> {
    let one = |what: &str, n: usize| {
        ApiError::invalid(
            format!(
                "this server takes one prompt per request, got a list of {n} {what}; send them as separate requests"
            ),
            Some("prompt"),
        )
    };
    let input = match prompt {
        None => return bad("you must provide a prompt".into(), "prompt"),
        Some(Prompt::Text(t)) => PromptInput::Text(t),
        Some(Prompt::Ids(ids)) => PromptInput::Ids(ids),
        Some(Prompt::Texts(mut v)) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        Some(Prompt::Texts(v)) => return Err(one("prompts", v.len())),
        Some(Prompt::IdLists(mut v)) if v.len() == 1 => PromptInput::Ids(v.remove(0)),
        Some(Prompt::IdLists(v)) => return Err(one("token lists", v.len())),
    };
    match &input {
        PromptInput::Text(t) if t.is_empty() => bad("the prompt is empty".into(), "prompt"),
        PromptInput::Ids(ids) if ids.is_empty() => bad("the prompt is empty".into(), "prompt"),
        PromptInput::Ids(ids) => match ids.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            Some(t) => bad(
                format!("the prompt's token {t} is outside the vocabulary (0..{vocab})"),
                "prompt",
            ),
            None => Ok(input),
        },
        PromptInput::Text(_) => Ok(input),
    }
}

/// The chat messages as (role, text) pairs.
pub fn chat_messages(messages: Option<Vec<Message>>) -> Result<Vec<(String, String)>, ApiError> {
    let messages = match messages {
        None => return bad("you must provide messages".into(), "messages"),
        Some(m) if m.is_empty() => return bad("messages must not be empty".into(), "messages"),
        Some(m) => m,
    };
    messages
        .into_iter()
        .map(|m| {
            let text = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return bad(
                                    format!("content parts of type `{kind}` are not supported; send text"),
                                    "messages",
                                );
                            }
                        }
                    }
                    text
                }
            };
            Ok((m.role, text))
        })
        .collect()
}
