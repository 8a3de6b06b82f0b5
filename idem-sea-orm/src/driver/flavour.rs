//! Which server family speaks the MySQL protocol to this process: MariaDB 10.5+ (the claim
//! reads the row back with `RETURNING` in the same statement, and `reject` waits 0 s with
//! `SET STATEMENT`), or the MySQL 8 family (MySQL 8.0/8.4, Aurora MySQL, TiDB, Vitess,
//! MariaDB before 10.5): an upsert, then a locked read; `reject` waits at most 1 s.
//!
//! The family is learnt from `SELECT VERSION()` the first time a MySQL-protocol
//! transaction begins in the process, and holds for the process (one MySQL family per
//! process). [`FORCE_MYSQL8_ENV`] set to `1` picks the MySQL 8 family whatever the server
//! says: that is how the path is tested on MariaDB.
//!
//! A MariaDB node of a Galera cluster (`@@wsrep_on`, asked at the same time) replicates
//! asynchronously to readers: a node may not yet have applied what another node committed.
//! The statements that decide a claim then wait for the node to catch up first
//! (`SET STATEMENT wsrep_sync_wait = 7 FOR …`), so a duplicate sent to another node sees the
//! record, or the lease, that the first call committed ([`GALERA_SYNC_WAIT_ENV`] set to `0`
//! turns the wait off).

use std::sync::{LazyLock, OnceLock};

use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

use idem_sql::Flavour;
pub use idem_sql::{FORCE_MYSQL8_ENV, GALERA_SYNC_WAIT_ENV};

static WITHOUT_RETURNING: OnceLock<bool> = OnceLock::new();
static GALERA: OnceLock<bool> = OnceLock::new();

static FORCED: LazyLock<bool> =
    LazyLock::new(|| std::env::var(FORCE_MYSQL8_ENV).is_ok_and(|v| v == "1"));

/// Whether the MySQL-protocol server lacks `RETURNING` (as far as this process knows yet).
pub(crate) fn mysql_without_returning() -> bool {
    WITHOUT_RETURNING.get().copied().unwrap_or(*FORCED)
}

/// Whether the MySQL-protocol server is a node of a Galera cluster (as far as this process
/// knows yet).
pub(crate) fn galera() -> bool {
    GALERA.get().copied().unwrap_or(false)
}

/// Learns the family from the server's version, once per process.
pub(crate) async fn detect(db: &DatabaseConnection) {
    if WITHOUT_RETURNING.get().is_some() {
        return;
    }
    let wsrep_on = scalar::<i64>(db, idem_sql::SELECT_WSREP_ON).await;
    let version = scalar::<String>(db, idem_sql::SELECT_VERSION).await;
    let flavour = idem_sql::mysql_flavour(version.as_deref(), wsrep_on);
    let _ = GALERA.set(flavour == Flavour::Galera);
    let _ = WITHOUT_RETURNING.set(flavour == Flavour::MySql8);
}

/// The one value `sql` selects, or `None` when the query fails or returns nothing.
async fn scalar<T: sea_orm::TryGetable>(db: &DatabaseConnection, sql: &str) -> Option<T> {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .ok()
        .flatten()
        .and_then(|row| row.try_get_by_index::<T>(0).ok())
}
