//! Effects that leave the database: messages staged in a handler's transaction (the outbox)
//! and the store-independent parts of the relay that publishes them afterwards.
//!
//! A handler stages a [`Message`] in its own transaction (with the SeaORM store:
//! `idem::sea_orm::Outbox::stage`), so the message commits with the handler's writes or not at
//! all, and a replay stages nothing. A relay then claims committed messages, hands each to a
//! [`Sink`] (a broker, an HTTP API) at least once, and marks it published. The message id
//! travels with every attempt, so the receiver deduplicates (JetStream's `Nats-Msg-Id`, an
//! API's `Idempotency-Key`, or idem's inbox on the consuming side).

use std::fmt;
use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use serde::Serialize;

use crate::error::{BoxError, Error};

/// Longest topic and aggregate key, in bytes (they are indexed `VARCHAR(255)` columns).
pub const MAX_NAME_LEN: usize = 255;

/// A message to stage in the outbox, built in a handler.
///
/// ```
/// # #[derive(serde::Serialize)] struct Paid { order_id: String }
/// let message = idem_core::outbox::Message::json("shop.orders.paid", &Paid { order_id: "o-1".into() })
///     .unwrap()
///     .aggregate("o-1")
///     .header("content-type", "application/json");
/// assert_eq!(message.topic(), "shop.orders.paid");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    topic: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    aggregate: Option<String>,
}

impl Message {
    /// A message on `topic` (a NATS subject, a queue name, an API route) with raw bytes.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            topic: topic.into(),
            payload: payload.into(),
            headers: Vec::new(),
            aggregate: None,
        }
    }

    /// A message whose payload is `value` as JSON.
    pub fn json<T: Serialize + ?Sized>(topic: impl Into<String>, value: &T) -> Result<Self, Error> {
        let topic = topic.into();
        let payload = serde_json::to_vec(value).map_err(|e| Error::Encode {
            scope: topic.clone(),
            source: Box::new(e),
        })?;
        Ok(Self::new(topic, payload))
    }

    /// Orders this message after every earlier message of the same aggregate (an order id,
    /// an account): the relay publishes them in commit order. Messages of different
    /// aggregates, and messages without one, flow in parallel.
    #[must_use]
    pub fn aggregate(mut self, key: impl Into<String>) -> Self {
        self.aggregate = Some(key.into());
        self
    }

    /// Adds a header, delivered with the message (NATS headers, HTTP headers of a function
    /// sink).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers, in the order they were added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The aggregate key, if any.
    pub fn aggregate_key(&self) -> Option<&str> {
        self.aggregate.as_deref()
    }

    /// Checks what the outbox table can hold: a non-empty topic and aggregate of at most
    /// [`MAX_NAME_LEN`] bytes without control characters, header names that are tokens.
    pub fn validate(&self) -> Result<(), Error> {
        let name = |what: &str, value: &str| {
            let problem = if value.is_empty() {
                "is empty"
            } else if value.len() > MAX_NAME_LEN {
                "is longer than 255 bytes"
            } else if value.chars().any(char::is_control) {
                "contains a control character"
            } else {
                return Ok(());
            };
            Err(invalid(format!("the message's {what} {problem}")))
        };
        name("topic", &self.topic)?;
        if let Some(aggregate) = &self.aggregate {
            name("aggregate key", aggregate)?;
        }
        for (header, value) in &self.headers {
            if header.is_empty() || !header.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
                return Err(invalid(format!(
                    "header name `{}` is not a token (visible ASCII without `:`)",
                    header.escape_debug()
                )));
            }
            if value.chars().any(|c| c == '\r' || c == '\n') {
                return Err(invalid(format!(
                    "the value of header `{header}` contains a line break"
                )));
            }
        }
        Ok(())
    }

    /// The payload, by value.
    pub fn into_payload(self) -> Vec<u8> {
        self.payload
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidMessage { message }
}

/// A committed message as the relay hands it to a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// Stable, unique id (a UUID): the same on every attempt. Send it downstream as the
    /// deduplication key (`Nats-Msg-Id`, `Idempotency-Key`).
    pub id: String,
    /// The topic it was staged on.
    pub topic: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The headers it was staged with.
    pub headers: Vec<(String, String)>,
    /// The aggregate key, if any.
    pub aggregate: Option<String>,
    /// Position within its aggregate (1, 2, …, in commit order), if it has one.
    pub aggregate_seq: Option<i64>,
    /// Which attempt this is (1 for the first).
    pub attempt: u32,
}

impl OutboxMessage {
    /// A message for tests and custom relays.
    pub fn new(id: impl Into<String>, topic: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            id: id.into(),
            topic: topic.into(),
            payload,
            headers: Vec::new(),
            aggregate: None,
            aggregate_seq: None,
            attempt: 1,
        }
    }
}

/// Why a sink could not deliver a message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SinkError {
    message: String,
    permanent: bool,
    #[source]
    source: Option<BoxError>,
}

impl SinkError {
    /// A failure that may pass (broker down, timeout, 5xx): the relay retries with backoff.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            permanent: false,
            source: None,
        }
    }

    /// A failure that will not pass (the receiver refused the message, 4xx): the message is
    /// dead at once and waits for an operator.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            permanent: true,
            source: None,
        }
    }

    /// Attaches the underlying error.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

/// Where a relay delivers messages: a broker, an HTTP API, a log.
///
/// `publish` returns once the receiver has the message durably (a broker's ack, a 2xx). It
/// must be safe to call again with the same message: delivery is at least once, and the
/// message id is the receiver's deduplication key.
pub trait Sink: Send + Sync {
    /// Delivers one message.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Drops the sink's connection, so the next publish opens a new one. A relay calls it
    /// when it had messages to publish and none went through for
    /// [`RelayOptions::sink_stall`]: a connection that looks alive and carries nothing (a
    /// half-open TCP connection, a client library stuck on it) is what no bound inside a
    /// publish catches. The default does nothing (a sink without a connection of its own).
    fn reconnect(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

impl<S: Sink + ?Sized> Sink for std::sync::Arc<S> {
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), SinkError>> + Send {
        (**self).publish(message)
    }

    fn reconnect(&self) -> impl Future<Output = ()> + Send {
        (**self).reconnect()
    }
}

/// A sink that calls a function: an HTTP API, an email service, a test's counter. The
/// function gets the message (its `id` is the call's idempotency key).
///
/// ```
/// use idem_core::outbox::{FnSink, OutboxMessage, SinkError};
/// let sink = FnSink::new(|message: OutboxMessage| async move {
///     // e.g. POST message.payload with `Idempotency-Key: {message.id}`
///     if message.payload.is_empty() {
///         return Err(SinkError::permanent("empty payload"));
///     }
///     Ok(())
/// });
/// # let _ = sink;
/// ```
pub struct FnSink<F> {
    call: F,
}

impl<F> FnSink<F> {
    /// A sink that calls `call` for every message.
    pub fn new(call: F) -> Self {
        Self { call }
    }
}

impl<F> fmt::Debug for FnSink<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnSink").finish_non_exhaustive()
    }
}

impl<F, Fut> Sink for FnSink<F>
where
    F: Fn(OutboxMessage) -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), SinkError>> + Send,
{
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), SinkError>> + Send {
        (self.call)(message.clone())
    }
}

/// A sink that logs each message at `info` (topic, id, size): the default when no broker is
/// configured, so a program runs end to end without one.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogSink;

impl Sink for LogSink {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        tracing::info!(
            topic = %message.topic,
            id = %message.id,
            aggregate = message.aggregate.as_deref().unwrap_or(""),
            bytes = message.payload.len(),
            "outbox message published to the log sink"
        );
        Ok(())
    }
}

/// The relay's and the inbox runner's backoff (half jitter): the crate's one backoff.
pub use crate::retry::Backoff;

/// A random positive 63-bit token (relay rounds and lease owners), as the engine makes them.
pub use crate::ledger::ids::random_token;

/// How a relay runs. The defaults suit a service; tests shorten the lease and the poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayOptions {
    /// Messages claimed per round trip.
    pub batch_size: u32,
    /// How long a claimed message stays reserved for this relay. A relay that dies holding
    /// messages delays them by at most this long; a publish that takes longer may be repeated
    /// by another relay (the id deduplicates it).
    pub lease: Duration,
    /// Attempts before a message is dead (kept, reported, blocking only its own aggregate).
    pub max_attempts: u32,
    /// Delay between attempts.
    pub backoff: Backoff,
    /// Longest sleep when nothing wakes the relay (another process committed a message, on a
    /// database without notifications).
    pub poll_interval: Duration,
    /// How often the relay logs its figures (pending, oldest pending age, dead, published/s).
    pub report_interval: Duration,
    /// How long a relay may attempt publishes without one going through before it drops
    /// its sink's connection and starts again ([`Sink::reconnect`]); `None`: three leases.
    pub sink_stall: Option<Duration>,
}

impl RelayOptions {
    /// The bound after which a relay whose publishes all fail restarts its sink:
    /// [`sink_stall`](Self::sink_stall), or three leases.
    pub fn sink_stall_bound(&self) -> Duration {
        self.sink_stall.unwrap_or(self.lease.saturating_mul(3))
    }
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            backoff: Backoff::default(),
            poll_interval: Duration::from_millis(500),
            report_interval: Duration::from_secs(30),
            sink_stall: None,
        }
    }
}

/// What a health endpoint or a metrics scrape reads from the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct OutboxHealth {
    /// Messages not yet published (and not dead).
    pub pending: u64,
    /// Age of the oldest pending message, on the database clock.
    pub oldest_pending_ms: Option<u64>,
    /// Dead messages, waiting for an operator.
    pub dead: u64,
    /// How often relays of this process restarted their sink because publishes stopped
    /// going through ([`Sink::reconnect`]; [`sink_restarts`]). Not a figure of the database:
    /// another process's relays count their own.
    pub sink_restarts: u64,
}

/// Sink restarts by the relays of this process (their liveness guard), since it started.
static SINK_RESTARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How often relays of this process restarted their sink since it started: a relay that had
/// messages to publish and got none through for [`RelayOptions::sink_stall_bound`] drops its
/// sink's connection and starts again. A figure that grows means a broker or a network path
/// that accepts connections and then stops answering.
pub fn sink_restarts() -> u64 {
    SINK_RESTARTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts a sink restart by a relay of this process, in [`sink_restarts`] and the
/// `idem_relay_sink_restarts_total` metric. Relays call it; a relay of your own should too.
pub fn note_sink_restart() {
    SINK_RESTARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::metrics::sink_restart();
}

/// A message a consumer gave up on, as it is recorded.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DeadLetter<'a> {
    /// The consumer (durable name or handler scope) that gave up.
    pub consumer: &'a str,
    /// The message id (its deduplication key).
    pub message_id: &'a str,
    /// The subject or topic it arrived on.
    pub subject: &'a str,
    /// The payload.
    pub payload: &'a [u8],
    /// The handler's last error.
    pub error: &'a str,
    /// How often it was delivered.
    pub deliveries: u64,
}

impl<'a> DeadLetter<'a> {
    /// A dead letter of `consumer` for `message_id`.
    pub fn new(
        consumer: &'a str,
        message_id: &'a str,
        subject: &'a str,
        payload: &'a [u8],
        error: &'a str,
        deliveries: u64,
    ) -> Self {
        Self {
            consumer,
            message_id,
            subject,
            payload,
            error,
            deliveries,
        }
    }
}

/// Where a consumer records messages it gave up on (with SeaORM:
/// `idem::sea_orm::DeadLetterTable`).
pub trait DeadLetters: Send + Sync {
    /// Records `letter`; recording the same consumer and message id again updates it.
    fn record(&self, letter: &DeadLetter<'_>) -> impl Future<Output = Result<(), Error>> + Send;
}

/// The wake-up signal of relays in this process: bumped after a transaction that staged
/// messages commits, so a relay picks them up without waiting for its poll interval.
static WAKE: LazyLock<tokio::sync::watch::Sender<u64>> =
    LazyLock::new(|| tokio::sync::watch::Sender::new(0));

/// Wakes the relays of this process. `#[idempotent]` calls it after a call that staged
/// messages commits; call it yourself after committing a transaction of your own in which you
/// staged messages (relays poll anyway, this only saves the wait).
pub fn wake() {
    WAKE.send_modify(|generation| *generation = generation.wrapping_add(1));
}

/// A relay's end of the wake-up signal.
pub fn wake_signal() -> tokio::sync::watch::Receiver<u64> {
    WAKE.subscribe()
}

/// Notes that the running handler body staged a message (the store calls it), so the relays
/// of this process are woken once the call's transaction commits. `false` when no
/// `#[idempotent]` body is running in this task (nobody will wake the relays after
/// a commit: call [`wake`] yourself).
pub fn note_staged() -> bool {
    crate::call::after_commit(wake)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_with_bad_names_or_headers_are_refused() {
        let ok = Message::new("a.b", vec![1])
            .aggregate("o-1")
            .header("x-a", "1");
        assert!(ok.validate().is_ok());
        for bad in [
            Message::new("", vec![]),
            Message::new("a".repeat(256), vec![]),
            Message::new("a\nb", vec![]),
            Message::new("t", vec![]).aggregate(""),
            Message::new("t", vec![]).header("bad name", "v"),
            Message::new("t", vec![]).header("x", "a\r\nb"),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_body_that_stages_wakes_the_relays_after_its_commit() {
        let (inside, hooks) = crate::call::collecting_hooks(async { note_staged() }).await;
        assert!(inside);
        assert!(hooks.iter().any(|h| std::ptr::fn_addr_eq(*h, wake as fn())));
        assert!(!note_staged(), "outside a body nothing notices");
    }

    #[tokio::test]
    async fn wake_reaches_a_waiting_relay() {
        let mut signal = wake_signal();
        signal.borrow_and_update();
        wake();
        tokio::time::timeout(Duration::from_secs(1), signal.changed())
            .await
            .expect("woken")
            .expect("sender alive");
    }
}
