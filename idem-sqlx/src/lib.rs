//! The sqlx ledger store of [`idem`](https://docs.rs/idempotence): `#[idempotent]` on a
//! function whose connection is a sqlx pool (`&PgPool`, `&MySqlPool`, `&SqlitePool`). Inside
//! the body that name is the claim's transaction, as sqlx's executors take it (`&mut
//! PgConnection`): `sqlx::query!(..).execute(&mut *db)` runs in the transaction that claims
//! the key and records the answer, so they commit together or not at all.
//!
//! Lease mode (`#[idempotent(..., lease = "30s")]`, [`SqlxLeaseStore`]) runs on the same
//! pools: the lease commits at once, the body runs on the pool, its `idem::step`s are
//! recorded fenced by the lease's token, and its database writes go in [`final_step`] or
//! [`finish`] (`&mut PgConnection` in a fenced transaction that records them with a step).
//! A function whose connection is a [`Conn`] also runs nested, inside another call's body on
//! its `&mut PgConnection`, claiming its key in a savepoint of that transaction.
//! [`StateTable`] applies declared state transitions with one guarded `UPDATE` inside the
//! body's transaction. A [`Completer`] finishes resumable lease-mode calls
//! (`#[idempotent(..., lease = "30s", resumable)]`) whose clients did not come back.
//!
//! The statements are idem-sql's, the same as the SeaORM store runs, and so are the
//! atomic claim and lease mode's claim, fence and completion; this crate only executes them. Applications use it through the facade's feature `sqlx` (with
//! `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite`); it needs no SeaORM.
//!
//! This is an implementation crate of idem: its API follows idem's versions.

#![cfg_attr(docsrs, feature(doc_cfg))]

// Modules named by feature as in idem-core, idem-sql and idem-sea-orm (`atomic`, `lease`,
// `completer`, `outbox`, `state`; `check` is the pre-deploy check), plus `driver/`: how sqlx runs idem-sql's statements (binding,
// decoding, `BEGIN`, flavour, errors, transaction poolers).
mod atomic;
pub mod check;
mod completer;
mod driver;
mod lease;
mod outbox;
mod state;

pub use atomic::{ClaimedTx, Conn, ConnClaimed, ConnStore, Nested, NestedClaim, SqlxStore};
pub use check::{AnswerCheck, check_answers, check_final_errors};
pub use completer::Completer;
pub use driver::Backend;
pub use driver::pooler::through_transaction_pooler;
pub use driver::port::{Sqlx, SqlxConn, SqlxNested, SqlxPooled, SqlxTx};
pub use idem_sql::{
    ExpiredLease, ExpiredPurge, Family, StuckLease, create_tables, database_now_ms, expired_leases,
    inspect, purge_expired, release_lease, stuck_leases,
};
pub use lease::{SqlxLeaseStore, final_step, finish};
pub use outbox::{
    DeadLetterTable, DeadMessage, Outbox, Relay, RelayCounters, RelayRound, dead_messages,
    outbox_health, purge_published, retry_dead,
};
pub use sqlx;
pub use state::{Bindable, StateConnection, StateTable};
