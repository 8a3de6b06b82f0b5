//! A payment gateway as a service of its own: `cargo run --example gateway`.
//!
//! `POST /charges` (`Idempotency-Key` required; body `{"amount_cents", "reference"}`) answers
//! 201 with the charge; a retry with the same key and body gets the same charge back with
//! `Idempotent-Replayed: true`, another body under that key 422. `GET /charges` lists every
//! charge. It is itself built on `#[idempotent]` over its own database (`DATABASE_URL`,
//! default an SQLite file in the temp directory); `--addr` sets the address (default
//! 127.0.0.1:3100). The payments example calls it in lease mode with `GATEWAY_URL`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::axum::{IdempotencyKey, Problem, respond, run_to_completion};
use idem::idempotent;
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, ConnectOptions, Database, DatabaseConnection, QueryOrder, Schema};
use serde::{Deserialize, Serialize};

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

#[derive(Debug)]
enum ApiError {
    Idem(idem::Error),
    Invalid(String),
    Database,
}

impl From<idem::Error> for ApiError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl From<DbErr> for ApiError {
    fn from(e: DbErr) -> Self {
        tracing::error!(error = %e, "database error");
        Self::Database
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Idem(e) => Problem::from(e).into_response(),
            Self::Invalid(detail) => {
                Problem::new(422, "invalid-charge", "Invalid charge", detail).into_response()
            }
            Self::Database => Problem::new(
                503,
                "store",
                "Service unavailable",
                "the database is unavailable; retry later",
            )
            .into_response(),
        }
    }
}

/// Makes the charge once per key: the claim, the charge row and the recorded answer commit
/// together, so a retried request never charges twice.
#[idempotent(scope = "gateway.charges", key = key)]
async fn create_charge(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    new: NewCharge,
) -> Result<ChargeView, ApiError> {
    let created_seq = charge::Entity::find().count(db).await? as i64 + 1;
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

async fn post_charge(
    State(db): State<DatabaseConnection>,
    key: IdempotencyKey,
    Json(new): Json<NewCharge>,
) -> Response {
    if new.amount_cents <= 0 || new.reference.trim().is_empty() {
        return ApiError::Invalid(
            "a charge needs a positive `amount_cents` and a non-empty `reference`".into(),
        )
        .into_response();
    }
    // Owned state, so the call can run to completion on its own task (see `respond`).
    respond(StatusCode::CREATED, async move {
        create_charge(&db, key, new).await
    })
    .await
}

async fn list_charges(State(db): State<DatabaseConnection>) -> Response {
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
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let mut addr = "127.0.0.1:3100".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => {
                addr = args
                    .next()
                    .ok_or("--addr needs a value, e.g. 127.0.0.1:3100")?
            }
            other => {
                return Err(
                    format!("unknown argument `{other}`; expected --addr HOST:PORT").into(),
                );
            }
        }
    }
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("idem-gateway.db");
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let mut options = ConnectOptions::new(url.clone());
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    idem::sea_orm::create_tables(&db).await?;
    let schema = Schema::new(db.get_database_backend());
    db.execute(
        schema
            .create_table_from_entity(charge::Entity)
            .if_not_exists(),
    )
    .await?;

    let app = Router::new()
        .route("/charges", post(post_charge).get(list_charges))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(db);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, database = %url.split('?').next().unwrap_or_default(), "gateway listening");
    axum::serve(listener, app).await?;
    Ok(())
}
