//! Answering an idempotent call's value: its JSON with the first execution's status (or 200
//! for replays), an optional `ETag`, replays marked; or an [`Answer`] as it was recorded.

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use idem_core::{EntityTag, Outcome, with_outcome};
use idem_http::frameworks::actix::to_actix;
use idem_http::{Answer, JsonAnswer, ReplayStatus};
use serde::Serialize;

/// Runs an idempotent call to completion on a task of its own and answers it: its JSON value
/// with `status` (the first execution's status for its replays too, with
/// `Idempotent-Replayed: true`), or its error's response (marked too when it is a recorded
/// final error replayed). A client that hangs up does not cut the call off: it finishes and
/// records, and the client's retry replays it.
///
/// Shorthand for `Respond::new(status).run(call)`; see [`Respond`] for replays answered with
/// 200 and for an `ETag` taken from the value.
pub async fn respond<T, E, F>(status: StatusCode, call: F) -> HttpResponse
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + Send + 'static,
    E: ResponseError + Send + 'static,
{
    Respond::<T>::new(status).run(call).await
}

/// Runs an idempotent call whose value is an [`Answer`] (a `303 See Other` with its
/// `Location`, a rendered page, a flash cookie) to completion on a task of its own, as
/// [`respond`] does, and answers it as it was recorded: its status, headers and body, with
/// `Idempotent-Replayed: true` on a replay. `Err(e)` is `e`'s response, marked on a replay of
/// a recorded final error too.
///
/// ```text
/// async fn publish(pool: web::Data<PgPool>, Keyed(key, form): Keyed<web::Form<PublishForm>>) -> HttpResponse {
///     let (pool, form) = (pool.get_ref().clone(), form.into_inner());
///     // publish_issue returns Ok(Answer::see_other("/admin/newsletters").set_cookie(flash))
///     respond_answer(async move { publish_issue(&pool, key, form).await }).await
/// }
/// ```
pub async fn respond_answer<E, F>(call: F) -> HttpResponse
where
    F: Future<Output = Result<Answer, E>> + Send + 'static,
    E: ResponseError + Send + 'static,
{
    let (answer, outcome) = idem_http::run_to_completion(with_outcome(call)).await;
    let replayed = outcome == Some(Outcome::Replayed);
    match answer {
        Ok(answer) => to_actix(answer.to_response(replayed)),
        Err(e) => error_response(&e, replayed),
    }
}

/// An error's own response, marked `Idempotent-Replayed: true` when it is a recorded final
/// error replayed.
fn error_response(e: &impl ResponseError, replayed: bool) -> HttpResponse {
    let mut response = e.error_response();
    if replayed {
        response.headers_mut().insert(
            HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        );
    }
    response
}

/// How to answer an idempotent call on actix-web: [`respond`] with options, the twin of
/// `idem::axum::Respond`.
///
/// ```
/// use actix_web::http::StatusCode;
/// use idem_actix::{ReplayStatus, Respond};
///
/// // 201 for the first execution, 200 for its replays.
/// let created = Respond::<String>::new(StatusCode::CREATED).replay_status(ReplayStatus::Ok);
/// # let _ = created;
/// ```
///
/// In a handler:
/// `Respond::new(StatusCode::OK).etag(OrderView::etag).run(async move { change_note(&db, key, id, if_match, change).await }).await`
/// answers the order's view with its `ETag`, on its replays too.
#[must_use = "a `Respond` does nothing until `.run(call)` is awaited"]
pub struct Respond<T>(JsonAnswer<T>);

impl<T> Clone for Respond<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Respond<T> {}

impl<T> std::fmt::Debug for Respond<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Respond").field(&self.0).finish()
    }
}

impl<T: Serialize> Respond<T> {
    /// Answers a value with `status` (and a replayed value with the same status, unless
    /// [`replay_status`](Self::replay_status) says otherwise). A status actix-web knows but
    /// the `http` crate does not cannot exist (both accept 100–999), so none is lost.
    pub fn new(status: StatusCode) -> Self {
        let status = http::StatusCode::from_u16(status.as_u16()).unwrap_or(http::StatusCode::OK);
        Self(JsonAnswer::new(status))
    }

    /// Chooses the status of replayed values.
    pub const fn replay_status(self, policy: ReplayStatus) -> Self {
        Self(self.0.replay_status(policy))
    }

    /// Sends `ETag: <etag(&value)>` with every value, first execution and replay alike (a
    /// replay's tag is the one the first answer had, taken from the recorded value).
    pub const fn etag(self, etag: fn(&T) -> EntityTag) -> Self {
        Self(self.0.etag(etag))
    }

    /// Runs the idempotent call to completion on a task of its own and answers it: the value
    /// as JSON, an error as its own response, a replay with `Idempotent-Replayed: true`. A
    /// client that hangs up stops only the wait, never the call.
    pub async fn run<E, F>(self, call: F) -> HttpResponse
    where
        F: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: ResponseError + Send + 'static,
    {
        let (answer, outcome) = idem_http::run_to_completion(with_outcome(call)).await;
        let replayed = outcome == Some(Outcome::Replayed);
        match answer {
            Ok(value) => to_actix(self.0.answer(&value, replayed)),
            Err(e) => error_response(&e, replayed),
        }
    }
}
