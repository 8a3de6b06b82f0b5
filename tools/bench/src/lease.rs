//! P10: the same handler in lease mode against atomic mode: latency per first execution and
//! commits per call (counted by the server where it counts them).
//!
//! The handler calls an external service (here an in-process stand-in that answers at once)
//! and writes one row. Atomic mode makes the call inside its transaction (what lease mode
//! exists to avoid); lease mode makes it a recorded step and writes in its final phase
//! (`finish`, which records the result in the phase's transaction: claim, step, phase).

use std::time::Instant;

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};

use crate::Res;
use crate::setup::{Bench, Plan};

/// P10's figures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseCost {
    pub(crate) calls: usize,
    pub(crate) atomic_median_us: f64,
    pub(crate) lease_median_us: f64,
    /// Write transactions per call as the server counts them (PostgreSQL: transaction ids,
    /// MariaDB: COMMIT statements; `None` on SQLite, which keeps no count).
    pub(crate) atomic_commits_per_call: Option<f64>,
    pub(crate) lease_commits_per_call: Option<f64>,
}

impl LeaseCost {
    /// Lease-mode latency over atomic-mode latency.
    pub(crate) fn ratio(&self) -> f64 {
        self.lease_median_us / self.atomic_median_us
    }
}

#[derive(Debug, serde::Serialize)]
struct Order {
    key: String,
    amount_cents: i64,
}

async fn external_call(key: String, amount_cents: i64) -> Result<String, idem::Error> {
    Ok(format!("{}:{amount_cents}", &key[..key.len().min(12)]))
}

pub(crate) async fn insert_row<C: ConnectionTrait>(
    db: &C,
    reference: &str,
) -> Result<(), idem::Error> {
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        idem::sea_orm::placeholders(
            backend,
            "INSERT INTO bench_lease_rows (reference) VALUES (?)",
        ),
        [reference.into()],
    ))
    .await
    .map(drop)
    .map_err(|e| idem::Error::store("inserting the row", e))
}

#[idempotent(scope = "bench.p10.atomic", key = order.key)]
async fn atomic(db: &DatabaseConnection, order: Order) -> Result<String, idem::Error> {
    let reference = external_call(order.key.clone(), order.amount_cents).await?;
    insert_row(db, &reference).await?;
    Ok(reference)
}

#[idempotent(scope = "bench.p10.lease", key = order.key, lease = "30s")]
async fn leased(db: &DatabaseConnection, order: Order) -> Result<String, idem::Error> {
    let reference: String =
        idem::step("call", |key| external_call(key, order.amount_cents)).await?;
    // The final phase is the last work: `finish` records the result in its transaction.
    idem::sea_orm::finish(db, "write", move |tx| {
        Box::pin(async move {
            insert_row(tx, &reference).await?;
            Ok::<_, idem::Error>(reference)
        })
    })
    .await
}

/// The server's commit counter, where it has one.
async fn commits(db: &DatabaseConnection) -> Res<Option<i64>> {
    let sql = match db.get_database_backend() {
        // Every committed write transaction takes a transaction id (the probe takes one too).
        DbBackend::Postgres => "SELECT CAST(CAST(pg_current_xact_id() AS TEXT) AS BIGINT)",
        // COMMIT statements, server-wide (the bench runs alone; autocommit statements such as
        // a lease renewal are not counted).
        DbBackend::MySql => {
            "SELECT CAST(VARIABLE_VALUE AS SIGNED) + 1 FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'COM_COMMIT'"
        }
        _ => return Ok(None),
    };
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await?;
    Ok(row.and_then(|r| r.try_get_by_index::<i64>(0).ok()))
}

/// P10's median: the upper middle sample. Not `stats::median` (which averages the two middle
/// samples of an even count): P10 has been published with this one.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// P10: the plan's first executions of each mode, alternating, on fresh keys, in the
/// bench's `bench_lease_rows` (created with the other bench tables).
pub(crate) async fn measure(b: &Bench, plan: &Plan) -> Res<LeaseCost> {
    let (db, calls) = (&b.db, plan.lease_calls);
    let run = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    );
    // One first execution in lease mode or in atomic mode, on key `<run>-<prefix>-<i>`.
    let pay = async |lease_mode: bool, prefix: &str, i: usize| {
        let order = Order {
            key: format!("{run}-{prefix}-{i}"),
            amount_cents: 1200,
        };
        match lease_mode {
            true => leased(db, order).await,
            false => atomic(db, order).await,
        }
    };
    // Warm both paths (prepared statements, pool).
    for i in 0..20 {
        pay(false, "wa", i).await?;
        pay(true, "wl", i).await?;
    }
    let (mut a, mut l) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    for i in 0..calls {
        let started = Instant::now();
        pay(false, "a", i).await?;
        a.push(started.elapsed().as_secs_f64() * 1e6);
        let started = Instant::now();
        pay(true, "l", i).await?;
        l.push(started.elapsed().as_secs_f64() * 1e6);
    }
    // Commits, counted apart from the timing runs (the counter query commits too).
    let n = calls.min(200);
    let mut per_call = Vec::new();
    for (lease_mode, prefix) in [(false, "ca"), (true, "cl")] {
        let before = commits(db).await?;
        for i in 0..n {
            pay(lease_mode, prefix, i).await?;
        }
        let after = commits(db).await?;
        per_call.push(
            before
                .zip(after)
                .map(|(b, a)| (a - b - 1) as f64 / n as f64),
        );
    }
    b.progress("lease done");
    Ok(LeaseCost {
        calls,
        atomic_median_us: median(a),
        lease_median_us: median(l),
        atomic_commits_per_call: per_call[0],
        lease_commits_per_call: per_call[1],
    })
}
