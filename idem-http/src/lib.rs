//! The HTTP contract of [`idem`](https://docs.rs/idempotence), once, on the [`http`] crate's
//! types and for any web framework: the `Idempotency-Key` header, problem+json answers for
//! every idem [`Error`](idem_core::Error), the replay marker, `If-Match` and `ETag`, the
//! canonical form of a request the tower layer fingerprints, and running a call to completion
//! when its client hangs up, as the IETF Idempotency-Key draft and RFC 9110 describe them. The
//! axum adapter (`idem::axum`) is a thin layer over it; a service on another framework maps an
//! error to a full response in one call: `Problem::from(&e).to_response()`.
//!
//! | situation | status |
//! |---|---|
//! | missing or invalid `Idempotency-Key` | 400 |
//! | key reused with a different payload | 422 |
//! | same key still in flight | 409 + `Retry-After` |
//! | invalid state transition | 409 |
//! | malformed `If-Match` | 400 |
//! | `If-Match` does not match the resource's current `ETag` | 412, nothing written |
//! | missing `If-Match` where the route requires it | 428 |
//! | store unreachable, a newer deployment's answer, a deadline passed | 503 + `Retry-After` |
//! | store failure | 503 (no SQL in the body) |
//! | replay | the recorded status (or 200, see [`ReplayStatus`]) and body + `Idempotent-Replayed: true` |

#![cfg_attr(docsrs, feature(doc_cfg))]

mod answer;
pub mod canonical;
mod completion;
mod conditional;
pub mod frameworks;
mod key;
mod keyed;
mod precondition;
mod problem;
mod recorded;
pub mod recording;
mod replay;

pub use answer::Answer;
pub use completion::{run_to_completion, spawn_and_wait};
pub use conditional::{ETag, IfMatch};
pub use key::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey, idempotency_key, key_of_fields, parse_key,
};
pub use keyed::{IDEMPOTENCY_KEY_FIELD, Keyed, ViaKeyed, key_of_request};
pub use precondition::{etag_value, if_match, parse_entity_tag, parse_if_match};
pub use problem::Problem;
pub use recorded::{RecordedBody, RecordedResponse, restore_headers};
pub use replay::{JsonAnswer, ReplayStatus, json_answer, mark_replayed};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::header::{CONTENT_TYPE, ETAG, RETRY_AFTER};
    use http::{HeaderMap, HeaderValue, StatusCode};
    use idem_core::{EntityTag, Error, ErrorKind};

    use super::*;

    /// A service on no framework at all answers any idem error in one call.
    #[test]
    fn an_error_is_a_full_response_in_one_call() {
        let in_flight = Error::InFlight {
            scope: "orders.pay".to_owned(),
            retry_after: Duration::from_millis(1500),
        };
        let response = Problem::from(&in_flight).to_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        let body: serde_json::Value = serde_json::from_slice(response.body()).expect("json");
        assert_eq!(body["type"], "urn:idem:problem:in-flight");
        assert_eq!(body["status"], 409);

        let missing = Problem::from(&Error::MissingKey).to_response();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert!(missing.headers().get(RETRY_AFTER).is_none());
        assert_eq!(Error::MissingKey.kind(), ErrorKind::MissingKey);
    }

    #[test]
    fn the_key_header_is_one_valid_key_or_an_error() {
        let mut headers = HeaderMap::new();
        assert_eq!(idempotency_key(&headers).expect("absent"), None);
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("\"k-\\\"1\""));
        assert_eq!(
            idempotency_key(&headers)
                .expect("a key")
                .expect("some")
                .as_str(),
            "k-\"1"
        );
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("k-2"));
        let repeated = idempotency_key(&headers).expect_err("two keys");
        assert_eq!(repeated.kind(), ErrorKind::InvalidKey);
        assert_eq!(Problem::from(&repeated).status, 400);
    }

    #[test]
    fn a_replayed_value_carries_the_marker_and_its_status_policy() {
        let etag = |_: &u32| EntityTag::from_version(7);
        let first = json_answer(
            &5u32,
            StatusCode::CREATED,
            ReplayStatus::Ok,
            false,
            Some(etag),
        );
        assert_eq!(first.status(), StatusCode::CREATED);
        assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(first.headers()[ETAG], "\"7\"");
        assert_eq!(first.body(), b"5");
        let replay = json_answer(&5u32, StatusCode::CREATED, ReplayStatus::Ok, true, None);
        assert_eq!(replay.status(), StatusCode::OK);
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        let original = json_answer(
            &5u32,
            StatusCode::CREATED,
            ReplayStatus::Original,
            true,
            None,
        );
        assert_eq!(original.status(), StatusCode::CREATED);
    }
}
