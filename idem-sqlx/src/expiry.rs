//! Purging the ledger's expired records on a sqlx pool: idem-sql's purge
//! ([`idem_sql::ExpiredPurge`], the same the SeaORM store and the `idem purge` command run),
//! one bounded statement at a time.

use idem_core::Error;
use idem_sql::{Bound, PurgeConnection, Row, Sql};
use sqlx::Pool;
use sqlx::pool::PoolConnection;

use crate::driver::Backend;
use crate::driver::error::store_error;

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
        self.0
            .step(&mut conn, sql, batch)
            .await
            .map_err(|(doing, e)| store_error(doing, e))
    }
}

/// A connection of `pool` as the purge runs statements on it, and the statements.
async fn connection<DB: Backend>(pool: &Pool<DB>) -> Result<(OnSqlx<DB>, &'static Sql), Error> {
    let (conn, sql, named) = crate::lease::acquire(pool, "purging expired records").await?;
    Ok((OnSqlx { conn, named }, sql))
}

/// A pooled sqlx connection as the purge runs statements on it.
struct OnSqlx<DB: Backend> {
    conn: PoolConnection<DB>,
    named: bool,
}

impl<DB: Backend> PurgeConnection for OnSqlx<DB> {
    type Error = sqlx::Error;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, sqlx::Error> {
        DB::execute(&mut self.conn, statement, self.named).await
    }

    async fn fetch_key(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Option<Vec<u8>>, sqlx::Error> {
        DB::fetch_first(&mut self.conn, statement, self.named, Row::into_bytes).await
    }

    async fn fetch_texts(&mut self, statement: Bound<'static>) -> Result<Vec<String>, sqlx::Error> {
        DB::fetch_each(&mut self.conn, statement, self.named, Row::into_text).await
    }
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
        .map_err(|(doing, e)| store_error(doing, e))
}
