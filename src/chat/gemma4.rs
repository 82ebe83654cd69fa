//! Gemma 4's chat layer beyond plain turns: the system turn (with `<|think|>` when thinking is
//! on, and tool declarations), the thought channel of a reply (`<|channel>thought ...
//! <channel|>`), tool calls (`<|tool_call>call:NAME{...}<tool_call|>`) and tool responses
//! (`<|tool_response>response:NAME{...}<tool_response|>`), rendered and parsed as Gemma 4's chat
//! template and llama.cpp's `common/parsers/gemma4.cpp` lay them out. Values inside use the
//! native syntax of [`super::gemma4_value`].

use super::gemma4_value::{self, write_object, QUOTE};
use serde_json::Value;

/// Whether the model thinks before it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Thinking {
    /// Answers at once (the default).
    #[default]
    Off,
    /// The system turn starts with `<|think|>`; the reply opens with a thought channel.
    On,
}

/// A tool the model may call: OpenAI's function shape (`parameters` is a JSON schema).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDeclaration {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

impl ToolDeclaration {
    /// `<|tool>declaration:NAME{description:...,parameters:{...}}<tool|>`: the schema in the
    /// native syntax, keys sorted, `type` names upper-cased (`STRING`, `OBJECT`).
    pub fn render(&self) -> String {
        let mut body = serde_json::Map::new();
        body.insert("description".into(), Value::String(self.description.clone()));
        body.insert("parameters".into(), upper_types(&self.parameters));
        let mut out = format!("<|tool>declaration:{}", self.name);
        write_object(body.iter(), &mut out);
        out.push_str("<tool|>");
        out
    }
}

/// A schema with every `type` name upper-cased, as the template writes them.
fn upper_types(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("type", Value::String(t)) => Value::String(t.to_uppercase()),
                        _ => upper_types(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(upper_types).collect()),
        other => other.clone(),
    }
}

/// A call the model made: the tool's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

impl ToolCall {
    /// `<|tool_call>call:NAME{...}<tool_call|>`.
    pub fn render(&self) -> String {
        format!("<|tool_call>call:{}{}<tool_call|>", self.name, native_object(&self.arguments))
    }
}

/// What a tool returned, for the model's next step.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResponse {
    pub name: String,
    /// An object is written as it is; anything else as `{value:...}`.
    pub response: Value,
}

impl ToolResponse {
    /// `<|tool_response>response:NAME{...}<tool_response|>`.
    pub fn render(&self) -> String {
        format!("<|tool_response>{}", self.render_after_open())
    }

    /// The response without its opening `<|tool_response>` (which the model itself writes when it
    /// hands over to the tool).
    pub fn render_after_open(&self) -> String {
        format!("response:{}{}<tool_response|>", self.name, native_object(&self.response))
    }
}

/// An object in the native syntax; a non-object as `{value:...}`.
fn native_object(value: &Value) -> String {
    match value {
        Value::Object(_) => gemma4_value::encode(value),
        other => gemma4_value::encode(&serde_json::json!({ "value": other })),
    }
}

/// The system turn: instructions, thinking, tools. Rendered only where it says something.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SystemTurn {
    pub instructions: Option<String>,
    pub thinking: Thinking,
    pub tools: Vec<ToolDeclaration>,
}

impl SystemTurn {
    /// `<|turn>system\n[<|think|>\n]{instructions}{declarations}<turn|>\n`, or nothing when there
    /// are no instructions, no tools and thinking is off.
    pub fn render(&self) -> String {
        if self.instructions.is_none() && self.tools.is_empty() && self.thinking == Thinking::Off {
            return String::new();
        }
        let mut out = String::from("<|turn>system\n");
        if self.thinking == Thinking::On {
            out.push_str("<|think|>\n");
        }
        if let Some(text) = &self.instructions {
            out.push_str(text);
        }
        for tool in &self.tools {
            out.push_str(&tool.render());
        }
        out.push_str("<turn|>\n");
        out
    }
}

/// A reply of the model, split into its parts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelReply {
    /// The thought channel's text, where the model thought.
    pub thought: Option<String>,
    /// The answer (without the thought, the calls and the control tokens around them).
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    /// Calls that did not parse (name and reason); their text stays in `content`.
    pub malformed_calls: Vec<String>,
}

const CHANNEL_OPEN: &str = "<|channel>";
const CHANNEL_CLOSE: &str = "<channel|>";
const CALL_OPEN: &str = "<|tool_call>";
const CALL_CLOSE: &str = "<tool_call|>";
/// Where the content of a reply ends.
const CONTENT_ENDS: [&str; 3] = ["<turn|>", "<|tool_response>", "<eos>"];

impl ModelReply {
    /// Splits a generated reply (decoded with its control tokens). Never fails: what does not
    /// parse stays text.
    pub fn parse(text: &str) -> Self {
        let mut reply = Self::default();
        let mut rest = text.strip_prefix("<|turn>model\n").unwrap_or(text);
        if let Some(end) = CONTENT_ENDS.iter().filter_map(|e| rest.find(e)).min() {
            rest = &rest[..end];
        }
        while !rest.is_empty() {
            let next =
                [CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN].iter().filter_map(|m| rest.find(m).map(|i| (i, *m))).min();
            let Some((at, marker)) = next else {
                reply.content.push_str(rest);
                break;
            };
            reply.content.push_str(&rest[..at]);
            rest = &rest[at + marker.len()..];
            match marker {
                CHANNEL_OPEN => {
                    let (inside, after) = rest.split_once(CHANNEL_CLOSE).unwrap_or((rest, ""));
                    // An empty channel (`<|channel><channel|>`) or one not named `thought` says nothing.
                    if let Some(thought) = inside.strip_prefix("thought") {
                        let thought = thought.trim_start_matches([' ', '\n']);
                        match &mut reply.thought {
                            Some(t) => t.push_str(thought),
                            None if !thought.is_empty() => reply.thought = Some(thought.to_string()),
                            None => {}
                        }
                    }
                    rest = after;
                }
                // A stray close (the model sometimes writes one): dropped.
                CHANNEL_CLOSE => {}
                _ => {
                    let (inside, after, closed) = match rest.split_once(CALL_CLOSE) {
                        Some((inside, after)) => (inside, after, true),
                        None => (rest, "", false),
                    };
                    match parse_call(inside) {
                        Ok(call) if closed => reply.tool_calls.push(call),
                        outcome => {
                            let reason = match outcome {
                                Err(e) => e,
                                Ok(_) => "the call is not closed with <tool_call|>".into(),
                            };
                            reply.malformed_calls.push(reason);
                            reply.content.push_str(CALL_OPEN);
                            reply.content.push_str(inside);
                            if closed {
                                reply.content.push_str(CALL_CLOSE);
                            }
                        }
                    }
                    rest = after;
                }
            }
        }
        reply.content = reply.content.trim().to_string();
        reply
    }

    /// The reply as the model writes it: thought channel, calls, then the content.
    pub fn render_generated(&self) -> String {
        let mut out = String::new();
        if let Some(thought) = &self.thought {
            out.push_str(&format!("{CHANNEL_OPEN}thought\n{thought}{CHANNEL_CLOSE}"));
        }
        for call in &self.tool_calls {
            out.push_str(&call.render());
        }
        out.push_str(&self.content);
        out
    }
}

/// `call:NAME{...}` -> the call.
fn parse_call(text: &str) -> Result<ToolCall, String> {
    let body =
        text.trim().strip_prefix("call:").ok_or_else(|| format!("{:?} does not start with `call:`", short(text)))?;
    let open = body.find('{').ok_or_else(|| format!("{:?} has no arguments", short(text)))?;
    let name = body[..open].trim();
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains(QUOTE) {
        return Err(format!("{:?} is not a tool name", short(name)));
    }
    let arguments = gemma4_value::decode(&body[open..]).map_err(|e| format!("call of {name}: {e}"))?;
    Ok(ToolCall { name: name.to_string(), arguments })
}

fn short(text: &str) -> String {
    text.chars().take(60).collect()
}

/// Where streamed reply text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyPart {
    Thought,
    Answer,
}

/// Routes a reply's text, as it streams, to the thought or the answer: the channel markers are
/// whole tokens, so they arrive whole, though possibly with other text in the same piece.
#[derive(Debug, Default)]
pub struct ReplyRouter {
    in_thought: bool,
    /// A thought channel's name (`thought\n`) still to skip.
    skip_name: bool,
}

impl ReplyRouter {
    /// Splits `piece` and calls `emit` with each part, markers left out.
    pub fn push(&mut self, mut piece: &str, mut emit: impl FnMut(ReplyPart, &str)) {
        while !piece.is_empty() {
            let marker = if self.in_thought { CHANNEL_CLOSE } else { CHANNEL_OPEN };
            let (before, after) = match piece.split_once(marker) {
                Some((b, a)) => (b, Some(a)),
                None => (piece, None),
            };
            let mut before = before;
            if self.skip_name && self.in_thought {
                let trimmed = before.strip_prefix("thought").unwrap_or(before).trim_start_matches('\n');
                if !trimmed.is_empty() || after.is_some() {
                    self.skip_name = false;
                }
                before = trimmed;
            }
            if !before.is_empty() {
                emit(if self.in_thought { ReplyPart::Thought } else { ReplyPart::Answer }, before);
            }
            match after {
                Some(a) => {
                    self.in_thought = !self.in_thought;
                    self.skip_name = self.in_thought;
                    piece = a;
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> ToolDeclaration {
        ToolDeclaration {
            name: "get_weather".into(),
            description: "Weather in a city".into(),
            parameters: json!({"type": "object", "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "city": {"type": "string", "description": "City"}}, "required": ["city"]}),
        }
    }

    #[test]
    fn system_turn_with_thinking_and_tools() {
        let system =
            SystemTurn { instructions: Some("Be brief.".into()), thinking: Thinking::On, tools: vec![weather()] };
        assert_eq!(
            system.render(),
            "<|turn>system\n<|think|>\nBe brief.<|tool>declaration:get_weather{description:<|\"|>Weather in a city<|\"|>,\
             parameters:{properties:{city:{description:<|\"|>City<|\"|>,type:<|\"|>STRING<|\"|>},\
             unit:{description:<|\"|>Unit<|\"|>,enum:[<|\"|>celsius<|\"|>,<|\"|>fahrenheit<|\"|>],type:<|\"|>STRING<|\"|>}},\
             required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|><turn|>\n"
        );
        assert_eq!(SystemTurn::default().render(), "");
        let thinking_only = SystemTurn { thinking: Thinking::On, ..Default::default() };
        assert_eq!(thinking_only.render(), "<|turn>system\n<|think|>\n<turn|>\n");
    }

    #[test]
    fn reply_with_thought_call_and_content() {
        let text = "<|channel>thought\nThe user wants Paris.<channel|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>";
        let reply = ModelReply::parse(text);
        assert_eq!(reply.thought.as_deref(), Some("The user wants Paris."));
        assert_eq!(
            reply.tool_calls,
            [ToolCall { name: "get_weather".into(), arguments: json!({"city": "Paris", "days": 2}) }]
        );
        assert_eq!(reply.content, "");
        // Content ends at the turn's end; an empty channel and a stray close say nothing.
        let reply = ModelReply::parse("<|turn>model\n<|channel><channel|>It is 15 C.<channel|><turn|>\nignored");
        assert_eq!((reply.thought, reply.content.as_str()), (None, "It is 15 C."));
        // A call that does not parse stays text, with the reason.
        let reply = ModelReply::parse("<|tool_call>call:f{a:<|\"|>x}<tool_call|>done");
        assert!(reply.tool_calls.is_empty() && reply.content.contains("call:f") && reply.content.ends_with("done"));
        assert_eq!(reply.malformed_calls.len(), 1, "{:?}", reply.malformed_calls);
        assert_eq!(ModelReply::parse("<|tool_call>call:f{}").malformed_calls.len(), 1);
    }

    #[test]
    fn render_then_parse_round_trips() {
        let reply = ModelReply {
            thought: Some("Two lookups.".into()),
            content: "Here you go.".into(),
            tool_calls: vec![
                ToolCall {
                    name: "a".into(),
                    arguments: json!({"q": "x: {y}", "n": [1, 2.5, null], "deep": {"ok": true}}),
                },
                ToolCall { name: "b".into(), arguments: json!({}) },
            ],
            malformed_calls: vec![],
        };
        assert_eq!(ModelReply::parse(&reply.render_generated()), reply);
    }

    #[test]
    fn tool_responses_render() {
        let object =
            ToolResponse { name: "get_weather".into(), response: json!({"weather": "sunny", "temperature": 15}) };
        assert_eq!(
            object.render(),
            "<|tool_response>response:get_weather{temperature:15,weather:<|\"|>sunny<|\"|>}<tool_response|>"
        );
        let text = ToolResponse { name: "read".into(), response: json!("file body") };
        assert_eq!(text.render_after_open(), "response:read{value:<|\"|>file body<|\"|>}<tool_response|>");
    }

    #[test]
    fn router_splits_streamed_pieces() {
        let pieces =
            ["<|channel>", "thought", "\nSo", "me thought", "<channel|>An", "swer<|channel>thought\nmore<channel|>!"];
        let mut router = ReplyRouter::default();
        let (mut thought, mut answer) = (String::new(), String::new());
        for p in pieces {
            router.push(p, |part, text| match part {
                ReplyPart::Thought => thought.push_str(text),
                ReplyPart::Answer => answer.push_str(text),
            });
        }
        assert_eq!((thought.as_str(), answer.as_str()), ("Some thoughtmore", "Answer!"));
    }
}
