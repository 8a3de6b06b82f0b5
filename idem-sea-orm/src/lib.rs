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
//! Every SQL statement the crate runs is in one module, `src/sql.rs`: one table of statements
//! per backend, rendered once from templates that name the tables through [`LEDGER_TABLE`],
//! [`STEPS_TABLE`], [`OUTBOX_TABLE`], [`OUTBOX_HEADS_TABLE`] and [`DEAD_LETTERS_TABLE`]. The
//! rest of the crate only picks statements from that table and binds their values.
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

pub mod check;
mod completer;
mod error;
mod flavour;
mod group_commit;
pub mod inspect;
mod lease;
mod outbox;
mod sql;
mod state;
mod store;

pub mod ledger;
#[cfg(feature = "migration")]
mod migration;

pub use check::{AnswerCheck, check_answers, check_final_errors};
pub use completer::Completer;
pub use flavour::{FORCE_MYSQL8_ENV, GALERA_SYNC_WAIT_ENV};
pub use idem_sql::Family;
pub use lease::{
    ExpiredLease, SeaOrmLeaseStore, StuckLease, expired_leases, final_step, finish, release_lease,
    stuck_leases,
};
#[cfg(feature = "migration")]
#[cfg_attr(docsrs, doc(cfg(feature = "migration")))]
pub use migration::{CompleterMigration, LeaseMigration, Migration, OutboxMigration, migrations};
pub use outbox::{
    DeadLetterTable, DeadMessage, Outbox, Relay, RelayCounters, RelayRound, dead_messages,
    outbox_health, purge_published, retry_dead,
};
pub use sql::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
    placeholders,
};
pub use state::{ConditionalUpdate, Stateful};
pub use store::{ClaimedTx, SeaOrmStore, set_connection_wait};

pub use sea_orm;

use idem_core::Error;
use sea_orm::ConnectionTrait;

use crate::error::store_error;
use crate::sql::statement;
use crate::sql::{Bound, Purge};

/// Creates the ledger, the steps and calls tables of lease mode, and the outbox tables (with
/// their indexes) where they do not exist. Call it once at startup (or use the migrations,
/// feature `migration`).
///
/// On PostgreSQL and MySQL it reads the catalogue first and runs DDL only for a family of
/// tables that is missing: on a cluster (Galera) even `CREATE TABLE IF NOT EXISTS` is
/// replicated as DDL and aborts the transactions committing on that table cluster-wide, so
/// starting a service must not issue it against a live ledger. (On a cluster, prefer migrating
/// once to creating at start.)
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// idem_sea_orm::create_tables(&db).await?;
/// idem_sea_orm::create_tables(&db).await?; // finds everything there: no DDL
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub async fn create_tables<C: ConnectionTrait>(db: &C) -> Result<(), Error> {
    let sql = crate::sql::of(db.get_database_backend());
    // SQLite runs its (idempotent) DDL every time: it is embedded, so no other node aborts,
    // and it drops the expiry index that ledgers of earlier versions have.
    let missing = match crate::sql::backend(sql) {
        sea_orm::DbBackend::Sqlite => sql::ALL_TABLES.to_vec(),
        _ => inspect::missing_tables(db).await?,
    };
    let exists = |table: &str| !missing.contains(&table);
    let families = [
        (
            &sql.ledger.tables,
            &[LEDGER_TABLE][..],
            "creating the ledger table",
        ),
        (
            &sql.lease.tables,
            &[STEPS_TABLE][..],
            "creating the steps table",
        ),
        (
            &sql.completer.tables,
            &[CALLS_TABLE][..],
            "creating the calls table",
        ),
        (
            &sql.outbox.tables,
            &[OUTBOX_TABLE, OUTBOX_HEADS_TABLE, DEAD_LETTERS_TABLE][..],
            "creating the outbox tables",
        ),
    ];
    for (tables, names, doing) in families {
        if names.iter().all(|&name| exists(name)) {
            continue;
        }
        for statement in &tables.create {
            db.execute_unprepared(statement)
                .await
                .map_err(|e| store_error(doing, e))?;
        }
    }
    Ok(())
}

/// A purge of expired records, one bounded statement at a time. [`purge_expired`] runs one to
/// the end; step one yourself to pace it your own way.
///
/// Only records that ended are purged: completed, failed, or given up with no hook owed,
/// and past their TTL. A call not finished is kept however old (a lease-mode call in
/// progress, one whose lease ended unfinished, a resumable call awaiting its completer, a
/// give-up whose hook is owed): deleting it would delete the recorded steps that keep its
/// retry or completer from repeating their effects. [`expired_leases`] lists those.
///
/// PostgreSQL and MySQL find expired records by their expiry index: a step deletes up to
/// `batch` of them (PostgreSQL skips rows a claim holds locked). SQLite's ledger has no expiry
/// index, because on SQLite every commit waits for its pages to reach the disk and the index
/// page was a fifth of a first execution's; there a step examines the next `batch` records in
/// key order and deletes the expired ones among them, so one purge reads the ledger once.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # idem_sea_orm::create_tables(&db).await?;
/// let mut purge = idem_sea_orm::ExpiredPurge::new();
/// while let Some(deleted) = purge.step(&db, 500).await? {
///     tracing::debug!(deleted, "purged a batch of expired records");
///     tokio::time::sleep(std::time::Duration::from_millis(5)).await;
/// }
/// assert!(purge.is_finished());
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
#[derive(Debug, Default, Clone)]
pub struct ExpiredPurge {
    /// SQLite: the last key a step examined (empty before the first step: below every key).
    after: Vec<u8>,
    /// Which of the steps and calls tables exist, learnt at the first step: a schema of
    /// atomic calls has the ledger alone (`idem schema --only ledger`).
    tables: Option<OptionalTables>,
    finished: bool,
    deleted: u64,
}

impl ExpiredPurge {
    /// A purge that has not started.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records deleted so far.
    pub fn deleted(&self) -> u64 {
        self.deleted
    }

    /// Whether the purge has finished: every record that had ended and expired when it
    /// started is gone.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Runs one statement (`batch` rows at most, at least 1) and returns the records it
    /// deleted, or `None` once the purge has finished (then nothing runs). The step that
    /// finishes also deletes steps and stored calls left without their record.
    pub async fn step<C: ConnectionTrait>(
        &mut self,
        db: &C,
        batch: u32,
    ) -> Result<Option<u64>, Error> {
        if self.finished {
            return Ok(None);
        }
        let batch = batch.max(1);
        let d = crate::sql::of(db.get_database_backend());
        let tables = match self.tables {
            Some(tables) => tables,
            None => *self.tables.insert(OptionalTables::of(db).await?),
        };
        let delete = |bound: Bound<'static>| {
            let delete = statement(d, bound);
            async move {
                db.execute_raw(delete)
                    .await
                    .map(|done| done.rows_affected())
                    .map_err(|e| store_error("purging expired records", e))
            }
        };
        let deleted = match d.ledger.purge(tables.calls) {
            Purge::ByIndex(purge) => {
                let deleted = delete(purge.delete(i64::from(batch))).await?;
                self.finished = deleted < u64::from(batch);
                deleted
            }
            Purge::Sweep(sweep) => {
                let last = db
                    .query_one_raw(statement(d, sweep.bound(&self.after, i64::from(batch - 1))))
                    .await
                    .and_then(|row| {
                        row.map(|row| row.try_get_by_index::<Vec<u8>>(0))
                            .transpose()
                    })
                    .map_err(|e| store_error("finding the next records to purge", e))?;
                match last {
                    Some(last) => {
                        let deleted = delete(sweep.delete(&self.after, &last)).await?;
                        self.after = last;
                        deleted
                    }
                    None => {
                        self.finished = true;
                        delete(sweep.delete_rest(&self.after)).await?
                    }
                }
            }
        };
        self.deleted += deleted;
        if self.finished {
            lease::purge_orphaned_steps(db, tables.steps, tables.calls).await?;
        }
        Ok(Some(deleted))
    }
}

/// The DDL of `family`'s tables for `backend`, as a migration file (comment, then each
/// statement ending in `;`): what a service puts in its own migrations to create only the
/// tables of the features it uses (`idem schema --backend … --only …` prints the same, and
/// `idem-sql/schema/` holds every file). Atomic mode needs [`Family::Ledger`] alone.
pub fn schema(backend: sea_orm::DbBackend, family: Family) -> String {
    let dialect = match backend {
        sea_orm::DbBackend::Postgres => idem_sql::Dialect::Postgres,
        sea_orm::DbBackend::MySql => idem_sql::Dialect::MySql,
        _ => idem_sql::Dialect::Sqlite,
    };
    idem_sql::schema(dialect, family)
}

/// Which of the tables that only some features use exist.
#[derive(Debug, Clone, Copy)]
struct OptionalTables {
    steps: bool,
    calls: bool,
}

impl OptionalTables {
    async fn of<C: ConnectionTrait>(db: &C) -> Result<Self, Error> {
        let missing = inspect::missing_tables(db).await?;
        Ok(Self {
            steps: !missing.contains(&STEPS_TABLE),
            calls: !missing.contains(&CALLS_TABLE),
        })
    }
}

/// Deletes every record that ended and whose TTL passed, `batch` rows per statement (see
/// [`ExpiredPurge`]), and returns how many it deleted. Calls not finished (a lease that ended
/// unfinished, a resumable call awaiting its completer, a give-up whose hook is owed) are
/// kept however old; [`expired_leases`] lists them.
///
/// Each statement is its own short transaction, and after each one the purge pauses for as
/// long as the statement took, so it never holds more than half of the database's write time:
/// claims queue behind at most one batch. Small batches keep that wait short (the benchmark's
/// P7: about 150 rows per statement on PostgreSQL keep a statement near 2 ms).
pub async fn purge_expired<C: ConnectionTrait>(db: &C, batch: u32) -> Result<u64, Error> {
    let mut purge = ExpiredPurge::new();
    loop {
        let started = std::time::Instant::now();
        purge.step(db, batch).await?;
        if purge.is_finished() {
            return Ok(purge.deleted());
        }
        tokio::time::sleep(started.elapsed()).await;
    }
}

/// The database's clock, in milliseconds since the Unix epoch (what expiry is measured on).
pub async fn database_now_ms<C: ConnectionTrait>(db: &C) -> Result<i64, Error> {
    let d = crate::sql::of(db.get_database_backend());
    let row = db
        .query_one_raw(statement(d, d.ledger.select_now()))
        .await
        .map_err(|e| store_error("reading the database clock", e))?;
    row.ok_or_else(|| Error::Store {
        message: "the database clock query returned no row".to_owned(),
        source: None,
    })?
    .try_get_by_index::<i64>(0)
    .map_err(|e| store_error("reading the database clock", e))
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Database};

    #[tokio::test]
    async fn create_tables_makes_a_missing_family_and_leaves_the_others() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        super::create_tables(&db).await.expect("create");
        db.execute_unprepared("DROP TABLE idem_calls")
            .await
            .expect("drop");
        super::create_tables(&db).await.expect("create again");
        db.execute_unprepared("SELECT COUNT(*) FROM idem_calls")
            .await
            .expect("made again");
    }
}
