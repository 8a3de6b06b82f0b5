//! Whole-response idempotency for plain handlers, through both front doors on every backend
//! of the run: `idem::axum::IdempotencyLayer` on an axum router and
//! `idem::actix::IdempotencyMiddleware` on a real actix-web server (the same cases, the same
//! handlers' logic): the 400/409/422 contract, replays of the whole response, 5xx releasing
//! the key, the body-size limits, principals, and a client that hangs up. Each handler writes
//! a row to the effects table, so the tests count executions in the database.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use common::http::{Answer, Call, FRONTS, Front, FrontDoor, Served, post_json};
use common::{Backend, Gate, backends, insert_effect, unique};
use idem::actix::IdempotencyMiddleware;
use idem::axum::IdempotencyLayer;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::sqlx::SqlxLeaseStore;
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

/// What a handler answers, whatever the framework.
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
}

/// The suite's handlers, written once; each front door adapts them.
#[derive(Clone, Copy, Debug)]
enum Handler {
    /// Writes one effect and answers 201 with a fresh execution id as JSON, a recorded header
    /// (`location`) and one that is not recorded (`x-trace`).
    Create,
    /// Like `Create` (a plain-text body), after the test lets it go.
    Slow,
    /// Writes an effect, then fails with 503 on its first run and answers 200 afterwards.
    Flaky,
    /// Answers a 2,000-byte body (over the route's 1,000-byte limit).
    Big,
    /// A 4xx from the route is a recorded answer like any other.
    Refuse,
}

impl Handler {
    async fn run(self, app: &App, body: &Value) -> Reply {
        let (run, amount) = effect_of(body);
        let plain = |status, body| Reply {
            status,
            headers: vec![("content-type", "text/plain; charset=utf-8".to_owned())],
            body,
        };
        match self {
            Self::Create => {
                insert_effect(&app.db, &run, "create", amount).await;
                let execution = unique("exec");
                Reply {
                    status: 201,
                    headers: vec![
                        ("content-type", "application/json".to_owned()),
                        ("location", format!("/effects/{execution}")),
                        ("x-trace", "t-1".to_owned()),
                    ],
                    body: json!({ "execution": execution, "amount": amount }).to_string(),
                }
            }
            Self::Slow => {
                app.gate.pass().await;
                insert_effect(&app.db, &run, "slow", amount).await;
                plain(201, unique("exec"))
            }
            Self::Flaky => {
                insert_effect(&app.db, &run, "flaky", amount).await;
                if app.flaky_runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    return plain(503, "try again".to_owned());
                }
                plain(200, unique("exec"))
            }
            Self::Big => {
                insert_effect(&app.db, &run, "big", amount).await;
                plain(200, "x".repeat(2000))
            }
            Self::Refuse => {
                insert_effect(&app.db, &run, "refuse", amount).await;
                plain(404, unique("gone"))
            }
        }
    }
}

/// A route's recording settings, built as either front door's layer.
#[derive(Clone)]
struct Layer {
    ledger: DatabaseConnection,
    scope: &'static str,
    max_response_body: Option<usize>,
    max_request_body: Option<usize>,
    concurrency: Option<Concurrency>,
    remember_answers: Option<usize>,
    /// The key belongs to the `x-tenant` header's tenant.
    tenants: bool,
    /// The ledger through idem's sqlx store on the same pool (SeaORM's pool is a sqlx pool),
    /// not through the SeaORM store.
    sqlx: bool,
    /// Enforcing (the default) or observe mode.
    mode: idem::Mode,
}

/// `$make` with `$store` bound to `$layer`'s lease store: SeaORM's on its ledger connection,
/// or sqlx's on the same pool.
macro_rules! with_store {
    ($layer:expr, |$store:ident| $make:expr) => {{
        use sea_orm::DatabaseConnectionType as Kind;
        let ledger = &$layer.ledger;
        match (&$layer.sqlx, &ledger.inner) {
            (false, _) => {
                let $store = SeaOrmLeaseStore::new(ledger.clone());
                $make
            }
            (true, Kind::SqlxSqlitePoolConnection(_)) => {
                let $store = SqlxLeaseStore::new(ledger.get_sqlite_connection_pool().clone());
                $make
            }
            (true, Kind::SqlxPostgresPoolConnection(_)) => {
                let $store = SqlxLeaseStore::new(ledger.get_postgres_connection_pool().clone());
                $make
            }
            (true, _) => {
                let $store = SqlxLeaseStore::new(ledger.get_mysql_connection_pool().clone());
                $make
            }
        }
    }};
}

impl Layer {
    fn new(ledger: &DatabaseConnection, scope: &'static str) -> Self {
        Self {
            ledger: ledger.clone(),
            scope,
            max_response_body: None,
            max_request_body: None,
            concurrency: None,
            remember_answers: None,
            tenants: false,
            sqlx: false,
            mode: idem::Mode::Enforce,
        }
    }

    fn axum(&self) -> IdempotencyLayer {
        let mut layer = with_store!(self, |store| IdempotencyLayer::new(store, self.scope));
        layer = layer.mode(self.mode);
        if let Some(bytes) = self.max_response_body {
            layer = layer.max_response_body(bytes);
        }
        if let Some(bytes) = self.max_request_body {
            layer = layer.max_request_body(bytes);
        }
        if let Some(concurrency) = self.concurrency {
            layer = layer.on_concurrent(concurrency);
        }
        if let Some(bytes) = self.remember_answers {
            layer = layer.remember_answers(bytes);
        }
        if self.tenants {
            layer = layer
                .principal(|parts| tenant(parts.headers.get("x-tenant").map(|v| v.as_bytes())));
        }
        layer
    }

    fn actix(&self) -> IdempotencyMiddleware {
        let mut layer = with_store!(self, |store| IdempotencyMiddleware::new(store, self.scope));
        layer = layer.mode(self.mode);
        if let Some(bytes) = self.max_response_body {
            layer = layer.max_response_body(bytes);
        }
        if let Some(bytes) = self.max_request_body {
            layer = layer.max_request_body(bytes);
        }
        if let Some(concurrency) = self.concurrency {
            layer = layer.on_concurrent(concurrency);
        }
        if let Some(bytes) = self.remember_answers {
            layer = layer.remember_answers(bytes);
        }
        if self.tenants {
            layer = layer.principal(|request| {
                tenant(request.headers().get("x-tenant").map(|v| v.as_bytes()))
            });
        }
        layer
    }
}

fn tenant(header: Option<&[u8]>) -> Option<String> {
    header
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned)
}

/// `routes` (path, handler, layer) behind `front`.
fn serve(front: Front, app: &App, routes: Vec<(&'static str, Handler, Layer)>) -> FrontDoor {
    match front {
        Front::Axum => {
            let mut router = Router::new();
            for (path, handler, layer) in routes {
                let route = post(
                    move |State(app): State<App>, axum::Json(body): axum::Json<Value>| async move {
                        let reply = handler.run(&app, &body).await;
                        let status = StatusCode::from_u16(reply.status).expect("a status");
                        let mut response = (status, reply.body).into_response();
                        for (name, value) in reply.headers {
                            let value = value.parse().expect("a header value");
                            response.headers_mut().insert(name, value);
                        }
                        response
                    },
                );
                router = router.route(path, route.route_layer(layer.axum()));
            }
            FrontDoor::Axum(router.with_state(app.clone()))
        }
        Front::Actix => FrontDoor::Actix(serve_actix(app, routes)),
    }
}

/// `routes` on a real actix-web server on a free port.
fn serve_actix(app: &App, routes: Vec<(&'static str, Handler, Layer)>) -> Served {
    use actix_web::{HttpResponse, HttpServer, web};

    async fn handle(
        app: web::Data<App>,
        handler: web::Data<Handler>,
        body: web::Json<Value>,
    ) -> HttpResponse {
        let reply = handler.run(&app, &body).await;
        let status = actix_web::http::StatusCode::from_u16(reply.status).expect("a status");
        let mut response = HttpResponse::build(status);
        for (name, value) in reply.headers {
            response.insert_header((name, value));
        }
        response.body(reply.body)
    }

    let app = web::Data::new(app.clone());
    // Built once, outside the per-worker factory, so the workers share recent answers.
    let routes: Vec<_> = routes
        .into_iter()
        .map(|(path, handler, layer)| (path, handler, layer.actix()))
        .collect();
    let server = HttpServer::new(move || {
        let mut service = actix_web::App::new().app_data(app.clone());
        for (path, handler, middleware) in routes.clone() {
            service = service.service(
                web::resource(path)
                    .app_data(web::Data::new(handler))
                    .wrap(middleware)
                    .route(web::post().to(handle)),
            );
        }
        service
    })
    .workers(2)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .expect("bind");
    let addr = server.addrs()[0];
    tokio::spawn(server.run());
    Served(format!("http://{addr}"))
}

/// The suite's usual routes on `b`, behind `front`.
fn routes(front: Front, b: &Backend) -> (FrontDoor, App) {
    let app = App::new(&b.db);
    let layer = Layer::new(&b.db, "layer.effects");
    let tenants = Layer {
        tenants: true,
        ..layer.clone()
    };
    let big = Layer {
        max_response_body: Some(1000),
        max_request_body: Some(100),
        ..Layer::new(&b.db, "layer.big")
    };
    let door = serve(
        front,
        &app,
        vec![
            ("/effects", Handler::Create, layer.clone()),
            ("/slow", Handler::Slow, layer.clone()),
            ("/flaky", Handler::Flaky, layer.clone()),
            ("/refuse", Handler::Refuse, layer),
            ("/big", Handler::Big, big),
            ("/tenant", Handler::Create, tenants),
        ],
    );
    (door, app)
}

/// One test on one backend behind one front door: the routes, and a key and a JSON body that
/// name the test's run.
struct Case {
    b: Backend,
    name: String,
    router: FrontDoor,
    app: App,
    run: String,
    key: String,
    body: Value,
}

impl Case {
    fn new(front: Front, b: Backend, run: &str, amount: i64) -> Self {
        let (router, app) = routes(front, &b);
        Self::with(front, b, router, app, run, amount)
    }

    fn with(front: Front, b: Backend, router: FrontDoor, app: App, run: &str, amount: i64) -> Self {
        let run = unique(run);
        Self {
            name: format!("{}, {front:?}", b.name),
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
        let what = format!("{}: {what}", self.name);
        self.b.assert_effects(&self.run, times, &what).await;
    }
}

#[tokio::test]
async fn missing_invalid_or_repeated_keys_are_400_and_nothing_runs() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-400", 1);
            let name = &t.name;
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
}

#[tokio::test]
async fn a_retry_replays_the_recorded_status_headers_and_body_and_the_route_runs_once() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-replay", 7);
            let name = &t.name;
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
}

#[tokio::test]
async fn the_same_key_with_another_body_path_or_query_is_422() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-422", 7);
            let name = &t.name;
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_409_with_retry_after_then_replays() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-409", 3);
            let name = &t.name;
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
}

#[tokio::test]
async fn a_5xx_is_not_recorded_and_the_retry_runs_the_route_again() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-5xx", 3);
            let name = &t.name;
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
}

#[tokio::test]
async fn a_response_over_the_limit_reaches_its_client_and_its_retry_gets_500_not_a_second_run() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-big", 3);
            let name = &t.name;
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
}

#[tokio::test]
async fn principals_never_share_keys() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-tenant", 1);
            let name = &t.name;
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_stop_the_route_and_its_retry_replays() {
    for front in FRONTS {
        for b in backends().await {
            let t = Case::new(front, b, "layer-gone", 3);
            let name = &t.name;
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
}

#[tokio::test]
async fn a_waiting_duplicate_replays_the_first_response() {
    for front in FRONTS {
        for b in backends().await {
            let app = App::new(&b.db);
            let layer = Layer {
                concurrency: Some(Concurrency::Wait {
                    bound: Duration::from_secs(10),
                }),
                ..Layer::new(&b.db, "layer.wait")
            };
            let router = serve(front, &app, vec![("/slow", Handler::Slow, layer)]);
            let t = Case::with(front, b, router, app, "layer-wait", 3);
            let name = &t.name;
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
}

#[tokio::test]
async fn a_retry_this_process_recorded_is_replayed_from_memory() {
    for front in FRONTS {
        for b in backends().await {
            let name = format!("{}, {front:?}", b.name);
            for remembered in [IdempotencyLayer::DEFAULT_REMEMBERED, 0] {
                // A pool of its own, closed once the first response is recorded.
                let ledger = common::connect(&b.url, 2).await;
                let layer = Layer {
                    remember_answers: Some(remembered),
                    ..Layer::new(&ledger, "layer.memory")
                };
                let app = App::new(&b.db);
                let router = serve(front, &app, vec![("/effects", Handler::Create, layer)]);
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_keys_and_duplicates_runs_each_key_once() {
    const KEYS: usize = 24;
    const COPIES: usize = 4;
    // Both stores: on SQLite each commits its one-statement lease writes in groups.
    for (front, sqlx) in FRONTS.into_iter().flat_map(|f| [(f, false), (f, true)]) {
        for b in backends().await {
            let name = format!("{}, {front:?}, sqlx store: {sqlx}", b.name);
            let layer = Layer {
                remember_answers: Some(0),
                sqlx,
                ..Layer::new(&b.db, "layer.storm")
            };
            let router = serve(
                front,
                &App::new(&b.db),
                vec![("/effects", Handler::Create, layer)],
            );
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
}

/// Observe mode on both front doors, every backend: every request reaches the route and gets
/// the route's own answer where enforcing would have answered for it (a retry, the key with
/// another body, a missing key), and the ledger is written as enforcing writes it, so the same
/// route enforced afterwards replays the first observed answer: no migration.
#[tokio::test]
async fn observed_every_request_runs_the_route_and_enforcing_then_replays_the_first_answer() {
    for front in FRONTS {
        for b in backends().await {
            let app = App::new(&b.db);
            let scope = "layer.observed";
            let observed = Layer {
                mode: idem::Mode::Observe,
                ..Layer::new(&b.db, scope)
            };
            let observed = serve(front, &app, vec![("/effects", Handler::Create, observed)]);
            let enforced = serve(
                front,
                &app,
                vec![("/effects", Handler::Create, Layer::new(&b.db, scope))],
            );
            let t = Case::with(front, b, observed, app, "layer-observe", 1);
            let name = &t.name;
            let first = t.post("/effects").await;
            assert_eq!(first.status, 201, "{name}: {first:?}");
            // Enforcing would replay the first answer: observed, the route runs and answers.
            let retry = t.post("/effects").await;
            assert_eq!(retry.status, 201, "{name}: {retry:?}");
            assert!(!retry.replayed, "{name}: not marked replayed");
            assert_ne!(
                retry.text, first.text,
                "{name}: the route's own answer, not a replay"
            );
            // Enforcing would answer 422 (another body) and 400 (no key).
            let other = json!({"run": t.run, "amount": 2});
            let reused = post_json(&t.router, "/effects", &t.key, &other).await;
            assert_eq!(reused.status, 201, "{name}: {reused:?}");
            let keyless = Call::post("/effects").json(&t.body).send(&t.router).await;
            assert_eq!(keyless.status, 201, "{name}: {keyless:?}");
            t.assert_ran(4, "observed, every request ran the route")
                .await;
            // Enforcing now, on the same ledger: the first observed answer replays.
            let replay = post_json(&enforced, "/effects", &t.key, &t.body).await;
            assert_eq!(replay.status, 201, "{name}: {replay:?}");
            assert!(replay.replayed, "{name}: marked replayed");
            assert_eq!(
                replay.text, first.text,
                "{name}: the first answer, replayed"
            );
            let refused = post_json(&enforced, "/effects", &t.key, &other).await;
            assert_eq!(refused.status, 422, "{name}: {refused:?}");
            t.assert_ran(
                4,
                "enforcing replayed and refused without running the route",
            )
            .await;
        }
    }
}
