//! A database that cannot give a connection is an outage, told promptly: with every pooled
//! connection taken (what a dead server looks like to the pool: no connection comes), atomic
//! and lease-mode calls fail with `Unavailable` (503, `Retry-After`) within the connection wait,
//! not `InFlight` after the wait bound, nor after the pool's 30 s acquire timeout, on
//! PostgreSQL and MariaDB (set their URLs: without them this test has nothing to check). And a
//! lease-mode call whose server dies under its final phase is answered at once, its lease
//! released behind the answer, not after the connection wait a second time. Its own test
//! binary: the connection wait is process-wide.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::link::Link;
use common::{connect, connect_all, prepare, server_urls, unique};
use idem::{ErrorKind, idempotent};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, TransactionTrait};

/// How long a call waits for a connection here (`set_connection_wait`), in both tests.
const CONNECTION_WAIT: Duration = Duration::from_secs(1);

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
    idem::sea_orm::set_connection_wait(CONNECTION_WAIT);
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
                took < CONNECTION_WAIT * 2,
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

#[derive(Debug)]
enum PhaseError {
    Idem(idem::Error),
    /// The handler's own statement failed.
    Db(DbErr),
}

impl std::fmt::Display for PhaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Idem(e) => e.fmt(f),
            Self::Db(e) => write!(f, "database: {e}"),
        }
    }
}

impl From<idem::Error> for PhaseError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

/// A lease-mode call whose server goes away during its final phase: the link is cut inside
/// the phase's writes, which then return (the phase's own record fails) or, with
/// `statement_after_the_cut`, run a statement of the handler's (which fails).
#[idempotent(scope = "outage.final_phase", key = key, lease = "30s", skip(link))]
async fn final_phase_loses_its_server(
    db: &DatabaseConnection,
    link: Arc<Link>,
    key: String,
    statement_after_the_cut: bool,
) -> Result<u8, PhaseError> {
    idem::sea_orm::finish(db, "write", move |tx| {
        Box::pin(async move {
            link.cut().await;
            if statement_after_the_cut {
                tx.execute_unprepared("SELECT 1")
                    .await
                    .map_err(PhaseError::Db)?;
            }
            Ok(3)
        })
    })
    .await
}

#[tokio::test]
async fn a_server_lost_under_a_final_phase_is_answered_before_the_lease_is_released() {
    idem::sea_orm::set_connection_wait(CONNECTION_WAIT);
    for (name, url) in server_urls() {
        prepare(&connect(&url, 2).await).await;
        for statement_after_the_cut in [false, true] {
            let link = Arc::new(Link::to(&url).await);
            let db = connect(&link.url(&url), 4).await;
            let started = Instant::now();
            let answer = final_phase_loses_its_server(
                &db,
                Arc::clone(&link),
                unique("f"),
                statement_after_the_cut,
            )
            .await;
            let took = started.elapsed();
            let case = format!("{name}, statement after the cut: {statement_after_the_cut}");
            match answer {
                Err(PhaseError::Idem(e)) if !statement_after_the_cut => {
                    assert_eq!(e.kind(), ErrorKind::Unavailable, "{case}: {e}");
                }
                Err(PhaseError::Db(_)) if statement_after_the_cut => {}
                other => panic!("{case}: {other:?}"),
            }
            // The release cannot reach the server either: awaited, it would wait the
            // connection wait out before the answer.
            assert!(
                took < CONNECTION_WAIT / 2,
                "{case}: answered after {took:?}"
            );
            println!("{case}: answered after {took:?}");
        }
    }
}
