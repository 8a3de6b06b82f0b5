//! Answering an idempotent call's value: its JSON with the first execution's status, replays
//! marked.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use idem_core::{Outcome, with_outcome};
use idem_http::ReplayStatus;
use idem_http::frameworks::actix::to_actix;
use serde::Serialize;

/// Runs an idempotent call to completion on a task of its own and answers it: its JSON value
/// with `status` (the first execution's status for its replays too, with
/// `Idempotent-Replayed: true`), or its error's response. A client that hangs up does not cut
/// the call off: it finishes and records, and the client's retry replays it.
pub async fn respond<T, E, F>(status: StatusCode, call: F) -> HttpResponse
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + Send + 'static,
    E: ResponseError + Send + 'static,
{
    let (answer, outcome) = idem_http::run_to_completion(with_outcome(call)).await;
    match answer {
        Ok(value) => {
            let status =
                http::StatusCode::from_u16(status.as_u16()).unwrap_or(http::StatusCode::OK);
            let replayed = outcome == Some(Outcome::Replayed);
            to_actix(idem_http::json_answer(
                &value,
                status,
                ReplayStatus::Original,
                replayed,
                None,
            ))
        }
        Err(e) => e.error_response(),
    }
}
