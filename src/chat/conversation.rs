//! A conversation laid out in the model's chat template: the one place where system
//! instructions, user and model turns become prompt text (for the generator, the engine and
//! the server alike).

use super::{ChatTemplate, SystemTurn, Thinking, TURN_SEPARATOR};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Instructions for the whole conversation (first message only).
    System,
    User,
    /// The model's earlier replies.
    Assistant,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        Self { role: Role::System, content: content.into() }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self { role: Role::User, content: content.into() }
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self { role: Role::Assistant, content: content.into() }
    }
}

/// Why a conversation cannot be laid out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    #[error("the conversation has no messages")]
    NoMessages,
    #[error("messages[{index}]: a system message must come first")]
    SystemNotFirst { index: usize },
    #[error("the last message must be the user's")]
    LastNotUser,
    #[error("messages[{index}]: the user's message is empty")]
    EmptyUserMessage { index: usize },
    /// Thinking or tool calls asked of a model before Gemma 4.
    #[error("{feature} need a Gemma 4 model (its chat template); this model's has none")]
    Gemma4Only { feature: &'static str },
}

impl ChatTemplate {
    /// The prompt text of `messages` from the conversation's start, the model's turn opened
    /// (no `<bos>`: the tokenizer adds it). A leading system message gives the instructions;
    /// Gemma 4 writes them as its system turn, Gemma 1-3 at the head of the first user message.
    ///
    /// ```
    /// use burn_gemma::chat::{ChatMessage, ChatTemplate};
    /// let text = ChatTemplate::Gemma.render(&[ChatMessage::system("Be brief."), ChatMessage::user("Hi")])?;
    /// assert_eq!(text, "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
    /// # Ok::<(), burn_gemma::chat::ChatError>(())
    /// ```
    pub fn render(self, messages: &[ChatMessage]) -> Result<String, ChatError> {
        self.render_with(&SystemTurn::default(), messages)
    }

    /// [`ChatTemplate::render`] after `system`'s turn (thinking and tools: Gemma 4 only). A leading
    /// system message replaces `system`'s instructions.
    pub fn render_with(self, system: &SystemTurn, messages: &[ChatMessage]) -> Result<String, ChatError> {
        self.check_system(system)?;
        // A leading system message: its text, and the messages to skip.
        let (first, skip) = match messages.first() {
            None => return Err(ChatError::NoMessages),
            Some(m) if m.role == Role::System => (Some(m.content.as_str()), 1),
            Some(_) => (None, 0),
        };
        let instructions = first.or(system.instructions.as_deref());
        // Gemma 4 opens with its system turn; Gemma 1-3 put the instructions in the first user turn.
        let (mut text, mut leading) = match self {
            ChatTemplate::Gemma4 => {
                let turn = SystemTurn { instructions: instructions.map(str::to_owned), ..system.clone() };
                (turn.render(), None)
            }
            ChatTemplate::Gemma => (String::new(), instructions),
        };
        for (index, message) in messages.iter().enumerate().skip(skip) {
            match message.role {
                Role::System => return Err(ChatError::SystemNotFirst { index }),
                Role::User => {
                    check_user(&message.content, index)?;
                    match leading.take() {
                        Some(s) => text.push_str(&self.user_turn(&format!("{s}\n\n{}", message.content))),
                        None => text.push_str(&self.user_turn(&message.content)),
                    }
                }
                Role::Assistant => {
                    text.push_str(&message.content);
                    text.push_str(self.end_of_turn());
                    text.push_str(TURN_SEPARATOR);
                }
            }
        }
        match messages.last() {
            Some(m) if m.role == Role::User => Ok(text),
            _ => Err(ChatError::LastNotUser),
        }
    }

    /// The text that follows a conversation already in the context with one more user turn:
    /// the previous reply's turn closed (`ended` says whether its end-of-turn token is already
    /// there), then `message`'s turn, the model's opened.
    pub fn next_turn(self, ended: ReplyEnd, message: &str) -> Result<String, ChatError> {
        check_user(message, 0)?;
        let mut text = String::new();
        if ended == ReplyEnd::Open {
            text.push_str(self.end_of_turn());
        }
        text.push_str(TURN_SEPARATOR);
        text.push_str(&self.user_turn(message));
        Ok(text)
    }

    /// Refuses what Gemma 1-3's template cannot say (thinking, tools).
    pub fn check_system(self, system: &SystemTurn) -> Result<(), ChatError> {
        if self == ChatTemplate::Gemma4 {
            return Ok(());
        }
        match (system.thinking, system.tools.is_empty()) {
            (Thinking::On, _) => Err(ChatError::Gemma4Only { feature: "thinking" }),
            (_, false) => Err(ChatError::Gemma4Only { feature: "tool calls" }),
            _ => Ok(()),
        }
    }
}

/// Whether the model's last reply closed its turn itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyEnd {
    /// It stopped on its end-of-turn token, which is in the context.
    Closed,
    /// It was cut short (a limit, a stop string): the turn is closed for it.
    Open,
}

fn check_user(content: &str, index: usize) -> Result<(), ChatError> {
    match content.trim().is_empty() {
        true => Err(ChatError::EmptyUserMessage { index }),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ToolDeclaration;

    #[test]
    fn conversations_in_both_templates() -> Result<(), ChatError> {
        let convo = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Hi"),
            ChatMessage::assistant("Hello!"),
            ChatMessage::user("Again"),
        ];
        assert_eq!(
            ChatTemplate::Gemma.render(&convo)?,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ChatTemplate::Gemma4.render(&convo)?,
            "<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n\
             <|turn>user\nAgain<turn|>\n<|turn>model\n"
        );
        // Without instructions Gemma 4 writes no system turn.
        assert_eq!(ChatTemplate::Gemma4.render(&convo[1..2])?, "<|turn>user\nHi<turn|>\n<|turn>model\n");
        Ok(())
    }

    #[test]
    fn the_system_turn_and_the_next_turn() -> Result<(), ChatError> {
        let tools = vec![ToolDeclaration {
            name: "f".into(),
            description: "d".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let system = SystemTurn { instructions: None, thinking: Thinking::On, tools };
        let text = ChatTemplate::Gemma4.render_with(&system, &[ChatMessage::user("Hi")])?;
        assert_eq!(text, format!("{}<|turn>user\nHi<turn|>\n<|turn>model\n", system.render()));
        assert!(text.starts_with("<|turn>system\n<|think|>\n<|tool>declaration:f"));
        assert_eq!(
            ChatTemplate::Gemma.render_with(&system, &[ChatMessage::user("Hi")]),
            Err(ChatError::Gemma4Only { feature: "thinking" })
        );
        assert_eq!(
            ChatTemplate::Gemma.next_turn(ReplyEnd::Open, "More")?,
            "<end_of_turn>\n<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ChatTemplate::Gemma4.next_turn(ReplyEnd::Closed, "More")?,
            "\n<|turn>user\nMore<turn|>\n<|turn>model\n"
        );
        Ok(())
    }

    #[test]
    fn bad_conversations_are_named() {
        let cases: [(&[ChatMessage], ChatError); 5] = [
            (&[], ChatError::NoMessages),
            (&[ChatMessage::user("a"), ChatMessage::system("s")], ChatError::SystemNotFirst { index: 1 }),
            (&[ChatMessage::user("a"), ChatMessage::assistant("b")], ChatError::LastNotUser),
            (&[ChatMessage::system("s")], ChatError::LastNotUser),
            (&[ChatMessage::system("s"), ChatMessage::user(" \n")], ChatError::EmptyUserMessage { index: 1 }),
        ];
        for template in [ChatTemplate::Gemma, ChatTemplate::Gemma4] {
            for (messages, error) in &cases {
                assert_eq!(template.render(messages).as_ref(), Err(error), "{template:?} {messages:?}");
            }
        }
        assert_eq!(ChatTemplate::Gemma.next_turn(ReplyEnd::Open, ""), Err(ChatError::EmptyUserMessage { index: 0 }));
    }
}
