//! An actix-web 4 service made idempotent with idem, on an SQLite file (or `DATABASE_URL`):
//! `cargo run --example actix` serves it on a free port and calls it as a client would, retries
//! included, then stops.
//!
//! - `POST /orders/{id}/pay` is a domain function: `#[idempotent]` claims the key in the
//!   payment's own transaction; `respond` answers its JSON and marks replays.
//! - `GET /checkout` renders a form with a fresh key in a hidden field, and `POST /checkout`
//!   pays it as a server-rendered app does: `Keyed` reads the key from the form, the function
//!   answers a `303 See Other` to the payment with a flash cookie (an `Answer`, recorded with
//!   the payment), and `respond_answer` answers it, the same 303 again for a resubmitted form.
//! - `POST /refunds` is a plain handler: `IdempotencyMiddleware` records its whole response.

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, HttpServer, web};
use idem::actix::{
    Answer, IdempotencyKey, IdempotencyMiddleware, Keyed, Problem, respond, respond_answer,
};
use idem::idempotent;
use idem::sea_orm::SeaOrmLeaseStore;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pay {
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    payment_id: String,
    order_id: String,
    amount_cents: i64,
}

/// Writes a payment row (in the claim's transaction the function's body is given); its id.
async fn record_payment(
    db: &impl ConnectionTrait,
    order_id: &str,
    amount_cents: i64,
) -> Result<String, idem::Error> {
    let payment_id = format!("pay-{}", idem::store::random_token());
    let backend = db.get_database_backend();
    let insert = idem::sea_orm::placeholders(
        backend,
        "INSERT INTO actix_payments (id, order_id, amount_cents) VALUES (?, ?, ?)",
    );
    let values = [
        payment_id.clone().into(),
        order_id.into(),
        amount_cents.into(),
    ];
    db.execute_raw(Statement::from_sql_and_values(backend, insert, values))
        .await
        .map_err(|e| idem::Error::store("recording the payment", e))?;
    Ok(payment_id)
}

/// Pays an order once per key: the payment row and the recorded answer commit together.
#[idempotent(scope = "actix.orders.pay", key = key)]
async fn pay_order(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    order_id: String,
    pay: Pay,
) -> Result<Payment, Problem> {
    let payment_id = record_payment(db, &order_id, pay.amount_cents).await?;
    Ok(Payment {
        payment_id,
        order_id,
        amount_cents: pay.amount_cents,
    })
}

/// The checkout form's fields; its key is the hidden `idempotency_key` field, which `Keyed`
/// reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Checkout {
    order_id: String,
    amount_cents: i64,
}

/// Pays from the checkout form once per key. The answer is the browser's: a 303 to the payment
/// with a flash message, recorded with the payment, so a resubmitted form gets the same.
#[idempotent(scope = "actix.checkout", key = key)]
async fn checkout(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    form: Checkout,
) -> Result<Answer, Problem> {
    let payment_id = record_payment(db, &form.order_id, form.amount_cents).await?;
    Ok(Answer::see_other(format!("/payments/{payment_id}"))
        .set_cookie("flash=Payment%20received; Path=/payments; Max-Age=60; HttpOnly"))
}

async fn pay(
    db: web::Data<DatabaseConnection>,
    key: IdempotencyKey,
    order_id: web::Path<String>,
    body: web::Json<Pay>,
) -> HttpResponse {
    let (db, order_id, pay) = (
        db.get_ref().clone(),
        order_id.into_inner(),
        body.into_inner(),
    );
    respond(StatusCode::CREATED, async move {
        pay_order(&db, key, order_id, pay).await
    })
    .await
}

/// The checkout form, with a fresh key in its hidden field: submitting it twice pays once.
async fn checkout_form() -> Answer {
    Answer::html(format!(
        "<form method=\"post\" action=\"/checkout\">\
         <input name=\"order_id\"><input name=\"amount_cents\">\
         <input type=\"hidden\" name=\"idempotency_key\" value=\"{}\">\
         <button>Pay</button></form>",
        idem::store::random_token()
    ))
}

async fn submit_checkout(
    db: web::Data<DatabaseConnection>,
    Keyed(key, form): Keyed<web::Form<Checkout>>,
) -> HttpResponse {
    let (db, form) = (db.get_ref().clone(), form.into_inner());
    respond_answer(async move { checkout(&db, key, form).await }).await
}

/// A plain handler: the middleware makes it idempotent.
async fn refund(body: web::Json<serde_json::Value>) -> HttpResponse {
    let refund_id = format!("ref-{}", idem::store::random_token());
    HttpResponse::Created()
        .json(serde_json::json!({ "refund_id": refund_id, "request": body.into_inner() }))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("idem-actix-example.db");
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let db = sea_orm::Database::connect(&url).await?;
    idem::sea_orm::create_tables(&db).await?;
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS actix_payments (id VARCHAR(64) PRIMARY KEY, order_id VARCHAR(255) NOT NULL, amount_cents BIGINT NOT NULL)",
    )
    .await?;

    // Built once, outside the factory: every worker shares its memory of recent answers.
    let refunds = IdempotencyMiddleware::new(SeaOrmLeaseStore::new(db.clone()), "actix.refunds");
    let data = web::Data::new(db.clone());
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/orders/{id}/pay", web::post().to(pay))
            .route("/checkout", web::get().to(checkout_form))
            .route("/checkout", web::post().to(submit_checkout))
            .service(
                web::resource("/refunds")
                    .wrap(refunds.clone())
                    .route(web::post().to(refund)),
            )
    })
    .workers(1)
    .disable_signals()
    .bind(("127.0.0.1", 0))?;
    let base = format!("http://{}", server.addrs()[0]);
    let server = tokio::spawn(server.run());

    let client = reqwest::Client::new();
    let run = idem::store::random_token();
    let call = |path: String, key: String, body: serde_json::Value| {
        let request = client
            .post(format!("{base}{path}"))
            .header("Idempotency-Key", key)
            .json(&body);
        async move {
            let response = request.send().await?;
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            Ok::<_, reqwest::Error>((status, replayed, response.text().await?))
        }
    };
    let pay_path = format!("/orders/o-{run}/pay");
    let key = format!("pay-{run}");
    for what in ["pay", "pay, retried"] {
        let (status, replayed, body) = call(
            pay_path.clone(),
            key.clone(),
            serde_json::json!({"amount_cents": 4200}),
        )
        .await?;
        println!("{what:<15} {status} replayed={replayed} {body}");
    }
    let (status, _, body) = call(pay_path, key, serde_json::json!({"amount_cents": 9900})).await?;
    println!("{:<15} {status} {body}", "pay, reused");
    // A browser submits the checkout form twice (a double click): one payment, the same 303.
    let page = client
        .get(format!("{base}/checkout"))
        .send()
        .await?
        .text()
        .await?;
    let form_key = page
        .split("name=\"idempotency_key\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .ok_or("the checkout form has no key field")?
        .to_owned();
    let browser = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    for what in ["checkout", "checkout, again"] {
        let answer = browser
            .post(format!("{base}/checkout"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!(
                "order_id=c-{run}&amount_cents=1500&idempotency_key={form_key}"
            ))
            .send()
            .await?;
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        println!(
            "{what:<15} {} replayed={} location={} set-cookie={}",
            answer.status(),
            answer.headers().contains_key("idempotent-replayed"),
            header("location"),
            header("set-cookie"),
        );
    }
    let count = idem::sea_orm::placeholders(
        db.get_database_backend(),
        "SELECT COUNT(*) AS n FROM actix_payments WHERE order_id = ?",
    );
    let paid = db
        .query_one_raw(Statement::from_sql_and_values(
            db.get_database_backend(),
            count,
            [format!("c-{run}").into()],
        ))
        .await?
        .map(|row| row.try_get::<i64>("", "n"))
        .transpose()?;
    println!("{:<15} {} payment(s)", "checkout, paid", paid.unwrap_or(0));
    let key = format!("refund-{run}");
    for what in ["refund", "refund, retried"] {
        let (status, replayed, body) = call(
            "/refunds".to_owned(),
            key.clone(),
            serde_json::json!({"amount_cents": 500}),
        )
        .await?;
        println!("{what:<15} {status} replayed={replayed} {body}");
    }
    server.abort();
    Ok(())
}
