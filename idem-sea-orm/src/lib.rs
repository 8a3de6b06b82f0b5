//! The SeaORM ledger store of [`idem`](https://docs.rs/idempotence).
//!
//! - [`create_tables`] creates the ledger (or use `Migration` in your own Migrator, with the
//!   `migration` feature);
//! - [`SeaOrmStore`] claims keys, records results and releases keys, in the same
//!   transaction as the handler's own writes;
//! - [`purge_expired`] deletes records that ended and expired, in bounded batches, never a
//!   call not finished ([`ExpiredPurge`] to pace it yourself);
//! - [`ledger`] is the ledger's SeaORM entity, for inspection and admin tools;
//! - [`check_answers`] decodes a scope's live records as an answer type about to be
//!   deployed, and reports those it cannot read (the pre-deploy check);
//! - [`inspect`] reads one record with its steps and stored call, and lists the tables a
//!   database lacks (what the `idem` command-line tool shows).
//!
//! The crate writes no SQL of its own: every statement it runs is `idem-sql`'s, rendered once
//! per server flavour from templates that name the tables through [`LEDGER_TABLE`],
//! [`STEPS_TABLE`], [`OUTBOX_TABLE`], [`OUTBOX_HEADS_TABLE`] and [`DEAD_LETTERS_TABLE`], with
//! its values bound beside its text. This crate picks statements, executes them on a SeaORM
//! connection (`driver/`) and reads their rows.
//!
//! The claim, per backend:
//! - **PostgreSQL**: at READ COMMITTED, one statement inserts the key (`ON CONFLICT DO
//!   NOTHING`) or returns the committed row it ran into; a completed record replays from that
//!   row without a lock, anything else is read again with `SELECT … FOR UPDATE`.
//! - **MariaDB** (10.5+): `INSERT … ON DUPLICATE KEY UPDATE id = id RETURNING …` returns the
//!   inserted row or the existing one, locked and current, then an owner-token comparison
//!   (MySQL 8 has no `RETURNING`).
//! - **SQLite**: `BEGIN IMMEDIATE` takes the only write lock, then a plain read; the record
//!   writes the whole row once. The ledger has no expiry index there (see [`ExpiredPurge`]).
//!
//! Expiry is always computed on the database's clock, never the application's.

#![cfg_attr(docsrs, feature(doc_cfg))]

// One module per feature, named as in idem-core and idem-sql (`ledger/`, `atomic`, `lease/`,
// `completer`, `outbox`, `state`; `check` is the pre-deploy check of `versioned` answers), a
// folder where a feature has several roles, plus `driver/`: how SeaORM runs idem-sql's
// statements (flavour, errors, conversion).
mod atomic;
pub mod check;
mod completer;
mod driver;
mod lease;
pub mod ledger;
mod outbox;
mod state;

pub use atomic::{ClaimedTx, ExecutorStore, NestedStore, SeaOrmStore};
pub use check::{AnswerCheck, check_answers, check_final_errors};
pub use completer::Completer;
pub use driver::flavour::{FORCE_MYSQL8_ENV, GALERA_SYNC_WAIT_ENV};
pub use driver::port::{On, Runs, SeaOrm, SeaOrmNested, set_connection_wait};
pub use driver::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
    placeholders,
};
pub use idem_sql::{
    ExpiredLease, ExpiredPurge, Family, StuckLease, database_now_ms, expired_leases, inspect,
    purge_expired, release_lease, stuck_leases,
};
pub use lease::{SeaOrmLeaseStore, final_step, finish};
#[cfg(feature = "migration")]
#[cfg_attr(docsrs, doc(cfg(feature = "migration")))]
pub use ledger::migration::{
    CompleterMigration, LeaseMigration, Migration, OutboxMigration, migrations,
};
pub use outbox::{
    DeadLetterTable, DeadMessage, Outbox, Relay, RelayCounters, RelayRound, dead_messages,
    outbox_health, purge_published, retry_dead,
};
pub use state::{ConditionalUpdate, Stateful};

pub use sea_orm;

pub use ledger::schema::{create_tables, schema};
