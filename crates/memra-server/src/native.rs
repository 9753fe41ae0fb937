//! llama-server's own `POST /completion` (and `/completions`), and `POST /infill` (code
//! completion in editors: `input_prefix`, `input_suffix`, `input_extra` around the cursor,
//! as a fill-in-the-middle prompt, fim.rs), for tools written against it: `n_predict` (-1, the default: up to the end of the context), `n_probs`,
//! `return_tokens`, the sampling fields under llama-server's names; the answer as
//! llama-server gives it (`content`, `stop`, `stop_type`, `stopping_word`,
//! `tokens_predicted`, `tokens_evaluated`, `generation_settings`, `timings`), streamed as
//! a chunk per piece of text and a last one with `stop: true` (no `[DONE]`, as
//! llama-server). Requests are checked and run as `/v1/completions` requests are.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use memra_engine::engine::{Event, FinishReason, Request, TokenEvent};
use memra_engine::models::Model;
use memra_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tracing::Instrument;

use crate::error::ApiError;
use crate::fim::{self, ExtraFile, Repo};
use crate::openai::{gather, prepare, submit, token_entries, ChoiceOut, Events, Inflight, Job};
use crate::params::{Endpoint, MAX_TOP_LOGPROBS};
use crate::{json_body, request_id_header, AppState};

pub(crate) async fn completion(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(st, body, false).await
}

pub(crate) async fn infill(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(st, body, true).await
}

async fn serve(st: Arc<AppState>, body: Result<Bytes, BytesRejection>, infill: bool) -> Response {
    let rid = st.request_id();
    let span = tracing::info_span!("request", id = %rid);
    let headers = request_id_header(&rid);
    let r = async move {
        let start = Instant::now();
        let ready = st.ready()?;
        let mut v = json_body(body)?;
        let return_tokens = translate(&mut v)?;
        let s = st.clone();
        let job = tokio::task::spawn_blocking(move || {
            let ready = s.ready()?;
            if infill {
                infill_prompt(&mut v, &ready.engine.model().tokenizer)?;
            }
            prepare(&s, ready, &v, Endpoint::Completions, rid, true)
        })
        .await
        .map_err(|_| ApiError::internal("internal error (a bug) preparing the request"))??;
        tracing::info!(
            "/completion: {} prompt(s) of {:?} tokens, n_predict {}, stream {}",
            job.prompt_lens.len(),
            job.prompt_lens,
            job.choices.first().map_or(0, |c| c.params.max_tokens),
            job.stream
        );
        let (rx, guard) = submit(&st, ready, &job.id, &job.choices, start)?;
        let out = Out {
            job,
            model: ready.engine.model().clone(),
            return_tokens,
            start,
        };
        Ok::<Response, ApiError>(match out.job.stream {
            true => stream(out, rx, guard),
            false => collect(out, rx, guard).await?,
        })
    }
    .instrument(span)
    .await;
    match r {
        Ok(resp) => (headers, resp).into_response(),
        Err(e) => {
            tracing::info!("refused: {} {}", e.status.as_u16(), e.message);
            (headers, e).into_response()
        }
    }
}

/// llama-server's names to OpenAI's, in place (the rest are the same or ignored);
/// returns `return_tokens`. `n_predict` and `n_probs` are checked here, under their names.
fn translate(v: &mut Value) -> Result<bool, ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let int = |o: &Map<String, Value>, name: &str, lo: i64, hi: i64| match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_i64()
            .filter(|n| (lo..=hi).contains(n))
            .map(Some)
            .ok_or_else(|| {
                ApiError::invalid(
                    name,
                    format!("'{name}' must be an integer from {lo} to {hi}"),
                )
            }),
    };
    // -1: no limit but the context's.
    if let Some(n) = int(o, "n_predict", -1, i64::MAX)? {
        if n == 0 {
            return Err(ApiError::invalid(
                "n_predict",
                "'n_predict' of 0 generates nothing",
            ));
        }
        if n > 0 {
            o.insert("max_tokens".into(), json!(n));
        }
    }
    let top = int(o, "n_probs", 0, MAX_TOP_LOGPROBS as i64)?;
    o.remove("logprobs");
    if let Some(k) = top.filter(|&k| k > 0) {
        o.insert("logprobs".into(), json!(k));
    }
    // OpenAI's completions fields that are not llama-server's.
    o.remove("echo");
    o.remove("n");
    match o.get("return_tokens") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            "return_tokens",
            "'return_tokens' must be a boolean",
        )),
    }
}

/// `/infill`'s fields as the fill-in-the-middle prompt's ids in `prompt` (`prompt`, if
/// given, continues the prefix, as in llama-server).
fn infill_prompt(v: &mut Value, tok: &Tokenizer) -> Result<(), ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let text = |o: &Map<String, Value>, name: &str| match o.get(name) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::invalid(
            name,
            format!("'{name}' must be a string"),
        )),
    };
    let (prefix, suffix, cont) = (
        text(o, "input_prefix")?,
        text(o, "input_suffix")?,
        text(o, "prompt")?,
    );
    let mut files = Vec::new();
    match o.get("input_extra") {
        None | Some(Value::Null) => {}
        Some(Value::Array(chunks)) => {
            for (i, c) in chunks.iter().enumerate() {
                let field = format!("input_extra[{i}]");
                let Value::Object(c) = c else {
                    return Err(ApiError::invalid(&field, "each chunk must be an object"));
                };
                let name = match c.get("filename") {
                    None | Some(Value::Null) => "tmp".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(_) => return Err(ApiError::invalid(field + ".filename", "a string")),
                };
                let Some(Value::String(body)) = c.get("text") else {
                    return Err(ApiError::invalid(field + ".text", "a string is required"));
                };
                files.push(ExtraFile {
                    name,
                    text: body.clone(),
                });
            }
        }
        Some(_) => return Err(ApiError::invalid("input_extra", "an array of chunks")),
    }
    let enc = |t: &str, field: &str| {
        tok.encode(t, false, false)
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    };
    let mut before = enc(&prefix, "input_prefix")?;
    before.extend(enc(&cont, "prompt")?);
    let repo = Repo { files: &files };
    let ids = fim::prompt(tok, "input_prefix", Some(repo), &before, &suffix)?;
    for k in ["input_prefix", "input_suffix", "input_extra"] {
        o.remove(k);
    }
    o.insert("prompt".into(), json!(ids));
    Ok(())
}

/// What the answer needs beside the events.
struct Out {
    job: Job,
    model: Arc<Model>,
    return_tokens: bool,
    start: Instant,
}

impl Out {
    /// `completion_probabilities` entries, llama-server's shape.
    fn probs(&self, tokens: &[TokenEvent]) -> Value {
        Value::Array(token_entries(&self.model, tokens, true))
    }

    fn token_ids(&self, tokens: &[TokenEvent]) -> Vec<u32> {
        match self.return_tokens {
            true => tokens.iter().map(|t| t.id).collect(),
            false => Vec::new(),
        }
    }

    /// A piece of text while choice `i` runs.
    fn partial(&self, i: usize, text: &str, tokens: &[TokenEvent], predicted: usize) -> Value {
        let mut c = json!({
            "index": i,
            "content": text,
            "tokens": self.token_ids(tokens),
            "stop": false,
            "tokens_predicted": predicted,
            "tokens_evaluated": self.job.choices[i].prompt.len(),
        });
        if self.job.logprobs.is_some() && !tokens.is_empty() {
            c["completion_probabilities"] = self.probs(tokens);
        }
        c
    }

    /// Choice `i`'s last object (it has ended): everything but the text when streamed.
    fn last(&self, i: usize, c: &ChoiceOut, streamed: bool) -> Value {
        let r: &Request = &self.job.choices[i];
        let p = &r.params;
        let (stop_type, word) = match c.finish.expect("the choice ended") {
            FinishReason::EndOfGeneration => ("eos", ""),
            FinishReason::StopString => ("word", c.stop.as_deref().unwrap_or("")),
            FinishReason::Length => ("limit", ""),
        };
        let now = Instant::now();
        let first = c.first_token.unwrap_or(now);
        let prompt_n = c.usage.prompt_tokens - c.usage.cached_tokens;
        let prompt_ms = (first - self.start).as_secs_f64() * 1e3;
        let predicted_n = c.usage.completion_tokens;
        let predicted_ms = (now - first).as_secs_f64() * 1e3;
        let per = |n: usize, ms: f64| (ms / n.max(1) as f64, n as f64 / (ms / 1e3).max(1e-9));
        let (prompt_per_token_ms, prompt_per_second) = per(prompt_n, prompt_ms);
        let (predicted_per_token_ms, predicted_per_second) = per(predicted_n, predicted_ms);
        let s = &p.sampler;
        let mut out = json!({
            "index": i,
            "content": if streamed { "" } else { c.text.as_str() },
            "tokens": if streamed { Vec::new() } else { self.token_ids(&c.tokens) },
            "stop": true,
            "model": self.job.model,
            "tokens_predicted": predicted_n,
            "tokens_evaluated": r.prompt.len(),
            "generation_settings": {
                "n_predict": p.max_tokens, "max_tokens": p.max_tokens,
                "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                "repeat_last_n": s.penalty_last_n, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "seed": s.seed, "stop": p.stop,
                "stream": self.job.stream, "n_probs": p.logprobs.unwrap_or(0),
                "ignore_eos": p.ignore_eos,
            },
            "prompt": self.model.tokenizer.decode_lossy(&r.prompt, false).unwrap_or_default(),
            "has_new_line": c.text.contains('\n'),
            "truncated": false,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": c.usage.cached_tokens,
            "timings": {
                "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token_ms, "prompt_per_second": prompt_per_second,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_per_token_ms,
                "predicted_per_second": predicted_per_second,
            },
        });
        if !streamed && self.job.logprobs.is_some() {
            out["completion_probabilities"] = self.probs(&c.tokens);
        }
        out
    }
}

/// One object for one prompt, an array for several (as llama-server answers).
async fn collect(out: Out, mut rx: Events, guard: Inflight) -> Result<Response, ApiError> {
    let choices = gather(out.job.choices.len(), &mut rx, guard).await?;
    let mut all: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| out.last(i, c, false))
        .collect();
    Ok(match all.len() {
        1 => Json(all.pop().expect("one")).into_response(),
        _ => Json(Value::Array(all)).into_response(),
    })
}

fn stream(out: Out, rx: Events, guard: Inflight) -> Response {
    let n = out.job.choices.len();
    struct S {
        out: Out,
        rx: Events,
        _guard: Inflight,
        choices: Vec<ChoiceOut>,
        predicted: Vec<usize>,
        queue: VecDeque<SseEvent>,
        left: usize,
    }
    let s = S {
        out,
        rx,
        _guard: guard,
        choices: (0..n).map(|_| ChoiceOut::default()).collect(),
        predicted: vec![0; n],
        queue: VecDeque::new(),
        left: n,
    };
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let events = futures_util::stream::unfold(s, move |mut s| async move {
        loop {
            if let Some(ev) = s.queue.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.left == 0 {
                return None; // the sequences' guard goes with the state
            }
            let (i, e) = match s.rx.recv().await {
                Some(x) => x,
                None => (0, Event::Error("the engine stopped".into())),
            };
            match e {
                Event::Token(t) => {
                    s.choices[i].first_token.get_or_insert_with(Instant::now);
                    s.choices[i].text.push_str(&t.text);
                    s.predicted[i] += 1;
                    if !t.text.is_empty() || s.out.job.logprobs.is_some() || s.out.return_tokens {
                        let c = s
                            .out
                            .partial(i, &t.text, std::slice::from_ref(&t), s.predicted[i]);
                        s.queue.push_back(data(c));
                    }
                }
                Event::Finished {
                    reason,
                    text,
                    usage,
                    stop,
                } => {
                    if !text.is_empty() {
                        let c = s.out.partial(i, &text, &[], s.predicted[i]);
                        s.queue.push_back(data(c));
                    }
                    s.choices[i].finished(reason, &text, usage, stop);
                    let c = s.out.last(i, &s.choices[i], true);
                    s.queue.push_back(data(c));
                    s.left -= 1;
                }
                Event::Error(e) => {
                    let err = ApiError::internal(format!("generation failed: {e}"));
                    s.queue.push_back(data(err.body()));
                    s.left = 0;
                }
                Event::PromptScores(_) | Event::Embedding(_) => {}
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_names_become_openai_names_and_bad_values_are_named() {
        let mut v = json!({"prompt": "x", "n_predict": 5, "n_probs": 3, "echo": true, "n": 4});
        assert!(!translate(&mut v).unwrap());
        assert_eq!(
            v,
            json!({"prompt": "x", "n_predict": 5, "n_probs": 3, "max_tokens": 5,
            "logprobs": 3})
        );
        // -1 (and absent): up to the context; no alternatives with 0.
        let mut v = json!({"n_predict": -1, "n_probs": 0, "logprobs": 2, "return_tokens": true});
        assert!(translate(&mut v).unwrap());
        assert!(v.get("max_tokens").is_none() && v.get("logprobs").is_none());
        let weird = [
            json!("5"),
            json!(1.5),
            json!(-2),
            json!(true),
            json!([1]),
            json!({}),
        ];
        for field in ["n_predict", "n_probs", "return_tokens"] {
            for w in weird
                .iter()
                .filter(|w| !(field == "return_tokens" && w.is_boolean()))
            {
                let mut v = json!({ field: w.clone() });
                let e = translate(&mut v).expect_err("refused");
                assert_eq!(e.param.as_deref(), Some(field), "{field}: {w}");
            }
        }
        assert_eq!(
            translate(&mut json!({"n_predict": 0}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("n_predict")
        );
        assert!(translate(&mut json!([1])).is_err());
    }
}
