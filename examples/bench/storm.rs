//! P6: concurrent duplicates of one key against one execution, and how the time grows with
//! the number of duplicates; concurrent replays of one key against distinct keys.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::Res;
use crate::pin::Pinned;
use crate::setup::{Bench, Plan, SLOT_STORM};
use crate::stats::{alternate, median, us};
use crate::variants::{Variant, pay_idem};
use crate::workload::{PayOrder, Receipt};

/// `copies` concurrent calls with one new key: time until every one is answered.
async fn storm_once(b: &Arc<Bench>, copies: usize, i: usize) -> Res<f64> {
    let cmd = b.command(SLOT_STORM, i);
    let cmds: Vec<PayOrder> = (0..copies).map(|_| cmd.clone()).collect();
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmd in cmds {
        let b = Arc::clone(b);
        set.spawn(async move { pay_idem(&b.db, cmd, &b.sql).await });
    }
    let answers = set.join_all().await;
    let elapsed = us(start.elapsed());
    b.executed.fetch_add(1, Ordering::Relaxed);
    let mut first: Option<Receipt> = None;
    for answer in answers {
        let answer = answer?;
        match &first {
            None => first = Some(answer),
            Some(f) if *f != answer => return Err("a duplicate got a different receipt".into()),
            Some(_) => {}
        }
    }
    Ok(elapsed)
}

/// Storms and single executions, alternating: µs per round.
#[derive(Debug, Default)]
pub(crate) struct StormPair {
    /// µs until every duplicate of a storm is answered.
    pub(crate) storm_us: Vec<f64>,
    /// µs of one execution alone.
    pub(crate) single_us: Vec<f64>,
}

impl StormPair {
    /// A storm over one execution.
    pub(crate) fn ratio(&self) -> f64 {
        median(&self.storm_us) / median(&self.single_us)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Storm {
    /// Measured with every thread on one CPU (the figure, P6): the duplicates' work without
    /// this VM's cross-CPU wake-ups, and without a second CPU to share it. `None` without
    /// taskset.
    pub(crate) pinned: Option<StormPair>,
    /// Measured on every CPU.
    pub(crate) unpinned: StormPair,
    /// Smaller storms, to see how the time grows with the number of duplicates: copies and
    /// the median µs until all are answered.
    pub(crate) scaling: Vec<(usize, f64)>,
    /// 64 concurrent replays of one recorded key, and of 64 different recorded keys.
    pub(crate) replays_same_us: Vec<f64>,
    pub(crate) replays_distinct_us: Vec<f64>,
}

impl Storm {
    /// P6: a storm over one execution, pinned where it could be.
    pub(crate) fn storm_vs_single(&self) -> f64 {
        self.pinned.as_ref().unwrap_or(&self.unpinned).ratio()
    }
}

/// Runs `cmds` concurrently: µs until every one is answered.
async fn concurrently(b: &Arc<Bench>, cmds: Vec<PayOrder>) -> Res<f64> {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmd in cmds {
        let b = Arc::clone(b);
        set.spawn(async move { pay_idem(&b.db, cmd, &b.sql).await });
    }
    for answer in set.join_all().await {
        answer?;
    }
    Ok(us(start.elapsed()))
}

/// Storms of `plan.storm` duplicates of one key and single executions, alternating, every
/// call with a new key; `first` picks the orders the pass pays.
async fn storms_and_singles(b: &Arc<Bench>, plan: &Plan, first: usize) -> Res<StormPair> {
    let mut out = StormPair::default();
    for round in 0..plan.storm_rounds {
        let i = first + 2 * round;
        for which in alternate(&[true, false], round) {
            if which {
                out.storm_us.push(storm_once(b, plan.storm, i).await?);
            } else {
                let cmd = b.command(SLOT_STORM, i + 1);
                let start = Instant::now();
                b.call(Variant::IdemFirst, cmd).await?;
                out.single_us.push(us(start.elapsed()));
            }
        }
    }
    Ok(out)
}

/// 64 concurrent duplicates of one key against one execution, alternating, pinned to one CPU
/// and not (P6); how the time grows with the duplicates; concurrent replays.
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<Storm> {
    storm_once(b, plan.storm, 0).await?; // opens the pool's connections
    let pinned = match Pinned::to_one_cpu() {
        // The pin holds until the arm ends.
        Some(_pin) => Some(storms_and_singles(b, plan, 1).await?),
        None => None,
    };
    let unpinned = storms_and_singles(b, plan, 1 + 2 * plan.storm_rounds).await?;
    let mut out = Storm {
        pinned,
        unpinned,
        ..Storm::default()
    };
    let sizes = [2, 8, 16, 32];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for round in 0..plan.storm_rounds.div_ceil(2) {
        for i in alternate(&[0_usize, 1, 2, 3], round) {
            times[i].push(storm_once(b, sizes[i], round + 3).await?);
        }
    }
    out.scaling = sizes
        .iter()
        .zip(&times)
        .map(|(n, t)| (*n, median(t)))
        .collect();
    // Replays only: one shared key (every call locks the same ledger row) against distinct keys.
    let mut recorded = Vec::with_capacity(plan.storm);
    for i in 0..plan.storm {
        let cmd = b.command(SLOT_STORM, i);
        recorded.push(cmd.clone());
        b.call(Variant::IdemFirst, cmd).await?;
    }
    for round in 0..plan.storm_rounds.div_ceil(2) {
        for same in alternate(&[true, false], round) {
            if same {
                let one = vec![recorded[round % recorded.len()].clone(); plan.storm];
                out.replays_same_us.push(concurrently(b, one).await?);
            } else {
                out.replays_distinct_us
                    .push(concurrently(b, recorded.clone()).await?);
            }
        }
    }
    Ok(out)
}
