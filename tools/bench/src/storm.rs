//! P6: concurrent duplicates of one key against one execution, and how the time grows with
//! the number of duplicates; concurrent replays of one key against distinct keys.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::Res;
use crate::harness::{Pair, median, on_one_cpu, storm, take_turns, us};
use crate::setup::{Bench, Plan, SLOT_STORM};
use crate::variants::Variant;

/// `copies` concurrent calls with one new key: µs until every one is answered (the same
/// receipt, or an error).
async fn storm_once(b: &Arc<Bench>, copies: usize, i: usize) -> Res<f64> {
    let cmd = b.command(SLOT_STORM, i);
    let (elapsed, answers) = storm(b, vec![cmd; copies]).await?;
    b.executed.fetch_add(1, Ordering::Relaxed);
    if answers.iter().any(|a| *a != answers[0]) {
        return Err("a duplicate got a different receipt".into());
    }
    Ok(elapsed)
}

#[derive(Debug, Default)]
pub(crate) struct Storm {
    /// Storms (µs until every duplicate is answered) against one execution alone, measured
    /// with every thread on one CPU (the figure, P6): the duplicates' work without this VM's
    /// cross-CPU wake-ups, and without a second CPU to share it. `None` without taskset.
    pub(crate) pinned: Option<Pair>,
    /// The same on every CPU.
    pub(crate) unpinned: Pair,
    /// Smaller storms, to see how the time grows with the number of duplicates: copies and
    /// the median µs until all are answered.
    pub(crate) scaling: Vec<(usize, f64)>,
    /// Concurrent replays of one recorded key (measured) against as many recorded keys.
    pub(crate) replays: Pair,
}

impl Storm {
    /// P6: a storm over one execution, pinned where it could be.
    pub(crate) fn storm_vs_single(&self) -> f64 {
        self.pinned.as_ref().unwrap_or(&self.unpinned).ratio()
    }
}

/// Storms of `plan.storm` duplicates of one key and single executions, alternating, every
/// call with a new key; `first` picks the orders the pass pays.
async fn storms_and_singles(b: &Arc<Bench>, plan: &Plan, first: usize) -> Res<Pair> {
    let turn = async |storm: bool, round: usize| {
        let i = first + 2 * round;
        if storm {
            return storm_once(b, plan.storm, i).await;
        }
        let cmd = b.command(SLOT_STORM, i + 1);
        let start = Instant::now();
        b.call(Variant::IdemFirst, cmd).await?;
        Ok(us(start.elapsed()))
    };
    let turns = take_turns(&[true, false], plan.storm_rounds, turn, |_| {}).await?;
    Ok(Pair::of(turns))
}

/// 64 concurrent duplicates of one key against one execution, alternating, pinned to one CPU
/// and not (P6); how the time grows with the duplicates; concurrent replays.
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<Storm> {
    storm_once(b, plan.storm, 0).await?; // opens the pool's connections
    let pinned = on_one_cpu(async || storms_and_singles(b, plan, 1).await).await?;
    let unpinned = storms_and_singles(b, plan, 1 + 2 * plan.storm_rounds).await?;
    let sizes = [2, 8, 16, 32];
    let rounds = plan.storm_rounds.div_ceil(2);
    let sized = async |copies, round| storm_once(b, copies, round + 3).await;
    let times = take_turns(&sizes, rounds, sized, |_| {}).await?;
    let scaling = sizes.into_iter().zip(&times).map(|(n, t)| (n, median(t)));
    // Replays only: one shared key (every call locks the same ledger row) against distinct keys.
    let mut recorded = Vec::with_capacity(plan.storm);
    for i in 0..plan.storm {
        let cmd = b.command(SLOT_STORM, i);
        recorded.push(cmd.clone());
        b.call(Variant::IdemFirst, cmd).await?;
    }
    let replay = async |same: bool, round: usize| {
        let cmds = match same {
            true => vec![recorded[round % recorded.len()].clone(); plan.storm],
            false => recorded.clone(),
        };
        Ok(storm(b, cmds).await?.0)
    };
    let replays = Pair::of(take_turns(&[true, false], rounds, replay, |_| {}).await?);
    Ok(Storm {
        pinned,
        unpinned,
        scaling: scaling.collect(),
        replays,
    })
}
