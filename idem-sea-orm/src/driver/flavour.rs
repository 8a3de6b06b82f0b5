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

use sea_orm::DatabaseConnection;

use idem_sql::MySqlServer;
pub use idem_sql::{FORCE_MYSQL8_ENV, GALERA_SYNC_WAIT_ENV};

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
