//! The stores the database-facing rows run through (R1-R5, R7): SeaORM's and sqlx's on the
//! same database, and on PostgreSQL tokio-postgres's. The suite's handlers are written once, in `handlers!`, and
//! instantiated per connection type (`on_sea_orm`, `on_sqlx_sqlite`, `on_sqlx_postgres`,
//! `on_sqlx_mysql`), as tests/lease.rs does; `call!` (tests/common/stores.rs) dispatches a
//! case to its store. Each handler writes its two effect rows through the claim's
//! transaction as its store hands it to the body (`&DatabaseTransaction`, or the sqlx
//! connection used as `&mut *db`), so a write outside it, or half of one, shows as an odd
//! count in the same tables whichever store wrote it.

#![allow(dead_code, unreachable_pub)]

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection};

pub(crate) use crate::common::stores::{Conn, call};
use crate::connection_faults::{Fault, FaultAt};
use crate::isolation::{TenantAnswer, TenantCmd};
use crate::support::{Answer, Backend, Probe, Transfer, connect, stmt, unique};

/// Which store a case goes through; children of R2/R3 get it as `IDEM_REL_STORE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    SeaOrm,
    Sqlx,
    /// On PostgreSQL only.
    TokioPostgres,
}

impl Store {
    /// Every store, SeaORM's first.
    pub const ALL: [Self; 3] = [Self::SeaOrm, Self::Sqlx, Self::TokioPostgres];

    /// The stores that run on the database at `url`.
    pub fn on(url: &str) -> Vec<Self> {
        let postgres = backend_of(url) == "postgres";
        Self::ALL
            .into_iter()
            .filter(|store| *store != Self::TokioPostgres || postgres)
            .collect()
    }

    /// Its name in `IDEM_REL_STORE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SeaOrm => "sea-orm",
            Self::Sqlx => "sqlx",
            Self::TokioPostgres => "tokio-postgres",
        }
    }

    /// Parses `IDEM_REL_STORE`.
    pub fn parse(s: &str) -> Self {
        match s {
            "sea-orm" => Self::SeaOrm,
            "sqlx" => Self::Sqlx,
            "tokio-postgres" => Self::TokioPostgres,
            other => panic!("unknown store {other}"),
        }
    }
}

/// One test on one backend through one store. `db` is a SeaORM pool of the case's own: the
/// SeaORM store's connection, and what tests read through either way (its own pool, so a
/// count never waits behind the calls); `conn` says which store the calls go through.
#[derive(Clone)]
pub struct Case {
    /// `postgres (sea-orm)`, `sqlite (sqlx)` …
    pub name: String,
    pub store: Store,
    pub db: DatabaseConnection,
    pub conn: Conn,
}

/// The backend a URL names.
fn backend_of(url: &str) -> &'static str {
    if url.starts_with("sqlite:") {
        "sqlite"
    } else if url.starts_with("postgres") {
        "postgres"
    } else {
        "mysql"
    }
}

impl Case {
    /// A case on `url` through `store`, on pools of at most `max` connections. SeaORM's
    /// SQLite pool has one connection whatever `max` says (`crate::common::connect`); sqlx's
    /// has up to 4, as in the lease suite (SQLite serialises its writers anyway).
    pub async fn open(url: &str, store: Store, max: u32) -> Self {
        let db = connect(url, max).await;
        let backend = backend_of(url);
        let conn = match (store, backend) {
            (Store::SeaOrm, _) => Conn::SeaOrm,
            (Store::Sqlx, "sqlite") => Conn::SqlxSqlite(
                sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(max.clamp(1, 4))
                    .connect(url)
                    .await
                    .expect("sqlx connects to the run's database"),
            ),
            (Store::Sqlx, "postgres") => Conn::SqlxPostgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(max)
                    .connect(url)
                    .await
                    .expect("sqlx connects to the run's database"),
            ),
            (Store::TokioPostgres, _) => {
                Conn::TokioPostgres(crate::common::stores::deadpool_pool(url, max as usize))
            }
            (Store::Sqlx, _) => Conn::SqlxMySql(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(max)
                    .connect(url)
                    .await
                    .expect("sqlx connects to the run's database"),
            ),
        };
        Self {
            name: format!("{backend} ({})", store.as_str()),
            store,
            db,
            conn,
        }
    }

    /// Every store's case on backend `b`.
    pub async fn both(b: &Backend, max: u32) -> Vec<Self> {
        let mut cases = Vec::new();
        for store in Store::on(&b.url) {
            cases.push(Self::open(&b.url, store, max).await);
        }
        cases
    }

    /// The server's id of the one connection of a one-connection pool (0 on SQLite).
    pub async fn pool_connection_id(&self) -> i64 {
        let (postgres, mysql) = (
            "SELECT CAST(pg_backend_pid() AS BIGINT)",
            "SELECT CAST(CONNECTION_ID() AS SIGNED)",
        );
        match &self.conn {
            Conn::SeaOrm => {
                let sql = match self.db.get_database_backend() {
                    sea_orm::DbBackend::Postgres => postgres,
                    sea_orm::DbBackend::MySql => mysql,
                    _ => return 0,
                };
                self.db
                    .query_one_raw(stmt(&self.db, sql, vec![]))
                    .await
                    .expect("the pool's connection id")
                    .expect("a row")
                    .try_get_by_index(0)
                    .expect("an id")
            }
            Conn::SqlxSqlite(_) => 0,
            Conn::SqlxPostgres(pool) => sqlx::query_scalar(postgres)
                .fetch_one(pool)
                .await
                .expect("the pool's connection id"),
            Conn::SqlxMySql(pool) => sqlx::query_scalar(mysql)
                .fetch_one(pool)
                .await
                .expect("the pool's connection id"),
            Conn::TokioPostgres(pool) => pool
                .get()
                .await
                .expect("a connection")
                .query_one(postgres, &[])
                .await
                .expect("the pool's connection id")
                .get(0),
        }
    }

    /// Reads one integer on the calls' pool (on the one connection of a one-connection pool).
    pub async fn query_i64(&self, sql: &'static str) -> Result<i64, String> {
        match &self.conn {
            Conn::SeaOrm => {
                return self
                    .db
                    .query_one_raw(stmt(&self.db, sql, vec![]))
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| "no row".to_owned())?
                    .try_get_by_index::<i64>(0)
                    .map_err(|e| e.to_string());
            }
            Conn::SqlxSqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            Conn::SqlxPostgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            Conn::SqlxMySql(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            Conn::TokioPostgres(pool) => {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                let row = client.query_one(sql, &[]).await;
                return row.map(|row| row.get(0)).map_err(|e| e.to_string());
            }
        }
        .map_err(|e: sqlx::Error| e.to_string())
    }

    /// Runs `sql` unprepared on the calls' pool.
    pub async fn execute(&self, sql: &'static str) -> Result<(), String> {
        match &self.conn {
            Conn::SeaOrm => {
                return self
                    .db
                    .execute_unprepared(sql)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string());
            }
            Conn::SqlxSqlite(pool) => sqlx::raw_sql(sql).execute(pool).await.map(drop),
            Conn::SqlxPostgres(pool) => sqlx::raw_sql(sql).execute(pool).await.map(drop),
            Conn::SqlxMySql(pool) => sqlx::raw_sql(sql).execute(pool).await.map(drop),
            Conn::TokioPostgres(pool) => {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                return client.batch_execute(sql).await.map_err(|e| e.to_string());
            }
        }
        .map_err(|e: sqlx::Error| e.to_string())
    }

    /// Closes the calls' pool (the database becomes unreachable for them).
    pub async fn close(&self) {
        match &self.conn {
            Conn::SeaOrm => self.db.close_by_ref().await.expect("close"),
            Conn::SqlxSqlite(pool) => pool.close().await,
            Conn::SqlxPostgres(pool) => pool.close().await,
            Conn::SqlxMySql(pool) => pool.close().await,
            Conn::TokioPostgres(pool) => pool.close(),
        }
    }
}

/// The handlers, once per kind of connection: `$conn` is what they take (SeaORM's connection
/// or a sqlx pool), `$tx` what their body gets (the claim's transaction), `effect` writes one
/// effect row through it and `connection_id` reads the server's id of its connection.
macro_rules! handlers {
    (
        $module:ident,
        $conn:ty,
        $tx:ty,
        effect = |$db:ident, $run:ident, $key:ident, $label:ident, $execution:ident| $effect:expr,
        connection_id = |$cdb:ident| $id:expr $(,)?
    ) => {
        pub mod $module {
            use super::*;

            /// One effect row, in the claim's transaction.
            async fn effect(
                db: $tx,
                run: &str,
                key: &str,
                label: &str,
                execution: &str,
            ) -> Result<(), idem::Error> {
                let ($db, $run, $key, $label, $execution) = (db, run, key, label, execution);
                $effect
            }

            /// The server's id of the claim's connection (R5 kills it).
            async fn connection_id(db: $tx) -> i64 {
                let $cdb = db;
                $id
            }

            /// The handler of R1-R5: two effect rows per execution (a debit and a credit, so
            /// a partial write shows as an odd count), with named points between its steps.
            #[idempotent(scope = "rel.transfer", key = cmd.key, skip(probe))]
            pub async fn transfer(
                db: &$conn,
                cmd: Transfer,
                probe: &Probe,
            ) -> Result<Answer, idem::Error> {
                probe.at("after-claim").await;
                let execution = unique("exec");
                effect(db, &cmd.run, &cmd.key, "debit", &execution).await?;
                probe.at("mid-body").await;
                effect(db, &cmd.run, &cmd.key, "credit", &execution).await?;
                probe.at("before-commit").await;
                Ok(Answer {
                    key: cmd.key,
                    amount: cmd.amount,
                    execution,
                })
            }

            /// R4: a handler whose body runs no statement: every point a call can be
            /// dropped at is in idem's own ledger steps.
            #[idempotent(scope = "rel.claim-only", key = cmd.key, skip(probe))]
            pub async fn claim_only(
                db: &$conn,
                cmd: Transfer,
                probe: &Probe,
            ) -> Result<Answer, idem::Error> {
                let _ = db;
                probe.at("after-claim").await;
                Ok(Answer {
                    key: cmd.key,
                    amount: cmd.amount,
                    execution: unique("exec"),
                })
            }

            /// A handler that holds its claim for `pause` and writes nothing (R4: a call
            /// cancelled inside its body).
            #[idempotent(scope = "rel.outcome", key = key, skip(pause))]
            pub async fn paused(
                db: &$conn,
                key: String,
                pause: std::time::Duration,
            ) -> Result<u8, idem::Error> {
                let _ = db;
                tokio::time::sleep(pause).await;
                Ok(7)
            }

            /// R5: `transfer` whose connection `fault` kills before or after its writes.
            #[idempotent(scope = "rel.fault", key = cmd.key, skip(fault))]
            pub async fn faulty(
                db: &$conn,
                cmd: Transfer,
                fault: &Fault,
            ) -> Result<Answer, idem::Error> {
                if fault.at == Some(FaultAt::BeforeWrites) {
                    fault.strike(connection_id(db).await).await;
                }
                let execution = unique("exec");
                effect(db, &cmd.run, &cmd.key, "debit", &execution).await?;
                effect(db, &cmd.run, &cmd.key, "credit", &execution).await?;
                if fault.at == Some(FaultAt::BeforeRecord) {
                    fault.strike(connection_id(db).await).await;
                }
                Ok(Answer {
                    key: cmd.key,
                    amount: cmd.amount,
                    execution,
                })
            }

            /// R7: two effect rows labelled with the scope.
            async fn tenant_body(
                db: $tx,
                scope: &str,
                cmd: &TenantCmd,
            ) -> Result<TenantAnswer, idem::Error> {
                let execution = unique("exec");
                effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
                effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
                Ok(TenantAnswer {
                    tenant: cmd.tenant.clone(),
                    scope: scope.to_owned(),
                    execution,
                })
            }

            #[idempotent(scope = "rel.iso.a", key = cmd.key, principal = cmd.tenant)]
            pub async fn iso_a(db: &$conn, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
                tenant_body(db, "rel.iso.a", &cmd).await
            }

            #[idempotent(scope = "rel.iso.b", key = cmd.key, principal = cmd.tenant)]
            pub async fn iso_b(db: &$conn, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
                tenant_body(db, "rel.iso.b", &cmd).await
            }
        }
    };
}

handlers!(
    on_sea_orm,
    DatabaseConnection,
    &sea_orm::DatabaseTransaction,
    effect = |db, run, key, label, execution| {
        crate::support::effect(db, run, key, label, execution).await
    },
    connection_id = |db| {
        let sql = match db.get_database_backend() {
            sea_orm::DbBackend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT)",
            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED)",
        };
        db.query_one_raw(stmt(db, sql, vec![]))
            .await
            .expect("own connection id")
            .expect("a row")
            .try_get_by_index(0)
            .expect("an id")
    },
);

/// The sqlx handlers' statements, in `$p`'s placeholders; `$id` reads the connection's id.
macro_rules! sqlx_handlers {
    ($module:ident, $pool:ty, $tx:ty, $id:literal, $p1:literal, $p2:literal, $p3:literal, $p4:literal) => {
        handlers!(
            $module,
            $pool,
            $tx,
            effect = |db, run, key, label, execution| sqlx::query(concat!(
                "INSERT INTO idem_rel_effects (run_id, k, label, execution) VALUES (",
                $p1,
                ", ",
                $p2,
                ", ",
                $p3,
                ", ",
                $p4,
                ")"
            ))
            .bind(run)
            .bind(key)
            .bind(label)
            .bind(execution)
            .execute(&mut *db)
            .await
            .map(drop)
            .map_err(|e| idem::Error::store("writing an effect", e)),
            connection_id = |db| sqlx::query_scalar::<_, i64>($id)
                .fetch_one(&mut *db)
                .await
                .expect("own connection id"),
        );
    };
}

sqlx_handlers!(
    on_sqlx_sqlite,
    sqlx::SqlitePool,
    &mut sqlx::SqliteConnection,
    "SELECT 0",
    "?",
    "?",
    "?",
    "?"
);
sqlx_handlers!(
    on_sqlx_postgres,
    sqlx::PgPool,
    &mut sqlx::PgConnection,
    "SELECT CAST(pg_backend_pid() AS BIGINT)",
    "$1",
    "$2",
    "$3",
    "$4"
);
sqlx_handlers!(
    on_sqlx_mysql,
    sqlx::MySqlPool,
    &mut sqlx::MySqlConnection,
    "SELECT CAST(CONNECTION_ID() AS SIGNED)",
    "?",
    "?",
    "?",
    "?"
);

handlers!(
    on_tokio_postgres,
    idem::tokio_postgres::deadpool_postgres::Pool,
    &idem::tokio_postgres::deadpool_postgres::ClientWrapper,
    effect = |db, run, key, label, execution| db
        .execute(
            "INSERT INTO idem_rel_effects (run_id, k, label, execution) VALUES ($1, $2, $3, $4)",
            &[&run, &key, &label, &execution],
        )
        .await
        .map(drop)
        .map_err(|e| idem::Error::store("writing an effect", e)),
    connection_id = |db| db
        .query_one("SELECT CAST(pg_backend_pid() AS BIGINT)", &[])
        .await
        .expect("own connection id")
        .get(0),
);
