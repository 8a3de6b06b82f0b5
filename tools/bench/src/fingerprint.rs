//! P5: the fingerprint of the 1 KiB request, as `#[idempotent]` computes it, against the
//! canonical encoding (which hashes most of its blocks as it goes) and against SHA-256 of the
//! same canonical bytes.

use std::hint::black_box;
use std::time::Instant;

use idem::Fingerprinter;
use sha2::{Digest, Sha256};

use crate::Res;
use crate::harness::{median, us};
use crate::setup::Plan;
use crate::workload::PayOrder;

/// P5's samples, µs per call, one per round of each.
#[derive(Debug, Default)]
pub(crate) struct FingerprintCost {
    /// The whole fingerprint (encoding and hash): P5 in µs is its median.
    pub(crate) whole: Vec<f64>,
    /// The canonical encoding without the final hash: since the hash runs while encoding,
    /// this includes every block hashed on the way but the last ones.
    pub(crate) encoding: Vec<f64>,
    /// SHA-256 of a copy of the canonical bytes, with the `sha2` crate the fingerprint uses:
    /// the floor P5's ratio is measured against.
    pub(crate) sha256: Vec<f64>,
}

impl FingerprintCost {
    /// P5 in µs.
    pub(crate) fn whole_us(&self) -> f64 {
        median(&self.whole)
    }

    pub(crate) fn encoding_us(&self) -> f64 {
        median(&self.encoding)
    }

    pub(crate) fn sha256_us(&self) -> f64 {
        median(&self.sha256)
    }

    /// P5 as a ratio: the whole fingerprint over SHA-256 of its canonical bytes (goal ≤ 1.3):
    /// what the encoding adds to the hash it cannot avoid.
    pub(crate) fn vs_sha256(&self) -> f64 {
        self.whole_us() / self.sha256_us()
    }
}

/// What a round of P5 times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Whole,
    Encoding,
    Sha256,
}

/// The fingerprint of the 1 KiB request, as `#[idempotent]` computes it, in µs per call of
/// every round: the whole fingerprint, the canonical encoding (blocks hashed on the way), and
/// SHA-256 of the same canonical bytes, taking turns round by round (ABC, CBA, …).
pub(crate) fn measure(cmd: &PayOrder, plan: &Plan) -> Res<FingerprintCost> {
    let mut canonical = Fingerprinter::new("bench.pay");
    canonical.named("cmd", cmd)?;
    // The bytes the fingerprint hashes, in a buffer of their own length.
    let bytes = canonical.encoded().to_vec();
    let parts = [Part::Whole, Part::Encoding, Part::Sha256];
    let mut out = FingerprintCost::default();
    for round in 0..plan.fp_rounds {
        for part in crate::harness::alternate(&parts, round) {
            let start = Instant::now();
            for _ in 0..plan.fp_iters {
                match part {
                    Part::Sha256 => {
                        black_box(Sha256::digest(black_box(bytes.as_slice())));
                    }
                    Part::Whole | Part::Encoding => {
                        let mut f = Fingerprinter::new(black_box("bench.pay"));
                        f.named("cmd", black_box(cmd))?;
                        if part == Part::Whole {
                            black_box(f.finish_versions());
                        } else {
                            black_box(f.encoded_v1().len());
                        }
                    }
                }
            }
            let per_call = us(start.elapsed()) / plan.fp_iters as f64;
            match part {
                Part::Whole => out.whole.push(per_call),
                Part::Encoding => out.encoding.push(per_call),
                Part::Sha256 => out.sha256.push(per_call),
            }
        }
    }
    Ok(out)
}
