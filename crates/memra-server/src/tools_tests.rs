//! The tool-call parsers on outputs of each format (as the models write them: spacing,
//! several calls, arguments as strings, fences), plain answers left as text, and the
//! grammars' shapes.

use super::*;

fn tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        },
        Tool {
            name: "add".into(),
            parameters: json!({"type": "object", "properties": {"a": {"type": "number"}}}),
        },
    ]
}

fn call(name: &str, arguments: Value) -> Call {
    Call {
        name: name.into(),
        arguments,
    }
}

fn parsed(format: ToolFormat, text: &str) -> Parsed {
    parse(format, text, &tools(), true)
}

#[test]
fn hermes_calls_parse_with_text_before_them() {
    // Qwen2.5-Coder 0.5B's reply to "What's the weather in Paris?" with get_weather.
    let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    assert_eq!(
        parsed(ToolFormat::Hermes, out),
        Parsed {
            content: None,
            calls: vec![call("get_weather", json!({"city": "Paris"}))],
        }
    );
    // Two calls, text before them, the last block unclosed at the end of the output,
    // arguments given as a string.
    let out = "Let me check.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n\
               <tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}\n";
    let p = parsed(ToolFormat::Hermes, out);
    assert_eq!(p.content.as_deref(), Some("Let me check."));
    assert_eq!(
        p.calls,
        [
            call("add", json!({"a": 1})),
            call("get_weather", json!({"city": "Oslo"}))
        ]
    );
    // Only the first without parallel calls.
    assert_eq!(
        parse(ToolFormat::Hermes, out, &tools(), false).calls.len(),
        1
    );
}

/// Qwen2.5-Coder 0.5B under its own (Hermes) template, recorded through `memra serve`
/// (greedy, `tool_choice: auto`): it writes the call's JSON bare or in a fence, and
/// once a pseudo-call of no declared tool.
#[test]
fn recorded_qwen_replies_parse_as_calls_or_stay_text() {
    let weather =
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}";
    assert_eq!(
        parsed(ToolFormat::Hermes, weather).calls,
        [call(
            "get_weather",
            json!({"city": "Paris", "unit": "celsius"})
        )]
    );
    let fenced = "```json\n{\n  \"name\": \"add\",\n  \"arguments\": {\n    \"a\": 2,\n    \"b\": 3\n  }\n}\n```";
    assert_eq!(
        parsed(ToolFormat::Hermes, fenced).calls,
        [call("add", json!({"a": 2, "b": 3}))]
    );
    let pseudo = "```json\n{\n  \"name\": \"hello world\",\n  \"arguments\": {}\n}\n```";
    assert_eq!(
        parsed(ToolFormat::Hermes, pseudo).content.as_deref(),
        Some(pseudo)
    );
    assert_eq!(
        parsed(ToolFormat::Hermes, "17 plus 25 equals 42.").calls,
        []
    );
}

#[test]
fn llama3_calls_parse_with_or_without_the_python_tag() {
    let one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    let want = vec![call("get_weather", json!({"city": "Paris"}))];
    assert_eq!(parsed(ToolFormat::Llama3, one).calls, want);
    assert_eq!(
        parsed(ToolFormat::Llama3, &format!("<|python_tag|>{one}")).calls,
        want
    );
    assert_eq!(
        parsed(ToolFormat::Llama3, &format!("\n\n{one}\n")).calls,
        want
    );
    // Calls separated by `;`, a `;` inside an argument.
    let two = "{\"name\": \"add\", \"parameters\": {\"a\": 2}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}";
    assert_eq!(
        parsed(ToolFormat::Llama3, two).calls,
        [
            call("add", json!({"a": 2})),
            call("get_weather", json!({"city": "a;b"}))
        ]
    );
}

#[test]
fn generic_json_calls_parse_in_every_accepted_shape() {
    let want = vec![call("add", json!({"a": 3}))];
    for out in [
        "{\"name\": \"add\", \"arguments\": {\"a\": 3}}",
        "```json\n{\"name\": \"add\", \"arguments\": {\"a\": 3}}\n```",
        "[{\"name\": \"add\", \"arguments\": {\"a\": 3}}]",
        "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": 3}}]}",
        "{\"tool_call\": {\"name\": \"add\", \"arguments\": {\"a\": 3}}}",
    ] {
        let p = parsed(ToolFormat::Json, out);
        assert_eq!((p.content, p.calls), (None, want.clone()), "{out}");
    }
}

#[test]
fn plain_answers_and_malformed_calls_stay_text() {
    let cases = [
        (ToolFormat::Hermes, "The weather in Paris is usually mild."),
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",
        ),
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"undeclared\", \"arguments\": {}}\n</tool_call>",
        ),
        (
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"add\", \"arguments\": [1]}\n</tool_call>",
        ),
        (
            ToolFormat::Llama3,
            "Sure! {\"name\": \"add\", \"parameters\": {\"a\": 1}}",
        ),
        (
            ToolFormat::Llama3,
            "{\"name\": \"add\", \"parameters\": {\"a\": 1}} and more",
        ),
        (ToolFormat::Llama3, "{\"answer\": 42}"),
        (ToolFormat::Json, "Here is some JSON: {\"a\": 1}"),
        (ToolFormat::Json, "{\"a\": 1}"),
        (ToolFormat::Json, "[]"),
        (ToolFormat::Json, "```python\nprint(1)\n```"),
    ];
    for (format, out) in cases {
        assert_eq!(
            parsed(format, out),
            Parsed {
                content: Some(out.to_string()),
                calls: vec![]
            },
            "{format:?}: {out}"
        );
    }
}

#[test]
fn streaming_holds_back_only_what_may_become_a_call() {
    assert_eq!(call_start(ToolFormat::Hermes, "Hello", true), None);
    assert_eq!(call_start(ToolFormat::Hermes, "Hello <tool", true), Some(6));
    assert_eq!(
        call_start(ToolFormat::Hermes, "Hi <tool_call>\n{", true),
        Some(3)
    );
    assert_eq!(call_start(ToolFormat::Hermes, "a < b", true), None);
    assert_eq!(call_start(ToolFormat::Hermes, " {\"na", true), Some(0));
    assert_eq!(call_start(ToolFormat::Hermes, "{\"na", false), None);
    assert_eq!(call_start(ToolFormat::Llama3, "  ", true), Some(0));
    assert_eq!(call_start(ToolFormat::Llama3, "<|python", true), Some(0));
    assert_eq!(call_start(ToolFormat::Llama3, "{\"name\"", true), Some(0));
    assert_eq!(call_start(ToolFormat::Llama3, "{\"name\"", false), None);
    assert_eq!(call_start(ToolFormat::Llama3, "The answer", true), None);
    assert_eq!(call_start(ToolFormat::Json, "``", true), Some(0));
    assert_eq!(call_start(ToolFormat::Json, "Sure", true), None);
}

#[test]
fn formats_come_from_the_template_text() {
    assert_eq!(
        ToolFormat::detect("{{- '<tool_call>\\n' }}{{ tools }}"),
        ToolFormat::Hermes
    );
    assert_eq!(
        ToolFormat::detect("<|start_header_id|>ipython{% if tools %}<|python_tag|>"),
        ToolFormat::Llama3
    );
    assert_eq!(
        ToolFormat::detect("<|im_start|>{{ message.content }}"),
        ToolFormat::Json
    );
    assert_eq!(ToolFormat::from_name("llama3"), Some(ToolFormat::Llama3));
    assert_eq!(ToolFormat::from_name("xml"), None);
}

#[test]
fn grammars_name_the_chosen_functions_in_the_format() {
    let Grammar::Lark(g) = grammar(ToolFormat::Hermes, &tools(), Some("add"), false) else {
        panic!("a Lark grammar");
    };
    assert!(
        g.starts_with("start: call\ncall: \"<tool_call>\\n\" call_json \"\\n</tool_call>\""),
        "{g}"
    );
    assert!(
        g.contains("{\"const\":\"add\"}") && !g.contains("get_weather"),
        "{g}"
    );
    let Grammar::Lark(g) = grammar(ToolFormat::Llama3, &tools(), None, true) else {
        panic!("a Lark grammar");
    };
    assert!(
        g.contains("anyOf") && g.contains("\"parameters\"") && g.contains("get_weather"),
        "{g}"
    );
}

#[test]
fn call_ids_look_like_openai_s() {
    let (a, b) = (call_id(), call_id());
    assert!(
        a.starts_with("call_")
            && a.len() == 29
            && a[5..].chars().all(|c| c.is_ascii_alphanumeric())
    );
    assert_ne!(a, b);
}
