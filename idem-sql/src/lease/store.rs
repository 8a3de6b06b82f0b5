//! Lease mode's one-statement writes on [`SqlStore`], once for every driver: at once, or on
//! SQLite committed in groups ([`write_grouped`]: the queue, who leads and who waits) through
//! the store's [`GroupCommit`].

use super::group_commit::{GroupCommit, write_grouped};
use super::{LeaseWrite, LeaseWritten};
use crate::driver::fetch_first;
use crate::store::SqlStore;
use crate::{Begin, ClaimRow, Connection, Dialect, Driver, Fault, Transaction};

impl<D: Driver> SqlStore<D> {
    /// Applies `write`: on SQLite with the writes that arrive meanwhile, in one transaction;
    /// elsewhere at once.
    pub async fn write_lease(&self, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        if self.driver().dialect() != Dialect::Sqlite {
            return self.apply(write).await;
        }
        // A handle that is not a pool of its own (a mock, a proxy) shares one queue.
        let pool = self.driver().identity().unwrap_or(0);
        write_grouped(self, pool, write).await
    }
}

/// Applies `write` on `conn`.
async fn apply<C: Connection>(
    conn: &mut C,
    write: LeaseWrite,
) -> Result<LeaseWritten, Fault<C::Error>> {
    match write {
        LeaseWrite::Claim { claim, read } => {
            let row = match fetch_first(conn, claim, ClaimRow::from_row).await? {
                Some(row) => Some(row),
                // SQLite's `DO NOTHING` returns no row; nor does PostgreSQL's for a row
                // committed while its insert waited: read it, committed.
                None => fetch_first(conn, read, ClaimRow::from_row).await?,
            };
            Ok(LeaseWritten::Row(row))
        }
        LeaseWrite::Update(update) => conn
            .execute(update)
            .await
            .map(LeaseWritten::Changed)
            .map_err(Fault::Db),
    }
}

impl<D: Driver> GroupCommit for SqlStore<D> {
    type Error = Fault<D::Error>;
    type Tx = D::Tx;

    async fn apply(&self, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        let mut conn = self.driver().acquire().await.map_err(Fault::Db)?;
        apply(&mut conn, write).await
    }

    async fn begin(&self) -> Result<D::Tx, Fault<D::Error>> {
        self.driver().begin(Begin::Write).await.map_err(Fault::Db)
    }

    async fn apply_in(tx: &mut D::Tx, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        apply(tx, write).await
    }

    async fn commit(tx: D::Tx) -> Result<(), Fault<D::Error>> {
        tx.commit().await.map_err(Fault::Db)
    }

    fn group_failed(why: String) -> Fault<D::Error> {
        Fault::Group(why)
    }
}
