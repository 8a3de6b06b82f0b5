//! Metrics of idempotent calls through the [`metrics`](https://docs.rs/metrics) facade
//! (feature `metrics`, off by default). Install any recorder (for example
//! `metrics-exporter-prometheus`) and every call of an `#[idempotent]` handler, in atomic or
//! lease mode, and every request through the axum `IdempotencyLayer` (which runs in lease
//! mode), is counted once, when its answer is known:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idem_calls_total` | counter | `scope`, `outcome` | calls answered, by outcome |
//! | `idem_call_duration_seconds` | histogram | `scope`, `outcome` | time from the call to its answer, in seconds |
//! | `idem_completer_total` | counter | `scope`, `outcome` | what [completers](crate::completer) did: `resumed`, `finished`, `failed`, `gave_up`, `unregistered` |
//! | `idem_conflict_retries_total` | counter | `scope` | tries run again after a transient database conflict ([`conflict`](crate::retry::conflict)) |
//! | `idem_relay_sink_restarts_total` | counter | | outbox relays that restarted their sink after publishes stopped going through ([`note_sink_restart`](crate::outbox::note_sink_restart)) |
//! | `idem_observed_total` | counter | `scope`, `decision` | in observe mode ([`Mode::Observe`](crate::Mode::Observe)), what enforcing would have done with each call: `decision` takes the `outcome` values below |
//!
//! `outcome` is one of:
//!
//! | outcome | meaning |
//! |---|---|
//! | `executed` | the handler ran and its result (or final error) was recorded |
//! | `replayed` | a recorded result was returned; the handler did not run |
//! | `key_reused` | the key was used before with other arguments ([`Error::KeyReused`](crate::Error::KeyReused), 422) |
//! | `in_flight` | another call held the key ([`Error::InFlight`](crate::Error::InFlight), 409) |
//! | `released` | the handler returned a transient error; nothing was recorded, the key is free |
//! | `invalid_key` | the key (or principal) was missing or malformed; nothing was done (400) |
//! | `error` | idem could not answer: the store failed or kept conflicting, a record no longer decodes, a lease was lost |
//! | `observed` | observe mode: the handler ran and its own answer was returned; what enforcing would have done is counted in `idem_observed_total` |
//!
//! A call whose future is dropped before its answer (a client that went away) is not
//! counted. Without the feature nothing here is compiled: no clock reads, no task-local.

/// Counter of what completers did, labelled `scope` and `outcome`: `resumed` (an abandoned
/// call was taken over), `finished` (an attempt ended with the call's answer recorded),
/// `failed` (an attempt did not finish it; retried after a backoff), `gave_up` (the call was
/// given up), `unregistered` (calls whose lease ended have no resumer in this process; counted
/// once a minute per scope).
pub const COMPLETER_TOTAL: &str = "idem_completer_total";
/// Counter of tries run again after a transient database conflict (a deadlock, a
/// serialization or certification failure), labelled `scope`.
pub const CONFLICT_RETRIES_TOTAL: &str = "idem_conflict_retries_total";
/// Counter of outbox relays' sink restarts: a relay had messages to publish and none went
/// through for its stall bound, so it dropped its sink's connection and started again.
pub const RELAY_SINK_RESTARTS_TOTAL: &str = "idem_relay_sink_restarts_total";
/// Counter of the decisions observe mode reported, labelled `scope` and `decision` (one of
/// the `outcome` values of [`CALLS_TOTAL`]: what it would have counted when enforcing).
pub const OBSERVED_TOTAL: &str = "idem_observed_total";
/// Counter of answered calls, labelled `scope` and `outcome`.
pub const CALLS_TOTAL: &str = "idem_calls_total";
/// Histogram of call latency in seconds, labelled `scope` and `outcome`.
pub const CALL_DURATION_SECONDS: &str = "idem_call_duration_seconds";

/// How a call was answered, as the `outcome` label (and the tracing span's `outcome` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Label {
    Executed,
    Replayed,
    KeyReused,
    InFlight,
    Released,
    InvalidKey,
    Error,
    /// Observe mode: the body answered; its decision is counted apart.
    Observed,
}

impl Label {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::KeyReused => "key_reused",
            Self::InFlight => "in_flight",
            Self::Released => "released",
            Self::InvalidKey => "invalid_key",
            Self::Error => "error",
            Self::Observed => "observed",
        }
    }

    /// The label of a call that ended with idem's error `e`.
    pub(crate) fn of_error(e: &crate::Error) -> Self {
        match e.kind() {
            crate::ErrorKind::InvalidKey | crate::ErrorKind::MissingKey => Self::InvalidKey,
            crate::ErrorKind::KeyReused => Self::KeyReused,
            crate::ErrorKind::InFlight => Self::InFlight,
            _ => Self::Error,
        }
    }
}

/// Notes how the current call was answered: in its span, and for [`observe`].
pub(crate) fn settle(span: &tracing::Span, label: Label) {
    span.record("outcome", label.as_str());
    note(label);
}

#[cfg(feature = "metrics")]
mod enabled {
    use std::cell::Cell;
    use std::future::Future;

    use super::{CALL_DURATION_SECONDS, CALLS_TOTAL, Label};

    tokio::task_local! {
        static ANSWER: Cell<Option<Label>>;
    }

    /// Notes the answer of the call being observed in this task (the first note wins).
    pub(crate) fn note(label: Label) {
        let _ = ANSWER.try_with(|slot| {
            if slot.get().is_none() {
                slot.set(Some(label));
            }
        });
    }

    /// Counts a completer outcome for `scope`.
    pub(crate) fn completer(scope: &str, outcome: &'static str) {
        ::metrics::counter!(super::COMPLETER_TOTAL, "scope" => scope.to_owned(), "outcome" => outcome)
            .increment(1);
    }

    /// Counts a try run again after a conflict, for `scope`.
    pub(crate) fn conflict_retry(scope: &str) {
        ::metrics::counter!(super::CONFLICT_RETRIES_TOTAL, "scope" => scope.to_owned())
            .increment(1);
    }

    /// Counts a decision observe mode reported for `scope`.
    pub(crate) fn observed(scope: &'static str, decision: Label) {
        ::metrics::counter!(super::OBSERVED_TOTAL, "scope" => scope, "decision" => decision.as_str())
            .increment(1);
    }

    /// Counts a relay's sink restart.
    pub(crate) fn sink_restart() {
        ::metrics::counter!(super::RELAY_SINK_RESTARTS_TOTAL).increment(1);
    }

    /// Runs one call of `scope` and counts it with its latency: the one place the engine
    /// emits metrics.
    pub(crate) fn observe<F: Future>(
        scope: &'static str,
        call: F,
    ) -> impl Future<Output = F::Output> {
        // On the heap: a handler's future can be large, and unoptimised builds copy it on the
        // stack at each layer that holds it by value (enough to overflow a 2 MiB worker).
        let call = Box::pin(call);
        async move {
            let started = std::time::Instant::now();
            let (answer, label) = ANSWER
                .scope(Cell::new(None), async move {
                    let answer = call.await;
                    (answer, ANSWER.with(Cell::get))
                })
                .await;
            // Every path notes its answer; `error` is the safe reading if one ever does not.
            let outcome = label.unwrap_or(Label::Error).as_str();
            ::metrics::counter!(CALLS_TOTAL, "scope" => scope, "outcome" => outcome).increment(1);
            ::metrics::histogram!(CALL_DURATION_SECONDS, "scope" => scope, "outcome" => outcome)
                .record(started.elapsed().as_secs_f64());
            answer
        }
    }
}

/// Registers the help text and unit of idem's metrics with the installed recorder (the
/// `# HELP` lines of a Prometheus scrape). Optional: the metrics are recorded without it.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn describe() {
    ::metrics::describe_counter!(
        CALLS_TOTAL,
        "Idempotent calls answered, by scope and outcome"
    );
    ::metrics::describe_histogram!(
        CALL_DURATION_SECONDS,
        ::metrics::Unit::Seconds,
        "Time from an idempotent call to its answer, by scope and outcome"
    );
    ::metrics::describe_counter!(
        COMPLETER_TOTAL,
        "What completers did with abandoned lease-mode calls, by scope and outcome"
    );
    ::metrics::describe_counter!(
        CONFLICT_RETRIES_TOTAL,
        "Tries run again after a transient database conflict, by scope"
    );
    ::metrics::describe_counter!(
        RELAY_SINK_RESTARTS_TOTAL,
        "Outbox relays that restarted their sink after publishes stopped going through"
    );
    ::metrics::describe_counter!(
        OBSERVED_TOTAL,
        "In observe mode, what idem would have done with each call when enforcing, by scope and decision"
    );
}

#[cfg(not(feature = "metrics"))]
mod enabled {
    use std::future::Future;

    use super::Label;

    #[inline(always)]
    pub(crate) fn note(_label: Label) {}

    #[inline(always)]
    pub(crate) fn completer(_scope: &str, _outcome: &'static str) {}

    #[inline(always)]
    pub(crate) fn conflict_retry(_scope: &str) {}

    #[inline(always)]
    pub(crate) fn observed(_scope: &'static str, _decision: Label) {}

    #[inline(always)]
    pub(crate) fn sink_restart() {}

    /// Without the feature the call is returned as it is: nothing wraps it.
    #[inline(always)]
    pub(crate) fn observe<F: Future>(_scope: &'static str, call: F) -> F {
        call
    }
}

pub(crate) use enabled::{completer, conflict_retry, note, observe, observed, sink_restart};
