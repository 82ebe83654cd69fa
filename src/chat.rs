//! The Gemma chat template.

/// Formats one user turn and opens the model's turn:
/// `<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n`.
pub fn user_turn(text: &str) -> String {
    format!("<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n")
}

/// What follows a finished model reply before the next user turn: the reply's `<end_of_turn>`
/// (if generation stopped on it, it is already in the context) and a newline.
pub const TURN_SEPARATOR: &str = "\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_template() {
        assert_eq!(user_turn("Hi"), "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
        let convo = format!("{}Hello!<end_of_turn>{TURN_SEPARATOR}{}", user_turn("Hi"), user_turn("Again"));
        assert_eq!(
            convo,
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
        );
    }
}
