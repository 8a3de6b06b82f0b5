//! Round 2's figures: the outbox's P8 (relay throughput) and P9 (commit-to-publish latency)
//! against a hand-written relay measured in the same run, and P10 (lease mode against atomic
//! mode for the same handler):
//!
//! ```text
//! cargo run --release --example bench_effects -- [--backend sqlite|postgres|mysql] [--quick] [--url URL]
//! ```
//!
//! Needs a nats-server with JetStream (`NATS_URL`, default `nats://127.0.0.1:4222`); it uses a
//! stream of its own (`BENCH_OUTBOX`, subjects `bench.outbox.>`), recreated each run. Tables
//! live in the temp directory (SQLite), schema `bench_idem` (PostgreSQL) or database
//! `bench_idem` (MariaDB). The last line is one JSON object.

#[path = "bench/lease.rs"]
mod lease;
#[path = "bench/outbox.rs"]
mod outbox;

use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

async fn connect(url: &str, schema: Option<&str>) -> Res<DatabaseConnection> {
    let mut options = ConnectOptions::new(url.to_owned());
    options.sqlx_logging(false).max_connections(16);
    if let Some(schema) = schema {
        options.set_schema_search_path(schema);
    }
    Ok(Database::connect(options).await?)
}

async fn database(backend: &str, url: Option<String>) -> Res<DatabaseConnection> {
    Ok(match backend {
        "sqlite" => {
            let path = std::env::temp_dir().join("bench_idem_outbox.db");
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            let url = url.unwrap_or_else(|| format!("sqlite://{}?mode=rwc", path.display()));
            Database::connect(url).await?
        }
        "postgres" => {
            let url = url.unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into());
            connect(&url, None)
                .await?
                .execute_unprepared("CREATE SCHEMA IF NOT EXISTS bench_idem")
                .await?;
            connect(&url, Some("bench_idem")).await?
        }
        "mysql" => {
            let url = url.unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
            connect(&url, None)
                .await?
                .execute_unprepared("CREATE DATABASE IF NOT EXISTS bench_idem")
                .await?;
            let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
            connect(&format!("{base}/bench_idem"), None).await?
        }
        other => {
            return Err(format!("unknown backend `{other}`: sqlite, postgres or mysql").into());
        }
    })
}

#[tokio::main]
async fn main() -> Res<()> {
    let mut backend = "sqlite".to_owned();
    let mut quick = false;
    let mut url = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => backend = args.next().ok_or("--backend needs a value")?,
            "--url" => url = Some(args.next().ok_or("--url needs a value")?),
            "--quick" => quick = true,
            other => {
                return Err(format!(
                    "unknown argument `{other}`; expected --backend sqlite|postgres|mysql, --quick, --url URL"
                )
                .into());
            }
        }
    }
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let db = database(&backend, url).await?;
    idem::sea_orm::create_tables(&db).await?;
    let client = idem::nats::async_nats::connect(&nats_url).await?;
    let js = outbox::jetstream(&nats_url).await?;
    let (n8, n9) = if quick { (2_000, 200) } else { (10_000, 1_000) };

    let p8 = outbox::throughput(&db, &js, n8).await?;
    let p9 = outbox::latency(&db, &js, &client, n9).await?;
    let p10 = lease::lease_cost(&db, if quick { 300 } else { 2_000 }).await?;

    println!(
        "outbox figures on {backend} ({} load: {})",
        if quick { "quick" } else { "full" },
        load()
    );
    println!(
        "P8 relay throughput, {} messages to JetStream (msg/s): idem 1 relay {:.0}, 4 relays {:.0}, 4 relays over 50 aggregates {:.0}; hand-written polling relay {:.0}; ratio 1 relay / hand-written {:.2} (goal >= 3)",
        p8.messages,
        p8.idem_1_relay_per_s,
        p8.idem_4_relays_per_s,
        p8.idem_4_relays_50_aggregates_per_s,
        p8.hand_written_per_s,
        p8.ratio()
    );
    println!(
        "P9 commit-to-publish, {} messages at 100/s (ms): idem woken by commit p50 {:.2} p99 {:.2} (goal p99 <= 10); hand-written polling every 100 ms p50 {:.2} p99 {:.2}",
        p9.messages, p9.wake_p50_ms, p9.wake_p99_ms, p9.polling_p50_ms, p9.polling_p99_ms
    );
    let per_call =
        |c: Option<f64>| c.map_or_else(|| "not counted".to_owned(), |c| format!("{c:.2}"));
    println!(
        "P10 lease mode vs atomic mode, same handler, {} first executions each: median {:.0} µs vs {:.0} µs (ratio {:.2}); write transactions per call {} vs {}",
        p10.calls,
        p10.lease_median_us,
        p10.atomic_median_us,
        p10.ratio(),
        per_call(p10.lease_commits_per_call),
        per_call(p10.atomic_commits_per_call)
    );
    println!(
        "{}",
        serde_json::json!({
            "backend": backend,
            "quick": quick,
            "p8_messages": p8.messages,
            "p8_idem_1_relay_per_s": p8.idem_1_relay_per_s,
            "p8_idem_4_relays_per_s": p8.idem_4_relays_per_s,
            "p8_idem_4_relays_50_aggregates_per_s": p8.idem_4_relays_50_aggregates_per_s,
            "p8_hand_written_per_s": p8.hand_written_per_s,
            "p8_ratio": p8.ratio(),
            "p9_messages": p9.messages,
            "p9_wake_p50_ms": p9.wake_p50_ms,
            "p9_wake_p99_ms": p9.wake_p99_ms,
            "p9_polling_p50_ms": p9.polling_p50_ms,
            "p9_polling_p99_ms": p9.polling_p99_ms,
            "p10_calls": p10.calls,
            "p10_atomic_median_us": p10.atomic_median_us,
            "p10_lease_median_us": p10.lease_median_us,
            "p10_ratio": p10.ratio(),
            "p10_atomic_commits_per_call": p10.atomic_commits_per_call,
            "p10_lease_commits_per_call": p10.lease_commits_per_call,
        })
    );
    Ok(())
}

/// The 1-minute load average, for the record.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}
