//! The transactional outbox on sqlx: stage messages in an `#[idempotent]` body's transaction
//! (its `&mut PgConnection`, `&mut MySqlConnection` or `&mut SqliteConnection`), relay them
//! to a [`Sink`](idem_core::outbox::Sink) from a pool afterwards. The statements, what the
//! relay does with them and the relay's loop are idem-sql's, shared with the SeaORM store;
//! this file runs them on sqlx. Guarantees and their limits are in `docs/OUTBOX.md`.

#[cfg(feature = "postgres")]
use std::any::Any;
use std::time::Duration;

use idem_core::Error;
use idem_core::outbox::{Message, OutboxHealth};
use idem_sql::{
    ClaimedMessage, FailedAttempt, Outbox as Statements, RelayStore, SqlStore, millis, paced_purge,
};
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::error::store_error;
use crate::driver::pooler::named;
use crate::driver::port::Sqlx;

pub use idem_sql::{DeadMessage, RelayCounters, RelayRound};

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

/// The statements staging `message` under a new id, and the id.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn staging(
    dialect: idem_sql::Dialect,
    message: Message,
) -> Result<(String, Vec<idem_sql::Bound<'static>>), Error> {
    message.validate()?;
    let id = uuid::Uuid::now_v7().to_string();
    let headers = if message.headers().is_empty() {
        None
    } else {
        Some(
            serde_json::to_string(message.headers())
                .map_err(|e| Error::store("encoding message headers", e))?,
        )
    };
    let staged = idem_sql::NewMessage {
        id: id.clone(),
        topic: message.topic().to_owned(),
        aggregate: message.aggregate_key().map(str::to_owned),
        headers,
        payload: message.into_payload(),
    };
    let statements = Statements::of(dialect).stage(&staged);
    Ok((id, statements))
}

/// Stages on `conn`, a connection of `DB`.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
async fn stage_on<DB: Backend>(
    conn: &mut DB::Connection,
    message: Message,
) -> Result<String, Error> {
    let (id, statements) = staging(DB::DIALECT, message)?;
    for statement in statements {
        // Unnamed: a connection does not say whether its pool goes through a transaction
        // pooler, and an unnamed statement runs through one or not.
        DB::execute(&mut *conn, statement, false)
            .await
            .map_err(|e| store_error("staging an outbox message", e))?;
    }
    if !idem_core::outbox::note_staged() {
        // Not inside an `#[idempotent]` call: no commit to wait for that we can see.
        idem_core::outbox::wake();
    }
    Ok(id)
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

/// Names the sqlx store in [`idem_sql::Relay`]'s parameters: [`Relay`] is the relay on a
/// sqlx pool.
#[derive(Debug, Clone, Copy)]
pub struct SqlxOutbox;

/// Publishes committed outbox messages from a sqlx pool (`Pool<Postgres>`, `Pool<MySql>`,
/// `Pool<Sqlite>`) to a [`Sink`](idem_core::outbox::Sink): claims a batch (leased, so
/// several relays in several processes share the work), publishes, marks. The same relay as
/// the SeaORM store's, on the same tables.
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
pub type Relay<DB, S> = idem_sql::Relay<Pool<DB>, S, SqlxOutbox>;

impl<DB: Backend> RelayStore<SqlxOutbox> for Pool<DB> {
    async fn claim(
        &self,
        batch: u32,
        lease: Duration,
        token: i64,
    ) -> Result<Vec<ClaimedMessage>, Error> {
        generic(self).claim_messages(batch, lease, token).await
    }

    async fn record_outcomes(
        &self,
        token: i64,
        published: Vec<i64>,
        failures: Vec<FailedAttempt>,
    ) -> Result<(), Error> {
        generic(self)
            .record_outcomes(token, &published, &failures)
            .await
    }

    async fn health(&self) -> Result<OutboxHealth, Error> {
        outbox_health(self).await
    }

    fn listen_for_commits(&self) -> Option<tokio::task::JoinHandle<()>> {
        #[cfg(feature = "postgres")]
        if let Some(pool) = (self as &dyn Any).downcast_ref::<Pool<sqlx::Postgres>>() {
            return Some(listen_for_notifications(pool.clone()));
        }
        None
    }
}

/// On PostgreSQL, a task that turns each `NOTIFY` on the outbox's channel (sent by every
/// stage at commit, from any process) into a wake-up of this process's relays. It
/// reconnects after failures.
#[cfg(feature = "postgres")]
fn listen_for_notifications(pool: Pool<sqlx::Postgres>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        use sqlx::postgres::PgListener;
        let mut failures = 0u32;
        loop {
            let listening = async {
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.listen(idem_sql::names::WAKE_CHANNEL).await?;
                loop {
                    listener.recv().await?;
                    idem_core::outbox::wake();
                }
            };
            let result: Result<(), sqlx::Error> = listening.await;
            if let Err(e) = result {
                failures = failures.saturating_add(1);
                tracing::debug!(error = %e, "outbox listener reconnecting");
            }
            let pause = Duration::from_millis(100u64 << failures.min(6));
            tokio::time::sleep(pause).await;
        }
    })
}

/// The outbox's figures for a health endpoint or a metrics scrape: pending messages, the age
/// of the oldest one (database clock), dead messages. One statement.
pub async fn outbox_health<DB: Backend>(pool: &Pool<DB>) -> Result<OutboxHealth, Error> {
    generic(pool).outbox_health().await
}

/// The store written once for every driver, on `pool`.
fn generic<DB: Backend>(pool: &Pool<DB>) -> SqlStore<Sqlx<DB>> {
    SqlStore::new(Sqlx::new(pool.clone()))
}

/// Lists up to `limit` dead messages, oldest first: each blocks its aggregate until
/// [`retry_dead`] puts it back in line.
pub async fn dead_messages<DB: Backend>(
    pool: &Pool<DB>,
    limit: u32,
) -> Result<Vec<DeadMessage>, Error> {
    let doing = "listing dead outbox messages";
    let mut conn = pool.acquire().await.map_err(|e| store_error(doing, e))?;
    let list = Statements::of(DB::DIALECT).list_dead(i64::from(limit));
    DB::fetch_each(&mut *conn, list, named(pool), DeadMessage::from_row)
        .await
        .map_err(|e| store_error(doing, e))
}

/// Puts a dead message back in line with fresh attempts, and wakes this process's relays;
/// `false` if no dead message has that id.
pub async fn retry_dead<DB: Backend>(pool: &Pool<DB>, message_id: &str) -> Result<bool, Error> {
    let doing = "retrying a dead outbox message";
    let mut conn = pool.acquire().await.map_err(|e| store_error(doing, e))?;
    let retry = Statements::of(DB::DIALECT).retry_dead(message_id);
    let retried = DB::execute(&mut *conn, retry, named(pool))
        .await
        .map_err(|e| store_error(doing, e))?;
    if retried > 0 {
        idem_core::outbox::wake();
    }
    Ok(retried > 0)
}

/// Deletes messages published more than `retention` ago, `batch` rows per statement, pausing
/// after each statement for as long as it took ([`idem_sql::paced_purge`]). Returns how many
/// it deleted.
pub async fn purge_published<DB: Backend>(
    pool: &Pool<DB>,
    retention: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let doing = "purging published outbox messages";
    let batch = batch.max(1);
    paced_purge(batch, || async move {
        let mut conn = pool.acquire().await.map_err(|e| store_error(doing, e))?;
        let purge =
            Statements::of(DB::DIALECT).purge_published(millis(retention), i64::from(batch));
        DB::execute(&mut *conn, purge, named(pool))
            .await
            .map_err(|e| store_error(doing, e))
    })
    .await
}
