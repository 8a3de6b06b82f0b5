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
use std::time::Duration;

use idem_core::Error;
use idem_core::outbox::{Message, OutboxHealth};
use idem_sql::{ClaimedMessage, FailedAttempt, RelayStore, SqlStore, read_health};
use sea_orm::{ConnectionTrait, DatabaseConnection};

use idem_sql::paced_purge;
pub use idem_sql::{DeadMessage, RelayCounters, RelayRound};

use crate::driver::error::store_error;
use crate::driver::list_rows;
use crate::driver::port::SeaOrm;
use crate::driver::{Bound, NewDeadLetter, NewMessage, Sql, fetch_first, millis};
use idem_core::detached;

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
        message.validate()?;
        let sql = crate::driver::of(self.get_database_backend());
        let id = uuid::Uuid::now_v7().to_string();
        let headers = if message.headers().is_empty() {
            None
        } else {
            Some(
                serde_json::to_string(message.headers())
                    .map_err(|e| Error::store("encoding message headers", e))?,
            )
        };
        let staged = NewMessage {
            id: id.clone(),
            topic: message.topic().to_owned(),
            aggregate: message.aggregate_key().map(str::to_owned),
            headers,
            payload: message.into_payload(),
        };
        for statement in sql.outbox.stage(&staged) {
            exec(self, sql, statement)
                .await
                .map_err(|e| store_error("staging an outbox message", e))?;
        }
        if !idem_core::outbox::note_staged() {
            // Not inside an `#[idempotent]` call: no commit to wait for that we can see.
            idem_core::outbox::wake();
        }
        Ok(id)
    }
}

async fn exec<C: ConnectionTrait + ?Sized>(
    db: &C,
    sql: &Sql,
    statement: Bound<'_>,
) -> Result<u64, sea_orm::DbErr> {
    db.execute_raw(crate::driver::statement(sql, statement))
        .await
        .map(|r| r.rows_affected())
}

/// Names the SeaORM store in [`idem_sql::Relay`]'s parameters: [`Relay`] is the relay on a
/// SeaORM `DatabaseConnection`.
#[derive(Debug, Clone, Copy)]
pub struct SeaOrmOutbox;

/// Publishes committed outbox messages to a [`Sink`](idem_core::outbox::Sink): claims a
/// batch (leased, so several relays in several processes share the work), publishes, marks.
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
pub type Relay<S> = idem_sql::Relay<DatabaseConnection, S, SeaOrmOutbox>;

impl RelayStore<SeaOrmOutbox> for DatabaseConnection {
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
        generic(self).outbox_health().await
    }

    fn listen_for_commits(&self) -> Option<tokio::task::JoinHandle<()>> {
        listen_for_notifications(self)
    }
}

/// The store written once for every driver, on `db`'s pool.
fn generic(db: &DatabaseConnection) -> SqlStore<SeaOrm> {
    SqlStore::new(SeaOrm::new(db.clone()))
}

/// On PostgreSQL, a task that turns each `NOTIFY` on the channel named after the outbox table
/// (sent by every stage at commit, from any process) into a wake-up of this process's relays.
/// It reconnects after failures.
#[allow(unused_variables)]
fn listen_for_notifications(db: &DatabaseConnection) -> Option<tokio::task::JoinHandle<()>> {
    #[cfg(feature = "postgres")]
    if db.get_database_backend() == sea_orm::DbBackend::Postgres {
        let pool = db.get_postgres_connection_pool().clone();
        return Some(tokio::spawn(async move {
            use sea_orm::sqlx::postgres::PgListener;
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
                let result: Result<(), sea_orm::sqlx::Error> = listening.await;
                if let Err(e) = result {
                    failures = failures.saturating_add(1);
                    tracing::debug!(error = %e, "outbox listener reconnecting");
                }
                let pause = Duration::from_millis(100u64 << failures.min(6));
                tokio::time::sleep(pause).await;
            }
        }));
    }
    None
}

/// The outbox's figures for a health endpoint or a metrics scrape: pending messages, the age
/// of the oldest one (database clock), dead messages. One statement.
pub async fn outbox_health<C: ConnectionTrait>(db: &C) -> Result<OutboxHealth, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let doing = "reading the outbox's health";
    fetch_first(db, sql, sql.outbox.outbox_health(), read_health)
        .await
        .map_err(|e| store_error(doing, e))?
        .ok_or_else(|| Error::store(doing, "no row"))
}

/// Lists up to `limit` dead messages, oldest first.
pub async fn dead_messages<C: ConnectionTrait>(
    db: &C,
    limit: u32,
) -> Result<Vec<DeadMessage>, Error> {
    let list = crate::driver::of(db.get_database_backend())
        .outbox
        .list_dead(i64::from(limit));
    list_rows(
        db,
        list,
        "listing dead outbox messages",
        DeadMessage::from_row,
    )
    .await
}

/// Puts a dead message back in line with fresh attempts; `false` if no dead message has that
/// id.
pub async fn retry_dead<C: ConnectionTrait>(db: &C, message_id: &str) -> Result<bool, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let retried = exec(db, sql, sql.outbox.retry_dead(message_id))
        .await
        .map_err(|e| store_error("retrying a dead outbox message", e))?;
    if retried > 0 {
        idem_core::outbox::wake();
    }
    Ok(retried > 0)
}

/// Deletes messages published more than `retention` ago, `batch` rows per statement, pausing
/// between statements as [`crate::purge_expired`] does. Returns how many it deleted.
pub async fn purge_published<C: ConnectionTrait>(
    db: &C,
    retention: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let batch = batch.max(1);
    paced_purge(batch, || async move {
        let purge = sql
            .outbox
            .purge_published(millis(retention), i64::from(batch));
        exec(db, sql, purge)
            .await
            .map_err(|e| store_error("purging published outbox messages", e))
    })
    .await
}

/// Where a consumer records the messages it gave up on: the dead-letter table,
/// [`DEAD_LETTERS_TABLE`](crate::DEAD_LETTERS_TABLE).
#[derive(Debug, Clone)]
pub struct DeadLetterTable {
    db: DatabaseConnection,
}

impl DeadLetterTable {
    /// The dead-letter table on `db` ([`crate::create_tables`] creates it).
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }
}

impl idem_core::outbox::DeadLetters for DeadLetterTable {
    async fn record(&self, letter: &idem_core::outbox::DeadLetter<'_>) -> Result<(), Error> {
        let sql = crate::driver::of(self.db.get_database_backend());
        let record = sql.inbox.record_dead_letter(&NewDeadLetter {
            consumer: letter.consumer.to_owned(),
            message_id: letter.message_id.to_owned(),
            subject: letter.subject.to_owned(),
            payload: letter.payload.to_vec(),
            // Bounded: an error text can be long; the start says what failed.
            error: letter.error.chars().take(2000).collect(),
            deliveries: i64::try_from(letter.deliveries).unwrap_or(i64::MAX),
        });
        let db = self.db.clone();
        detached(async move {
            exec(&db, sql, record)
                .await
                .map(drop)
                .map_err(|e| store_error("recording a dead letter", e))
        })
        .await
    }
}
