//! The one harness every timed figure runs on: turns that alternate (ABCD, DCBA, …) so drift
//! hits every contender alike, a pass pinned to one CPU, storms of concurrent calls, and the
//! medians and percentiles the figures are read from.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::Res;
use crate::setup::Bench;
use crate::variants::pay_idem;
use crate::workload::{PayOrder, Receipt};

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Rounds to 3 decimals for the JSON (`null` when not finite).
pub(crate) fn r3(x: f64) -> serde_json::Value {
    rounded(x).map_or(serde_json::Value::Null, |x| json!(x))
}

/// `x` rounded to 3 decimals, `None` when not finite: what the JSON holds, so the profile's
/// table prints the same numbers as the JSON.
pub(crate) fn rounded(x: f64) -> Option<f64> {
    x.is_finite().then(|| (x * 1000.0).round() / 1000.0)
}

/// A value with `decimals` decimals, or `n/a`.
pub(crate) fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.decimals$}"))
}

/// Alternating order: ABCD, DCBA, ABCD, …
pub(crate) fn alternate<T: Copy>(items: &[T], round: usize) -> Vec<T> {
    if round.is_multiple_of(2) {
        items.to_vec()
    } else {
        items.iter().rev().copied().collect()
    }
}

/// `rounds` rounds in which every contender takes one turn, in the order ABCD, DCBA, …:
/// `turn(contender, round)` measures one; the samples come back per contender, in
/// `contenders`' order. `round_done(round)` is called as each round ends.
pub(crate) async fn take_turns<T: Copy>(
    contenders: &[T],
    rounds: usize,
    mut turn: impl AsyncFnMut(T, usize) -> Res<f64>,
    mut round_done: impl FnMut(usize),
) -> Res<Vec<Vec<f64>>> {
    let mut samples = vec![Vec::new(); contenders.len()];
    let order: Vec<usize> = (0..contenders.len()).collect();
    for round in 0..rounds {
        for i in alternate(&order, round) {
            samples[i].push(turn(contenders[i], round).await?);
        }
        round_done(round);
    }
    Ok(samples)
}

/// Two contenders' samples, taken in turns: a figure and what it is measured against.
#[derive(Debug, Default)]
pub(crate) struct Pair {
    pub(crate) measured: Vec<f64>,
    pub(crate) against: Vec<f64>,
}

impl Pair {
    /// [`take_turns`] of two contenders, the measured one first.
    pub(crate) fn of(mut turns: Vec<Vec<f64>>) -> Self {
        let against = turns.pop().unwrap_or_default();
        let measured = turns.pop().unwrap_or_default();
        Self { measured, against }
    }

    /// The measured median over the median it is measured against.
    pub(crate) fn ratio(&self) -> f64 {
        median(&self.measured) / median(&self.against)
    }
}

/// Sends `cmds` to idem at once, each from a task of its own: µs until every one is answered,
/// and the answers.
pub(crate) async fn storm(b: &Arc<Bench>, cmds: Vec<PayOrder>) -> Res<(f64, Vec<Receipt>)> {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmd in cmds {
        let b = Arc::clone(b);
        set.spawn(async move { pay_idem(&b.db, cmd, &b.sql).await });
    }
    let answers = set.join_all().await;
    let elapsed = us(start.elapsed());
    Ok((elapsed, answers.into_iter().collect::<Result<_, _>>()?))
}

/// Runs `measure` with every thread of this process on the first CPU (`taskset`, util-linux),
/// for figures that measure work rather than this VM's wake-ups; `None` where it cannot pin.
///
/// On this VM a thread woken on the other, idle vCPU costs tens of µs in some stretches and
/// not in others (docs/BENCHMARKS.md, round 4), so a figure that crosses threads for every
/// statement swings with it. On one CPU the same work measures the same. The mask found is
/// restored afterwards; threads started meanwhile keep the pin.
pub(crate) async fn on_one_cpu<T>(measure: impl AsyncFnOnce() -> Res<T>) -> Res<Option<T>> {
    let Some(_pin) = Pinned::to_one_cpu() else {
        return Ok(None);
    };
    Ok(Some(measure().await?))
}

/// The pin: the mask it replaced is restored on drop.
struct Pinned {
    pid: String,
    mask: String,
}

impl Pinned {
    fn to_one_cpu() -> Option<Self> {
        let pid = std::process::id().to_string();
        let out = Command::new("taskset").args(["-p", &pid]).output().ok()?;
        // "pid 123's current affinity mask: 3"
        let mask = String::from_utf8(out.stdout).ok()?;
        let mask = mask.rsplit(':').next()?.trim().to_owned();
        let pinned = Command::new("taskset")
            .args(["-a", "-p", "1", &pid])
            .stdout(Stdio::null())
            .status()
            .ok()?
            .success();
        pinned.then_some(Self { pid, mask })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = Command::new("taskset")
            .args(["-a", "-p", &self.mask, &self.pid])
            .stdout(Stdio::null())
            .status();
    }
}
