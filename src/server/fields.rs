//! Which request fields the server reads, which it knows and does not implement, and what it
//! does with the rest ([`UnknownFields`]): no field is ignored without the client being told.
//!
//! A field the server does not implement is accepted only at the value that asks for nothing
//! (`"logprobs": false`, `"tools": []`, `"response_format": {"type": "text"}` ...); any other
//! value gets a 400 naming it, whatever [`UnknownFields`] says.

use super::{config::UnknownFields, openai::ApiError, Endpoint};
use serde_json::{Map, Value};

/// How the server treats a known field.
#[derive(Debug, Clone, Copy)]
enum Rule {
    /// Read and applied.
    Read,
    /// An identifier of the caller, with no effect on the answer (`user`).
    Identifier,
    /// Not implemented: accepted only where `off` says its value asks for nothing.
    OnlyOff { off: fn(&Value) -> bool, accepted: &'static str },
}

fn null(v: &Value) -> bool {
    v.is_null()
}
fn null_or_false(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}
fn null_or_zero(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(0)
}
fn null_or_one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}
fn null_or_empty(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty)
}
fn null_or_empty_text(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("")
}
fn text_format(v: &Value) -> bool {
    v.is_null() || v.as_object().is_some_and(|o| o.len() == 1 && o.get("type") == Some(&Value::from("text")))
}
fn no_tool_choice(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}
fn text_modality(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(|m| m.iter().all(|m| m.as_str() == Some("text")))
}
fn default_tier(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("auto" | "default"))
}
fn null_or_bool(v: &Value) -> bool {
    v.is_null() || v.is_boolean()
}

const fn off(off: fn(&Value) -> bool, accepted: &'static str) -> Rule {
    Rule::OnlyOff { off, accepted }
}

/// The fields both endpoints share.
const SHARED: &[(&str, Rule)] = &[
    ("model", Rule::Read),
    ("stream", Rule::Read),
    ("stream_options", Rule::Read),
    ("max_tokens", Rule::Read),
    ("temperature", Rule::Read),
    ("top_p", Rule::Read),
    ("top_k", Rule::Read),
    ("min_p", Rule::Read),
    ("seed", Rule::Read),
    ("stop", Rule::Read),
    ("n", Rule::Read),
    ("frequency_penalty", Rule::Read),
    ("presence_penalty", Rule::Read),
    ("user", Rule::Identifier),
    ("safety_identifier", Rule::Identifier),
    ("prompt_cache_key", Rule::Identifier),
    ("logit_bias", off(null_or_empty, "null or {}")),
    ("service_tier", off(default_tier, "null, \"auto\" or \"default\"")),
    ("store", off(null_or_false, "null or false")),
    ("metadata", off(null_or_empty, "null or {}")),
];

const COMPLETIONS: &[(&str, Rule)] = &[
    ("prompt", Rule::Read),
    ("logprobs", off(null, "null")),
    ("echo", off(null_or_false, "null or false")),
    ("suffix", off(null_or_empty_text, "null or \"\"")),
    ("best_of", off(null_or_one, "null or 1")),
];

const CHAT: &[(&str, Rule)] = &[
    ("messages", Rule::Read),
    ("max_completion_tokens", Rule::Read),
    ("logprobs", off(null_or_false, "null or false")),
    ("top_logprobs", off(null_or_zero, "null or 0")),
    ("tools", off(null_or_empty, "null or []")),
    ("tool_choice", off(no_tool_choice, "null or \"none\"")),
    // Without tools (refused above unless empty) it changes nothing.
    ("parallel_tool_calls", off(null_or_bool, "null, true or false")),
    ("functions", off(null_or_empty, "null or []")),
    ("function_call", off(no_tool_choice, "null or \"none\"")),
    ("response_format", off(text_format, "null or {\"type\": \"text\"}")),
    ("reasoning_effort", off(null, "null")),
    ("chat_template_kwargs", off(null_or_empty, "null or {}")),
    ("modalities", off(text_modality, "null or [\"text\"]")),
    ("audio", off(null, "null")),
    ("prediction", off(null, "null")),
    ("web_search_options", off(null, "null")),
];

/// A chat message's fields; the roles and contents are checked where the chat is rendered.
const MESSAGE: &[(&str, Rule)] = &[
    ("role", Rule::Read),
    ("content", Rule::Read),
    ("name", off(null, "null (names of participants are not implemented)")),
    ("tool_calls", off(null_or_empty, "null or []")),
    ("tool_call_id", off(null, "null")),
    ("function_call", off(null, "null")),
    ("refusal", off(null, "null")),
    ("reasoning_content", off(null, "null")),
];

const STREAM_OPTIONS: &[(&str, Rule)] = &[("include_usage", Rule::Read)];

/// A content part's fields (its `type` says which are read).
const CONTENT_PART: &[(&str, Rule)] = &[("type", Rule::Read), ("text", Rule::Read), ("image_url", Rule::Read)];

const IMAGE_URL: &[(&str, Rule)] = &[("url", Rule::Read), ("detail", off(auto_detail, "null or \"auto\""))];

fn auto_detail(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

/// Checks every field of `body` (a JSON object) against what `endpoint` reads: a field the
/// server does not implement, set to ask for something, is refused; an unknown one refused or,
/// where `unknown` says so, ignored and returned (by its path).
pub(super) fn check(body: &Value, endpoint: Endpoint, unknown: UnknownFields) -> Result<Vec<String>, ApiError> {
    let Some(object) = body.as_object() else {
        return Err(ApiError::invalid_body("the request body must be a JSON object"));
    };
    let mut ignored = Vec::new();
    let own = match endpoint {
        Endpoint::Completions => COMPLETIONS,
        Endpoint::Chat => CHAT,
    };
    check_object(object, &[SHARED, own], "", unknown, &mut ignored)?;
    if let Some(options) = object.get("stream_options").and_then(Value::as_object) {
        check_object(options, &[STREAM_OPTIONS], "stream_options.", unknown, &mut ignored)?;
    }
    let messages = object.get("messages").and_then(Value::as_array).filter(|_| endpoint == Endpoint::Chat);
    for (i, message) in messages.into_iter().flatten().enumerate() {
        let Some(message) = message.as_object() else { continue };
        check_object(message, &[MESSAGE], &format!("messages[{i}]."), unknown, &mut ignored)?;
        let parts = message.get("content").and_then(Value::as_array);
        for (j, part) in parts.into_iter().flatten().enumerate() {
            let Some(part) = part.as_object() else { continue };
            let at = format!("messages[{i}].content[{j}].");
            check_object(part, &[CONTENT_PART], &at, unknown, &mut ignored)?;
            if let Some(url) = part.get("image_url").and_then(Value::as_object) {
                check_object(url, &[IMAGE_URL], &format!("{at}image_url."), unknown, &mut ignored)?;
            }
        }
    }
    Ok(ignored)
}

fn check_object(
    object: &Map<String, Value>,
    tables: &[&[(&str, Rule)]],
    at: &str,
    unknown: UnknownFields,
    ignored: &mut Vec<String>,
) -> Result<(), ApiError> {
    // The request's top-level field names the error (as OpenAI's `param` does).
    let param = |name: &str| match at.split(['.', '[']).next().filter(|f| !f.is_empty()) {
        Some(top) => top.to_string(),
        None => name.to_string(),
    };
    for (name, value) in object {
        let rule = tables.iter().flat_map(|t| t.iter()).find(|(n, _)| n == name).map(|(_, r)| *r);
        match rule {
            Some(Rule::Read | Rule::Identifier) => {}
            Some(Rule::OnlyOff { off, .. }) if off(value) => {}
            Some(Rule::OnlyOff { accepted, .. }) => {
                let shown = shown(value);
                let message = format!(
                    "{at}{name} = {shown} is not implemented by this server; leave it out or set it to {accepted}"
                );
                return Err(ApiError::invalid_owned(param(name), message));
            }
            None => match unknown {
                UnknownFields::Refuse => {
                    let message = format!(
                        "unknown field {at}{name}: this server does not know it (start it with \
                         --ignore-unknown-fields to have such fields ignored)"
                    );
                    return Err(ApiError::invalid_owned(param(name), message));
                }
                UnknownFields::Ignore => ignored.push(format!("{at}{name}")),
            },
        }
    }
    Ok(())
}

/// A value as shown in an error: its JSON, cut short.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(60) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value, unknown: UnknownFields) -> Result<Vec<String>, ApiError> {
        check(&body, Endpoint::Chat, unknown)
    }

    #[test]
    fn fields_asking_for_what_is_not_implemented_are_refused_by_name() {
        let user = json!([{ "role": "user", "content": "hi" }]);
        for (field, value) in [
            ("logprobs", json!(true)),
            ("top_logprobs", json!(3)),
            ("tools", json!([{ "type": "function", "function": { "name": "f" } }])),
            ("tool_choice", json!("required")),
            ("response_format", json!({ "type": "json_object" })),
            ("logit_bias", json!({ "42": 5 })),
            ("reasoning_effort", json!("high")),
            ("parallel_tool_calls", json!("yes")),
        ] {
            let mut body = json!({ "messages": user });
            body[field] = value.clone();
            for unknown in [UnknownFields::Refuse, UnknownFields::Ignore] {
                let e = chat(body.clone(), unknown).expect_err(field);
                assert_eq!(e.param.as_deref(), Some(field), "{e:?}");
                assert!(e.message.contains("not implemented"), "{e:?}");
            }
        }
        // Their off values are accepted.
        let body = json!({
            "messages": user, "logprobs": false, "tools": [], "tool_choice": "none",
            "response_format": { "type": "text" }, "logit_bias": {}, "user": "u-1", "store": false,
        });
        assert_eq!(chat(body, UnknownFields::Refuse).map_err(|e| e.message), Ok(vec![]));
        let e = check(&json!({ "prompt": "a", "logprobs": 0 }), Endpoint::Completions, UnknownFields::Refuse);
        assert_eq!(e.err().and_then(|e| e.param).as_deref(), Some("logprobs"));
    }

    #[test]
    fn unknown_fields_are_refused_or_ignored_and_named() {
        let body = json!({ "messages": [{ "role": "user", "content": [
            { "type": "text", "text": "hi", "cache_control": {} }
        ] }], "frobnicate": 1 });
        let e = chat(body.clone(), UnknownFields::Refuse).expect_err("unknown");
        assert_eq!(e.param.as_deref(), Some("frobnicate"));
        assert_eq!(
            chat(body, UnknownFields::Ignore).map_err(|e| e.message),
            Ok(vec!["frobnicate".to_string(), "messages[0].content[0].cache_control".to_string()])
        );
        // A field of the other endpoint is unknown here.
        let e = check(&json!({ "prompt": "a", "messages": [] }), Endpoint::Completions, UnknownFields::Refuse);
        assert_eq!(e.err().and_then(|e| e.param).as_deref(), Some("messages"));
        let e = chat(json!({ "messages": [{ "role": "user", "content": "a", "name": "bob" }] }), UnknownFields::Refuse);
        assert_eq!(e.err().and_then(|e| e.param).as_deref(), Some("messages"));
        let e =
            chat(json!({ "messages": [], "stream_options": { "include_obfuscation": true } }), UnknownFields::Refuse);
        assert_eq!(e.err().and_then(|e| e.param).as_deref(), Some("stream_options"));
        assert!(chat(json!([1, 2]), UnknownFields::Refuse).is_err());
    }
}
