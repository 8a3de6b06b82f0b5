//! The stores a parametrised suite runs each case through (the behaviour, lease, completer,
//! outbox and reliability suites): SeaORM's, on the backend's connection, sqlx's, on a pool of
//! its own to the same database, and on PostgreSQL tokio-postgres's, on a deadpool pool of its
//! own. Each suite writes its handlers once per connection type, in modules `on_sea_orm`,
//! `on_sqlx_sqlite`, `on_sqlx_postgres`, `on_sqlx_mysql` and `on_tokio_postgres`.

use idem::tokio_postgres::deadpool_postgres;

/// Which store a case goes through.
#[derive(Clone)]
pub enum Conn {
    SeaOrm,
    SqlxSqlite(sqlx::SqlitePool),
    SqlxPostgres(sqlx::PgPool),
    SqlxMySql(sqlx::MySqlPool),
    TokioPostgres(deadpool_postgres::Pool),
}

impl Conn {
    /// sqlx's store, on a pool of its own to the database of backend `backend` at `url`
    /// (SQLite's of 4 connections). A database that cannot be reached fails the test.
    pub async fn sqlx(backend: &str, url: &str) -> Self {
        let failed = "sqlx connects to the test's database";
        match backend {
            "sqlite" => {
                let options = sqlx::sqlite::SqlitePoolOptions::new().max_connections(4);
                Self::SqlxSqlite(options.connect(url).await.expect(failed))
            }
            "postgres" => Self::SqlxPostgres(sqlx::PgPool::connect(url).await.expect(failed)),
            _ => Self::SqlxMySql(sqlx::MySqlPool::connect(url).await.expect(failed)),
        }
    }

    /// tokio-postgres's store, on a deadpool pool of its own (8 connections) to the
    /// PostgreSQL database at `url`.
    #[allow(dead_code)]
    pub fn tokio_postgres(url: &str) -> Self {
        Self::TokioPostgres(deadpool_pool(url, 8))
    }

    /// The name of a case through this store on backend `backend`.
    pub fn name(&self, backend: &'static str) -> &'static str {
        match self {
            Self::SeaOrm => backend,
            Self::SqlxSqlite(_) => "sqlite (sqlx)",
            Self::SqlxPostgres(_) => "postgres (sqlx)",
            Self::SqlxMySql(_) => "mysql (sqlx)",
            Self::TokioPostgres(_) => "postgres (tokio-postgres)",
        }
    }
}

/// Calls `handler` of the case's store (the suite's `on_*` module), with the case's
/// connection first: `$case.db` for SeaORM, the case's pool for sqlx.
#[allow(unused_macros)]
macro_rules! call {
    ($case:expr, $handler:ident($($arg:expr),* $(,)?)) => {
        match &$case.conn {
            Conn::SeaOrm => on_sea_orm::$handler(&$case.db, $($arg),*).await,
            Conn::SqlxSqlite(pool) => on_sqlx_sqlite::$handler(pool, $($arg),*).await,
            Conn::SqlxPostgres(pool) => on_sqlx_postgres::$handler(pool, $($arg),*).await,
            Conn::SqlxMySql(pool) => on_sqlx_mysql::$handler(pool, $($arg),*).await,
            Conn::TokioPostgres(pool) => on_tokio_postgres::$handler(pool, $($arg),*).await,
        }
    };
}
#[allow(unused_imports)]
pub(crate) use call;

/// A deadpool-postgres pool of up to `size` connections to the PostgreSQL database at `url`,
/// waiting at most 5 s for a connection, as a service would configure it.
#[allow(dead_code)]
pub fn deadpool_pool(url: &str, size: usize) -> deadpool_postgres::Pool {
    let config: idem::tokio_postgres::deadpool_postgres::tokio_postgres::Config =
        url.parse().expect("a PostgreSQL URL");
    let manager = deadpool_postgres::Manager::new(config, deadpool_postgres::tokio_postgres::NoTls);
    deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(std::time::Duration::from_secs(5)))
        .build()
        .expect("a deadpool-postgres pool")
}
