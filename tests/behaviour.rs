//! Atomic-mode semantics (DESIGN §2), on every backend of the run: each test counts the
//! handler's effects in the database.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// What most handlers do: write the call's effect (labelled `label`), and answer a receipt
/// of this execution.
async fn write_receipt<C: ConnectionTrait>(db: &C, cmd: &Pay, label: &str) -> Receipt {
    insert_effect(db, &cmd.run, label, cmd.amount).await;
    Receipt {
        amount: cmd.amount,
        execution: unique("exec"),
    }
}

#[idempotent(scope = "test.pay", key = cmd.key)]
async fn pay(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, PayError> {
    Ok(write_receipt(db, &cmd, "pay").await)
}

#[tokio::test]
async fn first_call_executes_and_a_retry_replays() {
    for b in backends().await {
        let run = unique("replay");
        let (first, first_outcome) = with_outcome(pay(&b.db, Pay::new(&run, 1200))).await;
        let (again, again_outcome) = with_outcome(pay(&b.db, Pay::new(&run, 1200))).await;
        let first = first.expect("first call");
        assert_eq!(first, again.expect("retry"), "{}", b.name);
        assert_eq!(first_outcome, Some(Outcome::Executed), "{}", b.name);
        assert_eq!(again_outcome, Some(Outcome::Replayed), "{}", b.name);
        b.assert_effects(&run, 1, "body ran once").await;
        assert_eq!(ledger_rows(&b.db, &format!("{run}-key")).await, 1);
    }
}

#[tokio::test]
async fn same_key_with_other_arguments_is_key_reused() {
    for b in backends().await {
        let run = unique("reused");
        let first = pay(&b.db, Pay::new(&run, 1200)).await.expect("first");
        let other = pay(&b.db, Pay::new(&run, 9900)).await.unwrap_err();
        assert_eq!(other.kind(), Some(ErrorKind::KeyReused), "{}", b.name);
        // The recorded result is untouched.
        let again = pay(&b.db, Pay::new(&run, 1200)).await.expect("replay");
        assert_eq!(first, again, "{}", b.name);
        b.assert_effects(&run, 1, "ran once").await;
    }
}

macro_rules! empty_value_handler {
    ($name:ident, $ty:ty, $value:expr) => {
        #[idempotent(scope = "test.empty", key = key, skip(runs))]
        async fn $name(
            db: &DatabaseConnection,
            key: String,
            runs: &AtomicUsize,
        ) -> Result<$ty, idem::Error> {
            let _ = db;
            runs.fetch_add(1, Ordering::SeqCst);
            Ok($value)
        }
    };
}
empty_value_handler!(unit_value, (), ());
empty_value_handler!(none_value, Option<u32>, None);
empty_value_handler!(zero_value, u64, 0);
empty_value_handler!(empty_vec, Vec<String>, Vec::new());
empty_value_handler!(empty_string, String, String::new());

#[tokio::test]
async fn empty_values_are_recorded_and_replayed() {
    for b in backends().await {
        let runs = AtomicUsize::new(0);
        let run = unique("empty");
        for round in 0..2 {
            unit_value(&b.db, format!("{run}-unit"), &runs)
                .await
                .expect("unit");
            assert_eq!(
                none_value(&b.db, format!("{run}-none"), &runs)
                    .await
                    .expect("none"),
                None
            );
            assert_eq!(
                zero_value(&b.db, format!("{run}-zero"), &runs)
                    .await
                    .expect("zero"),
                0
            );
            assert!(
                empty_vec(&b.db, format!("{run}-vec"), &runs)
                    .await
                    .expect("vec")
                    .is_empty()
            );
            assert_eq!(
                empty_string(&b.db, format!("{run}-str"), &runs)
                    .await
                    .expect("str"),
                ""
            );
            assert_eq!(
                runs.load(Ordering::SeqCst),
                5,
                "{} round {round}: bodies ran once",
                b.name
            );
        }
    }
}

#[idempotent(scope = "test.flaky", key = cmd.key, skip(fail))]
async fn flaky_pay(db: &DatabaseConnection, cmd: Pay, fail: bool) -> Result<Receipt, PayError> {
    let receipt = write_receipt(db, &cmd, "flaky").await;
    if fail {
        return Err(PayError::Flaky);
    }
    Ok(receipt)
}

#[tokio::test]
async fn a_transient_error_releases_the_key_and_rolls_back() {
    for b in backends().await {
        let run = unique("flaky");
        let failed = flaky_pay(&b.db, Pay::new(&run, 5), true).await;
        assert!(matches!(failed, Err(PayError::Flaky)), "{}", b.name);
        b.assert_effects(&run, 0, "write rolled back").await;
        assert_eq!(
            ledger_rows(&b.db, &format!("{run}-key")).await,
            0,
            "{}: key free",
            b.name
        );
        let retried = flaky_pay(&b.db, Pay::new(&run, 5), false).await;
        assert!(retried.is_ok(), "{}", b.name);
        b.assert_effects(&run, 1, "the retry ran").await;
    }
}

#[idempotent(scope = "test.declined", key = cmd.key, skip(runs))]
async fn declined_pay(
    db: &DatabaseConnection,
    cmd: Pay,
    runs: &AtomicUsize,
) -> Result<Receipt, PayError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(db, &cmd.run, "declined", cmd.amount).await;
    Err(PayError::Declined {
        reason: format!("card declined for {}", cmd.amount),
    })
}

#[tokio::test]
async fn a_final_error_is_recorded_and_replayed() {
    for b in backends().await {
        let run = unique("declined");
        let runs = AtomicUsize::new(0);
        let (first, outcome) = with_outcome(declined_pay(&b.db, Pay::new(&run, 7), &runs)).await;
        assert!(
            matches!(&first, Err(PayError::Declined { reason }) if reason == "card declined for 7")
        );
        assert_eq!(outcome, Some(Outcome::Executed));
        let (again, outcome) = with_outcome(declined_pay(&b.db, Pay::new(&run, 7), &runs)).await;
        assert!(
            matches!(&again, Err(PayError::Declined { reason }) if reason == "card declined for 7"),
            "{}: {again:?}",
            b.name
        );
        assert_eq!(outcome, Some(Outcome::Replayed), "{}", b.name);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{}: replayed without running",
            b.name
        );
        b.assert_effects(&run, 0, "the body's write rolled back")
            .await;
        assert_eq!(
            ledger_rows(&b.db, &format!("{run}-key")).await,
            1,
            "{}: error recorded",
            b.name
        );
    }
}

#[idempotent(scope = "test.slow", key = cmd.key, skip(pause))]
async fn slow_pay(db: &DatabaseConnection, cmd: Pay, pause: Duration) -> Result<Receipt, PayError> {
    let receipt = write_receipt(db, &cmd, "slow").await;
    tokio::time::sleep(pause).await;
    Ok(receipt)
}

#[tokio::test]
async fn a_dropped_call_leaves_nothing_behind() {
    for b in backends().await {
        let run = unique("dropped");
        let cancelled = tokio::time::timeout(
            Duration::from_millis(300),
            slow_pay(&b.db, Pay::new(&run, 3), Duration::from_secs(30)),
        )
        .await;
        assert!(cancelled.is_err(), "{}: the call was cut off", b.name);
        let retried = slow_pay(&b.db, Pay::new(&run, 3), Duration::ZERO).await;
        assert!(retried.is_ok(), "{}: {retried:?}", b.name);
        b.assert_effects(&run, 1, "exactly one effect").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_execute_once_and_agree() {
    for b in backends().await {
        let run = unique("storm");
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let db = b.db.clone();
            let cmd = Pay::new(&run, 640);
            tasks.spawn(async move { pay(&db, cmd).await });
        }
        let answers: Vec<Receipt> = tasks
            .join_all()
            .await
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{}: {e:?}", b.name)))
            .collect();
        assert_eq!(answers.len(), 64);
        assert!(
            answers.iter().all(|a| a == &answers[0]),
            "{}: 64 identical answers",
            b.name
        );
        b.assert_effects(&run, 1, "exactly one effect").await;
    }
}

#[idempotent(scope = "test.reject", key = cmd.key, on_concurrent = reject, skip(gate))]
async fn held_pay(db: &DatabaseConnection, cmd: Pay, gate: Gate) -> Result<Receipt, PayError> {
    write_then_hold(db, cmd, &gate).await
}

/// A body that writes its effect, then holds the claim at `gate` until released.
async fn write_then_hold<C: ConnectionTrait>(
    db: &C,
    cmd: Pay,
    gate: &Gate,
) -> Result<Receipt, PayError> {
    let receipt = write_receipt(db, &cmd, "held").await;
    gate.pass().await;
    Ok(receipt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reject_fails_fast_while_the_first_call_runs() {
    for b in backends().await {
        let run = unique("reject");
        let gate = Gate::default();
        let (db, cmd, held) = (b.db.clone(), Pay::new(&run, 1), gate.clone());
        let first = tokio::spawn(async move { held_pay(&db, cmd, held).await });
        gate.entered().await;
        let started = Instant::now();
        let (db, cmd) = (b.db.clone(), Pay::new(&run, 1));
        let duplicate = tokio::spawn(async move { held_pay(&db, cmd, Gate::default()).await });
        // In one process the duplicate meets the first call's single flight and is refused at
        // once on every backend (across processes SQLite, one writer, makes it wait).
        let second = duplicate.await.expect("join");
        let elapsed = started.elapsed();
        assert_eq!(
            second.unwrap_err().kind(),
            Some(ErrorKind::InFlight),
            "{}",
            b.name
        );
        assert!(
            elapsed < Duration::from_secs(2),
            "{}: rejected in {elapsed:?}",
            b.name
        );
        gate.release();
        first.await.expect("join").expect("first");
        b.assert_effects(&run, 1, "ran once").await;
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TenantPay {
    tenant: String,
    key: String,
    run: String,
}

#[idempotent(scope = "test.tenant", key = cmd.key, principal = cmd.tenant, skip(cmd))]
async fn tenant_pay(db: &DatabaseConnection, cmd: TenantPay) -> Result<String, idem::Error> {
    insert_effect(db, &cmd.run, &cmd.tenant, 1).await;
    Ok(format!("{} paid", cmd.tenant))
}

#[idempotent(scope = "test.other-scope", key = cmd.key)]
async fn other_scope_pay(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, PayError> {
    Ok(write_receipt(db, &cmd, "other").await)
}

#[tokio::test]
async fn principals_and_scopes_never_share_records() {
    for b in backends().await {
        let run = unique("isolation");
        let key = format!("{run}-shared");
        let call = |tenant: &str| TenantPay {
            tenant: tenant.to_owned(),
            key: key.clone(),
            run: run.clone(),
        };
        assert_eq!(
            tenant_pay(&b.db, call("acme")).await.expect("acme"),
            "acme paid"
        );
        assert_eq!(
            tenant_pay(&b.db, call("globex")).await.expect("globex"),
            "globex paid"
        );
        assert_eq!(
            tenant_pay(&b.db, call("acme")).await.expect("acme replay"),
            "acme paid"
        );
        b.assert_effects(&run, 2, "one execution per principal")
            .await;

        let scoped = unique("scopes");
        let a = pay(&b.db, Pay::new(&scoped, 1)).await.expect("pay");
        let o = other_scope_pay(&b.db, Pay::new(&scoped, 1))
            .await
            .expect("other scope");
        assert_ne!(a, o, "{}: another scope executes anew", b.name);
        b.assert_effects(&scoped, 2, "one execution per scope")
            .await;
    }
}

#[tokio::test]
async fn bad_keys_fail_before_any_database_work() {
    // No ledger table at all: any database work would be a store error instead.
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("db");
    let long = "k".repeat(256);
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
            pay(&db, cmd).await.unwrap_err().kind(),
            Some(expected),
            "{key:?}"
        );
    }
}

#[idempotent(scope = "test.optional", key = key)]
async fn optional_key(db: &DatabaseConnection, key: Option<String>) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(1)
}

#[tokio::test]
async fn an_absent_optional_key_is_missing_key() {
    let db = common::sqlite().await;
    assert_eq!(
        optional_key(&db, None).await.unwrap_err().kind(),
        ErrorKind::MissingKey
    );
    assert_eq!(
        optional_key(&db, Some(unique("k"))).await.expect("present"),
        1
    );
}

#[tokio::test]
async fn a_missing_ledger_table_names_the_fix() {
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("db");
    let err = pay(&db, Pay::new(&unique("noledger"), 1))
        .await
        .unwrap_err();
    let PayError::Idem(err) = err else {
        panic!("expected an idem error")
    };
    assert_eq!(err.kind(), ErrorKind::Store);
    assert!(err.to_string().contains("create_tables"), "{err}");
}

#[idempotent(scope = "test.decode", key = key)]
async fn decode_v1(db: &DatabaseConnection, key: String) -> Result<String, idem::Error> {
    let _ = db;
    Ok("version one".to_owned())
}

#[idempotent(scope = "test.decode", key = key)]
async fn decode_v2(db: &DatabaseConnection, key: String) -> Result<u64, idem::Error> {
    let _ = db;
    Ok(2)
}

#[tokio::test]
async fn a_record_that_no_longer_decodes_is_an_unreadable_answer() {
    for b in backends().await {
        let key = unique("decode");
        decode_v1(&b.db, key.clone()).await.expect("v1");
        let err = decode_v2(&b.db, key.clone()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AnswerUnreadable, "{}", b.name);
        assert_eq!(err.http_status(), 410);
        let message = err.to_string();
        // The key only by its hash: keys can carry user data.
        assert!(
            message.contains("test.decode") && !message.contains(&key),
            "{message}"
        );
    }
}

#[idempotent(scope = "test.expiry", key = cmd.key, ttl = "1s")]
async fn short_lived(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, PayError> {
    Ok(write_receipt(db, &cmd, "short").await)
}

#[tokio::test]
async fn an_expired_key_executes_anew_and_purge_removes_it() {
    for b in backends().await {
        let run = unique("expiry");
        let first = short_lived(&b.db, Pay::new(&run, 1)).await.expect("first");
        let replay = short_lived(&b.db, Pay::new(&run, 1)).await.expect("replay");
        assert_eq!(first, replay, "{}", b.name);
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let later = short_lived(&b.db, Pay::new(&run, 1))
            .await
            .expect("after expiry");
        assert_ne!(first, later, "{}: executed anew", b.name);
        b.assert_effects(&run, 2, "ran again after expiry").await;

        // Expire it again, keep a live record beside it, and purge.
        let live = unique("live");
        pay(&b.db, Pay::new(&live, 1)).await.expect("live");
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let deleted = idem::sea_orm::purge_expired(&b.db, 2).await.expect("purge");
        assert!(deleted >= 1, "{}", b.name);
        assert_purged(&b.db, b.name, &run, &live).await;
    }
}

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

#[tokio::test]
async fn a_stepped_purge_removes_every_expired_record_and_no_live_one() {
    for b in backends().await {
        let run = unique("sweep");
        let name = |kind: &str, i: usize| format!("{run}-{kind}{i}");
        for i in 0..12 {
            short_lived(&b.db, Pay::new(&name("e", i), 1))
                .await
                .expect("short-lived");
            pay(&b.db, Pay::new(&name("l", i), 1)).await.expect("live");
        }
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let mut purge = idem::sea_orm::ExpiredPurge::new();
        let mut steps = 0;
        while purge.step(&b.db, 3).await.expect("step").is_some() {
            steps += 1;
        }
        assert!(purge.is_finished(), "{}", b.name);
        // Three rows per statement: twelve expired records need at least four statements.
        assert!(steps >= 4, "{}: {steps} steps", b.name);
        assert!(purge.deleted() >= 12, "{}: {}", b.name, purge.deleted());
        for i in 0..12 {
            assert_purged(&b.db, b.name, &name("e", i), &name("l", i)).await;
        }
        assert_eq!(
            purge.step(&b.db, 3).await.expect("after"),
            None,
            "{}",
            b.name
        );
    }
}

#[tokio::test]
async fn a_sqlite_ledger_of_an_earlier_version_loses_its_index_and_keeps_working() {
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

struct Payments {
    db: DatabaseConnection,
}

impl Payments {
    #[idempotent(scope = "test.method", key = cmd.key, conn = self.db as db)]
    async fn pay(&self, cmd: Pay) -> Result<Receipt, PayError> {
        Ok(write_receipt(db, &cmd, "method").await)
    }
}

#[tokio::test]
async fn methods_take_the_connection_from_self() {
    for b in backends().await {
        let service = Payments { db: b.db.clone() };
        let run = unique("method");
        let first = service.pay(Pay::new(&run, 4)).await.expect("first");
        let again = service.pay(Pay::new(&run, 4)).await.expect("again");
        assert_eq!(first, again);
        b.assert_effects(&run, 1, "ran once").await;
    }
}

#[idempotent(scope = "test.bounded-wait", key = cmd.key, on_concurrent = wait("300ms"), skip(gate))]
async fn bounded_wait_pay(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Gate,
) -> Result<Receipt, PayError> {
    write_then_hold(db, cmd, &gate).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_past_its_bound_is_in_flight_then_the_retry_replays() {
    for b in backends().await {
        let run = unique("bounded");
        let gate = Gate::default();
        let (db, cmd, held) = (b.db.clone(), Pay::new(&run, 5), gate.clone());
        let first = tokio::spawn(async move { bounded_wait_pay(&db, cmd, held).await });
        gate.entered().await;
        let started = Instant::now();
        let duplicate = bounded_wait_pay(&b.db, Pay::new(&run, 5), Gate::default()).await;
        let waited = started.elapsed();
        assert_eq!(
            duplicate.unwrap_err().kind(),
            Some(ErrorKind::InFlight),
            "{}",
            b.name
        );
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
            "{}: waited {waited:?} for a 300 ms bound",
            b.name
        );
        gate.release();
        let first = first.await.expect("join").expect("first");
        let retry = bounded_wait_pay(&b.db, Pay::new(&run, 5), Gate::default()).await;
        assert_eq!(retry.expect("replay"), first, "{}", b.name);
        b.assert_effects(&run, 1, "ran once").await;
    }
}

/// PostgreSQL answers a replay from the claim statement's own snapshot: a completed record
/// is final until it expires, so the replay needs no row lock and is not held up by another
/// transaction that holds one (MySQL's claim locks the row; SQLite serialises writers).
#[tokio::test]
async fn a_replay_on_postgres_takes_no_row_lock() {
    for b in backends().await {
        if b.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            continue;
        }
        let run = unique("nolock");
        let first = pay(&b.db, Pay::new(&run, 700)).await.expect("first call");
        let blocker = sea_orm::TransactionTrait::begin(&b.db)
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
            with_outcome(pay(&b.db, Pay::new(&run, 700))),
        )
        .await
        .expect("the replay waited for the row lock");
        drop(blocker);
        assert_eq!(again.expect("replay"), first);
        assert_eq!(outcome, Some(Outcome::Replayed));
        assert_eq!(effects(&b.db, &run).await, 1, "body ran once");
    }
}

/// `create_tables` reads the catalogue and issues no DDL where the tables exist (on a
/// cluster even `CREATE TABLE IF NOT EXISTS` aborts commits cluster-wide). PostgreSQL proves
/// it: a read-only session refuses any DDL, existing table or not (SQLite and MariaDB let a
/// no-op `IF NOT EXISTS` through, so they cannot tell).
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
    }
}

/// Writes its effect, then panics while `panics` is set.
#[idempotent(scope = "test.panics", key = cmd.key, skip(panics))]
async fn pay_or_panic(
    db: &DatabaseConnection,
    panics: &std::sync::atomic::AtomicBool,
    cmd: Pay,
) -> Result<Receipt, PayError> {
    let receipt = write_receipt(db, &cmd, "panics").await;
    assert!(
        !panics.swap(false, Ordering::SeqCst),
        "the body panicked after its write"
    );
    Ok(receipt)
}

#[tokio::test]
async fn a_panic_in_an_atomic_body_rolls_back_and_frees_the_key() {
    for b in backends().await {
        let run = unique("panic");
        let panics = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (db, first, cmd) = (b.db.clone(), panics.clone(), Pay::new(&run, 1));
        let panicked = tokio::spawn(async move { pay_or_panic(&db, &first, cmd).await }).await;
        assert!(panicked.is_err_and(|e| e.is_panic()), "{}", b.name);
        b.assert_effects(&run, 0, "the panicked write rolled back")
            .await;
        let (retry, outcome) = with_outcome(pay_or_panic(&b.db, &panics, Pay::new(&run, 1))).await;
        assert!(retry.is_ok(), "{}: {retry:?}", b.name);
        assert_eq!(outcome, Some(Outcome::Executed), "{}", b.name);
        b.assert_effects(&run, 1, "the retry ran it once").await;
    }
}
