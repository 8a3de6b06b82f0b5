//! The payments service's routes on actix-web 4: the twin of [`super::app::router`], over the
//! same `#[idempotent]` domain functions (same paths, JSON, statuses, `If-Match` and `ETag`).
//! One function taking idem's `IdempotencyKey` serves both frameworks: only the handlers
//! differ. `cargo run --example payments` serves the axum routes; `tests/http.rs` includes
//! this file and runs every case of the service's contract through both.
//!
//! ```text
//! let routes = actix_app::routes(state);       // built once: the refunds' middleware is shared
//! HttpServer::new(move || App::new().configure(routes.clone())).bind(addr)?.run().await
//! ```

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError, web};
use idem::actix::{
    ETag, IdempotencyKey, IdempotencyMiddleware, IfMatch, Problem, Respond, respond,
};
use idem::sea_orm::SeaOrmLeaseStore;

use super::app::{
    AppState, ChangeNote, NewOrder, OrderView, PayRequest, cancel, change_note,
    order_with_payments, pay, place_order, positive, refund, short_enough,
};
use super::service::ApiError;

/// The service's errors answer as problem+json on actix-web too (the same [`Problem`] as
/// axum's `IntoResponse` in `shop/service.rs`).
impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.problem().status_code()
    }

    fn error_response(&self) -> HttpResponse {
        self.problem().error_response()
    }
}

/// The routes, for `App::configure`: built once, outside `HttpServer::new`'s factory, so
/// every worker shares the refund middleware's memory of recent answers.
pub(crate) fn routes(state: AppState) -> impl Fn(&mut web::ServiceConfig) + Clone + Send + 'static {
    // A plain handler made idempotent by the middleware, on the same ledger and scope as the
    // axum route's `IdempotencyLayer`.
    let refunds = IdempotencyMiddleware::new(
        SeaOrmLeaseStore::new(state.db.clone()),
        "shop.orders.refund",
    );
    let state = web::Data::new(state);
    move |config| {
        config
            .app_data(state.clone())
            .app_data(body_config())
            .route("/healthz", web::get().to(|| async { "ok" }))
            .route("/orders", web::post().to(create_order))
            .service(
                web::resource("/orders/{id}")
                    .route(web::get().to(show_order))
                    .route(web::patch().to(change_order)),
            )
            .route("/orders/{id}/pay", web::post().to(pay_order))
            .route("/orders/{id}/cancel", web::post().to(cancel_order))
            .service(
                web::resource("/orders/{id}/refund")
                    .wrap(refunds.clone())
                    .route(web::post().to(refund_order)),
            );
    }
}

/// A JSON body whose rejection (malformed JSON, wrong content type, missing fields) is a
/// problem+json answer like every other error of the service, with actix-web's status for it
/// (400, 413, 415 or 422), as `app::Body` does on axum.
fn body_config() -> web::JsonConfig {
    web::JsonConfig::default().error_handler(|rejection, _| {
        let status = rejection.status_code().as_u16();
        let detail = rejection.to_string();
        Problem::new(status, "invalid-body", "Invalid request body", detail).into()
    })
}

// Every handler that reaches the database runs its work through `respond` (or
// `run_to_completion`): on a task of its own, with owned state, as the axum handlers do.

async fn create_order(
    app: web::Data<AppState>,
    key: IdempotencyKey,
    new: web::Json<NewOrder>,
) -> HttpResponse {
    let new = new.into_inner();
    if let Err(refused) = positive(new.amount_cents) {
        return refused.error_response();
    }
    let db = app.db.clone();
    respond(StatusCode::CREATED, async move {
        place_order(&db, key, new).await
    })
    .await
}

async fn pay_order(
    app: web::Data<AppState>,
    key: IdempotencyKey,
    id: web::Path<String>,
    request: web::Json<PayRequest>,
) -> HttpResponse {
    let request = request.into_inner();
    if let Err(refused) = positive(request.amount_cents) {
        return refused.error_response();
    }
    let (app, id) = (app.get_ref().clone(), id.into_inner());
    respond(StatusCode::OK, async move {
        pay(&app.db, &app.gateway, key, id, request).await
    })
    .await
}

async fn cancel_order(
    app: web::Data<AppState>,
    key: IdempotencyKey,
    id: web::Path<String>,
) -> HttpResponse {
    let (db, id) = (app.db.clone(), id.into_inner());
    respond(StatusCode::OK, async move { cancel(&db, key, id).await }).await
}

async fn change_order(
    app: web::Data<AppState>,
    key: IdempotencyKey,
    if_match: IfMatch,
    id: web::Path<String>,
    change: web::Json<ChangeNote>,
) -> HttpResponse {
    let change = change.into_inner();
    if let Err(refused) = short_enough(&change) {
        return refused.error_response();
    }
    let (db, id) = (app.db.clone(), id.into_inner());
    // The answer carries the order's new `ETag`, so the client can chain its next change; a
    // replay carries the recorded answer's.
    Respond::new(StatusCode::OK)
        .etag(OrderView::etag)
        .run(async move { change_note(&db, key, id, if_match, change).await })
        .await
}

/// `POST /orders/{id}/refund`: a plain handler; the resource's `IdempotencyMiddleware`
/// requires the key, records the answer and replays it.
async fn refund_order(app: web::Data<AppState>, id: web::Path<String>) -> HttpResponse {
    match refund(&app.db, id.into_inner()).await {
        Ok(refunded) => HttpResponse::Ok().json(refunded),
        Err(e) => e.error_response(),
    }
}

/// The order with its payments, and its `ETag` (the row's version) for conditional writes.
async fn show_order(app: web::Data<AppState>, id: web::Path<String>) -> HttpResponse {
    let (db, id) = (app.db.clone(), id.into_inner());
    match idem::http::run_to_completion(async move { order_with_payments(&db, id).await }).await {
        Ok((tag, order)) => HttpResponse::Ok().insert_header(ETag(tag)).json(order),
        Err(e) => e.error_response(),
    }
}
