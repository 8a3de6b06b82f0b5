//! A payment gateway as a service of its own: `cargo run --example gateway`.
//!
//! `POST /charges` (`Idempotency-Key` required; body `{"amount_cents", "reference"}`) answers
//! 201 with the charge; a retry with the same key and body gets the same charge back with
//! `Idempotent-Replayed: true`, another body under that key 422. `GET /charges` lists every
//! charge. It is itself built on `#[idempotent]` over its own database (`DATABASE_URL`,
//! default an SQLite file in the temp directory); `--addr` sets the address (default
//! 127.0.0.1:3100). The payments example calls it in lease mode with `GATEWAY_URL`.
//!
//! `GATEWAY_DELAY_MS` holds every answer that long after the charge is made, as a slow acquirer
//! does: a client that dies while it waits has been charged without learning the charge id, and
//! its retry (with the same key) gets the same charge back, held as long.

#[path = "shop/service.rs"]
mod service;

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::axum::{IdempotencyKey, Problem, respond, run_to_completion};
use idem::idempotent;
use sea_orm::entity::prelude::*;
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{ActiveValue::Set, DatabaseConnection, QueryOrder, QuerySelect};
use serde::{Deserialize, Serialize};
use service::{ApiError, BoxError};
use tracing_subscriber::fmt::format::FmtSpan;

mod charge {
    use sea_orm::entity::prelude::*;

    /// One charge the gateway made.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "gateway_charges")]
    pub(crate) struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub(crate) charge_id: String,
        pub(crate) reference: String,
        pub(crate) amount_cents: i64,
        /// The charge's place in the list (`GET /charges`), indexed: the next one is one
        /// index probe away.
        #[sea_orm(indexed)]
        pub(crate) created_seq: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct NewCharge {
    amount_cents: i64,
    reference: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ChargeView {
    charge_id: String,
    reference: String,
    amount_cents: i64,
    status: String,
}

/// Makes the charge once per key: the claim, the charge row and the recorded answer commit
/// together, so a retried request never charges twice.
#[idempotent(scope = "gateway.charges", key = key)]
async fn create_charge(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    new: NewCharge,
) -> Result<ChargeView, ApiError> {
    // The last number taken, from the column's index. (It was `COUNT(*)` of the charges:
    // a read of every charge made, inside each charge, so the gateway slowed as it was
    // used, by half in 8 minutes of R22's soak.)
    let last: Option<i64> = charge::Entity::find()
        .select_only()
        .column_as(Expr::col(charge::Column::CreatedSeq).max(), "last")
        .into_tuple()
        .one(db)
        .await?
        .flatten();
    let created_seq = last.unwrap_or(0) + 1;
    let saved = charge::Entity::insert(charge::ActiveModel {
        charge_id: Set(format!("ch_{}", uuid::Uuid::new_v4().simple())),
        reference: Set(new.reference),
        amount_cents: Set(new.amount_cents),
        created_seq: Set(created_seq),
    })
    .exec_with_returning(db)
    .await?;
    Ok(view(saved))
}

fn view(c: charge::Model) -> ChargeView {
    ChargeView {
        charge_id: c.charge_id,
        reference: c.reference,
        amount_cents: c.amount_cents,
        status: "succeeded".to_owned(),
    }
}

/// The gateway's state: its database, and how long it holds each answer.
#[derive(Debug, Clone)]
struct Gateway {
    db: DatabaseConnection,
    answer_delay: Duration,
}

async fn post_charge(
    State(Gateway { db, answer_delay }): State<Gateway>,
    key: IdempotencyKey,
    Json(new): Json<NewCharge>,
) -> Response {
    if new.amount_cents <= 0 || new.reference.trim().is_empty() {
        let detail = "a charge needs a positive `amount_cents` and a non-empty `reference`";
        return Problem::new(422, "invalid-charge", "Invalid charge", detail).into_response();
    }
    // Owned state, so the call can run to completion on its own task (see `respond`).
    respond(StatusCode::CREATED, async move {
        let charged = create_charge(&db, key, new).await;
        // Held after the charge committed: a client that gives up meanwhile was charged.
        tokio::time::sleep(answer_delay).await;
        charged
    })
    .await
}

/// `GATEWAY_DELAY_MS`, if set: how long each answer is held.
fn answer_delay() -> Result<Duration, BoxError> {
    match std::env::var("GATEWAY_DELAY_MS") {
        Err(_) => Ok(Duration::ZERO),
        Ok(ms) => ms.trim().parse().map(Duration::from_millis).map_err(|e| {
            format!("GATEWAY_DELAY_MS must be a number of milliseconds, not `{ms}`: {e}").into()
        }),
    }
}

async fn list_charges(State(Gateway { db, .. }): State<Gateway>) -> Response {
    // A read that shares the pool: finished on its own task too, so a client that hangs up
    // cannot cut its statement off mid-flight.
    run_to_completion(async move {
        let listed = charge::Entity::find()
            .order_by_asc(charge::Column::CreatedSeq)
            .all(&db)
            .await;
        match listed {
            Ok(all) => Json(all.into_iter().map(view).collect::<Vec<_>>()).into_response(),
            Err(e) => ApiError::from(e).into_response(),
        }
    })
    .await
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    service::init_tracing(FmtSpan::CLOSE);
    let addr = service::listen_addr("127.0.0.1:3100")?;
    let answer_delay = answer_delay()?;
    let (db, database) = service::database("gateway").await?;
    service::create_tables(&db, charge::Entity).await?;

    let app = Router::new()
        .route("/charges", post(post_charge).get(list_charges))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(Gateway { db, answer_delay });
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, %database, ?answer_delay, "gateway listening");
    axum::serve(listener, app).await?;
    Ok(())
}
