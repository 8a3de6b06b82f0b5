//! The report: the figures against their goals, the table on stdout, and the JSON object.

use std::time::Instant;

use serde_json::{Map, Value, json};

use crate::counters::{loadavg, peak_rss_bytes, read_proc, utc_date};
use crate::harness::{Pair, fmt_opt, median, percentile, r3, rounded};
use crate::latency::{Latencies, Latency, PAIR};
use crate::lease::LeaseCost;
use crate::ledger::{Ledger, PACED_BUDGET, PurgeHow};
use crate::outbox::OutboxFigures;
use crate::profile::Profile;
use crate::setup::{Args, Backend, Checked, Facts, Plan};
use crate::storm::Storm;
use crate::throughput::{Rate, Throughput};
use crate::variants::{PerVariant, Variant};

/// Everything the figures measured.
#[derive(Debug)]
pub(crate) struct Results {
    /// The whole fingerprint, measured against its encoding alone.
    pub(crate) fingerprint: Pair,
    pub(crate) latency: Latency,
    pub(crate) throughput: Throughput,
    pub(crate) storm: Storm,
    pub(crate) profile: Profile,
    pub(crate) ledger: Ledger,
    pub(crate) checked: Checked,
    pub(crate) outbox: OutboxFigures,
    pub(crate) lease: LeaseCost,
}

/// How the run went, besides the figures.
#[derive(Debug)]
pub(crate) struct Run<'a> {
    pub(crate) args: &'a Args,
    pub(crate) plan: &'a Plan,
    pub(crate) facts: Facts,
    pub(crate) load_start: String,
    pub(crate) elapsed_s: f64,
    pub(crate) load_end: String,
    pub(crate) date: String,
    pub(crate) peak_rss_bytes: Option<u64>,
}

impl<'a> Run<'a> {
    /// Closes the run: its length, the load and memory at the end.
    pub(crate) fn ended(
        args: &'a Args,
        plan: &'a Plan,
        facts: Facts,
        started: Instant,
        load_start: String,
    ) -> Self {
        Self {
            args,
            plan,
            facts,
            load_start,
            elapsed_s: started.elapsed().as_secs_f64(),
            load_end: loadavg(),
            date: utc_date(),
            peak_rss_bytes: peak_rss_bytes(),
        }
    }

    fn mode(&self) -> &'static str {
        if self.args.quick { "quick" } else { "full" }
    }
}

/// Where a figure's goal lies.
#[derive(Debug, Clone, Copy)]
enum Goal {
    /// At most this.
    Max(f64),
    /// At least this.
    Min(f64),
    /// Reported without a goal.
    Unset,
}

use Goal::{Max, Min, Unset};

/// One line of the figure table, and its keys in the JSON.
#[derive(Debug)]
struct Figure {
    id: &'static str,
    key: &'static str,
    what: &'static str,
    value: Option<f64>,
    goal: Goal,
    /// Why the figure has no value, when that is worth saying.
    not_measured: Option<String>,
}

impl Figure {
    fn met(&self) -> Option<bool> {
        let value = self.value?;
        match self.goal {
            Max(goal) => Some(value <= goal),
            Min(goal) => Some(value >= goal),
            Unset => None,
        }
    }

    fn goal_text(&self) -> String {
        match self.goal {
            Max(goal) => format!("<= {goal}"),
            Min(goal) => format!(">= {goal}"),
            Unset => "-".to_owned(),
        }
    }
}

/// Every figure: its id, its key in the JSON, its goal, and what it measures.
#[rustfmt::skip] // a table: one figure a line
const FIGURES: [(&str, &str, Goal, &str); 10] = [
    ("P1", "p1_first_vs_bare", Max(1.10), "idem first / bare latency (PostgreSQL, durable)"),
    ("P2", "p2_replay_vs_first", Max(0.33), "idem replay / idem first latency"),
    ("P3", "p3_vs_three_commit", Min(2.0), "idem first / three-commit throughput, 16 clients"),
    ("P4", "p4_sqlite_first_vs_bare", Max(1.20), "idem first / bare latency (SQLite file, WAL)"),
    ("P5", "p5_fingerprint_us", Max(2.0), "fingerprint of the 1 KiB request, µs"),
    ("P6", "p6_storm_vs_single", Max(3.0), "64 duplicates answered / one execution"),
    ("P7", "p7_purge_p99_ratio", Max(2.0), "claim p99 during a purge / without"),
    ("P8", "p8_ratio", Min(3.0), "idem relay / hand-written polling relay, msg/s"),
    ("P9", "p9_wake_p99_ms", Max(10.0), "commit-to-publish p99 (relay woken by commit), ms"),
    ("P10", "p10_ratio", Unset, "lease / atomic mode latency, same handler"),
];

fn figures(run: &Run<'_>, r: &Results) -> Vec<Figure> {
    let backend = run.args.backend;
    let first_vs_bare = r.latency.first_vs_bare();
    let outbox = r.outbox.as_ref().ok();
    let values = [
        (backend == Backend::Postgres).then_some(first_vs_bare),
        Some(r.latency.replay_vs_first()),
        Some(r.throughput.idem_vs_three_commit()),
        (backend == Backend::Sqlite).then_some(first_vs_bare),
        Some(median(&r.fingerprint.measured)),
        Some(r.storm.storm_vs_single()),
        r.ledger.p7_ratio(),
        outbox.map(|(p8, _)| p8.ratio()),
        outbox.map(|(_, p9)| p9.wake_p99_ms),
        Some(r.lease.ratio()),
    ];
    let figure = |(&(id, key, goal, what), value)| Figure {
        id,
        key,
        what,
        value,
        goal,
        // P8 and P9 say why NATS could not be reached.
        not_measured: r
            .outbox
            .as_ref()
            .err()
            .filter(|_| id == "P8" || id == "P9")
            .cloned(),
    };
    FIGURES.iter().zip(values).map(figure).collect()
}

/// The human report (stdout).
pub(crate) fn table(run: &Run<'_>, r: &Results) -> String {
    let mut out = Vec::new();
    header(&mut out, run, r);
    out.push(String::new());
    latency_lines(&mut out, run.plan, &r.latency);
    out.push(String::new());
    throughput_lines(&mut out, run.plan, &r.throughput);
    out.push(String::new());
    storm_lines(&mut out, run.plan, &r.storm);
    ledger_lines(&mut out, &r.ledger);
    outbox_lines(&mut out, &r.outbox);
    lease_lines(&mut out, &r.lease);
    out.push(String::new());
    figure_table(&mut out, &figures(run, r));
    out.push(String::new());
    out.push(format!(
        "peak memory (VmHWM): {}",
        fmt_opt(run.peak_rss_bytes.map(|p| p as f64 / 1_048_576.0), 1) + " MiB"
    ));
    let size = &r.ledger.size;
    out.push(format!(
        "ledger on disk: {:.0} bytes per 1,000,000 records ({:.1} MiB; measured over {} records \
         with a {}-byte recorded receipt, inserted in {:.1} s)",
        size.per_million(),
        size.per_million() / 1_048_576.0,
        size.rows,
        r.ledger.response_bytes,
        size.insert_s
    ));
    let c = &r.checked;
    out.push(format!(
        "checked: {} executions, {} payments, {} ledger records at the end",
        c.executed, c.payments, c.ledger_records
    ));
    out.push(String::new());
    profile_lines(&mut out, &r.profile);
    let mut text = out.join("\n");
    text.push('\n');
    text
}

fn header(out: &mut Vec<String>, run: &Run<'_>, r: &Results) {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mem = read_proc("/proc/meminfo", "MemTotal").unwrap_or_default();
    let cpu = read_proc("/proc/cpuinfo", "model name").unwrap_or_default();
    let facts = &run.facts;
    let p5 = median(&r.fingerprint.measured);
    let p5_encode = median(&r.fingerprint.against);
    out.push(format!(
        "idem bench {}: backend {}, {} mode, {:.0} s",
        run.date,
        run.args.backend.name(),
        run.mode(),
        run.elapsed_s
    ));
    out.push(format!(
        "machine: {cores} cores ({cpu}), {mem} RAM; load {} at start, {} at end",
        run.load_start, run.load_end
    ));
    out.push(format!("server: {}", facts.server));
    out.push(format!("durability: {}", facts.durability));
    out.push(format!(
        "request: {} bytes of JSON ({} canonical bytes fingerprinted); \
         fingerprint {p5:.2} µs = encoding {p5_encode:.2} µs + SHA-256 {:.2} µs",
        facts.request_json_bytes,
        facts.request_canonical_bytes,
        p5 - p5_encode
    ));
}

fn latency_lines(out: &mut Vec<String>, plan: &Plan, latency: &Latency) {
    out.push(format!(
        "latency, 1 client: median of {} rounds x {} calls per variant (variants alternate call \
         by call, ABCD/DCBA)",
        plan.latency_rounds, plan.latency_calls
    ));
    out.push(format!(
        "  {:<14} {:>10} {:>10} {:>10} {:>9}",
        "variant", "median µs", "p90 µs", "p99 µs", "vs bare"
    ));
    let line = |out: &mut Vec<String>, v: Variant, phase: &PerVariant<Latencies>| {
        let l = &phase[v];
        out.push(format!(
            "  {:<14} {:>10.0} {:>10.0} {:>10.0} {:>9.2}",
            v.name(),
            l.median(),
            l.p90(),
            l.p99(),
            l.median() / phase[Variant::Bare].median()
        ));
    };
    for v in Variant::ALL {
        line(out, v, &latency.all);
    }
    out.push(format!(
        "bare and idem first alone, {} rounds x {} calls each, alternating AB/BA",
        plan.latency_rounds, plan.latency_calls
    ));
    let pinned = latency.pinned.as_ref();
    for (pair, how) in [
        (pinned, "pinned to one CPU (P1, P4)"),
        (Some(&latency.pair), "not pinned"),
    ] {
        let Some(pair) = pair else {
            out.push("  (not pinned: no taskset; P1/P4 come from the pair not pinned)".to_owned());
            continue;
        };
        out.push(format!("  {how}"));
        for v in PAIR {
            line(out, v, pair);
        }
    }
}

fn throughput_lines(out: &mut Vec<String>, plan: &Plan, throughput: &Throughput) {
    out.push(format!(
        "throughput, {} clients: median of {} rounds x {:.1} s",
        plan.clients,
        plan.tput_rounds,
        plan.tput_round.as_secs_f64()
    ));
    out.push(format!(
        "  {:<14} {:>10} {:>16}   server counters per call",
        "variant", "calls/s", "vs three-commit"
    ));
    for (v, rate) in throughput.rates() {
        let counters: Vec<String> = rate
            .counters_per_call()
            .map(|(k, per_call)| format!("{k} {per_call:.2}"))
            .collect();
        out.push(format!(
            "  {:<14} {:>10.0} {:>16.2}   {}",
            v.name(),
            rate.median(),
            rate.median() / throughput[Variant::ThreeCommit].median(),
            counters.join(", ")
        ));
    }
}

fn storm_lines(out: &mut Vec<String>, plan: &Plan, storm: &Storm) {
    out.push(format!(
        "storm: {} concurrent duplicates of one key against one execution, {} rounds \
         alternating (median µs until all answered)",
        plan.storm, plan.storm_rounds,
    ));
    for (pair, how) in [
        (storm.pinned.as_ref(), "pinned to one CPU (P6)"),
        (Some(&storm.unpinned), "not pinned"),
    ] {
        let Some(pair) = pair else {
            out.push("  (not pinned: no taskset; P6 comes from the storms not pinned)".to_owned());
            continue;
        };
        out.push(format!(
            "  {how}: storm {:.0}, one execution {:.0}, ratio {:.2}",
            median(&pair.measured),
            median(&pair.against),
            pair.ratio()
        ));
    }
    out.push(format!(
        "{n} concurrent replays (no execution), median µs until all answered: one key {:.0}, \
         {n} distinct keys {:.0}",
        median(&storm.replays.measured),
        median(&storm.replays.against),
        n = plan.storm
    ));
    out.push(format!(
        "storm scaling (median µs until all answered): {}",
        storm
            .scaling
            .iter()
            .map(|(n, t)| format!("{n} copies {t:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
}

fn ledger_lines(out: &mut Vec<String>, ledger: &Ledger) {
    for c in &ledger.cycles {
        let how = match c.how {
            PurgeHow::Batch(n) => format!("purge_expired(db, {n})"),
            PurgeHow::Paced => format!(
                "paced: ~{} ms statements + equal pauses, median {:.0} rows each",
                PACED_BUDGET.as_millis(),
                c.batch
            ),
        };
        out.push(format!(
            "purge [{how}]: {} expired records in {:.1} s, {} statements, {:.1} ms each (pauses \
             included); claim p99 \
             {:.0} µs during ({} claims) vs {:.0} µs without ({} claims): ratio {:.2}; p50 {:.0} vs {:.0} µs",
            c.deleted,
            c.purge_s,
            c.statements,
            c.purge_s * 1000.0 / c.statements.max(1) as f64,
            percentile(&c.during_us, 0.99),
            c.during_us.len(),
            percentile(&c.baseline_us, 0.99),
            c.baseline_us.len(),
            c.ratio(),
            percentile(&c.during_us, 0.5),
            percentile(&c.baseline_us, 0.5),
        ));
    }
    if let Some((deleted, s)) = ledger.quick_purge {
        out.push(format!(
            "purge: {deleted} synthetic expired records deleted in {s:.1} s (batch 10000)"
        ));
    }
}

fn outbox_lines(out: &mut Vec<String>, outbox: &OutboxFigures) {
    let (p8, p9) = match outbox {
        Ok(measured) => measured,
        Err(reason) => {
            out.push(format!("outbox relay (P8, P9): not measured: {reason}"));
            return;
        }
    };
    out.push(format!(
        "relay throughput, {} messages to JetStream (msg/s): idem 1 relay {:.0}, 4 relays {:.0}, \
         4 relays over 50 aggregates {:.0}; hand-written polling relay {:.0}; ratio 1 relay / \
         hand-written {:.2}",
        p8.messages,
        p8.idem_1_relay_per_s,
        p8.idem_4_relays_per_s,
        p8.idem_4_relays_50_aggregates_per_s,
        p8.hand_written_per_s,
        p8.ratio()
    ));
    out.push(format!(
        "commit-to-publish, {} messages at 100/s (ms): idem woken by commit p50 {:.2} p99 {:.2}; \
         hand-written polling every 100 ms p50 {:.2} p99 {:.2}",
        p9.messages, p9.wake_p50_ms, p9.wake_p99_ms, p9.polling_p50_ms, p9.polling_p99_ms
    ));
}

fn lease_lines(out: &mut Vec<String>, lease: &LeaseCost) {
    let per_call =
        |c: Option<f64>| c.map_or_else(|| "not counted".to_owned(), |c| format!("{c:.2}"));
    out.push(format!(
        "lease mode vs atomic mode, same handler, {} first executions each: median {:.0} µs vs \
         {:.0} µs (ratio {:.2}); write transactions per call {} vs {}",
        lease.calls,
        lease.lease_median_us,
        lease.atomic_median_us,
        lease.ratio(),
        per_call(lease.lease_commits_per_call),
        per_call(lease.atomic_commits_per_call)
    ));
}

fn figure_table(out: &mut Vec<String>, figures: &[Figure]) {
    out.push(format!(
        "  {:<3} {:<50} {:>8} {:>9} {:>5}",
        "", "figure", "value", "goal", "met"
    ));
    for f in figures {
        out.push(format!(
            "  {:<3} {:<50} {:>8} {:>9} {:>5}",
            f.id,
            f.what,
            fmt_opt(f.value, 2),
            f.goal_text(),
            match f.met() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        ));
        if let Some(reason) = &f.not_measured {
            out.push(format!("      n/a: {reason}"));
        }
    }
}

fn profile_lines(out: &mut Vec<String>, profile: &Profile) {
    out.push(
        "profile (one connection, sequential; statements counted by SeaORM's metric callback):"
            .to_owned(),
    );
    out.push(format!(
        "  {:<14} {:>8} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "variant", "wall µs", "statements", "in stmts µs", "outside µs", "client CPU", "server CPU"
    ));
    for v in Variant::ALL {
        let p = &profile.variants[v];
        out.push(format!(
            "  {:<14} {:>8} {:>10} {:>12} {:>12} {:>12} {:>12}",
            v.name(),
            fmt_opt(rounded(p.wall_us), 0),
            fmt_opt(rounded(p.statements), 1),
            fmt_opt(rounded(p.statement_us), 0),
            fmt_opt(rounded(p.outside_statements_us), 0),
            fmt_opt(rounded(p.client_cpu_us), 0),
            fmt_opt(rounded(p.server_cpu_us), 0),
        ));
        let mut extra: Vec<String> = p
            .server_counters
            .iter()
            .map(|(k, x)| format!("{k} {}", fmt_opt(rounded(*x), 1)))
            .collect();
        if let Some(frames) = p.sqlite_wal_frames.and_then(rounded) {
            extra.push(format!("WAL frames {frames:.1}"));
        }
        if !extra.is_empty() {
            out.push(format!("      per call: {}", extra.join(", ")));
        }
        for (k, cost) in &p.by_statement {
            out.push(format!(
                "      {:<32} {:>5} per call {:>8} µs",
                k,
                fmt_opt(rounded(cost.per_call), 1),
                fmt_opt(rounded(cost.us_per_call), 0)
            ));
        }
    }
    let frame = &profile.frame;
    out.push(format!(
        "  frame: acquire+ping+BEGIN {} µs, SELECT 1 round trip {} µs, COMMIT after one UPDATE {} µs, \
         ROLLBACK read-only {} µs",
        fmt_opt(rounded(frame.acquire_ping_begin), 0),
        fmt_opt(rounded(frame.select_1_round_trip), 0),
        fmt_opt(rounded(frame.commit_after_one_update), 0),
        fmt_opt(rounded(frame.rollback_read_only), 0),
    ));
}

/// The JSON object (the last line of stdout with `--json`). Keys keep their meaning from run to
/// run: `docs/BENCHMARKS.md` and CI read them.
pub(crate) fn json(run: &Run<'_>, r: &Results) -> Value {
    let figures = figures(run, r);
    let latencies = |variants: &[Variant], phase: &PerVariant<Latencies>| {
        let latency = |&v: &Variant| {
            let l = &phase[v];
            let percentiles =
                json!({"median_us": r3(l.median()), "p90_us": r3(l.p90()), "p99_us": r3(l.p99())});
            (v.key().to_owned(), percentiles)
        };
        variants.iter().map(latency).collect::<Map<String, Value>>()
    };
    let rates = r.throughput.rates();
    let throughput: Map<String, Value> = rates
        .iter()
        .map(|(v, rate)| (v.key().to_owned(), r3(rate.median())))
        .collect();
    let counters = |rate: &Rate| {
        rate.counters_per_call()
            .map(|(k, x)| (k.to_owned(), r3(x)))
            .collect::<Map<_, _>>()
    };
    let throughput_counters: Map<String, Value> = rates
        .iter()
        .map(|(v, rate)| (v.key().to_owned(), json!(counters(rate))))
        .collect();
    let goals: Map<String, Value> = figures
        .iter()
        .map(|f| (f.key.to_owned(), json!(f.met())))
        .collect();
    let storm = &r.storm;
    let scaling = storm
        .scaling
        .iter()
        .map(|(n, t)| json!({"copies": n, "all_answered_us": r3(*t)}));
    let purge = r.ledger.cycles.iter().map(|c| {
        json!({
            "deleted": c.deleted, "purge_s": r3(c.purge_s),
            "p99_during_us": r3(percentile(&c.during_us, 0.99)),
            "p99_baseline_us": r3(percentile(&c.baseline_us, 0.99)),
            "claims_during": c.during_us.len(), "ratio": r3(c.ratio()),
        })
    });
    let (p8, p9) = (
        r.outbox.as_ref().ok().map(|o| &o.0),
        r.outbox.as_ref().ok().map(|o| &o.1),
    );
    let lease = &r.lease;
    let details = json!({
        "backend": run.args.backend.name(),
        "mode": run.mode(),
        "date": run.date,
        "elapsed_s": r3(run.elapsed_s),
        "first_vs_bare": r3(r.latency.first_vs_bare()),
        "goals_met": goals,
        "latency": latencies(&Variant::ALL, &r.latency.all),
        "latency_pair": latencies(&PAIR, &r.latency.pair),
        "latency_pair_pinned": r.latency.pinned.as_ref().map(|p| latencies(&PAIR, p)),
        "first_vs_bare_unpinned": r3(r.latency.first_vs_bare_unpinned()),
        "first_vs_bare_among_all": r3(r.latency.first_vs_bare_among_all()),
        "throughput_per_s": throughput,
        "throughput_server_counters_per_call": throughput_counters,
        "storm": {
            "copies": run.plan.storm,
            "pinned": storm.pinned.as_ref().map(|p| json!({
                "all_answered_us": r3(median(&p.measured)),
                "single_us": r3(median(&p.against)),
            })),
            "all_answered_us": r3(median(&storm.unpinned.measured)),
            "single_us": r3(median(&storm.unpinned.against)),
            "storm_vs_single_unpinned": r3(storm.unpinned.ratio()),
            "replays_one_key_us": r3(median(&storm.replays.measured)),
            "replays_distinct_keys_us": r3(median(&storm.replays.against)),
            "scaling_us": scaling.collect::<Vec<_>>(),
        },
        "purge": purge.collect::<Vec<_>>(),
        "peak_rss_bytes": run.peak_rss_bytes,
        "ledger_bytes_per_million": r.ledger.size.per_million().round(),
        "request_json_bytes": run.facts.request_json_bytes,
        "request_canonical_bytes": run.facts.request_canonical_bytes,
        "fingerprint_encode_us": r3(median(&r.fingerprint.against)),
        "server": run.facts.server,
        "durability": run.facts.durability,
        "cores": std::thread::available_parallelism().map_or(0, usize::from),
        "load_start": run.load_start,
        "load_end": run.load_end,
        "profile": r.profile.json(),
        // P8's and P9's details (their figures are in the figure list): `null` when they were
        // not measured, and `p8_p9_not_measured` says why.
        "p8_messages": p8.map(|t| t.messages),
        "p8_idem_1_relay_per_s": p8.map(|t| r3(t.idem_1_relay_per_s)),
        "p8_idem_4_relays_per_s": p8.map(|t| r3(t.idem_4_relays_per_s)),
        "p8_idem_4_relays_50_aggregates_per_s": p8.map(|t| r3(t.idem_4_relays_50_aggregates_per_s)),
        "p8_hand_written_per_s": p8.map(|t| r3(t.hand_written_per_s)),
        "p9_messages": p9.map(|l| l.messages),
        "p9_wake_p50_ms": p9.map(|l| r3(l.wake_p50_ms)),
        "p9_polling_p50_ms": p9.map(|l| r3(l.polling_p50_ms)),
        "p9_polling_p99_ms": p9.map(|l| r3(l.polling_p99_ms)),
        "p8_p9_not_measured": r.outbox.as_ref().err(),
        // P10's details (its figure is in the figure list).
        "p10_calls": lease.calls,
        "p10_atomic_median_us": r3(lease.atomic_median_us),
        "p10_lease_median_us": r3(lease.lease_median_us),
        "p10_atomic_commits_per_call": lease.atomic_commits_per_call.map(r3),
        "p10_lease_commits_per_call": lease.lease_commits_per_call.map(r3),
    });
    let mut report: Map<String, Value> = figures
        .iter()
        .map(|f| (f.key.to_owned(), f.value.map_or(Value::Null, r3)))
        .collect();
    if let Value::Object(details) = details {
        report.extend(details);
    }
    Value::Object(report)
}
