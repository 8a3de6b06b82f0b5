//! Observe mode ("shadow mode"): idem decides every call as it would when enforcing, and
//! reports the decision instead of acting on it. The handler's body runs on every call and its
//! answer is always its own. A team with a service in production turns idem on this way
//! first, reads what it would have done (a log line and a counter per decision), and then
//! switches to enforcing without a migration: observe mode writes the ledger exactly as
//! enforcing does, so the first enforced retry of a key observed before replays its record.
//!
//! `#[idempotent(..., mode = observe)]` sets it ([`Call::mode`](crate::call::Call::mode)), in
//! atomic and lease mode; the HTTP and gRPC layers take it as a setting (`.mode(Mode::Observe)`).
//! What it does per decision is described at [`Mode::Observe`].

use crate::metrics::{self, Label};

/// Whether idem acts on what it decides for a call, or only reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// idem acts on its decisions: a retry replays the recorded answer, a concurrent
    /// duplicate waits or gets [`InFlight`](crate::Error::InFlight) (409), a key reused with
    /// other arguments gets [`KeyReused`](crate::Error::KeyReused) (422).
    #[default]
    Enforce,
    /// idem decides as [`Mode::Enforce`] would, claiming and recording in the ledger the
    /// same way, but every call runs its body and answers the body's own answer:
    ///
    /// - a call that enforcing would execute runs its body in the claim's transaction, and
    ///   its answer is recorded with its writes, exactly as when enforcing (so later calls
    ///   can be decided against it, and enforcing later finds the same record);
    /// - a call that enforcing would answer without its body (a replay, `KeyReused`,
    ///   `InFlight`, an error of idem's own such as a store that fails or an invalid key) runs
    ///   its body in a transaction of the store that claims nothing, as with idem switched
    ///   off ([`testing`](crate::testing)): `Ok` commits, `Err` rolls back, nothing is
    ///   recorded, and the record already there is left as it is;
    /// - if idem's own recording fails after the body ran in the claim's transaction (the
    ///   transaction is gone with the body's writes), the body runs again unclaimed, so an
    ///   error of idem's never becomes the caller's. A body whose arguments are not `Clone`
    ///   cannot run twice; that call answers idem's error, as enforcing would.
    ///
    /// In lease mode (`lease = "…"`, and the HTTP and gRPC layers) the same holds with the
    /// lease for the claim's transaction:
    ///
    /// - a call that enforcing would execute claims the lease, runs its body with its steps
    ///   fenced and records its answer, exactly as when enforcing; if idem then cannot record
    ///   it, the body's own answer is returned (its writes committed in their own phases),
    ///   unless a final phase kept open for the record rolled back with it (`finish`), which
    ///   fails the call as enforcing does;
    /// - any other call runs its body under a lease of a fresh in-memory store: its
    ///   [`step`](crate::lease::step)s run and are kept in memory only, and a final phase
    ///   (`final_step`, `finish`) runs its writes in a transaction of their own, unfenced.
    ///
    /// Concurrent duplicates wait for the first call as enforcing makes them wait (that is
    /// how idem learns what it would have answered them), and then run their own body.
    ///
    /// Each decision is reported once: an INFO event in the call's span with `scope`,
    /// `key_hash` and `decision`, and the counter
    /// [`idem_observed_total`](crate::metrics::OBSERVED_TOTAL) labelled `scope` and `decision`
    /// (feature `metrics`). `decision` takes the values of `idem_calls_total`'s `outcome`
    /// (`executed`, `replayed`, `key_reused`, `in_flight`, `released`, `invalid_key`,
    /// `error`): what that counter would have counted when enforcing. The call itself is
    /// counted in `idem_calls_total` with outcome `observed`.
    Observe,
}

/// The decision of a call in observe mode for which enforcing would answer idem's error `e`;
/// an error of idem's own (not a refusal such as `InFlight`) is logged in `span` as enforcing
/// logs it, since the body runs without idem instead.
pub(crate) fn decision_on_error(span: &tracing::Span, e: &crate::Error) -> Label {
    let decision = Label::of_error(e);
    if decision == Label::Error {
        tracing::warn!(
            parent: span,
            error = %e,
            "observe mode: idem failed; the body runs without a claim"
        );
    }
    decision
}

/// Reports what enforcing would have done with a call in observe mode: one INFO event
/// (in the call's `span` when it has one: an invalid key has none) and one count.
pub(crate) fn report(scope: &'static str, key_hash: &str, span: &tracing::Span, decision: Label) {
    let would = match decision {
        Label::Executed => "run the body and recorded its answer",
        Label::Replayed => "replayed the recorded answer without running the body",
        Label::KeyReused => "answered KeyReused (422) without running the body",
        Label::InFlight => "answered InFlight (409) without running the body",
        Label::Released => "run the body and recorded nothing (a transient error)",
        Label::InvalidKey => "answered InvalidKey (400) without running the body",
        Label::Error | Label::Observed => "failed with an error of its own",
    };
    let decision_label = decision.as_str();
    tracing::info!(
        parent: span,
        scope,
        key_hash,
        decision = decision_label,
        "observe mode: enforcing, idem would have {would}; the body's own answer is returned"
    );
    metrics::observed(scope, decision);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforcing_is_the_default() {
        assert_eq!(Mode::default(), Mode::Enforce);
    }
}
