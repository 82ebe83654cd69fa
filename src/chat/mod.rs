//! The Gemma chat templates: plain turns for every generation ([`ChatTemplate`]), and Gemma 4's
//! system turn, thinking and tool calls ([`gemma4`]).

pub mod conversation;
pub mod gemma4;
pub mod gemma4_value;

pub use conversation::{ChatError, ChatMessage, ReplyEnd, Role};

pub use gemma4::{ModelReply, ReplyPart, ReplyRouter, SystemTurn, Thinking, ToolCall, ToolDeclaration, ToolResponse};

use burn_gemma_model::Architecture;

/// How a conversation is laid out in tokens: Gemma 1-3's `<start_of_turn>` turns, or Gemma 4's
/// `<|turn>` turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n`.
    Gemma,
    /// `<|turn>user\n{text}<turn|>\n<|turn>model\n`.
    Gemma4,
}

/// What follows a finished model reply before the next user turn: the reply's end-of-turn token
/// (if generation stopped on it, it is already in the context) and a newline.
pub const TURN_SEPARATOR: &str = "\n";

impl ChatTemplate {
    /// The template of an architecture.
    pub fn for_architecture(arch: Architecture) -> Self {
        match arch {
            Architecture::Gemma4 => Self::Gemma4,
            _ => Self::Gemma,
        }
    }

    /// Formats one user turn and opens the model's turn.
    pub fn user_turn(self, text: &str) -> String {
        match self {
            Self::Gemma => format!("<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"),
            Self::Gemma4 => format!("<|turn>user\n{text}<turn|>\n<|turn>model\n"),
        }
    }

    /// The special token that closes a turn (and stops generation).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            Self::Gemma => "<end_of_turn>",
            Self::Gemma4 => "<turn|>",
        }
    }
}

/// Gemma 1-3's user turn (see [`ChatTemplate::user_turn`]).
pub fn user_turn(text: &str) -> String {
    ChatTemplate::Gemma.user_turn(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_templates() {
        assert_eq!(user_turn("Hi"), "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
        let convo = format!("{}Hello!<end_of_turn>{TURN_SEPARATOR}{}", user_turn("Hi"), user_turn("Again"));
        assert_eq!(
            convo,
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
        );
        let gemma4 = ChatTemplate::for_architecture(Architecture::Gemma4);
        let convo = format!(
            "{}Hello!{}{TURN_SEPARATOR}{}",
            gemma4.user_turn("Hi"),
            gemma4.end_of_turn(),
            gemma4.user_turn("Again")
        );
        assert_eq!(
            convo,
            "<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nAgain<turn|>\n<|turn>model\n"
        );
        assert_eq!(ChatTemplate::for_architecture(Architecture::Gemma3), ChatTemplate::Gemma);
    }
}
