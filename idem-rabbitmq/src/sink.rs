//! [`AmqpSink`]: the outbox relay's sink for RabbitMQ.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{OutboxMessage, Sink, SinkError};
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::{AGGREGATE_HEADER, AGGREGATE_SEQ_HEADER, connection};

/// AMQP's delivery mode for a message the broker keeps on disk.
const PERSISTENT: u8 = 2;

/// Publishes outbox messages to a RabbitMQ exchange: the topic is the routing key, the
/// outbox message id the AMQP `message-id` (the consumer's idempotency key), the aggregate
/// and its sequence number the headers [`AGGREGATE_HEADER`] and [`AGGREGATE_SEQ_HEADER`],
/// persistent. A publish counts only once the broker confirmed it (publisher confirms), so
/// the relay marks a message published only after RabbitMQ has it. A message no queue is
/// bound for comes back (`mandatory`) and is a transient error: it stays in the outbox until
/// a queue is bound, never dropped.
///
/// The connection is opened at the first publish and again after it broke (the broker
/// restarted): a publish that fails on it is an error the relay retries with backoff.
/// Every step of a publish is bounded (opening the channel by the connect timeout, sending
/// and confirming by [`confirm_timeout`](Self::confirm_timeout)), and a connection on which a
/// publish failed without the broker's answer is dropped, so the next publish opens a new
/// one: a relay never waits forever on a connection that died or stopped reading.
/// Clones share the connection and its channel.
#[derive(Clone)]
pub struct AmqpSink {
    uri: Arc<str>,
    exchange: Arc<str>,
    confirm_timeout: Duration,
    /// The open connection, its channel, and which opening it was (to drop only that one).
    open: Arc<Mutex<Open>>,
}

/// The sink's connection, if one is open, and how many were opened (or tried).
#[derive(Default)]
struct Open {
    current: Option<(Connection, Channel, u64)>,
    openings: u64,
}

impl AmqpSink {
    /// A sink publishing to `exchange` on the broker at `uri`
    /// (`amqp://user:password@host:5672/%2f`). Nothing is connected until the first publish.
    pub fn new(uri: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            uri: uri.into().into(),
            exchange: exchange.into().into(),
            confirm_timeout: Duration::from_secs(10),
            open: Arc::default(),
        }
    }

    /// How long a publish waits for the broker's confirmation before it counts as failed
    /// (default 10 s). A failed publish is retried: the message may then arrive twice, which
    /// the consumer's inbox absorbs.
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// A channel in confirm mode on a live connection, the open one or a new one, with its
    /// opening's number.
    async fn channel(&self) -> Result<(Channel, u64), lapin::Error> {
        let mut open = self.open.lock().await;
        if let Some((connection, channel, opening)) = open.current.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok((channel.clone(), *opening));
        }
        if let Some((connection, _, _)) = open.current.take() {
            connection::forget(connection);
        }
        // Numbered across failed attempts too, so no two connections share a number.
        open.openings += 1;
        let opening = open.openings;
        let confirm_mode = async |channel: &Channel| {
            let options = ConfirmSelectOptions::default();
            channel.confirm_select(options).await
        };
        tracing::trace!(opening, "rabbitmq sink: opening a connection");
        let opened = connection::open_channel(&self.uri, confirm_mode).await;
        tracing::trace!(opening, ok = opened.is_ok(), "rabbitmq sink: opened");
        let (connection, channel, ()) = opened?;
        open.current = Some((connection, channel.clone(), opening));
        Ok((channel, opening))
    }

    /// Drops the connection of `opening` if it is still the open one (a concurrent publish
    /// may already have replaced it).
    async fn drop_connection(&self, opening: u64) {
        let mut open = self.open.lock().await;
        if open
            .current
            .as_ref()
            .is_some_and(|(_, _, current)| *current == opening)
            && let Some((connection, _, _)) = open.current.take()
        {
            connection::forget(connection);
        }
    }

    async fn publish_confirmed(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        let (channel, opening) = self
            .channel()
            .await
            .map_err(|e| SinkError::transient(format!("connecting to RabbitMQ: {e}")))?;
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        if let (Some(aggregate), Some(seq)) = (&message.aggregate, message.aggregate_seq) {
            headers.insert(
                AGGREGATE_HEADER.into(),
                AMQPValue::LongString(aggregate.as_str().into()),
            );
            headers.insert(AGGREGATE_SEQ_HEADER.into(), AMQPValue::LongLongInt(seq));
        }
        let properties = BasicProperties::default()
            .with_message_id(message.id.as_str().into())
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        // Sending waits until the frames are written, which a broker that stopped reading
        // never lets happen; the confirm may never come. Both under one bound.
        let sent_and_confirmed = tokio::time::timeout(self.confirm_timeout, async {
            let confirm = channel
                .basic_publish(
                    self.exchange.as_ref().into(),
                    message.topic.as_str().into(),
                    options,
                    &message.payload,
                    properties,
                )
                .await
                .map_err(|e| format!("publishing to RabbitMQ: {e}"))?;
            confirm
                .await
                .map_err(|e| format!("waiting for RabbitMQ's confirm: {e}"))
        })
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "RabbitMQ did not take and confirm the publish within {:?}",
                self.confirm_timeout
            ))
        });
        let confirmation = match sent_and_confirmed {
            Ok(confirmation) => confirmation,
            Err(problem) => {
                tracing::trace!(opening, %problem, "rabbitmq sink: publish failed, dropping the connection");
                // No answer from the broker on this connection: the next publish opens another.
                self.drop_connection(opening).await;
                return Err(SinkError::transient(problem));
            }
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(SinkError::transient(format!(
                "no queue is bound to exchange `{}` for routing key `{}`: RabbitMQ returned \
                the message (bind a queue, e.g. with idem::rabbitmq::declare)",
                self.exchange, message.topic
            ))),
            Confirmation::Nack(_) => Err(SinkError::transient(
                "RabbitMQ refused the message (negative confirm)",
            )),
            Confirmation::NotRequested => {
                Err(SinkError::transient("the channel is not in confirm mode"))
            }
        }
    }
}

impl Sink for AmqpSink {
    /// Drops the open connection (closed in the background, bounded), whatever lapin says of
    /// it: the next publish opens a new one.
    async fn reconnect(&self) {
        if let Some((connection, _, _)) = self.open.lock().await.current.take() {
            connection::forget(connection);
        }
    }

    /// Publishes on a task of its own, which the caller may stop waiting for (the relay's
    /// lease bounds each publish): the publish still runs to its own bounds, so a connection
    /// the broker never answered on is dropped even then. Awaited in place, a caller whose
    /// bound is shorter than the confirm timeout cancelled it every time before it could drop
    /// the connection, and a half-open one (lapin still calls it connected) took every
    /// publish until its heartbeats lapsed.
    async fn publish(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        let (sink, message) = (self.clone(), message.clone());
        tokio::spawn(async move { sink.publish_confirmed(&message).await })
            .await
            .unwrap_or_else(|e| Err(SinkError::transient(format!("the publish task ended: {e}"))))
    }
}

impl fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URI can carry a password.
        f.debug_struct("AmqpSink")
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}
