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

/// Set to `1` to use the MySQL 8 family's statements on any MySQL-protocol server.
pub const FORCE_MYSQL8_ENV: &str = "IDEM_MYSQL_WITHOUT_RETURNING";

/// Set to `0` to claim on a Galera node without waiting for it to catch up: for deployments
/// that send every request of a key to the same node (and to measure what the wait costs).
pub const GALERA_SYNC_WAIT_ENV: &str = "IDEM_GALERA_SYNC_WAIT";

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
    let galera = scalar::<i64>(db, idem_sql::SELECT_WSREP_ON)
        .await
        .is_some_and(|on| on == 1)
        && std::env::var(GALERA_SYNC_WAIT_ENV).map_or(true, |v| v != "0");
    let _ = GALERA.set(galera);
    let without = *FORCED || {
        // Unknown (the query failed): MariaDB's statements, as before; a server without
        // `RETURNING` then fails the claim visibly instead of silently taking another path.
        scalar::<String>(db, idem_sql::SELECT_VERSION)
            .await
            .is_some_and(|v| !idem_sql::has_returning(&v))
    };
    let _ = WITHOUT_RETURNING.set(without);
}

/// The one value `sql` selects, or `None` when the query fails or returns nothing.
async fn scalar<T: sea_orm::TryGetable>(db: &DatabaseConnection, sql: &str) -> Option<T> {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .ok()
        .flatten()
        .and_then(|row| row.try_get_by_index::<T>(0).ok())
}
