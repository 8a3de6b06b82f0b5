//! The SeaORM ledger store of [`idem`](https://docs.rs/idem).
//!
//! - [`create_tables`] creates the ledger (or use `Migration` in your own Migrator, with the
//!   `migration` feature);
//! - [`SeaOrmStore`] claims keys, records results and releases keys, in the same
//!   transaction as the handler's own writes;
//! - [`purge_expired`] deletes expired records in bounded batches;
//! - [`ledger`] is the ledger's SeaORM entity, for inspection and admin tools.
//!
//! The claim, per backend (every statement is in one place, `dialect.rs`):
//! - **PostgreSQL**: at READ COMMITTED, one statement inserts the key (`ON CONFLICT DO
//!   NOTHING`) or returns the committed row it ran into; a completed record replays from that
//!   row without a lock, anything else is read again with `SELECT … FOR UPDATE`.
//! - **MariaDB** (10.5+): `INSERT … ON DUPLICATE KEY UPDATE id = id RETURNING …` returns the
//!   inserted row or the existing one, locked and current, then an owner-token comparison
//!   (MySQL 8 has no `RETURNING`).
//! - **SQLite**: `BEGIN IMMEDIATE` takes the only write lock, then a plain read; the record
//!   writes the whole row once.
//!
//! Expiry is always computed on the database's clock, never the application's.

mod dialect;
mod error;
mod lease;
mod outbox;
mod outbox_sql;
mod state;
mod store;

pub mod ledger;
#[cfg(feature = "migration")]
mod migration;

pub use dialect::{LEDGER_TABLE, placeholders};
pub use lease::{ExpiredLease, STEPS_TABLE, SeaOrmLeaseStore, expired_leases, final_step};
#[cfg(feature = "migration")]
pub use migration::{LeaseMigration, Migration, OutboxMigration, migrations};
pub use outbox::{
    DeadLetterTable, DeadMessage, Outbox, Relay, RelayCounters, RelayRound, dead_messages,
    outbox_health, purge_published, retry_dead,
};
pub use outbox_sql::{DEAD_LETTERS_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE};
pub use state::{ConditionalUpdate, Stateful};
pub use store::SeaOrmStore;

pub use sea_orm;

use idem_core::Error;
use sea_orm::{ConnectionTrait, Statement};

use crate::dialect::Dialect;
use crate::error::store_error;

/// Creates the ledger table and the outbox tables (with their indexes) if they do not exist.
/// Call it once at startup (or use `Migration` and `OutboxMigration`, feature `migration`).
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// idem_sea_orm::create_tables(&db).await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub async fn create_tables<C: ConnectionTrait>(db: &C) -> Result<(), Error> {
    for sql in Dialect::of(db.get_database_backend()).create {
        db.execute_unprepared(sql)
            .await
            .map_err(|e| store_error("creating the ledger table", e))?;
    }
    lease::create_lease_tables(db).await?;
    outbox::create_outbox_tables(db).await
}

/// Deletes up to `batch` expired records in one statement and returns how many it deleted.
/// PostgreSQL skips rows a claim holds locked.
pub async fn purge_expired_batch<C: ConnectionTrait>(db: &C, batch: u32) -> Result<u64, Error> {
    let d = Dialect::of(db.get_database_backend());
    db.execute_raw(Statement::from_sql_and_values(
        d.backend,
        &d.purge,
        [i64::from(batch).into()],
    ))
    .await
    .map(|r| r.rows_affected())
    .map_err(|e| store_error("purging expired records", e))
}

/// Deletes every expired record, `batch` rows per statement, and returns how many it
/// deleted. Leases that ended without their call finishing are expired records too; their
/// recorded steps go with them.
///
/// Each statement is its own short transaction, and after each one the purge pauses for as
/// long as the statement took, so it never holds more than half of the database's write time:
/// claims queue behind at most one batch. Small batches keep that wait short (the benchmark's
/// P7: about 150 rows per statement on PostgreSQL, 50 on SQLite keep a statement near 2 ms).
pub async fn purge_expired<C: ConnectionTrait>(db: &C, batch: u32) -> Result<u64, Error> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let started = std::time::Instant::now();
        let deleted = purge_expired_batch(db, batch).await?;
        total += deleted;
        if deleted < u64::from(batch) {
            lease::purge_orphaned_steps(db).await?;
            return Ok(total);
        }
        tokio::time::sleep(started.elapsed()).await;
    }
}

/// The database's clock, in milliseconds since the Unix epoch (what expiry is measured on).
pub async fn database_now_ms<C: ConnectionTrait>(db: &C) -> Result<i64, Error> {
    let d = Dialect::of(db.get_database_backend());
    let row = db
        .query_one_raw(Statement::from_string(d.backend, d.select_now.clone()))
        .await
        .map_err(|e| store_error("reading the database clock", e))?;
    row.ok_or_else(|| Error::Store {
        message: "the database clock query returned no row".to_owned(),
        source: None,
    })?
    .try_get_by_index::<i64>(0)
    .map_err(|e| store_error("reading the database clock", e))
}
