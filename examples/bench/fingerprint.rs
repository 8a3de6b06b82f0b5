//! P5: the fingerprint of the 1 KiB request, as `#[idempotent]` computes it.

use std::hint::black_box;
use std::time::Instant;

use idem::Fingerprinter;

use crate::Res;
use crate::harness::{Pair, us};
use crate::setup::Plan;
use crate::workload::PayOrder;

/// The fingerprint of the 1 KiB request, as `#[idempotent]` computes it, in µs per call of
/// every round: the whole fingerprint (measured; P5 is its median) against the canonical
/// encoding alone (the rest is SHA-256), alternating round by round.
pub(crate) fn measure(cmd: &PayOrder, plan: &Plan) -> Res<Pair> {
    let mut out = Pair::default();
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
        match hash {
            true => out.measured.push(per_call),
            false => out.against.push(per_call),
        }
    }
    Ok(out)
}
