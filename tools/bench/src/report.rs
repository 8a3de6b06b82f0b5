//! The report: the figures against their goals, the table on stdout, and the JSON object.

use std::time::Instant;

use serde_json::{Map, Value, json};

use crate::counters::{hashing_cpu_flags, loadavg, peak_rss_bytes, read_proc, utc_date};
use crate::drivers::ByDriver;
use crate::fingerprint::FingerprintCost;
use crate::growth::{GOAL_LARGE, GOAL_SMALL, Growth};
use crate::harness::{fmt_opt, median, percentile, r3, rounded};
use crate::http_layer::{HttpFigures, Route, SAME_KEY_REQUESTS};
use crate::latency::{Latency, PAIR, Phase};
use crate::lease::LeaseCost;
use crate::ledger::{Ledger, PACED_BUDGET, PurgeHow};
use crate::outbox::OutboxFigures;
use crate::profile::Profile;
use crate::setup::{Args, Backend, Checked, Facts, Plan};
use crate::storm::Storm;
use crate::throughput::{Rate, Throughput};
use crate::variants::Variant;

/// Everything the figures measured.
#[derive(Debug)]
pub(crate) struct Results {
    /// The whole fingerprint, its encoding (most blocks hashed on the way), SHA-256 of its bytes.
    pub(crate) fingerprint: FingerprintCost,
    pub(crate) latency: Latency,
    /// F1 per driver (PostgreSQL only).
    pub(crate) drivers: Option<ByDriver>,
    pub(crate) throughput: Throughput,
    pub(crate) storm: Storm,
    pub(crate) profile: Profile,
    pub(crate) ledger: Ledger,
    pub(crate) checked: Checked,
    pub(crate) outbox: OutboxFigures,
    pub(crate) lease: LeaseCost,
    pub(crate) http: HttpFigures,
    pub(crate) growth: Growth,
}

/// How the run went, besides the figures.
#[derive(Debug)]
pub(crate) struct Run<'a> {
    pub(crate) args: &'a Args,
    pub(crate) plan: &'a Plan,
    pub(crate) facts: Facts,
    /// When the run started (UTC, to the second).
    pub(crate) started_at: String,
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
        started_at: String,
        load_start: String,
    ) -> Self {
        Self {
            args,
            plan,
            facts,
            started_at,
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

/// Every figure: its id, its key in the JSON, its goal, and what it measures. Some goals hold
/// on some backends only: [`figures`] drops them elsewhere.
#[rustfmt::skip] // a table: one figure a line
const FIGURES: [(&str, &str, Goal, &str); 22] = [
    ("P1", "p1_first_vs_bare", Max(1.10), "idem first / bare latency (PostgreSQL, durable)"),
    ("F1", "f1_first_beyond_floor", Max(1.25), "(idem first - bare) / (2 x round trip)"),
    ("P2", "p2_replay_vs_first", Max(0.33), "idem replay / idem first latency"),
    ("F2", "f2_replay_vs_floor", Max(1.25), "idem replay / (bare's frame + 1 round trip)"),
    ("P3", "p3_vs_three_commit", Min(2.0), "idem first / three-commit throughput, 16 clients"),
    ("P4", "p4_sqlite_first_vs_bare", Max(1.20), "idem first / bare latency (SQLite file, WAL)"),
    ("P5", "p5_fingerprint_us", Max(2.0), "fingerprint of the 1 KiB request, µs"),
    ("P5h", "p5_fingerprint_vs_sha256", Max(1.3), "fingerprint / SHA-256 of its canonical bytes"),
    ("P6", "p6_storm_vs_single", Max(3.0), "64 duplicates answered / one execution"),
    ("P7", "p7_purge_p99_ratio", Max(2.0), "claim p99 during a purge / without"),
    ("P8", "p8_ratio", Min(3.0), "idem relay / hand-written polling relay, msg/s"),
    ("P9", "p9_wake_p99_ms", Max(10.0), "commit-to-publish p99 (relay woken by commit), ms"),
    ("P10", "p10_ratio", Unset, "lease / atomic mode latency, same handler"),
    ("P11r", "p11_replay_p50_vs_peer", Max(1.0), "HTTP layer replay p50, idem / axum-idempotent"),
    ("P11f", "p11_first_p50_vs_peer", Max(2.0), "HTTP layer first p50, idem / peer (goal: SQLite)"),
    ("P11t", "p11_rps_vs_peer", Min(0.33), "HTTP layer req/s at 16 clients, idem / peer"),
    ("P11rs", "p11_sqlx_replay_p50_vs_peer", Max(1.0), "the same on idem's sqlx store: replay p50 / peer"),
    ("P11fs", "p11_sqlx_first_p50_vs_peer", Max(2.0), "the same on idem's sqlx store: first p50 / peer"),
    ("P11ts", "p11_sqlx_rps_vs_peer", Min(0.33), "the same on idem's sqlx store: req/s / peer"),
    ("P12", "p12_claim_p99_growth", Max(1.5), "claim p99, large / small ledger (goal: PG 10M/100k)"),
    ("P12r", "p12_replay_p99_growth", Max(1.5), "replay p99, large / small ledger (goal: PG 10M/100k)"),
    ("P12s", "p12_bytes_per_record", Max(250.0), "ledger bytes per record (142-byte answer)"),
];

/// Whether a figure's goal holds for this run: P11f's on SQLite, P11t's on SQLite and
/// PostgreSQL, P12's growth goals on PostgreSQL between 100,000 and 10,000,000 records.
fn goal_applies(id: &str, backend: Backend, growth: &Growth) -> bool {
    match id {
        "P11f" | "P11fs" => backend == Backend::Sqlite,
        "P11t" | "P11ts" => backend != Backend::Mysql,
        "P12" | "P12r" => backend == Backend::Postgres && growth.compares_goal_sizes(),
        _ => true,
    }
}

fn figures(run: &Run<'_>, r: &Results) -> Vec<Figure> {
    let backend = run.args.backend;
    let first_vs_bare = r.latency.first_vs_bare();
    let outbox = r.outbox.as_ref().ok();
    let values = [
        (backend == Backend::Postgres).then_some(first_vs_bare),
        Some(r.latency.first_beyond_floor()),
        Some(r.latency.replay_vs_first()),
        Some(r.latency.replay_vs_floor()),
        Some(r.throughput.idem_vs_three_commit()),
        (backend == Backend::Sqlite).then_some(first_vs_bare),
        Some(r.fingerprint.whole_us()),
        Some(r.fingerprint.vs_sha256()),
        Some(r.storm.storm_vs_single()),
        r.ledger.p7_ratio(),
        outbox.map(|(p8, _)| p8.ratio()),
        outbox.map(|(_, p9)| p9.wake_p99_ms),
        Some(r.lease.ratio()),
        r.http.replay_p50_vs_peer(Route::Idem),
        r.http.first_p50_vs_peer(Route::Idem),
        r.http.rps_vs_peer(Route::Idem),
        r.http.replay_p50_vs_peer(Route::IdemSqlx),
        r.http.first_p50_vs_peer(Route::IdemSqlx),
        r.http.rps_vs_peer(Route::IdemSqlx),
        r.growth.claim_p99_growth(),
        r.growth.replay_p99_growth(),
        // Without P12, the ledger size figure's expired records (the same shape) give it.
        r.growth
            .bytes_per_record()
            .or(Some(r.ledger.size.per_million() / 1e6)),
    ];
    let figure = |(&(id, key, goal, what), value): (
        &(&'static str, &'static str, Goal, &'static str),
        Option<f64>,
    )| {
        // P8 and P9 say why NATS could not be reached, P11 why the peer's Redis could not.
        let not_measured = match id {
            "P8" | "P9" => r.outbox.as_ref().err().cloned(),
            "P11r" | "P11f" | "P11t" | "P11rs" | "P11fs" | "P11ts" => {
                r.http.peer.as_ref().err().cloned()
            }
            _ => None,
        };
        Figure {
            id,
            key,
            what,
            value,
            goal: if goal_applies(id, backend, &r.growth) {
                goal
            } else {
                Unset
            },
            not_measured,
        }
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
    if let Some(drivers) = &r.drivers {
        out.extend(drivers.lines(run.plan));
        out.push(String::new());
    }
    throughput_lines(&mut out, run.plan, &r.throughput);
    out.push(String::new());
    storm_lines(&mut out, run.plan, &r.storm);
    ledger_lines(&mut out, &r.ledger);
    outbox_lines(&mut out, &r.outbox);
    lease_lines(&mut out, &r.lease);
    out.push(String::new());
    http_lines(&mut out, &r.http);
    growth_lines(&mut out, &r.growth);
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
    let fp = &r.fingerprint;
    out.push(format!(
        "idem bench {} (started {}): backend {}, {} mode, {:.0} s",
        run.date,
        run.started_at,
        run.args.backend.name(),
        run.mode(),
        run.elapsed_s
    ));
    out.push(format!(
        "machine: {cores} cores ({cpu}), {mem} RAM; load {} at start, {} at end; CPU flags for \
         hashing: {}",
        run.load_start,
        run.load_end,
        flags_text(&hashing_cpu_flags())
    ));
    out.push(format!("server: {}", facts.server));
    out.push(format!("durability: {}", facts.durability));
    out.push(format!(
        "request: {} bytes of JSON ({} canonical bytes fingerprinted); fingerprint {:.2} µs = \
         encoding with most blocks hashed {:.2} µs + the rest; SHA-256 of the same bytes alone {:.2} µs (ratio {:.2})",
        facts.request_json_bytes,
        facts.request_canonical_bytes,
        fp.whole_us(),
        fp.encoding_us(),
        fp.sha256_us(),
        fp.vs_sha256()
    ));
}

fn flags_text(flags: &[&str]) -> String {
    if flags.is_empty() {
        "none of sha_ni, avx2, ssse3".to_owned()
    } else {
        flags.join(", ")
    }
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
    let line = |out: &mut Vec<String>, v: Variant, phase: &Phase| {
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
    floor_lines(out, &latency.all, true);
    out.push(format!(
        "bare and idem first alone, {} rounds x {} calls each, alternating AB/BA",
        plan.latency_rounds, plan.latency_calls
    ));
    let pinned = latency.pinned.as_ref();
    if let Some(pinned) = pinned
        && pinned[Variant::Bare].median() > 2.0 * latency.pair[Variant::Bare].median()
    {
        // Pinned to CPU 0, the bench waits for whatever else runs there: every hand-off to
        // the driver's thread then costs a scheduler slice, and the pinned figures measure the
        // other work, not idem.
        out.push(
            "  warning: bare pinned is over twice bare not pinned: CPU 0 was busy with other \
             work (see the load), so P1/P4/F1, which come from the pinned pair, are not \
             meaningful in this run; the pair not pinned is printed below"
                .to_owned(),
        );
    }
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
        floor_lines(out, pair, false);
    }
}

/// The floor timed in turn with a phase's calls, and the calls against it (F1, F2).
fn floor_lines(out: &mut Vec<String>, phase: &Phase, with_replays: bool) {
    let rt = &phase.round_trip;
    out.push(format!(
        "  {:<14} {:>10.0} {:>10.0} {:>10.0}   (SELECT 1 in an open transaction, in turn with \
         the calls)",
        "round trip",
        rt.median(),
        rt.p90(),
        rt.p99()
    ));
    if with_replays {
        let tx = &phase.read_only_transaction;
        out.push(format!(
            "  {:<14} {:>10.0} {:>10.0} {:>10.0}   (acquire, BEGIN, SELECT 1, ROLLBACK)",
            "read-only tx",
            tx.median(),
            tx.p90(),
            tx.p99()
        ));
        out.push(format!(
            "  against the floor: (idem first - bare) / (2 x round trip) {:.2}; idem replay / \
             (bare's frame {:.0} µs + 1 round trip) {:.2}; idem replay / read-only tx {:.2}",
            phase.first_beyond_floor(),
            phase.bare_frame(),
            phase.replay_vs_floor(),
            phase.replay_vs_read_only_transaction()
        ));
    } else {
        out.push(format!(
            "  against the floor: (idem first - bare) / (2 x round trip) {:.2}",
            phase.first_beyond_floor()
        ));
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

/// P10's lines alone (`--lease`).
pub(crate) fn lease_table(lease: &LeaseCost) -> String {
    let mut out = Vec::new();
    lease_lines(&mut out, lease);
    out.iter().map(|line| format!("{line}\n")).collect()
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

/// P11's lines alone (`--http`).
pub(crate) fn http_table(http: &HttpFigures) -> String {
    let mut out = Vec::new();
    http_lines(&mut out, http);
    out.iter().map(|line| format!("{line}\n")).collect()
}

fn http_lines(out: &mut Vec<String>, http: &HttpFigures) {
    out.push(format!(
        "HTTP layer (P11), one axum server: {} new keys per route and round, each sent twice \
         on one keep-alive connection, then {} connections sending new keys for {:.0} s; {}-byte \
         JSON requests; median of {} rounds, routes alternating",
        http.keys_per_round, http.clients, http.seconds, http.request_bytes, http.rounds
    ));
    match &http.peer {
        Ok(setup) => out.push(format!("  peer: {setup}")),
        Err(reason) => out.push(format!("  peer: not measured: {reason}")),
    }
    out.push(format!(
        "  {:<9} {:>12} {:>12} {:>13} {:>13} {:>10}   replays marked",
        "route", "first p50 µs", "first p99 µs", "replay p50 µs", "replay p99 µs", "req/s"
    ));
    for route in Route::ALL {
        let Some(f) = http.route(route) else {
            continue;
        };
        out.push(format!(
            "  {:<9} {:>12.0} {:>12.0} {:>13.0} {:>13.0} {:>10.0}   {} of {}",
            route.key(),
            f.first_p50(),
            f.first_p99(),
            f.replay_p50(),
            f.replay_p99(),
            f.rps(),
            f.replays - f.replays_not_marked,
            f.replays
        ));
    }
    // Where a first request's time goes: its two durable commits (the lease's claim, the
    // record), each at least a commit of the database's own.
    if !http.commit_p50_us.is_empty() {
        let commit = median(&http.commit_p50_us);
        for route in [Route::Idem, Route::IdemSqlx] {
            if let (Some(f), Some(bare)) = (http.route(route), http.route(Route::Bare)) {
                let above_bare = f.first_p50() - bare.first_p50();
                out.push(format!(
                    "  {}: first p50 {:.0} µs above bare's; its 2 durable commits at least 2 x \
                     {commit:.0} µs (a one-row INSERT auto-committed, p50, same rounds): {:.0} \
                     µs of idem's own beyond them",
                    route.key(),
                    above_bare,
                    above_bare - 2.0 * commit
                ));
            }
        }
    }
    for (idem, store) in [(Route::Idem, "SeaORM"), (Route::IdemSqlx, "sqlx")] {
        if let (Some(first), Some(replay), Some(rps)) = (
            http.first_p50_vs_peer(idem),
            http.replay_p50_vs_peer(idem),
            http.rps_vs_peer(idem),
        ) {
            out.push(format!(
                "  {} ({store} store) / peer: first p50 {first:.2}, replay p50 {replay:.2}, \
                 req/s {rps:.2}",
                idem.key()
            ));
        }
    }
    let g = &http.guarantees;
    for (route, probe) in &g.same_key_at_once {
        out.push(format!(
            "  {SAME_KEY_REQUESTS} requests with one key at once, {}: the route ran {} times; \
             answers {}",
            route.key(),
            probe.executions,
            probe.statuses_text()
        ));
    }
    for (route, probe) in &g.key_reused_with_other_body {
        out.push(format!(
            "  a key sent again with another body, {}: the route ran {} times; answers {}",
            route.key(),
            probe.executions,
            probe.statuses_text()
        ));
    }
    if let Some(probe) = &g.peer_without_session {
        out.push(format!(
            "  peer, one key sent twice without a session cookie: the route ran {} times",
            probe.executions
        ));
    }
    if let Some(ttl) = g.peer_entry_ttl_s {
        out.push(format!(
            "  peer, TTL of a session holding an entry: {ttl} s{}",
            if ttl == -1 {
                " (-1: never expires)"
            } else {
                ""
            }
        ));
    }
}

fn growth_lines(out: &mut Vec<String>, growth: &Growth) {
    if growth.sizes.is_empty() {
        out.push(
            "ledger growth (P12): not measured (--ledger-records N[,N...] measures it)".to_owned(),
        );
        return;
    }
    out.push(format!(
        "ledger growth (P12): claims (new key, empty body) and replays (recent keys) taking \
         turns, {} each per size; live synthetic records with a {}-byte answer",
        growth.sizes.first().map_or(0, |s| s.claim_us.len()),
        growth.response_bytes
    ));
    out.push(format!(
        "  {:>12} {:>12} {:>12} {:>13} {:>13} {:>10} {:>8}",
        "records",
        "claim p50 µs",
        "claim p99 µs",
        "replay p50 µs",
        "replay p99 µs",
        "bytes/rec",
        "fill s"
    ));
    for s in &growth.sizes {
        out.push(format!(
            "  {:>12} {:>12.0} {:>12.0} {:>13.0} {:>13.0} {:>10.0} {:>8.1}",
            s.records,
            s.claim_p50(),
            s.claim_p99(),
            s.replay_p50(),
            s.replay_p99(),
            s.bytes_per_record,
            s.fill_s
        ));
    }
    if let Some((large, small)) = growth.compared() {
        out.push(format!(
            "  p99 at {} records / at {}: claim {:.2}, replay {:.2}{}",
            large.records,
            small.records,
            large.claim_p99() / small.claim_p99(),
            large.replay_p99() / small.replay_p99(),
            if growth.compares_goal_sizes() {
                String::new()
            } else {
                format!(" (the goal compares {GOAL_LARGE} with {GOAL_SMALL} on PostgreSQL)")
            }
        ));
    }
}

fn figure_table(out: &mut Vec<String>, figures: &[Figure]) {
    out.push(format!(
        "  {:<4} {:<50} {:>8} {:>9} {:>5}",
        "", "figure", "value", "goal", "met"
    ));
    for f in figures {
        out.push(format!(
            "  {:<4} {:<50} {:>8} {:>9} {:>5}",
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
    let latencies = |variants: &[Variant], phase: &Phase| {
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
        "fingerprint_encode_us": r3(r.fingerprint.encoding_us()),
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
    // Round 3's keys (one `json!` holds only so many).
    let round_3 = json!({
        "started_at": run.started_at,
        "cpu_flags": hashing_cpu_flags(),
        "fingerprint_sha256_us": r3(r.fingerprint.sha256_us()),
        "floor": floor_json(&r.latency),
        "p11": http_json(&r.http),
        "p12": growth_json(&r.growth),
        "f1_by_driver": r.drivers.as_ref().map(ByDriver::json),
    });
    let mut report: Map<String, Value> = figures
        .iter()
        .map(|f| (f.key.to_owned(), f.value.map_or(Value::Null, r3)))
        .collect();
    for part in [details, round_3] {
        if let Value::Object(part) = part {
            report.extend(part);
        }
    }
    Value::Object(report)
}

/// The floor and the calls against it, per latency phase: `floor` in the JSON.
fn floor_json(latency: &Latency) -> Value {
    let phase = |p: &Phase| {
        json!({
            "round_trip_us": r3(p.round_trip.median()),
            "round_trip_p99_us": r3(p.round_trip.p99()),
            "first_beyond_floor": r3(p.first_beyond_floor()),
        })
    };
    let all = &latency.all;
    json!({
        "pinned": latency.pinned.as_ref().map(phase),
        "pair": phase(&latency.pair),
        "all": {
            "round_trip_us": r3(all.round_trip.median()),
            "round_trip_p99_us": r3(all.round_trip.p99()),
            "read_only_transaction_us": r3(all.read_only_transaction.median()),
            "bare_frame_us": r3(all.bare_frame()),
            "first_beyond_floor": r3(all.first_beyond_floor()),
            "replay_vs_floor": r3(all.replay_vs_floor()),
            "replay_vs_read_only_transaction": r3(all.replay_vs_read_only_transaction()),
        },
    })
}

/// P11's details: `p11` in the JSON (its ratios are in the figure list).
fn http_json(http: &HttpFigures) -> Value {
    let routes: Map<String, Value> = Route::ALL
        .into_iter()
        .map(|route| {
            let figures = http.route(route).map(|f| {
                json!({
                    "first_p50_us": r3(f.first_p50()), "first_p99_us": r3(f.first_p99()),
                    "replay_p50_us": r3(f.replay_p50()), "replay_p99_us": r3(f.replay_p99()),
                    "requests_per_s": r3(f.rps()),
                    "replays": f.replays, "replays_not_marked": f.replays_not_marked,
                })
            });
            (route.key().to_owned(), figures.unwrap_or(Value::Null))
        })
        .collect();
    let probes = |probes: &[(Route, crate::http_layer::Probe)]| {
        probes
            .iter()
            .map(|(route, p)| {
                let statuses: Map<String, Value> = p
                    .statuses
                    .iter()
                    .map(|(code, n)| (code.to_string(), json!(n)))
                    .collect();
                (
                    route.key().to_owned(),
                    json!({"executions": p.executions, "statuses": statuses}),
                )
            })
            .collect::<Map<String, Value>>()
    };
    let g = &http.guarantees;
    json!({
        "keys_per_round": http.keys_per_round,
        "rounds": http.rounds,
        "commit_p50_us": (!http.commit_p50_us.is_empty()).then(|| r3(median(&http.commit_p50_us))),
        "clients": http.clients,
        "seconds": http.seconds,
        "request_bytes": http.request_bytes,
        "peer_setup": http.peer.as_ref().ok(),
        "peer_not_measured": http.peer.as_ref().err(),
        "routes": routes,
        "same_key_requests": SAME_KEY_REQUESTS,
        "same_key_at_once": probes(&g.same_key_at_once),
        "key_reused_with_other_body": probes(&g.key_reused_with_other_body),
        "peer_without_session_executions": g.peer_without_session.as_ref().map(|p| p.executions),
        "peer_entry_ttl_s": g.peer_entry_ttl_s,
    })
}

/// P12's details: `p12` in the JSON, one entry per ledger size (empty without
/// `--ledger-records`).
fn growth_json(growth: &Growth) -> Value {
    let sizes: Vec<Value> = growth
        .sizes
        .iter()
        .map(|s| {
            json!({
                "records": s.records,
                "claim_p50_us": r3(s.claim_p50()), "claim_p99_us": r3(s.claim_p99()),
                "replay_p50_us": r3(s.replay_p50()), "replay_p99_us": r3(s.replay_p99()),
                "bytes_per_record": r3(s.bytes_per_record),
                "calls": s.claim_us.len(),
                "fill_s": r3(s.fill_s),
            })
        })
        .collect();
    json!({"response_bytes": growth.response_bytes, "sizes": sizes})
}
