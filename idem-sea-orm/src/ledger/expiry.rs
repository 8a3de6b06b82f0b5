//! Expiry: the database's clock, and purging the records that ended and expired, in bounded
//! batches, never a call not finished.

use idem_core::Error;
use sea_orm::ConnectionTrait;

use crate::driver::error::{failed, store_error};
use crate::driver::fetch_first;
use crate::driver::port::On;

/// A purge of expired records, one bounded statement at a time. [`purge_expired`] runs one to
/// the end; step one yourself to pace it your own way.
///
/// Only records that ended are purged: completed, failed, or given up with no hook owed,
/// and past their TTL. A call not finished is kept however old (a lease-mode call in
/// progress, one whose lease ended unfinished, a resumable call awaiting its completer, a
/// give-up whose hook is owed): deleting it would delete the recorded steps that keep its
/// retry or completer from repeating their effects. [`expired_leases`](crate::expired_leases) lists those.
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
pub struct ExpiredPurge(idem_sql::ExpiredPurge);

impl ExpiredPurge {
    /// A purge that has not started.
    pub fn new() -> Self {
        Self::default()
    }

    /// This purge, whose last step also deletes steps and stored calls left without their
    /// record; it reads the whole ledger, so it is for the operator, not a periodic purge
    /// ([`idem_sql::ExpiredPurge::with_orphans`]).
    pub fn with_orphans(self) -> Self {
        Self(self.0.with_orphans())
    }

    /// Records deleted so far.
    pub fn deleted(&self) -> u64 {
        self.0.deleted()
    }

    /// Whether the purge has finished: every record that had ended and expired when it
    /// started is gone.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }

    /// Runs one statement (`batch` rows at most, at least 1) and returns the records it
    /// deleted, or `None` once the purge has finished (then nothing runs). With
    /// [`with_orphans`](Self::with_orphans), the step that finishes also deletes steps and
    /// stored calls left without their record.
    pub async fn step<C: ConnectionTrait>(
        &mut self,
        db: &C,
        batch: u32,
    ) -> Result<Option<u64>, Error> {
        let sql = crate::driver::of(db.get_database_backend());
        self.0.step(&mut On(db), sql, batch).await.map_err(failed)
    }
}

/// Deletes every record that ended and whose TTL passed, `batch` rows per statement (see
/// [`ExpiredPurge`]), and returns how many it deleted. Calls not finished (a lease that ended
/// unfinished, a resumable call awaiting its completer, a give-up whose hook is owed) are
/// kept however old; [`expired_leases`](crate::expired_leases) lists them.
///
/// Each statement is its own short transaction, and after each one the purge pauses for as
/// long as the statement took, so it never holds more than half of the database's write time:
/// claims queue behind at most one batch. Small batches keep that wait short (the benchmark's
/// P7: about 150 rows per statement on PostgreSQL keep a statement near 2 ms).
pub async fn purge_expired<C: ConnectionTrait>(db: &C, batch: u32) -> Result<u64, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    idem_sql::ExpiredPurge::new()
        .run(&mut On(db), sql, batch)
        .await
        .map_err(failed)
}

/// The database's clock, in milliseconds since the Unix epoch (what expiry is measured on).
pub async fn database_now_ms<C: ConnectionTrait>(db: &C) -> Result<i64, Error> {
    let d = crate::driver::of(db.get_database_backend());
    fetch_first(db, d, d.ledger.select_now(), idem_sql::Row::into_i64)
        .await
        .map_err(|e| store_error("reading the database clock", e))?
        .ok_or_else(|| Error::Store {
            message: "the database clock query returned no row".to_owned(),
            source: None,
        })
}
