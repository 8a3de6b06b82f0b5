//! Lease mode's one-statement writes on a sqlx pool, committed in groups on SQLite
//! ([`idem_sql::write_grouped`]: the queue, who leads and who waits): how one write, and a
//! group in one transaction, are applied here.

use idem_sql::{ClaimRow, Dialect, GroupCommit, LeaseWrite, LeaseWritten};
use sqlx::{Pool, Transaction};

use crate::driver::Backend;
use crate::driver::pooler::{identity, named};

/// A sqlx pool as the group commit applies writes on it.
struct OnSqlx<DB: Backend>(Pool<DB>);

impl<DB: Backend> Clone for OnSqlx<DB> {
    fn clone(&self) -> Self {
        OnSqlx(self.0.clone())
    }
}

async fn apply<DB: Backend>(
    conn: &mut DB::Connection,
    write: LeaseWrite,
    named: bool,
) -> Result<LeaseWritten, sqlx::Error> {
    match write {
        LeaseWrite::Claim { claim, read } => {
            let row = match DB::fetch_first(conn, claim, named, ClaimRow::from_row).await? {
                Some(row) => Some(row),
                // SQLite's `DO NOTHING` returns no row; nor does PostgreSQL's for a row
                // committed while its insert waited: read it, committed.
                None => DB::fetch_first(conn, read, named, ClaimRow::from_row).await?,
            };
            Ok(LeaseWritten::Row(row))
        }
        LeaseWrite::Update(update) => DB::execute(conn, update, named)
            .await
            .map(LeaseWritten::Changed),
    }
}

impl<DB: Backend> GroupCommit for OnSqlx<DB> {
    type Error = sqlx::Error;
    type Tx = (Transaction<'static, DB>, bool);

    async fn apply(&self, write: LeaseWrite) -> Result<LeaseWritten, sqlx::Error> {
        apply_alone(&self.0, write).await
    }

    async fn begin(&self) -> Result<Self::Tx, sqlx::Error> {
        Ok((crate::driver::begin_claim(&self.0).await?, named(&self.0)))
    }

    async fn apply_in(
        (tx, named): &mut Self::Tx,
        write: LeaseWrite,
    ) -> Result<LeaseWritten, sqlx::Error> {
        apply::<DB>(tx, write, *named).await
    }

    async fn commit((tx, _): Self::Tx) -> Result<(), sqlx::Error> {
        tx.commit().await
    }

    fn group_failed(why: String) -> sqlx::Error {
        sqlx::Error::Protocol(why)
    }
}

/// Applies `write` on `pool`: on SQLite with the writes that arrive meanwhile, in one
/// transaction; elsewhere at once.
pub(super) async fn write<DB: Backend>(
    pool: &Pool<DB>,
    write: LeaseWrite,
) -> Result<LeaseWritten, sqlx::Error> {
    if DB::DIALECT != Dialect::Sqlite {
        return apply_alone(pool, write).await;
    }
    idem_sql::write_grouped(&OnSqlx(pool.clone()), identity(pool), write).await
}

/// `write` on a connection of `pool`, on its own.
async fn apply_alone<DB: Backend>(
    pool: &Pool<DB>,
    write: LeaseWrite,
) -> Result<LeaseWritten, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    apply::<DB>(&mut conn, write, named(pool)).await
}
