//! Runtime of [`idem`](https://docs.rs/idem): validated keys, canonical fingerprints, the
//! error type, outcomes, the [`Store`] and [`LeaseStore`] contracts and the store-independent
//! engine that `#[idempotent]` expands to ([`atomic::run`], [`lease::run_lease`]). It knows no
//! database and no transport: SQL lives in `idem-sea-orm`, HTTP and brokers in crates of
//! their own.
//!
//! Applications use the `idem` crate, which re-exports what is public here.

pub mod atomic;
pub mod call;
mod error;
mod fingerprint;
mod flight;
pub mod handler;
#[cfg(feature = "axum")]
pub mod http;
pub mod ids;
mod key;
pub mod lease;
mod memory;
pub mod metrics;
#[cfg(feature = "nats")]
pub mod nats;
pub mod outbox;
mod outcome;
mod precondition;
mod state;
mod store;

pub use error::{BoxError, Error, ErrorKind, KeyProblem, Result};
pub use fingerprint::{
    FINGERPRINT_VERSION, Fingerprint, FingerprintError, Fingerprinter, canonical_bytes,
};
pub use key::{Key, KeySource, MAX_KEY_LEN};
pub use memory::{MemoryStore, MemoryTx};
pub use outcome::{Outcome, with_outcome};
pub use precondition::{EntityTag, IfMatch};
pub use state::{StateMachine, Transition, TransitionOutcome, declared};
pub use store::{
    BoxFuture, Claim, Concurrency, LeaseClaim, LeaseStore, RecordStatus, Recorded, Store, Ticket,
};

pub use call::Request;
pub use handler::FinalError;
