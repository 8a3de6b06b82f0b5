//! Which server family speaks the MySQL protocol on a connection: MariaDB 10.5+ (the claim
//! reads the row back with `RETURNING` in the same statement, and `reject` waits 0 s with
//! `SET STATEMENT`), or the MySQL 8 family (MySQL 8.0/8.4, Aurora MySQL, TiDB, Vitess,
//! MariaDB before 10.5): an upsert, then a locked read; `reject` waits at most 1 s.
//!
//! Only the claim's statements differ between the families ([`idem_sql::Sql::common`] has the
//! rest), so only a claim asks. The family is learnt from `SELECT VERSION()` the first time a
//! claim on a server needs it, and kept for that server ([`MySqlServer`]: its address), shared
//! with the sqlx store: one process may talk to MariaDB and to MySQL 8. A claim nested in
//! another call's transaction asks that transaction (two small queries), which does not say
//! which server it is on. [`FORCE_MYSQL8_ENV`] set to `1` picks the MySQL 8 family whatever
//! the server says: that is how the path is tested on MariaDB.
//!
//! A MariaDB node of a Galera cluster (`@@wsrep_on`, asked at the same time) replicates
//! asynchronously to readers: a node may not yet have applied what another node committed.
//! The statements that decide a claim then wait for the node to catch up first
//! (`SET STATEMENT wsrep_sync_wait = 7 FOR …`), so a duplicate sent to another node sees the
//! record, or the lease, that the first call committed ([`GALERA_SYNC_WAIT_ENV`] set to `0`
//! turns the wait off).

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};

pub use idem_sql::{FORCE_MYSQL8_ENV, GALERA_SYNC_WAIT_ENV};
use idem_sql::{Flavour, MySqlServer};

/// The flavour of the server `db` talks to, asked of it the first time on the MySQL protocol.
pub(crate) async fn of(db: &DatabaseConnection) -> Flavour {
    match db.get_database_backend() {
        DbBackend::Postgres => Flavour::Postgres,
        DbBackend::MySql => {
            let server = server(db);
            if let Some(flavour) = server.as_ref().and_then(MySqlServer::learnt) {
                return flavour;
            }
            let (version, wsrep_on) = ask(db).await;
            match server {
                Some(server) => server.learn(version.as_deref(), wsrep_on),
                None => idem_sql::mysql_flavour(version.as_deref(), wsrep_on),
            }
        }
        _ => Flavour::Sqlite,
    }
}

/// The flavour of the server `tx` (an open transaction: `C` is SeaORM's transaction) runs on,
/// asked of it on the MySQL protocol: a transaction does not say which server it is on.
pub(crate) async fn of_transaction<C: ConnectionTrait>(tx: &C) -> Flavour {
    match tx.get_database_backend() {
        DbBackend::Postgres => Flavour::Postgres,
        DbBackend::MySql => {
            let (version, wsrep_on) = ask(tx).await;
            idem_sql::mysql_flavour(version.as_deref(), wsrep_on)
        }
        _ => Flavour::Sqlite,
    }
}

/// The MySQL server of `db`'s pool; `None` for a connection of another kind (a proxy or a
/// mock), whose family is asked each time.
pub(crate) fn server(db: &DatabaseConnection) -> Option<MySqlServer> {
    #[cfg(feature = "mysql")]
    if let sea_orm::DatabaseConnectionType::SqlxMySqlPoolConnection(_) = &db.inner {
        let options = db.get_mysql_connection_pool().connect_options();
        return Some(MySqlServer::new(
            options.get_host(),
            options.get_port(),
            options.get_database(),
        ));
    }
    let _ = db;
    None
}

/// The server's answers to [`idem_sql::SELECT_VERSION`] and [`idem_sql::SELECT_WSREP_ON`].
async fn ask<C: ConnectionTrait>(db: &C) -> (Option<String>, Option<i64>) {
    let wsrep_on = scalar::<C, i64>(db, idem_sql::SELECT_WSREP_ON).await;
    let version = scalar::<C, String>(db, idem_sql::SELECT_VERSION).await;
    (version, wsrep_on)
}

/// The one value `sql` selects, or `None` when the query fails or returns nothing.
async fn scalar<C: ConnectionTrait, T: sea_orm::TryGetable>(db: &C, sql: &str) -> Option<T> {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .ok()
        .flatten()
        .and_then(|row| row.try_get_by_index::<T>(0).ok())
}
