//! Atomic-mode semantics (DESIGN §2), through both stores on every backend of the run: each
//! case runs once with SeaORM's store (the handler takes `&DatabaseConnection`, the body
//! `&DatabaseTransaction`) and once with sqlx's (a pool of its own to the same database, the
//! body `&mut SqliteConnection` etc.). The handlers are written once, in `handlers!`, per
//! connection type (`on_sea_orm`, `on_sqlx_sqlite`, `on_sqlx_postgres`, `on_sqlx_mysql`);
//! [`cases`] makes the cases and `call!` (`tests/common/stores.rs`) sends a call to its store.
//! Each test counts the handler's effects in the database (through SeaORM, whichever store
//! wrote them) and how often its body ran.
//!
//! SeaORM's alone: an earlier version's SQLite ledger (its `create_tables` reruns SQLite's
//! DDL, which drops the old expiry index; the sqlx store's own case is in `tests/sqlx.rs`).
//! The sqlx store's own cases (nested `Conn` calls, `StateTable`, the
//! schema as a sqlx migration, PgBouncer, an unreachable server) are in `tests/sqlx.rs`.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::pgbouncer::PgBouncer;
use common::stores::{Conn, call};
use common::{Gate, backends, effects, insert_effect, ledger_rows, unique};
use idem::{ErrorKind, FinalError, Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pay {
    key: String,
    run: String,
    amount: i64,
}

impl Pay {
    fn new(run: &str, amount: i64) -> Self {
        Self {
            key: format!("{run}-key"),
            run: run.to_owned(),
            amount,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    amount: i64,
    /// Differs between executions, so a replay is told from a second execution.
    execution: String,
    /// The run's effect rows the body's transaction saw after its write: its own uncommitted
    /// row, and none that rolled back.
    seen: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    /// idem's own errors are never recorded, so they need not serialise.
    #[serde(skip)]
    Idem(idem::Error),
    Declined {
        reason: String,
    },
    Flaky,
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl FinalError for PayError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined { .. })
    }
}

impl PayError {
    fn kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Idem(e) => Some(e.kind()),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TenantPay {
    tenant: String,
    key: String,
    run: String,
}

/// How many times a body of each run began (rolled back or not), by run id.
static BODY_RUNS: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// A body of run `run` began.
fn ran(run: &str) {
    *BODY_RUNS
        .lock()
        .expect("lock")
        .entry(run.to_owned())
        .or_default() += 1;
}

/// How many bodies of run `run` began.
fn body_runs(run: &str) -> usize {
    let runs = BODY_RUNS.lock().expect("lock");
    runs.get(run).copied().unwrap_or_default()
}

/// A handler of `$name` that records an empty value of type `$ty` and counts its runs.
macro_rules! empty_value_handler {
    ($conn:ty, $name:ident, $ty:ty, $value:expr) => {
        #[idempotent(scope = "test.empty", key = key, skip(runs))]
        pub(crate) async fn $name(
            db: &$conn,
            key: String,
            runs: &AtomicUsize,
        ) -> Result<$ty, idem::Error> {
            let _ = db;
            runs.fetch_add(1, Ordering::SeqCst);
            Ok($value)
        }
    };
}

/// The handlers, once per kind of connection: `$conn` is what they take (SeaORM's connection
/// or a sqlx pool), `$tx` what their bodies get (the claim's transaction); `insert` writes an
/// effect row in it, `count` counts a run's rows as it sees them.
macro_rules! handlers {
    (
        $module:ident,
        $conn:ty,
        $tx:ty,
        insert = |$idb:ident, $irun:ident, $label:ident, $amount:ident| $insert:expr,
        count = |$cdb:ident, $crun:ident| $count:expr $(,)?
    ) => {
        mod $module {
            use super::*;

            async fn write_effect($idb: $tx, $irun: &str, $label: &str, $amount: i64) {
                $insert;
            }

            async fn seen_effects($cdb: $tx, $crun: &str) -> i64 {
                $count
            }

            /// What most handlers do: count the run, write the call's effect (labelled
            /// `label`), and answer a receipt of this execution.
            async fn write_receipt(db: $tx, cmd: &Pay, label: &str) -> Receipt {
                ran(&cmd.run);
                write_effect(db, &cmd.run, label, cmd.amount).await;
                Receipt {
                    amount: cmd.amount,
                    execution: unique("exec"),
                    seen: seen_effects(db, &cmd.run).await,
                }
            }

            /// A body that writes its effect, then holds the claim at `gate` until released.
            async fn write_then_hold(db: $tx, cmd: Pay, gate: &Gate) -> Result<Receipt, PayError> {
                let receipt = write_receipt(db, &cmd, "held").await;
                gate.pass().await;
                Ok(receipt)
            }

            #[idempotent(scope = "test.pay", key = cmd.key)]
            pub(crate) async fn pay(db: &$conn, cmd: Pay) -> Result<Receipt, PayError> {
                Ok(write_receipt(db, &cmd, "pay").await)
            }

            empty_value_handler!($conn, unit_value, (), ());
            empty_value_handler!($conn, none_value, Option<u32>, None);
            empty_value_handler!($conn, zero_value, u64, 0);
            empty_value_handler!($conn, empty_vec, Vec<String>, Vec::new());
            empty_value_handler!($conn, empty_string, String, String::new());

            #[idempotent(scope = "test.flaky", key = cmd.key, skip(fail))]
            pub(crate) async fn flaky_pay(
                db: &$conn,
                cmd: Pay,
                fail: bool,
            ) -> Result<Receipt, PayError> {
                let receipt = write_receipt(db, &cmd, "flaky").await;
                if fail {
                    return Err(PayError::Flaky);
                }
                Ok(receipt)
            }

            #[idempotent(scope = "test.declined", key = cmd.key, skip(runs))]
            pub(crate) async fn declined_pay(
                db: &$conn,
                cmd: Pay,
                runs: &AtomicUsize,
            ) -> Result<Receipt, PayError> {
                runs.fetch_add(1, Ordering::SeqCst);
                write_effect(db, &cmd.run, "declined", cmd.amount).await;
                Err(PayError::Declined {
                    reason: format!("card declined for {}", cmd.amount),
                })
            }

            #[idempotent(scope = "test.slow", key = cmd.key, skip(pause))]
            pub(crate) async fn slow_pay(
                db: &$conn,
                cmd: Pay,
                pause: Duration,
            ) -> Result<Receipt, PayError> {
                let receipt = write_receipt(db, &cmd, "slow").await;
                tokio::time::sleep(pause).await;
                Ok(receipt)
            }

            #[idempotent(scope = "test.reject", key = cmd.key, on_concurrent = reject, skip(gate))]
            pub(crate) async fn held_pay(
                db: &$conn,
                cmd: Pay,
                gate: Gate,
            ) -> Result<Receipt, PayError> {
                write_then_hold(db, cmd, &gate).await
            }

            #[idempotent(scope = "test.tenant", key = cmd.key, principal = cmd.tenant, skip(cmd))]
            pub(crate) async fn tenant_pay(
                db: &$conn,
                cmd: TenantPay,
            ) -> Result<String, idem::Error> {
                write_effect(db, &cmd.run, &cmd.tenant, 1).await;
                Ok(format!("{} paid", cmd.tenant))
            }

            #[idempotent(scope = "test.other-scope", key = cmd.key)]
            pub(crate) async fn other_scope_pay(db: &$conn, cmd: Pay) -> Result<Receipt, PayError> {
                Ok(write_receipt(db, &cmd, "other").await)
            }

            #[idempotent(scope = "test.optional", key = key)]
            pub(crate) async fn optional_key(
                db: &$conn,
                key: Option<String>,
            ) -> Result<u8, idem::Error> {
                let _ = db;
                Ok(1)
            }

            #[idempotent(scope = "test.decode", key = key)]
            pub(crate) async fn decode_v1(db: &$conn, key: String) -> Result<String, idem::Error> {
                let _ = db;
                Ok("version one".to_owned())
            }

            #[idempotent(scope = "test.decode", key = key)]
            pub(crate) async fn decode_v2(db: &$conn, key: String) -> Result<u64, idem::Error> {
                let _ = db;
                Ok(2)
            }

            #[idempotent(scope = "test.expiry", key = cmd.key, ttl = "1s")]
            pub(crate) async fn short_lived(db: &$conn, cmd: Pay) -> Result<Receipt, PayError> {
                Ok(write_receipt(db, &cmd, "short").await)
            }

            /// The TTL read at run time (a service's configuration).
            #[idempotent(scope = "test.expiry.configured", key = cmd.key, ttl = ttl, skip(ttl))]
            pub(crate) async fn configured_ttl(
                db: &$conn,
                cmd: Pay,
                ttl: Duration,
            ) -> Result<Receipt, PayError> {
                Ok(write_receipt(db, &cmd, "configured").await)
            }

            pub(crate) struct Payments {
                pub(crate) db: $conn,
            }

            impl Payments {
                #[idempotent(scope = "test.method", key = cmd.key, conn = self.db as db)]
                pub(crate) async fn pay(&self, cmd: Pay) -> Result<Receipt, PayError> {
                    Ok(write_receipt(db, &cmd, "method").await)
                }
            }

            /// A method call on a service holding the connection.
            pub(crate) async fn pay_by_method(db: &$conn, cmd: Pay) -> Result<Receipt, PayError> {
                Payments { db: db.clone() }.pay(cmd).await
            }

            #[idempotent(scope = "test.wait", key = cmd.key, on_concurrent = wait("300ms"), skip(gate))]
            pub(crate) async fn bounded_wait_pay(
                db: &$conn,
                cmd: Pay,
                gate: Gate,
            ) -> Result<Receipt, PayError> {
                write_then_hold(db, cmd, &gate).await
            }

            /// Writes its effect, then panics while `panics` is set.
            #[idempotent(scope = "test.panics", key = cmd.key, skip(panics))]
            pub(crate) async fn pay_or_panic(
                db: &$conn,
                panics: &AtomicBool,
                cmd: Pay,
            ) -> Result<Receipt, PayError> {
                let receipt = write_receipt(db, &cmd, "panics").await;
                assert!(
                    !panics.swap(false, Ordering::SeqCst),
                    "the body panicked after its write"
                );
                Ok(receipt)
            }
        }
    };
}

handlers!(
    on_sea_orm,
    DatabaseConnection,
    &sea_orm::DatabaseTransaction,
    insert = |db, run, label, amount| insert_effect(db, run, label, amount).await,
    count = |db, run| effects(db, run).await,
);

/// The sqlx handlers of database `$db`, their statements in its placeholders: `$p1` the
/// first, `$values` the three of an effect row.
macro_rules! sqlx_handlers {
    ($module:ident, $db:ty, $p1:literal, $values:literal) => {
        handlers!(
            $module,
            sqlx::Pool<$db>,
            &mut <$db as sqlx::Database>::Connection,
            insert = |db, run, label, amount| sqlx::query(concat!(
                "INSERT INTO idem_test_effects (run_id, label, amount) VALUES (",
                $values,
                ")"
            ))
            .bind(run)
            .bind(label)
            .bind(amount)
            // Unnamed, as a body's own statements must be behind a transaction pooler (the
            // PgBouncer case): a named one would meet another client's on a server connection.
            .persistent(false)
            .execute(&mut *db)
            .await
            .expect("insert effect in the claim's transaction"),
            count = |db, run| sqlx::query_scalar::<_, i64>(concat!(
                "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = ",
                $p1
            ))
            .bind(run)
            .persistent(false)
            .fetch_one(&mut *db)
            .await
            .expect("count effects in the claim's transaction"),
        );
    };
}

sqlx_handlers!(on_sqlx_sqlite, sqlx::Sqlite, "?", "?, ?, ?");
sqlx_handlers!(on_sqlx_postgres, sqlx::Postgres, "$1", "$1, $2, $3");
sqlx_handlers!(on_sqlx_mysql, sqlx::MySql, "?", "?, ?, ?");

handlers!(
    on_tokio_postgres,
    idem::tokio_postgres::deadpool_postgres::Pool,
    &idem::tokio_postgres::deadpool_postgres::ClientWrapper,
    insert = |db, run, label, amount| db
        .execute(
            "INSERT INTO idem_test_effects (run_id, label, amount) VALUES ($1, $2, $3)",
            &[&run, &label, &amount],
        )
        .await
        .expect("insert effect in the claim's transaction"),
    count = |db, run| db
        .query_one(
            "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = $1",
            &[&run]
        )
        .await
        .expect("count effects in the claim's transaction")
        .get::<_, i64>(0),
);

/// One backend of the run through one store. `db` is the backend's SeaORM connection: the
/// test counts effects and ledger records through it, whichever store the calls use.
#[derive(Clone)]
struct Case {
    name: &'static str,
    /// The backend's name: its cases run side by side.
    backend: &'static str,
    db: DatabaseConnection,
    conn: Conn,
    /// The PgBouncer the case's pool goes through, kept running while the case lives.
    #[allow(dead_code)] // held, not read
    pooler: Option<Arc<PgBouncer>>,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl Case {
    /// Asserts that run `run` has `expected` committed effect rows; `what` says why.
    async fn assert_effects(&self, run: &str, expected: i64, what: &str) {
        assert_eq!(effects(&self.db, run).await, expected, "{self}: {what}");
    }

    /// How many ledger records hold the key of run `run`.
    async fn records(&self, run: &str) -> i64 {
        ledger_rows(&self.db, &format!("{run}-key")).await
    }
}

/// Every backend of the run through each store, a backend's cases side by side: SeaORM's,
/// then sqlx's on a pool of its own, and on PostgreSQL sqlx's again through a PgBouncer of
/// the case's own in transaction mode (SeaORM's store cannot run there: it always names its
/// statements).
async fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for b in backends().await {
        let sqlx = Conn::sqlx(b.name, &b.url).await;
        for conn in [Conn::SeaOrm, sqlx] {
            let (name, db) = (conn.name(b.name), b.db.clone());
            let (backend, pooler) = (b.name, None);
            cases.push(Case {
                name,
                backend,
                db,
                conn,
                pooler,
            });
        }
        if b.name == "postgres" {
            cases.push(Case {
                name: "postgres (tokio-postgres)",
                backend: b.name,
                db: b.db.clone(),
                conn: Conn::tokio_postgres(&b.url),
                pooler: None,
            });
            // tokio-postgres through a PgBouncer in transaction mode: idem's statements go out
            // unnamed; the body's own are named, but live only inside its transaction.
            let bouncer = PgBouncer::start(&b.url, 1);
            cases.push(Case {
                name: "postgres (tokio-postgres, PgBouncer)",
                backend: b.name,
                db: b.db.clone(),
                conn: Conn::tokio_postgres(&bouncer.url),
                pooler: Some(Arc::new(bouncer)),
            });
            // One server connection for up to 8 clients: every client's statements meet on it,
            // where named ones would collide.
            let bouncer = PgBouncer::start(&b.url, 1);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .connect(&bouncer.url)
                .await
                .expect("PostgreSQL through PgBouncer");
            idem::sqlx::through_transaction_pooler(&pool);
            cases.push(Case {
                name: "postgres (sqlx, PgBouncer)",
                backend: b.name,
                db: b.db.clone(),
                conn: Conn::SqlxPostgres(pool),
                pooler: Some(Arc::new(bouncer)),
            });
        }
    }
    cases
}

/// An SQLite database in memory without idem's tables, through each store: any database
/// work there is a store error.
async fn bare_cases() -> Vec<Case> {
    let db = sea_orm::Database::connect("sqlite::memory:").await;
    let db = db.expect("SQLite in memory");
    let sqlx = Conn::sqlx("sqlite", "sqlite::memory:").await;
    let case = |conn: Conn| Case {
        name: conn.name("sqlite"),
        backend: "sqlite",
        db: db.clone(),
        conn,
        pooler: None,
    };
    vec![case(Conn::SeaOrm), case(sqlx)]
}

#[tokio::test]
async fn first_call_executes_and_a_retry_replays() {
    for t in cases().await {
        let run = unique("replay");
        let (first, first_outcome) =
            with_outcome(async { call!(t, pay(Pay::new(&run, 1200))) }).await;
        let (again, again_outcome) =
            with_outcome(async { call!(t, pay(Pay::new(&run, 1200))) }).await;
        let first = first.expect("first call");
        assert_eq!(first.seen, 1, "{t}: the body saw its own uncommitted row");
        assert_eq!(first, again.expect("retry"), "{t}");
        assert_eq!(first_outcome, Some(Outcome::Executed), "{t}");
        assert_eq!(again_outcome, Some(Outcome::Replayed), "{t}");
        assert_eq!(body_runs(&run), 1, "{t}: the body ran once");
        t.assert_effects(&run, 1, "one committed effect").await;
        assert_eq!(t.records(&run).await, 1, "{t}");
    }
}

#[tokio::test]
async fn same_key_with_other_arguments_is_key_reused() {
    for t in cases().await {
        let run = unique("reused");
        let first = call!(t, pay(Pay::new(&run, 1200))).expect("first");
        let other = call!(t, pay(Pay::new(&run, 9900))).unwrap_err();
        assert_eq!(other.kind(), Some(ErrorKind::KeyReused), "{t}");
        t.assert_effects(&run, 1, "a reused key wrote nothing")
            .await;
        // The recorded result is untouched.
        let again = call!(t, pay(Pay::new(&run, 1200))).expect("replay");
        assert_eq!(first, again, "{t}");
        t.assert_effects(&run, 1, "ran once").await;
    }
}

#[tokio::test]
async fn empty_values_are_recorded_and_replayed() {
    for t in cases().await {
        let runs = AtomicUsize::new(0);
        let run = unique("empty");
        for round in 0..2 {
            call!(t, unit_value(format!("{run}-unit"), &runs)).expect("unit");
            assert_eq!(
                call!(t, none_value(format!("{run}-none"), &runs)).expect("none"),
                None
            );
            assert_eq!(
                call!(t, zero_value(format!("{run}-zero"), &runs)).expect("zero"),
                0
            );
            assert!(
                call!(t, empty_vec(format!("{run}-vec"), &runs))
                    .expect("vec")
                    .is_empty()
            );
            assert_eq!(
                call!(t, empty_string(format!("{run}-str"), &runs)).expect("str"),
                ""
            );
            assert_eq!(
                runs.load(Ordering::SeqCst),
                5,
                "{t} round {round}: bodies ran once"
            );
        }
    }
}

#[tokio::test]
async fn a_transient_error_releases_the_key_and_rolls_back() {
    for t in cases().await {
        let run = unique("flaky");
        let failed = call!(t, flaky_pay(Pay::new(&run, 5), true));
        assert!(matches!(failed, Err(PayError::Flaky)), "{t}");
        t.assert_effects(&run, 0, "write rolled back").await;
        assert_eq!(t.records(&run).await, 0, "{t}: key free");
        let retried = call!(t, flaky_pay(Pay::new(&run, 5), false)).expect("the retry");
        assert_eq!(retried.seen, 1, "{t}: the rolled-back row is gone");
        assert_eq!(body_runs(&run), 2, "{t}: the retry ran again");
        t.assert_effects(&run, 1, "the retry ran").await;
    }
}

#[tokio::test]
async fn a_final_error_is_recorded_and_replayed() {
    for t in cases().await {
        let run = unique("declined");
        let runs = AtomicUsize::new(0);
        let (first, outcome) =
            with_outcome(async { call!(t, declined_pay(Pay::new(&run, 7), &runs)) }).await;
        assert!(
            matches!(&first, Err(PayError::Declined { reason }) if reason == "card declined for 7"),
            "{t}: {first:?}"
        );
        assert_eq!(outcome, Some(Outcome::Executed), "{t}");
        let (again, outcome) =
            with_outcome(async { call!(t, declined_pay(Pay::new(&run, 7), &runs)) }).await;
        assert!(
            matches!(&again, Err(PayError::Declined { reason }) if reason == "card declined for 7"),
            "{t}: {again:?}"
        );
        assert_eq!(outcome, Some(Outcome::Replayed), "{t}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{t}: replayed without running"
        );
        t.assert_effects(&run, 0, "the body's write rolled back")
            .await;
        assert_eq!(t.records(&run).await, 1, "{t}: error recorded");
    }
}

#[tokio::test]
async fn a_dropped_call_leaves_nothing_behind() {
    for t in cases().await {
        let run = unique("dropped");
        let cancelled = tokio::time::timeout(Duration::from_millis(300), async {
            call!(t, slow_pay(Pay::new(&run, 3), Duration::from_secs(30)))
        })
        .await;
        assert!(cancelled.is_err(), "{t}: the call was cut off");
        let retried = call!(t, slow_pay(Pay::new(&run, 3), Duration::ZERO));
        assert!(retried.is_ok(), "{t}: {retried:?}");
        t.assert_effects(&run, 1, "exactly one effect").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_execute_once_and_agree() {
    for t in cases().await {
        let run = unique("storm");
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let (call, cmd) = (t.clone(), Pay::new(&run, 640));
            tasks.spawn(async move { call!(call, pay(cmd)) });
        }
        let answers: Vec<Receipt> = tasks
            .join_all()
            .await
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{t}: {e:?}")))
            .collect();
        assert_eq!(answers.len(), 64);
        assert!(
            answers.iter().all(|a| a == &answers[0]),
            "{t}: 64 identical answers"
        );
        assert_eq!(body_runs(&run), 1, "{t}: the body ran once");
        t.assert_effects(&run, 1, "exactly one effect").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reject_fails_fast_while_the_first_call_runs() {
    for t in cases().await {
        let run = unique("reject");
        let gate = Gate::default();
        let (holder, cmd, held) = (t.clone(), Pay::new(&run, 1), gate.clone());
        let first = tokio::spawn(async move { call!(holder, held_pay(cmd, held)) });
        gate.entered().await;
        let started = Instant::now();
        let (dup, cmd) = (t.clone(), Pay::new(&run, 1));
        let duplicate = tokio::spawn(async move { call!(dup, held_pay(cmd, Gate::default())) });
        // In one process the duplicate meets the first call's single flight and is refused at
        // once on every backend (across processes SQLite, one writer, makes it wait).
        let second = duplicate.await.expect("join");
        let elapsed = started.elapsed();
        assert_eq!(second.unwrap_err().kind(), Some(ErrorKind::InFlight), "{t}");
        assert!(
            elapsed < Duration::from_secs(2),
            "{t}: rejected in {elapsed:?}"
        );
        gate.release();
        first.await.expect("join").expect("first");
        assert_eq!(body_runs(&run), 1, "{t}: the duplicate ran nothing");
        t.assert_effects(&run, 1, "ran once").await;
    }
}

/// Under `reject`, a duplicate through another pool on the same database (another store: no
/// single flight between them) meets the first call's claim in the database, and the claim's
/// lock timeout answers in flight (`claim_nowait`). SQLite, one writer, makes it wait
/// instead: not run there.
#[tokio::test]
async fn reject_through_another_pool_is_in_flight_at_the_row_lock() {
    let cases = cases().await;
    for t in cases.iter().filter(|t| t.backend != "sqlite") {
        let Some(other) = cases
            .iter()
            .find(|o| o.backend == t.backend && o.name != t.name)
        else {
            continue;
        };
        let run = unique("reject-pools");
        let gate = Gate::default();
        let (holder, cmd, held) = (t.clone(), Pay::new(&run, 1), gate.clone());
        let first = tokio::spawn(async move { call!(holder, held_pay(cmd, held)) });
        gate.entered().await;
        let started = Instant::now();
        let (dup, cmd) = (other.clone(), Pay::new(&run, 1));
        let second = call!(dup, held_pay(cmd, Gate::default()));
        let elapsed = started.elapsed();
        assert_eq!(
            second.unwrap_err().kind(),
            Some(ErrorKind::InFlight),
            "{t}, then {other}"
        );
        // At most the MySQL 8 family's one-second lock wait, and the round trips.
        assert!(
            elapsed < Duration::from_secs(5),
            "{t}, then {other}: rejected in {elapsed:?}"
        );
        gate.release();
        first.await.expect("join").expect("first");
        assert_eq!(
            body_runs(&run),
            1,
            "{t}, then {other}: the duplicate ran nothing"
        );
        t.assert_effects(&run, 1, "ran once").await;
    }
}

#[tokio::test]
async fn principals_and_scopes_never_share_records() {
    for t in cases().await {
        let run = unique("isolation");
        let key = format!("{run}-shared");
        let tenant = |tenant: &str| TenantPay {
            tenant: tenant.to_owned(),
            key: key.clone(),
            run: run.clone(),
        };
        assert_eq!(
            call!(t, tenant_pay(tenant("acme"))).expect("acme"),
            "acme paid"
        );
        assert_eq!(
            call!(t, tenant_pay(tenant("globex"))).expect("globex"),
            "globex paid"
        );
        assert_eq!(
            call!(t, tenant_pay(tenant("acme"))).expect("acme replay"),
            "acme paid"
        );
        t.assert_effects(&run, 2, "one execution per principal")
            .await;

        let scoped = unique("scopes");
        let a = call!(t, pay(Pay::new(&scoped, 1))).expect("pay");
        let o = call!(t, other_scope_pay(Pay::new(&scoped, 1))).expect("other scope");
        assert_ne!(a, o, "{t}: another scope executes anew");
        t.assert_effects(&scoped, 2, "one execution per scope")
            .await;
    }
}

#[tokio::test]
async fn bad_keys_fail_before_any_database_work() {
    let long = "k".repeat(256);
    for t in bare_cases().await {
        for (key, expected) in [
            ("", ErrorKind::InvalidKey),
            (long.as_str(), ErrorKind::InvalidKey),
            ("line\nbreak", ErrorKind::InvalidKey),
            ("nul\0", ErrorKind::InvalidKey),
        ] {
            let cmd = Pay {
                key: key.to_owned(),
                run: unique("badkey"),
                amount: 1,
            };
            assert_eq!(
                call!(t, pay(cmd)).unwrap_err().kind(),
                Some(expected),
                "{t}: {key:?}"
            );
        }
    }
}

#[tokio::test]
async fn an_absent_optional_key_is_missing_key() {
    for t in cases().await {
        assert_eq!(
            call!(t, optional_key(None)).unwrap_err().kind(),
            ErrorKind::MissingKey,
            "{t}"
        );
        assert_eq!(
            call!(t, optional_key(Some(unique("k")))).expect("present"),
            1,
            "{t}"
        );
    }
}

#[tokio::test]
async fn a_missing_ledger_table_names_the_fix() {
    for t in bare_cases().await {
        let err = call!(t, pay(Pay::new(&unique("noledger"), 1))).unwrap_err();
        let PayError::Idem(err) = err else {
            panic!("{t}: expected an idem error")
        };
        assert_eq!(err.kind(), ErrorKind::Store, "{t}");
        let message = err.to_string();
        // The store's own fix: its `create_tables`, or (sqlx) `idem schema` in migrations.
        let fixes: &[&str] = match t.conn {
            Conn::SeaOrm => &["idem::sea_orm::create_tables"],
            _ => &["idem::sqlx::create_tables", "idem schema"],
        };
        assert!(message.contains("idem_ledger"), "{t}: {message}");
        for fix in fixes {
            assert!(message.contains(fix), "{t}: {message}");
        }
    }
}

#[tokio::test]
async fn a_record_that_no_longer_decodes_is_an_unreadable_answer() {
    for t in cases().await {
        let key = unique("decode");
        call!(t, decode_v1(key.clone())).expect("v1");
        let err = call!(t, decode_v2(key.clone())).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AnswerUnreadable, "{t}");
        assert_eq!(err.http_status(), 410);
        let message = err.to_string();
        // The key only by its hash: keys can carry user data.
        assert!(
            message.contains("test.decode") && !message.contains(&key),
            "{message}"
        );
    }
}

/// The expiry is the store's claim (through each store); the purge is the sqlx store's, and
/// removes the expired records both stores wrote (SeaORM's purge is stepped below). Each
/// waits out two expiries, so every case runs at once, and a backend's purge follows both of
/// its cases.
#[tokio::test]
async fn an_expired_key_executes_anew_and_purge_removes_it() {
    let _alone = PURGES.lock().await;
    let cases = cases().await;
    let backends = cases.chunk_by(|a, b| a.backend == b.backend);
    futures_util::future::join_all(backends.map(|backend| async move {
        let runs = futures_util::future::join_all(backend.iter().map(|t| async move {
            let run = unique("expiry");
            let first = call!(t, short_lived(Pay::new(&run, 1))).expect("first");
            let replay = call!(t, short_lived(Pay::new(&run, 1))).expect("replay");
            assert_eq!(first, replay, "{t}");
            // A TTL read at run time: 1 s expires as the literal does; 1 h replays (the
            // default, 24 h, would not expire either: the 1 s one shows the value is used).
            let (short, long) = (unique("configured-short"), unique("configured-long"));
            let ttl = Duration::from_secs;
            let short_first = call!(t, configured_ttl(Pay::new(&short, 1), ttl(1))).expect("1 s");
            let long_first = call!(t, configured_ttl(Pay::new(&long, 1), ttl(3600))).expect("1 h");
            tokio::time::sleep(Duration::from_millis(1300)).await;
            let later = call!(t, short_lived(Pay::new(&run, 1))).expect("after expiry");
            assert_ne!(first, later, "{t}: executed anew");
            t.assert_effects(&run, 2, "ran again after expiry").await;
            let short_later = call!(t, configured_ttl(Pay::new(&short, 1), ttl(1))).expect("1 s");
            let long_later = call!(t, configured_ttl(Pay::new(&long, 1), ttl(3600))).expect("1 h");
            assert_ne!(
                short_first, short_later,
                "{t}: a 1 s TTL read at run time expired"
            );
            assert_eq!(
                long_first, long_later,
                "{t}: a 1 h TTL read at run time replays"
            );
            t.assert_effects(&short, 2, "ran again after its run-time TTL")
                .await;
            t.assert_effects(&long, 1, "replayed within its run-time TTL")
                .await;
            // Expire it again, and keep a live record beside it.
            let live = unique("live");
            call!(t, pay(Pay::new(&live, 1))).expect("live");
            (run, live)
        }))
        .await;
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let db = &backend[0].db;
        let deleted = match &backend[1].conn {
            Conn::SeaOrm => idem::sea_orm::purge_expired(db, 2).await,
            Conn::SqlxSqlite(pool) => idem::sqlx::purge_expired(pool, 2).await,
            Conn::SqlxPostgres(pool) => idem::sqlx::purge_expired(pool, 2).await,
            Conn::SqlxMySql(pool) => idem::sqlx::purge_expired(pool, 2).await,
            Conn::TokioPostgres(pool) => idem::tokio_postgres::purge_expired(pool, 2).await,
        };
        assert!(deleted.expect("purge") >= 2, "{}", backend[1]);
        for (t, (run, live)) in backend.iter().zip(runs) {
            assert_purged(db, t.name, &run, &live).await;
        }
    }))
    .await;
}

/// Held by a test that purges: a purge deletes every expired record, whichever test wrote it,
/// so the counts of another purge's test would come out short.
static PURGES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The record of run `expired` is gone, the record of run `live` is still there.
async fn assert_purged(db: &DatabaseConnection, backend: &str, expired: &str, live: &str) {
    let (expired_key, live_key) = (format!("{expired}-key"), format!("{live}-key"));
    assert_eq!(
        ledger_rows(db, &expired_key).await,
        0,
        "{backend}: {expired}"
    );
    assert_eq!(ledger_rows(db, &live_key).await, 1, "{backend}: {live}");
}

/// The purges read only what they delete: on a ledger of 20,000 live records, and an outbox
/// of 20,000 messages published a moment ago, their statements read none of them from the
/// table. R22's soak found PostgreSQL's read the whole table on every purge (a volatile clock
/// cannot bound an index scan, and the planner estimated a third of the table would match).
/// Counted by the server itself, in the statement's own session: PostgreSQL's
/// `pg_stat_xact_user_tables.seq_tup_read`, MariaDB's `Handler_read_rnd_next`.
#[tokio::test]
async fn the_purges_read_their_index_not_the_whole_table() {
    use idem_sql::{Dialect, Purge, Sql};
    use sea_orm::{DbBackend, Statement, TransactionTrait};
    for common::isolated::Isolated { name, db, .. } in common::isolated::isolated().await {
        let backend = db.get_database_backend();
        let (dialect, series, hash, text) = match backend {
            DbBackend::Postgres => (
                Dialect::Postgres,
                "generate_series(1, 20000) AS s(seq)",
                "sha256(seq::text::bytea)",
                "seq::text",
            ),
            DbBackend::MySql => (
                Dialect::MySql,
                "seq_1_to_20000",
                "UNHEX(SHA2(seq, 256))",
                "CONCAT('', seq)",
            ),
            // SQLite's purge sweeps the ledger in key order by design (no expiry index).
            _ => continue,
        };
        let fills = [
            format!(
                "INSERT INTO idem_ledger SELECT {hash}, 'test.plan', '', {text}, 1, {hash}, 2, \
                 NULL, 0, 9000000000000 FROM {series}"
            ),
            format!(
                "INSERT INTO idem_outbox (message_id, topic, payload, state, attempts, \
                 next_attempt_at_ms, locked_until_ms, locked_by, created_at_ms, \
                 published_at_ms) SELECT {text}, 'test.plan', {hash}, 1, 1, 0, 0, 0, 0, \
                 9000000000000 FROM {series}"
            ),
        ];
        for fill in fills {
            db.execute_unprepared(&fill).await.expect("the rows");
        }
        for table in ["idem_ledger", "idem_outbox"] {
            let analyze = match backend {
                DbBackend::Postgres => format!("ANALYZE {table}"),
                _ => format!("ANALYZE TABLE {table}"),
            };
            db.execute_unprepared(&analyze).await.expect("statistics");
        }
        let sql = Sql::common(dialect);
        let Purge::ByIndex(ledger_purge) = sql.ledger.purge(true) else {
            panic!("{name}: a purge by the expiry index");
        };
        let purges = [
            (
                "idem_ledger",
                ledger_purge.delete(500),
                vec![500_i64.into()],
            ),
            (
                "idem_outbox",
                sql.outbox.purge_published(3_600_000, 500),
                vec![3_600_000_i64.into(), 500_i64.into()],
            ),
        ];
        for (table, purge, values) in purges {
            let rows_scanned = match backend {
                DbBackend::Postgres => format!(
                    "SELECT seq_tup_read FROM pg_stat_xact_user_tables \
                     WHERE relid = '{table}'::regclass"
                ),
                _ => "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM \
                      information_schema.SESSION_STATUS \
                      WHERE VARIABLE_NAME = 'HANDLER_READ_RND_NEXT'"
                    .to_owned(),
            };
            let tx = db.begin().await.expect("begin");
            let scanned = async || -> i64 {
                let row = tx
                    .query_one_raw(Statement::from_string(backend, rows_scanned.clone()))
                    .await
                    .expect("the server's count")
                    .expect("a row");
                row.try_get_by_index(0).expect("a count")
            };
            // Reading MariaDB's counter scans a table of its own: take that cost off.
            let (first, before) = (scanned().await, scanned().await);
            let reading_costs = before - first;
            let deleted = tx
                .execute_raw(Statement::from_sql_and_values(
                    backend,
                    purge.sql.as_ref(),
                    values,
                ))
                .await
                .expect("the purge's statement")
                .rows_affected();
            let read = scanned().await - before - reading_costs;
            // The counter sees a read of the whole table (so the bound below can fail).
            let before = scanned().await;
            let whole = format!("SELECT COUNT(*) FROM {table} WHERE created_at_ms >= 0");
            tx.query_one_raw(Statement::from_string(backend, whole))
                .await
                .expect("a read of every row");
            let whole = scanned().await - before - reading_costs;
            tx.rollback().await.expect("rollback");
            assert!(
                whole >= 20_000,
                "{name}: a read of all {table} counted {whole}"
            );
            assert_eq!(deleted, 0, "{name}: nothing in {table} is due");
            assert!(
                read < 100,
                "{name}: the purge read {read} rows of 20,000 in {table}"
            );
        }
    }
}

/// Each store's `ExpiredPurge`, a step at a time, on the records its own calls wrote.
#[tokio::test]
async fn a_stepped_purge_removes_every_expired_record_and_no_live_one() {
    let _alone = PURGES.lock().await;
    for t in cases().await {
        let run = unique("sweep");
        let name = |kind: &str, i: usize| format!("{run}-{kind}{i}");
        for i in 0..12 {
            call!(t, short_lived(Pay::new(&name("e", i), 1))).expect("short-lived");
            call!(t, pay(Pay::new(&name("l", i), 1))).expect("live");
        }
        // A step whose record is gone (deleted by hand): only the operator's purge looks
        // for those, since finding them reads the whole ledger.
        let orphan = idem::store::record_id("test.orphan", "", &run);
        t.db.execute_raw(sea_orm::Statement::from_sql_and_values(
            t.db.get_database_backend(),
            idem::sea_orm::placeholders(
                t.db.get_database_backend(),
                "INSERT INTO idem_steps (record_id, name, token, result, created_at_ms) \
                 VALUES (?, 'orphan', 1, ?, 0)",
            ),
            [orphan.to_vec().into(), vec![0_u8].into()],
        ))
        .await
        .expect("an orphaned step");
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let purge = |orphans: bool| {
            let (sea_orm, sqlx) = (
                idem::sea_orm::ExpiredPurge::new(),
                idem::sqlx::ExpiredPurge::new(),
            );
            match orphans {
                true => (sea_orm.with_orphans(), sqlx.with_orphans()),
                false => (sea_orm, sqlx),
            }
        };
        for orphans in [false, true] {
            let (mut sea_orm, mut sqlx) = purge(orphans);
            let mut step = async || match &t.conn {
                Conn::SeaOrm => sea_orm.step(&t.db, 3).await,
                Conn::SqlxSqlite(pool) => sqlx.step(pool, 3).await,
                Conn::SqlxPostgres(pool) => sqlx.step(pool, 3).await,
                Conn::SqlxMySql(pool) => sqlx.step(pool, 3).await,
                Conn::TokioPostgres(pool) => sqlx.step(pool, 3).await,
            };
            let mut steps = 0;
            while step().await.expect("step").is_some() {
                steps += 1;
            }
            assert_eq!(step().await.expect("after"), None, "{t}");
            let (finished, deleted) = match t.conn {
                Conn::SeaOrm => (sea_orm.is_finished(), sea_orm.deleted()),
                _ => (sqlx.is_finished(), sqlx.deleted()),
            };
            assert!(finished, "{t}");
            let orphaned = steps_of(&t.db, &orphan).await;
            if orphans {
                assert_eq!(
                    orphaned, 0,
                    "{t}: the operator's purge deletes the orphaned step"
                );
                continue;
            }
            assert_eq!(
                orphaned, 1,
                "{t}: a periodic purge leaves the ledger unread"
            );
            // Three rows per statement: twelve expired records need at least four statements.
            assert!(steps >= 4, "{t}: {steps} steps");
            assert!(deleted >= 12, "{t}: {deleted}");
            for i in 0..12 {
                assert_purged(&t.db, t.name, &name("e", i), &name("l", i)).await;
            }
        }
    }
}

/// The steps recorded under `record_id`.
async fn steps_of(db: &DatabaseConnection, record_id: &[u8]) -> i64 {
    let backend = db.get_database_backend();
    let sql = idem::sea_orm::placeholders(
        backend,
        "SELECT COUNT(*) FROM idem_steps WHERE record_id = ?",
    );
    db.query_one_raw(sea_orm::Statement::from_sql_and_values(
        backend,
        sql,
        [record_id.to_vec().into()],
    ))
    .await
    .expect("steps")
    .expect("a row")
    .try_get_by_index(0)
    .expect("a count")
}

/// SeaORM's: its `create_tables` reruns SQLite's DDL, which drops the index (the sqlx store's
/// case, the same through its own `create_tables`, is in `tests/sqlx.rs`).
#[tokio::test]
async fn a_sqlite_ledger_of_an_earlier_version_loses_its_index_and_keeps_working() {
    use on_sea_orm::{pay, short_lived};
    // The layout of earlier versions: WITHOUT ROWID, with an expiry index.
    let db = common::connect(&common::sqlite_url("idem-old-ledger"), 1).await;
    db.execute_unprepared(
        "CREATE TABLE idem_ledger (id BLOB NOT NULL PRIMARY KEY, scope TEXT NOT NULL, \
         principal TEXT NOT NULL, idem_key TEXT NOT NULL, owner INTEGER NOT NULL, \
         fingerprint BLOB NOT NULL, state INTEGER NOT NULL, response BLOB NULL, \
         created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL) WITHOUT ROWID",
    )
    .await
    .expect("the old ledger");
    db.execute_unprepared("CREATE INDEX idem_ledger_expires ON idem_ledger (expires_at_ms)")
        .await
        .expect("the old index");
    common::prepare(&db).await;
    let row = db
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Sqlite,
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = 'idem_ledger_expires'",
        ))
        .await
        .expect("schema")
        .expect("a row");
    assert_eq!(row.try_get_by_index::<i64>(0).expect("count"), 0);

    let (run, live) = (unique("old-expired"), unique("old-live"));
    let first = short_lived(&db, Pay::new(&run, 1)).await.expect("first");
    let replay = short_lived(&db, Pay::new(&run, 1)).await.expect("replay");
    assert_eq!(first, replay);
    pay(&db, Pay::new(&live, 1)).await.expect("live");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let deleted = idem::sea_orm::purge_expired(&db, 1).await.expect("purge");
    assert_eq!(deleted, 1);
    assert_eq!(effects(&db, &run).await, 1);
    assert_purged(&db, "sqlite (earlier layout)", &run, &live).await;
}

#[tokio::test]
async fn methods_take_the_connection_from_self() {
    for t in cases().await {
        let run = unique("method");
        let first = call!(t, pay_by_method(Pay::new(&run, 4))).expect("first");
        let again = call!(t, pay_by_method(Pay::new(&run, 4))).expect("again");
        assert_eq!(first, again, "{t}");
        t.assert_effects(&run, 1, "ran once").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_past_its_bound_is_in_flight_then_the_retry_replays() {
    for t in cases().await {
        let run = unique("bounded");
        let gate = Gate::default();
        let (holder, cmd, held) = (t.clone(), Pay::new(&run, 5), gate.clone());
        let first = tokio::spawn(async move { call!(holder, bounded_wait_pay(cmd, held)) });
        gate.entered().await;
        let started = Instant::now();
        let duplicate = call!(t, bounded_wait_pay(Pay::new(&run, 5), Gate::default()));
        let waited = started.elapsed();
        assert_eq!(
            duplicate.unwrap_err().kind(),
            Some(ErrorKind::InFlight),
            "{t}"
        );
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
            "{t}: waited {waited:?} for a 300 ms bound"
        );
        gate.release();
        let first = first.await.expect("join").expect("first");
        // A retry that ran its body would wait at its gate: bounded, so it fails instead.
        let retry = tokio::time::timeout(Duration::from_secs(5), async {
            call!(t, bounded_wait_pay(Pay::new(&run, 5), Gate::default()))
        });
        let retry = retry
            .await
            .expect("the retry replays, its body does not run");
        assert_eq!(retry.expect("replay"), first, "{t}");
        t.assert_effects(&run, 1, "ran once").await;
    }
}

/// PostgreSQL answers a replay from the claim statement's own snapshot: a completed record
/// is final until it expires, so the replay needs no row lock and is not held up by another
/// transaction that holds one (MySQL's claim locks the row; SQLite serialises writers).
#[tokio::test]
async fn a_replay_on_postgres_takes_no_row_lock() {
    for t in cases().await {
        if t.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            continue;
        }
        let run = unique("nolock");
        let first = call!(t, pay(Pay::new(&run, 700))).expect("first call");
        let blocker = sea_orm::TransactionTrait::begin(&t.db)
            .await
            .expect("begin");
        let id = idem::store::record_id("test.pay", "", &format!("{run}-key"));
        blocker
            .query_one_raw(sea_orm::Statement::from_sql_and_values(
                sea_orm::DbBackend::Postgres,
                "SELECT state FROM idem_ledger WHERE id = $1 FOR UPDATE",
                vec![id.to_vec().into()],
            ))
            .await
            .expect("lock the record")
            .expect("the record");
        let (again, outcome) = tokio::time::timeout(
            Duration::from_secs(3),
            with_outcome(async { call!(t, pay(Pay::new(&run, 700))) }),
        )
        .await
        .unwrap_or_else(|_| panic!("{t}: the replay waited for the row lock"));
        drop(blocker);
        assert_eq!(again.expect("replay"), first, "{t}");
        assert_eq!(outcome, Some(Outcome::Replayed), "{t}");
        t.assert_effects(&run, 1, "body ran once").await;
    }
}

/// `create_tables` reads the catalogue and issues no DDL where the tables exist (on a
/// cluster even `CREATE TABLE IF NOT EXISTS` aborts commits cluster-wide). PostgreSQL proves
/// it: a read-only session refuses any DDL, existing table or not (SQLite and MariaDB let a
/// no-op `IF NOT EXISTS` through, so they cannot tell). Each store's `create_tables`, on a
/// pool of one connection, so the session's setting holds for it.
#[tokio::test]
async fn create_tables_issues_no_ddl_where_the_tables_exist() {
    for (name, url) in common::server_urls() {
        if name != "postgres" {
            continue;
        }
        let db = common::connect(&url, 1).await;
        idem::sea_orm::create_tables(&db).await.expect("create");
        db.execute_unprepared("SET default_transaction_read_only = on")
            .await
            .expect("read-only session");
        idem::sea_orm::create_tables(&db)
            .await
            .expect("everything exists: nothing to create");
        let e = db
            .execute_unprepared("CREATE TABLE IF NOT EXISTS idem_ledger (id INTEGER)")
            .await
            .expect_err("the session really refuses DDL");
        assert!(e.to_string().contains("read-only"), "{e}");

        // sqlx's, on a pool of one connection: the session's setting holds for its calls.
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1);
        let pool = pool.connect(&url).await.expect("PostgreSQL");
        let (all, sql) = (idem::sqlx::Family::ALL, sqlx::raw_sql);
        let created = idem::sqlx::create_tables(&pool, &all).await;
        created.expect("create");
        let set = sql("SET default_transaction_read_only = on").execute(&pool);
        set.await.expect("read-only session");
        let again = idem::sqlx::create_tables(&pool, &all).await;
        again.expect("sqlx: everything exists: nothing to create");
        let ddl = sql("CREATE TABLE IF NOT EXISTS idem_ledger (id INTEGER)").execute(&pool);
        let e = ddl.await.expect_err("the session really refuses DDL");
        assert!(e.to_string().contains("read-only"), "{e}");
    }
}

#[tokio::test]
async fn a_panic_in_an_atomic_body_rolls_back_and_frees_the_key() {
    for t in cases().await {
        let run = unique("panic");
        let panics = Arc::new(AtomicBool::new(true));
        let (call, flag, cmd) = (t.clone(), panics.clone(), Pay::new(&run, 1));
        let panicked = tokio::spawn(async move { call!(call, pay_or_panic(&flag, cmd)) }).await;
        assert!(panicked.is_err_and(|e| e.is_panic()), "{t}");
        t.assert_effects(&run, 0, "the panicked write rolled back")
            .await;
        let (retry, outcome) =
            with_outcome(async { call!(t, pay_or_panic(&panics, Pay::new(&run, 1))) }).await;
        assert!(retry.is_ok(), "{t}: {retry:?}");
        assert_eq!(outcome, Some(Outcome::Executed), "{t}");
        t.assert_effects(&run, 1, "the retry ran it once").await;
    }
}
