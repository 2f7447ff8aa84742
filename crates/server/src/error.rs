//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    /// A 400 about one request field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
            retry_after_secs: None,
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_secs: None,
        }
    }

    /// A model other than the served one was asked for.
    pub fn unknown_model(id: &str, served: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model {id:?} does not exist; this server serves {served:?}"),
        )
        .code("model_not_found");
        e.param = Some("model".into());
        e
    }

    /// A generation that failed (or ended without a result) on the worker.
    pub fn generation(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

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
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}
