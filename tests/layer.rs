//! `idem::axum::IdempotencyLayer` on plain axum handlers, on every backend of the run: the
//! 400/409/422 contract, replays of the whole response, 5xx releasing the key, the body-size
//! limits, principals, and a client that hangs up. Each handler writes a row to the effects
//! table, so the tests count executions in the database.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::http::{Answer, Call, post_json};
use common::{Backend, Gate, backends, insert_effect, unique};
use idem::axum::IdempotencyLayer;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::store::Concurrency;
use sea_orm::DatabaseConnection;
use serde_json::{Value, json};

#[derive(Clone)]
struct App {
    db: DatabaseConnection,
    /// `/slow` passes it once it has started.
    gate: Gate,
    /// How often `/flaky` ran.
    flaky_runs: Arc<AtomicUsize>,
}

impl App {
    fn new(db: &DatabaseConnection) -> Self {
        Self {
            db: db.clone(),
            gate: Gate::default(),
            flaky_runs: Arc::new(AtomicUsize::new(0)),
        }
    }
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
    app.gate.pass().await;
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
    let app = App::new(&b.db);
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

/// One test on one backend: the routes, and a key and a JSON body that name the test's run.
struct Case {
    b: Backend,
    router: Router,
    app: App,
    run: String,
    key: String,
    body: Value,
}

impl Case {
    fn new(b: Backend, run: &str, amount: i64) -> Self {
        let (router, app) = router(&b);
        let run = unique(run);
        Self {
            body: json!({"run": run, "amount": amount}),
            key: unique("k"),
            run,
            router,
            app,
            b,
        }
    }

    /// POSTs the body under the key.
    async fn post(&self, uri: &str) -> Answer {
        post_json(&self.router, uri, &self.key, &self.body).await
    }

    /// POSTs the body under the key, from a client task of its own.
    fn spawn(&self, uri: &str) -> tokio::task::JoinHandle<Answer> {
        Call::post(uri)
            .key(&self.key)
            .json(&self.body)
            .spawn(&self.router)
    }

    /// Asserts the routes ran `times` times for the run (its effect rows).
    async fn assert_ran(&self, times: i64, what: &str) {
        self.b.assert_effects(&self.run, times, what).await;
    }
}

#[tokio::test]
async fn missing_invalid_or_repeated_keys_are_400_and_nothing_runs() {
    for b in backends().await {
        let t = Case::new(b, "layer-400", 1);
        let name = t.b.name;
        for (keys, kind) in [
            (&[][..], "missing-key"),
            (&["\"\""][..], "invalid-key"),
            (&["a", "b"][..], "invalid-key"),
        ] {
            let call = keys.iter().fold(Call::post("/effects"), |c, k| c.key(k));
            let answer = call.json(&t.body).send(&t.router).await;
            assert_eq!(answer.status, 400, "{name}: {keys:?}");
            assert_eq!(
                answer.header("content-type"),
                Some("application/problem+json")
            );
            let kind = format!("urn:idem:problem:{kind}");
            assert_eq!(answer.json["type"], kind, "{name}");
        }
        t.assert_ran(0, "the route never ran").await;
    }
}

#[tokio::test]
async fn a_retry_replays_the_recorded_status_headers_and_body_and_the_route_runs_once() {
    for b in backends().await {
        let t = Case::new(b, "layer-replay", 7);
        let name = t.b.name;
        let first = t.post("/effects").await;
        assert_eq!(first.status, 201, "{name}: {}", first.text);
        assert!(!first.replayed, "{name}");
        let trace = first.header("x-trace");
        assert_eq!(trace, Some("t-1"), "the first client gets every header");
        for _ in 0..3 {
            let again = t.post("/effects").await;
            assert_eq!(again.status, 201, "{name}");
            assert!(again.replayed, "{name}");
            assert_eq!(again.text, first.text, "{name}: the recorded body");
            let location = again.header("location");
            assert_eq!(location, first.header("location"), "{name}");
            assert_eq!(again.header("content-type"), Some("application/json"));
            let trace = again.header("x-trace");
            assert_eq!(trace, None, "{name}: not a recorded header");
        }
        t.assert_ran(1, "the route ran once").await;

        // A recorded 4xx replays too.
        let refused_key = unique("k");
        let refused = post_json(&t.router, "/refuse", &refused_key, &t.body).await;
        let again = post_json(&t.router, "/refuse", &refused_key, &t.body).await;
        assert_eq!(
            (refused.status, again.status),
            (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND)
        );
        assert!(again.replayed && again.text == refused.text, "{name}");
        t.assert_ran(2, "/refuse ran once").await;
    }
}

#[tokio::test]
async fn the_same_key_with_another_body_path_or_query_is_422() {
    for b in backends().await {
        let t = Case::new(b, "layer-422", 7);
        let name = t.b.name;
        assert_eq!(t.post("/effects").await.status, 201);
        let other_body = json!({"run": t.run, "amount": 8});
        for (uri, body) in [
            ("/effects", &other_body),
            ("/effects?dry=1", &t.body),
            ("/refuse", &t.body),
        ] {
            let answer = post_json(&t.router, uri, &t.key, body).await;
            assert_eq!(answer.status, 422, "{name}: {uri}");
            assert_eq!(answer.json["type"], "urn:idem:problem:key-reused");
        }
        t.assert_ran(1, "the route ran once").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_409_with_retry_after_then_replays() {
    for b in backends().await {
        let t = Case::new(b, "layer-409", 3);
        let name = t.b.name;
        let first = t.spawn("/slow");
        t.app.gate.entered().await;
        let duplicate = t.post("/slow").await;
        assert_eq!(duplicate.status, 409, "{name}: {}", duplicate.text);
        assert_eq!(duplicate.json["type"], "urn:idem:problem:in-flight");
        let retry_after: u64 = duplicate
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After in seconds");
        assert!((1..=30).contains(&retry_after), "{name}: {retry_after}");
        t.app.gate.release();
        let first = first.await.expect("join");
        assert_eq!(first.status, 201, "{name}");
        let again = t.post("/slow").await;
        assert!(again.replayed && again.text == first.text, "{name}");
        t.assert_ran(1, "the route ran once").await;
    }
}

#[tokio::test]
async fn a_5xx_is_not_recorded_and_the_retry_runs_the_route_again() {
    for b in backends().await {
        let t = Case::new(b, "layer-5xx", 3);
        let name = t.b.name;
        let failed = t.post("/flaky").await;
        assert_eq!(failed.status, 503, "{name}");
        assert!(!failed.replayed);
        assert_eq!(failed.text, "try again", "{name}: the route's own answer");
        let retried = t.post("/flaky").await;
        assert_eq!(retried.status, 200, "{name}: {}", retried.text);
        assert!(!retried.replayed, "{name}: executed again");
        let replayed = t.post("/flaky").await;
        assert!(replayed.replayed && replayed.text == retried.text, "{name}");
        t.assert_ran(2, "ran twice, then replayed").await;
    }
}

#[tokio::test]
async fn a_response_over_the_limit_reaches_its_client_and_its_retry_gets_500_not_a_second_run() {
    for b in backends().await {
        let t = Case::new(b, "layer-big", 3);
        let name = t.b.name;
        let first = t.post("/big").await;
        assert_eq!(first.status, 200, "{name}");
        assert_eq!(first.text.len(), 2000, "{name}: the whole body");
        let again = t.post("/big").await;
        assert_eq!(again.status, 500, "{name}: {}", again.text);
        assert!(again.replayed, "{name}");
        let kind = &again.json["type"];
        assert_eq!(kind, "urn:idem:problem:response-not-recorded");
        let detail = again.json["detail"].as_str();
        let says_why = detail.is_some_and(|d| d.contains("1000 bytes"));
        assert!(says_why, "{name}: {}", again.text);
        t.assert_ran(1, "the route ran once").await;

        // A request body over the layer's 100 bytes: 413 before anything is claimed.
        let padded = json!({"run": t.run, "amount": 3, "pad": "p".repeat(200)});
        let key = unique("k");
        let refused = post_json(&t.router, "/big", &key, &padded).await;
        assert_eq!(refused.status, 413, "{name}");
        assert_eq!(refused.json["type"], "urn:idem:problem:request-too-large");
        t.assert_ran(1, "not run").await;
        // Nothing was claimed: the key is still free for a request that fits.
        let fits = post_json(&t.router, "/big", &key, &t.body).await;
        assert_eq!((fits.status, fits.replayed), (StatusCode::OK, false));
    }
}

#[tokio::test]
async fn principals_never_share_keys() {
    for b in backends().await {
        let t = Case::new(b, "layer-tenant", 1);
        let name = t.b.name;
        let as_tenant = |tenant: &str| {
            let call = Call::post("/tenant").key(&t.key).header("x-tenant", tenant);
            call.json(&t.body).send(&t.router)
        };
        let a = as_tenant("a").await;
        let b_answer = as_tenant("b").await;
        let a_again = as_tenant("a").await;
        assert_eq!(
            (a.status, b_answer.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert!(!b_answer.replayed, "{name}: tenant b's own execution");
        assert!(a_again.replayed && a_again.text == a.text, "{name}");
        t.assert_ran(2, "one execution per tenant").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_stop_the_route_and_its_retry_replays() {
    for b in backends().await {
        let t = Case::new(b, "layer-gone", 3);
        let name = t.b.name;
        let client = t.spawn("/slow");
        t.app.gate.entered().await;
        client.abort();
        assert!(client.await.is_err_and(|e| e.is_cancelled()));
        t.app.gate.release();
        // The route finishes on its own task and records; the retry replays it.
        let mut answer = t.post("/slow").await;
        for _ in 0..100 {
            if answer.status != StatusCode::CONFLICT {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            answer = t.post("/slow").await;
        }
        assert_eq!(answer.status, 201, "{name}: {}", answer.text);
        assert!(answer.replayed, "{name}");
        t.assert_ran(1, "ran once").await;
    }
}

#[tokio::test]
async fn a_waiting_duplicate_replays_the_first_response() {
    for b in backends().await {
        let app = App::new(&b.db);
        let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "layer.wait")
            .on_concurrent(Concurrency::Wait {
                bound: Duration::from_secs(10),
            });
        let router = Router::new()
            .route("/slow", post(slow).route_layer(layer))
            .with_state(app.clone());
        let t = Case {
            router,
            app,
            ..Case::new(b, "layer-wait", 3)
        };
        let name = t.b.name;
        let first = t.spawn("/slow");
        t.app.gate.entered().await;
        let waiting = t.spawn("/slow");
        tokio::time::sleep(Duration::from_millis(100)).await;
        t.app.gate.release();
        let (first, waiting) = (first.await.expect("join"), waiting.await.expect("join"));
        assert_eq!(first.status, 201, "{name}");
        assert!(waiting.replayed && waiting.text == first.text, "{name}");
        t.assert_ran(1, "ran once").await;
    }
}

/// A response this layer recorded is replayed from memory: with the ledger's pool closed, a
/// retry still gets it (a layer that remembers nothing answers 503), and a retry with another
/// body is still 422. The route ran once.
#[tokio::test]
async fn a_retry_this_process_recorded_is_replayed_from_memory() {
    for b in backends().await {
        let name = b.name;
        for remembered in [IdempotencyLayer::DEFAULT_REMEMBERED, 0] {
            // A pool of its own, closed once the first response is recorded.
            let ledger = common::connect(&b.url, 2).await;
            let layer =
                IdempotencyLayer::new(SeaOrmLeaseStore::new(ledger.clone()), "layer.memory")
                    .remember_answers(remembered);
            let app = App::new(&b.db);
            let router = Router::new()
                .route("/effects", post(create).route_layer(layer))
                .with_state(app);
            let (run, key) = (unique("layer-memory"), unique("k"));
            let body = json!({"run": run, "amount": 3});
            let first = post_json(&router, "/effects", &key, &body).await;
            assert_eq!(first.status, 201, "{name}");
            ledger.close().await.expect("close the ledger's pool");
            let retry = post_json(&router, "/effects", &key, &body).await;
            let reused =
                post_json(&router, "/effects", &key, &json!({"run": run, "amount": 4})).await;
            if remembered > 0 {
                assert_eq!(retry.status, 201, "{name}: replayed from memory");
                assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{name}");
                assert_eq!(retry.json, first.json, "{name}: the recorded body");
                assert_eq!(reused.status, 422, "{name}: another body is still a reuse");
            } else {
                assert_eq!(
                    retry.status, 503,
                    "{name}: without memory the ledger is asked"
                );
            }
            b.assert_effects(&run, 1, "the route ran once").await;
        }
    }
}

/// Many keys at once, each sent four times, through a layer that remembers nothing (so the
/// claims, completions and replays all reach the ledger; on SQLite concurrent writes commit
/// in groups): every key runs its route once, every duplicate gets 409 or the first
/// response, and a later retry of each key replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_keys_and_duplicates_runs_each_key_once() {
    const KEYS: usize = 24;
    const COPIES: usize = 4;
    for b in backends().await {
        let name = b.name;
        let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "layer.storm")
            .remember_answers(0);
        let router = Router::new()
            .route("/effects", post(create).route_layer(layer))
            .with_state(App::new(&b.db));
        let keys: Vec<(String, Value, String)> = (0..KEYS)
            .map(|_| {
                let run = unique("layer-storm");
                (unique("k"), json!({"run": run, "amount": 1}), run)
            })
            .collect();
        let mut calls = Vec::new();
        for _ in 0..COPIES {
            for (key, body, _) in &keys {
                calls.push(Call::post("/effects").key(key).json(body).spawn(&router));
            }
        }
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.expect("client task"));
        }
        for (i, (key, body, run)) in keys.iter().enumerate() {
            b.assert_effects(run, 1, "each key ran once").await;
            let copies: Vec<&Answer> = answers.iter().skip(i).step_by(KEYS).collect();
            let first = copies
                .iter()
                .find(|a| a.status == 201)
                .unwrap_or_else(|| panic!("{name}: no copy of key {i} got 201"));
            for copy in &copies {
                assert!(
                    copy.status == 409 || (copy.status == 201 && copy.json == first.json),
                    "{name}: key {i}: {} {}",
                    copy.status,
                    copy.text
                );
            }
            let retry = post_json(&router, "/effects", key, body).await;
            assert_eq!(retry.status, 201, "{name}: key {i} replayed");
            assert!(retry.replayed, "{name}: key {i} marked replayed");
            assert_eq!(retry.json, first.json, "{name}: key {i}: the recorded body");
        }
    }
}
