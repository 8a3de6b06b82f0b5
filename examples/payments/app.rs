//! The payments service: routes, handlers and the idempotent domain functions. Shared by
//! `main.rs` and the HTTP tests (`tests/http.rs` includes this file and `../shop/model.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::axum::{IdempotencyKey, Problem, respond};
use idem::outbox::Message;
use idem::sea_orm::{Outbox, Stateful};
use idem::{TransitionOutcome, idempotent, transition};
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, DatabaseConnection, QueryOrder};
use serde::{Deserialize, Serialize};

pub(crate) use crate::model::{OrderStatus, create_tables, order, payment};

/// A simulated payment gateway with its own idempotency: a charge key seen before returns
/// the charge it created then (as Stripe does). The second line of defence for effects
/// outside our database.
#[derive(Debug, Default, Clone)]
pub(crate) struct Gateway {
    charges: Arc<Mutex<HashMap<String, String>>>,
}

impl Gateway {
    pub(crate) fn charge(&self, idempotency_key: &str, amount_cents: i64) -> String {
        let mut charges = self
            .charges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let next = charges.len() + 1;
        charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| format!("ch_{next:06}_{amount_cents}"))
            .clone()
    }

    /// How many distinct charges it made.
    #[allow(dead_code)] // read by tests/http.rs, which includes this file
    pub(crate) fn charges(&self) -> usize {
        self.charges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

#[derive(Clone, Debug)]
pub(crate) struct AppState {
    pub(crate) db: DatabaseConnection,
    pub(crate) gateway: Gateway,
}

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(show_order))
        .route("/orders/{id}/pay", post(pay_order))
        .route("/orders/{id}/cancel", post(cancel_order))
        .with_state(state)
}

/// The service's errors: idem's own, plus its domain errors.
#[derive(Debug)]
pub(crate) enum ApiError {
    Idem(idem::Error),
    NotFound(String),
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
            Self::Idem(e) => e.into_response(),
            Self::NotFound(id) => {
                Problem::new(404, "not-found", "Not found", format!("no order `{id}`"))
                    .into_response()
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct NewOrder {
    pub(crate) customer: String,
    pub(crate) amount_cents: i64,
    pub(crate) currency: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct OrderView {
    pub(crate) id: String,
    pub(crate) status: OrderStatus,
    pub(crate) customer: String,
    pub(crate) amount_cents: i64,
    pub(crate) currency: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PayRequest {
    pub(crate) amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PaymentView {
    pub(crate) order_id: String,
    pub(crate) status: OrderStatus,
    pub(crate) payment_id: String,
}

/// The subject of the event a payment publishes.
pub(crate) const ORDER_PAID: &str = "shop.orders.paid";

/// What other services hear when an order is paid (published through the outbox).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct OrderPaid {
    pub(crate) order_id: String,
    pub(crate) payment_id: String,
    pub(crate) amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StatusView {
    pub(crate) order_id: String,
    pub(crate) status: OrderStatus,
}

// ---- the idempotent domain functions: plain async fns, no HTTP in sight ----

#[idempotent(scope = "shop.orders.create", key = key)]
async fn place_order(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    new: NewOrder,
) -> Result<OrderView, ApiError> {
    let saved = order::Entity::insert(order::ActiveModel {
        id: Set(format!("ord_{}", uuid::Uuid::new_v4().simple())),
        customer: Set(new.customer),
        amount_cents: Set(new.amount_cents),
        currency: Set(new.currency),
        status: Set(OrderStatus::Pending),
        version: Set(0),
    })
    .exec_with_returning(db)
    .await?;
    Ok(OrderView {
        id: saved.id,
        status: saved.status,
        customer: saved.customer,
        amount_cents: saved.amount_cents,
        currency: saved.currency,
    })
}

#[idempotent(scope = "shop.orders.pay", key = key, skip(gateway))]
async fn pay(
    db: &DatabaseConnection,
    gateway: &Gateway,
    key: IdempotencyKey,
    order_id: String,
    request: PayRequest,
) -> Result<PaymentView, ApiError> {
    let moved = order::Entity::apply_transition(
        db,
        order_id.clone(),
        transition!(OrderStatus: Pending -> Paid),
    )
    .await?;
    match moved {
        TransitionOutcome::NotFound => Err(ApiError::NotFound(order_id)),
        // Already paid under another key: answer with the payment that exists.
        TransitionOutcome::AlreadyApplied => {
            let existing = payment::Entity::find()
                .filter(payment::Column::OrderId.eq(order_id.as_str()))
                .order_by_asc(payment::Column::Id)
                .one(db)
                .await?
                .ok_or_else(|| ApiError::NotFound(order_id.clone()))?;
            Ok(PaymentView {
                order_id,
                status: OrderStatus::Paid,
                payment_id: existing.id,
            })
        }
        _ => {
            // The gateway deduplicates on a key derived from ours (scope:key:step), so a
            // rolled-back attempt that charged is not charged again on retry.
            let charge_key = format!("shop.orders.pay:{}:charge", key.key());
            let charge_id = gateway.charge(&charge_key, request.amount_cents);
            let saved = payment::Entity::insert(payment::ActiveModel {
                id: Set(format!("pay_{}", uuid::Uuid::new_v4().simple())),
                order_id: Set(order_id.clone()),
                amount_cents: Set(request.amount_cents),
                charge_id: Set(charge_id),
            })
            .exec_with_returning(db)
            .await?;
            // Other services learn of the payment through the outbox: the message commits
            // with the payment or not at all, and the relay publishes it afterwards.
            let paid = OrderPaid {
                order_id: order_id.clone(),
                payment_id: saved.id.clone(),
                amount_cents: saved.amount_cents,
            };
            db.stage(Message::json(ORDER_PAID, &paid)?.aggregate(order_id.clone()))
                .await?;
            Ok(PaymentView {
                order_id,
                status: OrderStatus::Paid,
                payment_id: saved.id,
            })
        }
    }
}

#[idempotent(scope = "shop.orders.cancel", key = key)]
async fn cancel(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    order_id: String,
) -> Result<StatusView, ApiError> {
    let moved = order::Entity::apply_transition(
        db,
        order_id.clone(),
        transition!(OrderStatus: Pending -> Cancelled),
    )
    .await?;
    if moved == TransitionOutcome::NotFound {
        return Err(ApiError::NotFound(order_id));
    }
    Ok(StatusView {
        order_id,
        status: OrderStatus::Cancelled,
    })
}

// ---- HTTP handlers: extract, call, respond ----

async fn create_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Json(new): Json<NewOrder>,
) -> Response {
    respond(StatusCode::CREATED, place_order(&app.db, key, new)).await
}

async fn pay_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Path(id): Path<String>,
    Json(request): Json<PayRequest>,
) -> Response {
    respond(StatusCode::OK, pay(&app.db, &app.gateway, key, id, request)).await
}

async fn cancel_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Path(id): Path<String>,
) -> Response {
    respond(StatusCode::OK, cancel(&app.db, key, id)).await
}

async fn show_order(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let Some(found) = order::Entity::find_by_id(id.clone()).one(&app.db).await? else {
        return Err(ApiError::NotFound(id));
    };
    let payments: Vec<serde_json::Value> = payment::Entity::find()
        .filter(payment::Column::OrderId.eq(id.as_str()))
        .all(&app.db)
        .await?
        .into_iter()
        .map(|p| {
            serde_json::json!({
                "id": p.id, "amount_cents": p.amount_cents, "charge_id": p.charge_id
            })
        })
        .collect();
    Ok(Json(serde_json::json!({
        "id": found.id,
        "status": found.status,
        "customer": found.customer,
        "amount_cents": found.amount_cents,
        "currency": found.currency,
        "payments": payments,
    }))
    .into_response())
}
