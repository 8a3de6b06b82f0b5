//! The sqlx store's own cases (issue 31 item 1): `#[idempotent]` on functions whose connection
//! is a sqlx pool, the body's `sqlx::query(..).execute(&mut *db)` in the claim's transaction.
//! Atomic mode's semantics (claims, replays, final and transient errors, duplicates, expiry)
//! run through both stores in `tests/behaviour.rs`, lease mode in `tests/lease.rs`; here, on
//! every backend of the run (SQLite always; PostgreSQL and MariaDB when their URL is set),
//! what only sqlx has: nested calls (`Conn`), guarded transitions (`StateTable`), idem's schema
//! as a sqlx migration, PgBouncer, an unreachable server, a lease call inside an atomic body on
//! SQLite, an earlier version's SQLite ledger. Each counts the effect rows that committed, never trusting return values.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::link::Link;
use common::pgbouncer::PgBouncer;
use common::{server_urls, sqlite_url, unique};
use idem::{ErrorKind, FinalError, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pay {
    key: String,
    run: String,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum PayError {
    #[serde(skip)]
    Idem(ErrorKind),
    /// Final: recorded and replayed, the body's writes undone.
    Declined,
    /// Transient: rolls back, a retry runs again.
    Flaky,
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e.kind())
    }
}

impl FinalError for PayError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined)
    }
}

/// An order's state, declared once; stored as an integer (sqlx's `Type` for `i32`, as
/// `#[derive(sqlx::Type)] #[repr(i32)]` would make it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, idem::StateMachine)]
#[transitions(Pending -> Paid, Pending -> Cancelled)]
enum Status {
    Pending = 0,
    Paid = 1,
    Cancelled = 2,
}

impl<DB: sqlx::Database> sqlx::Type<DB> for Status
where
    i32: sqlx::Type<DB>,
{
    fn type_info() -> DB::TypeInfo {
        <i32 as sqlx::Type<DB>>::type_info()
    }
    fn compatible(ty: &DB::TypeInfo) -> bool {
        <i32 as sqlx::Type<DB>>::compatible(ty)
    }
}

impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for Status
where
    i32: sqlx::Encode<'q, DB>,
{
    fn encode_by_ref(
        &self,
        buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <i32 as sqlx::Encode<'q, DB>>::encode_by_ref(&(*self as i32), buf)
    }
}

impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for Status
where
    i32: sqlx::Decode<'r, DB>,
{
    fn decode(
        value: <DB as sqlx::Database>::ValueRef<'r>,
    ) -> Result<Self, sqlx::error::BoxDynError> {
        match <i32 as sqlx::Decode<'r, DB>>::decode(value)? {
            0 => Ok(Self::Pending),
            1 => Ok(Self::Paid),
            2 => Ok(Self::Cancelled),
            other => Err(format!("no order status {other}").into()),
        }
    }
}

/// A request to move an order: `pay` or `cancel`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Move {
    key: String,
    order: String,
    to: String,
}

/// The database of a pool type, for naming `idem::sqlx::Conn<'_, DB>` in the suite.
trait PoolOf {
    type Db: idem::sqlx::Backend;
}

impl<DB: idem::sqlx::Backend> PoolOf for sqlx::Pool<DB> {
    type Db = DB;
}

/// What the outer body does after its nested call.
#[derive(Clone, Copy, Debug, Serialize)]
enum Then {
    Answer,
    Fail,
}

/// The cases, once, for the pool type `$pool` whose statements use `$p1`..`$p3` as their
/// placeholders; `$connect` makes the pool for a test.
macro_rules! suite {
    ($name:ident, $pool:ty, [$p1:literal, $p2:literal, $p3:literal], $effects_ddl:literal, $connect:expr, schema = $schema:literal, fresh = $fresh:expr) => {
        mod $name {
            use super::*;

            const INSERT: &str = concat!(
                "INSERT INTO idem_sqlx_effects (run_id, label, amount) VALUES (",
                $p1, ", ", $p2, ", ", $p3, ")"
            );
            const COUNT: &str =
                concat!("SELECT COUNT(*) FROM idem_sqlx_effects WHERE run_id = ", $p1);

            pub(super) async fn pool() -> Option<$pool> {
                let pool: $pool = $connect?;
                idem::sqlx::create_tables(&pool, &[idem::sqlx::Family::Ledger])
                    .await
                    .expect("create the ledger");
                create_table(&pool, "idem_sqlx_effects", $effects_ddl).await;
                Some(pool)
            }

            /// Creates `table` with `ddl` unless it exists: no DDL for a table that exists (on
            /// Galera it aborts other tests' writes), and tests creating it at once are
            /// tolerated ([`common::until_created`]).
            async fn create_table(pool: &$pool, table: &str, ddl: &'static str) {
                common::until_created(table, || async {
                    let probe = format!("SELECT 1 FROM {table} WHERE 1 = 0");
                    sqlx::query(sqlx::AssertSqlSafe(probe)).execute(pool).await.is_ok()
                        || sqlx::query(ddl).execute(pool).await.is_ok()
                })
                .await;
            }

            /// Committed effect rows of `run`.
            pub(super) async fn effects(pool: &$pool, run: &str) -> i64 {
                sqlx::query_scalar::<_, i64>(COUNT)
                    .bind(run)
                    .fetch_one(pool)
                    .await
                    .expect("count")
            }

            /// Writes an effect row of `run` in the call's transaction.
            async fn write(
                db: &mut <<$pool as PoolOf>::Db as sqlx::Database>::Connection,
                run: &str,
                label: &str,
                amount: i64,
            ) {
                sqlx::query(INSERT)
                    .bind(run)
                    .bind(label)
                    .bind(amount)
                    .execute(db)
                    .await
                    .unwrap_or_else(|e| panic!("write the {label}: {e}"));
            }

            fn cmd(amount: i64) -> Pay {
                Pay { key: unique("key"), run: unique("run"), amount }
            }

            /// A database of the test's own without idem's tables, and the statement that drops
            /// it; `None` when the run does not cover this backend.
            async fn fresh() -> Option<($pool, Option<String>)> {
                $fresh
            }

            #[tokio::test]
            async fn idem_schema_applies_as_a_sqlx_migration_and_serves_calls() {
                let Some((pool, drop_it)) = fresh().await else { return };
                // What `idem schema --backend … --only ledger` prints, as the app's first
                // migration; the app's own table as its second.
                let dir = std::env::temp_dir().join(unique("idem-migrations"));
                std::fs::create_dir_all(&dir).expect("dir");
                let ledger = include_str!(concat!("../idem-sql/schema/", $schema, "/ledger.sql"));
                std::fs::write(dir.join("0001_idem_ledger.sql"), ledger).expect("write");
                std::fs::write(dir.join("0002_effects.sql"), $effects_ddl).expect("write");
                let migrator = sqlx::migrate::Migrator::new(dir.as_path()).await.expect("migrations");
                migrator.run(&pool).await.expect("sqlx migrate run");
                let _ = std::fs::remove_dir_all(&dir);
                // A `Conn` function called at the top, on the pool.
                let runs = AtomicUsize::new(0);
                let c = cmd(9);
                let first = charge((&pool).into(), c.clone(), false, &runs).await;
                let again = charge((&pool).into(), c.clone(), false, &runs).await;
                assert_eq!(first, Ok(9));
                assert_eq!(again, first, "replayed");
                assert_eq!(runs.load(Ordering::SeqCst), 1);
                assert_eq!(effects(&pool, &c.run).await, 1);
                if let Some(drop_it) = drop_it {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(drop_it)).execute(&pool).await.expect("drop");
                }
            }

            /// Replicas of a service starting at once on a new database each create idem's
            /// tables: every one starts. PostgreSQL's concurrent `CREATE TABLE IF NOT EXISTS`
            /// fails the losers on its catalogue (a unique violation on `pg_type`).
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn services_starting_at_once_on_a_new_database_all_create_the_tables() {
                let Some((pool, drop_it)) = fresh().await else { return };
                let starts = (0..8).map(|_| {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        idem::sqlx::create_tables(&pool, &idem::sqlx::Family::ALL)
                            .await
                            .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))
                    })
                });
                let started: Vec<Result<(), String>> =
                    futures_util::future::join_all(starts).await.into_iter().map(|r| r.expect("task")).collect();
                let failed: Vec<&String> = started.iter().filter_map(|r| r.as_ref().err()).collect();
                assert!(failed.is_empty(), "{} of 8 starts failed: {failed:?}", failed.len());
                create_table(&pool, "idem_sqlx_effects", $effects_ddl).await;
                let runs = AtomicUsize::new(0);
                let c = cmd(5);
                assert_eq!(charge((&pool).into(), c.clone(), false, &runs).await, Ok(5));
                assert_eq!(charge((&pool).into(), c.clone(), false, &runs).await, Ok(5), "replayed");
                assert_eq!(runs.load(Ordering::SeqCst), 1);
                if let Some(drop_it) = drop_it {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(drop_it)).execute(&pool).await.expect("drop");
                }
            }

            /// A charge callable at the top (a pool) or nested (another call's body `db`).
            #[idempotent(scope = "sqlx.charge", key = cmd.key, skip(runs))]
            async fn charge(
                db: idem::sqlx::Conn<'_, <$pool as PoolOf>::Db>,
                cmd: Pay,
                decline: bool,
                runs: &AtomicUsize,
            ) -> Result<i64, PayError> {
                runs.fetch_add(1, Ordering::SeqCst);
                write(&mut *db, &cmd.run, "charge", cmd.amount).await;
                if decline { Err(PayError::Declined) } else { Ok(cmd.amount) }
            }

            /// An order whose body writes its row and charges through a nested call, then
            /// answers (the charge's amount, or -1 when it was declined) or fails as `then` says.
            #[idempotent(scope = "sqlx.order", key = cmd.key, skip(runs))]
            async fn order_with_charge(
                db: &$pool,
                cmd: Pay,
                inner: Pay,
                decline: bool,
                then: Then,
                runs: &AtomicUsize,
            ) -> Result<i64, PayError> {
                write(&mut *db, &cmd.run, "order", cmd.amount).await;
                let charged = match charge((&mut *db).into(), inner, decline, runs).await {
                    Ok(amount) => amount,
                    Err(PayError::Declined) => -1,
                    Err(e) => return Err(e),
                };
                match then {
                    Then::Fail => Err(PayError::Flaky),
                    _ => Ok(charged),
                }
            }

            #[tokio::test]
            async fn a_nested_call_commits_with_the_outer_one_or_not_at_all() {
                let Some(pool) = pool().await else { return };
                let runs = AtomicUsize::new(0);
                let (outer, inner) = (cmd(20), cmd(2));
                // The outer body fails after the nested charge: nothing of either commits.
                let failed = order_with_charge(&pool, outer.clone(), inner.clone(), false, Then::Fail, &runs).await;
                assert_eq!(failed, Err(PayError::Flaky));
                assert_eq!((effects(&pool, &outer.run).await, effects(&pool, &inner.run).await), (0, 0));
                // Its retry runs the charge again (its record went with the rollback) and commits both.
                let paid = order_with_charge(&pool, outer.clone(), inner.clone(), false, Then::Answer, &runs).await;
                assert_eq!(paid, Ok(2));
                assert_eq!(runs.load(Ordering::SeqCst), 2, "the charge ran again after the rollback");
                assert_eq!((effects(&pool, &outer.run).await, effects(&pool, &inner.run).await), (1, 1));
                // The charge's record committed with the order: called at the top, it replays.
                let replayed = charge((&pool).into(), inner.clone(), false, &runs).await;
                assert_eq!(replayed, Ok(2));
                let again = order_with_charge(&pool, outer.clone(), inner.clone(), false, Then::Answer, &runs).await;
                assert_eq!(again, Ok(2), "the order replays");
                assert_eq!(runs.load(Ordering::SeqCst), 2, "no third charge");
                assert_eq!(effects(&pool, &inner.run).await, 1, "one committed charge");
            }

            #[tokio::test]
            async fn a_nested_final_error_undoes_only_its_own_writes() {
                let Some(pool) = pool().await else { return };
                let runs = AtomicUsize::new(0);
                let (outer, inner) = (cmd(30), cmd(3));
                let paid = order_with_charge(&pool, outer.clone(), inner.clone(), true, Then::Answer, &runs).await;
                assert_eq!(paid, Ok(-1), "the outer body went on after the declined charge");
                assert_eq!(effects(&pool, &outer.run).await, 1, "the order committed");
                assert_eq!(effects(&pool, &inner.run).await, 0, "the declined charge's write undone");
                let replayed = charge((&pool).into(), inner.clone(), true, &runs).await;
                assert_eq!(replayed, Err(PayError::Declined), "the refusal was recorded with the order");
                assert_eq!(runs.load(Ordering::SeqCst), 1);
            }

            /// A charge that, when `hang` says so, never finishes after its write: its caller
            /// gives up on it (a timeout), which drops it mid-body.
            #[idempotent(scope = "sqlx.charge.hanging", key = cmd.key, skip(hang, runs))]
            async fn hanging_charge(
                db: idem::sqlx::Conn<'_, <$pool as PoolOf>::Db>,
                cmd: Pay,
                hang: bool,
                runs: &AtomicUsize,
            ) -> Result<i64, PayError> {
                runs.fetch_add(1, Ordering::SeqCst);
                write(&mut *db, &cmd.run, "charge", cmd.amount).await;
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(cmd.amount)
            }

            /// An order that gives up on its nested charge after 100 ms, writes once more and
            /// answers 0.
            #[idempotent(scope = "sqlx.order.gives_up", key = cmd.key, skip(runs))]
            async fn order_giving_up_on_its_charge(
                db: &$pool,
                cmd: Pay,
                inner: Pay,
                runs: &AtomicUsize,
            ) -> Result<i64, PayError> {
                write(&mut *db, &cmd.run, "order", cmd.amount).await;
                let charge = hanging_charge((&mut *db).into(), inner, true, runs);
                let gave_up = tokio::time::timeout(Duration::from_millis(100), charge).await.is_err();
                assert!(gave_up, "the hanging charge finished");
                write(&mut *db, &cmd.run, "after", cmd.amount).await;
                Ok(0)
            }

            /// RELIABILITY finding 7: the dropped charge's write and its pending claim used to
            /// commit with the order (text savepoints nobody rolled back to); its savepoint is
            /// sqlx's own nested transaction now, rolled back before the order's next write.
            #[tokio::test]
            async fn a_nested_call_dropped_mid_body_leaves_nothing_in_the_outer_commit() {
                let Some(pool) = pool().await else { return };
                let runs = AtomicUsize::new(0);
                let (outer, inner) = (cmd(40), cmd(4));
                let answered = order_giving_up_on_its_charge(&pool, outer.clone(), inner.clone(), &runs).await;
                assert_eq!(answered, Ok(0));
                assert_eq!(runs.load(Ordering::SeqCst), 1, "the charge started");
                assert_eq!(effects(&pool, &outer.run).await, 2, "the order's two writes committed");
                assert_eq!(effects(&pool, &inner.run).await, 0, "the dropped charge's write was undone");
                // Its claim was undone too: called again, the charge runs (a pending record
                // committed with the order would answer `InFlight` until its TTL).
                let charged = hanging_charge((&pool).into(), inner.clone(), false, &runs).await;
                assert_eq!(charged, Ok(4));
                assert_eq!(runs.load(Ordering::SeqCst), 2);
                assert_eq!(effects(&pool, &inner.run).await, 1);
            }

            const ORDERS: idem::sqlx::StateTable =
                idem::sqlx::StateTable::new("idem_sqlx_orders", "id", "status").version("version");

            /// Pays or cancels an order with one guarded transition in the claim's transaction.
            #[idempotent(scope = "sqlx.order.move", key = cmd.key)]
            async fn move_order(db: &$pool, cmd: Move) -> Result<String, PayError> {
                let transition = match cmd.to.as_str() {
                    "pay" => idem::transition!(Status: Pending -> Paid),
                    _ => idem::transition!(Status: Pending -> Cancelled),
                };
                let outcome = ORDERS.apply_transition(&mut *db, cmd.order.clone(), transition).await?;
                Ok(format!("{outcome:?}"))
            }

            /// A new pending order at version 0.
            async fn new_order(pool: &$pool) -> String {
                let ddl = "CREATE TABLE IF NOT EXISTS idem_sqlx_orders (id VARCHAR(64) PRIMARY KEY, status INTEGER NOT NULL, version BIGINT NOT NULL)";
                create_table(pool, "idem_sqlx_orders", ddl).await;
                let id = unique("ord");
                let insert = concat!("INSERT INTO idem_sqlx_orders (id, status, version) VALUES (", $p1, ", ", $p2, ", 0)");
                sqlx::query(insert).bind(&id).bind(Status::Pending).execute(pool).await.expect("insert order");
                id
            }

            /// The order's committed state and version.
            async fn order_row(pool: &$pool, id: &str) -> (Status, i64) {
                let read = concat!("SELECT status, version FROM idem_sqlx_orders WHERE id = ", $p1);
                sqlx::query_as(read).bind(id).fetch_one(pool).await.expect("read order")
            }

            fn order_move(order: &str, to: &str) -> Move {
                Move { key: unique("move"), order: order.to_owned(), to: to.to_owned() }
            }

            #[tokio::test]
            async fn a_state_transition_is_guarded_in_the_claims_transaction() {
                let Some(pool) = pool().await else { return };
                let id = new_order(&pool).await;
                let pay = order_move(&id, "pay");
                assert_eq!(move_order(&pool, pay.clone()).await, Ok("Applied".to_owned()));
                assert_eq!(order_row(&pool, &id).await, (Status::Paid, 1));
                assert_eq!(move_order(&pool, pay).await, Ok("Applied".to_owned()), "replayed");
                // Another request paying the paid order: a no-op success; cancelling it: refused.
                let again = move_order(&pool, order_move(&id, "pay")).await;
                assert_eq!(again, Ok("AlreadyApplied".to_owned()));
                let cancel = move_order(&pool, order_move(&id, "cancel")).await;
                assert_eq!(cancel, Err(PayError::Idem(ErrorKind::InvalidTransition)));
                assert_eq!(order_row(&pool, &id).await, (Status::Paid, 1), "written once");
                let missing = move_order(&pool, order_move(&unique("none"), "pay")).await;
                assert_eq!(missing, Ok("NotFound".to_owned()));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn conflicting_transitions_have_exactly_one_winner() {
                let Some(pool) = pool().await else { return };
                let id = new_order(&pool).await;
                let moves = (0..16).map(|i| {
                    let (pool, m) = (pool.clone(), order_move(&id, if i % 2 == 0 { "pay" } else { "cancel" }));
                    tokio::spawn(async move { (m.to.clone(), move_order(&pool, m).await) })
                });
                let results: Vec<(String, Result<String, PayError>)> =
                    futures_util::future::join_all(moves).await.into_iter().map(|r| r.expect("task")).collect();
                let winners: Vec<&str> = results
                    .iter()
                    .filter(|(_, r)| r.as_deref() == Ok("Applied"))
                    .map(|(to, _)| to.as_str())
                    .collect();
                assert_eq!(winners.len(), 1, "{results:?}");
                for (to, result) in &results {
                    let allowed = matches!(result.as_deref(), Ok("Applied" | "AlreadyApplied"))
                        || *result == Err(PayError::Idem(ErrorKind::InvalidTransition));
                    assert!(allowed, "{to}: {result:?}");
                }
                let expected = if winners[0] == "pay" { Status::Paid } else { Status::Cancelled };
                assert_eq!(order_row(&pool, &id).await, (expected, 1), "moved exactly once");
            }
        }
    };
}

suite!(
    sqlite,
    sqlx::SqlitePool,
    ["?", "?", "?"],
    "CREATE TABLE IF NOT EXISTS idem_sqlx_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, label TEXT NOT NULL, amount INTEGER NOT NULL)",
    Some(
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect(&sqlite_url("idem-sqlx"))
            .await
            .expect("sqlite")
    ),
    schema = "sqlite",
    fresh = Some((
        sqlx::SqlitePool::connect(&sqlite_url("idem-sqlx-fresh"))
            .await
            .expect("sqlite"),
        None
    ))
);

suite!(
    postgres,
    sqlx::PgPool,
    ["$1", "$2", "$3"],
    "CREATE TABLE IF NOT EXISTS idem_sqlx_effects (id BIGSERIAL PRIMARY KEY, run_id VARCHAR(200) NOT NULL, label VARCHAR(255) NOT NULL, amount BIGINT NOT NULL)",
    match server_url("postgres") {
        Some(url) => Some(sqlx::PgPool::connect(&url).await.unwrap_or_else(|e| {
            panic!("cannot connect to {url} (set by the environment, so this fails): {e}")
        })),
        None => None,
    },
    schema = "postgres",
    fresh = match server_url("postgres") {
        // A schema of the test's own, first on the search path.
        Some(url) => {
            let admin = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
            let schema = unique("mig").replace('-', "_");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                .execute(&admin)
                .await
                .expect("schema");
            let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
            let options = options.options([("search_path", schema.as_str())]);
            let pool = sqlx::PgPool::connect_with(options)
                .await
                .expect("PostgreSQL");
            Some((pool, Some(format!("DROP SCHEMA {schema} CASCADE"))))
        }
        None => None,
    }
);

suite!(
    mysql,
    sqlx::MySqlPool,
    ["?", "?", "?"],
    "CREATE TABLE IF NOT EXISTS idem_sqlx_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, run_id VARCHAR(200) NOT NULL, label VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, INDEX (run_id))",
    match server_url("mysql") {
        Some(url) => Some(sqlx::MySqlPool::connect(&url).await.unwrap_or_else(|e| {
            panic!("cannot connect to {url} (set by the environment, so this fails): {e}")
        })),
        None => None,
    },
    schema = "mysql",
    fresh = match server_url("mysql") {
        // A database of the test's own.
        Some(url) => {
            let admin = sqlx::MySqlPool::connect(&url).await.expect("MySQL");
            let database = unique("mig").replace('-', "_");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
                .execute(&admin)
                .await
                .expect("database");
            let options: sqlx::mysql::MySqlConnectOptions = url.parse().expect("url");
            let pool = sqlx::MySqlPool::connect_with(options.database(&database))
                .await
                .expect("MySQL");
            Some((pool, Some(format!("DROP DATABASE {database}"))))
        }
        None => None,
    }
);

/// The URL of server `name` when this run covers it.
fn server_url(name: &str) -> Option<String> {
    server_urls()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, url)| url)
}

#[idempotent(scope = "sqlx.outage", key = key)]
async fn during_outage(db: &sqlx::PgPool, key: String) -> Result<u8, idem::Error> {
    let _ = &mut *db;
    Ok(1)
}

#[tokio::test]
async fn a_database_that_cannot_be_reached_is_an_outage_told_promptly() {
    // Nothing listens on port 1: every connection attempt is refused.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("lazy pool");
    let started = Instant::now();
    let e = during_outage(&pool, "k-1".into())
        .await
        .expect_err("no server");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A lease-mode call whose server goes away during its final phase: the link is cut inside
/// the phase's writes, which then return (the phase's own record fails) or, with
/// `statement_after_the_cut`, run a statement of the handler's (which fails).
#[idempotent(scope = "sqlx.outage.final_phase", key = key, lease = "30s", skip(link))]
async fn final_phase_loses_its_server(
    db: &sqlx::PgPool,
    link: Arc<Link>,
    key: String,
    statement_after_the_cut: bool,
) -> Result<u8, PayError> {
    idem::sqlx::finish(db, "write", move |conn| {
        Box::pin(async move {
            link.cut().await;
            if statement_after_the_cut {
                sqlx::query("SELECT 1")
                    .execute(&mut *conn)
                    .await
                    .map_err(|_| PayError::Flaky)?;
            }
            Ok(3)
        })
    })
    .await
}

#[tokio::test]
async fn a_server_lost_under_a_final_phase_is_answered_before_the_lease_is_released() {
    let Some(url) = server_url("postgres") else {
        return;
    };
    // The ledger, on a direct pool.
    postgres::pool().await.expect("PostgreSQL");
    let wait = Duration::from_secs(1);
    for statement_after_the_cut in [false, true] {
        let link = Arc::new(Link::to(&url).await);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(wait)
            .connect(&link.url(&url))
            .await
            .expect("through the link");
        let started = Instant::now();
        let answer = final_phase_loses_its_server(
            &pool,
            Arc::clone(&link),
            unique("f"),
            statement_after_the_cut,
        )
        .await;
        let took = started.elapsed();
        let expected = match statement_after_the_cut {
            false => PayError::Idem(ErrorKind::Unavailable),
            true => PayError::Flaky,
        };
        assert_eq!(
            answer,
            Err(expected),
            "statement after the cut: {statement_after_the_cut}"
        );
        // The release cannot reach the server either: awaited, it would wait the pool's
        // acquire timeout out before the answer.
        assert!(
            took < wait / 2,
            "statement after the cut: {statement_after_the_cut}: answered after {took:?}"
        );
        println!("statement after the cut: {statement_after_the_cut}: answered after {took:?}");
    }
}

/// A handler for a pool behind a transaction pooler: its own query runs unnamed too.
#[idempotent(scope = "sqlx.pooled", key = cmd.key, skip(runs))]
async fn pay_pooled(db: &sqlx::PgPool, cmd: Pay, runs: &AtomicUsize) -> Result<i64, PayError> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO idem_sqlx_effects (run_id, label, amount) VALUES ($1, $2, $3)")
        .bind(&cmd.run)
        .bind("charge")
        .bind(cmd.amount)
        .persistent(false)
        .execute(&mut *db)
        .await
        .map_err(|_| PayError::Flaky)?;
    Ok(cmd.amount)
}

/// 8 concurrent calls of one run (keys `k-0`..`k-3`, each twice) on `pool`: their answers.
async fn pooled_storm(
    pool: &sqlx::PgPool,
    run: &str,
    runs: &Arc<AtomicUsize>,
) -> Vec<Result<i64, PayError>> {
    let calls = (0..8).map(|i| {
        let (pool, runs) = (pool.clone(), Arc::clone(runs));
        let cmd = Pay {
            key: format!("{run}-k-{}", i % 4),
            run: run.to_owned(),
            amount: 10,
        };
        tokio::spawn(async move { pay_pooled(&pool, cmd, &runs).await })
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|answer| answer.expect("task"))
        .collect()
}

#[tokio::test]
async fn behind_pgbouncer_in_transaction_mode_the_store_runs_unnamed_statements() {
    let Some(url) = server_url("postgres") else {
        return;
    };
    // The ledger and the effects table, on a direct pool.
    let direct = postgres::pool().await.expect("PostgreSQL");
    let count = async |run: &str| postgres::effects(&direct, run).await;
    // One server connection: every client connection's statements meet on it.
    let bouncer = PgBouncer::start(&url, 1);
    let connect = || {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&bouncer.url)
    };

    // idem's statements named, sqlx's default: two client connections both name their first
    // statement `sqlx_s_1` on the one server connection.
    let named = connect().await.expect("through pgbouncer");
    let run = unique("named");
    let answers = pooled_storm(&named, &run, &Arc::new(AtomicUsize::new(0))).await;
    assert!(
        answers.iter().any(|a| matches!(
            a,
            Err(PayError::Idem(ErrorKind::Store | ErrorKind::Conflict))
        )),
        "named statements collide behind a transaction pooler: {answers:?}"
    );

    // The same, marked: every call answers, each key's body ran once, retries replay.
    let pooled = connect().await.expect("through pgbouncer");
    idem::sqlx::through_transaction_pooler(&pooled);
    let run = unique("unnamed");
    let runs = Arc::new(AtomicUsize::new(0));
    let answers = pooled_storm(&pooled, &run, &runs).await;
    assert!(answers.iter().all(|a| *a == Ok(10)), "{answers:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "each of the 4 keys ran once"
    );
    assert_eq!(count(&run).await, 4, "4 committed effects");
    let again = pooled_storm(&pooled, &run, &runs).await;
    assert!(again.iter().all(|a| *a == Ok(10)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 4, "replayed");
    assert_eq!(count(&run).await, 4);
}

/// Lease mode on the sqlx store runs the lease suite (`tests/lease.rs`, through both stores);
/// what is the sqlx store's own is here.
#[idempotent(scope = "sqlx.lease.inner", key = key, lease = "2s")]
async fn lease_inner(db: &sqlx::SqlitePool, key: String) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(1)
}

#[idempotent(scope = "sqlx.atomic.outer", key = key, skip(pool))]
async fn atomic_outer(
    db: &sqlx::SqlitePool,
    pool: &sqlx::SqlitePool,
    key: String,
) -> Result<String, idem::Error> {
    let _ = &mut *db;
    // The lease's claim would wait for the write lock this body's transaction holds.
    let inner = lease_inner(pool, format!("{key}-inner")).await;
    Ok(format!("{inner:?}"))
}

#[tokio::test]
async fn on_sqlite_a_lease_call_inside_an_atomic_body_is_refused_at_once() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect(&sqlite_url("idem-sqlx-lease-inside"))
        .await
        .expect("sqlite");
    let families = [idem::sqlx::Family::Ledger, idem::sqlx::Family::Lease];
    idem::sqlx::create_tables(&pool, &families)
        .await
        .expect("tables");
    let started = Instant::now();
    let inner = atomic_outer(&pool, &pool, unique("k"))
        .await
        .expect("outer");
    assert!(
        inner.contains("SQLite") && inner.contains("write lock"),
        "{inner}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// The sqlx store's `create_tables`, like SeaORM's, reruns SQLite's DDL, which drops the expiry
/// index of an earlier version's ledger (every SQLite commit paid for it); the ledger keeps
/// its records and works on.
#[tokio::test]
async fn a_sqlite_ledger_of_an_earlier_version_loses_its_index_and_keeps_working() {
    let pool = sqlx::SqlitePool::connect(&sqlite_url("idem-sqlx-old-ledger"))
        .await
        .expect("sqlite");
    // The layout of earlier versions: WITHOUT ROWID, with an expiry index.
    sqlx::raw_sql(
        "CREATE TABLE idem_ledger (id BLOB NOT NULL PRIMARY KEY, scope TEXT NOT NULL, \
         principal TEXT NOT NULL, idem_key TEXT NOT NULL, owner INTEGER NOT NULL, \
         fingerprint BLOB NOT NULL, state INTEGER NOT NULL, response BLOB NULL, \
         created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL) WITHOUT ROWID; \
         CREATE INDEX idem_ledger_expires ON idem_ledger (expires_at_ms)",
    )
    .execute(&pool)
    .await
    .expect("the old ledger");
    let indexes = || {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = 'idem_ledger_expires'",
        )
        .fetch_one(&pool)
    };
    assert_eq!(indexes().await.expect("schema"), 1);
    idem::sqlx::create_tables(&pool, &[idem::sqlx::Family::Ledger])
        .await
        .expect("tables");
    assert_eq!(
        indexes().await.expect("schema"),
        0,
        "the old index is dropped"
    );
    let key = unique("old-ledger");
    let first = old_ledger_greet(&pool, key.clone(), 1)
        .await
        .expect("first");
    let replay = old_ledger_greet(&pool, key, 2).await.expect("replay");
    assert_eq!((first, replay), (1, 1), "the second call replays the first");
}

#[idempotent(scope = "sqlx.old_ledger", key = key, skip(n))]
async fn old_ledger_greet(db: &sqlx::SqlitePool, key: String, n: u8) -> Result<u8, idem::Error> {
    let _ = &mut *db;
    Ok(n)
}
