//! `POST /v1/chat/completions` and `POST /v1/completions`: a request becomes one engine
//! sequence per choice (`n` per prompt; sequences with the same prompt share its full KV
//! blocks through the prefix cache), whose events come back through a tokio channel and
//! leave as one JSON response or as server-sent events in OpenAI's chunk shapes.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use memra_engine::constraint::{Constraint, Grammar};
use memra_engine::engine::{
    Engine, Event, FinishReason, GenerationParams, PromptScore, Request, TokenEvent, Usage,
};
use memra_engine::models::Model;
use memra_engine::scheduler::SeqId;
use memra_engine::tokenizer::template::ChatInput;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tracing::Instrument;

use crate::call_stream::{call_deltas, CallStream};
use crate::error::ApiError;
use crate::fim;
use crate::params::{self, Endpoint, Fields, Prompt};
use crate::structured::{self, OutputGrammar, ToolChoice, ToolRequest};
use crate::tools::{self, ToolParse};
use crate::{json_body, request_id_header, unix_time, unix_time_micros, AppState, Ready};

pub(crate) async fn chat(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Endpoint::Chat).await
}

pub(crate) async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Endpoint::Completions).await
}

/// What a request asks, checked and tokenized.
pub(crate) struct Job {
    endpoint: Endpoint,
    pub(crate) id: String,
    created: u64,
    pub(crate) model: String,
    /// One sequence per choice, in choice order (prompt by prompt, `n` each).
    pub(crate) choices: Vec<Request>,
    /// The prompt of each choice.
    pub(crate) prompt_of: Vec<usize>,
    pub(crate) prompt_lens: Vec<usize>,
    /// Completions with `echo`: each prompt's text, which starts its choices' text (and,
    /// with `logprobs`, its tokens start the choices' log-probabilities).
    echo: Vec<String>,
    pub(crate) stream: bool,
    include_usage: bool,
    pub(crate) logprobs: Option<usize>,
    /// Chat with tools the model may call: how to find the calls in its output.
    tools: Option<ToolParse>,
}

async fn handle(st: Arc<AppState>, body: Result<Bytes, BytesRejection>, ep: Endpoint) -> Response {
    let rid = st.request_id();
    let span = tracing::info_span!("request", id = %rid);
    let headers = request_id_header(&rid);
    let r = async move {
        let start = Instant::now();
        let ready = st.ready()?;
        let v = json_body(body)?;
        // The chat template and the tokenizer may take a while on a large body: off the
        // async threads.
        let s = st.clone();
        let job = tokio::task::spawn_blocking(move || {
            let ready = s.ready()?;
            prepare(&s, ready, &v, ep, rid, false)
        })
        .await
        .map_err(|_| ApiError::internal("internal error (a bug) preparing the request"))??;
        tracing::info!(
            "{} prompt(s) of {:?} tokens, {} choice(s), max_tokens {}, stream {}",
            job.prompt_lens.len(),
            job.prompt_lens,
            job.choices.len() / job.prompt_lens.len().max(1),
            job.choices.first().map_or(0, |c| c.params.max_tokens),
            job.stream
        );
        let (rx, guard) = submit(&st, ready, &job.id, &job.choices, start)?;
        let model = ready.engine.model().clone();
        if job.stream {
            Ok(stream(job, rx, guard, model))
        } else {
            collect(job, rx, guard, &model).await
        }
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

/// Checks and tokenizes a request; `rest_by_default`: without `max_tokens` a choice may
/// generate to the end of the context (chat does anyway; llama-server's `/completion`).
pub(crate) fn prepare(
    st: &AppState,
    r: &Ready,
    v: &Value,
    ep: Endpoint,
    id: String,
    rest_by_default: bool,
) -> Result<Job, ApiError> {
    let f = Fields::of(v)?;
    let tok = &r.engine.model().tokenizer;
    let c = params::common(&f, ep, tok.n_vocab())?;
    let output = structured::output_grammar(&f)?;
    let mut tool_req: Option<ToolRequest> = None;
    let encode = |text: &str, add_bos: bool, field: &str| {
        tok.encode(text, add_bos, true)
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    };
    let echo = ep == Endpoint::Completions && f.bool("echo")?.unwrap_or(false);
    let (prompts, echo_texts, field) = match ep {
        Endpoint::Chat => {
            let mut messages = params::messages(&f)?;
            // With `tool_choice: none` the model is not told of the tools.
            tool_req = structured::tools(&f)?.filter(|t| t.choice != ToolChoice::None);
            if let Some(t) = &tool_req {
                if !r.template_has_tools {
                    let prompt = tools::json_format_prompt(&t.raw, t.parallel);
                    add_system_text(&mut messages, &prompt);
                }
            }
            let text = r
                .template
                .render(&ChatInput {
                    messages: &messages,
                    tools: tool_req.as_ref().map(|t| &t.raw),
                    add_generation_prompt: true,
                    bos_token: &r.bos,
                    eos_token: &r.eos,
                })
                .map_err(|e| {
                    ApiError::invalid("messages", format!("the chat template refused it: {e}"))
                })?;
            // A template that writes the BOS text itself must not get a second one.
            let add_bos = r.bos.is_empty() || !text.starts_with(&r.bos);
            (
                vec![encode(&text, add_bos, "messages")?],
                Vec::new(),
                "messages",
            )
        }
        Endpoint::Completions => {
            let suffix = f.string("suffix")?;
            let mut ids = Vec::new();
            let mut texts = Vec::new();
            for p in params::prompts(&f)? {
                match (p, suffix) {
                    // With a suffix, the prompt is the text before the hole (fim.rs).
                    (Prompt::Text(s), Some(sfx)) => {
                        let before = tok
                            .encode(&s, false, false)
                            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
                        ids.push(fim::prompt(tok, "suffix", None, &before, sfx)?);
                        texts.push(s);
                    }
                    // As `memra run`: BOS when the model asks for it, special tokens parsed.
                    (Prompt::Text(s), None) => {
                        ids.push(encode(&s, true, "prompt")?);
                        texts.push(s);
                    }
                    (Prompt::Tokens(t), sfx) => {
                        if echo {
                            texts.push(tok.decode_lossy(&t, false).unwrap_or_default());
                        }
                        ids.push(match sfx {
                            Some(sfx) => fim::prompt(tok, "suffix", None, &t, sfx)?,
                            None => t,
                        });
                    }
                }
            }
            (ids, if echo { texts } else { Vec::new() }, "prompt")
        }
    };
    let constraint = constraint(r, output.as_ref(), tool_req.as_ref())?;
    let info = r.engine.info();
    let mut choices = Vec::with_capacity(prompts.len() * c.n);
    let mut prompt_of = Vec::with_capacity(choices.capacity());
    for (pi, prompt) in prompts.iter().enumerate() {
        if prompt.len() >= info.n_ctx {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(
                    field,
                    format!(
                        "the prompt has {} tokens; the context holds {} (no room to generate)",
                        prompt.len(),
                        info.n_ctx
                    ),
                )
            });
        }
        let rest = info.n_ctx - prompt.len();
        let max_tokens = match (c.max_tokens, ep) {
            (Some(m), _) => m,
            (None, _) if rest_by_default => rest,
            (None, Endpoint::Chat) => rest,
            (None, Endpoint::Completions) => params::COMPLETIONS_DEFAULT_MAX_TOKENS.min(rest),
        };
        // Echoed with log-probabilities: every prompt token's but the first is scored (lm-eval's
        // loglikelihood requests); echoed with no tokens to generate: nothing is scored.
        let score_from = match (echo, c.logprobs, max_tokens) {
            (true, Some(_), _) => Some(0),
            (_, _, 0) => Some(prompt.len() - 1),
            _ => None,
        };
        for i in 0..c.n {
            let request = Request {
                prompt: prompt.clone(),
                params: GenerationParams {
                    max_tokens,
                    sampler: c.sampler_for(i, fresh_seed()),
                    stop: c.stop.clone(),
                    ignore_eos: c.ignore_eos,
                    logprobs: c.logprobs,
                    score_from,
                    constraint: constraint.clone(),
                    draft_max: c.draft_max,
                    draft_min: c.draft_min,
                    embed: None,
                },
            };
            r.engine
                .validate(&request)
                .map_err(|e| ApiError::from_engine(&e, field))?;
            choices.push(request);
            prompt_of.push(pi);
        }
    }
    Ok(Job {
        endpoint: ep,
        id: match ep {
            Endpoint::Chat => format!("chatcmpl-{id}"),
            Endpoint::Completions => format!("cmpl-{id}"),
        },
        created: unix_time(),
        model: c.model.unwrap_or_else(|| st.config.model_id.clone()),
        prompt_lens: prompts.iter().map(Vec::len).collect(),
        choices,
        prompt_of,
        echo: echo_texts,
        stream: c.stream,
        include_usage: c.include_usage,
        logprobs: c.logprobs,
        tools: tool_req.map(|t| ToolParse {
            format: r.tool_format,
            tools: t.tools,
            parallel: t.parallel,
        }),
    })
}

/// `text` as the conversation's first system message (or added to it).
fn add_system_text(messages: &mut Value, text: &str) {
    let Value::Array(list) = messages else {
        return;
    };
    match list.first_mut() {
        Some(m) if m["role"] == "system" => {
            let content = m["content"].as_str().unwrap_or_default();
            m["content"] = json!(format!("{content}\n\n{text}"));
        }
        _ => list.insert(0, json!({"role": "system", "content": text})),
    }
}

/// The request's grammar, compiled (within llguidance's limits, so a hostile one is a
/// 400, not a hang): the output format's, or the tool call's that `tool_choice` requires.
fn constraint(
    r: &Ready,
    output: Option<&OutputGrammar>,
    tool_req: Option<&ToolRequest>,
) -> Result<Option<Constraint>, ApiError> {
    let forced = tool_req.and_then(|t| match &t.choice {
        ToolChoice::Required => Some(None),
        ToolChoice::Function(name) => Some(Some(name.as_str())),
        _ => None,
    });
    let (grammar, field, what) = match (output, forced) {
        (Some(o), Some(_)) => {
            return Err(ApiError::invalid(
                o.field,
                format!(
                    "'{}' cannot be combined with a required tool call ('tool_choice')",
                    o.field
                ),
            ))
        }
        (Some(o), None) => {
            let what = match &o.grammar {
                Grammar::JsonObject | Grammar::JsonSchema(_) => "the JSON schema",
                Grammar::Lark(_) => "the Lark grammar",
                Grammar::Gbnf(_) => "the GBNF grammar",
            };
            (o.grammar.clone(), o.field, what)
        }
        (None, Some(only)) => {
            let t = tool_req.expect("a forced call has tools");
            let g = tools::grammar(r.tool_format, &t.tools, only, t.parallel);
            (g, "tools", "the tools' parameters")
        }
        (None, None) => return Ok(None),
    };
    r.engine
        .compile_grammar(&grammar)
        .map(Some)
        .map_err(|e| ApiError {
            code: Some("invalid_grammar"),
            ..ApiError::invalid(field, format!("{what} cannot be used: {e}"))
        })
}

/// A seed for a request that gives none (splitmix64 over the clock and a counter).
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut z = unix_time_micros()
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sequences of a request while they run: dropping it (the client went away, the
/// stream was dropped) cancels those not finished, whose blocks go back at the engine's
/// next step.
pub(crate) struct Inflight {
    st: Arc<AppState>,
    engine: Arc<Engine>,
    ids: Vec<SeqId>,
    /// Whether a choice's end was counted (by its sink at the finish, or here as an abort).
    claimed: Arc<Vec<AtomicBool>>,
    n: usize,
    request: String,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        let mut aborted = 0;
        for (i, &id) in self.ids.iter().enumerate() {
            if !self.claimed[i].swap(true, Ordering::AcqRel) {
                self.engine.cancel(id);
                self.st.metrics.finished("abort");
                aborted += 1;
            }
        }
        self.st.pending.fetch_sub(self.n, Ordering::AcqRel);
        if aborted > 0 {
            tracing::info!(
                "request {}: the client went away, {aborted} sequence(s) cancelled",
                self.request
            );
        }
    }
}

pub(crate) fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::EndOfGeneration | FinishReason::StopString => "stop",
    }
}

pub(crate) type Events = UnboundedReceiver<(usize, Event)>;

/// Queues a request's sequences (`choices`, the request's id `id`); refuses them (503)
/// when the queue is full.
pub(crate) fn submit(
    st: &Arc<AppState>,
    r: &Ready,
    id: &str,
    choices: &[Request],
    start: Instant,
) -> Result<(Events, Inflight), ApiError> {
    let n = choices.len();
    let cap = st.capacity();
    let before = st.pending.fetch_add(n, Ordering::AcqRel);
    // One request larger than the whole queue still runs when nothing else waits.
    if before > 0 && before + n > cap {
        st.pending.fetch_sub(n, Ordering::AcqRel);
        return Err(ApiError::busy(cap));
    }
    let claimed: Arc<Vec<AtomicBool>> = Arc::new((0..n).map(|_| AtomicBool::new(false)).collect());
    let mut guard = Inflight {
        st: st.clone(),
        engine: r.engine.clone(),
        ids: Vec::with_capacity(n),
        claimed: claimed.clone(),
        n,
        request: id.to_string(),
    };
    let (tx, rx) = unbounded_channel();
    for (i, request) in choices.iter().enumerate() {
        let tx = tx.clone();
        let st = st.clone();
        let claimed = claimed.clone();
        let mut last: Option<Instant> = None;
        // Runs on the engine thread: counts, then forwards; a closed channel cancels.
        let sink = Box::new(move |e: Event| {
            let m = &st.metrics;
            match &e {
                Event::Token(_) => {
                    let now = Instant::now();
                    match last {
                        None => m.ttft.observe((now - start).as_secs_f64()),
                        Some(l) => m.itl.observe((now - l).as_secs_f64()),
                    }
                    last = Some(now);
                    m.generation_tokens.inc();
                }
                Event::Finished { reason, usage, .. } => {
                    m.e2e.observe(start.elapsed().as_secs_f64());
                    m.prompt_tokens.inc_by(usage.prompt_tokens as u64);
                    m.prefix_queries.inc_by(usage.prompt_tokens as u64);
                    m.prefix_hits.inc_by(usage.cached_tokens as u64);
                    if !claimed[i].swap(true, Ordering::AcqRel) {
                        m.finished(if tx.is_closed() {
                            "abort"
                        } else {
                            finish_reason(*reason)
                        });
                    }
                }
                Event::Error(_) => {
                    if !claimed[i].swap(true, Ordering::AcqRel) {
                        m.finished("error");
                    }
                }
                Event::PromptScores(_) | Event::Embedding(_) => {}
            }
            tx.send((i, e)).is_ok()
        });
        let id = r
            .engine
            .submit_with(request.clone(), sink)
            .map_err(|e| ApiError::from_engine(&e, "prompt"))?;
        guard.ids.push(id);
    }
    Ok((rx, guard))
}

/// What one choice produced.
#[derive(Default)]
pub(crate) struct ChoiceOut {
    pub(crate) text: String,
    pub(crate) tokens: Vec<TokenEvent>,
    /// When its first token came (llama-server's timings).
    pub(crate) first_token: Option<Instant>,
    /// An echoed prompt's scores (with `logprobs`).
    prompt_scores: Vec<PromptScore>,
    /// An embedding request's pooled state.
    pub(crate) embedding: Vec<f32>,
    pub(crate) finish: Option<FinishReason>,
    /// The stop string that ended it, if one did.
    pub(crate) stop: Option<String>,
    pub(crate) usage: Usage,
}

impl ChoiceOut {
    /// Its end (the fields of the engine's `Finished`): the text held back added.
    pub(crate) fn finished(
        &mut self,
        reason: FinishReason,
        text: &str,
        usage: Usage,
        stop: Option<String>,
    ) {
        self.text.push_str(text);
        self.finish = Some(reason);
        self.usage = usage;
        self.stop = stop;
    }
}

/// Every choice's events until each has ended (answers that are not streamed); the
/// sequences' guard goes when they have.
pub(crate) async fn gather(
    n: usize,
    rx: &mut Events,
    guard: Inflight,
) -> Result<Vec<ChoiceOut>, ApiError> {
    let mut outs: Vec<ChoiceOut> = (0..n).map(|_| ChoiceOut::default()).collect();
    let mut left = n;
    while left > 0 {
        let Some((i, e)) = rx.recv().await else {
            return Err(ApiError::internal("the engine stopped"));
        };
        let o = &mut outs[i];
        match e {
            Event::Token(t) => {
                o.first_token.get_or_insert_with(Instant::now);
                o.text.push_str(&t.text);
                o.tokens.push(t);
            }
            Event::Finished {
                reason,
                text,
                usage,
                stop,
            } => {
                o.finished(reason, &text, usage, stop);
                left -= 1;
            }
            Event::Error(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
            Event::PromptScores(s) => o.prompt_scores = s,
            Event::Embedding(v) => o.embedding = v,
        }
    }
    drop(guard);
    Ok(outs)
}

/// The usage of a whole request: each prompt counted once, every choice's tokens.
fn usage_json(job: &Job, outs: &[Usage]) -> Value {
    let prompt: usize = job.prompt_lens.iter().sum();
    let completion: usize = outs.iter().map(|u| u.completion_tokens).sum();
    let mut cached = vec![0; job.prompt_lens.len()];
    for (u, &p) in outs.iter().zip(&job.prompt_of) {
        cached[p] = cached[p].max(u.cached_tokens);
    }
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached.iter().sum::<usize>()},
    })
}

/// A token as the logprobs fields show it: its text (special tokens too) and bytes.
fn token_piece(model: &Model, id: u32) -> (String, Vec<u8>) {
    let bytes = model.tokenizer.token_bytes(id, true).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
fn chat_logprobs(model: &Model, tokens: &[TokenEvent]) -> Value {
    json!({ "content": token_entries(model, tokens, false) })
}

/// Each token as `{"token", "logprob", "bytes", "top_logprobs": [...]}`, its alternatives
/// alike; with `id`, each with its `"id"` too (llama-server's `completion_probabilities`).
pub(crate) fn token_entries(model: &Model, tokens: &[TokenEvent], id: bool) -> Vec<Value> {
    let entry = |t: u32, lp: f32| {
        let (text, bytes) = token_piece(model, t);
        let mut e = json!({"token": text, "logprob": lp, "bytes": bytes});
        if id {
            e["id"] = json!(t);
        }
        e
    };
    tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.id, t.logprob.unwrap_or(0.0));
            e["top_logprobs"] = t
                .top_logprobs
                .iter()
                .map(|&(id, lp)| entry(id, lp))
                .collect();
            e
        })
        .collect()
}

/// Completions' `logprobs`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
/// offsets in characters of the choice's text.
#[derive(Default)]
struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// A token at `offset`, which moves past its text.
    fn push(
        &mut self,
        model: &Model,
        id: u32,
        logprob: Option<f32>,
        top: Option<&[(u32, f32)]>,
        offset: &mut usize,
    ) {
        let (text, _) = token_piece(model, id);
        self.text_offset.push(*offset);
        *offset += text.chars().count();
        self.tokens.push(text);
        self.token_logprobs.push(logprob);
        self.top_logprobs.push(match top {
            None => Value::Null,
            Some(top) => Value::Object(
                top.iter()
                    .map(|&(id, lp)| (token_piece(model, id).0, json!(lp)))
                    .collect(),
            ),
        });
    }

    /// An echoed prompt's tokens from offset 0, scored each given those before it (the
    /// first, with nothing before it, has no log-probability, as in OpenAI's and vLLM's).
    fn push_prompt(&mut self, model: &Model, prompt: &[u32], scores: &[PromptScore]) {
        let mut offset = 0;
        for (i, &id) in prompt.iter().enumerate() {
            let s = i.checked_sub(1).and_then(|k| scores.get(k));
            let top = s.map(|s| s.top_logprobs.as_slice());
            self.push(model, id, s.map(|s| s.logprob), top, &mut offset);
        }
    }

    fn push_generated(&mut self, model: &Model, tokens: &[TokenEvent], offset: &mut usize) {
        for t in tokens {
            self.push(model, t.id, t.logprob, Some(&t.top_logprobs), offset);
        }
    }

    fn json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// Waits for every choice's end and answers in one JSON response.
async fn collect(
    job: Job,
    mut rx: Events,
    guard: Inflight,
    model: &Model,
) -> Result<Response, ApiError> {
    let mut outs = gather(job.choices.len(), &mut rx, guard).await?;
    for (i, o) in outs.iter_mut().enumerate() {
        if let Some(e) = job.echo.get(job.prompt_of[i]) {
            o.text.insert_str(0, e);
        }
    }
    let usages: Vec<Usage> = outs.iter().map(|o| o.usage.clone()).collect();
    let usage = usage_json(&job, &usages);
    let finish = |o: &ChoiceOut| o.finish.map(finish_reason);
    let choices: Vec<Value> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| match job.endpoint {
            Endpoint::Chat => {
                let parsed = job.tools.as_ref().map(|t| t.parse(&o.text));
                match parsed.filter(|p| !p.calls.is_empty()) {
                    Some(p) => json!({
                        "index": i,
                        "message": {
                            "role": "assistant",
                            "content": p.content,
                            "tool_calls": p.calls.iter().map(|c| json!({
                                "id": tools::call_id(),
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json()},
                            })).collect::<Vec<_>>(),
                        },
                        "logprobs": job.logprobs.map(|_| chat_logprobs(model, &o.tokens)),
                        "finish_reason": "tool_calls",
                    }),
                    None => json!({
                        "index": i,
                        "message": {"role": "assistant", "content": o.text},
                        "logprobs": job.logprobs.map(|_| chat_logprobs(model, &o.tokens)),
                        "finish_reason": finish(o),
                    }),
                }
            }
            Endpoint::Completions => {
                let echo = job.echo.get(job.prompt_of[i]);
                let logprobs = job.logprobs.map(|_| {
                    let mut lp = CompletionLogprobs::default();
                    if echo.is_some() {
                        lp.push_prompt(model, &job.choices[i].prompt, &o.prompt_scores);
                    }
                    let mut offset = echo.map_or(0, |e| e.chars().count());
                    lp.push_generated(model, &o.tokens, &mut offset);
                    lp.json()
                });
                json!({
                    "index": i,
                    "text": o.text,
                    "logprobs": logprobs,
                    "finish_reason": finish(o),
                })
            }
        })
        .collect();
    tracing::info!(
        "done: {} completion tokens, finish {:?}",
        usage["completion_tokens"],
        outs.iter().map(finish).collect::<Vec<_>>()
    );
    let object = match job.endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    Ok(Json(json!({
        "id": job.id,
        "object": object,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response())
}

/// The state of a streamed response: engine events in, SSE events out.
struct Streamer {
    job: Job,
    rx: Events,
    guard: Option<Inflight>,
    model: Arc<Model>,
    queue: VecDeque<SseEvent>,
    left: usize,
    usages: Vec<Usage>,
    /// Completions' logprob text offsets, per choice.
    offsets: Vec<usize>,
    /// With tools, per choice: the text so far and how much of it went out as content.
    calls: Vec<CallStream>,
    done: bool,
}

impl Streamer {
    fn chunk(&self, choices: Vec<Value>) -> SseEvent {
        let object = match self.job.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut c = json!({
            "id": self.job.id,
            "object": object,
            "created": self.job.created,
            "model": self.job.model,
            "choices": choices,
        });
        if self.job.include_usage {
            c["usage"] = Value::Null;
        }
        SseEvent::default().data(c.to_string())
    }

    /// A choice's piece of text (and its tokens' log-probabilities).
    fn piece(&mut self, i: usize, text: &str, tokens: &[TokenEvent]) -> Value {
        match self.job.endpoint {
            Endpoint::Chat => json!({
                "index": i,
                "delta": {"content": text},
                "logprobs": self.job.logprobs.map(|_| chat_logprobs(&self.model, tokens)),
                "finish_reason": null,
            }),
            Endpoint::Completions => {
                let lp = self.job.logprobs.map(|_| {
                    let mut lp = CompletionLogprobs::default();
                    lp.push_generated(&self.model, tokens, &mut self.offsets[i]);
                    lp.json()
                });
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null})
            }
        }
    }

    /// The first events: the role of each choice (chat), the echoed prompt (completions;
    /// with `logprobs`, when its scores come).
    fn start(&mut self) {
        for i in 0..self.job.choices.len() {
            let first = match self.job.endpoint {
                Endpoint::Chat => Some(json!({
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                })),
                Endpoint::Completions if self.job.logprobs.is_some() => None,
                Endpoint::Completions => self.echo(i, None),
            };
            if let Some(c) = first {
                let ev = self.chunk(vec![c]);
                self.queue.push_back(ev);
            }
        }
    }

    /// Choice `i`'s echoed prompt, if it echoes, with its tokens' scores when asked.
    fn echo(&mut self, i: usize, scores: Option<&[PromptScore]>) -> Option<Value> {
        let e = self.job.echo.get(self.job.prompt_of[i])?.clone();
        self.offsets[i] = e.chars().count();
        let lp = scores.map(|s| {
            let mut lp = CompletionLogprobs::default();
            lp.push_prompt(&self.model, &self.job.choices[i].prompt, s);
            lp.json()
        });
        Some(json!({"index": i, "text": e, "logprobs": lp, "finish_reason": null}))
    }

    /// The end of choice `i` with tools: the held text parsed; the calls, or the text.
    fn finish_calls(&mut self, i: usize, text: &str) -> Option<&'static str> {
        let tp = self.job.tools.as_ref()?;
        let (rest, calls) = self.calls[i].finish(tp, text);
        if !rest.is_empty() {
            let c = self.piece(i, &rest, &[]);
            let ev = self.chunk(vec![c]);
            self.queue.push_back(ev);
        }
        if calls.is_empty() {
            return None;
        }
        for delta in call_deltas(&calls) {
            let c = json!({
                "index": i, "delta": {"tool_calls": delta}, "logprobs": null, "finish_reason": null,
            });
            let ev = self.chunk(vec![c]);
            self.queue.push_back(ev);
        }
        Some("tool_calls")
    }

    fn on_event(&mut self, i: usize, e: Event) {
        match e {
            Event::Token(t) if self.job.tools.is_some() => {
                // Log-probabilities are not streamed while tool calls may come.
                let tp = self.job.tools.as_ref().expect("tools");
                let text = self.calls[i].push(tp, &t.text);
                if !text.is_empty() {
                    let c = self.piece(i, &text, &[]);
                    let ev = self.chunk(vec![c]);
                    self.queue.push_back(ev);
                }
            }
            Event::Token(t) => {
                if t.text.is_empty() && self.job.logprobs.is_none() {
                    return;
                }
                let text = t.text.clone();
                let c = self.piece(i, &text, std::slice::from_ref(&t));
                let ev = self.chunk(vec![c]);
                self.queue.push_back(ev);
            }
            Event::Finished {
                reason,
                text,
                usage,
                ..
            } => {
                let mut why = finish_reason(reason);
                if self.job.tools.is_some() {
                    if let Some(w) = self.finish_calls(i, &text) {
                        why = w;
                    }
                } else if !text.is_empty() {
                    let c = self.piece(i, &text, &[]);
                    let ev = self.chunk(vec![c]);
                    self.queue.push_back(ev);
                }
                let last = match self.job.endpoint {
                    Endpoint::Chat => json!({
                        "index": i, "delta": {}, "logprobs": null,
                        "finish_reason": why,
                    }),
                    Endpoint::Completions => json!({
                        "index": i, "text": "", "logprobs": null,
                        "finish_reason": finish_reason(reason),
                    }),
                };
                let ev = self.chunk(vec![last]);
                self.queue.push_back(ev);
                self.usages[i] = usage;
                self.left -= 1;
                if self.left == 0 {
                    self.end();
                }
            }
            Event::Error(e) => {
                let err = ApiError::internal(format!("generation failed: {e}"));
                self.queue
                    .push_back(SseEvent::default().data(err.body().to_string()));
                self.end();
            }
            Event::PromptScores(s) => {
                if self.job.endpoint == Endpoint::Completions && self.job.logprobs.is_some() {
                    if let Some(c) = self.echo(i, Some(&s)) {
                        let ev = self.chunk(vec![c]);
                        self.queue.push_back(ev);
                    }
                }
            }
            Event::Embedding(_) => {}
        }
    }

    /// The usage chunk when asked, then `[DONE]`.
    fn end(&mut self) {
        let usage = usage_json(&self.job, &self.usages);
        tracing::info!(
            "request {}: streamed, {} completion tokens",
            self.job.id,
            usage["completion_tokens"]
        );
        if self.job.include_usage {
            let object = match self.job.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completions => "text_completion",
            };
            let c = json!({
                "id": self.job.id,
                "object": object,
                "created": self.job.created,
                "model": self.job.model,
                "choices": [],
                "usage": usage,
            });
            self.queue
                .push_back(SseEvent::default().data(c.to_string()));
        }
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.done = true;
        self.guard = None;
    }
}

fn stream(job: Job, rx: Events, guard: Inflight, model: Arc<Model>) -> Response {
    let n = job.choices.len();
    let mut s = Streamer {
        job,
        rx,
        guard: Some(guard),
        model,
        queue: VecDeque::new(),
        left: n,
        usages: vec![Usage::default(); n],
        offsets: vec![0; n],
        calls: (0..n).map(|_| CallStream::default()).collect(),
        done: false,
    };
    s.start();
    // Dropping the stream (the client went away) drops the guard: the sequences end.
    let events = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(ev) = s.queue.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some((i, e)) => s.on_event(i, e),
                None => {
                    tracing::warn!("request {}: the engine dropped its sequences", s.job.id);
                    s.on_event(0, Event::Error("the engine stopped".into()));
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
