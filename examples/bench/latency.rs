//! P1, P2, P4: single-client latency of every variant.

use std::time::Instant;

use crate::Res;
use crate::setup::{Bench, Plan, SLOT_LATENCY};
use crate::stats::{alternate, median, percentile, us};
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

pub(crate) type Latency = PerVariant<Latencies>;

impl Latency {
    /// idem first over bare: P1 on PostgreSQL, P4 on SQLite.
    pub(crate) fn first_vs_bare(&self) -> f64 {
        self.idem_first.median() / self.bare.median()
    }

    /// P2: idem replay over idem first.
    pub(crate) fn replay_vs_first(&self) -> f64 {
        self.idem_replay.median() / self.idem_first.median()
    }
}

/// Single-client latency of every variant (P1, P2, P4). Variants alternate call by call
/// (ABCD, DCBA, …): a slow or fast phase of the machine hits all of them alike.
pub(crate) async fn measure(b: &Bench, plan: &Plan) -> Res<Latency> {
    let n = plan.latency_calls;
    // Requests idem first has recorded: idem replay sends them again.
    let mut recorded: Vec<PayOrder> = Vec::new();
    // Warm-up: prepared statements, pool connections, caches.
    for v in Variant::ALL {
        for i in 0..n.min(20) {
            let cmd = match v {
                Variant::IdemReplay => recorded[i % recorded.len()].clone(),
                _ => b.command(SLOT_LATENCY, i),
            };
            let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
            b.call(v, cmd).await?;
            recorded.extend(keep);
        }
    }
    let mut out = Latency::default();
    for round in 0..plan.latency_rounds {
        let mut this_round: PerVariant<Vec<f64>> = PerVariant::default();
        for i in 0..n {
            for v in alternate(&Variant::ALL, round * n + i) {
                let cmd = match v {
                    Variant::IdemReplay => recorded[(round * n + i * 7) % recorded.len()].clone(),
                    _ => b.command(SLOT_LATENCY, i),
                };
                let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
                let start = Instant::now();
                b.call(v, cmd).await?;
                this_round.get_mut(v).push(us(start.elapsed()));
                recorded.extend(keep);
            }
        }
        for v in Variant::ALL {
            let calls = this_round.get_mut(v);
            let latencies = out.get_mut(v);
            latencies.round_medians.push(median(calls));
            latencies.calls.append(calls);
        }
        if round % 5 == 4 {
            b.progress(&format!(
                "latency: round {}/{}",
                round + 1,
                plan.latency_rounds
            ));
        }
    }
    Ok(out)
}
