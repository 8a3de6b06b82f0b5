//! R5 database faults: a connection killed under idem's statements, or a pool closed under
//! the call, is `Unavailable` (a 503 with Retry-After) with no partial effects, and the retry
//! succeeds exactly once. Every fault
//! through both stores (SeaORM's and sqlx's, tests/reliability/stores.rs).

use std::time::{Duration, Instant};

use idem::{ErrorKind, Outcome, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection};

use crate::cmd;
use crate::stores::{
    Case, Conn, Store, call, on_sea_orm, on_sqlx_mysql, on_sqlx_postgres, on_sqlx_sqlite,
    on_tokio_postgres,
};
use crate::support::{
    Answer, Backend, Snapshot, Transfer, backends, connect, snapshot, stmt, unique,
};

/// What R5 breaks, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultAt {
    /// The handler's connection is killed after the claim, before the body's writes.
    BeforeWrites,
    /// The handler's connection is killed after the body's writes, before the record.
    BeforeRecord,
}

pub(crate) struct Fault {
    pub(crate) at: Option<FaultAt>,
    /// Another connection, to kill the handler's with.
    pub(crate) killer: DatabaseConnection,
}

impl Fault {
    /// Kills the server connection `id` (the handler's, read in its transaction by
    /// `faulty`, tests/reliability/stores.rs) from the other connection, and waits until the
    /// server has dropped it.
    pub(crate) async fn strike(&self, id: i64) {
        let (kill, gone) = match self.killer.get_database_backend() {
            sea_orm::DbBackend::Postgres => (
                "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
            ),
            _ => (
                "KILL CONNECTION ?",
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
            ),
        };
        kill_connection(&self.killer, kill, gone, id).await;
    }
}

async fn kill_connection(killer: &DatabaseConnection, kill: &str, gone: &str, id: i64) {
    let kill = if killer.get_database_backend() == sea_orm::DbBackend::MySql {
        // KILL takes no placeholder.
        kill.replace('?', &id.to_string())
    } else {
        kill.to_owned()
    };
    let values = if kill.contains('?') {
        vec![id.into()]
    } else {
        vec![]
    };
    killer
        .execute_raw(stmt(killer, &kill, values))
        .await
        .expect("kill the connection");
    for _ in 0..500 {
        let left: i64 = killer
            .query_one_raw(stmt(killer, gone, vec![id.into()]))
            .await
            .expect("is it gone")
            .expect("a row")
            .try_get_by_index(0)
            .expect("a count");
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("connection {id} survived its kill");
}

/// Runs `faulty` through the case's store in a task of its own, so a panic is reported as
/// such.
async fn run_faulty(
    case: &Case,
    c: &Transfer,
    fault: Fault,
) -> Result<(Result<Answer, idem::Error>, Option<Outcome>), String> {
    let (case, c) = (case.clone(), c.clone());
    tokio::spawn(async move { with_outcome(async { call!(case, faulty(c, &fault)) }).await })
        .await
        .map_err(|e| format!("the call panicked: {e}"))
}

/// After a fault: `Unavailable` (or, for a fault the body met, the body's own error: a
/// `Store` error), nothing half-written; the retry (through `retry`, the same store) executes
/// exactly once.
async fn after_fault(
    b: &Backend,
    retry: &Case,
    killer: &DatabaseConnection,
    run: &str,
    c: &Transfer,
    what: &str,
    result: Result<(Result<Answer, idem::Error>, Option<Outcome>), String>,
) -> String {
    let name = &retry.name;
    let (result, _) = result.unwrap_or_else(|e| panic!("{name} {what}: {e}"));
    let err = match result {
        Ok(a) => panic!("{name} {what}: succeeded despite the fault: {a:?}"),
        Err(e) => e,
    };
    // A connection lost under idem's statement, or a pool that gives none (closed), is an
    // outage. Before the body's writes the body meets the fault first, and its handler
    // answers it as a store error of its own.
    let expected = match what {
        "BeforeWrites" => ErrorKind::Store,
        _ => ErrorKind::Unavailable,
    };
    assert_eq!(err.kind(), expected, "{name} {what}: {err}");
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        s,
        Snapshot::default(),
        "{name} {what}: nothing half-written"
    );
    let again = run_faulty(
        retry,
        c,
        Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name} {what}: retry: {e}"));
    let (answer, outcome) = (
        again
            .0
            .unwrap_or_else(|e| panic!("{name} {what}: retry: {e}")),
        again.1,
    );
    assert_eq!(outcome, Some(Outcome::Executed), "{name} {what}");
    let fault = Fault {
        at: None,
        killer: killer.clone(),
    };
    let replayed = call!(retry, faulty(c.clone(), &fault)).expect("replay");
    assert_eq!(replayed, answer, "{name} {what}: replayed");
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        (s.effects, s.executions, s.completed, s.pending),
        (2, 1, 1, 0),
        "{name} {what}: the retry executed exactly once"
    );
    format!("{what}: {err}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_connection_is_an_outage_and_the_retry_succeeds_once() {
    for b in backends(4).await {
        for store in Store::on(&b.url) {
            faults_on(&b, store).await;
        }
    }
}

async fn faults_on(b: &Backend, store: Store) {
    let started = Instant::now();
    let run = unique("r5");
    let mut seen = Vec::new();
    let killer = connect(&b.url, 2).await;
    // The handler's pool has ONE connection: the retry must not get the dead one.
    let case = Case::open(&b.url, store, 1).await;
    let name = case.name.clone();
    if b.name != "sqlite" {
        for (i, at) in [FaultAt::BeforeWrites, FaultAt::BeforeRecord]
            .into_iter()
            .enumerate()
        {
            let c = cmd(&run, i);
            let result = run_faulty(
                &case,
                &c,
                Fault {
                    at: Some(at),
                    killer: killer.clone(),
                },
            )
            .await;
            seen.push(after_fault(b, &case, &killer, &run, &c, &format!("{at:?}"), result).await);
        }

        // Killed while its claim waits for the key's row lock, held by another
        // transaction with an uncommitted ledger row of the same id. The handler's pool
        // has one connection: its id is the claim's.
        let c = cmd(&run, 2);
        let postgres = b.name == "postgres";
        let (waits, kill, gone) = if postgres {
            (
                "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ? \
                 AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO idem_ledger%'",
                "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
            )
        } else {
            // `%` first: on Galera the claim starts `SET STATEMENT wsrep_sync_wait = …`.
            (
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? \
                 AND INFO LIKE '%INSERT INTO idem_ledger%'",
                "KILL CONNECTION ?",
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
            )
        };
        let claimer = case.pool_connection_id().await;
        let blocker = sea_orm::TransactionTrait::begin(&killer)
            .await
            .expect("begin");
        blocker
            .execute_raw(stmt(
                &blocker,
                "INSERT INTO idem_ledger (id, scope, principal, idem_key, owner, fingerprint, \
                 state, response, created_at_ms, expires_at_ms) \
                 VALUES (?, 'rel.fault', '', ?, 1, ?, 0, NULL, 0, 9000000000000)",
                vec![
                    idem::store::record_id("rel.fault", "", &c.key)
                        .to_vec()
                        .into(),
                    c.key.clone().into(),
                    vec![0_u8; 32].into(),
                ],
            ))
            .await
            .expect("the blocking row");
        let call = {
            let (case, c, killer) = (case.clone(), c.clone(), killer.clone());
            tokio::spawn(async move {
                let fault = Fault { at: None, killer };
                with_outcome(async { call!(case, faulty(c, &fault)) }).await
            })
        };
        let mut waiting = false;
        for _ in 0..300 {
            let n: i64 = killer
                .query_one_raw(stmt(&killer, waits, vec![claimer.into()]))
                .await
                .expect("is the claim waiting")
                .expect("a row")
                .try_get_by_index(0)
                .expect("a count");
            if n == 1 {
                waiting = true;
                break;
            }
            assert!(!call.is_finished(), "{name}: the claim did not wait");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            waiting,
            "{name}: the claim never waited on connection {claimer}"
        );
        kill_connection(&killer, kill, gone, claimer).await;
        let result = call.await.map_err(|e| format!("the call panicked: {e}"));
        blocker.rollback().await.expect("release the blocking row");
        seen.push(after_fault(b, &case, &killer, &run, &c, "WhileClaiming", result).await);
    }

    // The pool is closed under the caller (the database is unreachable).
    let c = cmd(&run, 3);
    let closed = Case::open(&b.url, store, 1).await;
    closed.close().await;
    let result = run_faulty(
        &closed,
        &c,
        Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await;
    let fresh = Case::open(&b.url, store, 1).await;
    seen.push(after_fault(b, &fresh, &killer, &run, &c, "PoolClosed", result).await);
    eprintln!(
        "R5 {name}: {} faults, each an outage, nothing written, one execution on retry: \
         {seen:#?}; {:.1?}",
        seen.len(),
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
