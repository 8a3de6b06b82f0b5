//! The reliability suite (docs/RELIABILITY.md): storms, many processes, SIGKILL crashes,
//! cancellation at every poll, broken connections, bad input, isolation, properties, HTTP
//! clients that hang up (R13) and completers finishing killed calls (R14).
//!
//! Every test counts effects in the database (`idem_rel_effects`, two rows per execution:
//! a partial write shows as an odd count) and checks the ledger for rows left in state 0.
//! SQLite always runs; PostgreSQL and MariaDB run when `IDEM_TEST_POSTGRES_URL` /
//! `IDEM_TEST_MYSQL_URL` are set (a set but unreachable server fails). Heavy cases have a
//! quick size with `IDEM_RELIABILITY_QUICK=1` for local iteration; by default they run
//! at the full size (well under a minute on all three backends). Both sizes assert
//! the same invariants. Random schedules print their seed; replay one with
//! `IDEM_RELIABILITY_SEED=<seed>`.
//!
//! One module per row of docs/RELIABILITY.md in `tests/reliability/` (`storm.rs` …);
//! this file holds what several rows share (the child process of R2/R3, the exactly-once
//! assertion), `support.rs` the plumbing (backends from `tests/common`, the suite's
//! tables, counts, the seeded PRNG, child processes) and `stores.rs` the handlers, written
//! once and instantiated per store.
//!
//! The database-facing rows run each case through both stores, SeaORM's and sqlx's, on
//! every backend of the run: R1 storm, R2 processes, R3 SIGKILL, R4 cancellation (all but
//! the wait-bound case, which drives the engine API with `SeaOrmStore`), R5 connection faults
//! and R7 isolation. The rest stay
//! on SeaORM's store, each module saying why: R6 bad input is refused before any database,
//! R8 properties run on the in-memory store, R13 is about HTTP clients, and R14's completer
//! suite (tests/completer.rs) already runs both stores.

mod common;
#[path = "reliability/support.rs"]
mod support;

#[path = "reliability/bad_input.rs"]
mod bad_input;
#[path = "reliability/cancellation.rs"]
mod cancellation;
#[path = "reliability/completer_crashes.rs"]
mod completer_crashes;
#[path = "reliability/connection_faults.rs"]
mod connection_faults;
#[path = "reliability/disconnects.rs"]
mod disconnects;
#[path = "reliability/isolation.rs"]
mod isolation;
#[path = "reliability/processes.rs"]
mod processes;
#[path = "reliability/properties.rs"]
mod properties;
#[path = "reliability/sigkill.rs"]
mod sigkill;
#[path = "reliability/stores.rs"]
mod stores;
#[path = "reliability/storm.rs"]
mod storm;

// The payments example, served over a socket by R13.
mod shop;
use shop::{app, model};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{ErrorKind, Outcome, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection};

use stores::{
    Case, Conn, Store, call, on_sea_orm, on_sqlx_mysql, on_sqlx_postgres, on_sqlx_sqlite,
    on_tokio_postgres,
};
use support::{Answer, Backend, Probe, Rng, SCOPE, Snapshot, Transfer, key_of, snapshot, stmt};

fn outcome_name(outcome: Option<Outcome>) -> &'static str {
    match outcome {
        Some(Outcome::Executed) => "Executed",
        Some(Outcome::Replayed) => "Replayed",
        None => "None",
    }
}

fn cmd(run: &str, i: usize) -> Transfer {
    Transfer {
        key: key_of(run, i),
        run: run.to_owned(),
        amount: i as i64,
    }
}

/// Asserts the end state of a run in which every one of `keys` keys executed exactly once.
async fn assert_exactly_once(b: &Backend, run: &str, keys: usize, what: &str) -> Snapshot {
    let s = snapshot(&b.db, SCOPE, run, None).await;
    let keys = keys as i64;
    assert_eq!(
        s,
        Snapshot {
            effects: 2 * keys,
            executions: keys,
            pending: 0,
            completed: keys,
            other: 0,
        },
        "{} {what}: {keys} keys must give {keys} executions, {} effect rows, {keys} completed \
         records and no pending one",
        b.name,
        2 * keys
    );
    let per_key = support::effects_per_key(&b.db, run).await;
    assert_eq!(per_key.len() as i64, keys, "{}: every key executed", b.name);
    assert!(
        per_key.values().all(|&n| n == 2),
        "{}: two effect rows per key",
        b.name
    );
    s
}

/// Every recorded answer of a run, by key, in one query.
async fn recorded_answers(db: &DatabaseConnection, run: &str) -> BTreeMap<String, Answer> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT idem_key, response FROM idem_ledger WHERE scope = ? AND idem_key LIKE ? \
             AND state = 1",
            vec![SCOPE.into(), format!("{run}-%").into()],
        ))
        .await
        .expect("recorded answers");
    rows.iter()
        .map(|r| {
            let key: String = r.try_get_by_index(0).expect("key");
            let bytes: Vec<u8> = r.try_get_by_index(1).expect("response");
            (key, serde_json::from_slice(&bytes).expect("an Answer"))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// The child process of R2 and R3: this test binary, re-executed by the parent.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of R2/R3: the parent runs it with IDEM_RELIABILITY_CHILD set"]
async fn child_process() {
    if std::env::var("IDEM_RELIABILITY_CHILD").is_err() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    println!("@@ START");
    // Which store the calls go through (the parent's case; SeaORM's when not set).
    let store = Store::parse(
        &std::env::var("IDEM_REL_STORE").unwrap_or_else(|_| Store::SeaOrm.as_str().to_owned()),
    );
    match var("IDEM_REL_MODE").as_str() {
        "crash" => {
            let case = Case::open(&var("IDEM_REL_URL"), store, 2).await;
            let probe = Probe::Markers {
                stop_at: Some(var("IDEM_REL_STOP_AT")).filter(|s| s != "none"),
                sleep: Duration::from_millis(var("IDEM_REL_SLEEP_MS").parse().expect("ms")),
            };
            let cmd = Transfer {
                key: var("IDEM_REL_KEY"),
                run: var("IDEM_REL_RUN"),
                amount: var("IDEM_REL_AMOUNT").parse().expect("amount"),
            };
            probe.at("before-claim").await;
            let (result, outcome) =
                with_outcome(async { call!(case, transfer(cmd.clone(), &probe)) }).await;
            match result {
                Ok(answer) => println!(
                    "@@ ANSWER {} {} {}",
                    cmd.key,
                    outcome_name(outcome),
                    serde_json::to_string(&answer).expect("json")
                ),
                Err(e) => println!("@@ ERROR {} {e}", e.kind().as_str()),
            }
            probe.at("after-commit").await;
        }
        "worker" => {
            let concurrency: usize = var("IDEM_REL_CONCURRENCY").parse().expect("n");
            let case = Case::open(&var("IDEM_REL_URL"), store, concurrency as u32 + 1).await;
            let run = var("IDEM_REL_RUN");
            let keys: usize = var("IDEM_REL_KEYS").parse().expect("n");
            let mut order: Vec<usize> = (0..keys).collect();
            Rng::from_seed(var("IDEM_REL_SEED").parse().expect("seed")).shuffle(&mut order);
            println!("@@ READY");
            if var("IDEM_REL_WAIT_GO") == "1" {
                let mut go = String::new();
                std::io::stdin().read_line(&mut go).expect("GO");
            }
            let (order, next) = (Arc::new(order), Arc::new(AtomicUsize::new(0)));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..concurrency {
                let (case, run, order, next) =
                    (case.clone(), run.clone(), order.clone(), next.clone());
                tasks.spawn(async move {
                    let mut in_flight = 0_u64;
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(&k) = order.get(i) else { break };
                        let cmd = cmd(&run, k);
                        loop {
                            let call = async { call!(case, transfer(cmd.clone(), &Probe::Quiet)) };
                            match with_outcome(call).await {
                                (Ok(a), outcome) => {
                                    println!(
                                        "@@ ANSWER {} {} {}",
                                        cmd.key,
                                        outcome_name(outcome),
                                        serde_json::to_string(&a).expect("json")
                                    );
                                    break;
                                }
                                (Err(e), _) if e.kind() == ErrorKind::InFlight => {
                                    in_flight += 1;
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                }
                                (Err(e), _) => {
                                    println!("@@ ERROR {} {} {e}", cmd.key, e.kind().as_str());
                                    break;
                                }
                            }
                        }
                    }
                    in_flight
                });
            }
            let in_flight: u64 = tasks.join_all().await.into_iter().sum();
            println!("@@ DONE in_flight={in_flight}");
        }
        other => panic!("unknown child mode {other}"),
    }
    println!("@@ EXIT");
}
