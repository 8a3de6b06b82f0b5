//! Nested calls (issue 29 item 6): an `#[idempotent]` function called with another one's body
//! `db` (its `&DatabaseTransaction`) claims its key in a savepoint of that transaction, so
//! both commit or neither; called through the pool inside a body, it fails at once with a
//! clear error. Every test counts effect rows, on every backend of the run.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{backends, insert_effect, ledger_rows, unique};
use idem::{ErrorKind, FinalError, idempotent};
use sea_orm::{DatabaseConnection, DatabaseExecutor, DatabaseTransaction};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    key: String,
    run: String,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum ShopError {
    #[serde(skip)]
    Idem(idem::Error),
    Declined,
    /// Transient: rolls the call back, a retry runs again.
    Flaky,
}

impl From<idem::Error> for ShopError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl FinalError for ShopError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined)
    }
}

impl ShopError {
    fn kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Idem(e) => Some(e.kind()),
            _ => None,
        }
    }
}

/// The inner call: takes the outer body's transaction. `decline` makes it a final error
/// (recorded; its writes rolled back to its savepoint).
#[idempotent(scope = "nested.charge", key = cmd.key, skip(runs, decline))]
async fn charge(
    db: &DatabaseTransaction,
    cmd: Charge,
    runs: &AtomicUsize,
    decline: bool,
) -> Result<i64, ShopError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(db, &cmd.run, "charge", cmd.amount).await;
    if decline {
        return Err(ShopError::Declined);
    }
    Ok(cmd.amount)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Checkout {
    key: String,
    run: String,
    charge: Charge,
}

impl Checkout {
    fn new(run: &str, charge_key: &str) -> Self {
        Self {
            key: format!("{run}-checkout"),
            run: run.to_owned(),
            charge: Charge {
                key: charge_key.to_owned(),
                run: run.to_owned(),
                amount: 7,
            },
        }
    }
}

/// What the outer body does after its inner call.
#[derive(Debug, Clone, Copy)]
enum Then {
    Succeed,
    /// A transient error: the whole call rolls back.
    FailOnce,
    /// The inner call with the same key again, in the same body.
    ChargeAgain,
}

/// The outer call: writes its own effect, charges through its own transaction, then `then`.
#[idempotent(scope = "nested.checkout", key = cmd.key, skip(runs, fails, then, decline))]
async fn checkout(
    db: &DatabaseConnection,
    cmd: Checkout,
    runs: &AtomicUsize,
    fails: &AtomicUsize,
    then: Then,
    decline: bool,
) -> Result<String, ShopError> {
    insert_effect(db, &cmd.run, "checkout", 1).await;
    let charged = charge(db, cmd.charge.clone(), runs, decline).await;
    match then {
        Then::FailOnce if fails.fetch_add(1, Ordering::SeqCst) == 0 => {
            return Err(ShopError::Flaky);
        }
        Then::ChargeAgain => {
            let again = charge(db, cmd.charge.clone(), runs, decline).await;
            assert_eq!(
                format!("{charged:?}"),
                format!("{again:?}"),
                "the same answer"
            );
        }
        _ => {}
    }
    Ok(match charged {
        Ok(amount) => format!("charged {amount}"),
        Err(ShopError::Declined) => "declined".to_owned(),
        Err(e) => return Err(e),
    })
}

/// Counts `run`'s committed effect rows labelled `label`.
async fn labelled(db: &DatabaseConnection, run: &str, label: &str) -> i64 {
    use sea_orm::{ConnectionTrait, Statement};
    let backend = db.get_database_backend();
    let sql = idem::sea_orm::placeholders(
        backend,
        "SELECT COUNT(*) FROM idem_test_effects WHERE run_id = ? AND label = ?",
    );
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            sql,
            [run.into(), label.into()],
        ))
        .await
        .expect("count")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("count")
}

#[tokio::test]
async fn a_nested_call_commits_with_its_outer_call() {
    for b in backends().await {
        let run = unique("nest-ok");
        let key = format!("{run}-charge");
        let (runs, fails) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let cmd = Checkout::new(&run, &key);
        let first = checkout(&b.db, cmd.clone(), &runs, &fails, Then::Succeed, false).await;
        assert_eq!(first.expect("first"), "charged 7", "{}", b.name);
        let again = checkout(&b.db, cmd, &runs, &fails, Then::Succeed, false).await;
        assert_eq!(again.expect("replay"), "charged 7", "{}", b.name);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}: charged once", b.name);
        assert_eq!(labelled(&b.db, &run, "charge").await, 1, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "checkout").await, 1, "{}", b.name);
        assert_eq!(
            ledger_rows(&b.db, &key).await,
            1,
            "{}: inner record",
            b.name
        );
    }
}

#[tokio::test]
async fn an_outer_call_failing_after_its_nested_call_commits_neither_and_a_retry_runs_both_once() {
    for b in backends().await {
        let run = unique("nest-fail");
        let key = format!("{run}-charge");
        let (runs, fails) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let cmd = Checkout::new(&run, &key);
        let failed = checkout(&b.db, cmd.clone(), &runs, &fails, Then::FailOnce, false).await;
        assert!(
            matches!(failed, Err(ShopError::Flaky)),
            "{}: {failed:?}",
            b.name
        );
        assert_eq!(labelled(&b.db, &run, "charge").await, 0, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "checkout").await, 0, "{}", b.name);
        assert_eq!(
            ledger_rows(&b.db, &key).await,
            0,
            "{}: inner key free",
            b.name
        );
        let retried = checkout(&b.db, cmd, &runs, &fails, Then::FailOnce, false).await;
        assert_eq!(retried.expect("retry"), "charged 7", "{}", b.name);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "{}: ran on each try",
            b.name
        );
        assert_eq!(labelled(&b.db, &run, "charge").await, 1, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "checkout").await, 1, "{}", b.name);
    }
}

#[tokio::test]
async fn a_nested_call_replays_inside_its_body_and_in_another_outer_call() {
    for b in backends().await {
        let run = unique("nest-replay");
        let key = format!("{run}-charge");
        let (runs, fails) = (AtomicUsize::new(0), AtomicUsize::new(0));
        // The same inner key twice in one body: the second replays the first, uncommitted.
        let cmd = Checkout::new(&run, &key);
        let first = checkout(&b.db, cmd.clone(), &runs, &fails, Then::ChargeAgain, false).await;
        assert_eq!(first.expect("first"), "charged 7", "{}", b.name);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}", b.name);
        // Another outer call (new key) reaching the same inner key replays it.
        let mut other = cmd.clone();
        other.key = format!("{run}-checkout-2");
        let second = checkout(&b.db, other.clone(), &runs, &fails, Then::Succeed, false).await;
        assert_eq!(second.expect("second"), "charged 7", "{}", b.name);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}: inner replayed", b.name);
        assert_eq!(labelled(&b.db, &run, "charge").await, 1, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "checkout").await, 2, "{}", b.name);
        // Other arguments under the inner key: KeyReused, as at top level, and the outer
        // call's error rolls its own writes back.
        other.key = format!("{run}-checkout-3");
        other.charge.amount = 8;
        let reused = checkout(&b.db, other, &runs, &fails, Then::Succeed, false).await;
        assert_eq!(
            reused.unwrap_err().kind(),
            Some(ErrorKind::KeyReused),
            "{}",
            b.name
        );
        assert_eq!(labelled(&b.db, &run, "checkout").await, 2, "{}", b.name);
    }
}

#[tokio::test]
async fn a_nested_final_error_undoes_only_the_inner_writes_and_replays() {
    for b in backends().await {
        let run = unique("nest-final");
        let key = format!("{run}-charge");
        let (runs, fails) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let cmd = Checkout::new(&run, &key);
        let first = checkout(&b.db, cmd.clone(), &runs, &fails, Then::Succeed, true).await;
        assert_eq!(first.expect("outer commits"), "declined", "{}", b.name);
        assert_eq!(
            labelled(&b.db, &run, "charge").await,
            0,
            "{}: undone",
            b.name
        );
        assert_eq!(
            labelled(&b.db, &run, "checkout").await,
            1,
            "{}: kept",
            b.name
        );
        assert_eq!(
            ledger_rows(&b.db, &key).await,
            1,
            "{}: error recorded",
            b.name
        );
        // Another outer call meets the recorded final error without running the inner body.
        let mut other = cmd;
        other.key = format!("{run}-checkout-2");
        let again = checkout(&b.db, other, &runs, &fails, Then::Succeed, true).await;
        assert_eq!(again.expect("second"), "declined", "{}", b.name);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{}: replayed", b.name);
    }
}

/// The inner call reached through the pool, not the body's transaction.
#[idempotent(scope = "nested.pooled", key = cmd.key)]
async fn pooled_charge(db: &DatabaseConnection, cmd: Charge) -> Result<i64, ShopError> {
    insert_effect(db, &cmd.run, "pooled", cmd.amount).await;
    Ok(cmd.amount)
}

#[idempotent(scope = "nested.pool-outer", key = cmd.key, skip(pool))]
async fn checkout_via_pool(
    db: &DatabaseConnection,
    pool: &DatabaseConnection,
    cmd: Checkout,
) -> Result<String, ShopError> {
    insert_effect(db, &cmd.run, "checkout", 1).await;
    let charged = pooled_charge(pool, cmd.charge.clone()).await?;
    Ok(format!("charged {charged}"))
}

#[tokio::test]
async fn a_call_through_the_pool_inside_a_body_is_a_clear_error_at_once() {
    for b in backends().await {
        let run = unique("nest-pool");
        let key = format!("{run}-charge");
        let cmd = Checkout::new(&run, &key);
        for attempt in 0..2 {
            let started = Instant::now();
            let err = checkout_via_pool(&b.db, &b.db, cmd.clone())
                .await
                .unwrap_err();
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{}: at once",
                b.name
            );
            let ShopError::Idem(e) = &err else {
                panic!("{}: {err:?}", b.name)
            };
            assert_eq!(e.kind(), ErrorKind::Store, "{} try {attempt}: {e}", b.name);
            assert!(
                e.to_string().contains("pass the body's `db`"),
                "{}: says what to do: {e}",
                b.name
            );
        }
        assert_eq!(labelled(&b.db, &run, "pooled").await, 0, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "checkout").await, 0, "{}", b.name);
        assert_eq!(ledger_rows(&b.db, &key).await, 0, "{}", b.name);
        // Outside any body the pool is the way in.
        assert_eq!(
            pooled_charge(&b.db, cmd.charge).await.expect("top level"),
            7
        );
    }
}

/// One function for both places: its connection is SeaORM's `DatabaseExecutor`.
#[idempotent(scope = "nested.either", key = cmd.key)]
async fn charge_either(db: &DatabaseExecutor<'_>, cmd: Charge) -> Result<i64, ShopError> {
    insert_effect(db, &cmd.run, "either", cmd.amount).await;
    Ok(cmd.amount)
}

#[idempotent(scope = "nested.either-outer", key = key, skip(fail))]
async fn outer_either(
    db: &DatabaseConnection,
    key: String,
    cmd: Charge,
    fail: bool,
) -> Result<i64, ShopError> {
    let charged = charge_either(&db.into(), cmd).await?;
    if fail {
        return Err(ShopError::Flaky);
    }
    Ok(charged)
}

#[tokio::test]
async fn a_database_executor_connection_works_at_the_top_and_nested() {
    for b in backends().await {
        let run = unique("nest-either");
        let cmd = |key: &str| Charge {
            key: format!("{run}-{key}"),
            run: run.clone(),
            amount: 3,
        };
        let top = charge_either(&(&b.db).into(), cmd("top")).await;
        assert_eq!(top.expect("top level"), 3, "{}", b.name);
        let failed = outer_either(&b.db, format!("{run}-o1"), cmd("in"), true).await;
        assert!(matches!(failed, Err(ShopError::Flaky)), "{}", b.name);
        assert_eq!(
            labelled(&b.db, &run, "either").await,
            1,
            "{}: rolled back",
            b.name
        );
        let nested = outer_either(&b.db, format!("{run}-o1"), cmd("in"), false).await;
        assert_eq!(nested.expect("nested"), 3, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "either").await, 2, "{}", b.name);
    }
}

/// A charge that, when `hang` says so, never finishes after its write: its caller gives up
/// on it (a timeout), which drops it mid-body.
#[idempotent(scope = "nested.hanging", key = cmd.key, skip(hang, runs))]
async fn hanging_charge(
    db: &DatabaseExecutor<'_>,
    cmd: Charge,
    hang: bool,
    runs: &AtomicUsize,
) -> Result<i64, ShopError> {
    runs.fetch_add(1, Ordering::SeqCst);
    insert_effect(db, &cmd.run, "charge", cmd.amount).await;
    if hang {
        std::future::pending::<()>().await;
    }
    Ok(cmd.amount)
}

/// An order that gives up on its nested charge after 100 ms, writes once more and answers.
#[idempotent(scope = "nested.gives-up", key = key, skip(inner, runs))]
async fn order_giving_up_on_its_charge(
    db: &DatabaseConnection,
    key: String,
    run: String,
    inner: Charge,
    runs: &AtomicUsize,
) -> Result<i64, ShopError> {
    insert_effect(db, &run, "order", 1).await;
    let executor = db.into();
    let charge = hanging_charge(&executor, inner, true, runs);
    let gave_up = tokio::time::timeout(Duration::from_millis(100), charge)
        .await
        .is_err();
    assert!(gave_up, "the hanging charge finished");
    insert_effect(db, &run, "after", 1).await;
    Ok(0)
}

/// A nested call cut off mid-body (a timeout, a `select!`) leaves nothing in the outer
/// commit: neither its write nor its claim, so the key runs again when called again.
#[tokio::test]
async fn a_nested_call_dropped_mid_body_leaves_nothing_in_the_outer_commit() {
    for b in backends().await {
        let run = unique("nest-dropped");
        let runs = AtomicUsize::new(0);
        let inner = Charge {
            key: format!("{run}-charge"),
            run: run.clone(),
            amount: 4,
        };
        let answered = order_giving_up_on_its_charge(
            &b.db,
            format!("{run}-order"),
            run.clone(),
            inner.clone(),
            &runs,
        )
        .await;
        assert!(matches!(answered, Ok(0)), "{}: {answered:?}", b.name);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{}: the charge started",
            b.name
        );
        assert_eq!(labelled(&b.db, &run, "order").await, 1, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "after").await, 1, "{}", b.name);
        assert_eq!(
            labelled(&b.db, &run, "charge").await,
            0,
            "{}: the dropped charge's write was undone",
            b.name
        );
        // Its claim was undone too: called again, the charge runs (a pending record committed
        // with the order would answer `InFlight` until its TTL).
        let charged = hanging_charge(&(&b.db).into(), inner, false, &runs).await;
        assert!(matches!(charged, Ok(4)), "{}: {charged:?}", b.name);
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{}", b.name);
        assert_eq!(labelled(&b.db, &run, "charge").await, 1, "{}", b.name);
    }
}
