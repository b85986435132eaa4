//! Chat templates: the Jinja template a chat model's tokenizer ships (`chat_template.jinja`, or the
//! `chat_template` string of `tokenizer_config.json`), rendered as transformers'
//! `apply_chat_template` renders it.

use std::path::Path;

use minijinja::{Environment, ErrorKind, context};
use serde_json::Value;

use crate::error::{Error, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"` (whatever roles the template knows).
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A turn of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template with the special tokens it refers to.
///
/// ```
/// use ndscope::data::{ChatMessage, ChatTemplate};
///
/// let template = ChatTemplate::from_dir("data/llama-tiny")?;
/// let text = template.apply(&[ChatMessage::new("user", "Hi")], true)?;
/// assert_eq!(
///     text,
///     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
///      <|start_header_id|>assistant<|end_header_id|>\n\n"
/// );
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

fn template_error(reason: impl std::fmt::Display) -> Error {
    Error::Format {
        format: "chat template",
        reason: reason.to_string(),
    }
}

/// A special token's text from `tokenizer_config.json`: a string, or an object with `content`.
fn token_text(config: &Value, key: &str) -> String {
    match &config[key] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of the model directory `dir`: `chat_template.jinja` when present, else
    /// `tokenizer_config.json`'s `chat_template`; the special tokens from `tokenizer_config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] for unreadable files; [`Error::Format`] when the directory has no chat
    /// template (a base model, not a chat model), for a list of named templates, or for a template
    /// that does not parse.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ChatTemplate> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| template_error(format!("{}: {e}", config_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => return Err(Error::io(&config_path, e)),
        };
        let file = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match &config["chat_template"] {
                Value::String(s) => s.clone(),
                Value::Array(_) => {
                    return Err(template_error(format!(
                        "{}: \"chat_template\" is a list of named templates; ndscope reads a \
                         single template",
                        config_path.display()
                    )));
                }
                _ => {
                    return Err(template_error(format!(
                        "{} has no chat_template.jinja and {} no \"chat_template\": this model \
                         has no chat format (a base model); prompt it with plain text",
                        dir.display(),
                        config_path.display()
                    )));
                }
            },
            Err(e) => return Err(Error::io(&file, e)),
        };
        let template = ChatTemplate {
            source,
            bos_token: token_text(&config, "bos_token"),
            eos_token: token_text(&config, "eos_token"),
        };
        template.environment()?; // parse now, so a broken template is refused at load
        Ok(template)
    }

    /// The chat template of the model at `path`: a Hugging Face directory's
    /// ([`from_dir`](Self::from_dir)) or a GGUF file's ([`from_gguf`](Self::from_gguf)).
    ///
    /// # Errors
    /// As for [`from_dir`](Self::from_dir) and [`from_gguf`](Self::from_gguf).
    pub fn for_model(path: impl AsRef<Path>) -> Result<ChatTemplate> {
        let path = path.as_ref();
        if path.is_file() {
            ChatTemplate::from_gguf(path)
        } else {
            ChatTemplate::from_dir(path)
        }
    }

    /// The template embedded in the GGUF file `path` (`tokenizer.chat_template`), with the bos
    /// and eos tokens' texts from its tokenizer metadata.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Format`] for a file that is not
    /// GGUF, has no chat template (a base model), or whose template does not parse.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<ChatTemplate> {
        let path = path.as_ref();
        let weights = crate::weights::Weights::open(path)?;
        let metadata = weights
            .gguf_metadata()
            .ok_or_else(|| template_error(format!("{} is not a GGUF file", path.display())))?;
        let source = metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                template_error(format!(
                    "{} has no \"tokenizer.chat_template\": this model has no chat format (a \
                     base model); prompt it with plain text",
                    path.display()
                ))
            })?;
        let token = |key: &str| -> String {
            let tokens = metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array());
            metadata
                .get(key)
                .and_then(|v| v.as_i64())
                .and_then(|id| tokens?.get(usize::try_from(id).ok()?)?.as_str())
                .unwrap_or_default()
                .to_string()
        };
        let template = ChatTemplate {
            source: source.to_string(),
            bos_token: token("tokenizer.ggml.bos_token_id"),
            eos_token: token("tokenizer.ggml.eos_token_id"),
        };
        template.environment()?;
        Ok(template)
    }

    /// The environment transformers renders in: blocks trimmed (`trim_blocks`, `lstrip_blocks`),
    /// `raise_exception` for templates that refuse a conversation.
    fn environment(&self) -> Result<Environment<'_>> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template("chat", &self.source)
            .map_err(template_error)?;
        Ok(env)
    }

    /// The conversation as the model's prompt text; with `add_generation_prompt`, ending with the
    /// header of the assistant's turn (so generation writes that turn). Tokenize the result with
    /// [`Tokenizer::encode`](super::Tokenizer::encode) (the template writes the special tokens).
    ///
    /// # Errors
    /// [`Error::Format`] when rendering fails (the message of a template's `raise_exception`).
    pub fn apply(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let env = self.environment()?;
        let messages: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role, content => m.content })
            .collect();
        env.get_template("chat")
            .and_then(|t| {
                t.render(context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos_token,
                    eos_token => self.eos_token,
                })
            })
            .map_err(template_error)
    }
}
