//! Runtime of [`idem`](https://docs.rs/idempotence): validated keys, canonical fingerprints, the
//! error type, outcomes, the [`Store`] and [`LeaseStore`] contracts, the store-independent
//! engine that `#[idempotent]` expands to ([`atomic::run`], [`lease::run_lease`]), and the
//! broker-independent halves of messaging: the outbox's [`Sink`](outbox::Sink) and the
//! [`inbox`]'s runner. It knows no database and no transport: SQL lives in `idem-sea-orm`,
//! the axum adapter in `idem-axum`, JetStream in `idem-nats`.
//!
//! Applications use the `idempotence` crate (imported as `idem`), which re-exports what is
//! public here.

#![cfg_attr(docsrs, feature(doc_cfg))]

// One folder per feature, one file per role inside it (docs/ARCHITECTURE.md has the map).
// The ledger is the bottom layer; the call builds on it; atomic and lease mode on the call.
#[doc(hidden)]
pub mod atomic;
#[doc(hidden)]
pub mod call;
pub mod completer;
mod error;
mod fingerprint;
pub mod inbox;
mod key_rules;
pub mod lease;
pub mod ledger;
pub mod metrics;
mod observe;
pub mod outbox;
mod precondition;
pub mod retry;
mod state;
mod store;
pub mod testing;
pub mod versioned;

pub use call::key::{Key, KeySource, derived_key, record_id};
pub use call::outcome::{CallReport, Outcome, with_outcome, with_report};
pub use error::{BoxError, Error, ErrorKind, Result};
pub use fingerprint::{
    FINGERPRINT_V1, FINGERPRINT_VERSION, Fingerprint, FingerprintError, Fingerprinter,
    Fingerprints, canonical_bytes, canonical_bytes_v1,
};
pub use key_rules::{KeyProblem, MAX_KEY_LEN};
pub use ledger::{BoxFuture, Claim, Concurrency, LeaseClaim, RecordStatus, Recorded, Ticket};
pub use observe::Mode;
pub use precondition::{EntityTag, IfMatch, InvalidEntityTag};
pub use state::{StateMachine, Transition, TransitionOutcome, declared};
pub use store::memory::{MemoryStore, MemoryTx};
pub use store::{LeaseStore, Store, detached};

pub use call::Request;
pub use call::answers::RecentAnswers;
pub use call::handler::FinalError;
pub use completer::{Completer, GaveUp, ResumeStore, Resumed};
pub use versioned::{AnswerError, AnswerVersion, Versioned};

/// What `#[idempotent]` and `#[derive(StateMachine)]` expand to, re-exported by the facade as
/// `idem::__private` (serde's `__private` is the model). Not public API: it changes without
/// notice. The modules it draws on (`atomic`, `call`, `handler`) are hidden for the same
/// reason; the store crates and adapters reach the engine through them.
#[doc(hidden)]
pub mod __private {
    pub use crate::Concurrency;
    pub use crate::Mode;
    pub use crate::atomic::run;
    pub use crate::call::handler::{
        FinalProbe, HandlerOutput, Rerun, RerunProbe, ViaClone, ViaFinal, ViaMove, ViaPlain,
    };
    pub use crate::call::{Call, Site};
    pub use crate::declared;
    pub use crate::lease::{once, run_lease};
    pub use crate::versioned::{VersionProbe, Versioned, ViaUnversioned, ViaVersioned};
    pub use core::time::Duration;
}
