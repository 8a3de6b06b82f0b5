//! R14 completer: resumable lease-mode calls whose processes are SIGKILLed at every step are
//! finished by completers that are themselves killed and restarted, and no client ever
//! retries. Each call (a child process: this test binary, re-executed) charges a table-backed
//! gateway in a recorded step and writes its payment row in the final phase; it is killed
//! *before the charge*, *after the charge* (before its step is recorded), *in the final phase*
//! (writes made, not committed), *after the final phase* (before the call is recorded), or by
//! the parent at a random moment of its body. Completer processes (`Completer::run`, 100 ms
//! poll) run meanwhile and are killed at random moments and restarted; two in three also
//! crash at one of those points inside their first or second attempt. At the end one completer
//! in the parent runs until every call has ended. Then, counted in the database:
//! every claimed call finished, 0 double charges, one payment per charge, no lease left
//! unfinished, and a late client retry of every key replays the recorded answer. The time from
//! each kill to the call's completion is measured on the database clock.
//!
//! SeaORM's store only: the completer suite (tests/completer.rs) runs its cases through both
//! stores; this row is the crash schedule on top of it.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::crash::{CHILD_CALL_FAILED, ChildEnd, kill_self};
use idem::completer::{GaveUp, Resumed};
use idem::sea_orm::{CALLS_TABLE, Completer, SeaOrmLeaseStore, database_now_ms};
use idem::{Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Value};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::watch;

use crate::common::isolated::{self, Isolated};
use crate::support::{Rng, quick, stmt, unique};

/// The handler's scope.
const SCOPE: &str = "r14.pay";
/// The handler's lease (`lease = "1s"` below): a killed holder's call waits this long, at
/// most, before a completer may take it over.
const LEASE: Duration = Duration::from_secs(1);
/// The handler's record TTL (`ttl = "1h"` below). A completed lease record expires TTL after
/// its completion (database clock), so its completion time is `expires_at_ms - TTL`.
const TTL_MS: i64 = 3_600_000;
/// How often a completer looks for calls whose lease ended, at most.
const POLL: Duration = Duration::from_millis(100);
/// Attempts a completer makes at one call before giving it up: the default (10). A
/// completer killed during a round counts an attempt for every call it had in flight, and
/// those calls, cut off together, come due together and are batched together again. These
/// completers die every 100–1500 ms and most of them crash inside an attempt, far more often
/// than a deployment's; the most attempts seen on one call were 5 (with SQLite's rollback
/// journal on a loaded machine, before the write-ahead log below: 6). With 10, no give-up is
/// the expected count (the gateway never fails); the most attempts on a call are printed.
const MAX_ATTEMPTS: u32 = idem::completer::DEFAULT_MAX_ATTEMPTS;
/// Call children of a round start within this many milliseconds.
const ROUND_SPREAD_MS: u64 = 1_500;
/// Completer processes alive at once while the calls are killed.
const COMPLETERS: usize = 2;
/// The environment variable that makes `crash_child` a child: its role (`call`, `completer`).
const CHILD: &str = "IDEM_R14_CHILD";
/// Where call children are killed; "random" is the parent's kill at a random moment of the
/// body (after the claim: the child announces its body).
const POINTS: [&str; 5] = [
    "before-charge",
    "after-charge",
    "in-final",
    "after-final",
    "random",
];

/// The arguments a resumable call stores with its claim.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    key: String,
    run: String,
}

/// Which process runs the handler, and where it kills itself (skipped: not stored).
#[derive(Debug, Clone)]
struct Runner {
    /// A point of `POINTS`, or "none".
    kill_at: String,
    /// Written with the payment: `call`, `completer`, `final` or `client`.
    writer: &'static str,
    /// Print `@@ BODY` when the body starts, for the parent's random kill.
    announce: bool,
}

impl Runner {
    fn resumed(writer: &'static str) -> Self {
        Self {
            kill_at: "none".to_owned(),
            writer,
            announce: false,
        }
    }
}

/// Where a completer process kills itself: at `point` of the `attempt`-th call it resumes
/// (its other attempts in flight are cut off with it).
#[derive(Debug, Clone)]
struct Crash {
    point: String,
    attempt: u32,
}

fn kill_at(runner: &Runner, here: &str) {
    if runner.kill_at == here {
        // The moment of death, on the machine's clock (the database's too: every server here
        // is local), for the parent: it sees the exit later, by as much as a loaded machine
        // delays it, and a completer may finish the call in between.
        println!("@@ DYING {}", epoch_ms());
        let _ = std::io::Write::flush(&mut std::io::stdout());
        kill_self();
    }
}

/// The machine's clock, in epoch milliseconds.
fn epoch_ms() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |since| since.as_millis() as i64)
}

/// The gateway: a row per call, written on the pool (outside the handler's transactions, as
/// an external service's charge would be), keyed by the step's derived key as an
/// `Idempotency-Key`. A gateway deduplicates on that key, so a repeated call with the same
/// key is the same charge; two keys for one order would be a double charge.
async fn gateway_charge(
    db: &DatabaseConnection,
    run: &str,
    key: &str,
) -> Result<String, idem::Error> {
    db.execute_raw(stmt(
        db,
        "INSERT INTO r14_gateway_calls (run_id, charge_key) VALUES (?, ?)",
        vec![run.into(), key.into()],
    ))
    .await
    .map_err(|e| idem::Error::store("calling the gateway", e))?;
    Ok(charge_id(key))
}

/// The charge id the gateway answers for `key`.
fn charge_id(key: &str) -> String {
    format!("ch_{key}")
}

#[idempotent(scope = "r14.pay", key = order.key, lease = "1s", ttl = "1h", resumable, skip(runner))]
async fn pay(
    db: &DatabaseConnection,
    runner: &Runner,
    order: Order,
) -> Result<String, idem::Error> {
    if runner.announce {
        println!("@@ BODY");
    }
    let gateway_run = order.run.clone();
    let charge: String = idem::step("charge", |key| async move {
        kill_at(runner, "before-charge");
        let charge = gateway_charge(db, &gateway_run, &key).await?;
        kill_at(runner, "after-charge");
        Ok::<_, idem::Error>(charge)
    })
    .await?;
    let (run, payment, process) = (order.run.clone(), charge.clone(), runner.clone());
    let answer = idem::sea_orm::final_step(db, "record-payment", move |tx| {
        Box::pin(async move {
            // The database clock at the payment, in the payment's own transaction.
            let paid_at = database_now_ms(tx).await?;
            tx.execute_raw(stmt(
                tx,
                "INSERT INTO r14_payments (run_id, charge, writer, paid_at_ms) \
                 VALUES (?, ?, ?, ?)",
                vec![
                    run.into(),
                    payment.clone().into(),
                    process.writer.into(),
                    paid_at.into(),
                ],
            ))
            .await
            .map_err(|e| idem::Error::store("writing the payment", e))?;
            kill_at(&process, "in-final");
            Ok::<_, idem::Error>(payment)
        })
    })
    .await?;
    kill_at(runner, "after-final");
    Ok(answer)
}

/// Writes a row of the attempts table, the test's own record of what completers did.
async fn note_attempt(db: &DatabaseConnection, sql: &str, values: Vec<Value>) {
    let _ = db.execute_raw(stmt(db, sql, values)).await;
}

/// A completer for `pay` on `db`; `writer` names its payments. A give-up's hook writes a row
/// (the compensation, keyed as the docs say), so give-ups are counted in the database too.
/// A completer child (`announce`) prints `@@ ATTEMPT` as each attempt begins, for the parent's
/// schedule of kills.
fn completer(
    db: &DatabaseConnection,
    writer: &'static str,
    crash: Option<Crash>,
    announce: bool,
) -> Completer {
    let (resume_db, hook_db) = (db.clone(), db.clone());
    let started_attempts = Arc::new(AtomicU32::new(0));
    Completer::new(SeaOrmLeaseStore::new(db.clone()))
        .max_attempts(MAX_ATTEMPTS)
        .backoff(Duration::from_millis(100), Duration::from_secs(1))
        .poll_interval(POLL)
        .resume(SCOPE, move |call: Resumed<(Order,)>| {
            let db = resume_db.clone();
            let nth = started_attempts.fetch_add(1, Ordering::SeqCst) + 1;
            if announce {
                println!("@@ ATTEMPT");
            }
            let mut runner = Runner::resumed(writer);
            if let Some(crash) = crash.as_ref().filter(|crash| crash.attempt == nth) {
                runner.kill_at = crash.point.clone();
            }
            async move {
                // Every attempt leaves a row first, and its outcome after: an attempt cut off
                // by a kill is a row without an outcome. Figures only: a note that fails (a
                // busy SQLite file) does not stop the attempt.
                let run = call.args.0.run.clone();
                let attempt = i64::from(call.attempt);
                note_attempt(
                    &db,
                    "INSERT INTO r14_attempts (run_id, attempt, writer) VALUES (?, ?, ?)",
                    vec![run.clone().into(), attempt.into(), writer.into()],
                )
                .await;
                let began = Instant::now();
                let paid = pay(&db, &runner, call.args.0).await;
                let took_ms = began.elapsed().as_millis() as i64;
                let outcome = match &paid {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => format!("{}: {e}", e.kind().as_str()),
                };
                note_attempt(
                    &db,
                    "UPDATE r14_attempts SET outcome = ?, took_ms = ? WHERE run_id = ? \
                     AND attempt = ? AND writer = ?",
                    vec![
                        outcome.into(),
                        took_ms.into(),
                        run.into(),
                        attempt.into(),
                        writer.into(),
                    ],
                )
                .await;
                paid
            }
        })
        .on_give_up(move |gave_up: GaveUp| {
            let db = hook_db.clone();
            async move {
                db.execute_raw(stmt(
                    &db,
                    "INSERT INTO r14_give_ups (idem_key, refund_key) VALUES (?, ?)",
                    vec![gave_up.key.clone().into(), gave_up.idempotency_key().into()],
                ))
                .await
                .map(drop)
                .map_err(|e| idem::Error::store("recording a refund", e))
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of R14: the parent runs it with IDEM_R14_CHILD set"]
async fn crash_child() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let db = isolated::connect(&var("IDEM_R14_URL")).await;
    match role.as_str() {
        "call" => {
            let runner = Runner {
                kill_at: var("IDEM_R14_POINT"),
                writer: "call",
                announce: true,
            };
            let order = Order {
                key: var("IDEM_R14_KEY"),
                run: var("IDEM_R14_RUN"),
            };
            // A call that failed before its kill point (a busy database) says so by its exit
            // code; no client retries it, so only a completer can finish it.
            if pay(&db, &runner, order).await.is_err() {
                std::process::exit(CHILD_CALL_FAILED);
            }
        }
        "completer" => {
            // Runs until killed; its standard input closing (the parent died) stops it too.
            let (gone, parent_gone) = tokio::sync::oneshot::channel::<()>();
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
                let _ = gone.send(());
            });
            let crash = std::env::var("IDEM_R14_CRASH_AT").ok().map(|point| Crash {
                point,
                attempt: var("IDEM_R14_CRASH_ATTEMPT").parse().expect("an attempt"),
            });
            completer(&db, "completer", crash, true)
                .run(async {
                    let _ = parent_gone.await;
                })
                .await;
        }
        other => panic!("unknown R14 child role {other}"),
    }
}

/// This test binary, re-executed as an R14 child with `role` on `url`.
fn child(role: &str, url: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary"));
    command
        .args([
            "completer_crashes::crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, role)
        .env("IDEM_R14_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // A parent that panics takes its children with it.
        .kill_on_drop(true);
    command
}

/// One call child, as the parent saw it.
#[derive(Debug)]
struct CallChild {
    run: String,
    point: &'static str,
    end: ChildEnd,
    /// The database clock when the child died.
    died_at_ms: i64,
}

impl CallChild {
    fn key(&self) -> String {
        format!("{}-k", self.run)
    }
}

/// One call child's schedule, drawn from the seeded PRNG.
#[derive(Debug, Clone, Copy)]
struct CallPlan {
    point: &'static str,
    /// When it starts within its round: the calls' leases end spread over time, so the
    /// completers are at work whenever they are killed.
    start_after: Duration,
    /// A `random` kill's moment, in thousandths of the body window.
    kill_permille: u64,
}

/// The body window of random kills (µs): from a random child's body announcement to its
/// exit, as the last random child that got there before its kill measured it. Kills are
/// drawn within it: most land in the body (charge, step record, final phase, completion),
/// some after the call was recorded, while the process exits.
type BodyWindow = Arc<AtomicU64>;

/// Runs one call child to its end: it kills itself at its point, or (`random`) the parent
/// kills it at a random moment of its body.
async fn call_child(
    db: DatabaseConnection,
    url: String,
    plan: CallPlan,
    window: BodyWindow,
) -> CallChild {
    tokio::time::sleep(plan.start_after).await;
    let run = unique("r14").replace('-', "_");
    let mut command = child("call", &url);
    command
        .env("IDEM_R14_POINT", plan.point)
        .env("IDEM_R14_KEY", format!("{run}-k"))
        .env("IDEM_R14_RUN", &run);
    command.stdout(Stdio::piped());
    let mut process = command.spawn().expect("spawn a call child");
    // The child's lines: `@@ BODY` (after the claim: the body has started) for a random kill,
    // `@@ DYING <ms>` from a child that kills itself at its point.
    let (body_tx, body_rx) = tokio::sync::oneshot::channel::<()>();
    let dying = process.stdout.take().map(|stdout| {
        tokio::spawn(async move {
            let (mut lines, mut body_tx, mut dying) =
                (BufReader::new(stdout).lines(), Some(body_tx), None);
            while let Ok(Some(line)) = lines.next_line().await {
                // libtest's `test completer_crashes::crash_child ... ` may start the line.
                if line.ends_with("@@ BODY") {
                    body_tx.take().map(|tx| tx.send(()));
                } else if let Some((_, ms)) = line.split_once("@@ DYING ") {
                    dying = ms.trim().parse::<i64>().ok();
                }
            }
            dying
        })
    });
    if plan.point == "random" {
        if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(60), body_rx).await {
            let body_started = Instant::now();
            let window_us = window.load(Ordering::Relaxed);
            let kill_after = Duration::from_micros(window_us * plan.kill_permille / 1000);
            tokio::select! {
                _ = process.wait() => {
                    let took = body_started.elapsed().as_micros() as u64;
                    window.store(took, Ordering::Relaxed);
                }
                () = tokio::time::sleep(kill_after) => {}
            }
        }
        let _ = process.start_kill();
    }
    let end = match tokio::time::timeout(Duration::from_secs(60), process.wait()).await {
        Ok(status) => ChildEnd::of(status.expect("wait for a call child")),
        Err(_) => {
            let _ = process.start_kill();
            let _ = process.wait().await;
            ChildEnd::Hung
        }
    };
    let seen_dead = died_at(&db).await;
    let dying = match dying {
        Some(reader) => reader.await.ok().flatten(),
        None => None,
    };
    CallChild {
        run,
        point: plan.point,
        end,
        // A child that killed itself said when; one the parent killed died when it was seen.
        died_at_ms: dying.unwrap_or(seen_dead),
    }
}

/// The database clock when a child's death was seen just now. The query may wait for the
/// pool (SQLite has one connection): the wait is taken off the reading, so every death is on
/// the database clock, as the completions are.
async fn died_at(db: &DatabaseConnection) -> i64 {
    let seen = Instant::now();
    let now = database_now_ms(db).await.expect("the database clock");
    now - seen.elapsed().as_millis() as i64
}

/// What the completer processes went through while the calls were killed.
#[derive(Debug, Default, Clone, Copy)]
struct ChaosTally {
    started: usize,
    /// Killed by the parent at a random moment.
    killed: usize,
    /// Killed by themselves at their crash point.
    crashed: usize,
    /// Completers that exited otherwise: they never should.
    exited: usize,
}

/// Where the completers of a slot crash, in turn from a random start: two in three crash, and
/// every third is at a point that each attempt reaching the final phase passes (a random
/// draw of four points gave runs whose crashers all waited at a charge point that their calls,
/// charged already, replayed; none crashed).
const COMPLETER_CRASHES: [Option<&str>; 6] = [
    Some("before-charge"),
    Some("in-final"),
    None,
    Some("after-charge"),
    Some("after-final"),
    None,
];

/// One slot of completer processes: starts one, lets it run for a random 100–1500 ms after it
/// began its first attempt, kills it, waits 0–300 ms, starts the next, until `stop` says so.
/// Two in three also crash at a point of their first or second attempt (`COMPLETER_CRASHES`:
/// before the charge, after it, in the final phase, after it; one the attempt reaches: a
/// recorded step replays without running), which cuts off every attempt they have in flight;
/// their life is counted from the start of that attempt.
///
/// Why the life is counted from an attempt, not from the spawn: a completer starting on a
/// loaded machine (the test binary re-executed, its pool connecting) or idle before the first
/// leases end can spend its whole life before any attempt, and then neither crashes nor is cut
/// off. One CI run drew 16 completers and none of them crashed.
async fn completer_slot(url: String, seed: u64, mut stop: watch::Receiver<bool>) -> ChaosTally {
    let mut rng = Rng::from_seed(seed);
    let mut next_plan = rng.below(COMPLETER_CRASHES.len() as u64) as usize;
    let mut tally = ChaosTally::default();
    while !*stop.borrow() {
        let mut command = child("completer", &url);
        // Its standard input stays open while this parent lives; it announces its attempts.
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
        let crash_at = COMPLETER_CRASHES[next_plan % COMPLETER_CRASHES.len()];
        next_plan += 1;
        let crashes = crash_at.is_some();
        // The attempt its life is counted from.
        let mut from_attempt = 1;
        if let Some(point) = crash_at {
            from_attempt = 1 + rng.below(2);
            command
                .env("IDEM_R14_CRASH_AT", point)
                .env("IDEM_R14_CRASH_ATTEMPT", from_attempt.to_string());
        }
        let mut process = command.spawn().expect("spawn a completer");
        // Held here: `wait` closes the child's standard input, which would stop it.
        let _stdin = process.stdin.take();
        let attempts = attempts_announced(process.stdout.take().expect("a piped stdout"));
        tally.started += 1;
        let life = Duration::from_millis(100 + rng.below(1400));
        let lived = async {
            let mut attempts = attempts;
            // A closed channel: the child died, and `wait` below says how.
            if attempts.wait_for(|n| *n >= from_attempt).await.is_ok() {
                tokio::time::sleep(life).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        let ended = tokio::select! {
            status = process.wait() => Some(status.expect("wait for a completer")),
            () = lived => None,
            _ = stop.changed() => None,
        };
        match ended {
            Some(status) if crashes && ChildEnd::of(status) == ChildEnd::Killed => {
                tally.crashed += 1;
            }
            Some(_) => tally.exited += 1,
            None => {
                process.start_kill().expect("SIGKILL a completer");
                let _ = process.wait().await;
                tally.killed += 1;
            }
        }
        let gap = Duration::from_millis(rng.below(300));
        tokio::select! {
            () = tokio::time::sleep(gap) => {}
            _ = stop.changed() => {}
        }
    }
    tally
}

/// The number of attempts a completer child has begun, from its `@@ ATTEMPT` lines. Its
/// standard output is read to the end, so the child never blocks on a full pipe.
fn attempts_announced(stdout: tokio::process::ChildStdout) -> watch::Receiver<u64> {
    let (begun, attempts) = watch::channel(0);
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            // libtest's `test completer_crashes::crash_child ... ` may start the line.
            if line.ends_with("@@ ATTEMPT") {
                begun.send_modify(|n| *n += 1);
            }
        }
    });
    attempts
}

/// Completer processes killed and restarted at random until stopped.
struct Chaos {
    stop: watch::Sender<bool>,
    slots: Vec<tokio::task::JoinHandle<ChaosTally>>,
}

impl Chaos {
    fn start(url: &str, rng: &mut Rng) -> Self {
        let (stop, watching) = watch::channel(false);
        let slots = (0..COMPLETERS)
            .map(|_| {
                tokio::spawn(completer_slot(
                    url.to_owned(),
                    rng.next_u64(),
                    watching.clone(),
                ))
            })
            .collect();
        Self { stop, slots }
    }

    /// Kills the completers alive now and says what they went through.
    async fn stop(self) -> ChaosTally {
        let _ = self.stop.send(true);
        let mut all = ChaosTally::default();
        for slot in self.slots {
            let tally = slot.await.expect("a completer slot");
            all.started += tally.started;
            all.killed += tally.killed;
            all.crashed += tally.crashed;
            all.exited += tally.exited;
        }
        all
    }
}

/// Calls not ended yet: ledger rows still claimed, and stored calls (in progress, or given up
/// with their hook owed).
async fn not_ended(db: &DatabaseConnection) -> (i64, i64) {
    let row = db
        .query_one_raw(stmt(
            db,
            &format!(
                "SELECT (SELECT COUNT(*) FROM idem_ledger WHERE state = 0), \
                 (SELECT COUNT(*) FROM {CALLS_TABLE})"
            ),
            vec![],
        ))
        .await
        .expect("count unfinished calls")
        .expect("a row");
    (
        row.try_get_by_index::<i64>(0).expect("claimed"),
        row.try_get_by_index::<i64>(1).expect("stored"),
    )
}

/// Waits until every call has ended (polling every 50 ms), at most `bound`; `false` if not.
async fn all_ended_within(db: &DatabaseConnection, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    loop {
        if not_ended(db).await == (0, 0) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A call's ledger record: its state, completion time (database clock) and recorded answer.
#[derive(Debug)]
struct Record {
    state: i16,
    completed_at_ms: i64,
    answer: Option<String>,
}

async fn records(db: &DatabaseConnection) -> BTreeMap<String, Record> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT idem_key, state, expires_at_ms, response FROM idem_ledger WHERE scope = ?",
            vec![SCOPE.into()],
        ))
        .await
        .expect("ledger records");
    rows.iter()
        .map(|r| {
            let response: Option<Vec<u8>> = r.try_get_by_index(3).expect("response");
            let record = Record {
                state: r.try_get_by_index(1).expect("state"),
                completed_at_ms: r.try_get_by_index::<i64>(2).expect("expiry") - TTL_MS,
                answer: response.and_then(|bytes| serde_json::from_slice(&bytes).ok()),
            };
            (r.try_get_by_index(0).expect("key"), record)
        })
        .collect()
}

/// What the gateway saw for an order: calls, distinct charge keys, one of them.
type GatewayCalls = (i64, i64, String);

async fn gateway_calls(db: &DatabaseConnection) -> BTreeMap<String, GatewayCalls> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT run_id, COUNT(*), COUNT(DISTINCT charge_key), MIN(charge_key) \
             FROM r14_gateway_calls GROUP BY run_id",
            vec![],
        ))
        .await
        .expect("gateway calls");
    rows.iter()
        .map(|r| {
            let run: String = r.try_get_by_index(0).expect("run");
            let calls = (
                r.try_get_by_index(1).expect("calls"),
                r.try_get_by_index(2).expect("keys"),
                r.try_get_by_index(3).expect("key"),
            );
            (run, calls)
        })
        .collect()
}

/// An order's payment rows: how many, and the first one's charge, writer and time.
type Payments = (i64, String, String, i64);

async fn payments(db: &DatabaseConnection) -> BTreeMap<String, Payments> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT run_id, COUNT(*), MIN(charge), MIN(writer), MIN(paid_at_ms) \
             FROM r14_payments GROUP BY run_id",
            vec![],
        ))
        .await
        .expect("payments");
    rows.iter()
        .map(|r| {
            let run: String = r.try_get_by_index(0).expect("run");
            let payment = (
                r.try_get_by_index(1).expect("count"),
                r.try_get_by_index(2).expect("charge"),
                r.try_get_by_index(3).expect("writer"),
                r.try_get_by_index(4).expect("paid at"),
            );
            (run, payment)
        })
        .collect()
}

/// Completer attempts per order (the resumer notes each before it runs the handler).
async fn attempts(db: &DatabaseConnection) -> BTreeMap<String, i64> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT run_id, COUNT(*) FROM r14_attempts GROUP BY run_id",
            vec![],
        ))
        .await
        .expect("attempts");
    rows.iter()
        .map(|r| {
            (
                r.try_get_by_index(0).expect("run"),
                r.try_get_by_index(1).expect("count"),
            )
        })
        .collect()
}

/// What the completers' attempts came to, from the attempts table.
#[derive(Debug, Default)]
struct AttemptFigures {
    /// By outcome: `ok`, the error kind of a failed one, or `cut off` (no outcome: its
    /// completer was killed during it); with one message of each failure kind.
    by_outcome: BTreeMap<String, (i64, String)>,
    /// How long the attempts that got an outcome took (ms), sorted.
    took_ms: Vec<i64>,
}

async fn attempt_figures(db: &DatabaseConnection) -> AttemptFigures {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT outcome, took_ms FROM r14_attempts",
            vec![],
        ))
        .await
        .expect("attempt outcomes");
    let mut figures = AttemptFigures::default();
    for row in &rows {
        let outcome: Option<String> = row.try_get_by_index(0).expect("outcome");
        let took: Option<i64> = row.try_get_by_index(1).expect("took");
        figures.took_ms.extend(took);
        let outcome = outcome.unwrap_or_else(|| "cut off".to_owned());
        let (kind, message) = outcome.split_once(": ").unwrap_or((&outcome, ""));
        let entry = figures.by_outcome.entry(kind.to_owned()).or_default();
        entry.0 += 1;
        if entry.1.is_empty() {
            entry.1 = message.chars().take(160).collect();
        }
    }
    figures.took_ms.sort_unstable();
    figures
}

async fn count(db: &DatabaseConnection, sql: &str, values: Vec<Value>) -> i64 {
    db.query_one_raw(stmt(db, sql, values))
        .await
        .expect("count")
        .expect("a row")
        .try_get_by_index::<i64>(0)
        .expect("an integer")
}

async fn create_tables(db: &DatabaseConnection) {
    if db.get_database_backend() == DbBackend::Sqlite {
        // A write-ahead log, as several processes on one SQLite file would use: kept in the
        // file, so every child's connection uses it too. With the rollback journal a reader
        // blocks the writers, and the crowd of processes queues on the file's lock.
        db.execute_unprepared("PRAGMA journal_mode = WAL")
            .await
            .expect("write-ahead log");
    }
    let (text, key) = match db.get_database_backend() {
        DbBackend::Sqlite => ("TEXT", "TEXT"),
        _ => ("VARCHAR(200)", "VARCHAR(100)"),
    };
    for ddl in [
        format!(
            "CREATE TABLE r14_gateway_calls (run_id {text} NOT NULL, charge_key {key} NOT NULL)"
        ),
        format!(
            "CREATE TABLE r14_payments (run_id {text} NOT NULL, charge {text} NOT NULL, \
             writer {key} NOT NULL, paid_at_ms BIGINT NOT NULL)"
        ),
        format!(
            "CREATE TABLE r14_attempts (run_id {text} NOT NULL, attempt BIGINT NOT NULL, \
             writer {key} NOT NULL, outcome {text} NULL, took_ms BIGINT NULL)"
        ),
        format!("CREATE TABLE r14_give_ups (idem_key {text} NOT NULL, refund_key {key} NOT NULL)"),
    ] {
        db.execute_unprepared(&ddl).await.expect("an R14 table");
    }
}

/// The `p`-th percentile of sorted `samples` (nearest rank).
fn percentile(samples: &[i64], p: usize) -> i64 {
    samples[(samples.len() * p).div_ceil(100).saturating_sub(1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_calls_are_finished_by_killed_completers_once() {
    let (rounds, per_round) = if quick() { (2, 20) } else { (4, 26) };
    for Isolated { name, db, url } in isolated::isolated().await {
        let started = Instant::now();
        let mut rng = Rng::new("r14");
        create_tables(&db).await;

        // Calls in rounds of concurrent children, while completers are killed and restarted.
        let chaos = Chaos::start(&url, &mut rng);
        let mut calls: Vec<CallChild> = Vec::new();
        let window: BodyWindow = Arc::new(AtomicU64::new(20_000));
        for round in 0..rounds {
            let children: Vec<_> = (0..per_round)
                .map(|i| {
                    let plan = CallPlan {
                        point: POINTS[(round * per_round + i) % POINTS.len()],
                        start_after: Duration::from_millis(rng.below(ROUND_SPREAD_MS)),
                        kill_permille: rng.below(1000),
                    };
                    let (db, url, window) = (db.clone(), url.clone(), Arc::clone(&window));
                    tokio::spawn(call_child(db, url, plan, window))
                })
                .collect();
            for child in children {
                calls.push(child.await.expect("a call child"));
            }
        }
        let calls_done = Instant::now();
        // The completers keep being killed while they finish the last round's calls.
        all_ended_within(&db, 2 * LEASE + Duration::from_secs(1)).await;
        let (claimed_left, stored_left) = not_ended(&db).await;
        let chaos = chaos.stop().await;

        // One completer, never killed, until every call has ended.
        let bound = LEASE + Duration::from_secs(30);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let last = tokio::spawn(completer(&db, "final", None, false).run(async {
            let _ = stopped.await;
        }));
        let ended = all_ended_within(&db, bound).await;
        let _ = stop.send(());
        last.await.expect("the last completer");
        let finished_at = Instant::now();

        // Counted in the database.
        let records = records(&db).await;
        let gateway = gateway_calls(&db).await;
        let payments = payments(&db).await;
        let attempts = attempts(&db).await;
        let attempt_figures = attempt_figures(&db).await;
        let (outcomes, took) = (&attempt_figures.by_outcome, &attempt_figures.took_ms);
        let (still_claimed, still_stored) = not_ended(&db).await;
        let refunds = count(
            &db,
            "SELECT COUNT(DISTINCT idem_key) FROM r14_give_ups",
            vec![],
        )
        .await;
        let unfinished = idem::sea_orm::expired_leases(&db, 10_000)
            .await
            .expect("list expired leases");
        let mut ends: BTreeMap<(&str, ChildEnd), usize> = BTreeMap::new();
        let mut writers: BTreeMap<String, usize> = BTreeMap::new();
        // Calls that break a claim, by claim.
        let mut wrong: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let (mut gateway_total, mut charges, mut double_charges) = (0, 0, 0);
        let (mut gave_up, mut unclaimed, mut before_death) = (0, 0, 0);
        let (mut taken_over, mut retaken, mut max_attempts) = (0, 0, 0);
        let mut kill_to_completion = Vec::new();
        for call in &calls {
            *ends.entry((call.point, call.end)).or_default() += 1;
            let mut check = |holds: bool, claim: &'static str| {
                if !holds {
                    wrong.entry(claim).or_default().push(call.run.clone());
                }
            };
            let (gateway_calls, charge_keys, charge_key) =
                gateway.get(&call.run).cloned().unwrap_or_default();
            let (paid, charge, writer, paid_at) =
                payments.get(&call.run).cloned().unwrap_or_default();
            gateway_total += gateway_calls;
            charges += charge_keys;
            double_charges += usize::from(charge_keys > 1);
            let tries = attempts.get(&call.run).copied().unwrap_or(0);
            taken_over += usize::from(tries > 0);
            retaken += usize::from(tries > 1);
            max_attempts = max_attempts.max(tries);
            let Some(record) = records.get(&call.key()) else {
                // Never claimed: its call failed at the claim. Nothing happened and nothing
                // is owed (no client retries it).
                unclaimed += 1;
                check(
                    call.end == ChildEnd::CallFailed,
                    "no record, yet not failed",
                );
                check((gateway_calls, paid) == (0, 0), "effects without a claim");
                continue;
            };
            if record.state == 3 {
                gave_up += 1;
                continue;
            }
            check(record.state == 1, "calls not finished");
            check(paid == 1, "payments lost or duplicated");
            check(charge_keys == 1, "calls without exactly one charge");
            if record.state != 1 || paid != 1 || charge_keys != 1 {
                continue;
            }
            *writers.entry(writer.clone()).or_default() += 1;
            check(
                charge_key == idem::lease::derived_key(SCOPE, "", &call.key(), "charge"),
                "charge key not the step's derived key",
            );
            check(
                charge == charge_id(&charge_key)
                    && record.answer.as_deref() == Some(charge.as_str()),
                "payment or recorded answer without the charge",
            );
            // The completion time read from the ledger comes after the payment it records.
            check(paid_at <= record.completed_at_ms, "paid after completion");
            // A call killed at a fixed point cannot have finished itself: a completer did,
            // after the kill; the payment was written by the process that got past
            // "in-final" (the call's own for "after-final", a completer's otherwise).
            if call.point != "random" && call.end == ChildEnd::Killed {
                check(
                    record.completed_at_ms > call.died_at_ms,
                    "killed at a point, completed before the kill",
                );
                check(
                    (writer == "call") == (call.point == "after-final"),
                    "payment written by the wrong process",
                );
                // Charged, step not recorded: the takeover called the gateway again, with the
                // same key (one charge at a gateway that deduplicates on it).
                if call.point == "after-charge" {
                    check(
                        gateway_calls >= 2,
                        "killed after the charge, not charged again",
                    );
                }
            }
            if record.completed_at_ms > call.died_at_ms {
                kill_to_completion.push(record.completed_at_ms - call.died_at_ms);
            } else {
                before_death += 1;
            }
        }
        let count_ends = |keep: &dyn Fn(&str, ChildEnd) -> bool| -> usize {
            ends.iter()
                .filter(|((point, end), _)| keep(point, *end))
                .map(|(_, n)| n)
                .sum()
        };
        let kills = count_ends(&|_, end| end == ChildEnd::Killed);
        let random_kills = count_ends(&|point, end| point == "random" && end == ChildEnd::Killed);
        kill_to_completion.sort_unstable();
        let (p50, p99, max) = match kill_to_completion.as_slice() {
            [] => (0, 0, 0),
            all => (percentile(all, 50), percentile(all, 99), all[all.len() - 1]),
        };
        let claimed = calls.len() - unclaimed;
        let total_payments: i64 = payments.values().map(|p| p.0).sum();
        let wrong_counts: BTreeMap<&str, usize> = wrong
            .iter()
            .map(|(claim, runs)| (*claim, runs.len()))
            .collect();
        println!(
            "R14 {name}: {} calls ({claimed} claimed, {unclaimed} failed at their claim), \
             {kills} SIGKILLs ({random_kills} random), ends {ends:?}; completer processes: {} \
             started, {} killed at random, {} crashed at a point, {} exited otherwise; when the killing stopped \
             {claimed_left} calls claimed / {stored_left} stored; payments by {writers:?}; \
             {taken_over} calls taken over by completers, {retaken} more than once ({} \
             attempts, at most {max_attempts} on a call, by outcome {outcomes:?}, taking p50 {} \
             ms, max {} ms); {gave_up} \
             given up ({refunds} refunds; {MAX_ATTEMPTS} attempts allowed); {gateway_total} \
             gateway calls for {charges} charges, {double_charges} double charges, \
             {total_payments} payments; {} leases unfinished, {still_claimed} calls claimed / \
             {still_stored} stored at the end; broken claims {wrong_counts:?}; kill to \
             completion (database clock, {} calls; {before_death} finished before their kill): \
             p50 {p50} ms, p99 {p99} ms, max {max} ms (lease {} ms, poll {} ms); calls {:.1} \
             s, then {:.1} s to the end, {:.1} s in all",
            calls.len(),
            chaos.started,
            chaos.killed,
            chaos.crashed,
            chaos.exited,
            attempts.values().sum::<i64>(),
            took.first()
                .map(|_| percentile(took, 50))
                .unwrap_or_default(),
            took.last().copied().unwrap_or_default(),
            unfinished.len(),
            kill_to_completion.len(),
            LEASE.as_millis(),
            POLL.as_millis(),
            (calls_done - started).as_secs_f64(),
            (finished_at - calls_done).as_secs_f64(),
            started.elapsed().as_secs_f64(),
        );
        assert!(
            ended,
            "{name}: calls did not all end within {bound:?} of the last completer's start: \
             {still_claimed} still claimed, {still_stored} stored, expired leases e.g. {:?}",
            unfinished
                .iter()
                .take(3)
                .map(|lease| &lease.key)
                .collect::<Vec<_>>()
        );
        assert_eq!(double_charges, 0, "{name}: double charges at the gateway");
        assert_eq!(
            charges, total_payments,
            "{name}: gateway charges and payments"
        );
        assert_eq!(unfinished.len(), 0, "{name}: leases left unfinished");
        assert_eq!(
            (still_claimed, still_stored),
            (0, 0),
            "{name}: calls left claimed / stored"
        );
        if let Some((claim, runs)) = wrong.iter().next() {
            panic!(
                "{name}: {claim}: {} calls, e.g. {:?}",
                runs.len(),
                &runs[..runs.len().min(3)]
            );
        }
        // The gateway never fails: nothing is given up (a give-up would be state 3, refunded
        // by the hook, and replayed to the client as `GaveUp`).
        assert_eq!(
            (gave_up, refunds),
            (0, 0),
            "{name}: calls given up / refunds"
        );
        assert_eq!(
            chaos.exited, 0,
            "{name}: a completer process exited on its own"
        );
        assert_eq!(
            count_ends(&|_, end| matches!(end, ChildEnd::Broke(_) | ChildEnd::Hung)),
            0,
            "{name}: a call child broke or hung: {ends:?}"
        );
        assert_eq!(
            count_ends(&|point, end| point != "random" && end == ChildEnd::Finished),
            0,
            "{name}: calls finished past their kill point: {ends:?}"
        );
        assert!(
            kills * 2 >= calls.len(),
            "{name}: only {kills} of {} calls were killed: {ends:?}",
            calls.len()
        );
        let cut_off = outcomes.get("cut off").map_or(0, |(n, _)| *n);
        assert!(
            chaos.killed >= 2 && chaos.crashed >= 1 && cut_off >= 1,
            "{name}: the completers were killed {} times, crashed {} times, and {cut_off} \
             attempts were cut off",
            chaos.killed,
            chaos.crashed
        );

        // A late client retry of every claimed key replays the recorded answer, and pays
        // nothing more.
        let client = Runner::resumed("client");
        for call in &calls {
            let Some(record) = records.get(&call.key()) else {
                continue;
            };
            let order = Order {
                key: call.key(),
                run: call.run.clone(),
            };
            let (answer, outcome) = with_outcome(pay(&db, &client, order)).await;
            assert_eq!(
                (outcome, answer.ok()),
                (Some(Outcome::Replayed), record.answer.clone()),
                "{name}: {}: the late retry replays the recorded answer",
                call.run
            );
        }
        let replays_paid = count(
            &db,
            "SELECT COUNT(*) FROM r14_payments WHERE writer = ?",
            vec!["client".into()],
        )
        .await;
        assert_eq!(replays_paid, 0, "{name}: the late retries paid again");
        println!(
            "R14 {name}: {claimed} late client retries, {claimed} replays of the recorded answer"
        );
    }
}
