//! actix-web 4 glue for [`idem`](https://docs.rs/idempotence), over the framework-neutral
//! HTTP contract of `idem-http` (the IETF Idempotency-Key draft): the
//! [`IdempotencyKey`] extractor (400 `missing-key` / `invalid-key`), [`Problem`] as actix's
//! `ResponseError` (every idem error with its status, problem+json and `Retry-After`), and
//! [`respond`] (and [`Respond`], its options: 200 for replays, an `ETag`), which runs a call
//! to completion on a task of its own (a client that hangs up cannot cut it off) and answers
//! its JSON value, marking replays with `Idempotent-Replayed: true`. [`IdempotencyMiddleware`] records whole responses of plain
//! handlers, the twin of `idem::axum::IdempotencyLayer` on the same ledger.
//!
//! Server-rendered forms: [`Keyed`] finds the key in a form's hidden `idempotency_key` field
//! (or a query parameter, or a JSON member) as well as the header, and hands the body on to
//! the extractor it wraps (`Keyed<web::Form<T>>`); [`respond_answer`] answers a call whose
//! value is an [`Answer`] (a `303 See Other` with a flash cookie, a rendered page) with its
//! recorded status and headers.
//!
//! ```no_run
//! use actix_web::{App, HttpResponse, http::StatusCode, web};
//! use idem_actix::{IdempotencyKey, Problem, respond};
//! # #[derive(serde::Serialize)] struct Receipt;
//! # async fn pay_order(key: IdempotencyKey, order: String) -> Result<Receipt, Problem> { Ok(Receipt) }
//!
//! async fn pay(key: IdempotencyKey, id: web::Path<String>) -> HttpResponse {
//!     let id = id.into_inner();
//!     respond(StatusCode::OK, async move { pay_order(key, id).await }).await
//! }
//!
//! let app = App::new().route("/orders/{id}/pay", web::post().to(pay));
//! ```
//!
//! This is an implementation crate of idem: applications use it as `idem::actix` (feature
//! `actix`).

mod middleware;
mod respond;

pub use middleware::{IdempotencyMiddleware, IdempotencyMiddlewareService};
pub use respond::{Respond, respond, respond_answer};

pub use idem_core::EntityTag;
/// The validated `Idempotency-Key` of a request, idem's one key type
/// ([`idem_http::IdempotencyKey`]): as an extractor it rejects a missing key with 400
/// (`missing-key`) and a malformed one with 400 (`invalid-key`); use
/// `Option<IdempotencyKey>` where the key is optional.
pub use idem_http::IdempotencyKey;
/// An RFC 9457 problem, idem's one problem type ([`idem_http::Problem`]): actix's
/// `ResponseError`, so `?` on an idem call in a handler returning `Result<_, Problem>`
/// answers the error's status, `application/problem+json` and `Retry-After` where it applies.
pub use idem_http::Problem;
pub use idem_http::{
    Answer, ETag, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED, IfMatch, Keyed,
    ReplayStatus,
};
