//! P5: the fingerprint of the 1 KiB request, as `#[idempotent]` computes it.

use std::hint::black_box;
use std::time::Instant;

use idem::Fingerprinter;

use crate::Res;
use crate::setup::Plan;
use crate::stats::{median, us};
use crate::workload::PayOrder;

/// µs per call of every round.
#[derive(Debug)]
pub(crate) struct Fingerprint {
    /// The whole fingerprint (the figure).
    pub(crate) whole_us: Vec<f64>,
    /// The canonical encoding alone (the rest is SHA-256).
    pub(crate) encoding_us: Vec<f64>,
}

impl Fingerprint {
    /// P5: µs per fingerprint, the median of the rounds.
    pub(crate) fn median_us(&self) -> f64 {
        median(&self.whole_us)
    }

    pub(crate) fn encoding_median_us(&self) -> f64 {
        median(&self.encoding_us)
    }
}

/// The fingerprint of the 1 KiB request, as `#[idempotent]` computes it (P5), in µs per call:
/// the whole fingerprint, and the canonical encoding alone, alternating round by round.
pub(crate) fn measure(cmd: &PayOrder, plan: &Plan) -> Res<Fingerprint> {
    let mut out = Fingerprint {
        whole_us: Vec::new(),
        encoding_us: Vec::new(),
    };
    for round in 0..plan.fp_rounds * 2 {
        let hash = round % 2 == 0;
        let start = Instant::now();
        for _ in 0..plan.fp_iters {
            let mut f = Fingerprinter::new(black_box("bench.pay"));
            f.arg(black_box(cmd))?;
            if hash {
                black_box(f.finish());
            } else {
                black_box(f.encoded().len());
            }
        }
        let per_call = us(start.elapsed()) / plan.fp_iters as f64;
        if hash {
            out.whole_us.push(per_call);
        } else {
            out.encoding_us.push(per_call);
        }
    }
    Ok(out)
}
