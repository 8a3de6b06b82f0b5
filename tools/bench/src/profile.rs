//! Where each variant's time goes: statements per call and their time (SeaORM's metric
//! callback), CPU of the bench and of the server, server counters, SQLite WAL frames, and the
//! cost of the transaction frame itself.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait};
use serde_json::json;

use crate::Res;
use crate::counters::{add_deltas, process_cpu_us, server_counters, server_cpu_us, server_process};
use crate::harness::{alternate, median, r3, us};
use crate::setup::{Bench, ORDERS_PER_SLOT, Plan, SLOT_PROFILE, Target, connect};
use crate::variants::{PerVariant, Variant};
use crate::workload::{PayOrder, now_ms};

/// Per statement label: how many ran and their µs, summed.
type StatementTotals = BTreeMap<&'static str, (u64, f64)>;

/// What one statement label costs a call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatementCost {
    pub(crate) per_call: f64,
    pub(crate) us_per_call: f64,
}

/// One variant's profile, per call.
#[derive(Debug, Default)]
pub(crate) struct VariantProfile {
    pub(crate) wall_us: f64,
    pub(crate) statements: f64,
    pub(crate) statement_us: f64,
    pub(crate) outside_statements_us: f64,
    /// NaN where `/proc` cannot tell.
    pub(crate) client_cpu_us: f64,
    /// NaN where the server's process cannot be read (SQLite has none).
    pub(crate) server_cpu_us: f64,
    pub(crate) server_counters: BTreeMap<&'static str, f64>,
    /// SQLite only.
    pub(crate) sqlite_wal_frames: Option<f64>,
    pub(crate) by_statement: BTreeMap<&'static str, StatementCost>,
}

/// The transaction frame on the profile's connection, medians in µs.
#[derive(Debug)]
pub(crate) struct FrameCosts {
    pub(crate) acquire_ping_begin: f64,
    pub(crate) select_1_round_trip: f64,
    pub(crate) commit_after_one_update: f64,
    pub(crate) rollback_read_only: f64,
}

#[derive(Debug)]
pub(crate) struct Profile {
    pub(crate) calls_per_variant: f64,
    pub(crate) variants: PerVariant<VariantProfile>,
    pub(crate) frame: FrameCosts,
}

impl Profile {
    /// The JSON's `profile` object.
    pub(crate) fn json(&self) -> serde_json::Value {
        let variant = |v: Variant| {
            let p = &self.variants[v];
            let cost = |c: &StatementCost| json!({"per_call": r3(c.per_call), "us_per_call": r3(c.us_per_call)});
            let by: BTreeMap<_, _> = p.by_statement.iter().map(|(k, c)| (*k, cost(c))).collect();
            let counters: BTreeMap<_, _> = p
                .server_counters
                .iter()
                .map(|(k, x)| (*k, r3(*x)))
                .collect();
            let figures = json!({
                "wall_us": r3(p.wall_us),
                "statements_per_call": r3(p.statements),
                "statement_us_per_call": r3(p.statement_us),
                "outside_statements_us_per_call": r3(p.outside_statements_us),
                "client_cpu_us_per_call": r3(p.client_cpu_us),
                "server_cpu_us_per_call": r3(p.server_cpu_us),
                "server_counters_per_call": counters,
                "sqlite_wal_frames_per_call": p.sqlite_wal_frames.map(r3),
                "by_statement": by,
            });
            (v.key(), figures)
        };
        let variants: BTreeMap<_, _> = Variant::ALL.into_iter().map(variant).collect();
        let frame = &self.frame;
        json!({
            "calls_per_variant": self.calls_per_variant,
            "variants": variants,
            "micro_us": {
                "acquire_ping_begin": r3(frame.acquire_ping_begin),
                "select_1_round_trip": r3(frame.select_1_round_trip),
                "commit_after_one_update": r3(frame.commit_after_one_update),
                "rollback_read_only": r3(frame.rollback_read_only),
            },
        })
    }
}

/// What a statement does, by its verb and table: the profile's per-statement lines.
fn label(sql: &str) -> &'static str {
    let verb = sql
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_ascii_uppercase();
    let table = [
        "idem_ledger",
        "bench_orders",
        "bench_payments",
        "bench_idem_keys",
    ]
    .into_iter()
    .find(|t| sql.contains(t));
    match (verb.as_str(), table) {
        // PostgreSQL's claim inserts or reads in one statement.
        ("WITH", Some("idem_ledger")) => "ledger: claim (insert or read)",
        // SQLite records by one upsert; the other backends' INSERT is the claim.
        ("INSERT", Some("idem_ledger")) if sql.contains("DO UPDATE") => "ledger: record upsert",
        ("INSERT", Some("idem_ledger")) => "ledger: claim INSERT",
        ("SELECT", Some("idem_ledger")) if sql.contains("FOR UPDATE") => "ledger: read FOR UPDATE",
        ("SELECT", Some("idem_ledger")) => "ledger: read",
        ("UPDATE", Some("idem_ledger")) if sql.contains("created_at_ms =") => {
            "ledger: take-over UPDATE"
        }
        ("UPDATE", Some("idem_ledger")) => "ledger: record UPDATE",
        ("SELECT", Some("bench_orders")) => "body: read order",
        ("INSERT", Some("bench_payments")) => "body: insert payment",
        ("UPDATE", Some("bench_orders")) => "body: update order",
        ("INSERT", Some("bench_idem_keys")) => "manual: insert key (commit 1)",
        ("SELECT", Some("bench_idem_keys")) => "manual: read key",
        ("UPDATE", Some("bench_idem_keys")) => "manual: record (commit 3)",
        _ => "other",
    }
}

/// WAL frames (pages) each variant's call appends to SQLite's WAL, over `calls` calls.
async fn sqlite_wal_frames(
    db: &DatabaseConnection,
    b: &Bench,
    recorded: &[PayOrder],
    calls: usize,
) -> Res<PerVariant<f64>> {
    let mut out = PerVariant::default();
    for v in Variant::ALL {
        db.execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
            .await?;
        for i in 0..calls {
            let cmd = match v {
                Variant::IdemReplay => recorded.get(i % recorded.len().max(1)).cloned(),
                _ => None,
            }
            .unwrap_or_else(|| b.command(SLOT_PROFILE, i));
            b.call_on(db, v, cmd).await?;
        }
        let row = db
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "PRAGMA wal_checkpoint(PASSIVE)",
            ))
            .await?
            .ok_or("no checkpoint row")?;
        let frames: i64 = row.try_get_by_index(1)?;
        out[v] = frames as f64 / calls as f64;
    }
    Ok(out)
}

/// Where each variant's time goes: statements per call and their time (SeaORM's metric
/// callback), CPU of the bench and of the server, server counters. One connection, calls in
/// sequence, variants interleaved in chunks of five calls (ABCD, DCBA, …).
pub(crate) async fn measure(b: &Bench, target: &Target, plan: &Plan) -> Res<Profile> {
    let totals: Arc<Mutex<PerVariant<StatementTotals>>> = Arc::default();
    // The variant being profiled, as its position in `Variant::ALL` (`usize::MAX`: none): an
    // atomic, so the metric callback reads it without taking a lock.
    let current = Arc::new(AtomicUsize::new(usize::MAX));
    let mut db = connect(&target.url, Some(1), target.schema).await?;
    if b.sql.backend == DbBackend::Sqlite {
        db.execute_unprepared("PRAGMA synchronous = FULL").await?;
    }
    let (sink, variant_now) = (Arc::clone(&totals), Arc::clone(&current));
    db.set_metric_callback(move |info| {
        let Some(&v) = Variant::ALL.get(variant_now.load(Ordering::Relaxed)) else {
            return;
        };
        if let Ok(mut m) = sink.lock() {
            let e = m[v].entry(label(&info.statement.sql)).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += us(info.elapsed);
        }
    });
    let server = server_process(&db).await;
    let chunk = 5;
    let rounds = plan.profile_calls.div_ceil(chunk);
    let n = (rounds * chunk) as f64;
    let mut recorded = Vec::new();
    // Warm the profile connection's statement cache; record keys for the replays.
    for v in Variant::EXECUTING {
        for i in 0..chunk.max(10) {
            let cmd = b.command(SLOT_PROFILE, i);
            recorded.push(cmd.clone());
            b.call_on(&db, v, cmd).await?;
        }
    }
    recorded.drain(..recorded.len() - chunk.max(10));
    if let Ok(mut m) = totals.lock() {
        *m = PerVariant::default();
    }
    let mut wall: PerVariant<f64> = PerVariant::default();
    let mut client: PerVariant<f64> = PerVariant::default();
    let mut server_cpu: PerVariant<f64> = PerVariant::default();
    let mut counters: PerVariant<BTreeMap<&'static str, f64>> = PerVariant::default();
    for round in 0..rounds {
        for v in alternate(&Variant::ALL, round) {
            let before = server_counters(&db).await;
            current.store(v as usize, Ordering::Relaxed);
            let (c0, s0) = (process_cpu_us("self"), server_cpu_us(server.as_ref()));
            let start = Instant::now();
            for i in 0..chunk {
                let cmd = match v {
                    Variant::IdemReplay => recorded[(round * chunk + i) % recorded.len()].clone(),
                    _ => b.command(SLOT_PROFILE, i),
                };
                let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
                b.call_on(&db, v, cmd).await?;
                recorded.extend(keep);
            }
            wall[v] += us(start.elapsed());
            let since = |now: Option<f64>, then| now.zip(then).map_or(f64::NAN, |(a, z)| a - z);
            client[v] += since(process_cpu_us("self"), c0);
            server_cpu[v] += since(server_cpu_us(server.as_ref()), s0);
            current.store(usize::MAX, Ordering::Relaxed);
            add_deltas(&mut counters[v], &before, server_counters(&db).await);
        }
    }
    let totals = totals.lock().map(|m| m.clone()).unwrap_or_default();
    let wal_frames = if b.sql.backend == DbBackend::Sqlite {
        Some(sqlite_wal_frames(&db, b, &recorded, 50).await?)
    } else {
        None
    };
    let variants = totals.map(|v, mine| {
        let statements: u64 = mine.values().map(|e| e.0).sum();
        let statement_us: f64 = mine.values().map(|e| e.1).sum();
        VariantProfile {
            wall_us: wall[v] / n,
            statements: statements as f64 / n,
            statement_us: statement_us / n,
            outside_statements_us: (wall[v] - statement_us) / n,
            client_cpu_us: client[v] / n,
            server_cpu_us: server_cpu[v] / n,
            server_counters: counters[v].iter().map(|(k, x)| (*k, x / n)).collect(),
            sqlite_wal_frames: wal_frames.as_ref().map(|w| w[v]),
            by_statement: mine
                .iter()
                .map(|(k, (count, t))| {
                    let cost = StatementCost {
                        per_call: *count as f64 / n,
                        us_per_call: t / n,
                    };
                    (*k, cost)
                })
                .collect(),
        }
    });
    let frame = frame_costs(&db, b, plan).await?;
    db.close().await?;
    Ok(Profile {
        calls_per_variant: n,
        variants,
        frame,
    })
}

/// Micro-costs of the transaction frame on the profile's connection.
async fn frame_costs(db: &DatabaseConnection, b: &Bench, plan: &Plan) -> Res<FrameCosts> {
    let (mut begin, mut select1, mut commit, mut rollback) = (vec![], vec![], vec![], vec![]);
    let one = Statement::from_string(b.sql.backend, "SELECT 1");
    let order = 1 + SLOT_PROFILE * ORDERS_PER_SLOT;
    for _ in 0..plan.profile_calls.min(300) {
        let t = Instant::now();
        let tx = db.begin().await?;
        begin.push(us(t.elapsed()));
        let t = Instant::now();
        tx.query_one_raw(one.clone()).await?;
        select1.push(us(t.elapsed()));
        tx.execute_raw(b.sql.stmt(
            &b.sql.update_order,
            vec![0_i64.into(), "open".into(), now_ms().into(), order.into()],
        ))
        .await?;
        let t = Instant::now();
        tx.commit().await?;
        commit.push(us(t.elapsed()));
        let tx = db.begin().await?;
        tx.query_one_raw(one.clone()).await?;
        let t = Instant::now();
        tx.rollback().await?;
        rollback.push(us(t.elapsed()));
    }
    Ok(FrameCosts {
        acquire_ping_begin: median(&begin),
        select_1_round_trip: median(&select1),
        commit_after_one_update: median(&commit),
        rollback_read_only: median(&rollback),
    })
}
