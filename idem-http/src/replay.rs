//! Answering a value, first execution or replay: JSON with its status, the replay marker, an
//! `ETag`.

use http::header::{CONTENT_TYPE, ETAG};
use http::{HeaderMap, HeaderValue, StatusCode};
use idem_core::{EntityTag, Error};
use serde::Serialize;

use crate::key::IDEMPOTENT_REPLAYED;
use crate::precondition::etag_value;
use crate::problem::Problem;

/// Which status a replayed value is answered with.
///
/// Replayed final errors always keep their own status (a recorded 409 stays a 409).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplayStatus {
    /// The status of the first execution, e.g. 201 again for a replayed create: the IETF
    /// Idempotency-Key draft and Stripe. The default.
    #[default]
    Original,
    /// `200 OK` whatever the first execution answered: "201 Created" once, then "200 OK" with
    /// the same body for every replay, for clients that treat 201 as "created just now".
    Ok,
}

/// Marks an answer replayed: `Idempotent-Replayed: true`.
pub fn mark_replayed(headers: &mut HeaderMap) {
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
}

/// `value` as the JSON answer of a call: `status` for a first execution, and for a replay the
/// status `replay_status` says, with `Idempotent-Replayed: true`; `ETag: etag(value)` if given.
/// A value that does not serialize is answered as the problem of an `Error::Encode`.
pub fn json_answer<T: Serialize>(
    value: &T,
    status: StatusCode,
    replay_status: ReplayStatus,
    replayed: bool,
    etag: Option<fn(&T) -> EntityTag>,
) -> http::Response<Vec<u8>> {
    let body = match serde_json::to_vec(value) {
        Ok(body) => body,
        Err(e) => {
            let mut response = Problem::from(Error::Encode {
                scope: "http response".to_owned(),
                source: Box::new(e),
            })
            .to_response();
            if replayed {
                mark_replayed(response.headers_mut());
            }
            return response;
        }
    };
    let mut response = http::Response::new(body);
    *response.status_mut() = match (replayed, replay_status) {
        (true, ReplayStatus::Ok) => StatusCode::OK,
        _ => status,
    };
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(etag) = etag
        && let Some(value) = etag_value(&etag(value))
    {
        headers.insert(ETAG, value);
    }
    if replayed {
        mark_replayed(headers);
    }
    response
}

/// How a call's value is answered, first execution and replays alike: its status, the status
/// of its replays, and an optional `ETag` taken from the value. The options behind every
/// front door's `Respond` (axum's and actix-web's), usable without a framework:
///
/// ```
/// use http::StatusCode;
/// use idem_http::{JsonAnswer, ReplayStatus};
///
/// let created = JsonAnswer::<u32>::new(StatusCode::CREATED).replay_status(ReplayStatus::Ok);
/// assert_eq!(created.answer(&7, false).status(), StatusCode::CREATED);
/// assert_eq!(created.answer(&7, true).status(), StatusCode::OK);
/// ```
pub struct JsonAnswer<T> {
    status: StatusCode,
    replay_status: ReplayStatus,
    etag: Option<fn(&T) -> EntityTag>,
}

impl<T> Clone for JsonAnswer<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for JsonAnswer<T> {}

impl<T> std::fmt::Debug for JsonAnswer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonAnswer")
            .field("status", &self.status)
            .field("replay_status", &self.replay_status)
            .field("etag", &self.etag.is_some())
            .finish()
    }
}

impl<T: Serialize> JsonAnswer<T> {
    /// Answers a value with `status` (and a replayed value with the same status, unless
    /// [`replay_status`](Self::replay_status) says otherwise).
    pub const fn new(status: StatusCode) -> Self {
        Self {
            status,
            replay_status: ReplayStatus::Original,
            etag: None,
        }
    }

    /// Chooses the status of replayed values.
    pub const fn replay_status(mut self, policy: ReplayStatus) -> Self {
        self.replay_status = policy;
        self
    }

    /// Sends `ETag: <etag(&value)>` with every value, first execution and replay alike (a
    /// replay's tag is the one the first answer had, taken from the recorded value).
    pub const fn etag(mut self, etag: fn(&T) -> EntityTag) -> Self {
        self.etag = Some(etag);
        self
    }

    /// `value` answered: see [`json_answer`].
    pub fn answer(&self, value: &T, replayed: bool) -> http::Response<Vec<u8>> {
        json_answer(value, self.status, self.replay_status, replayed, self.etag)
    }
}
