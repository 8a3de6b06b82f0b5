//! Shared test plumbing: the backend matrix and an `effects` table the handlers write to, so
//! tests count side effects in the database rather than trusting return values.
//!
//! SQLite always runs (a fresh file per test). PostgreSQL and MySQL/MariaDB run when
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` are set; a set but unreachable server
//! FAILS the test, it is never skipped.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod isolated;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idem::sea_orm::placeholders;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};

pub struct Backend {
    pub name: &'static str,
    pub db: DatabaseConnection,
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

async fn connect(url: &str, max: u32) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    options.sqlx_logging(false).max_connections(max);
    match Database::connect(options).await {
        Ok(db) => db,
        Err(e) => panic!("cannot connect to {url} (set by the environment, so this fails): {e}"),
    }
}

/// A fresh SQLite file database (with SeaORM's default pool of one connection).
pub async fn sqlite() -> DatabaseConnection {
    let path = std::env::temp_dir().join(format!("{}.db", unique("idem-test")));
    let db = Database::connect(format!("sqlite://{}?mode=rwc", path.display()))
        .await
        .expect("sqlite file");
    prepare(&db).await;
    db
}

/// Every backend this run covers, with the ledger and the effects table in place.
pub async fn backends() -> Vec<Backend> {
    let mut all = vec![Backend {
        name: "sqlite",
        db: sqlite().await,
    }];
    for (name, var) in [
        ("postgres", "IDEM_TEST_POSTGRES_URL"),
        ("mysql", "IDEM_TEST_MYSQL_URL"),
    ] {
        if let Ok(url) = std::env::var(var) {
            let db = connect(&url, 24).await;
            prepare(&db).await;
            all.push(Backend { name, db });
        }
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
    for attempt in 0..5 {
        let ledger = idem::sea_orm::create_tables(db).await;
        let table = db.execute_unprepared(effects).await;
        if ledger.is_ok() && table.is_ok() {
            return;
        }
        // Concurrent CREATE TABLE IF NOT EXISTS can race on PostgreSQL's catalog.
        tokio::time::sleep(std::time::Duration::from_millis(50 * (attempt + 1))).await;
    }
    panic!("cannot create the test tables");
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

/// How many effect rows a run wrote (committed ones only: a fresh statement on the pool).
pub async fn effects(db: &DatabaseConnection, run_id: &str) -> i64 {
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
