//! NATS JetStream for [`idem`](https://docs.rs/idempotence), on both sides of the outbox:
//! [`JetStreamSink`] publishes relayed messages with `Nats-Msg-Id` (JetStream drops
//! duplicates within the stream's window), and [`JetStreamSource`] is a durable pull consumer
//! as an inbox [`Source`](idem_core::inbox::Source): the inbox's
//! [`Runner`](idem_core::inbox::Runner) hands each message to a handler, an `#[idempotent]`
//! function keyed by the message id, so the ledger is the inbox: a redelivery replays instead
//! of running again, and the message is acknowledged only after the handler's transaction
//! committed. [`Consumer`] builds that runner in one line. Applications use it as `idem::nats`
//! (feature `nats`).
//!
//! Works with nats-server 2.9 and later (no 2.10+ consumer features are used).

mod sink;
mod source;

pub use async_nats;
pub use idem_core::inbox::Delivery;
pub use sink::{JetStreamSink, ensure_stream};
pub use source::{Consumer, JetStreamSource};

/// The JetStream header that carries a message's deduplication id.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";
/// The header that carries a message's aggregate key, when it has one.
pub const AGGREGATE_HEADER: &str = "Idem-Aggregate";
/// The header that carries a message's position in its aggregate (1, 2, … in commit order),
/// so a consumer can check it saw every message of an aggregate, in order.
pub const AGGREGATE_SEQ_HEADER: &str = "Idem-Aggregate-Seq";
