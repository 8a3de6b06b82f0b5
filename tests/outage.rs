//! A database that cannot give a connection is an outage, told promptly: with every pooled
//! connection taken (what a dead server looks like to the pool: no connection comes), atomic
//! and lease-mode calls fail with `Unavailable` (503, `Retry-After`) within the connection wait,
//! not `InFlight` after the wait bound, nor after the pool's 30 s acquire timeout, on
//! PostgreSQL and MariaDB (set their URLs: without them this test has nothing to check). Its
//! own test binary: the connection wait is process-wide.

mod common;

use std::time::{Duration, Instant};

use common::{connect_all, prepare, unique};
use idem::{ErrorKind, idempotent};
use sea_orm::{DatabaseConnection, TransactionTrait};

#[idempotent(scope = "outage.atomic", key = key)]
async fn atomic(db: &DatabaseConnection, key: String) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(1)
}

#[idempotent(scope = "outage.lease", key = key, lease = "30s")]
async fn leased(db: &DatabaseConnection, key: String) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(2)
}

#[tokio::test]
async fn without_a_connection_both_modes_answer_unavailable_within_the_connection_wait() {
    idem::sea_orm::set_connection_wait(Duration::from_millis(400));
    // Pools of one connection: holding it starves every call. (Servers only: an embedded
    // SQLite database cannot go away, and its one connection is queued for under load.)
    for backend in connect_all("idem-outage", 1).await {
        if backend.name == "sqlite" {
            continue;
        }
        prepare(&backend.db).await;
        let name = backend.name;
        // Works while a connection is free.
        assert_eq!(
            atomic(&backend.db, unique("a")).await.ok(),
            Some(1),
            "{name}"
        );
        let held = backend.db.begin().await.expect("take the only connection");
        for mode in ["atomic", "lease"] {
            let started = Instant::now();
            let answer = match mode {
                "atomic" => atomic(&backend.db, unique("a")).await,
                _ => leased(&backend.db, unique("l")).await,
            };
            let took = started.elapsed();
            let e = answer.expect_err("no connection: no answer");
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{name} {mode}: {e}");
            assert_eq!(e.http_status(), 503, "{name} {mode}");
            assert!(
                took < Duration::from_secs(2),
                "{name} {mode}: told after {took:?}"
            );
            println!("{name} {mode}: unavailable after {took:?}");
        }
        held.rollback().await.expect("give it back");
        assert_eq!(
            leased(&backend.db, unique("l")).await.ok(),
            Some(2),
            "{name}"
        );
    }
}
