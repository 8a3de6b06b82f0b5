//! The relay, once for every store: rounds that claim, publish and mark, and the loop that
//! runs them until shutdown.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::outbox::{Backoff, RelayOptions, Sink, SinkError, random_token};
use idem_core::{Error, detached};

use super::FailedAttempt;
use crate::{Driver, SqlStore};

/// What one relay round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayRound {
    /// Messages claimed.
    pub claimed: usize,
    /// Messages the sink accepted and that were marked published.
    pub published: usize,
    /// Attempts that failed and will be retried.
    pub retrying: usize,
    /// Messages that became dead.
    pub dead: usize,
}

/// Counters of a relay since it was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayCounters {
    /// Messages published.
    pub published: u64,
    /// Failed attempts that will be retried.
    pub retried: u64,
    /// Messages that became dead.
    pub dead: u64,
    /// Times this relay restarted its sink because no publish went through for
    /// [`RelayOptions::sink_stall_bound`].
    pub sink_restarts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    sink_restarts: AtomicU64,
}

/// Publishes committed outbox messages to a [`Sink`]: claims a batch (leased, so several
/// relays in several processes share the work), publishes, marks. `D` is the driver of the
/// pool it relays from; each store exports it as its own `Relay`.
pub struct Relay<D, S> {
    store: SqlStore<D>,
    sink: S,
    options: RelayOptions,
    counters: Arc<Counters>,
}

impl<D: std::fmt::Debug, S: std::fmt::Debug> std::fmt::Debug for Relay<D, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("store", &self.store)
            .field("sink", &self.sink)
            .field("options", &self.options)
            .field("counters", &self.counters)
            .finish()
    }
}

impl<D: Driver, S: Sink> Relay<D, S> {
    /// A relay from the outbox of `pool` (a `DatabaseConnection`, a sqlx `Pool`, ...) to
    /// `sink`, with [`RelayOptions::default`].
    pub fn new(pool: impl Into<D>, sink: S) -> Self {
        Self {
            store: SqlStore::new(pool),
            sink,
            options: RelayOptions::default(),
            counters: Arc::default(),
        }
    }

    /// Messages claimed per round trip (default 100, at least 1).
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.options.batch_size = batch_size.max(1);
        self
    }

    /// How long a claimed message stays reserved (default 30 s). Also the longest a publish
    /// may take before it counts as failed.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// Attempts before a message is dead (default 10, at least 1).
    #[must_use]
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.options.max_attempts = max_attempts.max(1);
        self
    }

    /// Delays between attempts (default 0.5 s doubling to 60 s, with jitter).
    #[must_use]
    pub fn backoff(mut self, backoff: idem_core::outbox::Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }

    /// Longest sleep when nothing wakes the relay (default 500 ms).
    #[must_use]
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        self.options.poll_interval = poll_interval;
        self
    }

    /// How long [`run`](Self::run) may attempt publishes without one going through before it
    /// drops the sink's connection and starts again ([`Sink::reconnect`]; default three
    /// leases). A broker that is down costs a reconnect per bound, which is harmless; a
    /// connection that looks alive and carries nothing is what this catches.
    #[must_use]
    pub fn sink_stall(mut self, sink_stall: Duration) -> Self {
        self.options.sink_stall = Some(sink_stall);
        self
    }

    /// How often [`run`](Self::run) logs the outbox's figures (default 30 s).
    #[must_use]
    pub fn report_interval(mut self, report_interval: Duration) -> Self {
        self.options.report_interval = report_interval;
        self
    }

    /// The options in effect.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// Counters since this relay was built.
    pub fn counters(&self) -> RelayCounters {
        RelayCounters {
            published: self.counters.published.load(Ordering::Relaxed),
            retried: self.counters.retried.load(Ordering::Relaxed),
            dead: self.counters.dead.load(Ordering::Relaxed),
            sink_restarts: self.counters.sink_restarts.load(Ordering::Relaxed),
        }
    }

    /// One round: claims a batch, publishes it (concurrently: a batch holds at most one
    /// message per aggregate), and marks each message published, retrying or dead.
    pub async fn run_once(&self) -> Result<RelayRound, Error> {
        let token = random_token();
        let options = self.options;
        let store = self.store.clone();
        // Detached: a claim or a mark the caller stops waiting for still finishes, so no
        // message stays leased (or published unmarked) longer than it must.
        tracing::trace!(token, "relay round: claiming");
        let claimed = detached(async move {
            store
                .claim_messages(options.batch_size, options.lease, token)
                .await
        })
        .await?;
        tracing::trace!(
            token,
            claimed = claimed.len(),
            "relay round: claimed, publishing"
        );
        let mut round = RelayRound {
            claimed: claimed.len(),
            ..RelayRound::default()
        };
        if claimed.is_empty() {
            return Ok(round);
        }
        let outcomes = futures_util::future::join_all(claimed.iter().map(|c| async {
            if c.message.attempt > options.max_attempts {
                // Earlier attempts ended without a verdict (the relay died or lost its lease
                // every time): this message may be what kills it.
                return Err(SinkError::permanent(format!(
                    "gave up after {} attempts that ended without a result (relay stopped or lease lost)",
                    options.max_attempts
                )));
            }
            match tokio::time::timeout(options.lease, self.sink.publish(&c.message)).await {
                Ok(result) => result,
                Err(_) => Err(SinkError::transient(format!(
                    "the sink did not answer within the lease ({} ms)",
                    options.lease.as_millis()
                ))),
            }
        }))
        .await;
        let mut published = Vec::new();
        let mut failures = Vec::new();
        for (c, outcome) in claimed.iter().zip(outcomes) {
            match outcome {
                Ok(()) => published.push(c.row),
                Err(e) => {
                    let dead = e.is_permanent() || c.message.attempt >= options.max_attempts;
                    tracing::warn!(
                        id = %c.message.id,
                        topic = %c.message.topic,
                        attempt = c.message.attempt,
                        dead,
                        error = %e,
                        "outbox message not delivered"
                    );
                    failures.push(FailedAttempt {
                        row: c.row,
                        dead,
                        error: e.to_string(),
                        delay: options.backoff.delay(c.message.attempt),
                    });
                }
            }
        }
        round.published = published.len();
        round.dead = failures.iter().filter(|f| f.dead).count();
        round.retrying = failures.len() - round.dead;
        tracing::trace!(
            token,
            published = round.published,
            failed = failures.len(),
            "relay round: published, recording"
        );
        let store = self.store.clone();
        detached(async move { store.record_outcomes(token, &published, &failures).await }).await?;
        tracing::trace!(token, "relay round: recorded");
        self.counters
            .published
            .fetch_add(round.published as u64, Ordering::Relaxed);
        self.counters
            .retried
            .fetch_add(round.retrying as u64, Ordering::Relaxed);
        self.counters
            .dead
            .fetch_add(round.dead as u64, Ordering::Relaxed);
        Ok(round)
    }

    /// Runs rounds until `shutdown` completes: right after a round that found work, on a
    /// wake-up (a call in this process committed messages; on PostgreSQL, a `NOTIFY` from any
    /// process), or after the poll interval. Database and sink failures are logged and
    /// retried with backoff; they never end the loop. A round in progress finishes before
    /// the relay stops.
    ///
    /// Its liveness guard: when rounds keep claiming messages and none goes through for
    /// [`sink_stall`](Self::sink_stall), the relay drops the sink's connection
    /// ([`Sink::reconnect`]), logs it at WARN, and counts it ([`RelayCounters::sink_restarts`],
    /// [`OutboxHealth::sink_restarts`](idem_core::outbox::OutboxHealth::sink_restarts), the
    /// `idem_relay_sink_restarts_total` metric).
    pub async fn run(&self, shutdown: impl Future) -> Result<(), Error> {
        let mut shutdown = pin!(shutdown);
        let mut wake = idem_core::outbox::wake_signal();
        let listener = listen_for_commits(self.store.driver());
        let mut failures: u32 = 0;
        let mut last_report = Instant::now();
        let mut published_at_report = 0;
        // Since when every publish attempted has failed (none when the last one went through).
        let mut failing_since: Option<Instant> = None;
        loop {
            wake.borrow_and_update();
            let pause = match self.run_once().await {
                Ok(round) if round.claimed > 0 => {
                    failures = 0;
                    if round.published > 0 {
                        failing_since = None;
                    } else {
                        let since = *failing_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= self.options.sink_stall_bound() {
                            self.restart_sink(since.elapsed(), round.claimed).await;
                            failing_since = Some(Instant::now());
                        }
                    }
                    None
                }
                Ok(_) => {
                    failures = 0;
                    Some(self.options.poll_interval)
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let pause = self.options.backoff.delay(failures);
                    tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "outbox relay round failed");
                    Some(pause)
                }
            };
            if last_report.elapsed() >= self.options.report_interval {
                let published = self.counters.published.load(Ordering::Relaxed);
                let per_s =
                    (published - published_at_report) as f64 / last_report.elapsed().as_secs_f64();
                match crate::outbox_health(&self.store).await {
                    Ok(h) => tracing::info!(
                        pending = h.pending,
                        oldest_pending_ms = h.oldest_pending_ms.unwrap_or(0),
                        dead = h.dead,
                        published_per_s = per_s,
                        sink_restarts = self.counters.sink_restarts.load(Ordering::Relaxed),
                        "outbox relay"
                    ),
                    Err(e) => tracing::warn!(error = %e, "outbox health unavailable"),
                }
                last_report = Instant::now();
                published_at_report = published;
            }
            match pause {
                None => {
                    // More work may be waiting; still stop promptly when asked.
                    tokio::select! {
                        biased;
                        _ = shutdown.as_mut() => break,
                        () = std::future::ready(()) => {}
                    }
                }
                Some(pause) => {
                    tokio::select! {
                        _ = shutdown.as_mut() => break,
                        _ = wake.changed() => {}
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
        if let Some(listener) = listener {
            listener.abort();
        }
        Ok(())
    }

    /// The liveness guard's move: publishes have failed for `failing_for` (the last round
    /// claimed `claimed` and published none), so the sink's connection goes, bounded by the
    /// lease: a sink stuck even there does not hold the relay.
    async fn restart_sink(&self, failing_for: Duration, claimed: usize) {
        tracing::warn!(
            failing_for_ms = failing_for.as_millis() as u64,
            claimed,
            "outbox relay: no publish went through; restarting the sink's connection"
        );
        if tokio::time::timeout(self.options.lease, self.sink.reconnect())
            .await
            .is_err()
        {
            tracing::warn!(
                lease_ms = self.options.lease.as_millis() as u64,
                "outbox relay: the sink did not reconnect within the lease"
            );
        }
        self.counters.sink_restarts.fetch_add(1, Ordering::Relaxed);
        idem_core::outbox::note_sink_restart();
    }
}

/// Wakes this process's relays on each of `notifications` (a driver's commit listener, as
/// [`Driver::wake_on_commits`] returns it) until one fails.
pub async fn wake_on_each<N, E>(
    notifications: impl futures_util::Stream<Item = Result<N, E>>,
) -> Result<(), E> {
    use futures_util::StreamExt as _;
    let mut notifications = pin!(notifications);
    while let Some(notification) = notifications.next().await {
        notification?;
        idem_core::outbox::wake();
    }
    Ok(())
}

/// The pause before the commit listener listens again: 0.1 s doubling per failure in a row to
/// 6.4 s, half of it random (listeners of many processes cut off together spread out).
const RELISTEN: Backoff = Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_millis(6_400),
};

/// A task that wakes this process's relays on each commit another process announces
/// ([`Driver::wake_on_commits`]: PostgreSQL's `NOTIFY`), restarting the listener after a
/// failure with a growing pause ([`RELISTEN`]); `None` where the driver cannot listen (the
/// relay polls). The relay aborts it when it stops.
fn listen_for_commits<D: Driver>(driver: &D) -> Option<tokio::task::JoinHandle<()>> {
    let first = driver.wake_on_commits()?;
    let driver = driver.clone();
    Some(tokio::spawn(async move {
        let mut listening = Some(first);
        let mut failures = 0u32;
        loop {
            if let Some(listen) = listening.take().or_else(|| driver.wake_on_commits()) {
                match listen.await {
                    Ok(()) => failures = 0,
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        tracing::debug!(error = %e, "outbox listener reconnecting");
                    }
                }
            }
            tokio::time::sleep(RELISTEN.delay(failures.saturating_add(1))).await;
        }
    }))
}
