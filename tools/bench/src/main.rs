//! What `#[idempotent]` costs, measured side by side with the alternatives, and what the
//! outbox relay and lease mode cost.
//!
//! ```text
//! cargo run --release -p idem-bench -- [--backend sqlite|postgres|mysql] [--quick] [--json] [--url URL]
//!     [--p7-records N] [--p11] [--ledger-records N[,N…]]
//! ```
//!
//! One process runs every workload, alternating the variants round by round (ABCD, DCBA, …)
//! so drift hits all of them equally, and reports medians: [`harness`] takes the turns, pins
//! the process to one CPU, sends storms of concurrent calls and reads the medians. The
//! workload is a "pay order" handler (read the order, insert a payment row, update the order)
//! whose argument struct is about 1 KiB of JSON; [`variants`] lists the four ways of running
//! it. One module per figure:
//!
//! | figure | module |
//! |---|---|
//! | P1, P2, P4 single-client latency; F1, F2 the same against one round trip | [`latency`] |
//! | F1 per driver: SeaORM, sqlx, tokio-postgres (PostgreSQL) | [`drivers`] |
//! | P3 throughput, 16 clients | [`throughput`] |
//! | P5 fingerprint, and against SHA-256 of its bytes | [`fingerprint`] |
//! | P6 concurrent duplicates | [`storm`] |
//! | where the time goes | [`profile`] |
//! | ledger size, P7 purge | [`ledger`] |
//! | P8 relay throughput, P9 commit-to-publish | [`outbox`] (needs NATS JetStream at `NATS_URL`) |
//! | P10 lease mode against atomic mode | [`lease`] |
//! | P11 the HTTP layer against the peer crate axum-idempotent (Redis at `REDIS_URL`) | [`http_layer`] (client: [`http_client`]) |
//! | P12 claims and replays as the ledger grows (`--ledger-records`) | [`growth`] |
//! | P13 the sqlx store against hand-written sqlx idempotency and the SeaORM store (`--p13`) | [`sqlx_floor`] |
//! | R22 the soak: the payments example for minutes or hours (`--soak MINUTES`) | [`soak`] |
//!
//! The bench owns its tables: `bench_*` business tables and a ledger, lease steps and outbox of
//! its own (a SQLite file in the temp directory; schema `bench_idem` on PostgreSQL; database
//! `bench_idem` on MySQL), so the test suite's tables are never touched. Their rows are deleted
//! at the start and at the end of every run. See `docs/BENCHMARKS.md` for the figures and their
//! goals.

mod counters;
mod drivers;
mod fingerprint;
mod growth;
mod harness;
mod http_client;
mod http_layer;
mod latency;
mod lease;
mod ledger;
mod outbox;
mod profile;
mod report;
mod setup;
mod soak;
mod sqlx_floor;
mod storm;
mod throughput;
mod variants;
mod workload;

use std::time::Instant;

use crate::report::{Results, Run};
use crate::setup::{Plan, parse_args};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

#[tokio::main]
async fn main() -> Res<()> {
    let args = parse_args()?;
    let mode = if args.quick {
        Plan::quick()
    } else {
        Plan::full()
    };
    let mode = match args.p7_records {
        Some(rows) => mode.with_p7_records(rows),
        None => mode,
    };
    let plan = if args.p11_full {
        mode.with_full_p11()
    } else {
        mode
    };
    if let Some(soak) = &args.soak {
        return soak::run(args.backend, args.url.as_deref(), soak).await;
    }
    if args.p13_only {
        return sqlx_floor::run(args.backend, args.url.as_deref(), args.quick).await;
    }
    if args.p5_only {
        // The request every call of the bench sends, with its 36-character key.
        let cost = fingerprint::measure(&workload::template(), &plan)?;
        println!(
            "P5 fingerprint of the 1 KiB request: {:.3} µs (encoding {:.3} µs, SHA-256 of its \
            bytes {:.3} µs): {:.2}x SHA-256 (goal <= 1.3), median of {} rounds",
            cost.whole_us(),
            cost.encoding_us(),
            cost.sha256_us(),
            cost.vs_sha256(),
            cost.whole.len()
        );
        return Ok(());
    }
    let started = Instant::now();
    let started_at = counters::utc_now();
    let load_start = counters::loadavg();
    let (bench, target, facts) = setup::prepare(&args, started).await?;
    let b = &bench;

    if args.drivers_only {
        let drivers = drivers::measure(b, &target, &plan)
            .await?
            .ok_or("--drivers measures PostgreSQL's drivers: add --backend postgres")?;
        for line in drivers.lines(&plan) {
            println!("{line}");
        }
        return Ok(());
    }
    if args.lease_only {
        let lease = lease::measure(b, &plan).await?;
        setup::finish(b, &target).await?;
        print!("{}", report::lease_table(&lease));
        return Ok(());
    }
    if args.http_only {
        let http = http_layer::measure(b, &plan).await?;
        setup::finish(b, &target).await?;
        print!("{}", report::http_table(&http));
        return Ok(());
    }
    let fingerprint = fingerprint::measure(&facts.sample, &plan)?;
    b.progress("fingerprint done");
    let latency = latency::measure(b, &plan).await?;
    let drivers = drivers::measure(b, &target, &plan).await?;
    let throughput = throughput::measure(b, &plan).await?;
    let storm = storm::measure(b, &plan).await?;
    b.progress("storm done");
    let profile = profile::measure(b, &target, &plan).await?;
    b.progress("profile done");
    let ledger = ledger::measure(b, &plan).await?;
    // Before the outbox and lease figures, whose ledger records are not the workload's.
    let checked = setup::check(b).await?;
    let outbox = outbox::measure(b, &plan).await?;
    let lease = lease::measure(b, &plan).await?;
    let http = http_layer::measure(b, &plan).await?;
    b.progress("p11 done");
    // Last: its records stay in the ledger until the end.
    let growth = growth::measure(b, &plan, &args.ledger_records).await?;
    setup::finish(b, &target).await?;

    let results = Results {
        fingerprint,
        latency,
        drivers,
        throughput,
        storm,
        profile,
        ledger,
        checked,
        outbox,
        lease,
        http,
        growth,
    };
    let run = Run::ended(&args, &plan, facts, started, started_at, load_start);
    print!("{}", report::table(&run, &results));
    if args.json {
        println!("{}", report::json(&run, &results));
    }
    Ok(())
}
