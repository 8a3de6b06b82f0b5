//! P3: throughput of the variants that execute, with concurrent clients.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::counters::{add_deltas, machine_cpu, server_counters};
use crate::harness::{median, take_turns};
use crate::setup::{Bench, Plan};
use crate::variants::{PerVariant, Variant};
use crate::{BoxError, Res};

/// Calls completed by `clients` concurrent clients of `variant` in about `length`, and the
/// seconds they took.
async fn throughput_round(
    b: &Arc<Bench>,
    variant: Variant,
    clients: usize,
    length: Duration,
) -> Res<(u64, f64)> {
    let start = Instant::now();
    let deadline = start + length;
    let mut set = tokio::task::JoinSet::new();
    for client in 0..clients {
        let b = Arc::clone(b);
        set.spawn(async move {
            let mut done = 0_u64;
            let mut i = 0;
            while Instant::now() < deadline {
                let cmd = b.command(client as i64, i);
                b.call(variant, cmd).await?;
                done += 1;
                i += 1;
            }
            Ok::<u64, BoxError>(done)
        });
    }
    let mut total = 0;
    for done in set.join_all().await {
        total += done?;
    }
    Ok((total, start.elapsed().as_secs_f64()))
}

/// One variant's throughput.
#[derive(Debug, Default)]
pub(crate) struct Rate {
    /// Calls per second of every round.
    pub(crate) per_round: Vec<f64>,
    /// Calls over all rounds.
    pub(crate) calls: u64,
    /// Server counter deltas summed over the rounds.
    pub(crate) counters: BTreeMap<&'static str, f64>,
}

impl Rate {
    /// The figure: calls per second, the median of the rounds.
    pub(crate) fn median(&self) -> f64 {
        median(&self.per_round)
    }

    /// Each counter's delta per call.
    pub(crate) fn counters_per_call(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        let calls = self.calls.max(1) as f64;
        self.counters
            .iter()
            .map(move |(k, total)| (*k, total / calls))
    }
}

/// The executing variants' throughput (replays execute nothing, so theirs stays empty).
pub(crate) type Throughput = PerVariant<Rate>;

impl Throughput {
    /// P3: idem first over three-commit.
    pub(crate) fn idem_vs_three_commit(&self) -> f64 {
        self[Variant::IdemFirst].median() / self[Variant::ThreeCommit].median()
    }

    /// Each executing variant with its rate, in [`Variant::EXECUTING`]'s order.
    pub(crate) fn rates(&self) -> [(Variant, &Rate); 3] {
        Variant::EXECUTING.map(|v| (v, &self[v]))
    }
}

/// Throughput of the executing variants with concurrent clients (P3).
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<Throughput> {
    for v in Variant::EXECUTING {
        throughput_round(b, v, plan.clients, Duration::from_millis(300)).await?;
    }
    let mut out = Throughput::default();
    let turn = async |v, _| {
        let mut before = server_counters(&b.db).await;
        let cpu0 = machine_cpu();
        let (calls, secs) = throughput_round(b, v, plan.clients, plan.tput_round).await?;
        let cpu1 = machine_cpu();
        let mut after = server_counters(&b.db).await;
        if let (Some((busy0, all0)), Some((busy1, all1))) = (cpu0, cpu1) {
            // Machine CPU per call in µs (all cores, 100 jiffies a second), and how busy the
            // machine was (weighted by calls, so the per-call average is the mean).
            before.insert("machine_cpu_us", busy0 * 10_000.0);
            after.insert("machine_cpu_us", busy1 * 10_000.0);
            before.insert("machine_busy_pct", 0.0);
            after.insert(
                "machine_busy_pct",
                100.0 * (busy1 - busy0) / (all1 - all0).max(1.0) * calls as f64,
            );
        }
        let rate: &mut Rate = &mut out[v];
        rate.calls += calls;
        add_deltas(&mut rate.counters, &before, after);
        Ok(calls as f64 / secs)
    };
    let rounds = plan.tput_rounds;
    let progress = |round: usize| b.progress(&format!("throughput: round {}/{rounds}", round + 1));
    let per_round = take_turns(&Variant::EXECUTING, rounds, turn, progress).await?;
    for (v, per_round) in Variant::EXECUTING.into_iter().zip(per_round) {
        out[v].per_round = per_round;
    }
    Ok(out)
}
