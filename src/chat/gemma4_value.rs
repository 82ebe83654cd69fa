//! Gemma 4's native value syntax, the form tool declarations, calls and responses take inside
//! `<|tool>`, `<|tool_call>` and `<|tool_response>`: JSON-like, with bare keys (sorted, as the
//! chat template's `dictsort` writes them), every string between `<|"|>` tokens, and no spaces.
//!
//! `{city:<|"|>Paris<|"|>,days:3,units:[<|"|>C<|"|>]}`

use serde_json::{Map, Number, Value};

/// The string delimiter token.
pub const QUOTE: &str = "<|\"|>";

/// Why a native value did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Gemma 4 value at byte {at}: {reason}")]
pub struct ValueError {
    /// Byte offset into the parsed text.
    pub at: usize,
    pub reason: String,
}

/// Writes `value` in the native syntax (object keys sorted).
pub fn encode(value: &Value) -> String {
    let mut out = String::new();
    write(value, &mut out);
    out
}

fn write(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => {
            out.push_str(QUOTE);
            out.push_str(s);
            out.push_str(QUOTE);
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => write_object(map.iter(), out),
    }
}

/// An object's members in the native syntax, keys sorted.
pub(super) fn write_object<'a>(members: impl Iterator<Item = (&'a String, &'a Value)>, out: &mut String) {
    let mut members: Vec<_> = members.collect();
    members.sort_by(|a, b| a.0.cmp(b.0));
    out.push('{');
    for (i, (key, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(key);
        out.push(':');
        write(value, out);
    }
    out.push('}');
}

/// Parses one value in the native syntax; the whole text must be that value (whitespace around
/// tokens is allowed, as the model sometimes writes it).
pub fn decode(text: &str) -> Result<Value, ValueError> {
    let mut p = Parser { text, at: 0 };
    let value = p.value(0)?;
    p.space();
    if p.at != text.len() {
        return Err(p.fail("text after the value"));
    }
    Ok(value)
}

/// Deepest nesting accepted: model output is untrusted.
const MAX_DEPTH: usize = 64;

struct Parser<'a> {
    text: &'a str,
    at: usize,
}

impl Parser<'_> {
    fn fail(&self, reason: impl Into<String>) -> ValueError {
        ValueError { at: self.at, reason: reason.into() }
    }

    fn rest(&self) -> &str {
        &self.text[self.at..]
    }

    fn space(&mut self) {
        let trimmed = self.rest().trim_start();
        self.at = self.text.len() - trimmed.len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.space();
        if self.rest().starts_with(token) {
            self.at += token.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ValueError> {
        if depth > MAX_DEPTH {
            return Err(self.fail(format!("nested deeper than {MAX_DEPTH}")));
        }
        self.space();
        if self.eat(QUOTE) {
            let end = self.rest().find(QUOTE).ok_or_else(|| self.fail("a string is not closed"))?;
            let s = self.rest()[..end].to_string();
            self.at += end + QUOTE.len();
            return Ok(Value::String(s));
        }
        if self.eat("{") {
            let mut map = Map::new();
            if self.eat("}") {
                return Ok(Value::Object(map));
            }
            loop {
                self.space();
                let key_len = self.rest().find([':', '}', ',']).ok_or_else(|| self.fail("a key has no `:`"))?;
                let key = self.rest()[..key_len].trim();
                // Keys are bare; a model may also quote them.
                let key = key.strip_prefix(QUOTE).and_then(|k| k.strip_suffix(QUOTE)).unwrap_or(key);
                let key = key.trim_matches('"').to_string();
                if key.is_empty() {
                    return Err(self.fail("an empty key"));
                }
                self.at += key_len;
                if !self.eat(":") {
                    return Err(self.fail(format!("key {key:?} has no `:`")));
                }
                let value = self.value(depth + 1)?;
                map.insert(key, value);
                if self.eat("}") {
                    return Ok(Value::Object(map));
                }
                if !self.eat(",") {
                    return Err(self.fail("expected `,` or `}` in an object"));
                }
            }
        }
        if self.eat("[") {
            let mut items = Vec::new();
            if self.eat("]") {
                return Ok(Value::Array(items));
            }
            loop {
                items.push(self.value(depth + 1)?);
                if self.eat("]") {
                    return Ok(Value::Array(items));
                }
                if !self.eat(",") {
                    return Err(self.fail("expected `,` or `]` in an array"));
                }
            }
        }
        for (word, value) in [("true", Value::Bool(true)), ("false", Value::Bool(false)), ("null", Value::Null)] {
            if self.eat(word) {
                return Ok(value);
            }
        }
        let len = self
            .rest()
            .find(|c: char| !matches!(c, '0'..='9' | '-' | '+' | '.' | 'e' | 'E'))
            .unwrap_or(self.rest().len());
        let number = &self.rest()[..len];
        let parsed = serde_json::from_str::<Number>(number).map_err(|_| self.fail("expected a value"))?;
        self.at += len;
        Ok(Value::Number(parsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn encodes_sorted_with_quote_tokens() {
        let v = json!({"units": ["C", "F"], "city": "Paris", "days": 3, "exact": false, "note": null, "x": 1.5});
        assert_eq!(
            encode(&v),
            "{city:<|\"|>Paris<|\"|>,days:3,exact:false,note:null,units:[<|\"|>C<|\"|>,<|\"|>F<|\"|>],x:1.5}"
        );
    }

    #[test]
    fn round_trips_and_reads_model_spacing() {
        let v = json!({"a": {"b": [1, -2.5e3, true, null, {"c": "x, y: {z}"}]}, "empty": {}, "list": []});
        assert_eq!(decode(&encode(&v)).unwrap(), v);
        let spaced = "{ city: <|\"|>Paris<|\"|> , \"days\" : 3 }";
        assert_eq!(decode(spaced).unwrap(), json!({"city": "Paris", "days": 3}));
    }

    #[test]
    fn malformed_values_are_errors() {
        for bad in ["{city:<|\"|>Paris}", "{city}", "[1,2", "{a:1} trailing", "{:1}", "tru", ""] {
            assert!(decode(bad).is_err(), "{bad:?} parsed");
        }
        let deep = "[".repeat(100) + &"]".repeat(100);
        assert!(decode(&deep).unwrap_err().reason.contains("nested deeper"));
    }
}
