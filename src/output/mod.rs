//! What a sequence hands out as it generates: one token at a time, checked against its stop
//! tokens, stop strings and limits, its text never splitting a character.
//!
//! ```
//! use burn_gemma::output::{OutputRules, Room, SequenceOutput};
//! use burn_gemma::StopReason;
//!
//! let rules = OutputRules { stop_tokens: vec![1], stop_strings: vec!["END".into()], max_new_tokens: 8 };
//! let mut output = SequenceOutput::new(rules);
//! let room = Room { used: 3, capacity: 64 };
//! let first = output.push(7, "Hello E".as_bytes(), room);
//! assert_eq!((first.text.as_deref(), first.stop), (Some("Hello "), None));
//! let second = output.push(9, "ND, world".as_bytes(), room);
//! assert_eq!((second.text.as_deref(), second.stop), (Some(""), Some(StopReason::StopString(0))));
//! ```
//!
//! The generator, the engine and the split-model server all use [`SequenceOutput`].

mod stop_text;
mod utf8;

pub use stop_text::{Pushed, StopText};
pub use utf8::Utf8Stream;

use crate::{Error, RequestError};

/// When a sequence stops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputRules {
    /// Tokens that end the sequence; they are counted, their text is not handed out.
    pub stop_tokens: Vec<u32>,
    /// Strings that end the sequence; they and what follows are not handed out.
    pub stop_strings: Vec<String>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
}

impl OutputRules {
    /// Refuses rules no sequence could follow: no tokens to generate, an empty stop string.
    pub fn check(&self) -> Result<(), Error> {
        if self.max_new_tokens == 0 {
            return Err(RequestError::NoNewTokens.into());
        }
        if let Some(index) = self.stop_strings.iter().position(String::is_empty) {
            return Err(RequestError::EmptyStopString { index }.into());
        }
        Ok(())
    }
}

/// The positions of a sequence's cache before the pushed token runs: `used` are filled, the
/// token needs one more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub used: usize,
    pub capacity: usize,
}

/// What one pushed token gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    /// Text to hand out now (possibly empty while a character or a possible stop string is
    /// held back); `None` where the token is a stop token.
    pub text: Option<String>,
    /// Why the sequence ends with this token, if it does.
    pub stop: Option<StopReason>,
}

/// One sequence's output rules and the text it holds back.
#[derive(Debug)]
pub struct SequenceOutput {
    stop_tokens: Vec<u32>,
    max_new_tokens: usize,
    generated: usize,
    utf8: Utf8Stream,
    stop_text: StopText,
    stop: Option<StopReason>,
}

impl SequenceOutput {
    pub fn new(rules: OutputRules) -> Self {
        Self {
            stop_tokens: rules.stop_tokens,
            max_new_tokens: rules.max_new_tokens,
            generated: 0,
            utf8: Utf8Stream::default(),
            stop_text: StopText::new(rules.stop_strings),
            stop: None,
        }
    }

    /// Takes the next generated token and its bytes. The checks run in this order: a stop
    /// token, a stop string, `max_new_tokens`, the cache's room for one more position.
    pub fn push(&mut self, token: u32, bytes: &[u8], room: Room) -> Emitted {
        self.generated = self.generated.saturating_add(1);
        if self.stop_tokens.contains(&token) {
            return self.stopped(None, StopReason::StopToken(token));
        }
        let text = self.utf8.push(bytes);
        let pushed = self.stop_text.push(&text);
        let stop = if let Some(index) = pushed.stopped {
            Some(StopReason::StopString(index))
        } else if self.generated >= self.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if room.used.saturating_add(1) > room.capacity {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        match stop {
            Some(reason) => self.stopped(Some(pushed.text), reason),
            None => Emitted { text: Some(pushed.text), stop: None },
        }
    }

    fn stopped(&mut self, text: Option<String>, reason: StopReason) -> Emitted {
        self.stop = Some(reason);
        Emitted { text, stop: Some(reason) }
    }

    /// Tokens pushed so far, stop tokens included.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Tokens it may still generate under `max_new_tokens`.
    pub fn remaining(&self) -> usize {
        self.max_new_tokens.saturating_sub(self.generated)
    }

    /// Why the sequence stopped, once a pushed token stopped it.
    pub fn stop(&self) -> Option<StopReason> {
        self.stop
    }

    /// Ends the sequence: the text still held back (a character left split by the last token,
    /// the start of a stop string that never completed; with incomplete characters replaced),
    /// nothing after a stop string. A second call returns nothing.
    pub fn finish(&mut self) -> String {
        if let Some(StopReason::StopString(_)) = self.stop {
            return String::new();
        }
        let rest = self.utf8.finish();
        let pushed = self.stop_text.push(&rest);
        if let Some(index) = pushed.stopped {
            self.stop = Some(StopReason::StopString(index));
            return pushed.text;
        }
        pushed.text + &self.stop_text.finish()
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was generated (it is included in the tokens, not in the text).
    StopToken(u32),
    /// The text reached the stop string of this index ([`GenerationConfig::stop_strings`]); it
    /// and what follows are not in the text.
    StopString(usize),
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The model's context is full.
    ContextFull,
    /// The interrupt flag was raised (Ctrl-C), or a token stream was finished early.
    Interrupted,
    /// A step failed (the error was returned).
    Failed,
}

/// One generated token and the text it completes (empty while a character is still split
/// across tokens; stop tokens are not yielded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub id: u32,
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOM: Room = Room { used: 0, capacity: 1000 };

    fn output(stop_tokens: &[u32], stop_strings: &[&str], max_new_tokens: usize) -> SequenceOutput {
        SequenceOutput::new(OutputRules {
            stop_tokens: stop_tokens.to_vec(),
            stop_strings: stop_strings.iter().map(|s| s.to_string()).collect(),
            max_new_tokens,
        })
    }

    /// Pushes byte pieces as tokens 100, 101, ...; returns the text handed out (with the
    /// finish) and the reason it stopped.
    fn run(output: &mut SequenceOutput, pieces: &[&[u8]]) -> (String, Option<StopReason>) {
        let mut text = String::new();
        for (i, piece) in pieces.iter().enumerate() {
            let emitted = output.push(100 + i as u32, piece, ROOM);
            text.push_str(emitted.text.as_deref().unwrap_or(""));
            if emitted.stop.is_some() {
                break;
            }
        }
        text.push_str(&output.finish());
        (text, output.stop())
    }

    #[test]
    fn a_stop_token_ends_the_sequence_without_text() {
        let mut out = output(&[7], &[], 10);
        assert_eq!(out.push(3, b"ab", ROOM), Emitted { text: Some("ab".into()), stop: None });
        assert_eq!(out.push(7, b"<eos>", ROOM), Emitted { text: None, stop: Some(StopReason::StopToken(7)) });
        assert_eq!(out.generated(), 2);
        assert_eq!(out.finish(), "");
    }

    #[test]
    fn stop_strings_cut_across_tokens_and_drop_what_follows() {
        let mut out = output(&[], &["END"], 10);
        assert_eq!(run(&mut out, &[b"abc E", b"N", b"D tail"]), ("abc ".into(), Some(StopReason::StopString(0))));
        assert_eq!(out.finish(), "", "nothing after a stop string");
        let mut out = output(&[], &["END"], 10);
        assert_eq!(run(&mut out, &[b"abc E", b"x"]), ("abc Ex".into(), None));
    }

    #[test]
    fn limits_stop_after_the_token_and_hand_out_what_was_held() {
        // The last token's "E" could start the stop string: held, then handed out at the end.
        let mut out = output(&[], &["END"], 2);
        assert_eq!(run(&mut out, &[b"a", b"bE"]), ("abE".into(), Some(StopReason::MaxTokens)));
        let mut out = output(&[], &[], 10);
        let full = Room { used: 10, capacity: 10 };
        assert_eq!(out.push(1, b"x", full), Emitted { text: Some("x".into()), stop: Some(StopReason::ContextFull) });
        // The limit wins over a full cache; a stop string over both.
        let mut out = output(&[], &["x"], 1);
        assert_eq!(out.push(1, b"yx", full).stop, Some(StopReason::StopString(0)));
        let mut out = output(&[], &[], 1);
        assert_eq!(out.push(1, b"y", full).stop, Some(StopReason::MaxTokens));
    }

    #[test]
    fn characters_split_across_tokens_are_held_and_the_rest_replaced_at_the_end() {
        let bytes = "日本".as_bytes();
        let mut out = output(&[], &[], 10);
        assert_eq!(out.push(1, &bytes[..2], ROOM).text.as_deref(), Some(""));
        assert_eq!(out.push(2, &bytes[2..4], ROOM).text.as_deref(), Some("日"));
        assert_eq!(out.finish(), "\u{FFFD}");
        assert_eq!(out.finish(), "", "a second finish hands out nothing");
        // A stop string completed by the held bytes' replacement still stops.
        let mut out = output(&[], &["\u{FFFD}"], 10);
        out.push(1, &bytes[..1], ROOM);
        assert_eq!(out.finish(), "");
        assert_eq!(out.stop(), Some(StopReason::StopString(0)));
    }

    #[test]
    fn rules_no_sequence_can_follow_are_refused() {
        let rules = OutputRules { max_new_tokens: 0, ..Default::default() };
        assert!(matches!(rules.check(), Err(Error::Request(RequestError::NoNewTokens))));
        let rules =
            OutputRules { max_new_tokens: 1, stop_strings: vec!["a".into(), String::new()], ..Default::default() };
        assert!(matches!(rules.check(), Err(Error::Request(RequestError::EmptyStopString { index: 1 }))));
    }
}
