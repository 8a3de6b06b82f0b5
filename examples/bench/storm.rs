//! P6: concurrent duplicates of one key against one execution, and how the time grows with
//! the number of duplicates; concurrent replays of one key against distinct keys.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::Res;
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

#[derive(Debug, Default)]
pub(crate) struct Storm {
    /// µs until every duplicate of a storm is answered, per round.
    pub(crate) storm_us: Vec<f64>,
    /// µs of one execution alone, per round.
    pub(crate) single_us: Vec<f64>,
    /// Smaller storms, to see how the time grows with the number of duplicates: copies and
    /// the median µs until all are answered.
    pub(crate) scaling: Vec<(usize, f64)>,
    /// 64 concurrent replays of one recorded key, and of 64 different recorded keys.
    pub(crate) replays_same_us: Vec<f64>,
    pub(crate) replays_distinct_us: Vec<f64>,
}

impl Storm {
    /// P6: a storm over one execution.
    pub(crate) fn storm_vs_single(&self) -> f64 {
        median(&self.storm_us) / median(&self.single_us)
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

/// 64 concurrent duplicates of one key against one execution, alternating (P6).
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<Storm> {
    storm_once(b, plan.storm, 0).await?; // opens the pool's connections
    let mut out = Storm::default();
    for round in 0..plan.storm_rounds {
        for which in alternate(&[true, false], round) {
            if which {
                out.storm_us
                    .push(storm_once(b, plan.storm, round + 1).await?);
            } else {
                let cmd = b.command(SLOT_STORM, round + 7);
                let start = Instant::now();
                b.call(Variant::IdemFirst, cmd).await?;
                out.single_us.push(us(start.elapsed()));
            }
        }
    }
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
