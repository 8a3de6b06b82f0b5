//! The transactional outbox on sqlx: stage messages in an `#[idempotent]` body's transaction
//! (its `&mut PgConnection`, `&mut MySqlConnection` or `&mut SqliteConnection`), relay them
//! to a [`Sink`](idem_core::outbox::Sink) from a pool afterwards. The statements, what the
//! relay does with them and the relay's loop are idem-sql's, shared with the SeaORM store;
//! this file runs them on sqlx. Guarantees and their limits are in `docs/OUTBOX.md`.

use idem_core::Error;
use idem_core::outbox::Message;

use crate::driver::port::Sqlx;

pub use idem_sql::{
    DeadMessage, RelayCounters, RelayRound, dead_messages, outbox_health, purge_published,
    retry_dead,
};

/// Staging messages in the transaction you are in: inside an `#[idempotent]` body, on the
/// claim's transaction (`db` there, a `&mut PgConnection`, `&mut MySqlConnection` or
/// `&mut SqliteConnection`), or on a `sqlx::Transaction` of your own.
///
/// ```no_run
/// # use idem_core::outbox::Message;
/// # async fn body(db: &mut sqlx::SqliteConnection) -> Result<(), idem_core::Error> {
/// use idem_sqlx::Outbox;
/// db.stage(Message::json("shop.orders.paid", &serde_json::json!({"order_id": "o-1"}))?
///     .aggregate("o-1"))
///     .await?;
/// # Ok(()) }
/// ```
pub trait Outbox: Send {
    /// Stages `message` in this connection's transaction and returns its id (a UUID, the
    /// downstream deduplication key). It is published after the transaction commits, and
    /// never if it rolls back.
    ///
    /// Inside an `#[idempotent]` body the relays of this process are woken once the call
    /// commits. In a transaction of your own, call `idem::outbox::wake()` after committing
    /// (or let the relays' poll, or PostgreSQL's `NOTIFY`, find it).
    fn stage(
        &mut self,
        message: Message,
    ) -> impl std::future::Future<Output = Result<String, Error>> + Send;
}

/// Stages on `conn`, a connection of `DB`: idem-sql's staging, on the connection as a body's
/// (its statements unnamed on PostgreSQL, where a transaction pooler may sit between).
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
async fn stage_on<DB: crate::Backend>(
    mut conn: &mut DB::Connection,
    message: Message,
) -> Result<String, Error> {
    use idem_sql::Driver;
    let id = uuid::Uuid::now_v7().to_string();
    let mut on = Sqlx::<DB>::on_body(&mut conn);
    idem_sql::stage_message::<Sqlx<DB>>(&mut on, DB::DIALECT, id, message).await
}

// Unused when no database feature is on.
#[allow(unused_macros)]
macro_rules! outbox_connection {
    ($conn:ty, $db:ty) => {
        impl Outbox for $conn {
            async fn stage(&mut self, message: Message) -> Result<String, Error> {
                stage_on::<$db>(self, message).await
            }
        }
    };
}

#[cfg(feature = "postgres")]
outbox_connection!(sqlx::PgConnection, sqlx::Postgres);
#[cfg(feature = "mysql")]
outbox_connection!(sqlx::MySqlConnection, sqlx::MySql);
#[cfg(feature = "sqlite")]
outbox_connection!(sqlx::SqliteConnection, sqlx::Sqlite);

/// Publishes committed outbox messages from a sqlx pool (`Pool<Postgres>`, `Pool<MySql>`,
/// `Pool<Sqlite>`) to a [`Sink`](idem_core::outbox::Sink): claims a batch (leased, so
/// several relays in several processes share the work), publishes, marks. The relay written
/// once for every driver ([`idem_sql::Relay`]), on the same tables as the SeaORM store's; on
/// PostgreSQL it wakes on every commit's `NOTIFY`.
///
/// ```no_run
/// # async fn run(pool: sqlx::SqlitePool) -> Result<(), idem_core::Error> {
/// use idem_sqlx::Relay;
/// let relay = Relay::new(pool, idem_core::outbox::LogSink).batch_size(200);
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// relay.run(stopped).await // until `stop` is sent or dropped
/// # }
/// ```
pub type Relay<DB, S> = idem_sql::Relay<Sqlx<DB>, S>;

/// Where a consumer records the messages it gave up on: the dead-letter table,
/// [`idem_sql::DEAD_LETTERS_TABLE`] (`DeadLetterTable::new(pool)`; [`crate::create_tables`]
/// creates it with `Family::Inbox`).
pub type DeadLetterTable<DB> = idem_sql::DeadLetterTable<Sqlx<DB>>;
