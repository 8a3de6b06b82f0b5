//! RabbitMQ for [`idem`](https://docs.rs/idempotence), on both sides of the outbox, through
//! [lapin](https://docs.rs/lapin) (AMQP 0-9-1):
//!
//! - [`AmqpSink`] publishes relayed messages to an exchange, the topic as the routing key,
//!   the outbox message id as the AMQP `message-id`, and counts a publish only once the
//!   broker confirmed it (publisher confirms; an unroutable message is an error, never a
//!   silent drop). RabbitMQ does not deduplicate: a message the relay published but could
//!   not mark (a crash in between) is published again, and the consumer's inbox absorbs it.
//! - [`AmqpSource`] consumes a queue with manual acknowledgements as an inbox
//!   [`Source`](idem_core::inbox::Source): the inbox's [`Runner`](idem_core::inbox::Runner)
//!   hands each message to an `#[idempotent]` handler keyed by the message id, acknowledges it
//!   only after the handler committed, negatively acknowledges a failure after a backoff,
//!   and dead-letters a message at the delivery limit. [`Consumer`] builds that runner in
//!   one expression.
//! - [`declare`] makes the topology both sides need: a durable topic exchange and a durable
//!   quorum queue bound to it. Quorum queues count deliveries (`x-delivery-count`), which the
//!   runner's delivery limit needs; on a classic queue every redelivery counts as the second.
//!
//! Applications use it as `idem::rabbitmq` (feature `rabbitmq`). Tested against RabbitMQ 3.10.

mod connection;
mod sink;
mod source;

pub use idem_core::inbox::Delivery;
pub use lapin;
pub use sink::AmqpSink;
pub use source::{AmqpSource, Consumer};

use idem_core::Error;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

/// The header that carries a message's aggregate key, when it has one (as on NATS).
pub const AGGREGATE_HEADER: &str = "Idem-Aggregate";
/// The header that carries a message's position in its aggregate (1, 2, … in commit order).
pub const AGGREGATE_SEQ_HEADER: &str = "Idem-Aggregate-Seq";

/// Declares, if they do not exist, a durable topic exchange `exchange`, a durable quorum
/// queue `queue`, and a binding of the queue to every routing key matching `binding_key`
/// (`shop.orders.*`, `#`). Safe to run at every start; an existing exchange or queue of
/// another kind is an error naming it.
pub async fn declare(
    uri: &str,
    exchange: &str,
    queue: &str,
    binding_key: &str,
) -> Result<(), Error> {
    let doing = format!("declaring exchange `{exchange}` and queue `{queue}` on RabbitMQ");
    let connection = connection::open(uri)
        .await
        .map_err(|e| Error::store(doing.clone(), e))?;
    let declared = async {
        let channel = connection.create_channel().await?;
        channel
            .exchange_declare(
                exchange.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                arguments,
            )
            .await?;
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        // Closed before its connection, so the client does not report a channel cut off.
        channel.close(200, "declared".into()).await
    }
    .await;
    let _ = connection.close(200, "declared".into()).await;
    declared.map_err(|e| Error::store(doing, e))
}
