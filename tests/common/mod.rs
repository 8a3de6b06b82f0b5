//! Shared test plumbing, the one place every test binary gets its databases from: the
//! backend matrix ([`SERVERS`], [`connect`], [`connect_all`]), the table-creation loop
//! ([`prepare_with`]), and an `effects` table the handlers write to, so tests count side
//! effects in the database rather than trusting return values ([`Backend::assert_effects`]),
//! and a [`Gate`] that holds a call inside its body. `isolated` gives a test databases of its
//! own, `http` sends requests to a router, `brokers` starts a nats-server or RabbitMQ node of a
//! test's own, `pgbouncer` a PgBouncer in transaction mode, `link` a TCP link to a server that a
//! test can cut; the reliability suite adds its tables in `tests/reliability/support.rs`.
//!
//! SQLite always runs (a fresh file per test). PostgreSQL and MySQL/MariaDB run when
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` are set; a set but unreachable server
//! FAILS the test, it is never skipped. `IDEM_TEST_SKIP_SQLITE=1` leaves SQLite's cases of the
//! backend matrix out when a server is named: CI's server steps set it, SQLite's cases having
//! run in the README's test command already.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod brokers;
pub mod crash;
pub mod http;
pub mod isolated;
pub mod link;
pub mod pgbouncer;
pub mod stores;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idem::sea_orm::placeholders;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};
use tokio::sync::Semaphore;

/// One database of the run.
pub struct Backend {
    pub name: &'static str,
    /// How another pool or process reaches the same database.
    pub url: String,
    pub db: DatabaseConnection,
}

impl Backend {
    /// Asserts that run `run` has `expected` committed effect rows here; `what` says why.
    pub async fn assert_effects(&self, run: &str, expected: i64, what: &str) {
        assert_eq!(
            effects(&self.db, run).await,
            expected,
            "{}: {what}",
            self.name
        );
    }
}

/// Holds a call inside its body until the test lets it go: the body calls [`Gate::pass`],
/// the test waits for [`Gate::entered`], then calls [`Gate::release`]. Clones share the gate.
#[derive(Clone, Debug)]
pub struct Gate {
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            entered: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Gate {
    /// In the body: says it has entered, and waits to be released.
    pub async fn pass(&self) {
        self.entered.add_permits(1);
        self.release.acquire().await.expect("open").forget();
    }

    /// In the test: waits until a body has entered.
    pub async fn entered(&self) {
        self.entered.acquire().await.expect("open").forget();
    }

    /// In the test: lets one body go on.
    pub fn release(&self) {
        self.release.add_permits(1);
    }
}

/// The servers a run may cover: `(backend name, environment variable with its URL)`.
pub const SERVERS: [(&str, &str); 2] = [
    ("postgres", "IDEM_TEST_POSTGRES_URL"),
    ("mysql", "IDEM_TEST_MYSQL_URL"),
];

/// The servers this run covers: those whose variable is set, with their URLs.
pub fn server_urls() -> Vec<(&'static str, String)> {
    SERVERS
        .iter()
        .filter_map(|&(name, var)| std::env::var(var).ok().map(|url| (name, url)))
        .collect()
}

/// Whether the backend matrix includes SQLite: always, unless `IDEM_TEST_SKIP_SQLITE=1` and a
/// server is named (a run with no backend at all would prove nothing).
pub fn with_sqlite() -> bool {
    std::env::var("IDEM_TEST_SKIP_SQLITE").map_or(true, |v| v != "1") || server_urls().is_empty()
}

/// A string unique to this process and call, for keys and run ids.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}-{}-{nanos:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The URL of a fresh SQLite file in the system temp directory, named `<prefix>-<unique>.db`.
pub fn sqlite_url(prefix: &str) -> String {
    let path = std::env::temp_dir().join(format!("{}.db", unique(prefix)));
    format!("sqlite://{}?mode=rwc", path.display())
}

/// A pool on `url` with at most `max` connections; SQLite keeps SeaORM's default pool of
/// one connection whatever `max` says. A server that was named but cannot be reached FAILS.
pub async fn connect(url: &str, max: u32) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    options.sqlx_logging(false);
    if !url.starts_with("sqlite:") {
        options.max_connections(max);
    }
    match Database::connect(options).await {
        Ok(db) => db,
        Err(e) => panic!("cannot connect to {url} (set by the environment, so this fails): {e}"),
    }
}

/// Every database of this run, unprepared: a fresh SQLite file (`<prefix>-*.db`) always,
/// and each server whose variable is set, with pools of at most `max` connections.
pub async fn connect_all(prefix: &str, max: u32) -> Vec<Backend> {
    let mut all = Vec::new();
    if with_sqlite() {
        let url = sqlite_url(prefix);
        all.push(Backend {
            name: "sqlite",
            db: connect(&url, max).await,
            url,
        });
    }
    for (name, url) in server_urls() {
        all.push(Backend {
            name,
            db: connect(&url, max).await,
            url,
        });
    }
    all
}

/// A fresh SQLite file database (with SeaORM's default pool of one connection), prepared.
pub async fn sqlite() -> DatabaseConnection {
    let db = connect(&sqlite_url("idem-test"), 1).await;
    prepare(&db).await;
    db
}

/// Every backend this run covers, with the ledger and the effects table in place.
pub async fn backends() -> Vec<Backend> {
    let all = connect_all("idem-test", 24).await;
    for b in &all {
        prepare(&b.db).await;
    }
    all
}

/// Creates the ledger and the effects table; tolerant of another test doing it at once.
pub async fn prepare(db: &DatabaseConnection) {
    let effects = match db.get_database_backend() {
        DbBackend::Postgres => {
            "CREATE TABLE IF NOT EXISTS idem_test_effects (id BIGSERIAL PRIMARY KEY, run_id VARCHAR(200) NOT NULL, label VARCHAR(255) NOT NULL, amount BIGINT NOT NULL)"
        }
        DbBackend::MySql => {
            "CREATE TABLE IF NOT EXISTS idem_test_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, run_id VARCHAR(200) NOT NULL, label VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, INDEX (run_id))"
        }
        _ => {
            "CREATE TABLE IF NOT EXISTS idem_test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, label TEXT NOT NULL, amount INTEGER NOT NULL)"
        }
    };
    prepare_with(db, &[effects]).await;
}

/// Creates the ledger, as a service starting does (`create_tables` itself copes with tests
/// creating it at once, so no retry here hides its failure), then runs `ddl` (`CREATE TABLE
/// IF NOT EXISTS` statements) for the test's own tables that do not exist yet
/// ([`until_created`]). A table that exists gets no DDL at all: on a Galera cluster even
/// `CREATE TABLE IF NOT EXISTS` of an existing table is replicated and aborts every
/// transaction writing to it.
pub async fn prepare_with(db: &DatabaseConnection, ddl: &[&str]) {
    idem::sea_orm::create_tables(db)
        .await
        .expect("create idem's tables");
    until_created("the test tables", || async {
        let mut ok = true;
        for sql in ddl {
            let table = sql
                .strip_prefix("CREATE TABLE IF NOT EXISTS ")
                .and_then(|rest| rest.split_whitespace().next());
            if let Some(table) = table {
                let probe = format!("SELECT 1 FROM {table} WHERE 1 = 0");
                if db.execute_unprepared(&probe).await.is_ok() {
                    continue;
                }
            }
            ok &= db.execute_unprepared(sql).await.is_ok();
        }
        ok
    })
    .await;
}

/// Runs `create` (which says whether its tables now exist) until it succeeds, with a growing
/// pause: tests that start at once create the same tables at once, and concurrent `CREATE
/// TABLE IF NOT EXISTS` statements race on PostgreSQL's catalog (one fails with a unique
/// violation on `pg_type`). The next try finds the table the other test made.
pub async fn until_created<F, Fut>(what: &str, mut create: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for attempt in 0..10_u64 {
        if create().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50 * (attempt + 1))).await;
    }
    panic!("cannot create {what}");
}

/// Writes one effect row (what a handler's business write looks like).
pub async fn insert_effect<C: ConnectionTrait>(db: &C, run_id: &str, label: &str, amount: i64) {
    let backend = db.get_database_backend();
    let sql = placeholders(
        backend,
        "INSERT INTO idem_test_effects (run_id, label, amount) VALUES (?, ?, ?)",
    );
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        sql,
        [run_id.into(), label.into(), amount.into()],
    ))
    .await
    .expect("insert effect");
}

/// How many effect rows a run wrote, as `db` sees them: on the pool, the committed ones; in a
/// transaction, its own uncommitted ones too.
pub async fn effects<C: ConnectionTrait>(db: &C, run_id: &str) -> i64 {
    let backend = db.get_database_backend();
    let sql = placeholders(
        backend,
        "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = ?",
    );
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            sql,
            [run_id.into()],
        ))
        .await
        .expect("count effects")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("count")
}

/// How many ledger records hold `key` (in any scope).
pub async fn ledger_rows(db: &DatabaseConnection, key: &str) -> i64 {
    let backend = db.get_database_backend();
    let sql = placeholders(
        backend,
        "SELECT COUNT(*) FROM idem_ledger WHERE idem_key = ?",
    );
    let row = db
        .query_one_raw(Statement::from_sql_and_values(backend, sql, [key.into()]))
        .await
        .expect("count ledger")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("count")
}
