//! NATS JetStream on both sides of the outbox: [`JetStreamSink`] publishes relayed messages
//! with `Nats-Msg-Id` (JetStream drops duplicates within the stream's window), and
//! [`Consumer`] runs a durable pull consumer whose handler is an `#[idempotent]` function
//! keyed by the message id, so the ledger is the inbox: a redelivery replays instead of
//! running again, and the message is acknowledged only after the handler's transaction
//! committed.
//!
//! Works with nats-server 2.9 and later (no 2.10+ consumer features are used).

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures_util::StreamExt;

use crate::error::Error;
use crate::inbox::Delivery;
use crate::outbox::{Backoff, DeadLetter, DeadLetters, OutboxMessage, Sink, SinkError};

pub use async_nats;

/// The JetStream header that carries a message's deduplication id.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";
/// The header that carries a message's aggregate key, when it has one.
pub const AGGREGATE_HEADER: &str = "Idem-Aggregate";
/// The header that carries a message's position in its aggregate (1, 2, … in commit order),
/// so a consumer can check it saw every message of an aggregate, in order.
pub const AGGREGATE_SEQ_HEADER: &str = "Idem-Aggregate-Seq";

/// Publishes outbox messages to JetStream: the topic is the subject, the message id goes in
/// `Nats-Msg-Id` (and the aggregate and its sequence number in `Idem-Aggregate` and
/// `Idem-Aggregate-Seq`), and a publish counts once the stream acknowledged it (a duplicate's
/// acknowledgement too).
#[derive(Debug, Clone)]
pub struct JetStreamSink {
    jetstream: jetstream::Context,
}

impl JetStreamSink {
    /// A sink on `jetstream`. A stream must capture the topics (see [`ensure_stream`]).
    pub fn new(jetstream: jetstream::Context) -> Self {
        Self { jetstream }
    }
}

impl Sink for JetStreamSink {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers.insert(MESSAGE_ID_HEADER, message.id.as_str());
        if let (Some(aggregate), Some(seq)) = (&message.aggregate, message.aggregate_seq) {
            headers.insert(AGGREGATE_HEADER, aggregate.as_str());
            headers.insert(AGGREGATE_SEQ_HEADER, seq.to_string());
        }
        let ack = self
            .jetstream
            .publish_with_headers(
                message.topic.clone(),
                headers,
                message.payload.clone().into(),
            )
            .await
            .map_err(|e| SinkError::transient(format!("publishing to JetStream: {e}")))?;
        ack.await
            .map_err(|e| SinkError::transient(format!("waiting for JetStream's ack: {e}")))?;
        Ok(())
    }
}

/// Creates stream `name` capturing `subjects` if it does not exist (file storage, the
/// server's defaults otherwise, including the 2-minute duplicate window).
pub async fn ensure_stream(
    jetstream: &jetstream::Context,
    name: &str,
    subjects: &[&str],
) -> Result<(), Error> {
    jetstream
        .get_or_create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        })
        .await
        .map(drop)
        .map_err(|e| Error::store(format!("creating JetStream stream `{name}`"), e))
}

/// A durable JetStream pull consumer that hands each message to a handler and acknowledges
/// it only after the handler succeeded.
///
/// - `Ok`: acknowledged (and the acknowledgement confirmed by the server). With an
///   `#[idempotent]` handler keyed by [`Delivery::id`], a redelivery replays: no second
///   effect, acknowledged again.
/// - `Err` before `max_deliver` deliveries: negatively acknowledged with a backoff delay.
/// - `Err` at `max_deliver`: recorded in the dead letters, then terminated.
///
/// One message at a time by default (`max_ack_pending` 1), so messages of one aggregate are
/// handled in the order they were published even when one is retried.
#[derive(Debug, Clone)]
pub struct Consumer {
    jetstream: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: String,
    max_deliver: u64,
    ack_wait: Duration,
    max_ack_pending: i64,
    backoff: Backoff,
}

impl Consumer {
    /// A consumer named `durable` on `stream`, for every subject of the stream.
    pub fn new(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Self {
            jetstream,
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: String::new(),
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1,
            backoff: Backoff {
                initial: Duration::from_millis(200),
                max: Duration::from_secs(30),
            },
        }
    }

    /// Only messages on `subject` (wildcards allowed).
    #[must_use]
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = subject.into();
        self
    }

    /// Deliveries before a failing message is dead-lettered (default 5, at least 1).
    #[must_use]
    pub fn max_deliver(mut self, max_deliver: u64) -> Self {
        self.max_deliver = max_deliver.max(1);
        self
    }

    /// How long the server waits for an acknowledgement before redelivering (default 30 s).
    #[must_use]
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Messages in flight at once (default 1: strict order). More is faster but lets a
    /// retried message fall behind later ones.
    #[must_use]
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending.max(1);
        self
    }

    /// Delays of negative acknowledgements (default 200 ms doubling to 30 s, with jitter).
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// Consumes until `shutdown` completes. Lost connections and missing streams are logged
    /// and retried; they never end the loop. A message being handled is finished first.
    pub async fn run<H, Fut, T, E, D>(
        &self,
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
            let messages = async {
                let stream = self.jetstream.get_stream(&self.stream).await?;
                let consumer: jetstream::consumer::PullConsumer = stream
                    .get_or_create_consumer(
                        &self.durable,
                        pull::Config {
                            durable_name: Some(self.durable.clone()),
                            filter_subject: self.filter_subject.clone(),
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            ack_wait: self.ack_wait,
                            max_ack_pending: self.max_ack_pending,
                            ..Default::default()
                        },
                    )
                    .await?;
                Ok::<_, async_nats::Error>(consumer.messages().await?)
            };
            let mut messages = tokio::select! {
                _ = shutdown.as_mut() => return Ok(()),
                messages = messages => match messages {
                    Ok(messages) => messages,
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let pause = self.backoff.delay(failures);
                        tracing::warn!(consumer = %self.durable, error = %e, retry_in_ms = pause.as_millis() as u64, "consumer not ready");
                        tokio::select! {
                            _ = shutdown.as_mut() => return Ok(()),
                            () = tokio::time::sleep(pause) => continue,
                        }
                    }
                },
            };
            loop {
                let next = tokio::select! {
                    _ = shutdown.as_mut() => return Ok(()),
                    next = messages.next() => next,
                };
                match next {
                    Some(Ok(message)) => {
                        failures = 0;
                        self.handle(message, &handler, dead_letters).await;
                    }
                    Some(Err(e)) => {
                        // Missed heartbeats and the like: the client reconnects; the
                        // consumer is rebuilt to be sure.
                        tracing::warn!(consumer = %self.durable, error = %e, "consumer stream failed; resubscribing");
                        break;
                    }
                    None => break,
                }
            }
            tokio::select! {
                _ = shutdown.as_mut() => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    async fn handle<H, Fut, T, E, D>(
        &self,
        message: jetstream::Message,
        handler: &H,
        dead_letters: &D,
    ) where
        H: Fn(Delivery) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
        D: DeadLetters,
    {
        let (sequence, delivered) = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                u64::try_from(info.delivered).unwrap_or(1),
            ),
            Err(e) => {
                tracing::warn!(consumer = %self.durable, error = %e, "message without JetStream metadata; terminated");
                let _ = message.ack_with(AckKind::Term).await;
                return;
            }
        };
        let headers: Vec<(String, String)> = message
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |v| (name.to_string(), v.as_str().to_owned()))
            })
            .collect();
        let id = headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(MESSAGE_ID_HEADER))
            .map_or_else(|| format!("{}:{sequence}", self.stream), |(_, v)| v.clone());
        let delivery = headers.into_iter().fold(
            Delivery::new(id, message.subject.to_string(), message.payload.to_vec())
                .with_delivered(delivered),
            |delivery, (name, value)| delivery.header(name, value),
        );
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
        let ack = match outcome {
            Ok(()) => message.double_ack().await,
            Err(error) if delivered >= self.max_deliver => {
                let letter = DeadLetter::new(
                    &self.durable,
                    delivery.id(),
                    delivery.subject(),
                    delivery.payload(),
                    &error,
                    delivered,
                );
                match dead_letters.record(&letter).await {
                    Ok(()) => {
                        tracing::warn!(consumer = %self.durable, id = %delivery.id(), delivered, %error, "message dead-lettered");
                        message.double_ack_with(AckKind::Term).await
                    }
                    Err(e) => {
                        tracing::warn!(consumer = %self.durable, id = %delivery.id(), error = %e, "dead letter not recorded; redelivering");
                        message
                            .ack_with(AckKind::Nak(Some(
                                self.backoff.delay(self.max_deliver as u32),
                            )))
                            .await
                    }
                }
            }
            Err(error) => {
                let delay = self
                    .backoff
                    .delay(u32::try_from(delivered).unwrap_or(u32::MAX));
                tracing::info!(consumer = %self.durable, id = %delivery.id(), delivered, %error, retry_in_ms = delay.as_millis() as u64, "handler failed; redelivering");
                message.ack_with(AckKind::Nak(Some(delay))).await
            }
        };
        if let Err(e) = ack {
            // The server redelivers after `ack_wait`; the inbox makes that harmless.
            tracing::warn!(consumer = %self.durable, id = %delivery.id(), error = %e, "acknowledgement failed");
        }
    }
}
