//! Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered the way Hugging
//! Face `transformers.apply_chat_template` renders it: `trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string and dict methods, `raise_exception`, and a `tojson` that writes
//! what Python's `json.dumps` writes (`transformers` passes `ensure_ascii=False`).
//!
//! Templates come from model files, so they are untrusted: rendering runs on a fuel budget
//! (minijinja counts instructions) and the output has a size limit.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// Instructions a render may execute; real templates need a few thousand per message.
const FUEL: u64 = 20_000_000;
/// Largest prompt a template may produce.
const MAX_OUTPUT_BYTES: usize = 16 << 20;
const NAME: &str = "chat";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0:#}")]
    Syntax(Error),
    #[error("chat template failed: {0:#}")]
    Render(Error),
    #[error("chat template output exceeds {MAX_OUTPUT_BYTES} bytes")]
    TooLarge,
    #[error("{0:?} is neither a built-in chat template (chatml, llama3, gemma) nor a file")]
    UnknownBuiltin(String),
    #[error("the model has no chat template: choose one (chatml, llama3, gemma) or give a template file")]
    NoTemplate,
    #[error("cannot read chat template {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Metadata(#[from] memra_gguf::MetadataError),
}

/// Built-in templates for models that ship none, selectable by name.
pub const BUILTINS: [(&str, &str); 3] = [
    (
        "chatml",
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    ),
    (
        "llama3",
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    ),
    (
        "gemma",
        "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}{%- for message in loop_messages %}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}",
    ),
];

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja text (the server reads it to tell how the model writes tool calls).
    source: String,
}

/// The conversation to render.
pub struct ChatInput<'a> {
    pub messages: &'a serde_json::Value,
    pub tools: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_recursion_limit(100);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(TemplateError::Syntax)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn builtin(name: &str) -> Result<ChatTemplate, TemplateError> {
        let source = BUILTINS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| *s)
            .ok_or_else(|| TemplateError::UnknownBuiltin(name.to_string()))?;
        ChatTemplate::new(source)
    }

    /// The template to use for a model: `choice` (a built-in name or a template file) when
    /// given, else the model's own `tokenizer.chat_template`.
    pub fn select(
        metadata: &memra_gguf::Metadata,
        choice: Option<&str>,
    ) -> Result<ChatTemplate, TemplateError> {
        match choice {
            Some(name) if BUILTINS.iter().any(|(n, _)| *n == name) => ChatTemplate::builtin(name),
            Some(path) if std::path::Path::new(path).is_file() => {
                let source = std::fs::read_to_string(path).map_err(|source| TemplateError::Io {
                    path: path.to_string(),
                    source,
                })?;
                ChatTemplate::new(&source)
            }
            Some(other) => Err(TemplateError::UnknownBuiltin(other.to_string())),
            None => match metadata.get_str("tokenizer.chat_template")? {
                Some(source) => ChatTemplate::new(source),
                None => Err(TemplateError::NoTemplate),
            },
        }
    }

    pub fn render(&self, input: &ChatInput) -> Result<String, TemplateError> {
        let t = self.env.get_template(NAME).map_err(TemplateError::Syntax)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(input.messages),
            tools => input.tools.map(Value::from_serialize),
            add_generation_prompt => input.add_generation_prompt,
            bos_token => input.bos_token,
            eos_token => input.eos_token,
        };
        let out = t.render(ctx).map_err(TemplateError::Render)?;
        if out.len() > MAX_OUTPUT_BYTES {
            return Err(TemplateError::TooLarge);
        }
        Ok(out)
    }
}

/// `tojson` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(value, indent, 0, &mut out)?;
    if out.len() > MAX_OUTPUT_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson output too large",
        ));
    }
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    const MAX_DEPTH: usize = 64;
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson nesting too deep",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&python_number(v)),
        ValueKind::String | ValueKind::Bytes => {
            write_json_string(v.as_str().unwrap_or_default(), out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match k.as_str() {
                    Some(s) => write_json_string(s, out),
                    None => write_json_string(&k.to_string(), out),
                }
                out.push_str(": ");
                write_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => write_json_string(&v.to_string(), out),
    }
    Ok(())
}

/// Numbers as Python prints them: integers plainly, floats by `repr` (`1.0`, `1e+20`).
fn python_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust writes `1e20` / `1.5e-7`; Python writes `1e+20` / `1.5e-07`.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').expect("exponent form");
        let exp: i32 = exp.parse().expect("integer exponent");
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> Result<String, TemplateError> {
        ChatTemplate::new(source)?.render(&ChatInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            bos_token: "<s>",
            eos_token: "</s>",
        })
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let out = render(
            "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            json!([{"b": 1, "a": [1.5, 2.0, 1e20, -3e-7, null, true, "x\"\n\u{1}é<>"]}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "[{\"b\": 1, \"a\": [1.5, 2.0, 1e+20, -3e-07, null, true, \"x\\\"\\n\\u0001é<>\"]}]|{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    2.0,\n    1e+20,\n    -3e-07,\n    null,\n    true,\n    \"x\\\"\\n\\u0001é<>\"\n  ]\n}"
        );
    }

    #[test]
    fn hostile_templates_fail_cleanly() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        assert!(matches!(
            render("{% for x in ", msgs.clone()),
            Err(TemplateError::Syntax(_))
        ));
        let raised = render("{{ raise_exception('no system role') }}", msgs.clone()).unwrap_err();
        assert!(raised.to_string().contains("no system role"), "{raised}");
        // Effectively endless loops run out of fuel.
        let endless = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}";
        assert!(matches!(
            render(endless, msgs.clone()),
            Err(TemplateError::Render(_))
        ));
        let recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        assert!(matches!(
            render(recursive, msgs.clone()),
            Err(TemplateError::Render(_))
        ));
        let huge = "{{ 'x' * 100000000 }}{{ 'y' * 100000000 }}";
        assert!(render(huge, msgs).is_err());
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        let out = render(
            "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% if m.content.startswith(' a') %}!{% endif %}{% endfor %}",
            json!([{"content": " a "}, {"content": "b"}, {"content": "c"}]),
        )
        .unwrap();
        assert_eq!(out, "A!B");
    }

    #[test]
    fn builtins_render() {
        let msgs = json!([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi "}]);
        let t = |n| {
            ChatTemplate::builtin(n)
                .unwrap()
                .render(&ChatInput {
                    messages: &msgs,
                    tools: None,
                    add_generation_prompt: true,
                    bos_token: "<bos>",
                    eos_token: "",
                })
                .unwrap()
        };
        assert_eq!(t("chatml"), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(t("llama3"), "<bos><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
        assert_eq!(
            t("gemma"),
            "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert!(matches!(
            ChatTemplate::builtin("vicuna"),
            Err(TemplateError::UnknownBuiltin(_))
        ));
    }
}
