//! `POST /v1/embeddings` (served with `--embeddings`): each input becomes one engine
//! sequence that computes its prompt and returns the pooled last hidden state, normalized
//! (Euclidean, or as llama-server's `embd_normalize` asks), as floats or as base64 of
//! little-endian f32 (what the official client asks for by default).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use memra_engine::engine::{normalize, GenerationParams, Pooling, Request};
use serde_json::{json, Value};
use tracing::Instrument;

use crate::error::ApiError;
use crate::openai::{gather, submit};
use crate::params::{prompts_in, Fields, Prompt};
use crate::{json_body, request_id_header, AppState};

/// Inputs one request may hold (OpenAI's limit).
const MAX_INPUTS: usize = 2048;

pub(crate) async fn embeddings(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let rid = st.request_id();
    let span = tracing::info_span!("request", id = %rid);
    let headers = request_id_header(&rid);
    let r = handle(st, body, &rid).instrument(span).await;
    match r {
        Ok(v) => (headers, Json(v)).into_response(),
        Err(e) => {
            tracing::info!("refused: {} {}", e.status.as_u16(), e.message);
            (headers, e).into_response()
        }
    }
}

/// How the vectors leave.
#[derive(Clone, Copy, PartialEq)]
enum Encoding {
    Float,
    Base64,
}

async fn handle(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    rid: &str,
) -> Result<Value, ApiError> {
    let start = Instant::now();
    let ready = st.ready()?;
    let Some(pooling) = ready.pooling else {
        return Err(ApiError {
            status: StatusCode::NOT_IMPLEMENTED,
            kind: "not_supported_error",
            ..ApiError::internal(
                "This server does not serve embeddings: start it with --embeddings",
            )
        });
    };
    let v = json_body(body)?;
    let f = Fields::of(&v)?;
    let model = f
        .string("model")?
        .unwrap_or(&st.config.model_id)
        .to_string();
    f.string("user")?; // accepted, unused
    let encoding = match f.string("encoding_format")? {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("'encoding_format' must be 'float' or 'base64', not {other:?}"),
            ))
        }
    };
    let n_embd = ready.engine.model().decoder.hp.n_embd;
    if let Some(d) = f.integer("dimensions", 1, i64::MAX)? {
        if d as usize != n_embd {
            return Err(ApiError::invalid(
                "dimensions",
                format!("this model's embeddings have {n_embd} dimensions, not {d}"),
            ));
        }
    }
    // llama-server's: -1 none, 0 max-abs scaled to int16, 1 taxicab, 2 Euclidean, p > 2.
    let norm = f.integer("embd_normalize", -1, 64)?.unwrap_or(2);
    let inputs = prompts_in(&f, "input", MAX_INPUTS)?;
    // Up to MAX_INPUTS texts to tokenize: off the async threads.
    let s = st.clone();
    let choices = tokio::task::spawn_blocking(move || requests(&s, inputs, pooling))
        .await
        .map_err(|_| ApiError::internal("internal error (a bug) preparing the request"))??;
    tracing::info!(
        "{} input(s), {} tokens, {} pooling",
        choices.len(),
        choices.iter().map(|c| c.prompt.len()).sum::<usize>(),
        pooling.name()
    );
    // In windows of the sequences the engine runs at once, each after the one before: a
    // batch of thousands neither takes the whole queue (which would refuse every other
    // request meanwhile) nor is refused itself while others wait.
    let window = ready.engine.info().max_running.max(1);
    let mut outs = Vec::with_capacity(choices.len());
    for part in choices.chunks(window) {
        let (mut rx, guard) = submit(&st, ready, rid, part, start)?;
        outs.extend(gather(part.len(), &mut rx, guard).await?);
    }
    let prompt_tokens: usize = choices.iter().map(|c| c.prompt.len()).sum();
    let data: Vec<Value> = outs
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            let mut e = o.embedding;
            normalize(&mut e, norm);
            let embedding = match encoding {
                Encoding::Float => json!(e),
                Encoding::Base64 => json!(base64_f32(&e)),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
}

/// The inputs as checked engine requests: texts tokenized with BOS and EOS as the model
/// asks (embedding models end the text with EOS).
fn requests(
    st: &AppState,
    inputs: Vec<Prompt>,
    pooling: Pooling,
) -> Result<Vec<Request>, ApiError> {
    let ready = st.ready()?;
    let tok = &ready.engine.model().tokenizer;
    inputs
        .into_iter()
        .map(|p| {
            let prompt = match p {
                Prompt::Tokens(t) => t,
                Prompt::Text(s) => tok
                    .encode(&s, true, true)
                    .map_err(|e| ApiError::invalid("input", e.to_string()))?,
            };
            let request = Request {
                prompt,
                params: GenerationParams {
                    max_tokens: 0,
                    embed: Some(pooling),
                    ..GenerationParams::default()
                },
            };
            ready
                .engine
                .validate(&request)
                .map_err(|e| ApiError::from_engine(&e, "input"))?;
            Ok(request)
        })
        .collect()
}

/// Standard base64 (with padding) of the floats' little-endian bytes, as OpenAI sends
/// `encoding_format: base64` (the client decodes it with `np.frombuffer(..., "float32")`).
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            out.push(if i <= c.len() {
                ALPHABET[(n >> shift) as usize & 63] as char
            } else {
                '='
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_encodings() {
        // Python's `base64.b64encode(struct.pack("<2f", 1.0, -2.5))` and the like: one,
        // two and no padding characters.
        assert_eq!(base64_f32(&[]), "");
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.5]), "AACAPwAAIMA=");
        assert_eq!(base64_f32(&[0.0, 0.0, 0.0]), "AAAAAAAAAAAAAAAA");
    }
}
