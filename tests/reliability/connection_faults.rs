//! R5 database faults: a connection killed under the call, or a pool closed under it, is a
//! `Store` error with no partial effects, and the retry succeeds exactly once.

use std::time::{Duration, Instant};

use idem::{ErrorKind, Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection};

use crate::cmd;
use crate::support::{
    Answer, Backend, Snapshot, Transfer, backends, connect, effect, snapshot, stmt, unique,
};

/// What R5 breaks, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultAt {
    /// The handler's connection is killed after the claim, before the body's writes.
    BeforeWrites,
    /// The handler's connection is killed after the body's writes, before the record.
    BeforeRecord,
}

struct Fault {
    at: Option<FaultAt>,
    /// Another connection, to kill the handler's with.
    killer: DatabaseConnection,
}

impl Fault {
    /// Kills the server connection `tx` runs on, from the other connection, and waits until
    /// the server has dropped it.
    async fn strike<C: ConnectionTrait>(&self, tx: &C) {
        let (me, kill, gone) = match tx.get_database_backend() {
            sea_orm::DbBackend::Postgres => (
                "SELECT CAST(pg_backend_pid() AS BIGINT)",
                "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
            ),
            _ => (
                "SELECT CAST(CONNECTION_ID() AS SIGNED)",
                "KILL CONNECTION ?",
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
            ),
        };
        let id: i64 = tx
            .query_one_raw(stmt(tx, me, vec![]))
            .await
            .expect("own connection id")
            .expect("a row")
            .try_get_by_index(0)
            .expect("an id");
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

#[idempotent(scope = "rel.fault", key = cmd.key, skip(fault))]
async fn faulty(
    db: &DatabaseConnection,
    cmd: Transfer,
    fault: &Fault,
) -> Result<Answer, idem::Error> {
    if fault.at == Some(FaultAt::BeforeWrites) {
        fault.strike(db).await;
    }
    let execution = unique("exec");
    effect(db, &cmd.run, &cmd.key, "debit", &execution).await?;
    effect(db, &cmd.run, &cmd.key, "credit", &execution).await?;
    if fault.at == Some(FaultAt::BeforeRecord) {
        fault.strike(db).await;
    }
    Ok(Answer {
        key: cmd.key,
        amount: cmd.amount,
        execution,
    })
}

/// Runs `faulty` in a task of its own, so a panic is reported as such.
async fn run_faulty(
    db: &DatabaseConnection,
    c: &Transfer,
    fault: Fault,
) -> Result<(Result<Answer, idem::Error>, Option<Outcome>), String> {
    let (db, c) = (db.clone(), c.clone());
    tokio::spawn(async move { with_outcome(faulty(&db, c, &fault)).await })
        .await
        .map_err(|e| format!("the call panicked: {e}"))
}

/// After a fault: a typed store error (or `Unavailable`), nothing half-written; the retry executes exactly once.
async fn after_fault(
    b: &Backend,
    retry_db: &DatabaseConnection,
    killer: &DatabaseConnection,
    run: &str,
    c: &Transfer,
    what: &str,
    result: Result<(Result<Answer, idem::Error>, Option<Outcome>), String>,
) -> String {
    let (result, _) = result.unwrap_or_else(|e| panic!("{} {what}: {e}", b.name));
    let err = match result {
        Ok(a) => panic!("{} {what}: succeeded despite the fault: {a:?}", b.name),
        Err(e) => e,
    };
    // A connection lost mid-call is a store error; a pool that gives none (closed) is an
    // outage: both are 503s, and neither wrote anything.
    assert!(
        matches!(err.kind(), ErrorKind::Store | ErrorKind::Unavailable),
        "{} {what}: {err}",
        b.name
    );
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        s,
        Snapshot::default(),
        "{} {what}: nothing half-written",
        b.name
    );
    let retry = run_faulty(
        retry_db,
        c,
        Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{} {what}: retry: {e}", b.name));
    let (answer, outcome) = (
        retry
            .0
            .unwrap_or_else(|e| panic!("{} {what}: retry: {e}", b.name)),
        retry.1,
    );
    assert_eq!(outcome, Some(Outcome::Executed), "{} {what}", b.name);
    let again = faulty(
        retry_db,
        c.clone(),
        &Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await
    .expect("replay");
    assert_eq!(again, answer, "{} {what}: replayed", b.name);
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        (s.effects, s.executions, s.completed, s.pending),
        (2, 1, 1, 0),
        "{} {what}: the retry executed exactly once",
        b.name
    );
    format!("{what}: {err}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_connection_is_a_store_error_and_the_retry_succeeds_once() {
    for b in backends(4).await {
        let started = Instant::now();
        let run = unique("r5");
        let mut seen = Vec::new();
        let killer = connect(&b.url, 2).await;
        if b.name != "sqlite" {
            // The handler's pool has ONE connection: the retry must not get the dead one.
            let db = connect(&b.url, 1).await;
            for (i, at) in [FaultAt::BeforeWrites, FaultAt::BeforeRecord]
                .into_iter()
                .enumerate()
            {
                let c = cmd(&run, i);
                let result = run_faulty(
                    &db,
                    &c,
                    Fault {
                        at: Some(at),
                        killer: killer.clone(),
                    },
                )
                .await;
                seen.push(
                    after_fault(&b, &db, &killer, &run, &c, &format!("{at:?}"), result).await,
                );
            }

            // Killed while its claim waits for the key's row lock, held by another
            // transaction with an uncommitted ledger row of the same id. The handler's pool
            // has one connection: its id is the claim's.
            let c = cmd(&run, 2);
            let postgres = b.name == "postgres";
            let (own_id, waits, kill, gone) = if postgres {
                (
                    "SELECT CAST(pg_backend_pid() AS BIGINT)",
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ? \
                     AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO idem_ledger%'",
                    "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
                )
            } else {
                // `%` first: on Galera the claim starts `SET STATEMENT wsrep_sync_wait = …`.
                (
                    "SELECT CAST(CONNECTION_ID() AS SIGNED)",
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? \
                     AND INFO LIKE '%INSERT INTO idem_ledger%'",
                    "KILL CONNECTION ?",
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
                )
            };
            let claimer: i64 = db
                .query_one_raw(stmt(&db, own_id, vec![]))
                .await
                .expect("the pool's connection id")
                .expect("a row")
                .try_get_by_index(0)
                .expect("an id");
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
                let (db, c, killer) = (db.clone(), c.clone(), killer.clone());
                tokio::spawn(async move {
                    with_outcome(faulty(&db, c, &Fault { at: None, killer })).await
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
                assert!(!call.is_finished(), "{}: the claim did not wait", b.name);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                waiting,
                "{}: the claim never waited on connection {claimer}",
                b.name
            );
            kill_connection(&killer, kill, gone, claimer).await;
            let result = call.await.map_err(|e| format!("the call panicked: {e}"));
            blocker.rollback().await.expect("release the blocking row");
            seen.push(after_fault(&b, &db, &killer, &run, &c, "WhileClaiming", result).await);
        }

        // The pool is closed under the caller (the database is unreachable).
        let c = cmd(&run, 3);
        let closed = connect(&b.url, 1).await;
        closed.close_by_ref().await.expect("close");
        let result = run_faulty(
            &closed,
            &c,
            Fault {
                at: None,
                killer: killer.clone(),
            },
        )
        .await;
        let fresh = connect(&b.url, 1).await;
        seen.push(after_fault(&b, &fresh, &killer, &run, &c, "PoolClosed", result).await);
        eprintln!(
            "R5 {}: {} faults, each a Store error, nothing written, one execution on retry: \
             {seen:#?}; {:.1?}",
            b.name,
            seen.len(),
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
