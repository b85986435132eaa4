//! A sample's text as its tokens arrive: incremental detokenization (a token may end inside a UTF-8
//! character, or change how the previous ones read) and stop strings, which may span tokens.

use std::sync::Arc;

use ndscope::data::Tokenizer;

/// Tokens in, text out: each [`push`](Self::push) returns the text that became final.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<i64>,
    /// `ids[prefix..read]` were decoded already; decoding from `prefix` gives the context that
    /// makes `ids[read..]` read as they do in the whole text (TGI's offsets).
    prefix: usize,
    read: usize,
    /// All text decoded so far, and how much of it was handed out.
    text: String,
    sent: usize,
    stops: Vec<String>,
    stopped: bool,
}

impl TextStream {
    pub fn new(tokenizer: Arc<Tokenizer>, stops: Vec<String>) -> TextStream {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            sent: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
        }
    }

    /// Whether a stop string was met: the text ends before it, and no more comes.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds `token`; the text that became final (it holds back a token that ends inside a
    /// character, and text that may be the start of a stop string).
    pub fn push(&mut self, token: i64) -> String {
        if self.stopped {
            return String::new();
        }
        self.ids.push(token);
        let before = self.decode(self.prefix, self.read);
        let now = self.decode(self.prefix, self.ids.len());
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            self.text.push_str(&now[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        self.release(false)
    }

    /// The text held back, at the end of the generation.
    pub fn finish(&mut self) -> String {
        if !self.stopped && self.read < self.ids.len() {
            let before = self.decode(self.prefix, self.read);
            let now = self.decode(self.prefix, self.ids.len());
            if let Some(rest) = now.strip_prefix(before.as_str()) {
                self.text.push_str(rest);
            }
            self.read = self.ids.len();
        }
        self.release(true)
    }

    /// The whole text handed out so far.
    pub fn text(&self) -> &str {
        &self.text[..self.sent]
    }

    fn decode(&self, from: usize, to: usize) -> String {
        // The ids came from the model, whose vocabulary the tokenizer's covers.
        self.tokenizer
            .decode(&self.ids[from..to])
            .unwrap_or_default()
    }

    /// Hands out what is final: up to the first stop string, or all but a possible stop's start.
    fn release(&mut self, at_end: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop wholly inside the text handed out was found before; one may start up to
        // `longest - 1` bytes before its end.
        let mut from = self.sent.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match found {
            Some(at) => {
                self.stopped = true;
                self.text.truncate(at);
                at
            }
            None if at_end => self.text.len(),
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.sent.min(end)..end].to_string();
        self.sent = self.sent.max(end);
        out
    }

    /// The bytes at the end of the text that begin some stop string.
    fn held_back(&self) -> usize {
        let tail = &self.text[self.sent..];
        self.stops
            .iter()
            .flat_map(|stop| {
                (1..stop.len().min(tail.len() + 1))
                    .rev()
                    .find(|&k| stop.is_char_boundary(k) && tail.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/llama-tiny/tokenizer.json"
        );
        Arc::new(Tokenizer::from_file(dir).unwrap())
    }

    /// Streams `text`'s tokens one by one: what came out, and whether a stop was met.
    fn stream(text: &str, stops: &[&str]) -> (Vec<String>, String, bool) {
        let t = tokenizer();
        let ids = t.encode(text).unwrap();
        let mut s = TextStream::new(t, stops.iter().map(|s| s.to_string()).collect());
        let mut pieces: Vec<String> = ids.iter().map(|&id| s.push(id)).collect();
        pieces.push(s.finish());
        let joined = pieces.concat();
        assert_eq!(joined, s.text());
        (pieces, joined, s.stopped())
    }

    #[test]
    fn without_stops_the_pieces_make_the_whole_text() {
        let text = "A scope owns every tensor — ünïcode and all.\n\tdef main():";
        let (pieces, joined, stopped) = stream(text, &[]);
        assert_eq!(joined, text);
        assert!(!stopped && pieces.len() > 5);
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it() {
        let text = "A scope owns every tensor created in it";
        for stop in ["every", "y ten", "s ev", "it"] {
            let (_, joined, stopped) = stream(text, &[stop, "never there"]);
            assert_eq!(joined, text[..text.find(stop).unwrap()], "{stop}");
            assert!(stopped);
        }
        // The first of several stops in the text wins.
        let (_, joined, _) = stream(text, &["created", "owns"]);
        assert_eq!(joined, "A scope ");
    }

    #[test]
    fn text_that_may_start_a_stop_is_held_back_until_it_cannot() {
        let t = tokenizer();
        let mut s = TextStream::new(t.clone(), vec!["scope!".into()]);
        let mut out = String::new();
        for id in t.encode("A scope owns").unwrap() {
            out.push_str(&s.push(id));
            // What was handed out never ends inside a possible stop.
            assert!(!out.ends_with("scope") && !out.ends_with("sco"), "{out:?}");
        }
        out.push_str(&s.finish());
        assert_eq!(out, "A scope owns");
        assert!(!s.stopped());
    }
}
