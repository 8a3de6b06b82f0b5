//! `idem::testing`. Switching idem off for tests of a service (issue 29 item 6):
//! `idem::testing::run_disabled`, `disable` / `enable`, and `IDEM_DISABLED=1`. One test drives
//! the process-wide switch in order (tests of one binary run in parallel); the environment
//! variable is read once per process, so it is tried in a child process.
//!
//! The crash-point harness (issue 41 item 2), `idem::testing::CrashTest`: it passes handlers
//! whose effects idem protects (a step deduplicated downstream, writes in the claim's
//! transaction, the payments example's pay, with and without its completer, on every backend
//! of the run), and fails, naming the crash point, handlers whose effects it does not protect
//! (an effect outside `idem::step`, a step whose key the receiver ignores, an atomic body's
//! effect outside its transaction). The newsletter example's publish is crash-tested in the
//! example's own tests (`examples/newsletter/main.rs`).

mod common;
mod shop;

use std::collections::HashSet;
use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{connect, effects, insert_effect, prepare_with, sqlite_url, unique};
use idem::idempotent;
use idem::testing::{CrashPoint, CrashReport, CrashTest, Scenario};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use shop::app::{self, AppState, Gateway, PayRequest, PaymentView};
use shop::model;
use shop::service::ApiError;

#[idempotent(scope = "testing.pay", key = key, skip(runs))]
async fn pay(
    db: &DatabaseConnection,
    key: String,
    runs: &AtomicUsize,
) -> Result<usize, idem::Error> {
    insert_effect(db, &key, "pay", 1).await;
    Ok(runs.fetch_add(1, Ordering::SeqCst))
}

#[idempotent(scope = "testing.lease", key = key, lease = "1s", skip(runs))]
async fn pay_out(
    db: &DatabaseConnection,
    key: String,
    runs: &AtomicUsize,
) -> Result<String, idem::Error> {
    let sent: usize = idem::step("send", |_key| async {
        Ok::<_, idem::Error>(runs.fetch_add(1, Ordering::SeqCst))
    })
    .await?;
    idem::sea_orm::final_step(db, "record", move |tx| {
        Box::pin(async move {
            insert_effect(tx, &key, "pay-out", 1).await;
            Ok::<_, idem::Error>(format!("sent {sent}"))
        })
    })
    .await
}

/// A database with the effects table only: switched off, idem needs no table of its own.
async fn without_ledger() -> DatabaseConnection {
    let db = connect(&sqlite_url("idem-testing"), 1).await;
    db.execute_unprepared(
        "CREATE TABLE idem_test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, label TEXT NOT NULL, amount INTEGER NOT NULL)",
    )
    .await
    .expect("effects table");
    db
}

/// Two calls with the same key: how many times the body ran, counted in committed rows.
async fn two_calls(db: &DatabaseConnection) -> (i64, i64) {
    let (key, runs) = (unique("pay"), AtomicUsize::new(0));
    let _ = pay(db, key.clone(), &runs).await;
    let _ = pay(db, key.clone(), &runs).await;
    let (out, out_runs) = (unique("out"), AtomicUsize::new(0));
    let _ = pay_out(db, out.clone(), &out_runs).await;
    let _ = pay_out(db, out.clone(), &out_runs).await;
    (effects(db, &key).await, effects(db, &out).await)
}

/// Where the test's log lines go.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn warnings(&self) -> usize {
        String::from_utf8_lossy(&self.0.lock().expect("log"))
            .matches("idem is switched off")
            .count()
    }
}

/// A dispatcher that lives as long as the test process. While only one dispatcher exists,
/// tracing computes a callsite's interest with the default of whichever thread reaches it
/// first, so a concurrent test without a subscriber could switch the WARN off for this test's
/// scoped subscriber. With a second one registered, tracing asks every subscriber.
static SECOND_DISPATCHER: std::sync::LazyLock<tracing::Dispatch> = std::sync::LazyLock::new(|| {
    tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default())
});

/// Held for writing while a test switches idem off for the whole process, and for reading by
/// each crash test: a call that ran switched off would have no crash points, or fewer.
static PROCESS_SWITCH: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[tokio::test]
async fn the_switch_runs_every_retry_and_is_off_unless_asked() {
    std::sync::LazyLock::force(&SECOND_DISPATCHER);
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);

    // On by default: a retry replays, on a ledger as usual.
    let db = connect(&sqlite_url("idem-testing"), 1).await;
    prepare_with(
        &db,
        &["CREATE TABLE IF NOT EXISTS idem_test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, label TEXT NOT NULL, amount INTEGER NOT NULL)"],
    )
    .await;
    assert!(!idem::testing::is_disabled(), "not silently on");
    assert_eq!(two_calls(&db).await, (1, 1), "on: the retries replay");
    assert_eq!(log.warnings(), 0, "no warning while on");

    // Off for one future: both calls run, with no ledger table at all.
    let bare = without_ledger().await;
    let off = idem::testing::run_disabled(two_calls(&bare)).await;
    assert_eq!(off, (2, 2), "run_disabled: every call runs its body");
    assert_eq!(two_calls(&db).await, (1, 1), "on again after the future");

    // Off for the process, then on again: not while a crash test runs in this process.
    let switching = PROCESS_SWITCH.write().await;
    idem::testing::disable();
    assert_eq!(two_calls(&bare).await, (2, 2), "disable(): every call runs");
    idem::testing::enable();
    drop(switching);
    assert_eq!(two_calls(&db).await, (1, 1), "enable(): replays again");
    assert_eq!(log.warnings(), 1, "switched off: one WARN per process");

    // Switched off, a body's error still rolls its writes back.
    let key = unique("rollback");
    let failed = idem::testing::run_disabled(failing(&bare, key.clone())).await;
    assert!(failed.is_err());
    assert_eq!(effects(&bare, &key).await, 0, "the error rolled back");
}

#[idempotent(scope = "testing.fail", key = key)]
async fn failing(db: &DatabaseConnection, key: String) -> Result<(), idem::Error> {
    insert_effect(db, &key, "fail", 1).await;
    Err(idem::Error::Store {
        message: "the body failed".into(),
        source: None,
    })
}

#[tokio::test]
async fn idem_disabled_in_the_environment_switches_idem_off() {
    let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_with_idem_disabled",
            "--ignored",
            "--nocapture",
        ])
        .env(idem::testing::DISABLED_ENV, "1")
        .output()
        .expect("run the child");
    let out = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success(), "{out}");
    assert!(out.contains("1 passed"), "the child ran: {out}");
}

#[tokio::test]
#[ignore = "run by idem_disabled_in_the_environment_switches_idem_off, with IDEM_DISABLED=1"]
async fn child_with_idem_disabled() {
    assert!(
        idem::testing::is_disabled(),
        "IDEM_DISABLED=1 switches idem off"
    );
    let bare = without_ledger().await;
    assert_eq!(two_calls(&bare).await, (2, 2), "every call runs its body");
}

// ---- the crash-point harness ----

/// A receiver of a handler's effect outside the database (a mail relay, a gateway): what it
/// was asked, and the distinct effects it made when it deduplicates on the key it is sent.
#[derive(Debug, Default)]
struct Receiver {
    asked: AtomicU64,
    keys: Mutex<HashSet<String>>,
}

impl Receiver {
    /// Makes the effect once per `key`, as a receiver that deduplicates does.
    fn send_keyed(&self, key: &str) -> u64 {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let mut keys = self.keys.lock().expect("keys");
        keys.insert(key.to_owned());
        keys.len() as u64
    }

    /// Makes the effect every time it is asked.
    fn send(&self) -> u64 {
        self.asked.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The effects made: distinct keys, or every ask when none was keyed.
    fn effects(&self) -> u64 {
        let keyed = self.keys.lock().expect("keys").len() as u64;
        if keyed > 0 {
            keyed
        } else {
            self.asked.load(Ordering::SeqCst)
        }
    }
}

/// A run's state for the handlers on a `MemoryStore`: its key and its receiver.
type Mailing = (String, Receiver);

async fn mailing(scenario: &Scenario) -> Mailing {
    (scenario.key.clone(), Receiver::default())
}

async fn mailed((_, receiver): &Mailing) -> u64 {
    receiver.effects()
}

/// Right: the effect is a step, and the receiver deduplicates on the step's key.
#[idempotent(scope = "crash.mail.keyed", key = key, lease = "30s", skip(receiver))]
async fn mail_keyed(
    store: &idem::MemoryStore,
    receiver: &Receiver,
    key: String,
) -> Result<u64, idem::Error> {
    idem::step("send", |step_key| async move {
        Ok::<_, idem::Error>(receiver.send_keyed(&step_key))
    })
    .await
}

/// Wrong: the effect is done in the body, outside any step.
#[idempotent(scope = "crash.mail.unstepped", key = key, lease = "30s", skip(receiver))]
async fn mail_outside_a_step(
    store: &idem::MemoryStore,
    receiver: &Receiver,
    key: String,
) -> Result<u64, idem::Error> {
    let sent = receiver.send();
    let checked: bool = idem::step("check", |_key| async { Ok::<_, idem::Error>(true) }).await?;
    Ok(sent + u64::from(checked))
}

/// Wrong: the effect is a step, but the receiver is not sent the step's key.
#[idempotent(scope = "crash.mail.unkeyed", key = key, lease = "30s", skip(receiver))]
async fn mail_ignoring_the_step_key(
    store: &idem::MemoryStore,
    receiver: &Receiver,
    key: String,
) -> Result<u64, idem::Error> {
    idem::step("send", |_step_key| async {
        Ok::<_, idem::Error>(receiver.send())
    })
    .await
}

/// The crash points whose runs failed, as the report names them.
fn failed_points(report: &CrashReport) -> Vec<String> {
    report
        .failures()
        .map(|row| {
            row.crash
                .as_ref()
                .map_or("no crash".to_owned(), ToString::to_string)
        })
        .collect()
}

#[tokio::test]
async fn the_crash_test_passes_a_lease_handler_whose_effect_is_a_deduplicated_step() {
    let _on = PROCESS_SWITCH.read().await;
    let store = idem::MemoryStore::new();
    let report = CrashTest::new(
        mailing,
        async |(key, receiver): &Mailing| mail_keyed(&store, receiver, key.clone()).await,
        mailed,
    )
    .expect_effects(1)
    .run()
    .await;
    println!("{report}");
    report.assert_once();
    let points: Vec<CrashPoint> = report
        .points()
        .iter()
        .map(|row| row.crash.as_ref().expect("a crash").point)
        .collect();
    assert_eq!(
        points,
        [
            CrashPoint::AfterLeaseClaim,
            CrashPoint::BeforeStep,
            CrashPoint::StepNotRecorded,
            CrashPoint::AfterStep,
            CrashPoint::BeforeLeaseRecord,
        ]
    );
}

#[tokio::test]
async fn the_crash_test_fails_a_lease_handler_whose_effect_is_outside_a_step() {
    let _on = PROCESS_SWITCH.read().await;
    let store = idem::MemoryStore::new();
    let report = CrashTest::new(
        mailing,
        async |(key, receiver): &Mailing| mail_outside_a_step(&store, receiver, key.clone()).await,
        mailed,
    )
    .run()
    .await;
    println!("{report}");
    assert!(!report.passed());
    // Every crash after the send sends again on the retry.
    assert_eq!(
        failed_points(&report),
        [
            "lease: step `check`, before the step ran",
            "lease: step `check`, after the step ran, before it was recorded",
            "lease: step `check`, after the step was recorded",
            "lease: after the body, before the record",
        ]
    );
    let failure = &report.failures().next().expect("a failure").failures[0];
    assert_eq!(
        failure,
        "effects counted 2, a run without a crash counted 1"
    );
    let panic = std::panic::catch_unwind(|| report.assert_once()).expect_err("assert_once panics");
    let message = panic.downcast_ref::<String>().expect("a message");
    assert!(
        message.contains("FAILED: effects counted 2")
            && message.contains("lease: after the body, before the record"),
        "{message}"
    );
}

#[tokio::test]
async fn the_crash_test_fails_a_step_whose_key_the_receiver_ignores() {
    let _on = PROCESS_SWITCH.read().await;
    let store = idem::MemoryStore::new();
    let report = CrashTest::new(
        mailing,
        async |(key, receiver): &Mailing| {
            mail_ignoring_the_step_key(&store, receiver, key.clone()).await
        },
        mailed,
    )
    .run()
    .await;
    println!("{report}");
    // Only the crash between the send and its record sends twice: the step is not recorded,
    // so the next holder runs it again, and nothing downstream tells the two apart.
    assert_eq!(
        failed_points(&report),
        ["lease: step `send`, after the step ran, before it was recorded"]
    );
}

/// Right: the effect is a row written in the claim's transaction.
#[idempotent(scope = "crash.atomic.row", key = key)]
async fn write_a_row(db: &DatabaseConnection, key: String) -> Result<String, idem::Error> {
    insert_effect(db, &key, "row", 1).await;
    Ok(format!("wrote {key}"))
}

/// Wrong: besides its row, the body sends a message outside the transaction.
#[idempotent(scope = "crash.atomic.mail", key = key, skip(receiver))]
async fn write_a_row_and_mail(
    db: &DatabaseConnection,
    receiver: &Receiver,
    key: String,
) -> Result<String, idem::Error> {
    insert_effect(db, &key, "row", 1).await;
    receiver.send();
    Ok(format!("wrote {key}"))
}

#[tokio::test]
async fn the_crash_test_passes_an_atomic_handler_and_fails_one_with_an_effect_outside_its_transaction()
 {
    let _on = PROCESS_SWITCH.read().await;
    let db = connect(&sqlite_url("idem-crash"), 1).await;
    common::prepare(&db).await;
    let report = CrashTest::new(
        async |scenario: &Scenario| scenario.key.clone(),
        async |key: &String| write_a_row(&db, key.clone()).await,
        async |key: &String| effects(&db, key).await,
    )
    .expect_effects(1)
    .run()
    .await;
    println!("{report}");
    report.assert_once();
    assert_eq!(
        report.points().len(),
        3,
        "the claim, the record, the commit"
    );

    let report = CrashTest::new(
        mailing,
        async |(key, receiver): &Mailing| write_a_row_and_mail(&db, receiver, key.clone()).await,
        async |(key, receiver): &Mailing| (effects(&db, key).await, receiver.effects()),
    )
    .run()
    .await;
    println!("{report}");
    assert_eq!(
        failed_points(&report),
        [
            "atomic: after the body, before the record",
            "atomic: after the record, before the commit",
        ]
    );
    assert_eq!(
        report.failures().next().expect("a failure").failures[0],
        "effects counted (1, 2), a run without a crash counted (1, 1)"
    );
}

// ---- the payments example's pay under the harness ----

/// One run of a pay: the service's state (a gateway of the run's own), a pending order, and
/// the client's key.
struct PayRun {
    state: AppState,
    order: String,
    key: idem::axum::IdempotencyKey,
}

async fn pending_order(db: &DatabaseConnection, scenario: &Scenario) -> PayRun {
    let order = format!("ord_{}", scenario.key);
    model::insert_order(db, &order, "c-1", 1200)
        .await
        .expect("a pending order");
    PayRun {
        state: AppState {
            db: db.clone(),
            gateway: Gateway::default(),
        },
        order,
        key: idem::axum::IdempotencyKey::parse(scenario.key.as_bytes()).expect("a valid key"),
    }
}

async fn pay_order(run: &PayRun) -> Result<PaymentView, ApiError> {
    let request = PayRequest { amount_cents: 1200 };
    let PayRun { state, order, key } = run;
    app::pay(
        &state.db,
        &state.gateway,
        key.clone(),
        order.clone(),
        request,
    )
    .await
}

/// What a pay does to the world: charges at the gateway, payment rows, `shop.orders.paid`
/// messages staged in the outbox.
async fn paid(run: &PayRun) -> (usize, u64, i64) {
    let db = &run.state.db;
    let backend = db.get_database_backend();
    let staged = db
        .query_one_raw(sea_orm::Statement::from_sql_and_values(
            backend,
            idem::sea_orm::placeholders(
                backend,
                "SELECT COUNT(*) FROM idem_outbox WHERE aggregate_key = ?",
            ),
            [run.order.clone().into()],
        ))
        .await
        .expect("count the staged messages")
        .expect("a row")
        .try_get_by_index::<i64>(0)
        .expect("a count");
    let payments = model::payments_of(db, &run.order)
        .await
        .expect("count the payments");
    (run.state.gateway.charges(), payments, staged)
}

#[tokio::test]
async fn the_crash_test_of_the_payments_example_pay_passes_with_retries_and_with_its_completer() {
    let _on = PROCESS_SWITCH.read().await;
    for b in common::isolated::isolated().await {
        app::create_tables(&b.db).await.expect("the shop's tables");
        let db = &b.db;
        let by_retry = CrashTest::new(
            async |scenario: &Scenario| pending_order(db, scenario).await,
            pay_order,
            paid,
        )
        .expect_effects((1, 1, 1))
        .run()
        .await;
        println!("{}, finished by the retry: {by_retry}", b.name);
        by_retry.assert_once();
        // The claim; the charge's three; the final phase's three (`finish`: kept open for
        // the answer); the record, and its commit in the final phase's transaction.
        assert_eq!(by_retry.points().len(), 9, "{}: {by_retry}", b.name);

        let by_completer = CrashTest::new(
            async |scenario: &Scenario| pending_order(db, scenario).await,
            pay_order,
            paid,
        )
        .expect_effects((1, 1, 1))
        .completer(async |run: &PayRun| {
            app::completer(&run.state)
                .run_once()
                .await
                .expect("a completer round");
        })
        .run()
        .await;
        println!("{}, finished by the completer: {by_completer}", b.name);
        by_completer.assert_once();
        assert!(
            by_completer
                .points()
                .iter()
                .all(|row| row.outcome == Some(idem::Outcome::Replayed)),
            "{}: every retry replays the completer's answer: {by_completer}",
            b.name
        );
    }
}
