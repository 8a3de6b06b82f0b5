//! The consuming side of messaging, independent of the broker: a [`Runner`] takes messages
//! from a [`Source`] and hands each to a handler, whose `#[idempotent]` function keyed by the
//! message id makes the ledger the inbox: a redelivery replays instead of running again.
//!
//! The runner owns the consumer's logic, the same for every broker:
//! - the handler's `Ok`: the message is acknowledged, only now that its transaction committed;
//! - `Err` before [`max_deliver`](Runner::max_deliver) deliveries: negatively acknowledged,
//!   to come again after a [`Backoff`] delay;
//! - `Err` at `max_deliver`: recorded in the [`DeadLetters`], then terminated (if recording
//!   fails, it is negatively acknowledged instead, so nothing is dropped unrecorded);
//! - a subscription that fails or ends: subscribed again with backoff, until shutdown.
//!
//! A broker is a [`Source`]: five calls (connect, next, ack, nak with a delay, terminate).
//! NATS JetStream is `idem::nats::JetStreamSource`; [`MemorySource`] keeps messages in
//! memory, for tests. Kafka, SQS or RabbitMQ is an adapter of a few dozen lines.
//!
//! # Another broker
//!
//! An Amazon SQS queue as a source. `sqs::Client` stands in for the SDK's client, whose
//! `receive_message`, `delete_message` and `change_message_visibility` it mirrors: a receipt
//! handle settles a message, and the queue redelivers a message whose visibility timeout
//! ran out.
//!
//! ```
//! use std::time::Duration;
//!
//! use idem_core::BoxError;
//! use idem_core::inbox::{Delivery, Source};
//! # mod sqs {
//! #     pub struct Message {
//! #         pub message_id: String, pub body: String, pub receipt_handle: String,
//! #         pub receive_count: u64, pub attributes: Vec<(String, String)>,
//! #     }
//! #     pub struct Client;
//! #     impl Client {
//! #         pub async fn receive_message(&self, _queue: &str, _wait_seconds: u32)
//! #             -> Result<Option<Message>, idem_core::BoxError> { Ok(None) }
//! #         pub async fn delete_message(&self, _queue: &str, _receipt: &str)
//! #             -> Result<(), idem_core::BoxError> { Ok(()) }
//! #         pub async fn change_message_visibility(&self, _queue: &str, _receipt: &str, _seconds: u64)
//! #             -> Result<(), idem_core::BoxError> { Ok(()) }
//! #     }
//! # }
//!
//! /// An SQS queue; the outbox's message id travels in the `idem-message-id` attribute.
//! struct SqsSource {
//!     client: sqs::Client,
//!     queue_url: String,
//! }
//!
//! impl Source for SqsSource {
//!     /// The message's receipt handle.
//!     type Receipt = String;
//!
//!     async fn connect(&mut self) -> Result<(), BoxError> {
//!         Ok(()) // every call is a request of its own: nothing to subscribe to
//!     }
//!
//!     async fn next(&mut self) -> Result<Option<(Delivery, String)>, BoxError> {
//!         loop {
//!             // Long polling: waits up to 20 s for a message, then asks again.
//!             let Some(m) = self.client.receive_message(&self.queue_url, 20).await? else {
//!                 continue;
//!             };
//!             let id = m.attributes.iter().find(|(name, _)| name == "idem-message-id");
//!             let id = id.map_or(m.message_id, |(_, id)| id.clone());
//!             let delivery = Delivery::new(id, &self.queue_url, m.body.into_bytes())
//!                 .with_delivered(m.receive_count);
//!             return Ok(Some((delivery, m.receipt_handle)));
//!         }
//!     }
//!
//!     async fn ack(&mut self, receipt: String) -> Result<(), BoxError> {
//!         self.client.delete_message(&self.queue_url, &receipt).await
//!     }
//!
//!     async fn nak(&mut self, receipt: String, delay: Duration) -> Result<(), BoxError> {
//!         // Visible again after `delay`, when the queue delivers it again.
//!         let seconds = delay.as_secs().max(1);
//!         self.client.change_message_visibility(&self.queue_url, &receipt, seconds).await
//!     }
//!
//!     async fn terminate(&mut self, receipt: String) -> Result<(), BoxError> {
//!         // The runner has recorded it in the dead letters: off the queue.
//!         self.client.delete_message(&self.queue_url, &receipt).await
//!     }
//! }
//! # let _ = |source: SqsSource| idem_core::inbox::Runner::new("notifier", source);
//! ```
//!
//! It runs like any source:
//! `Runner::new("notifier", source).run(|d| send_receipt(&db, d), &dead_letters, shutdown)`.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::error::{BoxError, Error};
use crate::outbox::{Backoff, DeadLetter, DeadLetters};

/// One delivery of a message to a [`Runner`]'s handler.
///
/// It is `Serialize` over its subject and payload only (not the delivery count), so passing
/// it to an `#[idempotent(key = delivery.id())]` handler fingerprints the message itself: a
/// redelivery replays, and a different message under a reused id is `KeyReused`.
#[derive(Debug, Clone)]
pub struct Delivery {
    id: String,
    subject: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    delivered: u64,
}

impl Delivery {
    /// A first delivery of message `id`, without headers. Sources build theirs this way; so
    /// do tests and custom runners.
    pub fn new(id: impl Into<String>, subject: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            id: id.into(),
            subject: subject.into(),
            payload,
            headers: Vec::new(),
            delivered: 1,
        }
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets how often the broker has delivered the message, this delivery included (at
    /// least 1).
    #[must_use]
    pub fn with_delivered(mut self, delivered: u64) -> Self {
        self.delivered = delivered.max(1);
        self
    }

    /// The message id: with the outbox, the id it was staged under (JetStream's
    /// `Nats-Msg-Id`); else whatever identifies the message at its broker. Use it as the
    /// handler's idempotency key.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The subject (topic, queue) it was published on.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The payload as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// The message's headers.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// How often the broker delivered it (1 the first time).
    pub fn delivered(&self) -> u64 {
        self.delivered
    }
}

impl Serialize for Delivery {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("Delivery", 2)?;
        s.serialize_field("subject", &self.subject)?;
        s.serialize_field("payload", &self.payload)?;
        s.end()
    }
}

/// Where a [`Runner`] receives messages: a broker's subscription, as five calls.
///
/// Delivery is at least once: a message that is neither acknowledged nor terminated comes
/// again (after a negative acknowledgement's delay, or the broker's own timeout). The runner
/// calls one method at a time and settles each message it received (ack, nak or terminate)
/// before asking for the next.
pub trait Source: Send {
    /// What settles one received message: the broker's message handle, an SQS receipt
    /// handle, a RabbitMQ delivery tag.
    type Receipt: Send;

    /// Subscribes: called before the first [`next`](Self::next), and again after it failed
    /// or the subscription ended. An error is logged and retried with backoff.
    fn connect(&mut self) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Waits for the next message. `Ok(None)`: the subscription ended; `Err`: it failed (a
    /// lost connection); either way the runner connects again. The runner drops this future
    /// at shutdown, so a message must not be lost when it is dropped while waiting.
    fn next(
        &mut self,
    ) -> impl Future<Output = Result<Option<(Delivery, Self::Receipt)>, BoxError>> + Send;

    /// Acknowledges a message: its handler committed, and it must not come again.
    fn ack(&mut self, receipt: Self::Receipt) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Negatively acknowledges a message: deliver it again after `delay`.
    fn nak(
        &mut self,
        receipt: Self::Receipt,
        delay: Duration,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Gives a message up: it is in the dead letters, and must never come again.
    fn terminate(
        &mut self,
        receipt: Self::Receipt,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// Hands each message of a [`Source`] to a handler, and acknowledges it only after the
/// handler succeeded (the module's documentation lists what happens on failure).
///
/// With an `#[idempotent(key = delivery.id())]` handler, a redelivered message replays: no
/// second effect, acknowledged again.
#[derive(Debug, Clone)]
pub struct Runner<S> {
    name: String,
    source: S,
    max_deliver: u64,
    backoff: Backoff,
}

impl<S> Runner<S> {
    /// A runner named `name` (the consumer in logs and dead letters, e.g. a durable name) on
    /// `source`. Defaults: dead-lettered at the 5th failed delivery, negative
    /// acknowledgements delayed 200 ms doubling to 30 s.
    pub fn new(name: impl Into<String>, source: S) -> Self {
        Self {
            name: name.into(),
            source,
            max_deliver: 5,
            backoff: Backoff {
                initial: Duration::from_millis(200),
                max: Duration::from_secs(30),
            },
        }
    }

    /// Deliveries before a failing message is dead-lettered (default 5, at least 1).
    #[must_use]
    pub fn max_deliver(mut self, max_deliver: u64) -> Self {
        self.max_deliver = max_deliver.max(1);
        self
    }

    /// Delays of negative acknowledgements and of reconnections (default 200 ms doubling to
    /// 30 s, with jitter).
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The runner's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The source, to configure it.
    pub fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }
}

impl<S: Source> Runner<S> {
    /// Consumes until `shutdown` completes, then returns `Ok`. A failing or ending
    /// subscription is logged and subscribed again with backoff; it never ends the loop. A
    /// message being handled is finished (and settled) first.
    pub async fn run<H, Fut, T, E, D>(
        &mut self,
        handler: H,
        dead_letters: &D,
        shutdown: impl Future,
    ) -> Result<(), Error>
    where
        H: Fn(Delivery) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
        D: DeadLetters,
    {
        let mut shutdown = pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let connected = tokio::select! {
                _ = shutdown.as_mut() => return Ok(()),
                connected = self.source.connect() => connected,
            };
            match connected {
                Ok(()) => loop {
                    tracing::trace!(consumer = %self.name, "inbox: waiting for the next delivery");
                    let next = tokio::select! {
                        _ = shutdown.as_mut() => return Ok(()),
                        next = self.source.next() => next,
                    };
                    match next {
                        Ok(Some((delivery, receipt))) => {
                            failures = 0;
                            self.handle(delivery, receipt, &handler, dead_letters).await;
                        }
                        Ok(None) => {
                            tracing::info!(consumer = %self.name, "subscription ended; subscribing again");
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(consumer = %self.name, error = %e, "subscription failed; subscribing again");
                            break;
                        }
                    }
                },
                Err(e) => {
                    tracing::warn!(consumer = %self.name, error = %e, "consumer not ready");
                }
            }
            failures = failures.saturating_add(1);
            let pause = self.backoff.delay(failures);
            tracing::debug!(consumer = %self.name, retry_in_ms = pause.as_millis() as u64, "subscribing after a pause");
            tokio::select! {
                _ = shutdown.as_mut() => return Ok(()),
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Runs the handler on one delivery and settles it.
    async fn handle<H, Fut, T, E, D>(
        &mut self,
        delivery: Delivery,
        receipt: S::Receipt,
        handler: &H,
        dead_letters: &D,
    ) where
        H: Fn(Delivery) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
        D: DeadLetters,
    {
        let delivered = delivery.delivered();
        tracing::trace!(consumer = %self.name, id = %delivery.id(), "inbox: handling");
        let outcome = if delivered > self.max_deliver {
            // Earlier deliveries ended without an answer (the consumer died each time).
            Err(format!(
                "delivered {delivered} times without an acknowledgement"
            ))
        } else {
            handler(delivery.clone())
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        };
        tracing::trace!(consumer = %self.name, id = %delivery.id(), ok = outcome.is_ok(), "inbox: handled, settling");
        let settled = match outcome {
            Ok(()) => self.source.ack(receipt).await,
            Err(error) if delivered >= self.max_deliver => {
                let letter = DeadLetter::new(
                    &self.name,
                    delivery.id(),
                    delivery.subject(),
                    delivery.payload(),
                    &error,
                    delivered,
                );
                match dead_letters.record(&letter).await {
                    Ok(()) => {
                        tracing::warn!(consumer = %self.name, id = %delivery.id(), delivered, %error, "message dead-lettered");
                        self.source.terminate(receipt).await
                    }
                    Err(e) => {
                        tracing::warn!(consumer = %self.name, id = %delivery.id(), error = %e, "dead letter not recorded; redelivering");
                        let delay = self.backoff.delay(attempt(self.max_deliver));
                        self.source.nak(receipt, delay).await
                    }
                }
            }
            Err(error) => {
                let delay = self.backoff.delay(attempt(delivered));
                tracing::info!(consumer = %self.name, id = %delivery.id(), delivered, %error, retry_in_ms = delay.as_millis() as u64, "handler failed; redelivering");
                self.source.nak(receipt, delay).await
            }
        };
        tracing::trace!(consumer = %self.name, id = %delivery.id(), ok = settled.is_ok(), "inbox: settled");
        if let Err(e) = settled {
            // The broker delivers the message again after its own timeout; the inbox makes
            // that harmless.
            tracing::warn!(consumer = %self.name, id = %delivery.id(), error = %e, "acknowledgement failed");
        }
    }
}

/// A delivery count as a backoff attempt number.
fn attempt(delivered: u64) -> u32 {
    u32::try_from(delivered).unwrap_or(u32::MAX)
}

/// A [`Source`] in memory: a broker for tests of handlers, runners and dead letters, and
/// the model of what the runner expects from one.
///
/// Messages come in the order they were sent, one at a time: a negatively acknowledged
/// message keeps its place and holds the later ones back until its delay has passed (as
/// JetStream does with one message in flight), and comes again with its delivery count
/// raised. Clones share the queue, so a test keeps one to send and inspect while a runner
/// owns another.
///
/// ```
/// use idem_core::inbox::{Delivery, MemorySource, Runner};
/// use idem_core::outbox::{DeadLetter, DeadLetters};
///
/// struct NoDeadLetters;
/// impl DeadLetters for NoDeadLetters {
///     async fn record(&self, _: &DeadLetter<'_>) -> Result<(), idem_core::Error> {
///         Ok(())
///     }
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let source = MemorySource::new();
/// source.send(Delivery::new("m-1", "shop.orders.paid", b"{}".to_vec()));
/// source.send(Delivery::new("m-2", "shop.orders.paid", b"{}".to_vec()));
/// let handler = |d: Delivery| async move {
///     // Fails the first delivery of m-1: it comes again, before m-2.
///     if d.id() == "m-1" && d.delivered() == 1 { Err("busy") } else { Ok(()) }
/// };
/// let mut runner = Runner::new("receipts", source.clone());
/// runner.run(handler, &NoDeadLetters, source.settled()).await.unwrap();
/// assert_eq!(source.acked(), ["m-1", "m-2"]);
/// assert_eq!(source.naks().len(), 1);
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemorySource {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<Queue>,
    /// Notified on every change: a message sent or settled, a broken connection.
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Queue {
    /// Messages waiting to be delivered, in the order they were sent.
    waiting: Vec<Waiting>,
    /// Received and not yet settled, by receipt (the message's sequence number).
    in_flight: HashMap<u64, Delivery>,
    sent: u64,
    connected: bool,
    connects: u32,
    acked: Vec<String>,
    terminated: Vec<String>,
    naks: Vec<(String, Duration)>,
}

#[derive(Debug)]
struct Waiting {
    sequence: u64,
    delivery: Delivery,
    visible_at: Instant,
}

impl MemorySource {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues a message; it is delivered with its own delivery count (1 for
    /// [`Delivery::new`]; more for a message a crashed consumer received before).
    pub fn send(&self, delivery: Delivery) {
        self.change(|queue| {
            queue.sent += 1;
            let sequence = queue.sent;
            queue.waiting.push(Waiting {
                sequence,
                delivery,
                visible_at: Instant::now(),
            });
        });
    }

    /// Breaks the subscription, as a lost connection does: the next [`Source::next`] fails,
    /// and the source delivers again only after [`Source::connect`].
    pub fn disconnect(&self) {
        self.change(|queue| queue.connected = false);
    }

    /// The ids of acknowledged messages, in the order they were acknowledged.
    pub fn acked(&self) -> Vec<String> {
        self.lock().acked.clone()
    }

    /// The ids of terminated (dead-lettered) messages, in order.
    pub fn terminated(&self) -> Vec<String> {
        self.lock().terminated.clone()
    }

    /// Every negative acknowledgement: the message id and the delay asked for.
    pub fn naks(&self) -> Vec<(String, Duration)> {
        self.lock().naks.clone()
    }

    /// How often a runner connected.
    pub fn connects(&self) -> u32 {
        self.lock().connects
    }

    /// Messages sent and not yet acknowledged or terminated (waiting or in flight).
    pub fn unsettled(&self) -> usize {
        let queue = self.lock();
        queue.waiting.len() + queue.in_flight.len()
    }

    /// Completes once every message sent so far is acknowledged or terminated: a runner's
    /// shutdown in tests.
    pub async fn settled(&self) {
        loop {
            let changed = self.shared.changed.notified();
            let mut changed = pin!(changed);
            changed.as_mut().enable();
            if self.unsettled() == 0 {
                return;
            }
            changed.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // The queue stays consistent at every step: a panic elsewhere cannot leave it half-changed.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn change<R>(&self, change: impl FnOnce(&mut Queue) -> R) -> R {
        let result = change(&mut self.lock());
        self.shared.changed.notify_waiters();
        result
    }

    /// Takes a received message back out of flight.
    fn settle(
        &self,
        receipt: u64,
        settle: impl FnOnce(&mut Queue, Delivery),
    ) -> Result<(), BoxError> {
        self.change(|queue| {
            let delivery = queue
                .in_flight
                .remove(&receipt)
                .ok_or_else(|| format!("no message in flight under receipt {receipt}"))?;
            settle(queue, delivery);
            Ok(())
        })
    }
}

impl Source for MemorySource {
    /// The message's sequence number (1 for the first message sent).
    type Receipt = u64;

    async fn connect(&mut self) -> Result<(), BoxError> {
        self.change(|queue| {
            queue.connected = true;
            queue.connects += 1;
        });
        Ok(())
    }

    async fn next(&mut self) -> Result<Option<(Delivery, u64)>, BoxError> {
        loop {
            let changed = self.shared.changed.notified();
            let mut changed = pin!(changed);
            changed.as_mut().enable();
            let visible_at = {
                let mut queue = self.lock();
                if !queue.connected {
                    return Err("the subscription was broken".into());
                }
                match queue.waiting.first() {
                    Some(head) if head.visible_at <= Instant::now() => {
                        let head = queue.waiting.remove(0);
                        queue.in_flight.insert(head.sequence, head.delivery.clone());
                        return Ok(Some((head.delivery, head.sequence)));
                    }
                    head => head.map(|h| h.visible_at),
                }
            };
            match visible_at {
                Some(at) => {
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    async fn ack(&mut self, receipt: u64) -> Result<(), BoxError> {
        self.settle(receipt, |queue, delivery| queue.acked.push(delivery.id))
    }

    async fn nak(&mut self, receipt: u64, delay: Duration) -> Result<(), BoxError> {
        self.settle(receipt, |queue, mut delivery| {
            queue.naks.push((delivery.id.clone(), delay));
            delivery.delivered += 1;
            // Back in its place: later messages wait behind it.
            let place = queue.waiting.partition_point(|w| w.sequence < receipt);
            queue.waiting.insert(
                place,
                Waiting {
                    sequence: receipt,
                    delivery,
                    visible_at: Instant::now() + delay,
                },
            );
        })
    }

    async fn terminate(&mut self, receipt: u64) -> Result<(), BoxError> {
        self.settle(receipt, |queue, delivery| {
            queue.terminated.push(delivery.id)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Dead letters in memory; the first `refusals` records fail.
    #[derive(Default)]
    struct Letters {
        recorded: Mutex<Vec<(String, String, u64)>>,
        refusals: AtomicUsize,
    }

    impl DeadLetters for Letters {
        async fn record(&self, letter: &DeadLetter<'_>) -> Result<(), Error> {
            let refuse = self
                .refusals
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if refuse.is_ok() {
                return Err(Error::store("recording a dead letter", "database down"));
            }
            let mut recorded = self.recorded.lock().expect("letters");
            recorded.push((
                letter.message_id.to_owned(),
                letter.error.to_owned(),
                letter.deliveries,
            ));
            Ok(())
        }
    }

    impl Letters {
        fn recorded(&self) -> Vec<(String, String, u64)> {
            self.recorded.lock().expect("letters").clone()
        }
    }

    fn message(id: &str) -> Delivery {
        Delivery::new(id, "test.subject", id.as_bytes().to_vec())
    }

    const FAST: Backoff = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_secs(1),
    };

    #[tokio::test(start_paused = true)]
    async fn acks_only_after_the_handler_succeeded_and_redelivers_failures_in_order() {
        let source = MemorySource::new();
        for id in ["a", "b"] {
            source.send(message(id));
        }
        let probe = source.clone();
        let handled = Mutex::new(Vec::new());
        let handler = |d: Delivery| {
            let handled = &handled;
            let probe = &probe;
            async move {
                assert!(
                    !probe.acked().contains(&d.id().to_owned()),
                    "{} acknowledged before its handler finished",
                    d.id()
                );
                handled
                    .lock()
                    .expect("handled")
                    .push((d.id().to_owned(), d.delivered()));
                if d.id() == "a" && d.delivered() < 3 {
                    return Err("not yet");
                }
                Ok(())
            }
        };
        let started = Instant::now();
        Runner::new("test", source.clone())
            .backoff(FAST)
            .run(handler, &Letters::default(), source.settled())
            .await
            .expect("run");
        assert_eq!(
            handled.into_inner().expect("handled"),
            [
                ("a".into(), 1),
                ("a".into(), 2),
                ("a".into(), 3),
                ("b".into(), 1)
            ],
            "a retried in its place, b after it"
        );
        assert_eq!(source.acked(), ["a", "b"]);
        let naks = source.naks();
        assert_eq!(naks.len(), 2);
        // Backoff after delivery n: 10 ms · 2^(n-1), scaled into [0.5, 1).
        for (n, (id, delay)) in naks.iter().enumerate() {
            let full = FAST.initial * (1 << n);
            assert_eq!(id, "a");
            assert!(*delay >= full / 2 && *delay < full, "nak {n}: {delay:?}");
        }
        let waited: Duration = naks.iter().map(|(_, delay)| *delay).sum();
        assert!(started.elapsed() >= waited, "redelivered before its delay");
        assert!(source.terminated().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn dead_letters_at_the_delivery_limit_and_terminates() {
        let source = MemorySource::new();
        source.send(message("poison"));
        source.send(message("fine"));
        let letters = Letters::default();
        let runs = AtomicUsize::new(0);
        let handler = |d: Delivery| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                match d.id() {
                    "poison" => Err(format!("cannot handle delivery {}", d.delivered())),
                    _ => Ok(()),
                }
            }
        };
        Runner::new("test", source.clone())
            .max_deliver(3)
            .backoff(FAST)
            .run(handler, &letters, source.settled())
            .await
            .expect("run");
        assert_eq!(runs.load(Ordering::SeqCst), 4, "poison 3 times, fine once");
        assert_eq!(
            letters.recorded(),
            [("poison".into(), "cannot handle delivery 3".into(), 3)]
        );
        assert_eq!(source.terminated(), ["poison"]);
        assert_eq!(source.acked(), ["fine"]);
        assert_eq!(source.naks().len(), 2);
    }

    /// A message delivered past the limit without an answer (a consumer that died handling
    /// it, each time) is dead-lettered without running the handler again.
    #[tokio::test(start_paused = true)]
    async fn a_message_past_the_limit_is_dead_lettered_unhandled() {
        let source = MemorySource::new();
        source.send(message("crashes").with_delivered(6));
        let letters = Letters::default();
        let runs = AtomicUsize::new(0);
        let handler = |_: Delivery| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, String>(()) }
        };
        Runner::new("test", source.clone())
            .max_deliver(5)
            .run(handler, &letters, source.settled())
            .await
            .expect("run");
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        let recorded = letters.recorded();
        assert_eq!(recorded.len(), 1);
        assert_eq!(
            recorded[0].1,
            "delivered 6 times without an acknowledgement"
        );
        assert_eq!(source.terminated(), ["crashes"]);
    }

    /// A dead letter that cannot be recorded is not dropped: the message comes again, and
    /// is dead-lettered at its next delivery.
    #[tokio::test(start_paused = true)]
    async fn an_unrecorded_dead_letter_is_redelivered() {
        let source = MemorySource::new();
        source.send(message("poison"));
        let letters = Letters::default();
        letters.refusals.store(1, Ordering::SeqCst);
        let runs = AtomicUsize::new(0);
        let handler = |_: Delivery| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>("always fails") }
        };
        Runner::new("test", source.clone())
            .max_deliver(1)
            .backoff(FAST)
            .run(handler, &letters, source.settled())
            .await
            .expect("run");
        assert_eq!(source.naks().len(), 1, "refused once, redelivered");
        assert_eq!(source.terminated(), ["poison"]);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the second delivery is past the limit"
        );
        assert_eq!(letters.recorded().len(), 1);
        assert!(source.acked().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn reconnects_after_a_broken_subscription() {
        let source = MemorySource::new();
        source.send(message("before"));
        let probe = source.clone();
        let handler = |d: Delivery| {
            let probe = probe.clone();
            async move {
                if d.id() == "before" {
                    probe.disconnect();
                    probe.send(message("after"));
                }
                Ok::<_, String>(())
            }
        };
        Runner::new("test", source.clone())
            .backoff(FAST)
            .run(handler, &Letters::default(), source.settled())
            .await
            .expect("run");
        assert_eq!(source.acked(), ["before", "after"]);
        assert_eq!(source.connects(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_a_runner_waiting_for_messages() {
        let source = MemorySource::new();
        let handler = |_: Delivery| async { Ok::<_, String>(()) };
        let mut runner = Runner::new("test", source.clone());
        let letters = Letters::default();
        let stopped = runner.run(
            handler,
            &letters,
            tokio::time::sleep(Duration::from_secs(5)),
        );
        tokio::time::timeout(Duration::from_secs(10), stopped)
            .await
            .expect("stopped at shutdown")
            .expect("run");
        assert_eq!(source.connects(), 1);
    }

    #[test]
    fn a_delivery_fingerprints_its_subject_and_payload_only() {
        let first = message("m");
        let again = message("m").with_delivered(4).header("trace", "x");
        assert_eq!(
            serde_json::to_vec(&first).expect("json"),
            serde_json::to_vec(&again).expect("json")
        );
        assert_eq!(again.delivered(), 4);
        assert_eq!(again.headers(), [("trace".to_owned(), "x".to_owned())]);
    }
}
