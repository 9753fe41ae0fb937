//! Request bodies: OpenAI's field names and types (and llama-server's `top_k`, `min_p`,
//! `repeat_penalty`), read from the parsed JSON one field at a time so that a field of
//! the wrong type or range is a 400 that names it. Unknown fields are ignored, and `null`
//! means absent, as OpenAI's clients send it.

use std::collections::HashMap;

use memra_engine::sampler::SamplerConfig;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Choices one request may ask for (`n`), and prompts one completion request may hold:
/// a bound on what one request can put in the queue.
pub const MAX_CHOICES: usize = 16;
pub const MAX_PROMPTS: usize = 16;
/// Stop strings at most (OpenAI allows 4; vLLM and llama-server more).
pub const MAX_STOP: usize = 16;
/// Alternatives per token at most (`top_logprobs`, OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Drafted tokens a step a request may ask for (`speculative.n_max`).
pub const MAX_DRAFT: usize = 64;
/// OpenAI's completions endpoint generates 16 tokens when `max_tokens` is not given.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// The fields of one JSON object, read with their types checked.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
}

fn type_error(name: &str, want: &str) -> ApiError {
    ApiError::invalid(name, format!("'{name}' must be {want}"))
}

impl<'a> Fields<'a> {
    /// The body, which must be a JSON object.
    pub fn of(body: &'a Value) -> Result<Fields<'a>, ApiError> {
        match body {
            Value::Object(map) => Ok(Fields { map }),
            _ => Err(ApiError::bad_request(
                "the request body must be a JSON object",
            )),
        }
    }

    /// A field, `null` counting as absent.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| type_error(name, "a boolean")))
            .transpose()
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| type_error(name, "a string")))
            .transpose()
    }

    /// A number within `[lo, hi]`.
    pub fn number(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| type_error(name, "a number"))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be within [{lo}, {hi}], not {x}"),
            ));
        }
        Ok(Some(x))
    }

    /// An integer within `[lo, hi]`.
    pub fn integer(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v
            .as_i64()
            .or_else(|| v.as_u64().map(|u| u.min(i64::MAX as u64) as i64))
            .ok_or_else(|| type_error(name, "an integer"))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be within [{lo}, {hi}], not {x}"),
            ));
        }
        Ok(Some(x))
    }

    fn object(&self, name: &str) -> Result<Option<Fields<'a>>, ApiError> {
        self.get(name)
            .map(|v| match v {
                Value::Object(map) => Ok(Fields { map }),
                _ => Err(type_error(name, "an object")),
            })
            .transpose()
    }
}

/// Options both endpoints share.
#[derive(Clone, Debug)]
pub struct Common {
    pub model: Option<String>,
    /// `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    /// The seed is set per choice ([`Common::sampler_for`]).
    pub sampler: SamplerConfig,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// llama-server's `speculative.n_max` / `speculative.n_min`: this request's bounds on
    /// drafted tokens a step, where the server speculates (`--spec-ngram`, `--model-draft`).
    pub draft_max: Option<usize>,
    pub draft_min: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Reads the options both endpoints share; `n_vocab` bounds `logit_bias`'s token ids.
pub fn common(f: &Fields, endpoint: Endpoint, n_vocab: usize) -> Result<Common, ApiError> {
    let model = f.string("model")?.map(str::to_string);
    f.string("user")?; // accepted, unused
                       // Completions that echo may generate nothing (OpenAI's legacy API, vLLM): the prompt
                       // and, with `logprobs`, its tokens' log-probabilities.
    let echo = endpoint == Endpoint::Completions && f.bool("echo")?.unwrap_or(false);
    let mut max_tokens = f.integer("max_tokens", if echo { 0 } else { 1 }, i64::MAX)?;
    if endpoint == Endpoint::Chat {
        if let Some(m) = f.integer("max_completion_tokens", 1, i64::MAX)? {
            max_tokens = Some(m);
        }
    }
    let d = SamplerConfig::default();
    let num = |name, lo, hi, default: f32| -> Result<f32, ApiError> {
        Ok(f.number(name, lo, hi)?.map_or(default, |x| x as f32))
    };
    let mut sampler = SamplerConfig {
        temperature: num("temperature", 0.0, 2.0, d.temperature)?,
        top_p: num("top_p", 0.0, 1.0, d.top_p)?,
        min_p: num("min_p", 0.0, 1.0, d.min_p)?,
        presence_penalty: num("presence_penalty", -2.0, 2.0, d.presence_penalty)?,
        frequency_penalty: num("frequency_penalty", -2.0, 2.0, d.frequency_penalty)?,
        ..d
    };
    if let Some(k) = f.integer("top_k", -1, i64::MAX)? {
        // llama-server: top_k <= 0 disables it.
        sampler.top_k = k.max(0) as usize;
    }
    if let Some(r) = f.number("repeat_penalty", f64::MIN_POSITIVE, 100.0)? {
        sampler.repeat_penalty = r as f32;
    }
    if let Some(bias) = f.object("logit_bias")? {
        sampler.logit_bias = logit_bias(bias.map, n_vocab)?;
    }
    let seed = f.integer("seed", i64::MIN, i64::MAX)?.map(|s| s as u64);
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error("stop", "a string or an array of strings"))?,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOP} stop strings"),
            ))
        }
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let n = f.integer("n", 1, MAX_CHOICES as i64)?.unwrap_or(1) as usize;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => o
            .bool("include_usage")
            .map_err(|_| type_error("stream_options.include_usage", "a boolean"))?
            .unwrap_or(false),
        None => false,
    };
    let top = MAX_TOP_LOGPROBS as i64;
    let logprobs = match endpoint {
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let k = f.integer("top_logprobs", 0, top)?.unwrap_or(0) as usize;
            on.then_some(k)
        }
        Endpoint::Completions => f.integer("logprobs", 0, top)?.map(|k| k as usize),
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let draft = |name| -> Result<Option<usize>, ApiError> {
        Ok(f.integer(name, 0, MAX_DRAFT as i64)?.map(|k| k as usize))
    };
    let (draft_max, draft_min) = (draft("speculative.n_max")?, draft("speculative.n_min")?);
    Ok(Common {
        model,
        max_tokens: max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX)),
        sampler,
        seed,
        stop,
        n,
        stream,
        include_usage,
        logprobs,
        ignore_eos,
        draft_max,
        draft_min,
    })
}

fn logit_bias(map: &Map<String, Value>, n_vocab: usize) -> Result<HashMap<u32, f32>, ApiError> {
    map.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < n_vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("'logit_bias' key {k:?} is not a token id below {n_vocab}"),
                    )
                })?;
            let b = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "'logit_bias' values must be numbers within [-100, 100] (token {k})"
                        ),
                    )
                })?;
            Ok((id, b as f32))
        })
        .collect()
}

impl Common {
    /// The sampler of choice `i`: the request's seed plus `i` (so `n` seeded choices differ
    /// from each other and repeat across requests), or a fresh seed.
    pub fn sampler_for(&self, i: usize, fresh: u64) -> SamplerConfig {
        SamplerConfig {
            seed: self.seed.map_or(fresh, |s| s.wrapping_add(i as u64)),
            ..self.sampler.clone()
        }
    }
}

/// The conversation of a chat request, as the chat template reads it: roles
/// `system` (and `developer`), `user`, `assistant`, `tool`; content a string or an array
/// of text parts (joined by newlines, as vLLM does). Tool calls and names pass through.
pub fn messages(f: &Fields) -> Result<Value, ApiError> {
    let Some(v) = f.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "Missing required parameter: 'messages'",
        ));
    };
    let Value::Array(list) = v else {
        return Err(type_error("messages", "an array of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let Value::Object(m) = m else {
            return Err(type_error(&format!("messages[{i}]"), "an object"));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some(r) => {
                return Err(ApiError::invalid(
                    at("role"),
                    format!("unknown role {r:?} (system, developer, user, assistant or tool)"),
                ))
            }
            None => return Err(type_error(&at("role"), "a string")),
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    let part = format!("messages[{i}].content[{j}]");
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                        (Some("text"), _) => {
                            return Err(type_error(&format!("{part}.text"), "a string"))
                        }
                        (Some(other), _) => {
                            return Err(ApiError::invalid(
                                format!("{part}.type"),
                                format!(
                                    "content parts of type {other:?} are not supported (text only)"
                                ),
                            ))
                        }
                        (None, _) => return Err(type_error(&format!("{part}.type"), "a string")),
                    }
                }
                texts.join("\n")
            }
            _ => {
                return Err(type_error(
                    &at("content"),
                    "a string or an array of text parts",
                ))
            }
        };
        let mut msg = json!({"role": role, "content": content});
        for key in ["name", "tool_calls", "tool_call_id"] {
            if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
                msg[key] = v.clone();
            }
        }
        // OpenAI sends a call's arguments as a JSON string; templates (Qwen's, Llama's)
        // write them with `tojson`, as transformers' callers pass them: as an object.
        if let Some(Value::Array(calls)) = msg.get_mut("tool_calls") {
            for c in calls {
                let args = c.get_mut("function").and_then(|f| f.get_mut("arguments"));
                if let Some(a) = args {
                    if let Some(v) = a
                        .as_str()
                        .and_then(|s| serde_json::from_str::<Value>(s).ok())
                    {
                        *a = v;
                    }
                }
            }
        }
        out.push(msg);
    }
    Ok(Value::Array(out))
}

/// One prompt of a completion request.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of arrays
/// of token ids.
pub fn prompts(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    prompts_in(f, "prompt", MAX_PROMPTS)
}

/// At most `max` prompts in `field`, in the four forms of [`prompts`] (embeddings'
/// `input`).
pub fn prompts_in(f: &Fields, field: &str, max: usize) -> Result<Vec<Prompt>, ApiError> {
    let want = "a string, an array of strings, or an array of token ids (or of such arrays)";
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let out = match f.get(field) {
        None => {
            return Err(ApiError::invalid(
                field,
                format!("Missing required parameter: '{field}'"),
            ))
        }
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid(
                field,
                format!("'{field}' must not be empty"),
            ))
        }
        Some(Value::Array(a)) if a[0].is_number() => {
            vec![Prompt::Tokens(
                ids(a).ok_or_else(|| type_error(field, want))?,
            )]
        }
        Some(Value::Array(a)) => a
            .iter()
            .map(|p| match p {
                Value::String(s) => Some(Prompt::Text(s.clone())),
                Value::Array(t) => ids(t).map(Prompt::Tokens),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error(field, want))?,
        Some(_) => return Err(type_error(field, want)),
    };
    if out.len() > max {
        return Err(ApiError::invalid(
            field,
            format!("at most {max} prompts per request"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value, endpoint: Endpoint) -> Result<Common, ApiError> {
        common(&Fields::of(&body).unwrap(), endpoint, 1000)
    }

    fn param_of(r: Result<Common, ApiError>) -> String {
        r.expect_err("refused").param.unwrap_or_default()
    }

    #[test]
    fn defaults_are_llama_cpp_s_and_unknown_fields_are_ignored() {
        let c = parse(
            json!({"model": "m", "whatever": [1, 2], "temperature": null}),
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(c.model.as_deref(), Some("m"));
        assert_eq!(c.sampler.temperature, SamplerConfig::default().temperature);
        assert_eq!((c.n, c.stream, c.logprobs), (1, false, None));
        assert_eq!(c.max_tokens, None);
    }

    #[test]
    fn fields_are_read_with_their_names() {
        let c = parse(
            json!({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
                "repeat_penalty": 1.1, "presence_penalty": -1, "frequency_penalty": 0.5,
                "logit_bias": {"7": -100, "9": 2.5}, "seed": -1, "stop": ["a", ""], "n": 3,
                "stream": true, "stream_options": {"include_usage": true},
                "logprobs": true, "top_logprobs": 2, "user": "u"}),
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(c.max_tokens, Some(5));
        assert_eq!(c.sampler.temperature, 0.0);
        assert_eq!(c.sampler.top_k, 3);
        assert_eq!(c.sampler.logit_bias[&7], -100.0);
        assert_eq!(c.seed, Some(u64::MAX));
        assert_eq!(c.stop, vec!["a".to_string()]);
        assert_eq!((c.n, c.stream, c.include_usage), (3, true, true));
        assert_eq!(c.logprobs, Some(2));
        assert_eq!(c.sampler_for(2, 0).seed, 1);
        let c = parse(
            json!({"max_completion_tokens": 9, "max_tokens": 4}),
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(c.max_tokens, Some(9));
        let c = parse(json!({"logprobs": 3}), Endpoint::Completions).unwrap();
        assert_eq!(c.logprobs, Some(3));
        let c = parse(
            json!({"speculative.n_max": 0, "speculative.n_min": 2}),
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((c.draft_max, c.draft_min), (Some(0), Some(2)));
    }

    #[test]
    fn a_field_of_the_wrong_type_or_range_is_named() {
        let cases = [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"temperature": 3}), "temperature"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": 1.5}), "max_tokens"),
            (json!({"speculative.n_max": -1}), "speculative.n_max"),
            (json!({"speculative.n_min": 65}), "speculative.n_min"),
            (json!({"speculative.n_max": "4"}), "speculative.n_max"),
            (json!({"n": 0}), "n"),
            (json!({"n": 1000}), "n"),
            (json!({"stream": "yes"}), "stream"),
            (json!({"stop": 3}), "stop"),
            (json!({"stop": [1]}), "stop"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5000": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": 200}}), "logit_bias"),
            (json!({"top_p": -0.1}), "top_p"),
            (json!({"model": 5}), "model"),
            (json!({"top_logprobs": 50}), "top_logprobs"),
            (
                json!({"stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
        ];
        for (body, field) in cases {
            assert_eq!(
                param_of(parse(body.clone(), Endpoint::Chat)),
                field,
                "{body}"
            );
        }
        assert_eq!(
            param_of(parse(json!({"logprobs": true}), Endpoint::Completions)),
            "logprobs"
        );
        // No tokens only for completions that echo the prompt.
        for (body, ep) in [
            (json!({"max_tokens": 0}), Endpoint::Completions),
            (
                json!({"max_tokens": 0, "echo": false}),
                Endpoint::Completions,
            ),
            (json!({"max_tokens": 0, "echo": true}), Endpoint::Chat),
        ] {
            assert_eq!(param_of(parse(body.clone(), ep)), "max_tokens", "{body}");
        }
        let c = parse(
            json!({"max_tokens": 0, "echo": true}),
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(c.max_tokens, Some(0));
    }

    #[test]
    fn no_value_of_any_field_panics() {
        let weird = [
            json!(null),
            json!(true),
            json!(-1),
            json!(0),
            json!(1.5),
            json!(1e308),
            json!(-1e308),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(""),
            json!("x"),
            json!([]),
            json!([1]),
            json!([[]]),
            json!([null]),
            json!({}),
            json!({"a": 1}),
            json!({"include_usage": "x", "1": [2]}),
            json!([{"role": "user"}]),
            json!([{"role": "user", "content": [{"type": "text"}]}]),
        ];
        let fields = [
            "model",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "seed",
            "stop",
            "n",
            "stream",
            "stream_options",
            "logprobs",
            "top_logprobs",
            "ignore_eos",
            "speculative.n_max",
            "speculative.n_min",
            "user",
            "messages",
            "prompt",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "grammar",
            "json_schema",
            "echo",
        ];
        for field in fields {
            for v in &weird {
                let mut body = json!({"messages": [{"role": "user", "content": "hi"}],
                    "prompt": "hi"});
                body[field] = v.clone();
                let f = Fields::of(&body).unwrap();
                for ep in [Endpoint::Chat, Endpoint::Completions] {
                    if let Err(e) = common(&f, ep, 1000) {
                        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
                        assert!(e.param.is_some(), "{field} = {v}: {e:?}");
                    }
                }
                let _ = messages(&f);
                let _ = prompts(&f);
                let _ = crate::structured::tools(&f);
                let _ = crate::structured::output_grammar(&f);
            }
        }
        for body in [json!(null), json!([]), json!("x"), json!(1)] {
            assert!(Fields::of(&body).is_err());
        }
    }

    #[test]
    fn messages_take_strings_and_text_parts() {
        let body = json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "42", "tool_call_id": "1"},
        ]});
        let m = messages(&Fields::of(&body).unwrap()).unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1]["content"], "a\nb");
        assert_eq!(m[2]["content"], "");
        assert_eq!(m[2]["tool_calls"][0]["id"], "1");
        assert_eq!(m[3]["tool_call_id"], "1");
    }

    #[test]
    fn bad_messages_name_the_message() {
        let cases = [
            (json!({}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "king", "content": "x"}]}),
                "messages[0].role",
            ),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0].type",
            ),
        ];
        for (body, field) in cases {
            let e = messages(&Fields::of(&body).unwrap()).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
    }

    #[test]
    fn prompts_take_the_four_openai_forms() {
        let p = |v: Value| prompts(&Fields::of(&json!({ "prompt": v })).unwrap());
        assert_eq!(p(json!("hi")).unwrap(), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!(["a", "b"])).unwrap().len(), 2);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(
            p(json!([[1], [2, 3]])).unwrap(),
            vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])]
        );
        for bad in [
            json!(5),
            json!([]),
            json!([1, "a"]),
            json!([-1]),
            json!([{"a": 1}]),
        ] {
            assert_eq!(p(bad).unwrap_err().param.as_deref(), Some("prompt"));
        }
        assert!(prompts(&Fields::of(&json!({})).unwrap()).is_err());
    }
}
