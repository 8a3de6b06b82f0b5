//! The HTTP contract of `cargo run --example payments` (IETF Idempotency-Key draft), on every
//! backend of the run: each status code through `oneshot`, and 50 concurrent pays over a real
//! socket.

#[path = "../examples/payments/app.rs"]
#[allow(dead_code, unreachable_pub)]
mod app;
mod common;
#[path = "../examples/shop/model.rs"]
#[allow(unreachable_pub)]
mod model;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

use app::{AppState, Gateway};
use common::{Backend, backends, unique};

struct Answer {
    status: StatusCode,
    replayed: bool,
    content_type: String,
    body: Value,
}

async fn call(
    router: &axum::Router,
    method: &str,
    uri: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> Answer {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let request = match body {
        Some(body) => request
            .header("content-type", "application/json")
            .body(Body::from(body.to_string())),
        None => request.body(Body::empty()),
    }
    .expect("request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (status, replayed, content_type) = (
        response.status(),
        header("idempotent-replayed").as_deref() == Some("true"),
        header("content-type").unwrap_or_default(),
    );
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer {
        status,
        replayed,
        content_type,
        body,
    }
}

async fn service(b: &Backend) -> (axum::Router, AppState) {
    // Two tests creating the tables at once can race on PostgreSQL's catalog: retry.
    for attempt in 1..=5 {
        match app::create_tables(&b.db).await {
            Ok(()) => break,
            Err(e) if attempt == 5 => panic!("{}: cannot create tables: {e}", b.name),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100 * attempt)).await,
        }
    }
    let state = AppState {
        db: b.db.clone(),
        gateway: Gateway::default(),
    };
    (app::router(state.clone()), state)
}

async fn new_order(router: &axum::Router) -> String {
    let created = call(
        router,
        "POST",
        "/orders",
        Some(&unique("create")),
        Some(json!({"customer": "c-1", "amount_cents": 1200, "currency": "usd"})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED);
    created.body["id"].as_str().expect("id").to_owned()
}

async fn payment_rows(db: &sea_orm::DatabaseConnection, order: &str) -> u64 {
    model::payments_of(db, order).await.expect("count payments")
}

#[tokio::test]
async fn the_contract_holds() {
    for b in backends().await {
        let (router, state) = service(&b).await;
        let name = b.name;

        // Create: 201, then the same key replays 201 with the same body and the header.
        let key = unique("create");
        let order = json!({"customer": "c-1", "amount_cents": 1200, "currency": "usd"});
        let first = call(&router, "POST", "/orders", Some(&key), Some(order.clone())).await;
        assert_eq!(first.status, StatusCode::CREATED, "{name}");
        assert!(
            !first.replayed,
            "{name}: a first execution has no replay header"
        );
        assert_eq!(first.body["status"], "pending");
        assert_eq!(first.body["amount_cents"], 1200);
        let again = call(&router, "POST", "/orders", Some(&key), Some(order)).await;
        assert_eq!(
            (again.status, again.replayed),
            (StatusCode::CREATED, true),
            "{name}"
        );
        assert_eq!(again.body, first.body, "{name}");
        let id = first.body["id"].as_str().expect("id").to_owned();

        // Pay: 200; retry replays; same key other amount is 422; a new key is "already paid".
        let pay_uri = format!("/orders/{id}/pay");
        let pay_key = unique("pay");
        let paid = call(
            &router,
            "POST",
            &pay_uri,
            Some(&pay_key),
            Some(json!({"amount_cents": 1200})),
        )
        .await;
        assert_eq!(paid.status, StatusCode::OK, "{name}: {:?}", paid.body);
        assert_eq!(paid.body["status"], "paid");
        let replay = call(
            &router,
            "POST",
            &pay_uri,
            Some(&pay_key),
            Some(json!({"amount_cents": 1200})),
        )
        .await;
        assert_eq!(
            (replay.status, replay.replayed),
            (StatusCode::OK, true),
            "{name}"
        );
        assert_eq!(replay.body, paid.body);
        let reused = call(
            &router,
            "POST",
            &pay_uri,
            Some(&pay_key),
            Some(json!({"amount_cents": 9900})),
        )
        .await;
        assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY, "{name}");
        assert_eq!(reused.content_type, "application/problem+json");
        assert_eq!(reused.body["type"], "urn:idem:problem:key-reused");
        let other_key = call(
            &router,
            "POST",
            &pay_uri,
            Some(&unique("pay")),
            Some(json!({"amount_cents": 1200})),
        )
        .await;
        assert_eq!(other_key.status, StatusCode::OK, "{name}");
        assert!(!other_key.replayed);
        assert_eq!(
            other_key.body["payment_id"], paid.body["payment_id"],
            "{name}: no second payment"
        );
        assert_eq!(payment_rows(&b.db, &id).await, 1, "{name}");
        assert_eq!(
            state.gateway.charges(),
            1,
            "{name}: one charge at the gateway"
        );

        // Cancel a paid order: 409 invalid-transition; cancel a pending one: 200.
        let cancel = call(
            &router,
            "POST",
            &format!("/orders/{id}/cancel"),
            Some(&unique("cancel")),
            None,
        )
        .await;
        assert_eq!(cancel.status, StatusCode::CONFLICT, "{name}");
        assert_eq!(cancel.body["type"], "urn:idem:problem:invalid-transition");
        let pending = new_order(&router).await;
        let cancelled = call(
            &router,
            "POST",
            &format!("/orders/{pending}/cancel"),
            Some(&unique("cancel")),
            None,
        )
        .await;
        assert_eq!(cancelled.status, StatusCode::OK, "{name}");
        assert_eq!(
            cancelled.body,
            json!({"order_id": pending, "status": "cancelled"})
        );
        // Pay a cancelled order: 409, nothing written.
        let refused = call(
            &router,
            "POST",
            &format!("/orders/{pending}/pay"),
            Some(&unique("pay")),
            Some(json!({"amount_cents": 1200})),
        )
        .await;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{name}");
        assert_eq!(refused.body["type"], "urn:idem:problem:invalid-transition");
        assert_eq!(payment_rows(&b.db, &pending).await, 0, "{name}");

        // GET: the order with its payments; unknown: 404 problem.
        let shown = call(&router, "GET", &format!("/orders/{id}"), None, None).await;
        assert_eq!(shown.status, StatusCode::OK);
        assert_eq!(shown.body["status"], "paid");
        assert_eq!(shown.body["payments"].as_array().map(Vec::len), Some(1));
        let missing = call(&router, "GET", "/orders/ord_missing", None, None).await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND);
        assert_eq!(missing.body["type"], "urn:idem:problem:not-found");
        assert_eq!(
            call(&router, "GET", "/healthz", None, None).await.status,
            StatusCode::OK
        );

        // Missing and invalid keys: 400 before any work.
        let no_key = call(
            &router,
            "POST",
            "/orders",
            None,
            Some(json!({"customer": "c", "amount_cents": 1, "currency": "usd"})),
        )
        .await;
        assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(no_key.body["type"], "urn:idem:problem:missing-key");
        let empty = call(
            &router,
            "POST",
            "/orders",
            Some("\"\""),
            Some(json!({"customer": "c", "amount_cents": 1, "currency": "usd"})),
        )
        .await;
        assert_eq!(empty.status, StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(empty.body["type"], "urn:idem:problem:invalid-key");

        // A malformed body is problem+json 400; a negative amount is 422; nothing created.
        use sea_orm::{EntityTrait, PaginatorTrait};
        let orders_before = model::order::Entity::find()
            .count(&state.db)
            .await
            .expect("count orders");
        let malformed = Request::builder()
            .method("POST")
            .uri("/orders")
            .header("idempotency-key", unique("bad-body"))
            .header("content-type", "application/json")
            .body(Body::from("{\"customer\": "))
            .expect("request");
        let response = router.clone().oneshot(malformed).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{name}"
        );
        let negative = call(
            &router,
            "POST",
            "/orders",
            Some(&unique("negative")),
            Some(json!({"customer": "c", "amount_cents": -5, "currency": "usd"})),
        )
        .await;
        assert_eq!(negative.status, StatusCode::UNPROCESSABLE_ENTITY, "{name}");
        assert_eq!(negative.body["type"], "urn:idem:problem:invalid-amount");

        // Two Idempotency-Key fields: no value of them can be trusted: 400, nothing created.
        let request = Request::builder()
            .method("POST")
            .uri("/orders")
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"customer": "c", "amount_cents": 1, "currency": "usd"}).to_string(),
            ))
            .expect("request");
        let response = router.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name}");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("problem+json");
        assert_eq!(body["type"], "urn:idem:problem:invalid-key", "{name}");
        assert!(
            body["detail"]
                .as_str()
                .unwrap_or_default()
                .contains("2 times"),
            "{name}: {body}"
        );
        assert_eq!(
            model::order::Entity::find()
                .count(&state.db)
                .await
                .expect("count orders"),
            orders_before,
            "{name}: nothing created"
        );
    }
}

#[tokio::test]
async fn a_store_failure_is_503_without_sql() {
    // A database without the ledger table: the claim fails in the store.
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("db");
    let router = app::router(AppState {
        db,
        gateway: Gateway::default(),
    });
    let answer = call(
        &router,
        "POST",
        "/orders",
        Some("k-1"),
        Some(json!({"customer": "c", "amount_cents": 1, "currency": "usd"})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.body["type"], "urn:idem:problem:store");
    let detail = answer.body["detail"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(
        !detail.contains("select") && !detail.contains("insert") && !detail.contains("idem_ledger"),
        "{detail}"
    );
}

#[tokio::test]
async fn in_flight_is_409_with_retry_after() {
    let answer = {
        use axum::response::IntoResponse;
        idem::Error::InFlight {
            scope: "s".into(),
            retry_after: std::time::Duration::from_millis(1500),
        }
        .into_response()
    };
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    assert_eq!(
        answer
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("2")
    );
}

/// Sends one raw HTTP/1.1 request over a fresh connection and returns status and body.
async fn raw_post(addr: std::net::SocketAddr, path: &str, key: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_pays_over_a_real_socket_make_one_payment() {
    for b in backends().await {
        let (router, state) = service(&b).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, router).await });
        let (status, created) = raw_post(
            addr,
            "/orders",
            &unique("create"),
            r#"{"customer":"c-1","amount_cents":1200,"currency":"usd"}"#,
        )
        .await;
        assert_eq!(status, 201, "{}: {created}", b.name);
        let id = serde_json::from_str::<Value>(&created).expect("json")["id"]
            .as_str()
            .expect("id")
            .to_owned();

        let key = unique("pay");
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..50 {
            let (path, key) = (format!("/orders/{id}/pay"), key.clone());
            tasks.spawn(
                async move { raw_post(addr, &path, &key, r#"{"amount_cents":1200}"#).await },
            );
        }
        let answers = tasks.join_all().await;
        assert!(
            answers.iter().all(|(status, _)| *status == 200),
            "{}: {answers:?}",
            b.name
        );
        assert!(
            answers.iter().all(|(_, body)| body == &answers[0].1),
            "{}: 50 identical bodies",
            b.name
        );
        assert_eq!(
            payment_rows(&b.db, &id).await,
            1,
            "{}: one payment row",
            b.name
        );
        assert_eq!(state.gateway.charges(), 1, "{}: one charge", b.name);
        server.abort();
    }
}
