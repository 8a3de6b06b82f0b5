//! Answers that evolve (issue 29 item 4), on every backend of the run: a deploy is two
//! functions of one scope returning two versions of the answer type. A newer type upcasts
//! what the older one recorded (atomic and lease mode, values and final errors); an older
//! type meeting a newer answer is told to retry (503); a type changed without an upcast fails
//! the pre-deploy check, and its replays are 410, logged by key hash. Each test counts the
//! effect rows: a replay must not run the body again.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{Backend, backends, insert_effect, unique};
use idem::sea_orm::check_answers;
use idem::{ErrorKind, FinalError, Outcome, Versioned, idempotent, with_outcome};
use sea_orm::DatabaseConnection;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Version 1: what the service answered before the deploy.
#[derive(Debug, Serialize, Deserialize)]
struct ReceiptV1 {
    amount: i64,
}

/// Version 2: `amount` renamed `cents`, and a new required `currency`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    cents: i64,
    currency: String,
}

impl Versioned for Receipt {
    const VERSION: u32 = 2;
    fn upcast(from: u32, answer: Value) -> serde_json::Result<Value> {
        match from {
            1 => Ok(serde_json::json!({ "cents": answer["amount"], "currency": "EUR" })),
            _ => Ok(answer),
        }
    }
}

/// Version 2 again, deployed without the upcast: its records decode, older ones do not.
#[derive(Debug, Serialize, Deserialize)]
struct ReceiptNoUpcast {
    cents: i64,
    currency: String,
}

impl Versioned for ReceiptNoUpcast {
    const VERSION: u32 = 2;
}

// The deploy: the same scope before (`pay_v1`) and after (`pay_v2`) the type changed.

#[idempotent(scope = "answers.pay", key = key)]
async fn pay_v1(
    db: &DatabaseConnection,
    key: String,
    run: String,
) -> Result<ReceiptV1, idem::Error> {
    insert_effect(db, &run, "pay", 5).await;
    Ok(ReceiptV1 { amount: 5 })
}

#[idempotent(scope = "answers.pay", key = key, answer_version = 2)]
async fn pay_v2(db: &DatabaseConnection, key: String, run: String) -> Result<Receipt, idem::Error> {
    insert_effect(db, &run, "pay", 5).await;
    Ok(Receipt {
        cents: 5,
        currency: "EUR".to_owned(),
    })
}

#[idempotent(scope = "answers.pay", key = key)]
async fn pay_no_upcast(
    db: &DatabaseConnection,
    key: String,
    run: String,
) -> Result<ReceiptNoUpcast, idem::Error> {
    insert_effect(db, &run, "pay", 5).await;
    Ok(ReceiptNoUpcast {
        cents: 5,
        currency: "EUR".to_owned(),
    })
}

#[idempotent(scope = "answers.lease", key = key, lease = "1s")]
async fn lease_v1(
    db: &DatabaseConnection,
    key: String,
    run: String,
) -> Result<ReceiptV1, idem::Error> {
    insert_effect(db, &run, "lease", 5).await;
    Ok(ReceiptV1 { amount: 5 })
}

#[idempotent(scope = "answers.lease", key = key, lease = "1s")]
async fn lease_v2(
    db: &DatabaseConnection,
    key: String,
    run: String,
) -> Result<Receipt, idem::Error> {
    insert_effect(db, &run, "lease", 5).await;
    Ok(Receipt {
        cents: 5,
        currency: "EUR".to_owned(),
    })
}

/// A final error whose variant gained a required field in version 2.
#[derive(Debug, Serialize, Deserialize)]
enum RefusedV1 {
    #[serde(skip)]
    #[allow(dead_code)] // carries idem's errors; the tests only match the variant
    Idem(idem::Error),
    Declined {
        reason: String,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum Refused {
    #[serde(skip)]
    #[allow(dead_code)] // carries idem's errors; the tests only match the variant
    Idem(idem::Error),
    Declined {
        reason: String,
        code: u16,
    },
}

impl Versioned for Refused {
    const VERSION: u32 = 2;
    fn upcast(from: u32, mut answer: Value) -> serde_json::Result<Value> {
        if from == 1 {
            answer["Declined"]["code"] = 402.into();
        }
        Ok(answer)
    }
}

impl From<idem::Error> for RefusedV1 {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}
impl From<idem::Error> for Refused {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}
impl FinalError for RefusedV1 {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined { .. })
    }
}
impl FinalError for Refused {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined { .. })
    }
}

/// Bodies of `refuse_*` run: a final error rolls its writes back, so they are counted here.
static REFUSALS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "answers.refuse", key = key)]
async fn refuse_v1(db: &DatabaseConnection, key: String, run: String) -> Result<u8, RefusedV1> {
    REFUSALS.fetch_add(1, Ordering::SeqCst);
    insert_effect(db, &run, "refuse", 1).await;
    Err(RefusedV1::Declined {
        reason: "card declined".to_owned(),
    })
}

#[idempotent(scope = "answers.refuse", key = key)]
async fn refuse_v2(db: &DatabaseConnection, key: String, run: String) -> Result<u8, Refused> {
    REFUSALS.fetch_add(1, Ordering::SeqCst);
    insert_effect(db, &run, "refuse", 1).await;
    Err(Refused::Declined {
        reason: "card declined".to_owned(),
        code: 402,
    })
}

/// The start of the record id: what the logs and the errors name a key by.
fn key_hash(scope: &str, key: &str) -> String {
    let id = idem::store::record_id(scope, "", key);
    id[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn an_answer_type_changed_with_an_upcast_replays() {
    for b in backends().await {
        let (key, run) = (unique("up"), unique("up"));
        pay_v1(&b.db, key.clone(), run.clone())
            .await
            .expect("v1 executes");
        let (replay, outcome) = with_outcome(pay_v2(&b.db, key.clone(), run.clone())).await;
        let expected = Receipt {
            cents: 5,
            currency: "EUR".to_owned(),
        };
        assert_eq!(replay.expect("v2 reads v1"), expected, "{}", b.name);
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", b.name);
        // The new version records with its envelope and replays it too.
        let key2 = unique("up");
        pay_v2(&b.db, key2.clone(), run.clone())
            .await
            .expect("v2 executes");
        let again = pay_v2(&b.db, key2, run.clone()).await.expect("v2 replays");
        assert_eq!(again, expected, "{}", b.name);
        b.assert_effects(&run, 2, "one effect per key").await;
    }
}

#[tokio::test]
async fn an_answer_type_changed_with_an_upcast_replays_in_lease_mode() {
    for b in backends().await {
        let (key, run) = (unique("lease-up"), unique("lease-up"));
        lease_v1(&b.db, key.clone(), run.clone())
            .await
            .expect("v1 executes");
        let (replay, outcome) = with_outcome(lease_v2(&b.db, key.clone(), run.clone())).await;
        assert_eq!(replay.expect("v2 reads v1").cents, 5, "{}", b.name);
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", b.name);
        b.assert_effects(&run, 1, "the replay ran nothing").await;
    }
}

#[tokio::test]
async fn a_final_error_changed_with_an_upcast_replays() {
    for b in backends().await {
        let (key, run) = (unique("refuse"), unique("refuse"));
        let before = REFUSALS.load(Ordering::SeqCst);
        assert!(matches!(
            refuse_v1(&b.db, key.clone(), run.clone()).await,
            Err(RefusedV1::Declined { .. })
        ));
        let replay = refuse_v2(&b.db, key.clone(), run.clone()).await;
        assert!(
            matches!(replay, Err(Refused::Declined { code: 402, .. })),
            "{}: {replay:?}",
            b.name
        );
        let runs = REFUSALS.load(Ordering::SeqCst) - before;
        assert_eq!(runs, 1, "{}: the replay ran nothing", b.name);
        b.assert_effects(&run, 0, "a final error rolls its writes back")
            .await;
    }
}

/// Asserts `e` is the documented answer of an old process to a newer answer.
fn assert_too_new(b: &Backend, e: &idem::Error, scope: &str, key: &str) {
    assert_eq!(e.kind(), ErrorKind::AnswerTooNew, "{}: {e}", b.name);
    assert_eq!(e.http_status(), 503, "{}", b.name);
    let message = e.to_string();
    assert!(message.contains(&key_hash(scope, key)), "{message}");
    assert!(!message.contains(key), "never the key: {message}");
}

#[tokio::test]
async fn an_old_reader_meeting_a_newer_answer_is_told_to_retry() {
    for b in backends().await {
        // A new process answered first; the retry reaches a process not yet upgraded.
        let (key, run) = (unique("old"), unique("old"));
        pay_v2(&b.db, key.clone(), run.clone())
            .await
            .expect("v2 executes");
        let e = pay_v1(&b.db, key.clone(), run.clone()).await.unwrap_err();
        assert_too_new(&b, &e, "answers.pay", &key);
        // The client's next retry reaches a new process: the answer, not a second run.
        let replay = pay_v2(&b.db, key, run.clone()).await.expect("replays");
        assert_eq!(replay.cents, 5);
        b.assert_effects(&run, 1, "nothing ran again").await;

        let (key, run) = (unique("old-lease"), unique("old-lease"));
        lease_v2(&b.db, key.clone(), run.clone())
            .await
            .expect("v2 executes");
        let e = lease_v1(&b.db, key.clone(), run.clone()).await.unwrap_err();
        assert_too_new(&b, &e, "answers.lease", &key);
        b.assert_effects(&run, 1, "nothing ran again").await;
    }
}

#[tokio::test]
async fn an_answer_changed_without_an_upcast_fails_the_pre_deploy_check() {
    for b in backends().await {
        let run = unique("check");
        let keys = [unique("check"), unique("check")];
        for key in &keys {
            pay_v1(&b.db, key.clone(), run.clone())
                .await
                .expect("v1 executes");
        }
        // The check with the type about to be deployed without its upcast: red.
        let report = check_answers::<ReceiptNoUpcast, _>(&b.db, "answers.pay")
            .await
            .expect("check runs");
        assert!(!report.is_ok(), "{}: {report}", b.name);
        for key in &keys {
            let hash = key_hash("answers.pay", key);
            assert!(
                report.failures.iter().any(|f| f.key_hash == hash),
                "{}: {hash} reported in {report}",
                b.name
            );
        }
        let text = report.to_string();
        assert!(
            text.contains("upcast") && !text.contains(&keys[0]),
            "{text}"
        );
        // With the upcast: green, over at least the records just written.
        let report = check_answers::<Receipt, _>(&b.db, "answers.pay")
            .await
            .expect("check runs");
        assert!(
            report.is_ok() && report.checked >= 2,
            "{}: {report}",
            b.name
        );

        // Deployed anyway: the replay is its own problem (410), and still runs nothing.
        let e = pay_no_upcast(&b.db, keys[0].clone(), run.clone())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AnswerUnreadable, "{}: {e}", b.name);
        assert_eq!(e.http_status(), 410);
        b.assert_effects(&run, 2, "one effect per key, none from the failed replay")
            .await;
    }
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn an_unreadable_answer_is_logged_by_key_hash_never_the_key() {
    let db = common::sqlite().await;
    let captured = Captured::default();
    let writer = captured.clone();
    // Global, not `set_default`: tests running alongside would cache their callsites as
    // uninteresting to a thread-local subscriber. Their lines land here too, and never
    // hold this test's unique key.
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
    let (key, run) = (unique("log"), unique("log"));
    pay_v1(&db, key.clone(), run.clone()).await.expect("v1");
    pay_no_upcast(&db, key.clone(), run).await.unwrap_err();
    let log = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
    let hash = key_hash("answers.pay", &key);
    let line = log
        .lines()
        .find(|line| line.contains("WARN") && line.contains(&hash));
    let line = line.unwrap_or_else(|| panic!("no WARN line with key hash {hash} in {log}"));
    assert!(line.contains("no longer decodes"), "{line}");
    assert!(!log.contains(&key), "the raw key is logged: {log}");
}
