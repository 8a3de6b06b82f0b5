//! P1, P2, P4: single-client latency of every variant.

use std::time::Instant;

use crate::Res;
use crate::harness::{median, on_one_cpu, percentile, take_turns, us};
use crate::setup::{Bench, Plan, SLOT_LATENCY};
use crate::variants::{PerVariant, Variant};
use crate::workload::PayOrder;

/// One variant's latencies, in µs.
#[derive(Debug, Default)]
pub(crate) struct Latencies {
    /// The median of every round.
    pub(crate) round_medians: Vec<f64>,
    /// Every call.
    pub(crate) calls: Vec<f64>,
}

impl Latencies {
    /// The figure: the median of the round medians.
    pub(crate) fn median(&self) -> f64 {
        median(&self.round_medians)
    }

    pub(crate) fn p90(&self) -> f64 {
        percentile(&self.calls, 0.90)
    }

    pub(crate) fn p99(&self) -> f64 {
        percentile(&self.calls, 0.99)
    }
}

/// The variants that take turns in the pair phases (P1, P4).
pub(crate) const PAIR: [Variant; 2] = [Variant::Bare, Variant::IdemFirst];

/// Single-client latencies: bare and idem first alone, with the process pinned to one CPU (P1,
/// P4) and not pinned, then every variant taking turns (the table, P2).
///
/// Why the pair alone, first: on SQLite every call waits for an fsync, and a burst of writes
/// (three-commit's three fsyncs per call) slows the disk for a while; the pair runs before any
/// other variant wrote.
///
/// Why pinned: a call hands work to the database driver's thread and back once per statement
/// (sqlx runs each SQLite connection on a thread of its own), and on this VM a hand-off to a
/// thread on the other, idle vCPU sometimes costs tens of µs and sometimes not, in stretches:
/// the same code measured bare at 350 or 700 µs from one process to the next, and idem first /
/// bare anywhere from 0.94 to 1.33. With every thread on one CPU a hand-off is a plain context
/// switch, and the ratio measures the work (statements, fsynced pages, fingerprint). The
/// unpinned pair is reported beside it.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    /// bare and idem first alone, the process pinned to one CPU (the other variants stay
    /// empty); `None` where it could not be pinned (no `taskset`), and then P1/P4 come from
    /// the unpinned pair.
    pub(crate) pinned: Option<PerVariant<Latencies>>,
    /// bare and idem first alone, not pinned.
    pub(crate) pair: PerVariant<Latencies>,
    /// Every variant, calls alternating ABCD/DCBA.
    pub(crate) all: PerVariant<Latencies>,
}

impl Latency {
    /// The pair P1 and P4 come from: pinned where it could be.
    pub(crate) fn figure_pair(&self) -> &PerVariant<Latencies> {
        self.pinned.as_ref().unwrap_or(&self.pair)
    }

    /// idem first over bare, measured alone: P1 on PostgreSQL, P4 on SQLite.
    pub(crate) fn first_vs_bare(&self) -> f64 {
        ratio(self.figure_pair())
    }

    /// idem first over bare, alone, not pinned (reported beside P1/P4).
    pub(crate) fn first_vs_bare_unpinned(&self) -> f64 {
        ratio(&self.pair)
    }

    /// idem first over bare among all four variants (reported beside P1/P4).
    pub(crate) fn first_vs_bare_among_all(&self) -> f64 {
        ratio(&self.all)
    }

    /// P2: idem replay over idem first.
    pub(crate) fn replay_vs_first(&self) -> f64 {
        self.all[Variant::IdemReplay].median() / self.all[Variant::IdemFirst].median()
    }
}

fn ratio(latencies: &PerVariant<Latencies>) -> f64 {
    latencies[Variant::IdemFirst].median() / latencies[Variant::Bare].median()
}

pub(crate) async fn measure(b: &Bench, plan: &Plan) -> Res<Latency> {
    // Requests idem first has recorded: idem replay sends them again.
    let mut recorded: Vec<PayOrder> = Vec::new();
    warm_up(b, plan, &PAIR, &mut recorded).await?;
    let what = "latency, pinned to one CPU";
    let pinned = on_one_cpu(async || rounds(b, plan, &PAIR, &mut recorded, what).await).await?;
    let what = "latency, bare and idem first";
    let pair = rounds(b, plan, &PAIR, &mut recorded, what).await?;
    warm_up(b, plan, &Variant::ALL, &mut recorded).await?;
    let all = rounds(b, plan, &Variant::ALL, &mut recorded, "latency").await?;
    Ok(Latency { pinned, pair, all })
}

/// One call of `v` on one of the latency client's orders (`i`), or for a replay the recorded
/// request `replay` (modulo their number): its µs. idem first's requests are recorded.
async fn call(
    b: &Bench,
    v: Variant,
    i: usize,
    replay: usize,
    recorded: &mut Vec<PayOrder>,
) -> Res<f64> {
    let cmd = match v {
        Variant::IdemReplay => recorded[replay % recorded.len()].clone(),
        _ => b.command(SLOT_LATENCY, i),
    };
    let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
    let start = Instant::now();
    b.call(v, cmd).await?;
    let took = us(start.elapsed());
    recorded.extend(keep);
    Ok(took)
}

/// Warm-up: prepared statements, pool connections, caches.
async fn warm_up(
    b: &Bench,
    plan: &Plan,
    variants: &[Variant],
    recorded: &mut Vec<PayOrder>,
) -> Res<()> {
    for &v in variants {
        for i in 0..plan.latency_calls.min(20) {
            call(b, v, i, i, recorded).await?;
        }
    }
    Ok(())
}

/// `plan.latency_rounds` rounds of `plan.latency_calls` calls of each of `variants`, taking
/// turns call by call.
async fn rounds(
    b: &Bench,
    plan: &Plan,
    variants: &[Variant],
    recorded: &mut Vec<PayOrder>,
    what: &str,
) -> Res<PerVariant<Latencies>> {
    let n = plan.latency_calls;
    let turn = async |v, t| {
        let (round, i) = (t / n, t % n);
        call(b, v, i, round * n + i * 7, recorded).await
    };
    let progress = |t: usize| {
        let round = t / n;
        if t % n == n - 1 && round % 5 == 4 {
            let rounds = plan.latency_rounds;
            b.progress(&format!("{what}: round {}/{rounds}", round + 1));
        }
    };
    let calls = take_turns(variants, plan.latency_rounds * n, turn, progress).await?;
    let mut out = PerVariant::<Latencies>::default();
    for (&v, calls) in variants.iter().zip(calls) {
        out[v] = Latencies {
            round_medians: calls.chunks(n).map(median).collect(),
            calls,
        };
    }
    Ok(out)
}
