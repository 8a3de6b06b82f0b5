//! The tokio-postgres ledger store of [`idem`](https://docs.rs/idempotence): `#[idempotent]`
//! on a function whose connection is a `&deadpool_postgres::Pool`. Inside the body that name
//! is the claim's transaction, as a `&ClientWrapper` (which derefs to
//! `tokio_postgres::Client`): `db.execute(..)` runs in the transaction that claims the key
//! and records the answer, so they commit together or not at all. Called with that `db`, an
//! `#[idempotent]` function whose connection is a `&ClientWrapper` claims its key in a
//! savepoint of the transaction ([`NestedStore`]).
//!
//! Lease mode (`#[idempotent(..., lease = "30s")]`) runs on the same pool: the body runs on
//! the pool, its `idem::step`s are recorded fenced by the lease's token, and its database
//! writes go in [`final_step`] or [`finish`]. A [`Completer`] finishes resumable calls; a
//! [`Relay`] publishes what bodies staged ([`Outbox`]).
//!
//! This crate is a driver ([`TokioPostgres`]) and names: every statement, decision and store
//! is idem-sql's, the same the SeaORM and sqlx stores run. idem's statements go out unnamed
//! with their values' types (one round trip each), so the store works through a transaction
//! pooler (PgBouncer in transaction mode) as it is. The relay polls: a deadpool pool does not
//! hand out a connection's notifications, so PostgreSQL's `NOTIFY` does not wake it here.
//!
//! This is an implementation crate of idem: its API follows idem's versions.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod driver;

use std::future::Future;

use deadpool_postgres::{ClientWrapper, Pool};
use idem_core::Error;
use idem_core::outbox::Message;
use idem_sql::SqlStore;

pub use check::{AnswerCheck, check_answers, check_final_errors};
pub use deadpool_postgres;
pub use deadpool_postgres::tokio_postgres;
pub use driver::{
    OnBody, TokioPostgres, TokioPostgresError, TokioPostgresNested, TokioPostgresPooled,
    TokioPostgresTx,
};
pub use idem_sql::{
    DeadMessage, ExpiredLease, ExpiredPurge, Family, RelayCounters, RelayRound, StuckLease,
    create_tables, database_now_ms, dead_messages, expired_leases, inspect, outbox_health,
    purge_expired, purge_published, release_lease, retry_dead, stuck_leases,
};

/// The ledger on a deadpool-postgres pool, in atomic and lease mode, and the completer's
/// store: idem-sql's one store on the [`TokioPostgres`] driver. `#[idempotent]` builds one
/// from the handler's `&Pool`; `TokioPostgresStore::new(&pool)` builds one by hand. The
/// operator's functions ([`purge_expired`], [`inspect`], [`outbox_health`], ...) take the pool.
pub type TokioPostgresStore = SqlStore<TokioPostgres>;

/// The ledger in another call's body: an `#[idempotent]` function called with that body's
/// `&ClientWrapper` claims its key in a savepoint of its transaction, and commits with it or
/// not at all; dropped before it ends, it leaves nothing.
pub type NestedStore<'c> = idem_sql::Nested<'c, TokioPostgres>;

/// A key claimed on a deadpool-postgres pool: the claim's transaction, which the body runs in.
pub type ClaimedTx = idem_sql::ClaimedTx<TokioPostgres>;

/// A [`Completer`](idem_core::Completer) on a deadpool-postgres pool:
/// `Completer::new(TokioPostgresStore::new(&pool))`; the calls table must exist
/// ([`create_tables`] with [`Family::Completer`]).
pub type Completer = idem_core::Completer<TokioPostgresStore>;

/// Publishes committed outbox messages from a deadpool-postgres pool to a
/// [`Sink`](idem_core::outbox::Sink): `Relay::new(&pool, sink).run(stopped)`.
pub type Relay<S> = idem_sql::Relay<TokioPostgres, S>;

/// Where a consumer records the messages it gave up on (`DeadLetterTable::new(&pool)`).
pub type DeadLetterTable = idem_sql::DeadLetterTable<TokioPostgres>;

/// The pre-deploy check of an answer type that changed ([`idem_sql::check`]) on a pool.
pub mod check {
    pub use idem_sql::check::{AnswerCheck, MAX_LISTED, UnreadableRecord};

    idem_sql::check_entries!([] deadpool_postgres::Pool, crate::TokioPostgres);
}

/// Staging messages in the transaction you are in: inside an `#[idempotent]` body, on the
/// claim's transaction (`db` there), or on a `tokio_postgres::Transaction` of your own.
///
/// ```no_run
/// # async fn body(db: &deadpool_postgres::ClientWrapper) -> Result<(), idem_core::Error> {
/// use idem_tokio_postgres::Outbox;
/// db.stage(idem_core::outbox::Message::json("shop.orders.paid", &"o-1")?).await?;
/// # Ok(()) }
/// ```
pub trait Outbox {
    /// Stages `message` in this client's transaction and returns its id (a UUID, the
    /// downstream deduplication key): published after the transaction commits, never if it
    /// rolls back. In a transaction of your own, call `idem::outbox::wake()` after committing
    /// (or let the relays' poll find it).
    fn stage(&self, message: Message) -> impl Future<Output = Result<String, Error>> + Send;
}

impl<C: tokio_postgres::GenericClient + Sync> Outbox for C {
    async fn stage(&self, message: Message) -> Result<String, Error> {
        let id = uuid::Uuid::now_v7().to_string();
        let mut on = OnBody(self.client());
        idem_sql::stage_message::<TokioPostgres>(&mut on, idem_sql::Dialect::Postgres, id, message)
            .await
    }
}

idem_sql::final_phases!([] Pool, TokioPostgres, |'t| &'t ClientWrapper, "idem::tokio_postgres");
