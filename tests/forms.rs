//! Forms, queries and redirects (issue 41, item 3): a key sent in a form's hidden field, a
//! query parameter or a JSON member (`Keyed`) rather than the header, and an answer that is
//! not JSON (a `303 See Other` with its `Location` and a flash cookie: `Answer`) recorded and
//! replayed with its status and headers (`respond_answer`). Each case runs on a real axum
//! server and a real actix-web server over the same `#[idempotent]` function, on every backend
//! of the run, with a real HTTP client that does not follow redirects, and counts the
//! function's effect rows.

mod common;

use common::{backends, effects, insert_effect, unique};
use idem::http::{Answer, IdempotencyKey, Problem};
use idem::idempotent;
use sea_orm::DatabaseConnection;
use serde::{Deserialize, Serialize};

/// What the routes submit: the key is not one of its fields (serde skips it), so it is not
/// part of what the function is given, only the key it is called under.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Publish {
    run: String,
    title: String,
}

/// Publishes once per key: one effect row, and a 303 back to the list with a flash message.
#[idempotent(scope = "forms.publish", key = key)]
async fn publish(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    form: Publish,
) -> Result<Answer, Problem> {
    insert_effect(db, &form.run, "publish", 1).await;
    Ok(Answer::see_other(format!("/issues?run={}", form.run))
        .set_cookie(format!("flash=published%20{}; Path=/issues", form.title)))
}

/// The routes on axum: the key in a form field, a query parameter, a JSON member.
mod on_axum {
    use axum::Router;
    use axum::extract::{Form, Json, Query, State};
    use axum::response::Response;
    use axum::routing::post;
    use idem::axum::{Keyed, respond_answer};
    use sea_orm::DatabaseConnection;

    use super::{Publish, publish};

    async fn form(
        State(db): State<DatabaseConnection>,
        Keyed(key, Form(form)): Keyed<Form<Publish>>,
    ) -> Response {
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    async fn link(
        State(db): State<DatabaseConnection>,
        Keyed(key, Query(form)): Keyed<Query<Publish>>,
    ) -> Response {
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    async fn json(
        State(db): State<DatabaseConnection>,
        Keyed(key, Json(form)): Keyed<Json<Publish>>,
    ) -> Response {
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    /// A served router; its base URL.
    pub(super) async fn serve(db: &DatabaseConnection) -> String {
        let app = Router::new()
            .route("/form", post(form))
            .route("/link", post(link))
            .route("/json", post(json))
            .with_state(db.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        base
    }
}

/// The same routes on actix-web.
mod on_actix {
    use actix_web::{App, HttpResponse, HttpServer, web};
    use idem::actix::{Keyed, respond_answer};
    use sea_orm::DatabaseConnection;

    use super::{Publish, publish};

    async fn form(
        db: web::Data<DatabaseConnection>,
        Keyed(key, form): Keyed<web::Form<Publish>>,
    ) -> HttpResponse {
        let (db, form) = (db.get_ref().clone(), form.into_inner());
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    async fn link(
        db: web::Data<DatabaseConnection>,
        Keyed(key, form): Keyed<web::Query<Publish>>,
    ) -> HttpResponse {
        let (db, form) = (db.get_ref().clone(), form.into_inner());
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    async fn json(
        db: web::Data<DatabaseConnection>,
        Keyed(key, form): Keyed<web::Json<Publish>>,
    ) -> HttpResponse {
        let (db, form) = (db.get_ref().clone(), form.into_inner());
        respond_answer(async move { publish(&db, key, form).await }).await
    }

    /// A served app; its base URL.
    pub(super) fn serve(db: &DatabaseConnection) -> String {
        let db = web::Data::new(db.clone());
        let server = HttpServer::new(move || {
            App::new()
                .app_data(db.clone())
                .route("/form", web::post().to(form))
                .route("/link", web::post().to(link))
                .route("/json", web::post().to(json))
        })
        .workers(2)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        let base = format!("http://{}", server.addrs()[0]);
        tokio::spawn(server.run());
        base
    }
}

/// Both front doors on `db`: (name, base URL).
async fn fronts(db: &DatabaseConnection) -> [(&'static str, String); 2] {
    [
        ("axum", on_axum::serve(db).await),
        ("actix-web", on_actix::serve(db)),
    ]
}

/// A client as a browser's form submission is, minus following the 303.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

/// What a test reads of an answer.
#[derive(Debug)]
struct Got {
    status: u16,
    location: Option<String>,
    cookie: Option<String>,
    replayed: bool,
    content_type: Option<String>,
    body: String,
}

async fn post(url: String, content_type: &str, body: String) -> Got {
    let answer = client()
        .post(url)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("send");
    let header = |name: &str| {
        answer
            .headers()
            .get(name)
            .map(|v| v.to_str().expect("text").to_owned())
    };
    Got {
        status: answer.status().as_u16(),
        location: header("location"),
        cookie: header("set-cookie"),
        replayed: header("idempotent-replayed").as_deref() == Some("true"),
        content_type: header("content-type"),
        body: answer.text().await.expect("body"),
    }
}

/// A form submission with `key` in its hidden field.
async fn submit_form(base: &str, run: &str, title: &str, key: &str) -> Got {
    let body = format!("run={run}&title={title}&idempotency_key={key}");
    post(
        format!("{base}/form"),
        "application/x-www-form-urlencoded",
        body,
    )
    .await
}

/// Asserts that `first` and `retry` are the same 303 to the run's list with its flash
/// cookie, the retry marked replayed and the first not.
fn assert_same_redirect(first: &Got, retry: &Got, run: &str, title: &str, front: &str) {
    for got in [first, retry] {
        assert_eq!(got.status, 303, "{front}: {got:?}");
        assert_eq!(
            got.location.as_deref(),
            Some(format!("/issues?run={run}").as_str()),
            "{front}"
        );
        assert_eq!(
            got.cookie.as_deref(),
            Some(format!("flash=published%20{title}; Path=/issues").as_str()),
            "{front}"
        );
    }
    assert!(!first.replayed, "{front}: the first answer is not a replay");
    assert!(retry.replayed, "{front}: the retry is a replay");
}

#[tokio::test]
async fn a_form_field_key_retried_replays_the_same_303_and_publishes_once() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let (run, key) = (unique("form"), unique("k"));
            let first = submit_form(&base, &run, "One", &key).await;
            let retry = submit_form(&base, &run, "One", &key).await;
            assert_same_redirect(&first, &retry, &run, "One", front);
            assert_eq!(effects(&b.db, &run).await, 1, "{}/{front}", b.name);

            // A double click: two submissions at once, one publication.
            let (run, key) = (unique("form"), unique("k"));
            let (one, two) = tokio::join!(
                submit_form(&base, &run, "Two", &key),
                submit_form(&base, &run, "Two", &key)
            );
            let published = [&one, &two].iter().filter(|got| got.status == 303).count();
            assert!(published >= 1, "{front}: {one:?} {two:?}");
            for got in [&one, &two] {
                assert!(
                    got.status == 303 || got.status == 409,
                    "{front}: a duplicate in flight is 409: {got:?}"
                );
            }
            assert_eq!(effects(&b.db, &run).await, 1, "{}/{front}", b.name);
        }
    }
}

#[tokio::test]
async fn a_query_parameter_key_retried_replays_and_publishes_once() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let (run, key) = (unique("link"), unique("k"));
            let url = format!("{base}/link?run={run}&title=Linked&idempotency_key={key}");
            let first = post(url.clone(), "text/plain", String::new()).await;
            let retry = post(url, "text/plain", String::new()).await;
            assert_same_redirect(&first, &retry, &run, "Linked", front);
            assert_eq!(effects(&b.db, &run).await, 1, "{}/{front}", b.name);
        }
    }
}

#[tokio::test]
async fn a_json_member_key_retried_replays_and_publishes_once() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let (run, key) = (unique("json"), unique("k"));
            let body = serde_json::json!({"run": run, "title": "Json", "idempotency_key": key});
            let send = || post(format!("{base}/json"), "application/json", body.to_string());
            let first = send().await;
            let retry = send().await;
            assert_same_redirect(&first, &retry, &run, "Json", front);
            assert_eq!(effects(&b.db, &run).await, 1, "{}/{front}", b.name);
        }
    }
}

#[tokio::test]
async fn a_body_key_reused_with_another_body_is_422_and_publishes_nothing_more() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let (run, key) = (unique("reuse"), unique("k"));
            assert_eq!(submit_form(&base, &run, "One", &key).await.status, 303);
            let reused = submit_form(&base, &run, "Other", &key).await;
            assert_eq!(reused.status, 422, "{front}: {reused:?}");
            assert_eq!(
                reused.content_type.as_deref(),
                Some("application/problem+json")
            );
            assert!(
                reused.body.contains("key-reused"),
                "{front}: {}",
                reused.body
            );

            let (run, key) = (unique("reuse"), unique("k"));
            let json = |title: &str| {
                let body = serde_json::json!({"run": run, "title": title, "idempotency_key": key});
                post(format!("{base}/json"), "application/json", body.to_string())
            };
            assert_eq!(json("One").await.status, 303);
            assert_eq!(json("Other").await.status, 422, "{front}");
            assert_eq!(effects(&b.db, &run).await, 1, "{}/{front}", b.name);
        }
    }
}

#[tokio::test]
async fn a_missing_or_invalid_body_key_is_a_400_problem_and_nothing_runs() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let run = unique("bad");
            let form = "application/x-www-form-urlencoded";
            let long = "k".repeat(256);
            for (body, kind) in [
                (format!("run={run}&title=T"), "missing-key"),
                (format!("run={run}&title=T&idempotency_key="), "invalid-key"),
                (
                    format!("run={run}&title=T&idempotency_key={long}"),
                    "invalid-key",
                ),
                (
                    format!("run={run}&title=T&idempotency_key=a&idempotency_key=b"),
                    "invalid-key",
                ),
            ] {
                let got = post(format!("{base}/form"), form, body).await;
                assert_eq!(got.status, 400, "{front}: {got:?}");
                assert_eq!(
                    got.content_type.as_deref(),
                    Some("application/problem+json")
                );
                assert!(got.body.contains(kind), "{front}: {}", got.body);
            }
            // The header and the field disagree.
            let got = client()
                .post(format!("{base}/form"))
                .header("content-type", form)
                .header("idempotency-key", "h-1")
                .body(format!("run={run}&title=T&idempotency_key=f-1"))
                .send()
                .await
                .expect("send");
            assert_eq!(got.status(), 400, "{front}");
            assert_eq!(effects(&b.db, &run).await, 0, "{}/{front}", b.name);
        }
    }
}

#[tokio::test]
async fn a_body_over_the_frameworks_limit_is_a_413_problem_and_nothing_runs() {
    for b in backends().await {
        for (front, base) in fronts(&b.db).await {
            let run = unique("large");
            // Over both defaults: axum's `DefaultBodyLimit` (2 MiB), actix-web's
            // `PayloadConfig` (256 KiB).
            let padding = "x".repeat(3 << 20);
            let body = format!("run={run}&title={padding}&idempotency_key=k-large");
            let got = post(
                format!("{base}/form"),
                "application/x-www-form-urlencoded",
                body,
            )
            .await;
            assert_eq!(got.status, 413, "{front}: {}", got.body);
            assert_eq!(
                got.content_type.as_deref(),
                Some("application/problem+json")
            );
            assert!(
                got.body.contains("request-too-large"),
                "{front}: {}",
                got.body
            );
            assert_eq!(effects(&b.db, &run).await, 0, "{}/{front}", b.name);
        }
    }
}
