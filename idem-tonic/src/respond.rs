//! Running a call to completion and answering it, replays marked.

use idem_core::{Outcome, with_outcome};
use tonic::metadata::MetadataValue;

use crate::key::IDEMPOTENT_REPLAYED;
use crate::status::IntoStatus;

/// Runs an idempotent call to completion on a task of its own and answers it: its value as
/// the method's response (with `idempotent-replayed: true` when it was a replay), or its
/// error as a status ([`IntoStatus`]). A client that cancels or hangs up does not cut the
/// call off: it finishes and records, and the client's retry replays it.
///
/// ```no_run
/// # struct PayRequest; struct PayReply;
/// # async fn pay_once(key: idem_tonic::IdempotencyKey, r: PayRequest) -> Result<PayReply, idem_core::Error> { Ok(PayReply) }
/// async fn pay(request: tonic::Request<PayRequest>) -> Result<tonic::Response<PayReply>, tonic::Status> {
///     let key = idem_tonic::idempotency_key(&request)?;
///     idem_tonic::respond(pay_once(key, request.into_inner())).await
/// }
/// ```
pub async fn respond<T, E, F>(call: F) -> Result<tonic::Response<T>, tonic::Status>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: IntoStatus + Send + 'static,
{
    let (answer, outcome) = idem_http::run_to_completion(with_outcome(call)).await;
    let mut response = tonic::Response::new(answer.map_err(IntoStatus::into_status)?);
    if outcome == Some(Outcome::Replayed) {
        response
            .metadata_mut()
            .insert(IDEMPOTENT_REPLAYED, MetadataValue::from_static("true"));
    }
    Ok(response)
}
