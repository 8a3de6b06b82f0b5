//! Switching idem off for tests of a service (issue 29 item 6): `idem::testing::run_disabled`,
//! `disable` / `enable`, and `IDEM_DISABLED=1`. One test drives the process-wide switch in
//! order (tests of one binary run in parallel); the environment variable is read once per
//! process, so it is tried in a child process.

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{connect, effects, insert_effect, prepare_with, sqlite_url, unique};
use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection};

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

    // Off for the process, then on again.
    idem::testing::disable();
    assert_eq!(two_calls(&bare).await, (2, 2), "disable(): every call runs");
    idem::testing::enable();
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
