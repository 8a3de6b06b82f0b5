//! Lease mode's one-statement writes on a SeaORM connection, committed in groups on SQLite
//! ([`idem_sql::write_grouped`]: the queue, who leads and who waits): how one write, and a
//! group in one transaction, are applied here.

use idem_sql::{ClaimRow, GroupCommit, LeaseWrite, LeaseWritten};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, RuntimeErr,
};

use crate::atomic::begin;
use crate::driver::{Sql, fetch_first, statement};

/// A SeaORM connection as the group commit applies writes on it.
#[derive(Clone)]
struct OnSeaOrm(DatabaseConnection);

async fn apply<C: ConnectionTrait>(c: &C, write: LeaseWrite) -> Result<LeaseWritten, DbErr> {
    let sql: &Sql = crate::driver::of(c.get_database_backend());
    match write {
        LeaseWrite::Claim { claim, read } => {
            let row = match fetch_first(c, sql, claim, ClaimRow::from_row).await? {
                Some(row) => Some(row),
                None => fetch_first(c, sql, read, ClaimRow::from_row).await?,
            };
            Ok(LeaseWritten::Row(row))
        }
        LeaseWrite::Update(update) => c
            .execute_raw(statement(sql, update))
            .await
            .map(|done| LeaseWritten::Changed(done.rows_affected())),
    }
}

impl GroupCommit for OnSeaOrm {
    type Error = DbErr;
    type Tx = DatabaseTransaction;

    async fn apply(&self, write: LeaseWrite) -> Result<LeaseWritten, DbErr> {
        apply(&self.0, write).await
    }

    async fn begin(&self) -> Result<DatabaseTransaction, DbErr> {
        begin(&self.0).await
    }

    async fn apply_in(
        tx: &mut DatabaseTransaction,
        write: LeaseWrite,
    ) -> Result<LeaseWritten, DbErr> {
        apply(&*tx, write).await
    }

    async fn commit(tx: DatabaseTransaction) -> Result<(), DbErr> {
        tx.commit().await
    }

    fn group_failed(why: String) -> DbErr {
        DbErr::Conn(RuntimeErr::Internal(why))
    }
}

/// The identity of `db`'s pool (its clones share it), one group queue each.
fn pool_identity(db: &DatabaseConnection) -> usize {
    #[cfg(feature = "sqlite")]
    if let sea_orm::DatabaseConnectionType::SqlxSqlitePoolConnection(_) = &db.inner {
        return std::ptr::from_ref(db.get_sqlite_connection_pool().options()) as usize;
    }
    // Not a pool of its own (a mock, a proxy): one queue for all of them.
    let _ = db;
    0
}

/// Applies `write` on `db`: on SQLite with the writes that arrive meanwhile, in one
/// transaction; elsewhere at once.
pub(crate) async fn write(
    db: &DatabaseConnection,
    write: LeaseWrite,
) -> Result<LeaseWritten, DbErr> {
    if db.get_database_backend() != DbBackend::Sqlite {
        return apply(db, write).await;
    }
    idem_sql::write_grouped(&OnSeaOrm(db.clone()), pool_identity(db), write).await
}
