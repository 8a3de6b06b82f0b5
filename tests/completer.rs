//! Resumable lease-mode calls and the completer, on every backend of the run: a call whose
//! client went away is finished by a completer (its recorded charge replays, the payment is
//! written once), completers and a client racing for one call run it once, a call that keeps
//! failing is given up after its attempts with the hook run once and the give-up replayed to
//! the client, a scope without a resumer is left alone and reported, and oversized arguments
//! are refused before any claim. Every case runs through both stores (SeaORM's and sqlx's, the
//! handlers written once for each connection type: `handlers!`, as in `tests/lease.rs`), and
//! counts effect rows and gateway calls, on databases of its own (a completer works on every
//! call of its database).

mod common;

use common::stores::{Conn, call};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::isolated::isolated;
use common::{Gate, effects, insert_effect, unique};
use idem::completer::{Due, GaveUp, ResumeStore, Resumed, Round, Steps, StoredCall};
use idem::lease::BoxFuture;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::sqlx::SqlxLeaseStore;
use idem::{ErrorKind, Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde::{Deserialize, Serialize};

/// A payment gateway that deduplicates on the idempotency key, as Stripe does, and counts
/// every call it gets.
#[derive(Clone, Default)]
struct Gateway {
    calls: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    async fn charge(&self, key: String) -> Result<String, TestError> {
        self.calls.lock().expect("lock").push(key.clone());
        Ok(format!("ch_{}", &key[..12]))
    }

    fn calls(&self) -> usize {
        self.calls.lock().expect("lock").len()
    }
}

/// What a call does after its charge.
#[derive(Clone, Default)]
struct After {
    /// Hold there until the test releases it (or drops the call).
    gate: Option<Gate>,
    /// Fail transiently there, every time.
    fail: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pay {
    key: String,
    run: String,
    amount: i64,
}

#[derive(Debug)]
enum TestError {
    Idem(idem::Error),
    Flaky,
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl std::fmt::Display for TestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Idem(e) => write!(f, "{e}"),
            Self::Flaky => f.write_str("the gateway timed out on the way back"),
        }
    }
}

const SCOPE: &str = "completer.pay";

/// The handlers, once per kind of connection, so every case runs on both stores: `$conn` is
/// what they take (SeaORM's connection or a sqlx pool), `final_step` the store's final phase,
/// and `insert` writes a payment row in the phase's transaction `$tx`.
macro_rules! handlers {
    (
        $module:ident,
        $conn:ty,
        final_step = $final_step:path,
        insert = |$tx:ident, $run:ident, $amount:ident| $insert:expr $(,)?
    ) => {
        mod $module {
            use super::*;

            /// The handler's final step: the payment row and the charge's answer, in one
            /// fenced transaction.
            async fn record_payment(
                db: &$conn,
                cmd: &Pay,
                charge: String,
            ) -> Result<String, TestError> {
                let (run, amount) = (cmd.run.clone(), cmd.amount);
                $final_step(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        let ($run, $amount) = (&run, amount);
                        $insert;
                        Ok::<_, TestError>(charge)
                    })
                })
                .await
            }

            #[idempotent(
                                                                scope = "completer.pay",
                                                                key = cmd.key,
                                                                lease = "1s",
                                                                resumable,
                                                                skip(gateway, after)
                                                            )]
            pub(crate) async fn pay(
                db: &$conn,
                gateway: &Gateway,
                after: &After,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge: String = idem::step("charge", |key| gateway.charge(key)).await?;
                if let Some(gate) = &after.gate {
                    gate.pass().await;
                }
                if after.fail {
                    return Err(TestError::Flaky);
                }
                record_payment(db, &cmd, charge).await
            }

            /// A resumable handler whose argument is large.
            #[idempotent(scope = "completer.large", key = key, lease = "1s", resumable)]
            pub(crate) async fn large(
                db: &$conn,
                key: String,
                blob: String,
            ) -> Result<usize, TestError> {
                let _ = db;
                Ok(blob.len())
            }

            /// Fails (transiently) after its final phase committed, while `failures` lasts.
            #[idempotent(
                                                                scope = "completer.after-final",
                                                                key = cmd.key,
                                                                lease = "1s",
                                                                resumable,
                                                                skip(failures)
                                                            )]
            pub(crate) async fn pay_then_flake(
                db: &$conn,
                failures: &AtomicU32,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let run = cmd.run.clone();
                let answer = $final_step(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        let ($run, $amount) = (&run, 1_i64);
                        $insert;
                        Ok::<_, TestError>(format!("paid {run}"))
                    })
                })
                .await?;
                if failures
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return Err(TestError::Flaky);
                }
                Ok(answer)
            }

            /// Charges, then hangs while `hangs` is set; stopped at its deadline.
            #[idempotent(
                                                                scope = "completer.hangs",
                                                                key = cmd.key,
                                                                lease = "1s",
                                                                deadline = "1500ms",
                                                                resumable,
                                                                skip(gateway, hangs)
                                                            )]
            pub(crate) async fn pay_or_hang(
                db: &$conn,
                gateway: &Gateway,
                hangs: &std::sync::atomic::AtomicBool,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge: String = idem::step("charge", |key| gateway.charge(key)).await?;
                if hangs.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                record_payment(db, &cmd, charge).await
            }
        }
    };
}

handlers!(
    on_sea_orm,
    DatabaseConnection,
    final_step = idem::sea_orm::final_step,
    insert = |tx, run, amount| insert_effect(tx, run, "payment", amount).await,
);

/// The sqlx handlers' statements, in `$p`'s placeholders.
macro_rules! sqlx_handlers {
    ($module:ident, $pool:ty, $p1:literal, $p2:literal, $p3:literal) => {
        handlers!(
            $module,
            $pool,
            final_step = idem::sqlx::final_step,
            insert = |tx, run, amount| sqlx::query(concat!(
                "INSERT INTO idem_test_effects (run_id, label, amount) VALUES (",
                $p1,
                ", ",
                $p2,
                ", ",
                $p3,
                ")"
            ))
            .bind(run)
            .bind("payment")
            .bind(amount)
            .execute(&mut *tx)
            .await
            .expect("insert effect"),
        );
    };
}

sqlx_handlers!(on_sqlx_sqlite, sqlx::SqlitePool, "?", "?", "?");
sqlx_handlers!(on_sqlx_postgres, sqlx::PgPool, "$1", "$2", "$3");
sqlx_handlers!(on_sqlx_mysql, sqlx::MySqlPool, "?", "?", "?");

handlers!(
    on_tokio_postgres,
    idem::tokio_postgres::deadpool_postgres::Pool,
    final_step = idem::tokio_postgres::final_step,
    insert = |tx, run, amount| tx
        .execute(
            "INSERT INTO idem_test_effects (run_id, label, amount) VALUES ($1, $2, $3)",
            &[run, &"payment", &amount],
        )
        .await
        .expect("insert effect"),
);

/// The case's store, whichever it is, so one completer type serves every case.
#[derive(Clone)]
struct AnyStore(Arc<dyn ResumeStore>);

impl ResumeStore for AnyStore {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, idem::Error>> {
        self.0.due_calls(scopes, limit)
    }

    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, idem::Error>> {
        self.0.begin_attempt(call, backoff)
    }

    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), idem::Error>> {
        self.0.note_failure(call, error)
    }

    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, idem::Error>> {
        self.0.give_up(call, payload, hook_retry)
    }

    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, idem::Error>> {
        self.0.steps(call)
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), idem::Error>> {
        self.0.forget(call)
    }

    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, idem::Error>> {
        self.0.unregistered(scopes)
    }
}

/// A completer on either store.
type Completer = idem::completer::Completer<AnyStore>;

fn cmd(run: &str) -> Pay {
    Pay {
        key: format!("{run}-k"),
        run: run.to_owned(),
        amount: 700,
    }
}

/// One test on one backend and one store: its gateway and its run (one order, paid under key
/// `<run>-k`). `db` is the backend's SeaORM connection, which the test reads through whichever
/// store the calls use.
#[derive(Clone)]
struct Case {
    name: &'static str,
    db: DatabaseConnection,
    conn: Conn,
    gateway: Gateway,
    run: String,
}

/// A case of run `run` per backend of the run and per store, each on a database of its own:
/// sqlx's store, tokio-postgres's (on PostgreSQL), then SeaORM's.
async fn cases(run: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    for backend in isolated().await {
        let conn = Conn::sqlx(backend.name, &backend.url).await;
        let name = conn.name(backend.name);
        cases.push(Case {
            name,
            db: backend.db,
            conn,
            gateway: Gateway::default(),
            run: unique(run),
        });
    }
    for backend in isolated().await {
        if backend.name != "postgres" {
            continue;
        }
        cases.push(Case {
            name: "postgres (tokio-postgres)",
            db: backend.db,
            conn: Conn::tokio_postgres(&backend.url),
            gateway: Gateway::default(),
            run: unique(run),
        });
    }
    for backend in isolated().await {
        cases.push(Case {
            name: backend.name,
            db: backend.db,
            conn: Conn::SeaOrm,
            gateway: Gateway::default(),
            run: unique(run),
        });
    }
    cases
}

impl Case {
    /// The case's store.
    fn store(&self) -> AnyStore {
        AnyStore(match &self.conn {
            Conn::SeaOrm => Arc::new(SeaOrmLeaseStore::new(self.db.clone())),
            Conn::SqlxSqlite(pool) => Arc::new(SqlxLeaseStore::new(pool.clone())),
            Conn::SqlxPostgres(pool) => Arc::new(SqlxLeaseStore::new(pool.clone())),
            Conn::SqlxMySql(pool) => Arc::new(SqlxLeaseStore::new(pool.clone())),
            Conn::TokioPostgres(pool) => {
                Arc::new(idem::tokio_postgres::TokioPostgresStore::new(pool))
            }
        })
    }

    /// A completer on the case's store, with no resumer yet.
    fn bare_completer(&self) -> Completer {
        Completer::new(self.store())
    }

    /// A call that charged and was dropped while it held its lease: its client is gone.
    async fn abandoned(&self) {
        let gate = Gate::default();
        let after = After {
            gate: Some(gate.clone()),
            fail: false,
        };
        let t = self.clone();
        let held = tokio::spawn(async move { call!(t, pay(&t.gateway, &after, cmd(&t.run))) });
        gate.entered().await;
        held.abort();
        let _ = held.await;
    }

    /// A completer for `pay` whose resumer behaves as `after` says, with no backoff.
    fn completer(&self, after: After) -> Completer {
        let case = self.clone();
        self.bare_completer()
            .backoff(Duration::ZERO, Duration::ZERO)
            .resume(SCOPE, move |call: Resumed<(Pay,)>| {
                let (case, after) = (case.clone(), after.clone());
                async move { call!(case, pay(&case.gateway, &after, call.args.0)) }
            })
    }

    /// The client's call, failing after its charge when `after` says so.
    async fn pay(&self, after: &After) -> Result<String, TestError> {
        call!(self, pay(&self.gateway, after, cmd(&self.run)))
    }

    /// The client's late retry, straight through.
    async fn client_retry(&self) -> (Result<String, TestError>, Option<Outcome>) {
        with_outcome(self.pay(&After::default())).await
    }

    async fn assert_paid_once(&self, what: &str) {
        assert_eq!(
            effects(&self.db, &self.run).await,
            1,
            "{}: one payment ({what})",
            self.name
        );
        assert_eq!(
            self.gateway.calls(),
            1,
            "{}: one charge ({what})",
            self.name
        );
    }

    /// The run's stored calls (1 while it is in progress or its give-up hook is owed).
    async fn calls_rows(&self) -> i64 {
        count(
            &self.db,
            "SELECT COUNT(*) FROM idem_calls c JOIN idem_ledger l ON l.id = c.record_id \
            WHERE l.idem_key = ?",
            &format!("{}-k", self.run),
        )
        .await
    }
}

async fn count(db: &DatabaseConnection, sql: &str, value: &str) -> i64 {
    let backend = db.get_database_backend();
    db.query_one_raw(Statement::from_sql_and_values(
        backend,
        idem::sea_orm::placeholders(backend, sql),
        [value.into()],
    ))
    .await
    .expect("query")
    .expect("row")
    .try_get_by_index::<i64>(0)
    .expect("integer")
}

/// Runs `completer` round after round until `done` says so (at most 15 s): every round's sum.
async fn until(completer: &Completer, done: impl Fn(&Round) -> bool) -> Round {
    let mut total = Round::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let round = completer.run_once().await.expect("completer round");
        total.resumed += round.resumed;
        total.finished += round.finished;
        total.failed += round.failed;
        total.gave_up += round.gave_up;
        total.hooks_run += round.hooks_run;
        if done(&total) {
            return total;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completer did not get there: {total:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_abandoned_call_is_finished_by_the_completer_and_the_client_retry_replays() {
    for case in cases("finish").await {
        case.abandoned().await;
        // Before the completer: the lease ends, and the listing says a completer can finish it.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let listed = idem::sea_orm::expired_leases(&case.db, 1000)
            .await
            .expect("list");
        let ours = listed
            .iter()
            .find(|l| l.key == format!("{}-k", case.run))
            .expect("the abandoned lease is listed");
        assert!(ours.resumable, "{}: listed as resumable", case.name);
        assert_eq!(effects(&case.db, &case.run).await, 0, "{}", case.name);

        let completer = case.completer(After::default());
        let round = until(&completer, |r| r.finished >= 1).await;
        assert_eq!((round.resumed, round.failed), (1, 0), "{}", case.name);
        case.assert_paid_once("finished by the completer").await;
        assert_eq!(
            case.calls_rows().await,
            0,
            "{}: stored call forgotten",
            case.name
        );

        let (answer, outcome) = case.client_retry().await;
        let answer = answer.unwrap_or_else(|e| panic!("{}: retry: {e}", case.name));
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", case.name);
        assert!(answer.starts_with("ch_"), "{}: {answer}", case.name);
        case.assert_paid_once("after the client's retry").await;
        // Nothing left for a second completer round.
        let again = completer.run_once().await.expect("round");
        assert_eq!(again.resumed, 0, "{}", case.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_completers_and_a_client_racing_for_one_call_run_it_once() {
    for case in cases("race").await {
        case.abandoned().await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (first, second) = (
            case.completer(After::default()),
            case.completer(After::default()),
        );
        let (a, b, client) = tokio::join!(first.run_once(), second.run_once(), case.client_retry());
        let (a, b) = (a.expect("first"), b.expect("second"));
        // The client either ran it, replayed it, or met a completer's live lease.
        match client {
            (Ok(_), Some(_)) => {}
            (Err(TestError::Idem(e)), None) if e.kind() == ErrorKind::InFlight => {}
            (other, outcome) => panic!("{}: client: {other:?} {outcome:?}", case.name),
        }
        let finished = a.finished + b.finished;
        // Whoever lost the race finishes nothing; keep going until the call is recorded.
        if finished == 0 && case.client_retry().await.0.is_err() {
            until(&first, |r| r.finished >= 1).await;
        }
        case.assert_paid_once("two completers and a client").await;
        assert_eq!(
            case.client_retry().await.1,
            Some(Outcome::Replayed),
            "{}",
            case.name
        );
    }
}

#[tokio::test]
async fn a_call_that_keeps_failing_is_given_up_once_with_its_hook_and_the_retry_replays_it() {
    for case in cases("give-up").await {
        // The client's own call fails transiently after the charge: its lease ends at once.
        let failing = After {
            gate: None,
            fail: true,
        };
        let first = case.pay(&failing).await;
        assert!(matches!(first, Err(TestError::Flaky)), "{}", case.name);

        let hooks = Arc::new(Mutex::new(Vec::<(GaveUp, Option<String>)>::new()));
        let seen = Arc::clone(&hooks);
        let completer =
            case.completer(failing)
                .max_attempts(3)
                .on_give_up(move |gave_up: GaveUp| {
                    let seen = Arc::clone(&seen);
                    async move {
                        let charge = gave_up.step::<String>("charge")?;
                        seen.lock().expect("lock").push((gave_up, charge));
                        Ok::<_, idem::Error>(())
                    }
                });
        let round = until(&completer, |r| r.gave_up >= 1).await;
        assert_eq!((round.resumed, round.failed), (3, 3), "{}", case.name);
        // More rounds find nothing more to do: the hook ran once.
        for _ in 0..3 {
            let more = completer.run_once().await.expect("round");
            let did = (more.resumed, more.gave_up, more.hooks_run);
            assert_eq!(did, (0, 0, 0), "{}: {more:?}", case.name);
        }
        let hooks = std::mem::take(&mut *hooks.lock().expect("lock"));
        assert_eq!(hooks.len(), 1, "{}: the hook ran once", case.name);
        let (gave_up, charge) = &hooks[0];
        assert_eq!(gave_up.attempts, 3, "{}", case.name);
        assert!(
            gave_up.reason.contains("timed out"),
            "{}: {}",
            case.name,
            gave_up.reason
        );
        assert!(
            charge.is_some(),
            "{}: the hook sees the charge to refund",
            case.name
        );
        assert_eq!(gave_up.args::<(Pay,)>().expect("args").0.run, case.run);

        // The client's retry replays the give-up, every time, and nothing runs again.
        for _ in 0..2 {
            let (answer, outcome) = case.client_retry().await;
            match answer {
                Err(TestError::Idem(e)) if e.kind() == ErrorKind::GaveUp => {
                    assert_eq!(e.http_status(), 500);
                }
                other => panic!("{}: expected the give-up, got {other:?}", case.name),
            }
            assert_eq!(outcome, Some(Outcome::Replayed), "{}", case.name);
        }
        assert_eq!(
            effects(&case.db, &case.run).await,
            0,
            "{}: no payment",
            case.name
        );
        assert_eq!(case.gateway.calls(), 1, "{}: charged once", case.name);
        assert_eq!(
            case.calls_rows().await,
            0,
            "{}: forgotten after the hook",
            case.name
        );
    }
}

#[tokio::test]
async fn a_failed_hook_runs_again_until_it_succeeds() {
    for case in cases("hook-again").await {
        let failing = After {
            gate: None,
            fail: true,
        };
        let _ = case.pay(&failing).await;
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        let store = case.store();
        let completer = case
            .completer(failing)
            .max_attempts(1)
            .on_give_up(move |_: GaveUp| {
                let n = counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        Err("the refund service is down")
                    } else {
                        Ok(())
                    }
                }
            });
        until(&completer, |r| r.gave_up >= 1).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}", case.name);
        // The failed hook is owed: due again after HOOK_RETRY (30 s); bring it forward.
        assert_eq!(case.calls_rows().await, 1, "{}: still owed", case.name);
        case.db
            .execute_unprepared("UPDATE idem_calls SET next_attempt_at_ms = 0 WHERE gave_up = 1")
            .await
            .expect("bring the hook forward");
        until(&completer, |r| r.hooks_run >= 1).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{}", case.name);
        assert_eq!(case.calls_rows().await, 0, "{}: forgotten", case.name);
        let due = store.due_calls(&[SCOPE], 10).await.expect("due");
        assert!(due.calls.iter().all(|c| !c.key.starts_with(&case.run)));
    }
}

#[tokio::test]
async fn a_scope_without_a_resumer_is_left_alone_and_reported() {
    for case in cases("unregistered").await {
        case.abandoned().await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let store = case.store();
        let theirs = case.clone();
        let elsewhere =
            case.bare_completer()
                .resume("completer.other", move |call: Resumed<(Pay,)>| {
                    let case = theirs.clone();
                    async move { call!(case, pay(&case.gateway, &After::default(), call.args.0)) }
                });
        let round = elsewhere.run_once().await.expect("round");
        assert_eq!(round.resumed, 0, "{}", case.name);
        let unregistered = store
            .unregistered(&["completer.other"])
            .await
            .expect("unregistered");
        assert!(
            unregistered
                .iter()
                .any(|(scope, n)| scope == SCOPE && *n >= 1),
            "{}: {unregistered:?}",
            case.name
        );
        assert_eq!(effects(&case.db, &case.run).await, 0, "{}", case.name);
        // A client retry still finishes it.
        assert!(case.client_retry().await.0.is_ok(), "{}", case.name);
        case.assert_paid_once("the client came back").await;
    }
}

#[tokio::test]
async fn arguments_that_no_longer_decode_fail_each_attempt_then_give_up() {
    for case in cases("decode").await {
        case.abandoned().await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        // A resumer that expects other arguments (a deploy changed the handler).
        let completer = case
            .bare_completer()
            .backoff(Duration::ZERO, Duration::ZERO)
            .max_attempts(2)
            .resume(SCOPE, move |call: Resumed<(u64, u64)>| {
                let _ = call.args;
                async { Ok::<(), TestError>(()) }
            });
        let round = until(&completer, |r| r.gave_up >= 1).await;
        assert_eq!(round.failed, 2, "{}", case.name);
        match case.client_retry().await.0 {
            Err(TestError::Idem(idem::Error::GaveUp { reason, .. })) => {
                assert!(reason.contains("do not decode"), "{}: {reason}", case.name);
            }
            other => panic!("{}: {other:?}", case.name),
        }
        assert_eq!(effects(&case.db, &case.run).await, 0, "{}", case.name);
    }
}

#[tokio::test]
async fn arguments_over_the_limit_are_refused_before_any_claim() {
    for case in cases("large").await {
        let key = unique("large");
        let blob = "x".repeat(idem::completer::MAX_STORED_ARGS);
        let refused = call!(case, large(key.clone(), blob));
        match refused {
            Err(TestError::Idem(idem::Error::ArgumentsTooLarge { size, limit, .. })) => {
                assert!(size > limit, "{}", case.name);
            }
            other => panic!("{}: {other:?}", case.name),
        }
        assert_eq!(
            common::ledger_rows(&case.db, &key).await,
            0,
            "{}",
            case.name
        );
        // Under the limit it runs.
        let fine = call!(case, large(unique("small"), "x".repeat(1000)));
        assert_eq!(fine.ok(), Some(1000), "{}", case.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_completer_outlives_store_errors_and_finishes_the_call() {
    for case in cases("run").await {
        case.abandoned().await;
        // The calls table disappears (an operator's mistake, a failover): every round fails.
        rename(&case.db, "idem_calls", "idem_calls_away").await;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let completer = case
            .completer(After::default())
            .poll_interval(Duration::from_millis(50));
        let running = tokio::spawn(completer.run(async {
            let _ = stopped.await;
        }));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !running.is_finished(),
            "{}: run returned on errors",
            case.name
        );
        assert_eq!(effects(&case.db, &case.run).await, 0, "{}", case.name);
        rename(&case.db, "idem_calls_away", "idem_calls").await;
        // It recovers by itself (its backoff is capped at ten poll intervals).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while effects(&case.db, &case.run).await == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}: the running completer never finished the call",
                case.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop.send(());
        running.await.expect("the completer stops on shutdown");
        case.assert_paid_once("finished by a running completer")
            .await;
        assert_eq!(
            case.client_retry().await.1,
            Some(Outcome::Replayed),
            "{}",
            case.name
        );
    }
}

async fn rename(db: &DatabaseConnection, from: &str, to: &str) {
    let sql = match db.get_database_backend() {
        sea_orm::DbBackend::MySql => format!("RENAME TABLE {from} TO {to}"),
        _ => format!("ALTER TABLE {from} RENAME TO {to}"),
    };
    db.execute_unprepared(&sql).await.expect("rename a table");
}

#[tokio::test]
async fn a_call_whose_final_phase_committed_is_completed_never_given_up() {
    for case in cases("final-done").await {
        let failures = Arc::new(AtomicU32::new(4));
        let first = call!(case, pay_then_flake(&failures, cmd(&case.run)));
        assert!(matches!(first, Err(TestError::Flaky)), "{}", case.name);
        let (theirs, left) = (case.clone(), Arc::clone(&failures));
        // One attempt allowed: a call without its final phase would be given up after it.
        let completer = case
            .bare_completer()
            .backoff(Duration::ZERO, Duration::ZERO)
            .max_attempts(1)
            .resume("completer.after-final", move |call: Resumed<(Pay,)>| {
                let (case, left) = (theirs.clone(), Arc::clone(&left));
                async move { call!(case, pay_then_flake(&left, call.args.0)) }
            });
        let round = until(&completer, |r| r.finished >= 1).await;
        assert_eq!(round.gave_up, 0, "{}: {round:?}", case.name);
        assert_eq!(round.failed, 3, "{}: {round:?}", case.name);
        assert_eq!(effects(&case.db, &case.run).await, 1, "{}", case.name);
        let retry =
            with_outcome(async { call!(case, pay_then_flake(&failures, cmd(&case.run))) }).await;
        assert_eq!(retry.1, Some(Outcome::Replayed), "{}", case.name);
        assert_eq!(
            retry.0.ok(),
            Some(format!("paid {}", case.run)),
            "{}",
            case.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_attempt_does_not_hold_up_the_others() {
    for slow in cases("slow").await {
        let quick = Case {
            run: unique("quick"),
            ..slow.clone()
        };
        slow.abandoned().await;
        let gate = Gate::default();
        let (theirs, held) = (slow.clone(), gate.clone());
        let completer = slow
            .bare_completer()
            .poll_interval(Duration::from_millis(50))
            .resume(SCOPE, move |call: Resumed<(Pay,)>| {
                let case = theirs.clone();
                let after = After {
                    gate: (call.args.0.run == case.run).then(|| held.clone()),
                    fail: false,
                };
                async move { call!(case, pay(&case.gateway, &after, call.args.0)) }
            });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(completer.run(async {
            let _ = stopped.await;
        }));
        // Bounded: a completer that never resumes the slow call fails here, not hangs.
        tokio::time::timeout(Duration::from_secs(15), gate.entered())
            .await
            .unwrap_or_else(|_| panic!("{}: the slow call was never resumed", slow.name));
        // While the slow call is held inside its attempt, another call is abandoned, becomes
        // due a lease later, and is finished meanwhile.
        quick.abandoned().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while effects(&quick.db, &quick.run).await == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}: the quick call waited for the slow one",
                quick.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(effects(&slow.db, &slow.run).await, 0, "{}", slow.name);
        gate.release();
        let _ = stop.send(());
        running
            .await
            .expect("the completer stops after its attempts");
        assert_eq!(effects(&slow.db, &slow.run).await, 1, "{}", slow.name);
        assert_eq!(
            slow.gateway.calls(),
            2,
            "{}: one charge per call",
            slow.name
        );
    }
}

/// The run's ledger rows (1 while its record exists).
async fn ledger_rows(case: &Case) -> i64 {
    common::ledger_rows(&case.db, &format!("{}-k", case.run)).await
}

/// Moves the run's record past its TTL, as a day's wait would.
async fn expire_record(case: &Case) {
    let backend = case.db.get_database_backend();
    case.db
        .execute_raw(Statement::from_sql_and_values(
            backend,
            idem::sea_orm::placeholders(
                backend,
                "UPDATE idem_ledger SET expires_at_ms = 0 WHERE idem_key = ?",
            ),
            [format!("{}-k", case.run).into()],
        ))
        .await
        .expect("expire the record");
}

#[tokio::test]
async fn a_purge_during_an_abandoned_call_leaves_it_for_the_completer_to_finish_with_one_charge() {
    for case in cases("purge-completer").await {
        case.abandoned().await;
        // The lease ends; an operator's purge runs, however old the lease.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        expire_record(&case).await;
        idem::sea_orm::purge_expired(&case.db, 100)
            .await
            .expect("purge");
        assert_eq!(ledger_rows(&case).await, 1, "{}: kept", case.name);
        assert_eq!(case.calls_rows().await, 1, "{}: call kept", case.name);

        let completer = case.completer(After::default());
        let round = until(&completer, |r| r.finished >= 1).await;
        assert_eq!((round.resumed, round.failed), (1, 0), "{}", case.name);
        case.assert_paid_once("purged, then finished by the completer")
            .await;
        let (_, outcome) = case.client_retry().await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", case.name);

        // Once it ended and its TTL passed, the purge deletes it.
        expire_record(&case).await;
        let purged = idem::sea_orm::purge_expired(&case.db, 100)
            .await
            .expect("purge");
        assert_eq!(purged, 1, "{}", case.name);
        assert_eq!(ledger_rows(&case).await, 0, "{}: purged", case.name);
    }
}

#[tokio::test]
async fn a_purge_during_an_abandoned_call_leaves_its_steps_for_the_client_retry() {
    for case in cases("purge-retry").await {
        case.abandoned().await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        expire_record(&case).await;
        let mut purge = idem::sea_orm::ExpiredPurge::new();
        while purge.step(&case.db, 1).await.expect("purge").is_some() {}
        assert_eq!(purge.deleted(), 0, "{}", case.name);
        let (answer, outcome) = case.client_retry().await;
        assert!(answer.is_ok(), "{}: {answer:?}", case.name);
        assert_eq!(outcome, Some(Outcome::Executed), "{}", case.name);
        case.assert_paid_once("purged, then the client came back")
            .await;
    }
}

#[tokio::test]
async fn a_give_up_whose_hook_is_owed_is_not_purged_until_the_hook_ran() {
    for case in cases("purge-hook").await {
        let failing = After {
            gate: None,
            fail: true,
        };
        let _ = case.pay(&failing).await;
        let hook_fails = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let fails = Arc::clone(&hook_fails);
        let completer =
            case.completer(failing)
                .max_attempts(1)
                .on_give_up(move |gave_up: GaveUp| {
                    let fails = fails.load(Ordering::SeqCst);
                    async move {
                        // The refund needs the recorded charge: a purge must not have taken it.
                        let charge = gave_up
                            .step::<String>("charge")
                            .map_err(|e| e.to_string())?;
                        if fails || charge.is_none() {
                            return Err("the refund service is down".to_owned());
                        }
                        Ok(())
                    }
                });
        until(&completer, |r| r.gave_up >= 1).await;
        assert_eq!(case.calls_rows().await, 1, "{}: hook owed", case.name);
        expire_record(&case).await;
        idem::sea_orm::purge_expired(&case.db, 100)
            .await
            .expect("purge");
        assert_eq!(ledger_rows(&case).await, 1, "{}: kept", case.name);
        assert_eq!(case.calls_rows().await, 1, "{}: still owed", case.name);

        hook_fails.store(false, Ordering::SeqCst);
        case.db
            .execute_unprepared("UPDATE idem_calls SET next_attempt_at_ms = 0 WHERE gave_up = 1")
            .await
            .expect("bring the hook forward");
        until(&completer, |r| r.hooks_run >= 1).await;
        assert_eq!(case.calls_rows().await, 0, "{}: forgotten", case.name);
        let purged = idem::sea_orm::purge_expired(&case.db, 100)
            .await
            .expect("purge");
        assert_eq!(purged, 1, "{}", case.name);
        assert_eq!(ledger_rows(&case).await, 0, "{}: purged", case.name);
    }
}

#[tokio::test]
async fn a_resumable_call_past_its_deadline_is_handed_to_the_completer() {
    for case in cases("deadline").await {
        let hangs = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let stopped = call!(case, pay_or_hang(&case.gateway, &hangs, cmd(&case.run)));
        match stopped {
            Err(TestError::Idem(e)) if e.kind() == ErrorKind::DeadlineExceeded => {}
            other => panic!("{}: expected the deadline, got {other:?}", case.name),
        }
        // Its lease ended with the deadline: a completer finishes it at once.
        let theirs = case.clone();
        let completer = case
            .bare_completer()
            .backoff(Duration::ZERO, Duration::ZERO)
            .resume("completer.hangs", move |call: Resumed<(Pay,)>| {
                let case = theirs.clone();
                async move {
                    let hangs = std::sync::atomic::AtomicBool::new(false);
                    call!(case, pay_or_hang(&case.gateway, &hangs, call.args.0))
                }
            });
        let round = completer.run_once().await.expect("round");
        assert_eq!((round.resumed, round.finished), (1, 1), "{}", case.name);
        case.assert_paid_once("finished by the completer after the deadline")
            .await;
    }
}
