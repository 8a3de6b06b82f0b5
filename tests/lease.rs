//! Lease mode on every backend of the run, through both stores (SeaORM's and sqlx's, the
//! handlers written once for each connection type: `handlers!`), and on the in-memory store: the claim commits first,
//! steps are recovery points a takeover replays, a stale holder's writes are rejected by the
//! fencing token, duplicates during a live lease get `InFlight` with Retry-After, and lease
//! expiry is read from the database's clock. Every test counts effect rows and gateway calls.

mod common;

use common::stores::{Conn, call};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::crash::{CHILD_CALL_FAILED, ChildEnd, kill_self};
use common::{Gate, backends, effects, insert_effect, unique};
use idem::{ErrorKind, Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde::Serialize;

/// A payment gateway that deduplicates on the idempotency key, as Stripe does, and counts
/// every call it gets.
#[derive(Clone, Default)]
struct Gateway {
    calls: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    async fn charge(&self, key: String, amount: i64) -> Result<String, TestError> {
        self.calls.lock().expect("lock").push(key.clone());
        Ok(format!("ch_{}_{amount}", &key[5..13]))
    }

    fn calls(&self) -> usize {
        self.calls.lock().expect("lock").len()
    }

    fn distinct_keys(&self) -> usize {
        let calls = self.calls.lock().expect("lock");
        calls.iter().collect::<std::collections::HashSet<_>>().len()
    }
}

/// What a call does after its charge step.
#[derive(Clone, Default)]
struct Pause {
    /// Hold there until the test releases it.
    gate: Option<Gate>,
    /// Fail (transiently) there: the gateway timed out on the way back, say.
    fail_after_charge: bool,
    /// Record a second step there (`confirm`), before the final step.
    confirm_after_charge: bool,
    /// How many times the final phase's writes ran (`charge_and_finish`).
    phase_runs: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Debug, Clone, Serialize)]
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

impl TestError {
    fn kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Idem(e) => Some(e.kind()),
            Self::Flaky => None,
        }
    }
}

/// The handlers, once per kind of connection, so every case runs on both stores: `$conn` is
/// what they take (SeaORM's connection or a sqlx pool), `final_step` and `finish` the store's
/// final phase, `insert` writes a payment row in the phase's transaction `$tx`, and `count`
/// counts a run's payment rows through the connection `$db`.
macro_rules! handlers {
    (
        $module:ident,
        $conn:ty,
        final_step = $final_step:path,
        finish = $finish:path,
        insert = |$tx:ident, $run:ident, $amount:ident| $insert:expr,
        count = |$db:ident, $counted:ident| $count:expr $(,)?
    ) => {
        mod $module {
            use super::*;

            /// Charges `amount` at the gateway (a recovery point), then holds at the pause's
            /// gate if it has one.
            async fn charge_then_pause(
                gateway: &Gateway,
                pause: &Pause,
                amount: i64,
            ) -> Result<String, TestError> {
                let charge: String =
                    idem::step("charge", |key| gateway.charge(key, amount)).await?;
                if let Some(gate) = &pause.gate {
                    gate.pass().await;
                }
                Ok(charge)
            }

            /// The handler body: charge at the gateway (a recovery point), maybe pause or
            /// fail, then the final phase writes the payment row with the step record.
            async fn charge_and_record(
                db: &$conn,
                gateway: &Gateway,
                pause: &Pause,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge = charge_then_pause(gateway, pause, cmd.amount).await?;
                if pause.fail_after_charge {
                    return Err(TestError::Flaky);
                }
                if pause.confirm_after_charge {
                    let _: String =
                        idem::step("confirm", async |_| Ok::<_, TestError>("confirmed".to_owned()))
                            .await?;
                }
                record_payment(db, &cmd, charge).await
            }

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

            #[idempotent(scope = "lease.pay", key = cmd.key, lease = "2s", skip(gateway, pause))]
            pub(crate) async fn pay(
                db: &$conn,
                gateway: &Gateway,
                pause: &Pause,
                cmd: Pay,
            ) -> Result<String, TestError> {
                charge_and_record(db, gateway, pause, cmd).await
            }

            /// The same, but a duplicate polls for the holder's result (up to 5 s) instead
            /// of 409.
            #[idempotent(
                scope = "lease.pay-waiting",
                key = cmd.key,
                lease = "2s",
                on_concurrent = wait("5s"),
                skip(gateway, pause)
            )]
            pub(crate) async fn pay_waiting(
                db: &$conn,
                gateway: &Gateway,
                pause: &Pause,
                cmd: Pay,
            ) -> Result<String, TestError> {
                charge_and_record(db, gateway, pause, cmd).await
            }

            /// Database work after `finish` (which keeps its transaction open for the
            /// result).
            #[idempotent(scope = "lease.after-final", key = cmd.key, lease = "2s")]
            pub(crate) async fn pay_then_read(db: &$conn, cmd: Pay) -> Result<i64, TestError> {
                let run = cmd.run.clone();
                $finish(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        let ($run, $amount) = (&run, 1_i64);
                        $insert;
                        Ok::<_, TestError>(())
                    })
                })
                .await?;
                // On a pool of one connection this read needs the connection the open phase
                // holds: the phase commits alone after its fuse (elsewhere the read may not
                // see it yet).
                let ($db, $counted) = (db, &cmd.run);
                Ok($count)
            }

            /// `finish`, then more work that holds at the pause's gate (the test drops the
            /// call there): the phase commits alone after its fuse, with its step.
            #[idempotent(scope = "lease.finish-then-hold", key = cmd.key, lease = "2s", skip(pause))]
            pub(crate) async fn finish_then_hold(
                db: &$conn,
                pause: &Pause,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let run = cmd.run.clone();
                let paid = $finish(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        let ($run, $amount) = (&run, 1_i64);
                        $insert;
                        Ok::<_, TestError>(format!("paid {run}"))
                    })
                })
                .await?;
                if let Some(gate) = &pause.gate {
                    gate.pass().await;
                }
                Ok(paid)
            }

            /// The same with `finish` as its last work: the result is recorded in the
            /// phase's transaction.
            #[idempotent(scope = "lease.finish", key = cmd.key, lease = "2s")]
            pub(crate) async fn pay_and_finish(db: &$conn, cmd: Pay) -> Result<String, TestError> {
                let run = cmd.run.clone();
                $finish(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        let ($run, $amount) = (&run, 1_i64);
                        $insert;
                        Ok::<_, TestError>(format!("paid {run}"))
                    })
                })
                .await
            }

            /// Charges (a recovery point), maybe holds at the pause's gate, then `finish`
            /// writes the payment row and the result is recorded in its transaction.
            #[idempotent(scope = "lease.charge-finish", key = cmd.key, lease = "2s", skip(gateway, pause))]
            pub(crate) async fn charge_and_finish(
                db: &$conn,
                gateway: &Gateway,
                pause: &Pause,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge = charge_then_pause(gateway, pause, cmd.amount).await?;
                let run = cmd.run.clone();
                let phase_runs = Arc::clone(&pause.phase_runs);
                $finish(db, "record-payment", move |$tx| {
                    Box::pin(async move {
                        phase_runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let ($run, $amount) = (&run, cmd.amount);
                        $insert;
                        Ok::<_, TestError>(charge)
                    })
                })
                .await
            }

            /// No final phase: the call's completion alone records it, in a transaction that
            /// forgets the steps when `with_step` recorded one, else as the fenced update
            /// alone. Holds at `gate` if given; answers how many runs came before it.
            #[idempotent(
                scope = "lease.no-final-phase",
                key = cmd.key,
                lease = "2s",
                skip(runs, gate, with_step)
            )]
            pub(crate) async fn pay_without_final_phase(
                db: &$conn,
                runs: &std::sync::atomic::AtomicUsize,
                gate: Option<&Gate>,
                with_step: bool,
                cmd: Pay,
            ) -> Result<usize, TestError> {
                let _ = db;
                let before = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if with_step {
                    idem::step("note", |_| async { Ok::<_, TestError>(()) }).await?;
                }
                if let Some(gate) = gate {
                    gate.pass().await;
                }
                Ok(before)
            }

            /// Charges, then panics while `panics` is set; a lease long enough that only a
            /// release frees the key within the test.
            #[idempotent(scope = "lease.panics", key = cmd.key, lease = "10s", skip(gateway, panics))]
            pub(crate) async fn pay_or_panic(
                db: &$conn,
                gateway: &Gateway,
                panics: &std::sync::atomic::AtomicBool,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge: String =
                    idem::step("charge", |key| gateway.charge(key, cmd.amount)).await?;
                assert!(
                    !panics.swap(false, std::sync::atomic::Ordering::SeqCst),
                    "the body panicked after its charge"
                );
                record_payment(db, &cmd, charge).await
            }

            /// Charges, then awaits a call that never returns while `hangs` is set (a
            /// gateway call without a timeout); its deadline stops it.
            #[idempotent(
                scope = "lease.hangs",
                key = cmd.key,
                lease = "1s",
                deadline = "2s",
                skip(gateway, hangs)
            )]
            pub(crate) async fn pay_or_hang(
                db: &$conn,
                gateway: &Gateway,
                hangs: &std::sync::atomic::AtomicBool,
                cmd: Pay,
            ) -> Result<String, TestError> {
                let charge: String =
                    idem::step("charge", |key| gateway.charge(key, cmd.amount)).await?;
                let hang = hangs.load(std::sync::atomic::Ordering::SeqCst);
                idem::step("notify", |_| async move {
                    if hang {
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, TestError>(())
                })
                .await?;
                record_payment(db, &cmd, charge).await
            }
        }
    };
}

handlers!(
    on_sea_orm,
    DatabaseConnection,
    final_step = idem::sea_orm::final_step,
    finish = idem::sea_orm::finish,
    insert = |tx, run, amount| insert_effect(tx, run, "payment", amount).await,
    count = |db, run| effects(db, run).await,
);

/// The sqlx handlers' statements, in `$p`'s placeholders.
macro_rules! sqlx_handlers {
    ($module:ident, $pool:ty, $p1:literal, $p2:literal, $p3:literal) => {
        handlers!(
            $module,
            $pool,
            final_step = idem::sqlx::final_step,
            finish = idem::sqlx::finish,
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
            count = |db, run| sqlx::query_scalar::<_, i64>(concat!(
                "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = ",
                $p1
            ))
            .bind(run)
            .fetch_one(db)
            .await
            .expect("count effects"),
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
    finish = idem::tokio_postgres::finish,
    insert = |tx, run, amount| tx
        .execute(
            "INSERT INTO idem_test_effects (run_id, label, amount) VALUES ($1, $2, $3)",
            &[run, &"payment", &amount],
        )
        .await
        .expect("insert effect"),
    count = |db, run| db
        .get()
        .await
        .expect("a connection")
        .query_one(
            "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = $1",
            &[run]
        )
        .await
        .expect("count effects")
        .get::<_, i64>(0),
);

fn cmd(run: &str) -> Pay {
    Pay {
        key: format!("{run}-k"),
        run: run.to_owned(),
        amount: 1200,
    }
}

/// A call's task.
type Call = tokio::task::JoinHandle<Result<String, TestError>>;
/// A call's task that tells its outcome.
type Spawned = tokio::task::JoinHandle<(Result<String, TestError>, Option<Outcome>)>;

/// One test on one backend and one store: its gateway and its run (one order, paid under
/// key `<run>-k`). `db` is the backend's SeaORM connection, which the test reads through
/// whichever store the calls use.
#[derive(Clone)]
struct Case {
    name: &'static str,
    db: DatabaseConnection,
    conn: Conn,
    gateway: Gateway,
    run: String,
}

/// A case of run `run` per backend of the run and per store: SeaORM's and sqlx's.
async fn cases(run: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    for backend in backends().await {
        if backend.name == "postgres" {
            cases.push(Case {
                name: "postgres (tokio-postgres)",
                db: backend.db.clone(),
                conn: Conn::tokio_postgres(&backend.url),
                gateway: Gateway::default(),
                run: unique(run),
            });
        }
        let conn = Conn::sqlx(backend.name, &backend.url).await;
        let name = conn.name(backend.name);
        cases.push(Case {
            name,
            db: backend.db.clone(),
            conn,
            gateway: Gateway::default(),
            run: unique(run),
        });
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

/// Calls the operator function `$function` of the case's store on its connection.
macro_rules! operate {
    ($case:expr, $function:ident($($arg:expr),* $(,)?)) => {
        match &$case.conn {
            Conn::SeaOrm => idem::sea_orm::$function(&$case.db, $($arg),*).await,
            Conn::SqlxSqlite(pool) => idem::sqlx::$function(pool, $($arg),*).await,
            Conn::SqlxPostgres(pool) => idem::sqlx::$function(pool, $($arg),*).await,
            Conn::SqlxMySql(pool) => idem::sqlx::$function(pool, $($arg),*).await,
            Conn::TokioPostgres(pool) => idem::tokio_postgres::$function(pool, $($arg),*).await,
        }
    };
}

impl Case {
    fn key(&self) -> String {
        format!("{}-k", self.run)
    }

    /// The unfinished leases, as the case's store lists them to an operator.
    async fn expired_leases(&self) -> Vec<idem::sea_orm::ExpiredLease> {
        operate!(self, expired_leases(1000)).expect("list expired leases")
    }

    /// The live leases held longer than `held_for`, as the case's store lists them.
    async fn stuck_leases(&self, held_for: Duration) -> Vec<idem::sea_orm::StuckLease> {
        operate!(self, stuck_leases(held_for, 1000)).expect("list stuck leases")
    }

    /// Releases the lease of record `id` by hand, through the case's store.
    async fn release_lease(&self, id: &[u8]) -> bool {
        operate!(self, release_lease(id)).expect("release")
    }

    /// Pays the run's order through `pay`, straight through.
    async fn pay(&self) -> Result<String, TestError> {
        call!(self, pay(&self.gateway, &Pause::default(), cmd(&self.run)))
    }

    /// Pays the run's order through `pay_waiting`, straight through.
    async fn pay_waiting(&self) -> Result<String, TestError> {
        call!(
            self,
            pay_waiting(&self.gateway, &Pause::default(), cmd(&self.run))
        )
    }

    /// Starts a call of the run (through `pay_waiting` if `waiting`, else `pay`) that holds at
    /// a gate after its charge; returns its task once it holds there, and the gate.
    async fn paused(&self, waiting: bool) -> (Call, Gate) {
        let gate = Gate::default();
        let pause = Pause {
            gate: Some(gate.clone()),
            ..Pause::default()
        };
        let t = self.clone();
        let task = tokio::spawn(async move {
            if waiting {
                call!(t, pay_waiting(&t.gateway, &pause, cmd(&t.run)))
            } else {
                call!(t, pay(&t.gateway, &pause, cmd(&t.run)))
            }
        });
        gate.entered().await;
        (task, gate)
    }

    /// `n` calls of the run (through `pay_waiting` if `waiting`, else `pay`), each on a task
    /// of its own: their answers and outcomes.
    fn duplicates(&self, n: usize, waiting: bool) -> Vec<Spawned> {
        let spawn = |_| {
            let t = self.clone();
            tokio::spawn(async move {
                match waiting {
                    true => with_outcome(t.pay_waiting()).await,
                    false => with_outcome(t.pay()).await,
                }
            })
        };
        (0..n).map(spawn).collect()
    }

    /// A call that charged, recorded its step, and was dropped: its lease is left behind.
    async fn abandoned(&self) {
        let (held, _gate) = self.paused(false).await;
        held.abort();
        let _ = held.await;
    }

    /// Asserts the run has one payment row and the gateway one charge; `what` says why.
    async fn assert_paid_once(&self, what: &str) {
        let payments = effects(&self.db, &self.run).await;
        assert_eq!(payments, 1, "{}: one payment row ({what})", self.name);
        assert_eq!(
            self.gateway.calls(),
            1,
            "{}: one charge ({what})",
            self.name
        );
    }
}

async fn scalar(db: &DatabaseConnection, sql: &str, value: &str) -> i64 {
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

/// Ends the lease of `key` now, as if its holder had been paused past it (database clock).
async fn expire_lease(db: &DatabaseConnection, key: &str) {
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        idem::sea_orm::placeholders(
            backend,
            "UPDATE idem_ledger SET expires_at_ms = expires_at_ms - 3600000 WHERE idem_key = ? AND state = 0",
        ),
        [key.into()],
    ))
    .await
    .expect("expire the lease");
}

#[tokio::test]
async fn a_lease_call_records_its_steps_result_and_replays() {
    for t in cases("lease-basic").await {
        let name = t.name;
        let (first, outcome) = with_outcome(t.pay()).await;
        let first = first.expect("first");
        assert_eq!(outcome, Some(Outcome::Executed), "{name}");
        let (again, outcome) = with_outcome(t.pay()).await;
        assert_eq!(again.expect("replay"), first, "{name}");
        assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        t.assert_paid_once("the body ran once").await;
        let completed = "SELECT COUNT(*) FROM idem_ledger WHERE idem_key = ? AND state = 1";
        let completed = scalar(&t.db, completed, &t.key()).await;
        assert_eq!(completed, 1, "{name}: completed record");
        let steps = "SELECT COUNT(*) FROM idem_steps WHERE record_id IN (SELECT id FROM idem_ledger WHERE idem_key = ?)";
        let steps = scalar(&t.db, steps, &t.key()).await;
        assert_eq!(
            steps, 0,
            "{name}: steps are forgotten once the result is recorded"
        );
        let mut other = cmd(&t.run);
        other.amount = 9900;
        let reused = call!(t, pay(&t.gateway, &Pause::default(), other));
        let reused = reused.unwrap_err().kind();
        assert_eq!(reused, Some(ErrorKind::KeyReused), "{name}");
    }
}

#[tokio::test]
async fn a_stale_holder_is_fenced_off_and_the_takeover_resumes_after_its_steps() {
    for t in cases("lease-stale").await {
        let name = t.name;
        let (stale, gate) = t.paused(false).await; // charged, step recorded, now paused
        expire_lease(&t.db, &t.key()).await; // ... past its lease

        let taken_over = t.pay().await.expect("the retry takes over and completes");
        gate.release();
        let stale = stale.await.expect("task");
        assert_eq!(
            stale.as_ref().map_err(TestError::kind).unwrap_err(),
            Some(ErrorKind::LeaseLost),
            "{name}: the stale completion is rejected, got {stale:?}"
        );
        t.assert_paid_once("the charge step was replayed, not run again")
            .await;
        let replay = t.pay().await.expect("replay");
        assert_eq!(replay, taken_over, "{name}: the takeover's answer stands");
    }
}

/// A holder whose lease was taken over cannot record a step while the new holder runs: its
/// step is refused with `LeaseLost` and leaves no row (the fence and the insert are one
/// statement on PostgreSQL and SQLite, a transaction on MySQL).
#[tokio::test]
async fn a_stale_holders_step_is_refused_and_records_nothing() {
    for t in cases("lease-stale-step").await {
        let name = t.name;
        let paused = |confirm_after_charge: bool| {
            let gate = Gate::default();
            let pause = Pause {
                gate: Some(gate.clone()),
                confirm_after_charge,
                ..Pause::default()
            };
            let t = t.clone();
            let call = tokio::spawn(async move { call!(t, pay(&t.gateway, &pause, cmd(&t.run))) });
            (call, gate)
        };
        let (stale, stale_gate) = paused(true);
        stale_gate.entered().await; // charged, its step recorded, now paused
        expire_lease(&t.db, &t.key()).await;
        let (holder, holder_gate) = paused(false);
        holder_gate.entered().await; // took the lease over, replayed the charge, paused
        stale_gate.release();
        let stale = stale.await.expect("task");
        assert_eq!(
            stale.as_ref().map_err(TestError::kind).unwrap_err(),
            Some(ErrorKind::LeaseLost),
            "{name}: the stale step is refused, got {stale:?}"
        );
        let confirms = "SELECT COUNT(*) FROM idem_steps WHERE name = 'confirm' AND record_id IN (SELECT id FROM idem_ledger WHERE idem_key = ?)";
        let confirms = scalar(&t.db, confirms, &t.key()).await;
        assert_eq!(confirms, 0, "{name}: no step of the stale holder's");
        holder_gate.release();
        let taken_over = holder
            .await
            .expect("task")
            .expect("the new holder completes");
        let replay = t.pay().await.expect("replay");
        assert_eq!(replay, taken_over, "{name}: the new holder's answer stands");
        t.assert_paid_once("charged once").await;
    }
}

/// `finish` followed by more work: its phase commits alone after the fuse, with its step, so a
/// call that dies afterwards is taken over without running the phase's writes again.
#[tokio::test]
async fn a_phase_committed_alone_keeps_its_step_for_the_takeover() {
    for t in cases("lease-finish-alone").await {
        let name = t.name;
        let gate = Gate::default();
        let pause = Pause {
            gate: Some(gate.clone()),
            ..Pause::default()
        };
        let held = {
            let t = t.clone();
            tokio::spawn(async move { call!(t, finish_then_hold(&pause, cmd(&t.run))) })
        };
        gate.entered().await;
        // The fuse commits the phase alone: its payment row becomes visible.
        let mut waited = 0;
        while effects(&t.db, &t.run).await == 0 {
            waited += 1;
            assert!(waited < 500, "{name}: the phase commits alone");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held.abort(); // the call dies holding its lease
        let _ = held.await;
        expire_lease(&t.db, &t.key()).await;
        let taken_over = call!(t, finish_then_hold(&Pause::default(), cmd(&t.run)));
        let taken_over = taken_over.expect("the takeover completes");
        assert_eq!(taken_over, format!("paid {}", t.run), "{name}");
        let payments = effects(&t.db, &t.run).await;
        assert_eq!(payments, 1, "{name}: the phase's writes ran once");
    }
}

#[tokio::test]
async fn a_dropped_holder_leaves_a_lease_a_retry_takes_over_once_it_ends() {
    for t in cases("lease-drop").await {
        let name = t.name;
        t.abandoned().await;
        // During the lease a retry is told to come back, with the lease's remaining time.
        match t.pay().await {
            Err(TestError::Idem(idem::Error::InFlight { retry_after, .. })) => {
                assert!(
                    retry_after <= Duration::from_secs(2),
                    "{name}: {retry_after:?}"
                )
            }
            other => panic!("{name}: expected InFlight, got {other:?}"),
        }
        // After the lease (2 s, database clock), the retry takes over and completes.
        tokio::time::sleep(Duration::from_millis(2100)).await;
        // The operator sees the ended lease, not yet taken over.
        let listed = t.expired_leases().await;
        let ours = listed.iter().find(|l| l.key == t.key());
        let ours = ours.unwrap_or_else(|| panic!("{name}: the ended lease is listed"));
        assert!(
            ours.ended_ms_ago >= 0 && !ours.resumable,
            "{name}: {ours:?}"
        );
        t.pay().await.expect("takeover");
        t.assert_paid_once("charged once across the two holders")
            .await;
        let left = t.expired_leases().await.iter().any(|l| l.key == t.key());
        assert!(!left, "{name}: no unfinished lease left");
    }
}

#[tokio::test]
async fn duplicates_during_a_live_lease_get_in_flight_and_one_execution() {
    for t in cases("lease-dup").await {
        let name = t.name;
        let (first, gate) = t.paused(false).await;
        let mut in_flight = 0;
        for d in t.duplicates(8, false) {
            match d.await.expect("task").0 {
                Err(TestError::Idem(idem::Error::InFlight { retry_after, .. })) => {
                    assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(2));
                    in_flight += 1;
                }
                other => panic!("{name}: expected InFlight, got {other:?}"),
            }
        }
        gate.release();
        first.await.expect("task").expect("the holder completes");
        assert_eq!(in_flight, 8, "{name}");
        t.assert_paid_once("one execution").await;
    }
}

#[tokio::test]
async fn a_transient_error_hands_the_key_on_at_once_with_its_steps() {
    for t in cases("lease-flaky").await {
        let name = t.name;
        let failing = Pause {
            fail_after_charge: true,
            ..Pause::default()
        };
        let failed = call!(t, pay(&t.gateway, &failing, cmd(&t.run)));
        assert!(matches!(failed, Err(TestError::Flaky)), "{name}");
        assert_eq!(effects(&t.db, &t.run).await, 0, "{name}");
        // No waiting for the lease: the retry resumes after the recorded charge.
        t.pay().await.expect("retry");
        t.assert_paid_once("the charge was not repeated").await;
        assert_eq!(t.gateway.distinct_keys(), 1, "{name}");
    }
}

#[tokio::test]
async fn lease_expiry_is_read_on_the_database_clock() {
    for t in cases("lease-clock").await {
        let name = t.name;
        t.abandoned().await;
        // The lease end stored in the ledger is the database's now + 2 s ...
        let now = idem::sea_orm::database_now_ms(&t.db).await.expect("clock");
        let end = "SELECT expires_at_ms FROM idem_ledger WHERE idem_key = ?";
        let end = scalar(&t.db, end, &t.key()).await;
        assert!(
            (end - now) > 0 && (end - now) <= 2_000,
            "{name}: lease end {end} vs database now {now}"
        );
        // ... and moving it back on that clock (not waiting on ours) lets a retry take over.
        expire_lease(&t.db, &t.key()).await;
        t.pay()
            .await
            .expect("takeover decided by the stored lease end");
        assert_eq!(effects(&t.db, &t.run).await, 1, "{name}");
    }
}

/// The in-memory store runs lease mode too (steps and fencing; no database writes).
#[idempotent(scope = "lease.memory", key = key, lease = "1s", skip(gateway))]
async fn greet(
    store: &idem::MemoryStore,
    gateway: &Gateway,
    key: String,
) -> Result<String, TestError> {
    idem::step("send", |k| gateway.charge(k, 1)).await
}

#[tokio::test]
async fn the_in_memory_store_holds_leases_too() {
    let store = idem::MemoryStore::new();
    let gateway = Gateway::default();
    let first = greet(&store, &gateway, "m-1".into()).await.expect("first");
    let again = greet(&store, &gateway, "m-1".into()).await.expect("replay");
    assert_eq!(first, again);
    assert_eq!(gateway.calls(), 1);
}

#[tokio::test]
async fn ten_concurrent_calls_with_a_bounded_wait_run_the_body_once() {
    for t in cases("lease-ten").await {
        let name = t.name;
        let answers = futures_util::future::join_all(t.duplicates(10, true)).await;
        let answers: Vec<_> = answers.into_iter().map(|a| a.expect("task")).collect();
        let first = answers[0].0.as_ref().expect("answered").clone();
        for (answer, _) in &answers {
            assert_eq!(answer.as_ref().ok(), Some(&first), "{name}: {answers:?}");
        }
        let executed = answers
            .iter()
            .filter(|(_, outcome)| *outcome == Some(Outcome::Executed))
            .count();
        assert_eq!(executed, 1, "{name}: one execution, the others replayed");
        t.assert_paid_once("ten concurrent calls").await;
    }
}

#[tokio::test]
async fn a_stale_holder_cannot_complete_with_or_without_steps() {
    for with_step in [true, false] {
        for t in cases("lease-stale-completion").await {
            let name = format!("{} (with a step: {with_step})", t.name);
            let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let gate = Gate::default();
            let stale = {
                let (c, runs, gate) = (t.clone(), Arc::clone(&runs), gate.clone());
                tokio::spawn(async move {
                    call!(
                        c,
                        pay_without_final_phase(&runs, Some(&gate), with_step, cmd(&c.run))
                    )
                })
            };
            gate.entered().await;
            expire_lease(&t.db, &t.key()).await; // paused past its lease
            let taken_over = call!(
                t,
                pay_without_final_phase(&runs, None, with_step, cmd(&t.run))
            );
            assert_eq!(
                taken_over.ok(),
                Some(1),
                "{name}: the retry takes over and completes"
            );
            gate.release();
            let stale = stale.await.expect("task");
            assert_eq!(
                stale.err().and_then(|e| e.kind()),
                Some(ErrorKind::LeaseLost),
                "{name}: the stale holder's completion is refused"
            );
            let replay = call!(
                t,
                pay_without_final_phase(&runs, None, with_step, cmd(&t.run))
            );
            assert_eq!(replay.ok(), Some(1), "{name}: the takeover's answer stands");
        }
    }
}

/// A holder that lost its lease cannot complete while the new holder runs, and its refused
/// completion deletes none of the steps the new holder resumed after (on PostgreSQL the
/// completion and the deletes of the call's steps are one statement, the deletes fed by the
/// fenced update); the new holder's completion then forgets them.
#[tokio::test]
async fn a_stale_holders_completion_leaves_the_new_holders_steps() {
    for t in cases("lease-stale-keeps-steps").await {
        let name = t.name;
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let holder = |gate: &Gate| {
            let (c, runs, gate) = (t.clone(), Arc::clone(&runs), gate.clone());
            tokio::spawn(async move {
                call!(
                    c,
                    pay_without_final_phase(&runs, Some(&gate), true, cmd(&c.run))
                )
            })
        };
        let (stale_gate, new_gate) = (Gate::default(), Gate::default());
        let stale = holder(&stale_gate);
        stale_gate.entered().await; // its step recorded
        expire_lease(&t.db, &t.key()).await; // paused past its lease
        let taken_over = holder(&new_gate);
        new_gate.entered().await; // took over after the step, holds
        stale_gate.release();
        let stale = stale.await.expect("task");
        assert_eq!(
            stale.err().and_then(|e| e.kind()),
            Some(ErrorKind::LeaseLost),
            "{name}: the stale holder's completion is refused"
        );
        assert_eq!(
            steps_of(&t.db, &t.key()).await,
            1,
            "{name}: the new holder's step survives the refused completion"
        );
        new_gate.release();
        let taken_over = taken_over.await.expect("task");
        assert_eq!(taken_over.ok(), Some(1), "{name}: the new holder completes");
        assert_eq!(
            steps_of(&t.db, &t.key()).await,
            0,
            "{name}: the completion forgets the call's steps"
        );
    }
}

/// The recorded steps of the record of `key`.
async fn steps_of(db: &DatabaseConnection, key: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(*) FROM idem_steps s JOIN idem_ledger l ON l.id = s.record_id \
        WHERE l.idem_key = ?",
        key,
    )
    .await
}

/// A holder paused past its lease before `finish`: its phase is refused before its writes
/// run (they would meet the takeover's payment) and it gets `LeaseLost`; the takeover, which
/// replayed the charge, paid once.
#[tokio::test]
async fn a_stale_holders_finish_rolls_back_its_writes() {
    for t in cases("lease-stale-finish").await {
        let name = t.name;
        let gate = Gate::default();
        let stale_pause = Pause {
            gate: Some(gate.clone()),
            ..Pause::default()
        };
        let stale = {
            let (c, pause) = (t.clone(), stale_pause.clone());
            tokio::spawn(
                async move { call!(c, charge_and_finish(&c.gateway, &pause, cmd(&c.run))) },
            )
        };
        gate.entered().await; // charged, step recorded
        expire_lease(&t.db, &t.key()).await; // paused past its lease
        let taken_over = call!(
            t,
            charge_and_finish(&t.gateway, &Pause::default(), cmd(&t.run))
        )
        .expect("the retry takes over and finishes");
        gate.release();
        let stale = stale.await.expect("task");
        assert_eq!(
            stale.as_ref().map_err(TestError::kind).unwrap_err(),
            Some(ErrorKind::LeaseLost),
            "{name}: the stale finish is refused, got {stale:?}"
        );
        assert_eq!(
            stale_pause
                .phase_runs
                .load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{name}: the stale holder's writes never ran"
        );
        t.assert_paid_once("the stale finish's row rolled back")
            .await;
        let replay = call!(
            t,
            charge_and_finish(&t.gateway, &Pause::default(), cmd(&t.run))
        )
        .expect("replay");
        assert_eq!(replay, taken_over, "{name}: the takeover's answer stands");
    }
}

#[tokio::test]
async fn with_a_bounded_wait_duplicates_get_the_holders_answer() {
    for t in cases("lease-wait").await {
        let name = t.name;
        let (first, gate) = t.paused(true).await;
        let duplicates = t.duplicates(4, true);
        tokio::time::sleep(Duration::from_millis(300)).await;
        gate.release();
        let answer = first.await.expect("task").expect("holder");
        for d in duplicates {
            let (result, outcome) = d.await.expect("task");
            assert_eq!(result.expect("waited"), answer, "{name}");
            assert_eq!(outcome, Some(Outcome::Replayed), "{name}");
        }
        t.assert_paid_once("one execution").await;
    }
}

#[tokio::test]
async fn a_long_body_keeps_its_lease_by_renewing_it() {
    for t in cases("lease-renew").await {
        let name = t.name;
        let (holder, gate) = t.paused(false).await;
        // Past the 2 s lease the holder is still busy; its renewals keep duplicates out.
        tokio::time::sleep(Duration::from_millis(2600)).await;
        let duplicate = t.pay().await;
        assert_eq!(
            duplicate.as_ref().map_err(TestError::kind).unwrap_err(),
            Some(ErrorKind::InFlight),
            "{name}: {duplicate:?}"
        );
        gate.release();
        holder.await.expect("task").expect("the holder completes");
        t.assert_paid_once("one execution").await;
    }
}

#[tokio::test]
async fn finish_records_the_result_with_the_final_phase_and_work_after_it_does_not_hang() {
    for t in cases("finish").await {
        let paid = call!(t, pay_and_finish(cmd(&t.run)));
        assert_eq!(paid.ok(), Some(format!("paid {}", t.run)), "{}", t.name);
        let (again, outcome) = with_outcome(async { call!(t, pay_and_finish(cmd(&t.run))) }).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", t.name);
        assert_eq!(again.ok(), Some(format!("paid {}", t.run)), "{}", t.name);
        assert_eq!(effects(&t.db, &t.run).await, 1, "{}", t.name);
        assert_eq!(scalar(&t.db, "SELECT COUNT(*) FROM idem_steps s JOIN idem_ledger l ON l.id = s.record_id WHERE l.idem_key = ?", &format!("{}-k", t.run)).await, 0, "{}: steps forgotten", t.name);

        let t = Case {
            run: unique("after-finish"),
            ..t.clone()
        };
        let started = std::time::Instant::now();
        let seen = call!(t, pay_then_read(cmd(&t.run)));
        assert!(matches!(seen, Ok(0 | 1)), "{}: {seen:?}", t.name);
        assert!(started.elapsed() < Duration::from_secs(2), "{}", t.name);
        let (_, outcome) = with_outcome(async { call!(t, pay_then_read(cmd(&t.run))) }).await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", t.name);
        assert_eq!(effects(&t.db, &t.run).await, 1, "{}", t.name);
    }
}

/// Makes PostgreSQL abort the commit of the next `n` transactions that wrote a payment row of
/// a run named `forced-conflict-…` with a serialization failure (SQLSTATE 40001), as a Galera
/// node aborts a commit that failed certification: a deferred constraint trigger, counted by
/// a sequence (which an aborted transaction does not roll back).
async fn abort_the_next_commits(db: &DatabaseConnection, n: i64) {
    let statements = [
        "CREATE SEQUENCE IF NOT EXISTS idem_test_forced_conflicts",
        "CREATE TABLE IF NOT EXISTS idem_test_forced_conflicts_left (n BIGINT NOT NULL)",
        "CREATE OR REPLACE FUNCTION idem_test_force_conflict() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             -- Nested, so that only this test's rows count (SQL does not order an AND).
             IF NEW.run_id LIKE 'forced-conflict-%' THEN
                 IF nextval('idem_test_forced_conflicts') <= (SELECT max(n) FROM idem_test_forced_conflicts_left) THEN
                     RAISE EXCEPTION 'forced certification failure' USING ERRCODE = '40001';
                 END IF;
             END IF;
             RETURN NULL;
         END $$",
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'idem_test_force_conflict') THEN
                 CREATE CONSTRAINT TRIGGER idem_test_force_conflict AFTER INSERT ON idem_test_effects
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION idem_test_force_conflict();
             END IF;
         END $$",
    ];
    for sql in statements {
        common::until_created("the forced conflict's trigger", || async {
            db.execute_unprepared(sql).await.is_ok()
        })
        .await;
    }
    db.execute_unprepared("DELETE FROM idem_test_forced_conflicts_left")
        .await
        .expect("reset the count");
    db.execute_unprepared(&format!(
        "INSERT INTO idem_test_forced_conflicts_left VALUES ({n})"
    ))
    .await
    .expect("set the count");
    db.execute_unprepared("SELECT setval('idem_test_forced_conflicts', 1, false)")
        .await
        .expect("restart the count");
}

/// The database aborts the commit of a final phase kept open by `finish` for a conflict, which
/// rolls the phase's writes back with the result (RELIABILITY.md finding 8, seen on Galera):
/// the engine runs the body again under the lease it still holds, twice here. The charge step
/// it recorded replays (one gateway call), the phase runs again (three runs, one payment row),
/// and the caller gets the answer, not a 503. PostgreSQL only (a deferred trigger aborts the
/// commit there).
#[tokio::test]
async fn a_conflict_at_the_commit_of_finish_runs_the_body_again_and_pays_once() {
    for t in cases("forced-conflict").await {
        if t.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            continue;
        }
        abort_the_next_commits(&t.db, 2).await;
        let pause = Pause::default();
        let (paid, report) = idem::conflict::with_report(async {
            call!(t, charge_and_finish(&t.gateway, &pause, cmd(&t.run)))
        })
        .await;
        let phase_runs = pause.phase_runs.load(std::sync::atomic::Ordering::SeqCst);
        assert!(paid.is_ok(), "{}: {paid:?}", t.name);
        assert_eq!(phase_runs, 3, "{}: the phase ran on each try", t.name);
        assert_eq!(report.conflict_retries, 2, "{}", t.name);
        t.assert_paid_once("after two aborted commits").await;
        let (again, outcome) =
            with_outcome(async { call!(t, charge_and_finish(&t.gateway, &pause, cmd(&t.run))) })
                .await;
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", t.name);
        assert_eq!(again.ok(), paid.ok(), "{}", t.name);
    }
}

#[tokio::test]
async fn an_abandoned_lease_is_listed_and_kept_with_its_steps_by_the_purge() {
    // A database of its own: the purge looks at every expired record in it.
    let t = Case {
        name: "sqlite",
        db: common::sqlite().await,
        conn: Conn::SeaOrm,
        gateway: Gateway::default(),
        run: unique("lease-purge"),
    };
    let db = &t.db;
    let key = t.key();
    t.abandoned().await;
    assert!(
        idem::sea_orm::expired_leases(db, 10)
            .await
            .expect("list")
            .is_empty()
    );
    expire_lease(db, &key).await;
    let expired = idem::sea_orm::expired_leases(db, 10).await.expect("list");
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].key, key);
    assert!(expired[0].ended_ms_ago >= 3_500_000, "{:?}", expired[0]);
    let steps = "SELECT COUNT(*) FROM idem_steps WHERE ? <> ''";
    assert_eq!(
        scalar(db, steps, "x").await,
        1,
        "the charge step is recorded"
    );
    // However long ago its lease ended, a call not finished is never purged: its retry would
    // charge again without the recorded step.
    assert_eq!(
        idem::sea_orm::purge_expired(db, 100).await.expect("purge"),
        0
    );
    assert_eq!(scalar(db, steps, "x").await, 1, "its steps are kept");
    assert_eq!(
        idem::sea_orm::expired_leases(db, 10)
            .await
            .expect("list")
            .len(),
        1,
        "still listed for the operator"
    );
}

// ---------------------------------------------------------------------------------------
// SIGKILL across the steps: child processes (this binary re-executed) pay with a kill point,
// then the parent retries every key. The gateway here is a table written outside the
// handler's transactions (as an external service would be): every call is a row.

fn kill_at(point: &str, here: &str) {
    if point == here {
        kill_self();
    }
}

async fn gateway_call<C: ConnectionTrait>(
    db: &C,
    run: &str,
    key: &str,
) -> Result<String, TestError> {
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        idem::sea_orm::placeholders(
            backend,
            "INSERT INTO lease_gateway_calls (run_id, charge_key) VALUES (?, ?)",
        ),
        [run.into(), key.into()],
    ))
    .await
    .map_err(|e| TestError::Idem(idem::Error::store("gateway", e)))?;
    Ok(format!("ch_{}", &key[5..17]))
}

#[derive(Debug, Clone, Serialize)]
struct CrashPay {
    key: String,
    run: String,
}

#[idempotent(scope = "lease.crash", key = cmd.key, lease = "1s", skip(point))]
async fn crash_pay(
    db: &DatabaseConnection,
    point: &str,
    cmd: CrashPay,
) -> Result<String, TestError> {
    let gateway_run = cmd.run.clone();
    let charge: String = idem::step("charge", |key| async move {
        kill_at(point, "before-charge");
        let charge = gateway_call(db, &gateway_run, &key).await?;
        kill_at(point, "after-charge");
        Ok::<_, TestError>(charge)
    })
    .await?;
    let (run, point_owned) = (cmd.run.clone(), point.to_owned());
    let answer = idem::sea_orm::final_step(db, "record-payment", move |tx| {
        Box::pin(async move {
            insert_effect(tx, &run, "payment", 1).await;
            kill_at(&point_owned, "in-final");
            Ok::<_, TestError>(charge)
        })
    })
    .await?;
    kill_at(point, "after-final");
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the lease crash test: the parent runs it with IDEM_LEASE_CHILD set"]
async fn lease_child() {
    let Ok(url) = std::env::var("IDEM_LEASE_CHILD") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let db = common::isolated::connect(&url).await;
    let point = var("IDEM_LEASE_POINT");
    let paid = crash_pay(
        &db,
        &point,
        CrashPay {
            key: var("IDEM_LEASE_KEY"),
            run: var("IDEM_LEASE_RUN"),
        },
    )
    .await;
    // A call that failed before its kill point (a busy database under the crowd of children)
    // says so by its exit code: the parent tells it from a kill and from a call that finished.
    if paid.is_err() {
        std::process::exit(CHILD_CALL_FAILED);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_across_the_steps_then_retry_charges_once_and_pays_once() {
    let quick = std::env::var("IDEM_RELIABILITY_QUICK").is_ok_and(|v| v == "1");
    let (rounds, per_round) = if quick { (2, 20) } else { (5, 26) };
    for common::isolated::Isolated { name, db, url } in common::isolated::isolated().await {
        let create = match db.get_database_backend() {
            sea_orm::DbBackend::Sqlite => {
                "CREATE TABLE lease_gateway_calls (run_id TEXT NOT NULL, charge_key TEXT NOT NULL)"
            }
            _ => {
                "CREATE TABLE lease_gateway_calls (run_id VARCHAR(200) NOT NULL, charge_key VARCHAR(100) NOT NULL)"
            }
        };
        db.execute_unprepared(create).await.expect("gateway table");
        let points = [
            "before-charge",
            "after-charge",
            "in-final",
            "after-final",
            "random",
        ];
        let mut ends: std::collections::BTreeMap<(&str, ChildEnd), usize> = Default::default();
        let mut runs = Vec::new();
        let started = std::time::Instant::now();
        for round in 0..rounds {
            let mut children = Vec::new();
            for i in 0..per_round {
                let point = points[(round * per_round + i) % points.len()];
                let run = unique("crash").replace('-', "_");
                let child = std::process::Command::new(std::env::current_exe().expect("exe"))
                    .args([
                        "lease_child",
                        "--exact",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("IDEM_LEASE_CHILD", &url)
                    .env("IDEM_LEASE_POINT", point)
                    .env("IDEM_LEASE_KEY", format!("{run}-k"))
                    .env("IDEM_LEASE_RUN", &run)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn");
                children.push((child, point, 10 + (i as u64 * 7) % 80));
                runs.push(run);
            }
            let waited = tokio::task::spawn_blocking(move || {
                let mut outcome = Vec::new();
                let t0 = std::time::Instant::now();
                for (mut child, point, random_ms) in children {
                    if point == "random" {
                        let wait = Duration::from_millis(random_ms).saturating_sub(t0.elapsed());
                        std::thread::sleep(wait);
                        let _ = child.kill();
                    }
                    let status = child.wait().expect("wait");
                    outcome.push((point, ChildEnd::of(status)));
                }
                outcome
            })
            .await
            .expect("join");
            for (point, end) in waited {
                *ends.entry((point, end)).or_default() += 1;
            }
        }
        // Every lease has ended (1 s): retry every key to completion.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        for run in &runs {
            crash_pay(
                &db,
                "none",
                CrashPay {
                    key: format!("{run}-k"),
                    run: run.clone(),
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: retry of {run}: {e:?}"));
        }
        let mut double_charges = 0;
        let mut lost = 0;
        let mut gateway_calls = 0;
        for run in &runs {
            let keys = scalar(
                &db,
                "SELECT COUNT(DISTINCT charge_key) FROM lease_gateway_calls WHERE run_id = ?",
                run,
            )
            .await;
            gateway_calls += scalar(
                &db,
                "SELECT COUNT(*) FROM lease_gateway_calls WHERE run_id = ?",
                run,
            )
            .await;
            if keys > 1 {
                double_charges += 1;
            }
            let payments = effects(&db, run).await;
            if payments != 1 {
                lost += 1;
            }
        }
        let unfinished = idem::sea_orm::expired_leases(&db, 10_000)
            .await
            .expect("list")
            .len();
        // Children whose kill point and end `keep` accepts.
        let count = |keep: &dyn Fn(&str, ChildEnd) -> bool| -> usize {
            ends.iter()
                .filter(|((point, end), _)| keep(point, *end))
                .map(|(_, n)| n)
                .sum()
        };
        let total_kills = count(&|_, end| end == ChildEnd::Killed);
        println!(
            "lease crash {name}: {} calls, {total_kills} SIGKILLs, {} failed calls {ends:?}, then a retry each: {gateway_calls} gateway calls for {} charges (0 double charges), {} payments, {unfinished} unfinished leases, {:.1} s",
            runs.len(),
            count(&|_, end| end == ChildEnd::CallFailed),
            runs.len() - double_charges,
            runs.len() - lost,
            started.elapsed().as_secs_f64()
        );
        assert_eq!(double_charges, 0, "{name}: double charges at the gateway");
        assert_eq!(lost, 0, "{name}: payments lost or duplicated");
        assert_eq!(unfinished, 0, "{name}: leases left unfinished");
        // A child with a fixed kill point dies there unless its call failed first; a call
        // that finished past its kill point would mean the points are not reached.
        let finished_past_a_point =
            count(&|point, end| point != "random" && end == ChildEnd::Finished);
        assert_eq!(
            count(&|_, end| matches!(end, ChildEnd::Broke(_))),
            0,
            "{name}: a child broke: {ends:?}"
        );
        assert_eq!(
            finished_past_a_point, 0,
            "{name}: calls finished past their kill point: {ends:?}"
        );
        assert!(
            total_kills * 2 >= runs.len(),
            "{name}: only {total_kills} of {} calls were killed: {ends:?}",
            runs.len()
        );
    }
}

#[tokio::test]
async fn a_hung_holder_released_by_hand_is_taken_over_at_once_and_fenced_out() {
    for t in cases("release").await {
        let (held, gate) = t.paused(false).await;
        // The holder hangs after its charge; its renewals keep the lease alive.
        let retry = t.pay().await;
        assert_eq!(
            retry.err().and_then(|e| e.kind()),
            Some(ErrorKind::InFlight),
            "{}: in flight while held",
            t.name
        );
        let stuck = t.stuck_leases(Duration::ZERO).await;
        let ours = stuck
            .iter()
            .find(|l| l.key == t.key())
            .unwrap_or_else(|| panic!("{}: the held lease is listed as stuck", t.name));
        assert!(ours.ends_in_ms > 0, "{}: {ours:?}", t.name);
        let none = t.stuck_leases(Duration::from_secs(3600)).await;
        assert!(none.iter().all(|l| l.key != t.key()), "{}", t.name);

        let id = idem::store::record_id("lease.pay", "", &t.key());
        let released = t.release_lease(&id).await;
        assert!(released, "{}: released", t.name);
        // At once: the retry takes over from the recorded charge and finishes the call.
        let (answer, outcome) = with_outcome(t.pay()).await;
        assert!(answer.is_ok(), "{}: {answer:?}", t.name);
        assert_eq!(outcome, Some(Outcome::Executed), "{}", t.name);
        // The old holder wakes up: its final phase is refused.
        gate.release();
        let late = held.await.expect("task");
        assert_eq!(
            late.err().and_then(|e| e.kind()),
            Some(ErrorKind::LeaseLost),
            "{}: the late holder is fenced out",
            t.name
        );
        assert_eq!(effects(&t.db, &t.run).await, 1, "{}: one payment", t.name);
        assert_eq!(t.gateway.calls(), 1, "{}: one charge", t.name);
        // A record that ended has nothing to release.
        let again = t.release_lease(&id).await;
        assert!(!again, "{}", t.name);
    }
}

#[tokio::test]
async fn a_panic_in_a_lease_mode_body_releases_the_lease_at_once() {
    for t in cases("panic").await {
        let panics = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (c, first) = (t.clone(), panics.clone());
        let first_cmd = cmd(&t.run);
        let panicked =
            tokio::spawn(async move { call!(c, pay_or_panic(&c.gateway, &first, first_cmd)) })
                .await;
        assert!(panicked.is_err_and(|e| e.is_panic()), "{}", t.name);
        // The release runs behind the panic: the key is free within moments, not 10 s.
        let started = std::time::Instant::now();
        let (answer, outcome) = loop {
            let (answer, outcome) =
                with_outcome(async { call!(t, pay_or_panic(&t.gateway, &panics, cmd(&t.run))) })
                    .await;
            match answer {
                Err(e) if e.kind() == Some(ErrorKind::InFlight) => {
                    assert!(
                        started.elapsed() < Duration::from_secs(2),
                        "{}: still in flight after the panic",
                        t.name
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                answer => break (answer, outcome),
            }
        };
        assert!(answer.is_ok(), "{}: {answer:?}", t.name);
        assert_eq!(outcome, Some(Outcome::Executed), "{}", t.name);
        assert_eq!(effects(&t.db, &t.run).await, 1, "{}: one payment", t.name);
        assert_eq!(t.gateway.calls(), 1, "{}: the charge replayed", t.name);
    }
}

#[tokio::test]
async fn a_hung_body_is_stopped_at_its_deadline_and_the_retry_takes_over() {
    for t in cases("deadline").await {
        let hangs = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (c, hung) = (t.clone(), hangs.clone());
        let first_cmd = cmd(&t.run);
        let started = std::time::Instant::now();
        let first =
            tokio::spawn(async move { call!(c, pay_or_hang(&c.gateway, &hung, first_cmd)) });
        // Held past its 1 s lease by its renewals: a retry meanwhile is in flight.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let retry = call!(t, pay_or_hang(&t.gateway, &hangs, cmd(&t.run)));
        assert_eq!(
            retry.err().and_then(|e| e.kind()),
            Some(ErrorKind::InFlight),
            "{}: in flight while it hangs",
            t.name
        );
        // At its 2 s deadline the body is dropped and the caller told so.
        let stopped = tokio::time::timeout(Duration::from_secs(5), first)
            .await
            .unwrap_or_else(|_| panic!("{}: the hung call never ended", t.name))
            .expect("task");
        let took = started.elapsed();
        match stopped {
            Err(TestError::Idem(e)) if e.kind() == ErrorKind::DeadlineExceeded => {
                assert_eq!(e.http_status(), 503, "{}", t.name);
                assert!(e.to_string().contains("deadline"), "{}: {e}", t.name);
            }
            other => panic!("{}: expected the deadline, got {other:?}", t.name),
        }
        assert!(took < Duration::from_millis(3500), "{}: {took:?}", t.name);
        // The key is free at once: the retry takes over from the recorded charge.
        hangs.store(false, std::sync::atomic::Ordering::SeqCst);
        let (answer, outcome) =
            with_outcome(async { call!(t, pay_or_hang(&t.gateway, &hangs, cmd(&t.run))) }).await;
        assert!(answer.is_ok(), "{}: {answer:?}", t.name);
        assert_eq!(outcome, Some(Outcome::Executed), "{}", t.name);
        assert_eq!(effects(&t.db, &t.run).await, 1, "{}: one payment", t.name);
        assert_eq!(t.gateway.calls(), 1, "{}: one charge", t.name);
    }
}
