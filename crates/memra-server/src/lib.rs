//! memra-server: an OpenAI-compatible HTTP server over memra's continuous-batching engine.
//!
//! It knows wire types, server-sent events and chat templates, nothing of kernels: the
//! caller hands it a loader that returns a started [`Engine`]. The server binds first and
//! loads after (`/health` says 503 until the engine is up), then serves
//! `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`, `/health`,
//! `/metrics`, `/tokenize` and `/detokenize`. Engine calls never block: requests go in with
//! `Engine::submit_with`, whose sink (on the engine thread) forwards events into a tokio
//! channel and reports a closed channel, which cancels the request.

mod call_stream;
mod embeddings;
pub mod error;
mod fim;
pub mod metrics;
mod native;
mod openai;
pub mod params;
mod structured;
pub mod tools;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use memra_engine::engine::{Engine, Pooling};
use memra_engine::tokenizer::template::{ChatTemplate, TemplateError};
use serde_json::{json, Value};

use error::ApiError;
use metrics::Metrics;
use params::Fields;

/// How the server runs (the engine's own settings are the loader's).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// The model's id in `/v1/models` and in responses (`--alias`).
    pub model_id: String,
    /// Clients must send `Authorization: Bearer KEY` on `/v1/*`, `/tokenize`, `/detokenize`.
    pub api_key: Option<String>,
    /// Sequences that may wait beyond those running (`--parallel`); more is a 503.
    pub max_queue: usize,
    /// A built-in template name or a template file instead of the model's.
    pub chat_template: Option<String>,
    /// After SIGINT / SIGTERM, how long running requests may take to finish.
    pub grace: Duration,
    /// Request bodies larger than this are refused (413).
    pub body_limit: usize,
    /// How the model writes tool calls, instead of what its chat template says.
    pub tool_format: Option<tools::ToolFormat>,
    /// Serve `/v1/embeddings` (`--embeddings`).
    pub embeddings: bool,
    /// How embeddings pool the prompt's states, instead of what the file says (or, where
    /// it says nothing, the last token's, as vLLM pools decoder models).
    pub pooling: Option<Pooling>,
}

/// Loads the model and starts the engine (on a blocking thread, while the server already
/// answers `/health` with 503).
pub type Loader = Box<dyn FnOnce() -> Result<Engine> + Send>;

/// What exists once the model is loaded.
struct Ready {
    engine: Arc<Engine>,
    template: ChatTemplate,
    bos: String,
    eos: String,
    /// How the model writes tool calls.
    tool_format: tools::ToolFormat,
    /// Whether the chat template renders `tools` itself (else the server describes them
    /// in a system message).
    template_has_tools: bool,
    /// Unix time the model became ready (`created` of `/v1/models`).
    created: u64,
    /// How `/v1/embeddings` pools; `None`: embeddings are not served.
    pooling: Option<Pooling>,
}

struct AppState {
    config: ServerConfig,
    ready: OnceLock<Ready>,
    metrics: Metrics,
    /// Sequences submitted and not yet finished (each choice of each request counts).
    pending: AtomicUsize,
    next_request: AtomicU64,
}

impl AppState {
    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(ApiError::loading)
    }

    /// Sequences the server takes at once: the running batch plus the queue.
    fn capacity(&self) -> usize {
        let running = self.ready.get().map_or(0, |r| r.engine.info().max_running);
        running + self.config.max_queue
    }

    /// A request id: unique within this process and unlikely to repeat across restarts.
    fn request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{:012x}{n:06x}", unix_time_micros() & 0xffff_ffff_ffff)
    }
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn unix_time_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Runs the server until SIGINT or SIGTERM: binds, loads with `load`, serves; after the
/// signal, stops accepting, lets running requests finish within the grace period, and
/// returns `Ok` (the caller exits 0).
pub fn run(config: ServerConfig, load: Loader) -> Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
    // The engine thread and rayon's pool do the model's work; two threads carry HTTP.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = rt.block_on(serve(config, load));
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

async fn serve(config: ServerConfig, load: Loader) -> Result<()> {
    let addr: SocketAddr = format!("{}:{}", config.host, config.port)
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(config.host.as_str(), config.port))
                .ok()
                .and_then(|mut a| a.next())
                .context("no such address")
        })
        .with_context(|| format!("bad address {}:{}", config.host, config.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let addr = listener.local_addr()?;
    tracing::info!("listening on http://{addr} (model {})", config.model_id);
    let grace = config.grace;
    let template_choice = config.chat_template.clone();
    let tool_format = config.tool_format;
    let embeddings = config.embeddings.then_some(config.pooling);
    let state = Arc::new(AppState {
        config,
        ready: OnceLock::new(),
        metrics: Metrics::new(),
        pending: AtomicUsize::new(0),
        next_request: AtomicU64::new(1),
    });
    let app = router(state.clone());

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down: no new connections; running requests get {grace:?}");
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&s| s).await;
    };

    let loading = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let engine = load()?;
            let ready = make_ready(engine, template_choice.as_deref(), tool_format, embeddings)?;
            let info = ready.engine.info();
            tracing::info!(
                "ready: {} sequences at once, context {}, KV pool {} positions ({} blocks of {})",
                info.max_running,
                info.n_ctx,
                info.kv_tokens(),
                info.num_blocks,
                info.block_size
            );
            let _ = state.ready.set(ready);
            Ok(())
        })
    };

    let server = axum::serve(listener, app).with_graceful_shutdown(stopped(stop_rx.clone()));
    let grace_over = {
        let rx = stop_rx.clone();
        async move {
            stopped(rx).await;
            tokio::time::sleep(grace).await;
        }
    };
    let loaded = async {
        match loading.await {
            Ok(Ok(())) => std::future::pending::<Result<()>>().await,
            Ok(Err(e)) => Err(e),
            Err(e) => Err(anyhow::anyhow!("the loader panicked: {e}")),
        }
    };
    tokio::select! {
        r = server => r.context("the server failed")?,
        r = loaded => return r.context("cannot load the model"),
        _ = grace_over => tracing::warn!("grace period over: aborting the requests left"),
    }
    tracing::info!("stopped");
    Ok(())
}

/// `embeddings`: served, with the pooling asked for if any.
fn make_ready(
    engine: Engine,
    choice: Option<&str>,
    tool_format: Option<tools::ToolFormat>,
    embeddings: Option<Option<Pooling>>,
) -> Result<Ready> {
    let model = engine.model().clone();
    let pooling = match embeddings {
        None => None,
        Some(asked) => {
            let p = Pooling::for_model(&model, asked).map_err(anyhow::Error::msg)?;
            tracing::info!("embeddings with {} pooling", p.name());
            Some(p)
        }
    };
    let template = match ChatTemplate::select(&model.file.metadata, choice) {
        Ok(t) => t,
        // llama-server's fallback for a model without a template.
        Err(TemplateError::NoTemplate) if choice.is_none() => {
            tracing::warn!("the model has no chat template: using chatml");
            ChatTemplate::builtin("chatml")?
        }
        Err(e) => return Err(e).context("cannot use the chat template"),
    };
    let t = &model.tokenizer;
    let token = |id: Option<u32>| id.and_then(|i| t.token_text(i)).unwrap_or("").to_string();
    let tool_format = tool_format.unwrap_or_else(|| tools::ToolFormat::detect(template.source()));
    tracing::info!("tool calls in the {} format", tool_format.name());
    Ok(Ready {
        bos: token(t.bos),
        eos: token(t.eos),
        tool_format,
        template_has_tools: template.source().contains("tools"),
        engine: Arc::new(engine),
        template,
        created: unix_time(),
        pooling,
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn router(state: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/completion", post(native::completion))
        .route("/completions", post(native::completion))
        .route("/infill", post(native::infill))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    let limit = state.config.body_limit;
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .merge(protected)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::internal("internal error (a bug): the request failed").into_response()
            },
        ))
        .with_state(state)
}

/// Equal in time whatever the bytes (the length may show).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!("Invalid URL ({method} {uri})"))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: Some("method_not_allowed"),
        ..ApiError::not_found(format!("Method {method} not allowed on {uri}"))
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.ready() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let stats = st.ready.get().map(|r| r.engine.stats());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.encode(stats),
    )
        .into_response()
}

/// The served model as `/v1/models` lists it.
fn model_object(st: &AppState, r: &Ready) -> Value {
    let model = r.engine.model();
    json!({
        "id": st.config.model_id,
        "object": "model",
        "created": r.created,
        "owned_by": "memra",
        "meta": {
            "architecture": model.arch,
            "name": model.name,
            "n_params": model.n_params,
            "size": model.file.file_size(),
            "n_vocab": model.tokenizer.n_vocab(),
            "n_ctx": r.engine.info().n_ctx,
            "n_ctx_train": model.decoder.hp.n_ctx_train,
        },
    })
}

async fn models(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let r = st.ready()?;
    Ok(Json(
        json!({"object": "list", "data": [model_object(&st, r)]}),
    ))
}

/// `GET /v1/models/{id}` (the client's `models.retrieve`): the model, or 404 for another
/// id. The id may hold slashes (`org/name` aliases), hence the wildcard.
async fn model(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let r = st.ready()?;
    if id != st.config.model_id {
        return Err(ApiError {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..ApiError::not_found(format!("The model '{id}' does not exist"))
        });
    }
    Ok(Json(model_object(&st, r)))
}

/// The body as JSON; a body over the limit is a 413, malformed JSON a 400.
fn json_body(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(|e| ApiError {
        status: e.status(),
        ..ApiError::bad_request(e.body_text())
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))
}

/// `/tokenize` in llama-server's shape, `{"content", "add_special" (false), "parse_special"
/// (true), "with_pieces" (false)}` to `{"tokens": [...]}`, or in vLLM's, `{"prompt",
/// "add_special_tokens" (true)}` to `{"count", "max_model_len", "tokens", "token_strs"}`
/// (what lm-evaluation-harness's remote tokenizer sends).
async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r = st.ready()?;
    let v = json_body(body)?;
    let f = Fields::of(&v)?;
    if f.get("content").is_none() {
        if let Some(prompt) = f.string("prompt")? {
            let add = f.bool("add_special_tokens")?.unwrap_or(true);
            let ids = r
                .engine
                .model()
                .tokenizer
                .encode(prompt, add, true)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            return Ok(Json(json!({
                "count": ids.len(),
                "max_model_len": r.engine.info().n_ctx,
                "tokens": ids,
                "token_strs": null,
            })));
        }
    }
    let content = f.string("content")?.ok_or_else(|| {
        ApiError::invalid(
            "content",
            "Missing required parameter: 'content' (or vLLM's 'prompt')",
        )
    })?;
    let add_special = f.bool("add_special")?.unwrap_or(false);
    let parse_special = f.bool("parse_special")?.unwrap_or(true);
    let with_pieces = f.bool("with_pieces")?.unwrap_or(false);
    let tok = &r.engine.model().tokenizer;
    let ids = tok
        .encode(content, add_special, parse_special)
        .map_err(|e| ApiError::invalid("content", e.to_string()))?;
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id, true).unwrap_or_default();
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(e) => json!(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(Json(json!({ "tokens": tokens })))
}

/// `/detokenize`: `{"tokens": [...]}` to `{"content"}` (llama-server's name) and
/// `{"prompt"}` (vLLM's), the same text.
async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r = st.ready()?;
    let v = json_body(body)?;
    let f = Fields::of(&v)?;
    let bad = || ApiError::invalid("tokens", "'tokens' must be an array of token ids");
    let ids: Vec<u32> = match f.get("tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or_else(bad)?,
        None => Vec::new(),
        Some(_) => return Err(bad()),
    };
    let content = r
        .engine
        .model()
        .tokenizer
        .decode_lossy(&ids, true)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(json!({ "content": content, "prompt": content })))
}

/// vLLM's `GET /tokenizer_info`: the special tokens' texts, the chat template, the
/// context: what a client needs to use `/tokenize` and `/detokenize` as its tokenizer.
async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let r = st.ready()?;
    let tok = &r.engine.model().tokenizer;
    let text = |t: &str| (!t.is_empty()).then(|| t.to_string());
    Ok(Json(json!({
        "tokenizer_class": "memra",
        "bos_token": text(&r.bos),
        "eos_token": text(&r.eos),
        "pad_token": null,
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "chat_template": r.template.source(),
        "model_max_length": r.engine.info().n_ctx,
        "vocab_size": tok.n_vocab(),
    })))
}

/// The `x-request-id` header of a response.
fn request_id_header(id: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Ok(v) = id.parse() {
        h.insert("x-request-id", v);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
