//! Requests to an axum router, through `oneshot` (no socket), and the answers they get:
//! [`post_json`] and [`get`] for the common shapes, [`Call`] to build any other.

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt;

/// A request, built step by step: `Call::post("/orders").key("k-1").json(&body)`.
#[derive(Debug, Clone)]
pub struct Call {
    method: &'static str,
    uri: String,
    headers: Vec<(String, String)>,
    body: Option<String>,
}

impl Call {
    pub fn new(method: &'static str, uri: &str) -> Self {
        Self {
            method,
            uri: uri.to_owned(),
            headers: Vec::new(),
            body: None,
        }
    }

    pub fn post(uri: &str) -> Self {
        Self::new("POST", uri)
    }

    /// An `Idempotency-Key` field; each call adds one more.
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// `body` as JSON, with `content-type: application/json`.
    pub fn json(self, body: &Value) -> Self {
        self.raw_json(body.to_string())
    }

    /// `body` as it is (malformed JSON, say), with `content-type: application/json`.
    pub fn raw_json(mut self, body: impl Into<String>) -> Self {
        self.body = Some(body.into());
        self.header("content-type", "application/json")
    }

    pub async fn send(self, router: &Router) -> Answer {
        let mut request = Request::builder().method(self.method).uri(self.uri);
        for (name, value) in &self.headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let body = self.body.map_or_else(Body::empty, Body::from);
        let request = request.body(body).expect("request");
        let response = router.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
        let text = String::from_utf8(bytes.to_vec()).expect("a UTF-8 body");
        Answer {
            status: parts.status,
            replayed: parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            json: serde_json::from_str(&text).unwrap_or(Value::Null),
            headers: parts.headers,
            text,
        }
    }

    /// Sends it on a task of its own (a client the test can wait for, or hang up).
    pub fn spawn(self, router: &Router) -> tokio::task::JoinHandle<Answer> {
        let router = router.clone();
        tokio::spawn(async move { self.send(&router).await })
    }
}

/// A POST of `body` as JSON under `key`.
pub async fn post_json(router: &Router, uri: &str, key: &str, body: &Value) -> Answer {
    Call::post(uri).key(key).json(body).send(router).await
}

/// A GET without a key.
pub async fn get(router: &Router, uri: &str) -> Answer {
    Call::new("GET", uri).send(router).await
}

/// What a call got back.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    /// `Idempotent-Replayed: true` came with it.
    pub replayed: bool,
    pub headers: HeaderMap,
    pub text: String,
    /// The body as JSON (`Null` when it is not JSON).
    pub json: Value,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}
