//! Runtime of [`idem`](https://docs.rs/idem): validated keys, canonical fingerprints, the
//! error type, outcomes, the [`Store`] contract and the store-independent engine that
//! `#[idempotent]` expands to, and the broker-independent halves of messaging: the outbox's
//! [`Sink`](outbox::Sink) and the [`inbox`]'s runner.
//!
//! No transport lives here: the axum adapter is `idem-axum`, JetStream is `idem-nats`.
//! Applications use the `idem` crate, which re-exports what is public here.

mod error;
mod fingerprint;
mod flight;
pub mod inbox;
mod key;
pub mod lease;
mod memory;
pub mod metrics;
pub mod outbox;
mod outcome;
mod precondition;
mod state;
mod store;

pub mod engine;

pub use error::{BoxError, Error, ErrorKind, KeyProblem, Result};
pub use fingerprint::{
    FINGERPRINT_VERSION, Fingerprint, FingerprintError, Fingerprinter, canonical_bytes,
};
pub use key::{Key, KeySource, MAX_KEY_LEN};
pub use memory::{MemoryStore, MemoryTx};
pub use outcome::{Outcome, with_outcome};
pub use precondition::{EntityTag, IfMatch};
pub use state::{StateMachine, Transition, TransitionOutcome, declared};
pub use store::{Claim, ClaimRequest, Concurrency, RecordStatus, Recorded, Store};

pub use engine::FinalError;
