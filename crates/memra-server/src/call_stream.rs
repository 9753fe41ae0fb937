//! Tool calls in a streamed response: text that cannot start a call goes out as it comes;
//! from where a call may start, the text waits for the end, where the whole output is
//! parsed as a non-streamed response's is (so both give the same calls), and the calls go
//! out as OpenAI streams them: per call a piece with its index, id, type and name, then its
//! arguments in pieces.

use serde_json::{json, Value};

use crate::tools::{self, Call, ToolParse};

/// Characters of a call's arguments per streamed piece.
const ARGUMENT_PIECE_CHARS: usize = 16;

/// One choice's text while it may hold tool calls.
#[derive(Default)]
pub struct CallStream {
    text: String,
    /// Bytes of `text` sent as content.
    sent: usize,
    /// A `<tool_call>` block has begun: everything from `sent` on waits for the end.
    in_call: bool,
}

impl CallStream {
    /// Takes a piece of the output; returns the text that can go out as content now.
    pub fn push(&mut self, tp: &ToolParse, piece: &str) -> String {
        self.text.push_str(piece);
        if self.in_call {
            return String::new();
        }
        let pending = &self.text[self.sent..];
        let start = tools::call_start(tp.format, pending, self.sent == 0);
        let k = start.unwrap_or(pending.len());
        let out = pending[..k].to_string();
        // A partial marker, or a reply that may be a JSON call, waits for more text.
        self.in_call = pending[k..].starts_with(tools::HERMES_OPEN);
        self.sent += k;
        out
    }

    /// Takes the last piece; returns the content still to send and the calls (none: the
    /// held text was not a call, and is the content).
    pub fn finish(&mut self, tp: &ToolParse, piece: &str) -> (String, Vec<Call>) {
        self.text.push_str(piece);
        let calls = tp.parse(&self.text).calls;
        let rest = match calls.is_empty() {
            true => self.text[self.sent..].to_string(),
            false => String::new(),
        };
        self.sent = self.text.len();
        (rest, calls)
    }
}

/// The `delta.tool_calls` lists of the calls' pieces, in order.
pub fn call_deltas(calls: &[Call]) -> Vec<Value> {
    let mut out = Vec::new();
    for (j, call) in calls.iter().enumerate() {
        out.push(json!([{
            "index": j, "id": tools::call_id(), "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }]));
        let args: Vec<char> = call.arguments_json().chars().collect();
        for piece in args.chunks(ARGUMENT_PIECE_CHARS) {
            out.push(json!([{
                "index": j, "function": {"arguments": piece.iter().collect::<String>()},
            }]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{Tool, ToolFormat};

    fn tp(format: ToolFormat) -> ToolParse {
        let tool = |name: &str| Tool {
            name: name.into(),
            parameters: json!({"type": "object"}),
        };
        ToolParse {
            format,
            tools: vec![tool("add"), tool("get_weather")],
            parallel: true,
        }
    }

    /// Streams `text` in pieces of `n` characters; returns what went out as content and
    /// the calls.
    fn stream(tp: &ToolParse, text: &str, n: usize) -> (String, Vec<Call>) {
        let chars: Vec<char> = text.chars().collect();
        let mut cs = CallStream::default();
        let mut content = String::new();
        for piece in chars.chunks(n) {
            content += &cs.push(tp, &piece.iter().collect::<String>());
        }
        let (rest, calls) = cs.finish(tp, "");
        (content + &rest, calls)
    }

    /// Whatever the pieces, the streamed calls are the non-streamed ones, no text of a
    /// call goes out as content, and an answer without calls goes out whole.
    #[test]
    fn streamed_calls_and_content_equal_the_non_streamed_parse() {
        let cases = [
            (ToolFormat::Hermes, "Let me check.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>", "Let me check.\n"),
            (ToolFormat::Hermes, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", ""),
            (ToolFormat::Hermes, "Use a < b or <tool> tags; no call here.", "Use a < b or <tool> tags; no call here."),
            (ToolFormat::Hermes, "{\"answer\": 42}", "{\"answer\": 42}"),
            (ToolFormat::Llama3, "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 2}}", ""),
            (ToolFormat::Llama3, "The sum is 4.", "The sum is 4."),
            (ToolFormat::Json, "```json\n[{\"name\": \"add\", \"arguments\": {}}]\n```", ""),
            (ToolFormat::Json, "Sure: {\"name\": \"add\", \"arguments\": {}}", "Sure: {\"name\": \"add\", \"arguments\": {}}"),
        ];
        for (format, text, want_content) in cases {
            let tp = tp(format);
            let want = tp.parse(text).calls;
            for n in [1, 2, 3, 7, 1000] {
                let (content, calls) = stream(&tp, text, n);
                assert_eq!(calls, want, "{format:?} {text:?} in pieces of {n}");
                assert_eq!(
                    content, want_content,
                    "{format:?} {text:?} in pieces of {n}"
                );
            }
        }
    }

    #[test]
    fn calls_stream_as_openai_pieces() {
        let calls = [
            Call {
                name: "add".into(),
                arguments: json!({"a": 12345, "b": 678901234}),
            },
            Call {
                name: "get_weather".into(),
                arguments: json!({}),
            },
        ];
        let d = call_deltas(&calls);
        assert_eq!(d[0][0]["index"], 0);
        assert!(d[0][0]["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(
            (
                d[0][0]["type"].as_str(),
                d[0][0]["function"]["name"].as_str()
            ),
            (Some("function"), Some("add"))
        );
        let args: String = d[1..3]
            .iter()
            .map(|p| p[0]["function"]["arguments"].as_str().unwrap())
            .collect();
        assert_eq!(args, "{\"a\":12345,\"b\":678901234}");
        assert!(d[1][0].get("id").is_none());
        assert_eq!(
            (
                d[3][0]["index"].as_i64(),
                d[3][0]["function"]["name"].as_str()
            ),
            (Some(1), Some("get_weather"))
        );
        assert_eq!(d[4][0]["function"]["arguments"], "{}");
        assert_eq!(d.len(), 5);
    }
}
