//! Which server a store talks to, as far as its statements differ, and the two questions
//! that tell the MySQL-protocol servers apart.

use std::sync::Mutex;

/// The SQL dialect a statement is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// PostgreSQL: numbered placeholders (`$1`), `RETURNING`, `FOR UPDATE SKIP LOCKED`.
    Postgres,
    /// The MySQL protocol: MariaDB and the MySQL 8 family ([`Flavour`] tells them apart).
    MySql,
    /// SQLite.
    Sqlite,
}

/// The server a store talks to, as far as its statements differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flavour {
    /// PostgreSQL.
    Postgres,
    /// MariaDB 10.5 or later: the claim reads the row back with `RETURNING` in the same
    /// statement, and `reject` waits 0 s with `SET STATEMENT`.
    MariaDb,
    /// A MariaDB node of a Galera cluster: MariaDB's statements, those that decide a claim
    /// first waiting for the node to catch up with the cluster.
    Galera,
    /// The MySQL 8 family (MySQL 8.0/8.4, Aurora MySQL, TiDB, Vitess, MariaDB before 10.5):
    /// an upsert, then a locked read; `reject` waits at most 1 s.
    MySql8,
    /// SQLite.
    Sqlite,
}

impl Flavour {
    /// The dialect the flavour's statements are written in.
    pub const fn dialect(self) -> Dialect {
        match self {
            Flavour::Postgres => Dialect::Postgres,
            Flavour::MariaDb | Flavour::Galera | Flavour::MySql8 => Dialect::MySql,
            Flavour::Sqlite => Dialect::Sqlite,
        }
    }
}

/// Asked of a MySQL-protocol server: `1` on a node of a Galera cluster (only MariaDB knows the
/// variable; elsewhere the query fails, which says "no").
pub const SELECT_WSREP_ON: &str = "SELECT @@wsrep_on";

/// Asked of a MySQL-protocol server: its version, for [`has_returning`].
pub const SELECT_VERSION: &str = "SELECT VERSION()";

/// Set to `1` to use the MySQL 8 family's statements on any MySQL-protocol server: that is how
/// that path is tested on MariaDB.
pub const FORCE_MYSQL8_ENV: &str = "IDEM_MYSQL_WITHOUT_RETURNING";

/// Set to `0` to claim on a Galera node without waiting for it to catch up: for deployments
/// that send every request of a key to the same node (and to measure what the wait costs).
/// The node then runs MariaDB's statements, the lease's fence a locked read too: enough where
/// a key's takeover runs on the node that holds its locks.
pub const GALERA_SYNC_WAIT_ENV: &str = "IDEM_GALERA_SYNC_WAIT";

/// On a Galera node, what a statement that decides a claim or fences a lease first waits for:
/// the node to have applied every write the cluster committed before it (reads, updates and
/// inserts), as `SET STATEMENT {GALERA_SYNC_WAIT} FOR …`.
pub(crate) const GALERA_SYNC_WAIT: &str = "wsrep_sync_wait = 7";

/// The flavour of a MySQL-protocol server, from the answers to [`SELECT_VERSION`] and
/// [`SELECT_WSREP_ON`] (`None` where the query failed) and the two environment switches.
/// An unknown version keeps MariaDB's statements: a server without `RETURNING` then fails
/// the claim visibly instead of silently taking another path.
pub fn mysql_flavour(version: Option<&str>, wsrep_on: Option<i64>) -> Flavour {
    let forced = std::env::var(FORCE_MYSQL8_ENV).is_ok_and(|v| v == "1");
    if forced || version.is_some_and(|v| !has_returning(v)) {
        return Flavour::MySql8;
    }
    let sync_wait = std::env::var(GALERA_SYNC_WAIT_ENV).map_or(true, |v| v != "0");
    if wsrep_on == Some(1) && sync_wait {
        Flavour::Galera
    } else {
        Flavour::MariaDb
    }
}

/// A MySQL-protocol server by its address (`host:port/database`), and the family this process
/// learnt of it. Both stores ask a server once, when a claim first needs to know, whichever
/// pool or store reaches it: the family is a fact of the server, not of the process (a
/// service may talk to MariaDB and to MySQL 8), nor of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MySqlServer(String);

/// The family of each server this process asked.
static LEARNT: Mutex<Vec<(MySqlServer, Flavour)>> = Mutex::new(Vec::new());

impl MySqlServer {
    /// The server at `host:port`, database `database`.
    pub fn new(host: &str, port: u16, database: Option<&str>) -> Self {
        MySqlServer(format!("{host}:{port}/{}", database.unwrap_or_default()))
    }

    /// The family learnt of this server, if it was asked already.
    pub fn learnt(&self) -> Option<Flavour> {
        let learnt = LEARNT.lock().unwrap_or_else(|e| e.into_inner());
        learnt.iter().find(|(s, _)| s == self).map(|(_, f)| *f)
    }

    /// The family of this server from its answers to [`SELECT_VERSION`] and
    /// [`SELECT_WSREP_ON`] ([`mysql_flavour`]), kept for the next claim only if the server
    /// answered: a server that is down now says nothing yet.
    pub fn learn(&self, version: Option<&str>, wsrep_on: Option<i64>) -> Flavour {
        let flavour = mysql_flavour(version, wsrep_on);
        if version.is_some() {
            let mut learnt = LEARNT.lock().unwrap_or_else(|e| e.into_inner());
            if !learnt.iter().any(|(s, _)| s == self) {
                learnt.push((self.clone(), flavour));
            }
        }
        flavour
    }
}

/// Whether a `VERSION()` string is MariaDB 10.5 or later (`10.11.19-MariaDB-0+deb12u1`).
pub fn has_returning(version: &str) -> bool {
    if !version.contains("MariaDB") {
        return false;
    }
    // Some proxies still prefix the old replication marker.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut parts = version
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (10, 5)
}

#[cfg(test)]
mod tests {
    use super::has_returning;

    #[test]
    fn versions() {
        assert!(has_returning("10.11.19-MariaDB-0+deb12u1"));
        assert!(has_returning("11.4.2-MariaDB"));
        assert!(has_returning("5.5.5-10.6.12-MariaDB"));
        assert!(!has_returning("10.4.32-MariaDB"));
        assert!(!has_returning("8.0.36"));
        assert!(!has_returning("8.0.mysql_aurora.3.05.2"));
        assert!(!has_returning("8.0.11-TiDB-v7.5.0"));
    }
}
