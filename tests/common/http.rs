//! Requests to a front door and the answers they get: an axum router, through `oneshot` (no
//! socket), or a real server over HTTP ([`Served`], e.g. actix-web's); [`post_json`] and
//! [`get`] for the common shapes, [`Call`] to build any other. A suite that runs its cases
//! through both front doors loops over [`FRONTS`] and sends to a [`FrontDoor`].

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

    pub async fn send<D: Door>(self, door: &D) -> Answer {
        door.answer(self).await
    }

    async fn through_router(self, router: &Router) -> Answer {
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

    /// Sends it over HTTP to the server at `base` (`http://127.0.0.1:port`).
    async fn over_http(self, base: &str) -> Answer {
        let method = reqwest::Method::from_bytes(self.method.as_bytes()).expect("a method");
        let mut request = reqwest::Client::new().request(method, format!("{base}{}", self.uri));
        for (name, value) in &self.headers {
            request = request.header(name.as_str(), value.as_str());
        }
        if let Some(body) = self.body {
            request = request.body(body);
        }
        let response = request.send().await.expect("send");
        let (status, headers) = (response.status(), response.headers().clone());
        let text = response.text().await.expect("a UTF-8 body");
        Answer {
            status,
            replayed: headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            json: serde_json::from_str(&text).unwrap_or(Value::Null),
            headers,
            text,
        }
    }

    /// Sends it on a task of its own (a client the test can wait for, or hang up).
    pub fn spawn<D: Door>(self, door: &D) -> tokio::task::JoinHandle<Answer> {
        let door = door.clone();
        tokio::spawn(async move { self.send(&door).await })
    }
}

/// Where a test's requests go: an axum [`Router`] (called in process) or a [`Served`] server.
pub trait Door: Clone + Send + Sync + 'static {
    /// Sends `call` and reads the whole answer.
    fn answer(&self, call: Call) -> impl Future<Output = Answer> + Send;
}

impl Door for Router {
    async fn answer(&self, call: Call) -> Answer {
        call.through_router(self).await
    }
}

/// A real server listening at a base URL (`http://127.0.0.1:port`), reached over HTTP.
#[derive(Debug, Clone)]
pub struct Served(pub String);

impl Door for Served {
    async fn answer(&self, call: Call) -> Answer {
        call.over_http(&self.0).await
    }
}

/// The front doors a suite runs its cases through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Front {
    Axum,
    Actix,
}

pub const FRONTS: [Front; 2] = [Front::Axum, Front::Actix];

/// A test's routes behind one front door.
#[derive(Clone)]
pub enum FrontDoor {
    /// An axum router, called in process.
    Axum(Router),
    /// A real actix-web server.
    Actix(Served),
}

impl Door for FrontDoor {
    async fn answer(&self, call: Call) -> Answer {
        match self {
            Self::Axum(router) => call.send(router).await,
            Self::Actix(server) => call.send(server).await,
        }
    }
}

/// A POST of `body` as JSON under `key`.
pub async fn post_json<D: Door>(door: &D, uri: &str, key: &str, body: &Value) -> Answer {
    Call::post(uri).key(key).json(body).send(door).await
}

/// A GET without a key.
pub async fn get<D: Door>(door: &D, uri: &str) -> Answer {
    Call::new("GET", uri).send(door).await
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
