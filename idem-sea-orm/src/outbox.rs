//! The transactional outbox on SeaORM: stage messages in a handler's transaction, relay them
//! to a [`Sink`] afterwards, inspect and operate the table.
//!
//! Guarantees and their limits are in `docs/OUTBOX.md`; in short:
//! - a staged message commits with the handler's writes or not at all; a replay stages nothing;
//! - the relay delivers every committed message at least once, with a stable id for the
//!   receiver to deduplicate on;
//! - messages of one aggregate reach the sink in commit order, across any number of relays;
//! - a message that keeps failing is `dead` after `max_attempts` and blocks only its own
//!   aggregate.

use std::future::Future;

use idem_core::Error;
use idem_core::outbox::Message;
use sea_orm::ConnectionTrait;

pub use idem_sql::{
    DeadMessage, RelayCounters, RelayRound, dead_messages, outbox_health, purge_published,
    retry_dead,
};

use crate::driver::port::{On, SeaOrm};

/// Staging messages in the transaction you are in: inside an `#[idempotent]` body, on the
/// claim's transaction (`db` there).
///
/// ```no_run
/// # use idem_core::outbox::Message;
/// # async fn body(db: &sea_orm::DatabaseTransaction) -> Result<(), idem_core::Error> {
/// use idem_sea_orm::Outbox;
/// db.stage(Message::json("shop.orders.paid", &serde_json::json!({"order_id": "o-1"}))?
///     .aggregate("o-1"))
///     .await?;
/// # Ok(()) }
/// ```
pub trait Outbox {
    /// Stages `message` in this connection's transaction and returns its id (a UUID, the
    /// downstream deduplication key). It is published after the transaction commits, and
    /// never if it rolls back.
    ///
    /// Inside an `#[idempotent]` body the relays of this process are woken once the call
    /// commits. In a transaction of your own, call `idem::outbox::wake()` after committing
    /// (or let the relays' poll, or PostgreSQL's `NOTIFY`, find it).
    fn stage(&self, message: Message) -> impl Future<Output = Result<String, Error>> + Send;
}

impl<C: ConnectionTrait + Sync + ?Sized> Outbox for C {
    async fn stage(&self, message: Message) -> Result<String, Error> {
        let dialect = crate::driver::dialect(self.get_database_backend());
        let id = uuid::Uuid::now_v7().to_string();
        idem_sql::stage_message::<SeaOrm>(&mut On(self), dialect, id, message).await
    }
}

/// Publishes committed outbox messages to a [`Sink`](idem_core::outbox::Sink): claims a
/// batch (leased, so several relays in several processes share the work), publishes, marks.
/// The relay written once for every driver ([`idem_sql::Relay`]), on the [`SeaOrm`] driver;
/// on PostgreSQL it wakes on every commit's `NOTIFY`.
///
/// ```no_run
/// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), idem_core::Error> {
/// use idem_sea_orm::Relay;
/// let relay = Relay::new(db, idem_core::outbox::LogSink).batch_size(200);
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// relay.run(stopped).await // until `stop` is sent or dropped
/// # }
/// ```
pub type Relay<S> = idem_sql::Relay<SeaOrm, S>;

/// Where a consumer records the messages it gave up on: the dead-letter table,
/// [`DEAD_LETTERS_TABLE`](crate::DEAD_LETTERS_TABLE) (`DeadLetterTable::new(db)`;
/// [`crate::create_tables`] creates it).
pub type DeadLetterTable = idem_sql::DeadLetterTable<SeaOrm>;
