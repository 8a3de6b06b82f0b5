//! P1, P2, P4: single-client latency of every variant; F1, F2: the same calls against the
//! floor, one round trip to the database timed in turn with them.

use std::time::Instant;

use sea_orm::{ConnectionTrait, Statement, TransactionTrait};

use crate::Res;
use crate::harness::{median, on_one_cpu, percentile, take_turns, us};
use crate::setup::{Bench, Plan, SLOT_LATENCY};
use crate::variants::{PerVariant, Variant};
use crate::workload::PayOrder;

/// Statements bare runs besides its transaction frame (read the order, insert the payment,
/// update the order): what F2 subtracts from bare to find bare's frame.
pub(crate) const BARE_STATEMENTS: f64 = 3.0;
/// Statements idem first adds to bare (the claim and the record): F1's denominator counts
/// this many round trips.
pub(crate) const IDEM_EXTRA_STATEMENTS: f64 = 2.0;

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

/// What takes a turn in a latency phase: a variant's call, or a timing of the floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Call(Variant),
    /// One `SELECT 1` on a connection of the pool, inside a transaction begun (and rolled
    /// back) outside the timing: one round trip to the server (on SQLite, one statement
    /// through sqlx's worker thread and back).
    RoundTrip,
    /// A whole read-only transaction of one statement from the pool: acquire (and the pool's
    /// ping), `BEGIN`, `SELECT 1`, `ROLLBACK`. What a replay would cost if its claim were free.
    ReadOnlyTransaction,
}

/// One phase of the latency figures: the variants that took part, and the floor timed in
/// turn with them.
#[derive(Debug, Default)]
pub(crate) struct Phase {
    pub(crate) variants: PerVariant<Latencies>,
    /// One round trip (see [`Turn::RoundTrip`]), timed in every phase.
    pub(crate) round_trip: Latencies,
    /// A read-only transaction of one statement (see [`Turn::ReadOnlyTransaction`]); timed
    /// in the phase of all four variants only (empty elsewhere).
    pub(crate) read_only_transaction: Latencies,
}

impl std::ops::Index<Variant> for Phase {
    type Output = Latencies;
    fn index(&self, v: Variant) -> &Latencies {
        &self.variants[v]
    }
}

impl Phase {
    /// F1: what idem first costs beyond bare, in round trips of its two extra statements:
    /// `(idem first − bare) / (2 × round trip)`. 1.0 is a claim and a record that cost one
    /// round trip each and nothing else.
    pub(crate) fn first_beyond_floor(&self) -> f64 {
        (self[Variant::IdemFirst].median() - self[Variant::Bare].median())
            / (IDEM_EXTRA_STATEMENTS * self.round_trip.median())
    }

    /// Bare's frame: bare without its statements' round trips (acquire and ping, `BEGIN`,
    /// `COMMIT` with its flush).
    pub(crate) fn bare_frame(&self) -> f64 {
        self[Variant::Bare].median() - BARE_STATEMENTS * self.round_trip.median()
    }

    /// F2: idem replay over bare's frame plus one round trip (the claim that finds the
    /// record): `replay / (bare − 3 × round trip + round trip)`. Only in the phase of all four.
    pub(crate) fn replay_vs_floor(&self) -> f64 {
        self[Variant::IdemReplay].median() / (self.bare_frame() + self.round_trip.median())
    }

    /// idem replay over a measured read-only transaction of one statement (beside F2).
    pub(crate) fn replay_vs_read_only_transaction(&self) -> f64 {
        self[Variant::IdemReplay].median() / self.read_only_transaction.median()
    }
}

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
    pub(crate) pinned: Option<Phase>,
    /// bare and idem first alone, not pinned.
    pub(crate) pair: Phase,
    /// Every variant, calls alternating ABCD/DCBA.
    pub(crate) all: Phase,
}

impl Latency {
    /// The pair P1, P4 and F1 come from: pinned where it could be.
    pub(crate) fn figure_pair(&self) -> &Phase {
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

    /// F1 from the pair P1/P4 come from (pinned where it could be).
    pub(crate) fn first_beyond_floor(&self) -> f64 {
        self.figure_pair().first_beyond_floor()
    }

    /// F2, from the phase of all four variants (the only one with replays).
    pub(crate) fn replay_vs_floor(&self) -> f64 {
        self.all.replay_vs_floor()
    }

    /// P2: idem replay over idem first.
    pub(crate) fn replay_vs_first(&self) -> f64 {
        self.all[Variant::IdemReplay].median() / self.all[Variant::IdemFirst].median()
    }
}

fn ratio(latencies: &Phase) -> f64 {
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

/// One timing of the floor: a round trip, or a read-only transaction of one statement.
async fn floor(b: &Bench, turn: Turn) -> Res<f64> {
    let one = Statement::from_string(b.sql.backend, "SELECT 1");
    if turn == Turn::ReadOnlyTransaction {
        let start = Instant::now();
        let tx = b.db.begin().await?;
        tx.query_one_raw(one).await?;
        tx.rollback().await?;
        return Ok(us(start.elapsed()));
    }
    let tx = b.db.begin().await?;
    let start = Instant::now();
    tx.query_one_raw(one).await?;
    let took = us(start.elapsed());
    tx.rollback().await?;
    Ok(took)
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
/// turns call by call with the floor's timings: a round trip in every phase, and with all
/// four variants a read-only transaction too.
async fn rounds(
    b: &Bench,
    plan: &Plan,
    variants: &[Variant],
    recorded: &mut Vec<PayOrder>,
    what: &str,
) -> Res<Phase> {
    let n = plan.latency_calls;
    let mut turns: Vec<Turn> = variants.iter().map(|&v| Turn::Call(v)).collect();
    turns.push(Turn::RoundTrip);
    if variants.len() == Variant::ALL.len() {
        turns.push(Turn::ReadOnlyTransaction);
    }
    let turn = async |turn, t| match turn {
        Turn::Call(v) => {
            let (round, i) = (t / n, t % n);
            call(b, v, i, round * n + i * 7, recorded).await
        }
        floor_turn => floor(b, floor_turn).await,
    };
    let progress = |t: usize| {
        let round = t / n;
        if t % n == n - 1 && round % 5 == 4 {
            let rounds = plan.latency_rounds;
            b.progress(&format!("{what}: round {}/{rounds}", round + 1));
        }
    };
    let samples = take_turns(&turns, plan.latency_rounds * n, turn, progress).await?;
    let mut out = Phase::default();
    for (&turn, calls) in turns.iter().zip(samples) {
        let latencies = Latencies {
            round_medians: calls.chunks(n).map(median).collect(),
            calls,
        };
        match turn {
            Turn::Call(v) => out.variants[v] = latencies,
            Turn::RoundTrip => out.round_trip = latencies,
            Turn::ReadOnlyTransaction => out.read_only_transaction = latencies,
        }
    }
    Ok(out)
}
