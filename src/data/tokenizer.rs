//! Text to token ids and back with a Hugging Face `tokenizer.json` (GPT-2's byte-level BPE, and
//! every other model the `tokenizers` library describes), read by that library itself.

use std::path::Path;

use crate::error::{Error, Result};

/// A tokenizer read from a `tokenizer.json` file.
///
/// ```
/// use ndscope::data::Tokenizer;
///
/// let tokenizer = Tokenizer::from_file("data/gpt2-tiny/tokenizer.json")?;
/// let ids = tokenizer.encode("A scope owns every tensor created in it")?;
/// assert_eq!(tokenizer.decode(&ids)?, "A scope owns every tensor created in it");
/// assert_eq!(tokenizer.token_id("<|endoftext|>"), Some(0));
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

fn format_error(reason: impl std::fmt::Display) -> Error {
    Error::Format {
        format: "tokenizer.json",
        reason: reason.to_string(),
    }
}

impl Tokenizer {
    /// Reads `path`, a `tokenizer.json` as Hugging Face's `tokenizers` writes it.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Format`] for one the `tokenizers`
    /// library cannot read.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let inner = text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| format_error(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
    }

    /// The tokenizer of the model at `path`: a Hugging Face directory's `tokenizer.json`, or the
    /// one embedded in a GGUF file ([`from_gguf`](Self::from_gguf)).
    ///
    /// # Errors
    /// As for [`from_file`](Self::from_file) and [`from_gguf`](Self::from_gguf).
    pub fn for_model(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        if path.is_file() {
            Tokenizer::from_gguf(path)
        } else {
            Tokenizer::from_file(path.join("tokenizer.json"))
        }
    }

    /// The tokenizer embedded in the GGUF file `path` (`tokenizer.ggml.*`): its vocabulary,
    /// merges, special tokens, pre-tokenizer and the bos its prompts start with, tokenizing as
    /// the model's own `tokenizer.json` does.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read; [`Error::Format`] for one that is not GGUF
    /// or has no tokenizer; [`Error::UnsupportedConfig`] naming the key of a tokenizer ndscope
    /// does not rebuild (a SentencePiece vocabulary, an unknown pre-tokenizer).
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let weights = crate::weights::Weights::open(path)?;
        let metadata = weights.gguf_metadata().ok_or_else(|| Error::Format {
            format: "GGUF",
            reason: format!("{} is not a GGUF file", path.display()),
        })?;
        let inner = super::gguf_vocab::tokenizer_json(metadata)?
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| {
                format_error(format!("{}: the embedded tokenizer: {e}", path.display()))
            })?;
        Ok(Tokenizer { inner })
    }

    /// The ids of `text`'s tokens, without special tokens added.
    ///
    /// # Errors
    /// [`Error::Format`] when the tokenizer fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let encoding = self.inner.encode(text, false).map_err(format_error)?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    /// The ids of `text`'s tokens with the special tokens the tokenizer's post-processor adds
    /// (Llama 3's `<|begin_of_text|>` first, for example): what transformers' `tokenizer(text)`
    /// gives, and what a model expects of a prompt.
    ///
    /// # Errors
    /// [`Error::Format`] when the tokenizer fails on the text.
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<i64>> {
        let encoding = self.inner.encode(text, true).map_err(format_error)?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    /// The text of `ids` (special tokens included as their text).
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] for an id outside the vocabulary; [`Error::Format`] when the
    /// tokenizer fails to decode.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let vocab = self.vocab_size();
        let ids = ids
            .iter()
            .map(|&id| {
                u32::try_from(id)
                    .ok()
                    .filter(|&i| (i as usize) < vocab)
                    .ok_or(Error::IndexOutOfRange {
                        op: "Tokenizer::decode",
                        index: id,
                        size: vocab,
                    })
            })
            .collect::<Result<Vec<u32>>>()?;
        self.inner.decode(&ids, false).map_err(format_error)
    }

    /// Tokens in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token` (a special token such as `<|endoftext|>`, or a vocabulary entry).
    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }
}
