//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the
//! HTTP status OpenAI (and vLLM, llama-server) give the same case.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use memra_engine::engine::EngineError;
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`...
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (queue full, still loading).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A bad request (400) naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A bad request with no one field at fault (malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "Invalid API key: give the server's key as `Authorization: Bearer KEY`",
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("not_found"),
            ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    pub fn loading() -> ApiError {
        ApiError {
            code: Some("loading"),
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "Loading model",
            )
        }
    }

    pub fn busy(limit: usize) -> ApiError {
        ApiError {
            code: Some("queue_full"),
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                format!("The server is busy: {limit} sequences are running or queued; retry later"),
            )
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// A request the engine refused; `prompt_field` names where the prompt came from
    /// (`messages` or `prompt`).
    pub fn from_engine(e: &EngineError, prompt_field: &str) -> ApiError {
        match e {
            EngineError::TooLong { .. } | EngineError::PoolTooSmall { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(prompt_field, e.to_string())
            },
            EngineError::EmptyPrompt | EngineError::BadToken(_) => {
                ApiError::invalid(prompt_field, e.to_string())
            }
            EngineError::NoTokens => ApiError::invalid("max_tokens", e.to_string()),
            EngineError::Sampler(_)
            | EngineError::BadScoring { .. }
            | EngineError::BadEmbedding => ApiError::bad_request(e.to_string()),
            EngineError::NoEmbeddings => ApiError {
                status: StatusCode::NOT_IMPLEMENTED,
                kind: "not_supported_error",
                ..ApiError::internal(e.to_string())
            },
            EngineError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "unavailable_error",
                ..ApiError::internal(e.to_string())
            },
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_has_openai_s_four_fields() {
        let e = ApiError::invalid("temperature", "temperature must be a number");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body(),
            json!({"error": {"message": "temperature must be a number",
                "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
    }

    #[test]
    fn a_prompt_over_the_context_is_a_400_with_the_counts() {
        let e = ApiError::from_engine(
            &EngineError::TooLong {
                prompt: 5000,
                max_tokens: 16,
                n_ctx: 4096,
            },
            "messages",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("5000") && e.message.contains("4096"));
    }

    #[test]
    fn busy_and_loading_say_when_to_retry() {
        let r = ApiError::busy(8).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(ApiError::loading().retry_after, Some(1));
    }
}
