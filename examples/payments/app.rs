//! The payments service: routes, handlers and the idempotent domain functions. Shared by
//! `main.rs` and the HTTP tests (`tests/http.rs` includes this file, `../shop/model.rs` and
//! `../shop/service.rs`). `actix_app.rs` serves the same routes on actix-web over the same
//! domain functions; `tests/http.rs` runs the service's contract through both.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::axum::{
    ETag, EntityTag, IdempotencyKey, IdempotencyLayer, IfMatch, Problem, Respond, respond,
    run_to_completion,
};
use idem::completer::{GaveUp, Resumed};
use idem::outbox::Message;
use idem::sea_orm::{Completer, ConditionalUpdate, Outbox, SeaOrmLeaseStore, Stateful};
use idem::{TransitionOutcome, idempotent, transition};
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, ConnectionTrait, DatabaseConnection, QueryOrder};
use serde::{Deserialize, Serialize};

pub(crate) use super::model::{OrderStatus, create_tables, order, payment};
pub(crate) use super::service::ApiError;

/// The payment gateway: the `gateway` example over HTTP (`Gateway::http`, with `GATEWAY_URL`),
/// or an in-process simulation (`Gateway::default()`). Both deduplicate on the idempotency
/// key, as Stripe does: a key seen before returns the charge it created then.
#[derive(Debug, Default, Clone)]
pub(crate) struct Gateway {
    simulated: Arc<Mutex<HashMap<String, String>>>,
    http: Option<(reqwest::Client, String)>,
    /// How long each answer is held after the charge is made (zero: answered at once).
    answer_delay: Duration,
}

/// What the gateway answers (the fields payments reads).
#[derive(Debug, Deserialize)]
struct GatewayCharge {
    charge_id: String,
}

impl Gateway {
    /// The gateway service at `base_url` (e.g. `http://127.0.0.1:3100`).
    pub(crate) fn http(base_url: &str) -> Self {
        Self {
            simulated: Arc::default(),
            http: Some((
                reqwest::Client::new(),
                base_url.trim_end_matches('/').to_owned(),
            )),
            answer_delay: Duration::ZERO,
        }
    }

    /// This gateway (its charges shared), holding each answer `delay` after making the charge,
    /// as a slow acquirer does: a caller that dies meanwhile was charged without learning it.
    #[allow(dead_code)] // used by tests/http.rs, which includes this file
    pub(crate) fn answering_after(&self, delay: Duration) -> Self {
        Self {
            answer_delay: delay,
            ..self.clone()
        }
    }

    /// Charges `amount_cents` for `reference` once per `idempotency_key`.
    pub(crate) async fn charge(
        &self,
        idempotency_key: String,
        reference: &str,
        amount_cents: i64,
    ) -> Result<String, ApiError> {
        let charged = self
            .charge_now(idempotency_key, reference, amount_cents)
            .await;
        if !self.answer_delay.is_zero() {
            tokio::time::sleep(self.answer_delay).await;
        }
        charged
    }

    async fn charge_now(
        &self,
        idempotency_key: String,
        reference: &str,
        amount_cents: i64,
    ) -> Result<String, ApiError> {
        let Some((client, base)) = &self.http else {
            let mut charges = self
                .simulated
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = charges.len() + 1;
            return Ok(charges
                .entry(idempotency_key)
                .or_insert_with(|| format!("ch_{next:06}_{amount_cents}"))
                .clone());
        };
        let response = client
            .post(format!("{base}/charges"))
            .header(idem::axum::IDEMPOTENCY_KEY, idempotency_key)
            .json(&serde_json::json!({ "amount_cents": amount_cents, "reference": reference }))
            .send()
            .await
            .map_err(|e| ApiError::Gateway(e.to_string()))?;
        if !response.status().is_success() {
            return Err(ApiError::Gateway(format!(
                "the gateway answered {}",
                response.status()
            )));
        }
        let charge: GatewayCharge = response
            .json()
            .await
            .map_err(|e| ApiError::Gateway(e.to_string()))?;
        Ok(charge.charge_id)
    }

    /// How many distinct charges the simulated gateway made.
    #[allow(dead_code)] // read by tests/http.rs, which includes this file
    pub(crate) fn charges(&self) -> usize {
        self.simulated
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
        .route("/orders/{id}", get(show_order).patch(change_order))
        .route("/orders/{id}/pay", post(pay_order))
        .route("/orders/{id}/cancel", post(cancel_order))
        // A plain axum handler made idempotent by the layer: its whole response is recorded
        // on the same ledger (lease mode) and replayed to a retry with the same key.
        .route(
            "/orders/{id}/refund",
            post(refund_order).route_layer(IdempotencyLayer::new(
                SeaOrmLeaseStore::new(state.db.clone()),
                "shop.orders.refund",
            )),
        )
        .with_state(state)
}

/// `GET /metrics`: idem's call counters and latency histogram (and anything else recorded
/// through the `metrics` facade) in the Prometheus text format, rendered by `handle`.
pub(crate) fn metrics_routes(handle: metrics_exporter_prometheus::PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || async move {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                handle.render(),
            )
        }),
    )
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
    /// `#[serde(default)]` on the fields added later: answers recorded before them replay.
    #[serde(default)]
    pub(crate) note: Option<String>,
    /// The row's version when this answer was made; its `ETag` is made from it.
    #[serde(default)]
    pub(crate) version: i64,
}

impl OrderView {
    /// The `ETag` of the order as this view shows it.
    pub(crate) fn etag(&self) -> EntityTag {
        EntityTag::from_version(self.version)
    }
}

impl From<order::Model> for OrderView {
    fn from(row: order::Model) -> Self {
        Self {
            id: row.id,
            status: row.status,
            customer: row.customer,
            amount_cents: row.amount_cents,
            currency: row.currency,
            note: row.note,
            version: row.version,
        }
    }
}

/// The body of `PATCH /orders/{id}`: the new note (`null` removes it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChangeNote {
    pub(crate) note: Option<String>,
}

/// The longest note an order keeps, in characters.
pub(crate) const MAX_NOTE_CHARS: usize = 500;

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

/// How long this service keeps its calls' answers: set once at start from configuration
/// (`RECORD_TTL_SECS`, see `main.rs`), 24 hours when it is not. Every `#[idempotent]` below reads it
/// (`ttl = record_ttl()`), and the purge deletes what it has outlived.
pub(crate) static RECORD_TTL: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// The records' TTL ([`RECORD_TTL`]).
pub(crate) fn record_ttl() -> Duration {
    RECORD_TTL
        .get()
        .copied()
        .unwrap_or(Duration::from_secs(24 * 3600))
}

#[idempotent(scope = "shop.orders.create", key = key, ttl = record_ttl())]
pub(crate) async fn place_order(
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
        note: Set(None),
    })
    .exec_with_returning(db)
    .await?;
    Ok(OrderView::from(saved))
}

/// Changes an order's note, if the order is still at a version the client has seen
/// (`if_match`, from its `If-Match` header). The version is compared in the UPDATE itself, so
/// a concurrent writer cannot slip in between: a stale `If-Match` is a 412 and nothing is
/// written. `if_match` is fingerprinted with the rest of the request, so a retry of a change
/// that succeeded replays its answer even though the version has moved on since.
#[idempotent(scope = "shop.orders.change-note", key = key, ttl = record_ttl())]
pub(crate) async fn change_note(
    db: &DatabaseConnection,
    key: IdempotencyKey,
    order_id: String,
    if_match: IfMatch,
    change: ChangeNote,
) -> Result<OrderView, ApiError> {
    let set_note = order::Entity::update_many().col_expr(
        order::Column::Note,
        sea_orm::sea_query::Expr::value(change.note),
    );
    let written = order::Entity::update_if_match(db, order_id.clone(), &if_match, set_note).await?;
    if written == ConditionalUpdate::NotFound {
        return Err(ApiError::NotFound(order_id));
    }
    let Some(changed) = order::Entity::find_by_id(order_id.clone()).one(db).await? else {
        return Err(ApiError::NotFound(order_id));
    };
    Ok(OrderView::from(changed))
}

/// Pays an order in lease mode: the claim commits first, the charge at the gateway is a
/// recorded step (no database transaction is open while the gateway is called), and the final
/// phase moves the order `Pending -> Paid`, writes the payment and stages `shop.orders.paid` in
/// one transaction that also checks the lease. A retry after a crash resumes after the charge;
/// a duplicate that arrives while the first call holds the lease waits for its answer (up to
/// 10 s), so concurrent retries all get the same 200.
///
/// `resumable`: `key`, `order_id` and `request` are stored with the claim, so when the process
/// dies mid-pay and the client never comes back, a [`completer`] finishes the call once the
/// lease has ended (the gateway is not stored: the completer passes its own).
#[idempotent(
    scope = "shop.orders.pay",
    key = key,
    ttl = record_ttl(),
    lease = "30s",
    on_concurrent = wait("10s"),
    resumable,
    skip(gateway)
)]
pub(crate) async fn pay(
    db: &DatabaseConnection,
    gateway: &Gateway,
    key: IdempotencyKey,
    order_id: String,
    request: PayRequest,
) -> Result<PaymentView, ApiError> {
    let Some(found) = order::Entity::find_by_id(order_id.clone()).one(db).await? else {
        return Err(ApiError::NotFound(order_id));
    };
    match found.status {
        OrderStatus::Pending => {}
        // Paid already (under another key): answer with the payment that exists.
        OrderStatus::Paid | OrderStatus::Shipped | OrderStatus::Refunded => {
            return existing_payment(db, order_id).await;
        }
        from => {
            return Err(idem::Error::InvalidTransition {
                from: format!("{from:?}"),
                to: "Paid".to_owned(),
            }
            .into());
        }
    }
    // One charge per order, whichever key the client retries with: the gateway's key is
    // derived from the order, not from this request's key.
    let charge_key = idem::lease::derived_key("shop.orders.pay", "", &order_id, "charge");
    let charge_id: String = idem::step("charge", |_step_key| {
        gateway.charge(charge_key, &order_id, request.amount_cents)
    })
    .await?;
    let amount_cents = request.amount_cents;
    // The last work: `finish` records the answer in this transaction too.
    idem::sea_orm::finish(db, "record-payment", move |tx| {
        Box::pin(async move {
            let moved = order::Entity::apply_transition(
                tx,
                order_id.clone(),
                transition!(OrderStatus: Pending -> Paid),
            )
            .await?;
            match moved {
                TransitionOutcome::NotFound => return Err(ApiError::NotFound(order_id)),
                // Another key paid it meanwhile, with the same (order-derived) charge.
                TransitionOutcome::AlreadyApplied => return existing_payment(tx, order_id).await,
                _ => {}
            }
            let saved = payment::Entity::insert(payment::ActiveModel {
                id: Set(format!("pay_{}", uuid::Uuid::new_v4().simple())),
                order_id: Set(order_id.clone()),
                amount_cents: Set(amount_cents),
                charge_id: Set(charge_id),
            })
            .exec_with_returning(tx)
            .await?;
            // Other services learn of the payment through the outbox: the message commits
            // with the payment or not at all, and the relay publishes it afterwards.
            let paid = OrderPaid {
                order_id: order_id.clone(),
                payment_id: saved.id.clone(),
                amount_cents: saved.amount_cents,
            };
            tx.stage(Message::json(ORDER_PAID, &paid)?.aggregate(order_id.clone()))
                .await?;
            Ok(PaymentView {
                order_id,
                status: OrderStatus::Paid,
                payment_id: saved.id,
            })
        })
    })
    .await
}

/// The scope of [`pay`], which the completer resumes.
pub(crate) const PAY_SCOPE: &str = "shop.orders.pay";

/// The completer of this service: finishes pays whose process died (or whose call failed
/// transiently) after their lease ended, with no client involved, by calling [`pay`] again
/// with the stored arguments and this service's database and gateway. The charge step replays
/// if it was recorded, and the gateway deduplicates it if it was not (the charge's key is
/// derived from the order), so a resumed pay never charges twice. After 5 attempts it gives up.
pub(crate) fn completer(state: &AppState) -> Completer {
    let AppState { db, gateway } = state.clone();
    Completer::new(SeaOrmLeaseStore::new(db.clone()))
        .resume(
            PAY_SCOPE,
            move |call: Resumed<(IdempotencyKey, String, PayRequest)>| {
                let (db, gateway) = (db.clone(), gateway.clone());
                async move {
                    let (key, order_id, request) = call.args;
                    pay(&db, &gateway, key, order_id, request).await
                }
            },
        )
        .on_give_up(|gave_up: GaveUp| async move {
            log_given_up_pay(&gave_up);
            Ok::<_, idem::Error>(())
        })
}

/// What a given-up pay owes: the charge, if it was made, for someone to refund. Refunding is
/// the application's business (which gateway call, which policy, whether to tell the customer),
/// not the example's: a real hook would send the refund with `gave_up.idempotency_key()`, so
/// that the hook running twice (it runs at least once) refunds once. Here it is logged, and
/// the order stays `Pending`: retries of the pay's key answer 500 `gave-up`.
fn log_given_up_pay(gave_up: &GaveUp) {
    let order_id = gave_up
        .args::<(IdempotencyKey, String, PayRequest)>()
        .map(|(_, order_id, _)| order_id)
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let (attempts, reason) = (gave_up.attempts, gave_up.reason.as_str());
    match gave_up.step::<String>("charge") {
        Ok(Some(charge_id)) => tracing::error!(
            %order_id, %charge_id, attempts, reason,
            "pay given up after the gateway charged: refund the charge"
        ),
        Ok(None) => tracing::error!(
            %order_id, attempts, reason,
            "pay given up before any recorded charge: check the gateway for a charge of the order"
        ),
        // Not a reason to run the hook again: the record will not decode better next time.
        Err(e) => tracing::error!(
            %order_id, attempts, reason, error = %e,
            "pay given up; its recorded charge does not decode: check the gateway"
        ),
    }
}

/// The payment an already-paid order has.
async fn existing_payment<C: ConnectionTrait>(
    db: &C,
    order_id: String,
) -> Result<PaymentView, ApiError> {
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

#[idempotent(scope = "shop.orders.cancel", key = key, ttl = record_ttl())]
pub(crate) async fn cancel(
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

/// A JSON body whose rejection (malformed JSON, wrong content type, missing fields) is a
/// problem+json 400 like every other error of the service.
pub(crate) struct Body<T>(pub(crate) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Body<T> {
    type Rejection = Response;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Response> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(Problem::new(
                rejection.status().as_u16(),
                "invalid-body",
                "Invalid request body",
                rejection.body_text(),
            )
            .into_response()),
        }
    }
}

/// A shop refuses amounts it cannot charge: 422 before any work.
pub(crate) fn positive(amount_cents: i64) -> Result<(), Problem> {
    if amount_cents > 0 {
        return Ok(());
    }
    Err(Problem::new(
        422,
        "invalid-amount",
        "Invalid amount",
        format!("`amount_cents` must be positive, not {amount_cents}"),
    ))
}

// Every handler that reaches the database runs its work through `respond` or
// `run_to_completion`: on a task of its own, with owned state, so a client that hangs up
// cannot cut a statement off mid-flight (and poison a pooled connection) or leave a pay's
// lease claimed; the call finishes, and the client's retry replays its answer.

async fn create_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Body(new): Body<NewOrder>,
) -> Response {
    if let Err(refused) = positive(new.amount_cents) {
        return refused.into_response();
    }
    respond(StatusCode::CREATED, async move {
        place_order(&app.db, key, new).await
    })
    .await
}

async fn pay_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Path(id): Path<String>,
    Body(request): Body<PayRequest>,
) -> Response {
    if let Err(refused) = positive(request.amount_cents) {
        return refused.into_response();
    }
    respond(StatusCode::OK, async move {
        pay(&app.db, &app.gateway, key, id, request).await
    })
    .await
}

async fn cancel_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    Path(id): Path<String>,
) -> Response {
    respond(
        StatusCode::OK,
        async move { cancel(&app.db, key, id).await },
    )
    .await
}

/// A note longer than [`MAX_NOTE_CHARS`] is refused: 422 before any work.
pub(crate) fn short_enough(change: &ChangeNote) -> Result<(), Problem> {
    match &change.note {
        Some(note) if note.chars().count() > MAX_NOTE_CHARS => Err(Problem::new(
            422,
            "invalid-note",
            "Invalid note",
            format!("a note has at most {MAX_NOTE_CHARS} characters"),
        )),
        _ => Ok(()),
    }
}

async fn change_order(
    State(app): State<AppState>,
    key: IdempotencyKey,
    if_match: IfMatch,
    Path(id): Path<String>,
    Body(change): Body<ChangeNote>,
) -> Response {
    if let Err(refused) = short_enough(&change) {
        return refused.into_response();
    }
    // The answer carries the order's new `ETag`, so the client can chain its next change.
    Respond::new(StatusCode::OK)
        .etag(OrderView::etag)
        .run(async move { change_note(&app.db, key, id, if_match, change).await })
        .await
}

/// What a refund answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RefundView {
    pub(crate) order_id: String,
    pub(crate) status: OrderStatus,
    pub(crate) refund_id: String,
}

/// `POST /orders/{id}/refund`: a plain handler, no `#[idempotent]` and no key in sight; the
/// route's `IdempotencyLayer` requires the `Idempotency-Key`, records the 200 (or the 404 or
/// 409) and replays it. A refund moves the order `Paid -> Refunded`.
async fn refund_order(
    State(app): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<RefundView>), ApiError> {
    Ok((StatusCode::OK, Json(refund(&app.db, id).await?)))
}

/// Moves the order `Paid -> Refunded` (no key: the route's layer or middleware guards it).
pub(crate) async fn refund(db: &DatabaseConnection, id: String) -> Result<RefundView, ApiError> {
    let moved =
        order::Entity::apply_transition(db, id.clone(), transition!(OrderStatus: Paid -> Refunded))
            .await?;
    if moved == TransitionOutcome::NotFound {
        return Err(ApiError::NotFound(id));
    }
    Ok(RefundView {
        order_id: id,
        status: OrderStatus::Refunded,
        // Differs between executions: a replay is told from a second refund.
        refund_id: format!("re_{}", uuid::Uuid::new_v4().simple()),
    })
}

/// The order with its payments, and its `ETag` (the row's version) for conditional writes.
async fn show_order(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    run_to_completion(async move {
        match order_with_payments(&app.db, id).await {
            Ok((tag, order)) => (ETag(tag), Json(order)).into_response(),
            Err(e) => e.into_response(),
        }
    })
    .await
}

/// An order and its payments, as `GET /orders/{id}` shows them, and its `ETag`.
pub(crate) async fn order_with_payments(
    db: &DatabaseConnection,
    id: String,
) -> Result<(EntityTag, serde_json::Value), ApiError> {
    let Some(found) = order::Entity::find_by_id(id.clone()).one(db).await? else {
        return Err(ApiError::NotFound(id));
    };
    let payments: Vec<serde_json::Value> = payment::Entity::find()
        .filter(payment::Column::OrderId.eq(id.as_str()))
        .all(db)
        .await?
        .into_iter()
        .map(|p| {
            serde_json::json!({
                "id": p.id, "amount_cents": p.amount_cents, "charge_id": p.charge_id
            })
        })
        .collect();
    Ok((
        EntityTag::from_version(found.version),
        serde_json::json!({
            "id": found.id,
            "status": found.status,
            "customer": found.customer,
            "amount_cents": found.amount_cents,
            "currency": found.currency,
            "note": found.note,
            "payments": payments,
        }),
    ))
}
