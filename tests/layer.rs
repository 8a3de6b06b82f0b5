//! `idem::axum::IdempotencyLayer` on plain axum handlers, on every backend of the run: the
//! 400/409/422 contract, replays of the whole response, 5xx releasing the key, the body-size
//! limits, principals, and a client that hangs up. Each handler writes a row to the effects
//! table, so the tests count executions in the database.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Backend, backends, effects, insert_effect, unique};
use idem::axum::IdempotencyLayer;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::store::Concurrency;
use sea_orm::DatabaseConnection;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct App {
    db: DatabaseConnection,
    /// `/slow` signals here when it has started, and waits for a permit of `release`.
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
    /// How often `/flaky` ran.
    flaky_runs: Arc<AtomicUsize>,
}

/// The run id and amount a handler writes, from the JSON body.
fn effect_of(body: &Value) -> (String, i64) {
    (
        body["run"].as_str().unwrap_or("none").to_owned(),
        body["amount"].as_i64().unwrap_or(0),
    )
}

/// Writes one effect and answers 201 with a fresh execution id, a recorded header
/// (`location`) and one that is not recorded (`x-trace`).
async fn create(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> Response {
    let (run, amount) = effect_of(&body);
    insert_effect(&app.db, &run, "create", amount).await;
    let execution = unique("exec");
    (
        StatusCode::CREATED,
        [
            ("location", format!("/effects/{execution}")),
            ("x-trace", "t-1".to_owned()),
        ],
        axum::Json(json!({ "execution": execution, "amount": amount })),
    )
        .into_response()
}

/// Like `create`, after the test lets it go.
async fn slow(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> Response {
    app.entered.add_permits(1);
    app.release.acquire().await.expect("open").forget();
    let (run, amount) = effect_of(&body);
    insert_effect(&app.db, &run, "slow", amount).await;
    (StatusCode::CREATED, unique("exec")).into_response()
}

/// Writes an effect, then fails with 503 on its first run and answers 200 afterwards.
async fn flaky(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> Response {
    let (run, amount) = effect_of(&body);
    insert_effect(&app.db, &run, "flaky", amount).await;
    if app.flaky_runs.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
    }
    (StatusCode::OK, unique("exec")).into_response()
}

/// Answers a 2,000-byte body (over the route's 1,000-byte limit).
async fn big(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> Response {
    let (run, amount) = effect_of(&body);
    insert_effect(&app.db, &run, "big", amount).await;
    (StatusCode::OK, "x".repeat(2000)).into_response()
}

/// A 4xx from the route is a recorded answer like any other.
async fn refuse(State(app): State<App>, axum::Json(body): axum::Json<Value>) -> Response {
    let (run, amount) = effect_of(&body);
    insert_effect(&app.db, &run, "refuse", amount).await;
    (StatusCode::NOT_FOUND, unique("gone")).into_response()
}

fn router(b: &Backend) -> (Router, App) {
    let app = App {
        db: b.db.clone(),
        entered: Arc::new(Semaphore::new(0)),
        release: Arc::new(Semaphore::new(0)),
        flaky_runs: Arc::new(AtomicUsize::new(0)),
    };
    let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "layer.effects");
    let tenants = layer.clone().principal(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let router = Router::new()
        .route("/effects", post(create).route_layer(layer.clone()))
        .route("/slow", post(slow).route_layer(layer.clone()))
        .route("/flaky", post(flaky).route_layer(layer.clone()))
        .route("/refuse", post(refuse).route_layer(layer))
        .route(
            "/big",
            post(big).route_layer(
                IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "layer.big")
                    .max_response_body(1000)
                    .max_request_body(100),
            ),
        )
        .route("/tenant", post(create).route_layer(tenants))
        .with_state(app.clone());
    (router, app)
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

fn request(uri: &str, keys: &[&str], body: &str) -> Request<Body> {
    let mut request = Request::post(uri).header("content-type", "application/json");
    for key in keys {
        request = request.header("idempotency-key", *key);
    }
    request.body(Body::from(body.to_owned())).expect("request")
}

async fn send(router: &Router, request: Request<Body>) -> Answer {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn post_json(router: &Router, uri: &str, key: &str, body: &Value) -> Answer {
    send(router, request(uri, &[key], &body.to_string())).await
}

#[tokio::test]
async fn missing_invalid_or_repeated_keys_are_400_and_nothing_runs() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-400");
        let body = json!({"run": run, "amount": 1}).to_string();
        for (keys, kind) in [
            (&[][..], "missing-key"),
            (&["\"\""][..], "invalid-key"),
            (&["a", "b"][..], "invalid-key"),
        ] {
            let answer = send(&router, request("/effects", keys, &body)).await;
            assert_eq!(answer.status, 400, "{}: {keys:?}", b.name);
            assert_eq!(
                answer.header("content-type"),
                Some("application/problem+json")
            );
            assert_eq!(
                answer.json()["type"],
                format!("urn:idem:problem:{kind}"),
                "{}",
                b.name
            );
        }
        assert_eq!(
            effects(&b.db, &run).await,
            0,
            "{}: the route never ran",
            b.name
        );
    }
}

#[tokio::test]
async fn a_retry_replays_the_recorded_status_headers_and_body_and_the_route_runs_once() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-replay");
        let key = unique("k");
        let body = json!({"run": run, "amount": 7});
        let first = post_json(&router, "/effects", &key, &body).await;
        assert_eq!(first.status, 201, "{}: {}", b.name, first.body);
        assert!(!first.replayed(), "{}", b.name);
        assert_eq!(
            first.header("x-trace"),
            Some("t-1"),
            "the first client gets every header"
        );
        for _ in 0..3 {
            let again = post_json(&router, "/effects", &key, &body).await;
            assert_eq!(again.status, 201, "{}", b.name);
            assert!(again.replayed(), "{}", b.name);
            assert_eq!(again.body, first.body, "{}: the recorded body", b.name);
            assert_eq!(
                again.header("location"),
                first.header("location"),
                "{}",
                b.name
            );
            assert_eq!(again.header("content-type"), Some("application/json"));
            assert_eq!(
                again.header("x-trace"),
                None,
                "{}: not a recorded header",
                b.name
            );
        }
        assert_eq!(
            effects(&b.db, &run).await,
            1,
            "{}: the route ran once",
            b.name
        );

        // A recorded 4xx replays too.
        let refused_key = unique("k");
        let refused = post_json(&router, "/refuse", &refused_key, &body).await;
        let again = post_json(&router, "/refuse", &refused_key, &body).await;
        assert_eq!(
            (refused.status, again.status),
            (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND)
        );
        assert!(again.replayed() && again.body == refused.body, "{}", b.name);
        assert_eq!(
            effects(&b.db, &run).await,
            2,
            "{}: /refuse ran once",
            b.name
        );
    }
}

#[tokio::test]
async fn the_same_key_with_another_body_path_or_query_is_422() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-422");
        let key = unique("k");
        let body = json!({"run": run, "amount": 7});
        assert_eq!(
            post_json(&router, "/effects", &key, &body).await.status,
            201
        );
        let other_body = json!({"run": run, "amount": 8});
        for (uri, body) in [
            ("/effects", &other_body),
            ("/effects?dry=1", &body),
            ("/refuse", &body),
        ] {
            let answer = post_json(&router, uri, &key, body).await;
            assert_eq!(answer.status, 422, "{}: {uri}", b.name);
            assert_eq!(answer.json()["type"], "urn:idem:problem:key-reused");
        }
        assert_eq!(effects(&b.db, &run).await, 1, "{}", b.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_409_with_retry_after_then_replays() {
    for b in backends().await {
        let (router, app) = router(&b);
        let run = unique("layer-409");
        let key = unique("k");
        let body = json!({"run": run, "amount": 3});
        let first = {
            let (router, key, body) = (router.clone(), key.clone(), body.clone());
            tokio::spawn(async move { post_json(&router, "/slow", &key, &body).await })
        };
        app.entered.acquire().await.expect("entered").forget();
        let duplicate = post_json(&router, "/slow", &key, &body).await;
        assert_eq!(duplicate.status, 409, "{}: {}", b.name, duplicate.body);
        assert_eq!(duplicate.json()["type"], "urn:idem:problem:in-flight");
        let retry_after: u64 = duplicate
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After in seconds");
        assert!((1..=30).contains(&retry_after), "{}: {retry_after}", b.name);
        app.release.add_permits(1);
        let first = first.await.expect("join");
        assert_eq!(first.status, 201, "{}", b.name);
        let again = post_json(&router, "/slow", &key, &body).await;
        assert!(again.replayed() && again.body == first.body, "{}", b.name);
        assert_eq!(
            effects(&b.db, &run).await,
            1,
            "{}: the route ran once",
            b.name
        );
    }
}

#[tokio::test]
async fn a_5xx_is_not_recorded_and_the_retry_runs_the_route_again() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-5xx");
        let key = unique("k");
        let body = json!({"run": run, "amount": 3});
        let failed = post_json(&router, "/flaky", &key, &body).await;
        assert_eq!(failed.status, 503, "{}", b.name);
        assert!(!failed.replayed());
        assert_eq!(
            failed.body, "try again",
            "{}: the route's own answer",
            b.name
        );
        let retried = post_json(&router, "/flaky", &key, &body).await;
        assert_eq!(retried.status, 200, "{}: {}", b.name, retried.body);
        assert!(!retried.replayed(), "{}: executed again", b.name);
        let replayed = post_json(&router, "/flaky", &key, &body).await;
        assert!(
            replayed.replayed() && replayed.body == retried.body,
            "{}",
            b.name
        );
        assert_eq!(
            effects(&b.db, &run).await,
            2,
            "{}: ran twice, then replayed",
            b.name
        );
    }
}

#[tokio::test]
async fn a_response_over_the_limit_reaches_its_client_and_its_retry_gets_500_not_a_second_run() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-big");
        let key = unique("k");
        let body = json!({"run": run, "amount": 3});
        let first = post_json(&router, "/big", &key, &body).await;
        assert_eq!(first.status, 200, "{}", b.name);
        assert_eq!(first.body.len(), 2000, "{}: the whole body", b.name);
        let again = post_json(&router, "/big", &key, &body).await;
        assert_eq!(again.status, 500, "{}: {}", b.name, again.body);
        assert!(again.replayed(), "{}", b.name);
        assert_eq!(
            again.json()["type"],
            "urn:idem:problem:response-not-recorded"
        );
        assert!(
            again.json()["detail"]
                .as_str()
                .is_some_and(|d| d.contains("1000 bytes")),
            "{}: {}",
            b.name,
            again.body
        );
        assert_eq!(
            effects(&b.db, &run).await,
            1,
            "{}: the route ran once",
            b.name
        );

        // A request body over the layer's 100 bytes: 413 before anything is claimed.
        let padded = json!({"run": run, "amount": 3, "pad": "p".repeat(200)});
        let key = unique("k");
        let refused = post_json(&router, "/big", &key, &padded).await;
        assert_eq!(refused.status, 413, "{}", b.name);
        assert_eq!(refused.json()["type"], "urn:idem:problem:request-too-large");
        assert_eq!(effects(&b.db, &run).await, 1, "{}: not run", b.name);
        // Nothing was claimed: the key is still free for a request that fits.
        let fits = post_json(&router, "/big", &key, &body).await;
        assert_eq!((fits.status, fits.replayed()), (StatusCode::OK, false));
    }
}

#[tokio::test]
async fn principals_never_share_keys() {
    for b in backends().await {
        let (router, _) = router(&b);
        let run = unique("layer-tenant");
        let key = unique("k");
        let body = json!({"run": run, "amount": 1}).to_string();
        let as_tenant = |tenant: &str| {
            let mut r = request("/tenant", &[&key], &body);
            r.headers_mut()
                .insert("x-tenant", tenant.parse().expect("header"));
            r
        };
        let a = send(&router, as_tenant("a")).await;
        let b_answer = send(&router, as_tenant("b")).await;
        let a_again = send(&router, as_tenant("a")).await;
        assert_eq!(
            (a.status, b_answer.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert!(!b_answer.replayed(), "{}: tenant b's own execution", b.name);
        assert!(a_again.replayed() && a_again.body == a.body, "{}", b.name);
        assert_eq!(effects(&b.db, &run).await, 2, "{}", b.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_stop_the_route_and_its_retry_replays() {
    for b in backends().await {
        let (router, app) = router(&b);
        let run = unique("layer-gone");
        let key = unique("k");
        let body = json!({"run": run, "amount": 3});
        let client = {
            let (router, key, body) = (router.clone(), key.clone(), body.clone());
            tokio::spawn(async move { post_json(&router, "/slow", &key, &body).await })
        };
        app.entered.acquire().await.expect("entered").forget();
        client.abort();
        assert!(client.await.is_err_and(|e| e.is_cancelled()));
        app.release.add_permits(1);
        // The route finishes on its own task and records; the retry replays it.
        let mut answer = post_json(&router, "/slow", &key, &body).await;
        for _ in 0..100 {
            if answer.status != StatusCode::CONFLICT {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            answer = post_json(&router, "/slow", &key, &body).await;
        }
        assert_eq!(answer.status, 201, "{}: {}", b.name, answer.body);
        assert!(answer.replayed(), "{}", b.name);
        assert_eq!(effects(&b.db, &run).await, 1, "{}: ran once", b.name);
    }
}

#[tokio::test]
async fn a_waiting_duplicate_replays_the_first_response() {
    for b in backends().await {
        let app = App {
            db: b.db.clone(),
            entered: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
            flaky_runs: Arc::new(AtomicUsize::new(0)),
        };
        let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "layer.wait")
            .on_concurrent(Concurrency::Wait {
                bound: Duration::from_secs(10),
            });
        let router = Router::new()
            .route("/slow", post(slow).route_layer(layer))
            .with_state(app.clone());
        let run = unique("layer-wait");
        let key = unique("k");
        let body = json!({"run": run, "amount": 3});
        let first = {
            let (router, key, body) = (router.clone(), key.clone(), body.clone());
            tokio::spawn(async move { post_json(&router, "/slow", &key, &body).await })
        };
        app.entered.acquire().await.expect("entered").forget();
        let waiting = {
            let (router, key, body) = (router.clone(), key.clone(), body.clone());
            tokio::spawn(async move { post_json(&router, "/slow", &key, &body).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        app.release.add_permits(1);
        let (first, waiting) = (first.await.expect("join"), waiting.await.expect("join"));
        assert_eq!(first.status, 201, "{}", b.name);
        assert!(
            waiting.replayed() && waiting.body == first.body,
            "{}",
            b.name
        );
        assert_eq!(effects(&b.db, &run).await, 1, "{}", b.name);
    }
}
