//! Purging the ledger's expired records on a sqlx pool: idem-sql's purge
//! ([`idem_sql::ExpiredPurge`], the same the SeaORM store and the `idem purge` command run),
//! one bounded statement at a time.

use idem_core::Error;
use idem_sql::{Driver, Sql};
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::error::{failed, store_error};
use crate::driver::port::{Sqlx, SqlxPooled};

/// A purge of expired records, one bounded statement at a time; [`purge_expired`] runs one to
/// the end. Only records that ended and whose TTL passed are deleted, never a call not
/// finished (see [`idem_sql::ExpiredPurge`]).
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

    /// Runs one statement on `pool` (`batch` rows at most, at least 1) and returns the records
    /// it deleted, or `None` once the purge has finished (then nothing runs). With
    /// [`with_orphans`](Self::with_orphans), the step that finishes also deletes steps and
    /// stored calls left without their record.
    pub async fn step<DB: Backend>(
        &mut self,
        pool: &Pool<DB>,
        batch: u32,
    ) -> Result<Option<u64>, Error> {
        let (mut conn, sql) = connection(pool).await?;
        self.0.step(&mut conn, sql, batch).await.map_err(failed)
    }
}

/// A connection of `pool` as the purge runs statements on it, and the statements.
async fn connection<DB: Backend>(pool: &Pool<DB>) -> Result<(SqlxPooled<DB>, &'static Sql), Error> {
    let conn = Sqlx::new(pool.clone())
        .acquire()
        .await
        .map_err(|e| store_error("purging expired records", e))?;
    Ok((conn, Sql::common(DB::DIALECT)))
}

/// Deletes every record that ended and whose TTL passed, `batch` rows per statement (see
/// [`ExpiredPurge`]), and returns how many it deleted. Calls not finished are kept however
/// old; [`expired_leases`](crate::expired_leases) lists them. After each statement the purge
/// pauses for as long as it took, so it never holds more than half of the database's write
/// time; it holds one pooled connection until it ends.
pub async fn purge_expired<DB: Backend>(pool: &Pool<DB>, batch: u32) -> Result<u64, Error> {
    let (mut conn, sql) = connection(pool).await?;
    idem_sql::ExpiredPurge::new()
        .run(&mut conn, sql, batch)
        .await
        .map_err(failed)
}
