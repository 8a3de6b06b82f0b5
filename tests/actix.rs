//! The actix-web front door (issue 32 item 2): a real actix-web server and a real HTTP client,
//! on every backend of the run: the key header (400 without it), a replay marked
//! `Idempotent-Replayed`, a reused key answered 422, concurrent duplicates run once, a
//! recorded refusal replayed marked, and a client that hangs up mid-call finds it finished and
//! replayed on retry. Every case counts the effect rows (or the body's runs). (actix-web keeps polling a handler whose client left, so that case passes
//! without `respond`'s task too: the task guards the call where actix drops the handler, at
//! a worker's shutdown.)

mod common;

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, HttpServer, web};
use common::{Gate, backends, effects, insert_effect, unique};
use idem::actix::{IdempotencyKey, Problem, respond};
use idem::idempotent;
use sea_orm::DatabaseConnection;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Pay {
    run: String,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    run: String,
    amount: i64,
}

#[idempotent(scope = "actix.pay", key = key, skip(gate))]
async fn pay_order(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    cmd: Pay,
    gate: Option<Gate>,
) -> Result<Receipt, Problem> {
    insert_effect(db, &cmd.run, "pay", cmd.amount).await;
    if let Some(gate) = gate {
        gate.pass().await;
    }
    Ok(Receipt {
        run: cmd.run,
        amount: cmd.amount,
    })
}

async fn pay(
    db: web::Data<DatabaseConnection>,
    gate: web::Data<Option<Gate>>,
    key: IdempotencyKey,
    body: web::Json<Pay>,
) -> HttpResponse {
    let (db, gate, cmd) = (
        db.get_ref().clone(),
        gate.get_ref().clone(),
        body.into_inner(),
    );
    respond(StatusCode::CREATED, async move {
        pay_order(&db, key, cmd, gate).await
    })
    .await
}

/// An actix-web server on a free port; its base URL.
fn serve(db: &DatabaseConnection, gate: Option<Gate>) -> String {
    let (db, gate) = (web::Data::new(db.clone()), web::Data::new(gate));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(db.clone())
            .app_data(gate.clone())
            .route("/pay", web::post().to(pay))
    })
    .workers(2)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .expect("bind");
    let addr = server.addrs()[0];
    tokio::spawn(server.run());
    format!("http://{addr}/pay")
}

async fn post(url: &str, key: Option<&str>, body: &Value) -> reqwest::Response {
    let mut request = reqwest::Client::new().post(url).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.expect("send")
}

#[tokio::test]
async fn the_contract_over_a_real_actix_server() {
    for b in backends().await {
        let url = serve(&b.db, None);
        let run = unique("actix");
        let body = json!({"run": run, "amount": 5});

        let missing = post(&url, None, &body).await;
        assert_eq!(missing.status(), 400, "{}", b.name);
        assert_eq!(
            missing.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(effects(&b.db, &run).await, 0, "{}: no key, no call", b.name);

        let key = unique("k");
        let first = post(&url, Some(&key), &body).await;
        assert_eq!(first.status(), 201, "{}", b.name);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first: Value = first.json().await.expect("json");
        let again = post(&url, Some(&key), &body).await;
        assert_eq!(
            again.status(),
            201,
            "{}: a replay answers as the first",
            b.name
        );
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.json::<Value>().await.expect("json"), first);
        assert_eq!(
            effects(&b.db, &run).await,
            1,
            "{}: replayed, not run",
            b.name
        );

        let other = json!({"run": run, "amount": 6});
        let reused = post(&url, Some(&key), &other).await;
        assert_eq!(reused.status(), 422, "{}", b.name);
        assert_eq!(reused.headers()["content-type"], "application/problem+json");
        assert_eq!(
            effects(&b.db, &run).await,
            1,
            "{}: a reused key runs nothing",
            b.name
        );

        let storm_run = unique("actix-storm");
        let storm_body = json!({"run": storm_run, "amount": 7});
        let storm_key = unique("k");
        let answers = futures_util::future::join_all(
            (0..10).map(|_| post(&url, Some(&storm_key), &storm_body)),
        )
        .await;
        for answer in answers {
            assert_eq!(answer.status(), 201, "{}", b.name);
        }
        assert_eq!(
            effects(&b.db, &storm_run).await,
            1,
            "{}: 10 duplicates, one run",
            b.name
        );
    }
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_call_finds_it_finished_on_retry() {
    for b in backends().await {
        let gate = Gate::default();
        let url = serve(&b.db, Some(gate.clone()));
        let run = unique("actix-hangup");
        let body = json!({"run": run, "amount": 8});
        let key = unique("k");
        let gone = {
            let (url, key, body) = (url.clone(), key.clone(), body.clone());
            tokio::spawn(async move {
                reqwest::Client::new()
                    .post(&url)
                    .header("Idempotency-Key", key)
                    .json(&body)
                    .timeout(std::time::Duration::from_millis(300))
                    .send()
                    .await
            })
        };
        gate.entered().await;
        assert!(gone.await.expect("task").is_err(), "the client gave up");
        gate.release();
        // The call finishes on its own; the retry waits for it or replays it.
        let retry = post(&url, Some(&key), &body).await;
        assert_eq!(retry.status(), 201, "{}", b.name);
        assert_eq!(retry.headers()["idempotent-replayed"], "true", "{}", b.name);
        assert_eq!(effects(&b.db, &run).await, 1, "{}: ran once", b.name);
    }
}

/// A conditional write on actix-web: `IfMatch` is required (428 without it, 400 when
/// malformed), several field lines are one list, a tag that no longer matches is 412, and
/// `ETag` is a header. (No database: the precondition is checked before any write.)
#[tokio::test]
async fn if_match_and_etag_on_a_real_actix_server() {
    use idem::actix::{ETag, EntityTag, IfMatch};

    async fn update(if_match: IfMatch) -> Result<HttpResponse, Problem> {
        let current = EntityTag::from_version(3);
        if !if_match.matches(Some(&current)) {
            let e = idem::Error::PreconditionFailed {
                current: Some(current),
            };
            return Err(Problem::from(e));
        }
        Ok(HttpResponse::Ok()
            .insert_header(ETag(EntityTag::from_version(4)))
            .finish())
    }

    let server = HttpServer::new(|| App::new().route("/note", web::patch().to(update)))
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
    let url = format!("http://{}/note", server.addrs()[0]);
    tokio::spawn(server.run());
    let patch = |tags: &[&str]| {
        let mut request = reqwest::Client::new().patch(&url);
        for tag in tags {
            request = request.header("If-Match", *tag);
        }
        async move { request.send().await.expect("send") }
    };
    let kind = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        let body: Value = response.json().await.expect("problem+json");
        (status, body["type"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(
        kind(patch(&[]).await).await,
        (428, "urn:idem:problem:precondition-required".to_owned())
    );
    assert_eq!(
        kind(patch(&["three"]).await).await,
        (400, "urn:idem:problem:invalid-precondition".to_owned())
    );
    assert_eq!(
        kind(patch(&["\"2\""]).await).await,
        (412, "urn:idem:problem:precondition-failed".to_owned())
    );
    let matched = patch(&["\"1\"", "\"3\""]).await;
    assert_eq!(matched.status(), 200, "two field lines are one list");
    assert_eq!(matched.headers()["etag"], "\"4\"");
}

/// A declined card: a final error its retry replays. `respond` marks the replayed refusal
/// `Idempotent-Replayed: true` (a first refusal has no marker), and the card is tried once.
#[tokio::test]
async fn a_recorded_refusal_is_replayed_marked() {
    #[derive(Debug, Serialize, Deserialize)]
    enum Refusal {
        #[serde(skip)]
        Idem(idem::Error),
        Declined,
    }
    impl From<idem::Error> for Refusal {
        fn from(e: idem::Error) -> Self {
            Self::Idem(e)
        }
    }
    impl idem::FinalError for Refusal {
        fn is_final(&self) -> bool {
            matches!(self, Self::Declined)
        }
    }
    impl std::fmt::Display for Refusal {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{self:?}")
        }
    }
    impl actix_web::ResponseError for Refusal {
        fn error_response(&self) -> HttpResponse {
            match self {
                Self::Idem(e) => Problem::from(e).error_response(),
                Self::Declined => HttpResponse::PaymentRequired().json(json!({"declined": true})),
            }
        }
    }
    /// Card attempts, counted in process: a final error's writes roll back with its record.
    static TRIED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    /// Tries the card, which declines.
    #[idempotent(scope = "actix.declined", key = key)]
    async fn charge(
        db: &DatabaseConnection,
        key: IdempotencyKey,
        cmd: Pay,
    ) -> Result<Receipt, Refusal> {
        TRIED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(Refusal::Declined)
    }
    async fn declined(
        db: web::Data<DatabaseConnection>,
        key: IdempotencyKey,
        body: web::Json<Pay>,
    ) -> HttpResponse {
        let (db, cmd) = (db.get_ref().clone(), body.into_inner());
        respond(StatusCode::OK, async move { charge(&db, key, cmd).await }).await
    }

    for b in backends().await {
        let db = web::Data::new(b.db.clone());
        let server = HttpServer::new(move || {
            App::new()
                .app_data(db.clone())
                .route("/charge", web::post().to(declined))
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        let url = format!("http://{}/charge", server.addrs()[0]);
        tokio::spawn(server.run());
        let tried = TRIED.load(std::sync::atomic::Ordering::SeqCst);
        let (key, body) = (unique("k"), json!({"run": unique("declined"), "amount": 9}));
        let first = post(&url, Some(&key), &body).await;
        assert_eq!(first.status(), 402, "{}", b.name);
        assert!(
            first.headers().get("idempotent-replayed").is_none(),
            "{}",
            b.name
        );
        let again = post(&url, Some(&key), &body).await;
        assert_eq!(again.status(), 402, "{}", b.name);
        assert_eq!(
            again
                .headers()
                .get("idempotent-replayed")
                .map(|v| v.as_bytes()),
            Some(&b"true"[..]),
            "{}: the recorded refusal, replayed",
            b.name
        );
        assert_eq!(
            again.json::<Value>().await.expect("json"),
            json!({"declined": true})
        );
        assert_eq!(
            TRIED.load(std::sync::atomic::Ordering::SeqCst) - tried,
            1,
            "{}: the card tried once",
            b.name
        );
    }
}
