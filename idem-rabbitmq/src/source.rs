//! [`AmqpSource`]: a queue consumed with manual acknowledgements as an inbox source, and
//! [`Consumer`], the inbox runner on it.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use idem_core::inbox::{Delivery, Runner, Source};
use idem_core::outbox::{Backoff, DeadLetters};
use idem_core::{BoxError, Error};
use lapin::Acker;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use sha2::{Digest, Sha256};

use crate::connection;

/// The header a quorum queue puts on a redelivered message: how often it was delivered
/// before.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// A RabbitMQ queue consumed with manual acknowledgements, as an inbox [`Source`]: it
/// connects (again after the connection broke), sets the prefetch, and consumes.
///
/// - A delivery's id is the AMQP `message-id` (the outbox message id, as [`AmqpSink`]
///   publishes it); a message without one gets `amqp-` and the SHA-256 of its exchange,
///   routing key and body, so a redelivery keeps its id (two messages with the same body on
///   the same key are then one).
/// - Its subject is the routing key; its headers are the AMQP headers that are text or
///   numbers.
/// - How often it was delivered comes from a quorum queue's `x-delivery-count`; on a classic
///   queue a redelivered message counts as delivered twice.
/// - A negative acknowledgement waits out the runner's delay, then returns the message to
///   the queue; a termination rejects it without requeueing (to the queue's dead-letter
///   exchange, if it has one: the runner has recorded it in its dead letters already).
///
/// One unacknowledged message at a time by default (prefetch 1), so messages of one aggregate
/// are handled in the order they were published even when one is retried. A clone is not
/// connected: it connects when its runner starts.
///
/// [`AmqpSink`]: crate::AmqpSink
pub struct AmqpSource {
    uri: Arc<str>,
    queue: String,
    consumer_tag: String,
    prefetch: u16,
    open: Option<Open>,
}

struct Open {
    connection: Connection,
    // Kept with its consumer: the channel closes when dropped.
    _channel: Channel,
    consumer: lapin::Consumer,
}

impl AmqpSource {
    /// Consumes `queue` on the broker at `uri` as `consumer_tag` (the name in the broker's
    /// management views).
    pub fn new(
        uri: impl Into<String>,
        queue: impl Into<String>,
        consumer_tag: impl Into<String>,
    ) -> Self {
        Self {
            uri: uri.into().into(),
            queue: queue.into(),
            consumer_tag: consumer_tag.into(),
            prefetch: 1,
            open: None,
        }
    }

    /// Messages delivered before the first is acknowledged (default 1: strict order). More
    /// is faster but lets a retried message fall behind later ones.
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }
}

impl Clone for AmqpSource {
    fn clone(&self) -> Self {
        Self {
            uri: self.uri.clone(),
            queue: self.queue.clone(),
            consumer_tag: self.consumer_tag.clone(),
            prefetch: self.prefetch,
            // A consumer is one connection's: the clone opens its own.
            open: None,
        }
    }
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URI can carry a password.
        f.debug_struct("AmqpSource")
            .field("queue", &self.queue)
            .field("consumer_tag", &self.consumer_tag)
            .field("prefetch", &self.prefetch)
            .field("connected", &self.open.is_some())
            .finish_non_exhaustive()
    }
}

impl Source for AmqpSource {
    /// What acknowledges the delivery on its channel.
    type Receipt = Acker;

    async fn connect(&mut self) -> Result<(), BoxError> {
        if let Some(open) = self.open.take() {
            // Unacknowledged deliveries of the old connection return to the queue with it.
            connection::forget(open.connection);
        }
        let (queue, tag, prefetch) = (
            self.queue.as_str(),
            self.consumer_tag.as_str(),
            self.prefetch,
        );
        let consume = async |channel: &Channel| {
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await?;
            let options = BasicConsumeOptions::default();
            let arguments = FieldTable::default();
            channel
                .basic_consume(queue.into(), tag.into(), options, arguments)
                .await
        };
        let (connection, channel, consumer) = connection::open_channel(&self.uri, consume).await?;
        self.open = Some(Open {
            connection,
            _channel: channel,
            consumer,
        });
        Ok(())
    }

    async fn next(&mut self) -> Result<Option<(Delivery, Acker)>, BoxError> {
        let Some(open) = self.open.as_mut() else {
            return Err("not connected: connect first".into());
        };
        let Some(delivery) = open.consumer.next().await.transpose()? else {
            return Ok(None);
        };
        let acker = delivery.acker.clone();
        Ok(Some((to_delivery(&delivery), acker)))
    }

    async fn ack(&mut self, acker: Acker) -> Result<(), BoxError> {
        acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }

    async fn nak(&mut self, acker: Acker, delay: Duration) -> Result<(), BoxError> {
        // RabbitMQ has no delayed negative acknowledgement: the message stays unacknowledged
        // (and, with prefetch 1, holds back the ones after it) for the delay.
        tokio::time::sleep(delay).await;
        acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
        Ok(())
    }

    async fn terminate(&mut self, acker: Acker) -> Result<(), BoxError> {
        acker.reject(BasicRejectOptions { requeue: false }).await?;
        Ok(())
    }
}

/// The inbox's view of an AMQP delivery.
fn to_delivery(delivery: &lapin::message::Delivery) -> Delivery {
    let properties = &delivery.properties;
    let id = properties
        .message_id()
        .as_ref()
        .map_or_else(|| content_id(delivery), |id| id.as_str().to_owned());
    let headers: Vec<(String, String)> = properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(name, value)| Some((name.as_str().to_owned(), text(value)?)))
                .collect()
        })
        .unwrap_or_default();
    let delivered = headers
        .iter()
        .find(|(name, _)| name == DELIVERY_COUNT_HEADER)
        .and_then(|(_, count)| count.parse::<u64>().ok())
        .map_or(if delivery.redelivered { 2 } else { 1 }, |before| {
            before + 1
        });
    let message = Delivery::new(id, delivery.routing_key.as_str(), delivery.data.clone())
        .with_delivered(delivered);
    headers.into_iter().fold(message, |message, (name, value)| {
        message.header(name, value)
    })
}

/// The id of a message without a `message-id`: from its exchange, routing key and body.
fn content_id(delivery: &lapin::message::Delivery) -> String {
    let mut hasher = Sha256::new();
    for part in [
        delivery.exchange.as_str().as_bytes(),
        delivery.routing_key.as_str().as_bytes(),
        &delivery.data,
    ] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut id = String::with_capacity(5 + 64);
    id.push_str("amqp-");
    for byte in digest {
        id.push_str(&format!("{byte:02x}"));
    }
    id
}

/// A header value as text, when it is text or a number.
fn text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

/// The inbox [`Runner`] on an [`AmqpSource`], built in one expression: a queue consumed with
/// manual acknowledgements, each message handed to a handler and acknowledged only after
/// the handler succeeded.
///
/// - `Ok`: acknowledged. With an `#[idempotent]` handler keyed by [`Delivery::id`], a
///   redelivery replays: no second effect, acknowledged again.
/// - `Err` before `max_deliver` deliveries: negatively acknowledged after a backoff delay.
/// - `Err` at `max_deliver`: recorded in the dead letters, then rejected.
///
/// ```no_run
/// # async fn demo(dead_letters: impl idem_core::outbox::DeadLetters) {
/// # async fn send_receipt(delivery: idem_rabbitmq::Delivery) -> Result<(), idem_core::Error> { Ok(()) }
/// idem_rabbitmq::Consumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", "notifier.receipts", "notifier")
///     .run(send_receipt, &dead_letters, std::future::pending::<()>())
///     .await
///     .unwrap();
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Consumer {
    runner: Runner<AmqpSource>,
}

impl Consumer {
    /// A consumer named `name` (in logs and dead letters; also its consumer tag) of `queue`
    /// on the broker at `uri`.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>, name: impl Into<String>) -> Self {
        let name = name.into();
        Self {
            runner: Runner::new(name.clone(), AmqpSource::new(uri, queue, name)),
        }
    }

    /// Deliveries before a failing message is dead-lettered (default 5, at least 1).
    #[must_use]
    pub fn max_deliver(self, max_deliver: u64) -> Self {
        Self {
            runner: self.runner.max_deliver(max_deliver),
        }
    }

    /// Messages delivered before the first is acknowledged (default 1: strict order).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        let source = self.runner.source_mut();
        *source = source.clone().prefetch(prefetch);
        self
    }

    /// Delays of negative acknowledgements and reconnections (default 200 ms doubling to
    /// 30 s, with jitter).
    #[must_use]
    pub fn backoff(self, backoff: Backoff) -> Self {
        Self {
            runner: self.runner.backoff(backoff),
        }
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        self.runner.name()
    }

    /// The runner this consumer is.
    pub fn into_runner(self) -> Runner<AmqpSource> {
        self.runner
    }

    /// Consumes until `shutdown` completes. Lost connections and a missing queue are logged
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
        let mut runner = self.runner.clone();
        runner.run(handler, dead_letters, shutdown).await
    }
}
