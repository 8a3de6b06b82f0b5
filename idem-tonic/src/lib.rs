//! tonic (gRPC) glue for [`idem`](https://docs.rs/idempotence): the contract of the IETF
//! Idempotency-Key draft, mapped onto gRPC. The key travels as request metadata
//! (`idempotency-key`); [`idempotency_key`] reads and validates it (as idem's one
//! [`IdempotencyKey`] type, shared with the HTTP front doors); [`status`] answers
//! every idem error with its gRPC code; [`respond`] runs a call to completion on a task of
//! its own (a client that cancels cannot cut it off) and marks replays with
//! `idempotent-replayed: true`; [`IdempotencyLayer`] records whole unary calls for methods
//! that are not written over `#[idempotent]` functions.
//!
//! | situation | gRPC status | `idem-problem` |
//! |---|---|---|
//! | missing or invalid `idempotency-key` | `INVALID_ARGUMENT` | `missing-key`, `invalid-key` |
//! | key reused with another message | `FAILED_PRECONDITION` | `key-reused` |
//! | same key still in flight | `ABORTED` + `retry-after`, `grpc-retry-pushback-ms` | `in-flight` |
//! | the database kept aborting the call for conflicts | `ABORTED` + retry delay | `conflict` |
//! | a resumable call given up by its completer | `ABORTED` | `gave-up` |
//! | invalid state transition | `FAILED_PRECONDITION` | `invalid-transition` |
//! | store unreachable, a newer deployment's answer, a deadline passed | `UNAVAILABLE` + retry delay | `unavailable`, `answer-too-new`, `deadline-exceeded` |
//! | store failure | `UNAVAILABLE` (no SQL in the message) | `store` |
//! | arguments too large to store for resuming | `RESOURCE_EXHAUSTED` | `arguments-too-large` |
//! | the recorded answer can no longer be read | `DATA_LOSS` (do not retry under a new key) | `answer-unreadable` |
//! | replay | the recorded answer + `idempotent-replayed: true` | |
//!
//! `FAILED_PRECONDITION` and `INVALID_ARGUMENT` tell a client to change its request (a new
//! key, a fresh read); `ABORTED` and `UNAVAILABLE` to send the same request again, with the
//! same key, after the delay: list them in a gRPC retry policy.
//!
//! tonic's service traits are `#[tonic::async_trait]`, which runs before `#[idempotent]`
//! could: put `#[idempotent]` on an inherent `async fn` of the service and call it from the
//! trait method.
//!
//! ```no_run
//! use idem_tonic::{IdempotencyKey, idempotency_key, respond};
//! use tonic::{Request, Response, Status};
//! # struct PayRequest; struct PayReply; struct Payments;
//! # impl Payments { async fn pay_once(&self, key: IdempotencyKey, r: PayRequest) -> Result<PayReply, idem_core::Error> { Ok(PayReply) } }
//!
//! // inside `#[tonic::async_trait] impl payments_server::Payments for Payments`:
//! async fn pay(this: std::sync::Arc<Payments>, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
//!     let key = idempotency_key(&request)?;
//!     respond(async move { this.pay_once(key, request.into_inner()).await }).await
//! }
//! ```
//!
//! This is an implementation crate of idem: applications use it as `idem::tonic` (feature
//! `tonic`).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod key;
mod layer;
mod respond;
mod status;

pub use key::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey, idempotency_key, key_of_metadata,
    optional_idempotency_key,
};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use respond::respond;
pub use status::{GRPC_RETRY_PUSHBACK_MS, IDEM_PROBLEM, IntoStatus, RETRY_AFTER, code, status};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::Error;
    use tonic::Code;

    use super::*;

    #[test]
    fn an_error_in_flight_is_aborted_with_its_retry_delay() {
        let in_flight = Error::InFlight {
            scope: "orders.pay".to_owned(),
            retry_after: Duration::from_millis(1500),
        };
        let answer = status(&in_flight);
        assert_eq!(answer.code(), Code::Aborted);
        let metadata = answer.metadata();
        assert_eq!(metadata.get(IDEM_PROBLEM).expect("kind"), "in-flight");
        assert_eq!(metadata.get(RETRY_AFTER).expect("seconds"), "2");
        assert_eq!(metadata.get(GRPC_RETRY_PUSHBACK_MS).expect("ms"), "1500");

        let missing = status(&Error::MissingKey);
        assert_eq!(missing.code(), Code::InvalidArgument);
        assert!(missing.metadata().get(RETRY_AFTER).is_none());
    }

    #[test]
    fn the_key_is_one_valid_metadata_value() {
        let mut request = tonic::Request::new(());
        let missing = idempotency_key(&request).expect_err("no key");
        assert_eq!(missing.code(), Code::InvalidArgument);
        assert!(
            optional_idempotency_key(&request)
                .expect("absent")
                .is_none()
        );
        let metadata = request.metadata_mut();
        metadata.insert(IDEMPOTENCY_KEY, "\"k-1\"".parse().expect("ascii"));
        assert_eq!(idempotency_key(&request).expect("a key").0.as_str(), "k-1");
        let metadata = request.metadata_mut();
        metadata.append(IDEMPOTENCY_KEY, "k-2".parse().expect("ascii"));
        let repeated = idempotency_key(&request).expect_err("two keys");
        assert_eq!(repeated.code(), Code::InvalidArgument);
        assert_eq!(
            repeated.metadata().get(IDEM_PROBLEM).expect("kind"),
            "invalid-key"
        );
    }
}
