//! Tool calls: how each model family writes them, parsed out of the generated text into
//! OpenAI's `tool_calls`, and the grammar that makes the model write a valid one when the
//! request requires it (`tool_choice: "required"` or a named function).
//!
//! Formats (chosen from the chat template's text, or by `--tool-call-format`):
//! - `hermes` (Qwen2.5, Hermes, and the templates that write `<tool_call>`):
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call;
//! - `llama3` (Llama 3.1-3.3): a JSON object `{"name": ..., "parameters": {...}}`, after an
//!   optional `<|python_tag|>`, several separated by `;`;
//! - `json` (any other template): the whole reply a JSON object `{"name", "arguments"}`,
//!   an array of them, or `{"tool_calls": [...]}`, optionally in a Markdown code fence;
//!   the tools and this format are described to the model in a system message when the
//!   template does not render `tools` itself.

use memra_engine::constraint::{with_json_options, Grammar};
use serde_json::{json, Value};

/// How the model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Json,
}

impl ToolFormat {
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        match name {
            "hermes" | "qwen" => Some(ToolFormat::Hermes),
            "llama3" => Some(ToolFormat::Llama3),
            "json" => Some(ToolFormat::Json),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Json => "json",
        }
    }

    /// The format a chat template teaches its model (by what the template writes).
    pub fn detect(template: &str) -> ToolFormat {
        if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>")
            || (template.contains("<|start_header_id|>") && template.contains("tools"))
        {
            ToolFormat::Llama3
        } else {
            ToolFormat::Json
        }
    }

    /// The key of a call's arguments in this format.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }
}

/// A declared function: its name and its parameters' JSON schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// A call found in the output.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: Value,
}

impl Call {
    /// OpenAI's `function.arguments`: the arguments as a JSON string.
    pub fn arguments_json(&self) -> String {
        self.arguments.to_string()
    }
}

/// How a chat request's output is searched for tool calls.
pub struct ToolParse {
    pub format: ToolFormat,
    pub tools: Vec<Tool>,
    pub parallel: bool,
}

impl ToolParse {
    pub fn parse(&self, text: &str) -> Parsed {
        parse(self.format, text, &self.tools, self.parallel)
    }
}

/// The output as text before the calls (if any) and the calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<Call>,
}

pub const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// The call `v` stands for, when it names a declared tool: `{"name", key: {...}}` (the
/// arguments an object, or a string holding one).
fn call_of(v: &Value, key: &str, tools: &[Tool]) -> Option<Call> {
    let name = v.get("name")?.as_str()?;
    if !tools.iter().any(|t| t.name == name) {
        return None;
    }
    let args = match v.get(key).or_else(|| v.get("arguments")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?,
        Some(a) => a.clone(),
    };
    args.is_object().then(|| Call {
        name: name.to_string(),
        arguments: args,
    })
}

/// The text with a Markdown code fence around it removed.
fn unfence(s: &str) -> &str {
    let t = s.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

fn nonempty(s: &str) -> Option<String> {
    let t = s.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// Splits the model's output into text and calls. Output that is not a well-formed call
/// of a declared tool stays text, whole. With `parallel` false, only the first call counts.
pub fn parse(format: ToolFormat, text: &str, tools: &[Tool], parallel: bool) -> Parsed {
    let key = format.arguments_key();
    let plain = || Parsed {
        content: Some(text.to_string()),
        calls: Vec::new(),
    };
    let mut parsed = match format {
        ToolFormat::Hermes => {
            // Small models taught the tags often write the bare JSON (Qwen2.5-Coder 0.5B
            // does): that is a call too.
            let Some(first) = text.find(HERMES_OPEN) else {
                return parse(ToolFormat::Json, text, tools, parallel);
            };
            let mut calls = Vec::new();
            let mut rest = &text[first..];
            while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
                // The last block may end at the end of the output, unclosed.
                let (inner, after) = match body.find(HERMES_CLOSE) {
                    Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
                    None => (body, ""),
                };
                let Some(call) = serde_json::from_str::<Value>(inner.trim())
                    .ok()
                    .and_then(|v| call_of(&v, key, tools))
                else {
                    return plain();
                };
                calls.push(call);
                rest = after.trim_start();
            }
            Parsed {
                content: nonempty(&text[..first]),
                calls,
            }
        }
        ToolFormat::Llama3 => {
            let t = text.trim_start();
            let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
            if !t.starts_with('{') {
                return plain();
            }
            // Several calls separated by `;` (what Llama 3.1 writes for parallel calls).
            let calls: Option<Vec<Call>> = json_values(t, ';')
                .and_then(|vs| vs.iter().map(|v| call_of(v, key, tools)).collect());
            let Some(calls) = calls else {
                return plain();
            };
            if calls.is_empty() {
                return plain();
            }
            Parsed {
                content: None,
                calls,
            }
        }
        ToolFormat::Json => {
            let Ok(v) = serde_json::from_str::<Value>(unfence(text)) else {
                return plain();
            };
            let items: Vec<&Value> = match &v {
                Value::Array(a) => a.iter().collect(),
                Value::Object(o) if o.contains_key("tool_calls") => match &o["tool_calls"] {
                    Value::Array(a) => a.iter().collect(),
                    _ => return plain(),
                },
                Value::Object(o) if o.contains_key("tool_call") => vec![&o["tool_call"]],
                _ => vec![&v],
            };
            let calls: Option<Vec<Call>> = items.iter().map(|c| call_of(c, key, tools)).collect();
            match calls {
                Some(calls) if !calls.is_empty() => Parsed {
                    content: None,
                    calls,
                },
                _ => return plain(),
            }
        }
    };
    if !parallel {
        parsed.calls.truncate(1);
    }
    parsed
}

/// The JSON values of `s`, one after the other with `sep` between them (a `sep` inside
/// a string is part of it); `None` unless all of `s` is such values.
fn json_values(s: &str, sep: char) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        out.push(values.next()?.ok()?);
        rest = rest[values.byte_offset()..].trim_start();
        if let Some(more) = rest.strip_prefix(sep) {
            rest = more.trim_start();
        } else if !rest.is_empty() {
            return None;
        }
    }
    Some(out)
}

/// Where in `text` a tool call may start, for streaming: text before it can be sent as
/// content, the rest must wait for the parse at the end. `None` when nothing in `text`
/// can be (or become, with more text) a call. `at_start`: `text` begins the reply.
pub fn call_start(format: ToolFormat, text: &str, at_start: bool) -> Option<usize> {
    // A reply that is (or may become) one JSON call, in any format.
    let json_reply = || {
        let t = text.trim_start();
        let could = t.is_empty()
            || t.starts_with('{')
            || t.starts_with('[')
            || PYTHON_TAG.starts_with(t)
            || t.starts_with(PYTHON_TAG)
            || "```".starts_with(t)
            || t.starts_with("```");
        (at_start && could).then_some(0)
    };
    match format {
        ToolFormat::Hermes => json_reply().or_else(|| text.find(HERMES_OPEN)).or_else(|| {
            // A suffix that may grow into the marker.
            (1..HERMES_OPEN.len())
                .rev()
                .find(|&k| text.ends_with(&HERMES_OPEN[..k]))
                .map(|k| text.len() - k)
        }),
        // These formats are a call only when the whole reply is one: anything but
        // whitespace before a JSON start (or a fence, or the tag) makes it text.
        ToolFormat::Llama3 | ToolFormat::Json => json_reply(),
    }
}

/// The grammar that forces a call of one of `tools` (all, or only `only`), in `format`.
pub fn grammar(format: ToolFormat, tools: &[Tool], only: Option<&str>, parallel: bool) -> Grammar {
    let key = format.arguments_key();
    let alternatives: Vec<Value> = tools
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .map(|t| {
            let mut props = serde_json::Map::new();
            props.insert("name".into(), json!({"const": t.name}));
            props.insert(key.into(), t.parameters.clone());
            json!({
                "type": "object",
                "properties": props,
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let one = match alternatives.len() {
        1 => alternatives.into_iter().next().expect("one"),
        _ => json!({"anyOf": alternatives}),
    };
    let schema = |s: Value| with_json_options(s).expect("an object schema").to_string();
    let lark = match format {
        ToolFormat::Hermes => {
            let call = format!("\"{HERMES_OPEN}\\n\" call_json \"\\n{HERMES_CLOSE}\"");
            let start = match parallel {
                true => "start: call (\"\\n\" call)*".to_string(),
                false => "start: call".to_string(),
            };
            format!("{start}\ncall: {call}\ncall_json: %json {}\n", schema(one))
        }
        ToolFormat::Llama3 => format!("start: %json {}\n", schema(one)),
        ToolFormat::Json => {
            let body = match parallel {
                true => json!({"type": "array", "items": one, "minItems": 1}),
                false => one,
            };
            format!("start: %json {}\n", schema(body))
        }
    };
    Grammar::Lark(lark)
}

/// A system message that describes the tools and the `json` format, for templates that do
/// not render `tools` themselves.
pub fn json_format_prompt(tools: &Value, parallel: bool) -> String {
    let shape = match parallel {
        true => "a JSON array of calls, each {\"name\": <function name>, \"arguments\": <arguments object>}",
        false => "a JSON object {\"name\": <function name>, \"arguments\": <arguments object>}",
    };
    format!(
        "You can call these functions:\n{}\n\nTo call functions, reply with only {shape}, \
         and nothing else. Otherwise, answer normally.",
        serde_json::to_string_pretty(tools).unwrap_or_default()
    )
}

/// A fresh call id in OpenAI's form (`call_` and 24 letters and digits).
pub fn call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut z = crate::unix_time_micros()
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut id = String::from("call_");
    for _ in 0..24 {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        id.push(ALPHABET[(z >> 33) as usize % ALPHABET.len()] as char);
    }
    id
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
