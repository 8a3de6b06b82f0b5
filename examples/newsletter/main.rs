//! A newsletter service on sqlx and axum, the shape zero2prod's readers know:
//! `cargo run --example newsletter` (SQLite; `--addr` picks the listen address, default
//! 127.0.0.1:3001).
//!
//! An editor logs in (`POST /login`, a cookie naming the user; a real service checks a
//! session), opens the form (`GET /admin/newsletters`, which carries a fresh idempotency key
//! in a hidden field) and publishes an issue (`POST /admin/newsletters`): the issue and one
//! delivery per confirmed subscriber are written in one transaction, and the answer is a
//! `303 See Other` back to the form with a flash message in a cookie. Publishing must not
//! happen twice: a double click, a resubmitted page or a retry after a timeout sends the same
//! key and gets the same 303 and flash message without a second issue. Keys are scoped to the
//! logged-in user (`principal`), so two editors cannot collide; a key reused with another form
//! is `422` (problem+json).
//!
//! `Keyed<Form<PublishForm>>` reads the key from the form's hidden `idempotency_key` field and
//! hands the form on; the function answers an `Answer` (the 303, its `Location` and its flash
//! cookie), which idem records with the issue, and `respond_answer` runs the call to its end
//! and answers it, the same again for a resubmit.
//!
//! The schema is the app's own migrations (`examples/newsletter/migrations/`, run with sqlx's
//! migrator at start-up or `sqlx migrate run`); idem's ledger is one of them, as
//! `idem schema --backend sqlite --only ledger` prints it.
//!
//! The delivery insert is `sqlx::query!`, checked at compile time against that schema. The
//! check's answers are kept in `.sqlx/` (sqlx's offline data), so the example builds without
//! a database; after changing a checked query, apply the migrations to a SQLite file and build
//! once with `SQLX_OFFLINE=false`, `DATABASE_URL=sqlite://<file>` and
//! `SQLX_OFFLINE_DIR=$PWD/.sqlx` (this workspace sets `SQLX_OFFLINE=true`; or run
//! `cargo sqlx prepare -- --example newsletter --features sqlx-sqlite,axum`).

use std::net::SocketAddr;
use std::path::Path;

use axum::Router;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use idem::axum::{Answer, IdempotencyKey, Keyed, Problem, respond_answer};
use idem::idempotent;
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The form an editor submits. Its key is the hidden `idempotency_key` field the form page
/// rendered, which `Keyed` reads.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PublishForm {
    title: String,
    content: String,
}

/// Why publishing failed.
#[derive(Debug)]
enum PublishError {
    /// idem's answer: a reused key (422), a duplicate still running (409), no database (503).
    Idem(idem::Error),
    /// The database failed: the call rolled back, a retry publishes.
    Database(sqlx::Error),
}

impl From<idem::Error> for PublishError {
    fn from(e: idem::Error) -> Self {
        PublishError::Idem(e)
    }
}

impl From<sqlx::Error> for PublishError {
    fn from(e: sqlx::Error) -> Self {
        PublishError::Database(e)
    }
}

impl IntoResponse for PublishError {
    fn into_response(self) -> Response {
        match self {
            PublishError::Idem(e) => Problem::from(e).into_response(),
            PublishError::Database(e) => {
                tracing::error!(error = %e, "publishing failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "publishing failed; try again",
                )
                    .into_response()
            }
        }
    }
}

/// Publishes an issue: the issue and its deliveries in the claim's transaction (`db` is its
/// `&mut SqliteConnection`), so they commit with the recorded answer or not at all. Its key
/// belongs to the editor. The answer is the page's: a 303 back to the form with a flash
/// message, recorded as it is, so a resubmitted form gets the same.
#[idempotent(scope = "newsletter.publish", key = key, principal = editor)]
async fn publish_issue(
    db: &SqlitePool,
    key: IdempotencyKey,
    editor: &str,
    form: PublishForm,
) -> Result<Answer, PublishError> {
    let issue_id: i64 = sqlx::query_scalar(
        "INSERT INTO newsletter_issues (title, content, published_by) VALUES (?, ?, ?) RETURNING id",
    )
    .bind(&form.title)
    .bind(&form.content)
    .bind(editor)
    .fetch_one(&mut *db)
    .await?;
    // Checked at compile time against the schema (sqlx's offline data in `.sqlx/`, so the
    // example builds without a database).
    sqlx::query!(
        "INSERT INTO issue_delivery_queue (issue_id, subscriber_email) \
         SELECT ?, email FROM subscriptions WHERE status = 'confirmed'",
        issue_id
    )
    .execute(&mut *db)
    .await?;
    // 303: the browser GETs the form again, which shows the flash message.
    Ok(Answer::see_other("/admin/newsletters").set_cookie(format!(
        "flash=Issue%20{issue_id}%20published; Path=/admin; Max-Age=60; HttpOnly"
    )))
}

#[derive(Clone)]
struct AppState {
    pool: SqlitePool,
}

/// The value of the request's cookie `name`.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    let cookies = headers.get(header::COOKIE)?.to_str().ok()?;
    cookies
        .split(';')
        .find_map(|c| c.trim().strip_prefix(name)?.strip_prefix('='))
        .filter(|value| !value.is_empty())
        .map(str::to_owned)
}

/// The editor the request's cookie names.
fn editor(headers: &HeaderMap) -> Option<String> {
    cookie(headers, "editor")
}

#[derive(Deserialize)]
struct Login {
    username: String,
}

async fn login(Form(login): Form<Login>) -> Response {
    let cookie = format!(
        "editor={}; Path=/; HttpOnly; SameSite=Strict",
        login.username
    );
    (
        [(header::SET_COOKIE, cookie)],
        Redirect::to("/admin/newsletters"),
    )
        .into_response()
}

async fn form_page(State(app): State<AppState>, headers: HeaderMap) -> Response {
    let Some(editor) = editor(&headers) else {
        return Redirect::to("/login").into_response();
    };
    let published: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM newsletter_issues")
        .fetch_one(&app.pool)
        .await
        .unwrap_or(0);
    // The flash message a publication left, shown once (a real service escapes it).
    let flash = cookie(&headers, "flash")
        .map(|text| format!("<p><i>{}</i></p>", text.replace("%20", " ")))
        .unwrap_or_default();
    let key = uuid::Uuid::new_v4();
    let page = Html(format!(
        "{flash}<p>Logged in as {editor}. {published} issues published.</p>\
         <form method=\"post\" action=\"/admin/newsletters\">\
         <input name=\"title\"><textarea name=\"content\"></textarea>\
         <input type=\"hidden\" name=\"idempotency_key\" value=\"{key}\">\
         <button>Publish</button></form>"
    ));
    let shown = "flash=; Path=/admin; Max-Age=0";
    ([(header::SET_COOKIE, shown)], page).into_response()
}

async fn publish(
    State(app): State<AppState>,
    headers: HeaderMap,
    Keyed(key, Form(form)): Keyed<Form<PublishForm>>,
) -> Response {
    let Some(editor) = editor(&headers) else {
        return Redirect::to("/login").into_response();
    };
    // A browser that gives up does not cut the publication off half-way: it runs to its end
    // on a task of its own, and the retry replays its 303.
    respond_answer(async move { publish_issue(&app.pool, key, &editor, form).await }).await
}

fn router(pool: SqlitePool) -> Router {
    Router::new()
        .route("/login", post(login))
        .route("/admin/newsletters", get(form_page).post(publish))
        .with_state(AppState { pool })
}

/// The database at `url`, migrated: the app's tables and idem's ledger.
async fn database(url: &str) -> Result<SqlitePool, BoxError> {
    let options: sqlx::sqlite::SqliteConnectOptions = url.parse()?;
    let pool = SqlitePool::connect_with(options.create_if_missing(true)).await?;
    let migrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/newsletter/migrations");
    sqlx::migrate::Migrator::new(migrations)
        .await?
        .run(&pool)
        .await?;
    Ok(pool)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let addr: SocketAddr = match std::env::args().skip_while(|a| a != "--addr").nth(1) {
        Some(addr) => addr.parse()?,
        None => "127.0.0.1:3001".parse()?,
    };
    let path = std::env::temp_dir().join("idem-newsletter.db");
    let pool = database(&format!("sqlite://{}", path.display())).await?;
    sqlx::query(
        "INSERT OR IGNORE INTO subscriptions (email, name, status) VALUES \
         ('ada@example.com', 'Ada', 'confirmed'), ('alan@example.com', 'Alan', 'confirmed'), \
         ('grace@example.com', 'Grace', 'pending_confirmation')",
    )
    .execute(&pool)
    .await?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("newsletter on http://{addr} (database {})", path.display());
    println!("  curl -i -c jar -d username=ada http://{addr}/login");
    println!("  curl -s -b jar http://{addr}/admin/newsletters   # the form, with its key");
    axum::serve(listener, router(pool)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A served app on a fresh database with two confirmed subscribers and a pending one.
    async fn serve() -> (String, SqlitePool) {
        let pool = subscribed().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let app = router(pool.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (base, pool)
    }

    /// A fresh database with two confirmed subscribers and a pending one.
    async fn subscribed() -> SqlitePool {
        let path =
            std::env::temp_dir().join(format!("idem-newsletter-{}.db", uuid::Uuid::new_v4()));
        let pool = database(&format!("sqlite://{}", path.display()))
            .await
            .expect("database");
        sqlx::query(
            "INSERT INTO subscriptions (email, name, status) VALUES \
             ('a@example.com', 'A', 'confirmed'), ('b@example.com', 'B', 'confirmed'), \
             ('c@example.com', 'C', 'pending_confirmation')",
        )
        .execute(&pool)
        .await
        .expect("subscribers");
        pool
    }

    fn client() -> reqwest::Client {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("client")
    }

    /// Submits the form as `editor` would.
    async fn submit(base: &str, editor: &str, title: &str, key: &str) -> reqwest::Response {
        client()
            .post(format!("{base}/admin/newsletters"))
            .header(header::COOKIE, format!("editor={editor}"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(format!("title={title}&content=Hello&idempotency_key={key}"))
            .send()
            .await
            .expect("send")
    }

    async fn issues(pool: &SqlitePool) -> (i64, i64) {
        let issues = sqlx::query_scalar("SELECT COUNT(*) FROM newsletter_issues")
            .fetch_one(pool)
            .await
            .expect("count");
        let deliveries = sqlx::query_scalar("SELECT COUNT(*) FROM issue_delivery_queue")
            .fetch_one(pool)
            .await
            .expect("count");
        (issues, deliveries)
    }

    /// The key the form page renders, after logging in.
    async fn form_key(base: &str) -> String {
        let login = client()
            .post(format!("{base}/login"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body("username=ada")
            .send()
            .await
            .expect("login");
        assert_eq!(login.status(), StatusCode::SEE_OTHER);
        let cookie = login.headers()[header::SET_COOKIE]
            .to_str()
            .expect("cookie")
            .to_owned();
        let page = client()
            .get(format!("{base}/admin/newsletters"))
            .header(header::COOKIE, cookie.split(';').next().expect("pair"))
            .send()
            .await
            .expect("page")
            .text()
            .await
            .expect("html");
        let (_, rest) = page
            .split_once("name=\"idempotency_key\" value=\"")
            .expect("key field");
        rest.split('"').next().expect("key").to_owned()
    }

    #[tokio::test]
    async fn a_double_submit_publishes_once() {
        let (base, pool) = serve().await;
        let key = form_key(&base).await;
        let (first, second) = tokio::join!(
            submit(&base, "ada", "Issue-1", &key),
            submit(&base, "ada", "Issue-1", &key)
        );
        let flash = "flash=Issue%201%20published; Path=/admin; Max-Age=60; HttpOnly";
        for answer in [first, second] {
            assert_eq!(answer.status(), StatusCode::SEE_OTHER);
            assert_eq!(answer.headers()[header::LOCATION], "/admin/newsletters");
            assert_eq!(answer.headers()[header::SET_COOKIE], flash);
        }
        assert_eq!(
            issues(&pool).await,
            (1, 2),
            "one issue, one delivery per confirmed subscriber"
        );
        // A resubmit after the fact answers the same, flash message included, and publishes
        // nothing.
        let again = submit(&base, "ada", "Issue-1", &key).await;
        assert_eq!(again.status(), StatusCode::SEE_OTHER);
        assert_eq!(again.headers()[header::LOCATION], "/admin/newsletters");
        assert_eq!(again.headers()[header::SET_COOKIE], flash);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(issues(&pool).await, (1, 2));
    }

    /// The issue titled `title` and its deliveries, counted.
    async fn published(pool: &SqlitePool, title: &str) -> (i64, i64) {
        let issues = sqlx::query_scalar("SELECT COUNT(*) FROM newsletter_issues WHERE title = ?")
            .bind(title)
            .fetch_one(pool)
            .await
            .expect("count");
        let deliveries = sqlx::query_scalar(
            "SELECT COUNT(*) FROM issue_delivery_queue q \
             JOIN newsletter_issues i ON i.id = q.issue_id WHERE i.title = ?",
        )
        .bind(title)
        .fetch_one(pool)
        .await
        .expect("count");
        (issues, deliveries)
    }

    /// idem's crash-point harness: a publication killed at each crash point idem has on its
    /// path (after the claim, before the record, before the commit) and submitted again
    /// publishes one issue with one delivery per confirmed subscriber, and answers the
    /// recorded 303.
    #[tokio::test]
    async fn a_publication_killed_at_any_crash_point_publishes_once() {
        use idem::testing::{CrashTest, Scenario};

        let pool = subscribed().await;
        let report = CrashTest::new(
            async |scenario: &Scenario| {
                let key = IdempotencyKey::parse(scenario.key.as_bytes()).expect("a valid key");
                (key, format!("Issue {}", scenario.key))
            },
            async |(key, title): &(IdempotencyKey, String)| {
                let form = PublishForm {
                    title: title.clone(),
                    content: "Hello".to_owned(),
                };
                publish_issue(&pool, key.clone(), "ada", form).await
            },
            async |(_, title): &(IdempotencyKey, String)| published(&pool, title).await,
        )
        .expect_effects((1, 2))
        .run()
        .await;
        println!("{report}");
        report.assert_once();
        assert_eq!(report.points().len(), 3, "{report}");
    }

    #[tokio::test]
    async fn a_key_reused_with_another_form_is_refused() {
        let (base, pool) = serve().await;
        let key = form_key(&base).await;
        assert_eq!(
            submit(&base, "ada", "Issue-1", &key).await.status(),
            StatusCode::SEE_OTHER
        );
        let reused = submit(&base, "ada", "Issue-2", &key).await;
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            reused.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(
            issues(&pool).await,
            (1, 2),
            "the second form published nothing"
        );
    }

    #[tokio::test]
    async fn keys_belong_to_their_editor() {
        let (base, pool) = serve().await;
        let key = form_key(&base).await;
        assert_eq!(
            submit(&base, "ada", "Issue-1", &key).await.status(),
            StatusCode::SEE_OTHER
        );
        // Another editor's form with the same key is another publication.
        assert_eq!(
            submit(&base, "alan", "Issue-1", &key).await.status(),
            StatusCode::SEE_OTHER
        );
        assert_eq!(issues(&pool).await, (2, 4));
    }

    #[test]
    fn the_ledger_migration_is_what_idem_schema_prints() {
        let migration = include_str!("migrations/0003_idem_ledger.sql");
        let printed = include_str!("../../idem-sql/schema/sqlite/ledger.sql");
        let (_, rest) = migration
            .split_once('\n')
            .expect("the first line says where it is from");
        assert_eq!(
            rest, printed,
            "regenerate: idem schema --backend sqlite --only ledger"
        );
    }

    #[tokio::test]
    async fn logged_out_editors_are_sent_to_log_in() {
        let (base, pool) = serve().await;
        let answer = client()
            .post(format!("{base}/admin/newsletters"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body("title=T&content=C&idempotency_key=k-1")
            .send()
            .await
            .expect("send");
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        assert_eq!(answer.headers()[header::LOCATION], "/login");
        assert_eq!(issues(&pool).await, (0, 0));
    }
}
