//! The deferred `BEGIN` (docs/plans/driver-port.md §3.9): a transaction's `BEGIN` goes out
//! with its first statement, in one flight. What must hold: the first statement and every
//! later one run inside the transaction; a transaction dropped before its first statement
//! sends nothing; one dropped with its first flight unanswered leaves the connection outside
//! any transaction; a body lent before any statement of idem's (idem switched off, a final
//! phase outside a lease) runs inside the transaction. Needs `IDEM_TEST_POSTGRES_URL`; skipped
//! without it.

use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use deadpool_postgres::{Manager, Pool, Runtime};
use idem_core::Store;
use idem_sql::{Begin, Bound, Connection, Driver, Transaction};
use idem_tokio_postgres::{TokioPostgres, TokioPostgresStore, tokio_postgres};

/// A pool of one connection, so every check meets the connection the test used; `None`
/// without a server to test on.
fn one_connection() -> Option<Pool> {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL").ok()?;
    let config: tokio_postgres::Config = url.parse().expect("a PostgreSQL URL");
    let manager = Manager::new(config, tokio_postgres::NoTls);
    let pool = Pool::builder(manager)
        .max_size(1)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(5)))
        .build()
        .expect("a pool");
    Some(pool)
}

/// Whether the pooled connection is inside a transaction begun before its next statement.
async fn in_transaction(pool: &Pool) -> bool {
    tokio::time::sleep(Duration::from_millis(5)).await;
    began_earlier(&pool.get().await.expect("the connection")).await
}

/// Whether `client` is inside a transaction begun before this check: a transaction's `now()`
/// is its start, earlier than the statement's own timestamp (on the simple protocol, outside
/// a transaction, the statement's implicit one starts with it).
async fn began_earlier(client: &tokio_postgres::Client) -> bool {
    let rows = client
        .simple_query("SELECT now() < statement_timestamp()")
        .await
        .expect("the check");
    let row = rows.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
        _ => None,
    });
    row.as_deref() == Some("t")
}

/// A connection of its own, to watch the pooled one from.
async fn other_client() -> tokio_postgres::Client {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL").expect("a server");
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("a second connection");
    tokio::spawn(connection);
    client
}

/// The last statement the server saw from `pid`, once that backend is idle (up to 2 s).
async fn last_seen(other: &tokio_postgres::Client, pid: i32) -> (String, String) {
    for _ in 0..200 {
        let row = other
            .query_one(
                "SELECT coalesce(state, ''), coalesce(query, '') FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity");
        let (state, query): (String, String) = (row.get(0), row.get(1));
        if state != "active" {
            return (state, query);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("backend {pid} stayed active")
}

async fn backend_pid(pool: &Pool) -> i32 {
    let client = pool.get().await.expect("the connection");
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

fn statement(sql: &'static str) -> Bound<'static> {
    Bound::unbound(sql)
}

#[tokio::test]
async fn a_transaction_that_ran_no_statement_sends_nothing() {
    let Some(pool) = one_connection() else { return };
    let driver = TokioPostgres::from(&pool);
    let other = other_client().await;
    let pid = backend_pid(&pool).await;
    // Dropped, committed, rolled back: no `BEGIN` went out, so nothing follows it either.
    drop(driver.begin(Begin::Write).await.expect("begin"));
    driver
        .begin(Begin::Write)
        .await
        .expect("begin")
        .commit()
        .await
        .expect("commit");
    let tx = driver.begin(Begin::Snapshot).await.expect("begin");
    tx.rollback().await.expect("rollback");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        last_seen(&other, pid).await,
        ("idle".to_owned(), "SELECT pg_backend_pid()".to_owned())
    );
}

#[tokio::test]
async fn the_first_statement_carries_the_begin_and_every_statement_runs_inside() {
    let Some(pool) = one_connection() else { return };
    let driver = TokioPostgres::from(&pool);
    for keep in [false, true] {
        let mut tx = driver.begin(Begin::Write).await.expect("begin");
        tx.execute_unprepared("CREATE TEMP TABLE IF NOT EXISTS pipelined (x int)")
            .await
            .expect("the first statement");
        tokio::time::sleep(Duration::from_millis(5)).await;
        let selected = tx
            .execute(statement("SELECT 1 WHERE now() < statement_timestamp()"))
            .await
            .expect("a later statement");
        assert_eq!(selected, 1, "a later statement runs in the transaction");
        let inside = began_earlier(TokioPostgres::body(&mut tx)).await;
        assert!(inside, "the body's statement runs in the transaction");
        if keep {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        assert!(!in_transaction(&pool).await, "the transaction ended");
        let client = pool.get().await.expect("the connection");
        let exists: bool = client
            .query_one("SELECT to_regclass('pg_temp.pipelined') IS NOT NULL", &[])
            .await
            .expect("the table's check")
            .get(0);
        assert_eq!(exists, keep, "committed: kept; rolled back: gone");
        client
            .batch_execute("DROP TABLE IF EXISTS pg_temp.pipelined")
            .await
            .expect("drop");
    }
}

#[tokio::test]
async fn a_transaction_dropped_with_its_first_flight_unanswered_leaves_the_connection_clean() {
    let Some(pool) = one_connection() else { return };
    let driver = TokioPostgres::from(&pool);
    let other = other_client().await;
    let pid = backend_pid(&pool).await;
    // Polled once (the `BEGIN` and the statement queued, no answer read), then after the
    // `BEGIN` answered while the statement still runs.
    for waited in [None, Some(Duration::from_millis(30))] {
        let mut tx = driver.begin(Begin::Write).await.expect("begin");
        {
            let first = tx.execute(statement("SELECT pg_sleep(0.1)"));
            match waited {
                None => {
                    let first = pin!(first);
                    let polled = first.poll(&mut Context::from_waker(Waker::noop()));
                    assert!(matches!(polled, Poll::Pending));
                }
                Some(wait) => {
                    assert!(tokio::time::timeout(wait, first).await.is_err());
                }
            }
        }
        drop(tx);
        assert!(
            !in_transaction(&pool).await,
            "dropped after {waited:?}: the connection is outside any transaction"
        );
        let (state, _) = last_seen(&other, pid).await;
        assert_eq!(state, "idle", "dropped after {waited:?}");
    }
}

#[tokio::test]
async fn a_body_lent_before_any_statement_of_idem_runs_inside_the_transaction() {
    let Some(pool) = one_connection() else { return };
    let store = TokioPostgresStore::new(&pool);
    // idem switched off: the body is lent right after the transaction begins.
    for keep in [false, true] {
        let mut claimed = store.begin().await.expect("begin");
        {
            let client = TokioPostgresStore::tx(&mut claimed);
            client
                .batch_execute("CREATE TEMP TABLE IF NOT EXISTS lent (x int)")
                .await
                .expect("the body's first statement");
            tokio::time::sleep(Duration::from_millis(5)).await;
            let inside = began_earlier(client).await;
            assert!(inside, "the body runs inside the transaction");
        }
        if keep {
            store.commit(claimed).await.expect("commit");
        } else {
            store.release(claimed).await.expect("release");
        }
        let client = pool.get().await.expect("the connection");
        let exists: bool = client
            .query_one("SELECT to_regclass('pg_temp.lent') IS NOT NULL", &[])
            .await
            .expect("the table's check")
            .get(0);
        assert_eq!(exists, keep, "committed: kept; rolled back: gone");
        client
            .batch_execute("DROP TABLE IF EXISTS pg_temp.lent")
            .await
            .expect("drop");
    }
    // A final phase outside a lease (idem switched off): its writes are lent the transaction
    // at once; failing, they leave nothing.
    let failed: Result<(), idem_core::Error> =
        idem_core::testing::run_disabled(idem_tokio_postgres::final_step(&pool, "lent", |tx| {
            Box::pin(async move {
                tx.batch_execute("CREATE TEMP TABLE lent_in_phase (x int)")
                    .await
                    .expect("the writes' statement");
                Err(idem_core::Error::store(
                    "the writes failed",
                    std::io::Error::other("no"),
                ))
            })
        }))
        .await;
    assert!(failed.is_err());
    assert!(!in_transaction(&pool).await);
    let client = pool.get().await.expect("the connection");
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('pg_temp.lent_in_phase') IS NOT NULL",
            &[],
        )
        .await
        .expect("the table's check")
        .get(0);
    assert!(
        !exists,
        "the failed writes rolled back with their transaction"
    );
}

#[tokio::test]
async fn the_record_goes_out_with_its_commit_and_a_lost_claim_rolls_back() {
    let Some(pool) = one_connection() else { return };
    idem_tokio_postgres::create_tables(&pool, &[idem_tokio_postgres::Family::Ledger])
        .await
        .expect("the ledger");
    let driver = TokioPostgres::from(&pool);
    let ledger = &idem_sql::Sql::common(idem_sql::Dialect::Postgres).ledger;
    for lost in [true, false] {
        let id = format!("pipelining-{}-{lost}", std::process::id()).into_bytes();
        let row = idem_sql::NewRecord {
            id: id.clone(),
            scope: "test.pipelining".to_owned(),
            principal: String::new(),
            key: format!("{lost}"),
            owner: 7,
            fingerprint: vec![0; 32],
            ttl_ms: 60_000,
        };
        let mut tx = driver.begin(Begin::Write).await.expect("begin");
        tx.execute(ledger.claim(&row)).await.expect("the claim");
        tx.execute_unprepared("CREATE TEMP TABLE written_by_the_body (x int)")
            .await
            .expect("the body's write");
        let recorded_by = idem_sql::NewRecord {
            owner: if lost { 8 } else { 7 },
            ..row.clone()
        };
        let record = ledger
            .record_or_fail(&recorded_by, 1, b"answer")
            .expect("PostgreSQL's record fails when lost");
        let recorded = tx.commit_after(record).await;
        assert!(!in_transaction(&pool).await, "lost: {lost}");
        let client = pool.get().await.expect("the connection");
        let (written, state): (bool, Option<i16>) = {
            let written = client
                .query_one(
                    "SELECT to_regclass('pg_temp.written_by_the_body') IS NOT NULL",
                    &[],
                )
                .await
                .expect("the body's check")
                .get(0);
            let state = client
                .query_opt("SELECT state FROM idem_ledger WHERE id = $1", &[&id])
                .await
                .expect("the ledger's check")
                .map(|row| row.get(0));
            (written, state)
        };
        client
            .batch_execute("DROP TABLE IF EXISTS pg_temp.written_by_the_body")
            .await
            .expect("drop");
        client
            .execute("DELETE FROM idem_ledger WHERE id = $1", &[&id])
            .await
            .expect("clean");
        if lost {
            let error = match recorded.expect_err("a lost claim fails the record") {
                idem_tokio_postgres::TokioPostgresError::Statement(e) => {
                    e.as_db_error().map(|e| e.message().to_owned())
                }
                idem_tokio_postgres::TokioPostgresError::Pool(_) => None,
            };
            assert!(
                error
                    .as_ref()
                    .is_some_and(|e| e.contains("the claim was lost")),
                "{error:?}"
            );
            assert_eq!((written, state), (false, None), "nothing committed");
        } else {
            assert_eq!(recorded.expect("recorded"), 1);
            assert_eq!(
                (written, state),
                (true, Some(1)),
                "the body's write and the record"
            );
        }
    }
}
