//! The axum 0.8 adapter of [`idem`](https://docs.rs/idempotence): the `Idempotency-Key` header,
//! problem+json errors, replay-aware responses and `If-Match`, as the IETF Idempotency-Key
//! draft and RFC 9110 describe them. Applications use it as `idem::axum` (feature `axum`).
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
//! | store failure | 503 (no SQL in the body) |
//! | replay | the recorded status (or 200, see [`ReplayStatus`]) and body + `Idempotent-Replayed: true` |
//!
//! The contract itself (the header's grammar, the problem+json answer of every error, the
//! replay marker, `If-Match`, run-to-completion) lives in `idem-http` on the `http` crate's
//! types; this crate adds axum's extractors and responses. An [`idem_core::Error`] becomes a
//! response through [`Problem`]: `Problem::from(e).into_response()`.
//!
//! [`IdempotencyLayer`] gives plain routes (not `#[idempotent]` functions) the same contract by
//! recording their whole responses.
//!
//! [`respond`] runs the call to completion on a task of its own, so a client that hangs up
//! cannot cut it off mid-statement; its retry replays the recorded answer.
//!
//! Server-rendered forms: [`Keyed`] finds the key in a form's hidden `idempotency_key` field
//! (or a query parameter, or a JSON member) as well as the header, and hands the body on to
//! the extractor it wraps (`Keyed<Form<T>>`); [`respond_answer`] answers a call whose value is
//! an [`Answer`] (a `303 See Other` with a flash cookie, a rendered page) with its recorded
//! status and headers.

mod http;
mod layer;

pub use http::{
    Answer, ETag, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED, IdempotencyKey,
    IfMatch, Keyed, Problem, ReplayStatus, Respond, respond, respond_answer, respond_inline,
    run_to_completion,
};
pub use idem_core::EntityTag;
pub use layer::{IdempotencyLayer, IdempotencyService};
