//! What an operator asks of the outbox, once for every store: its health, the dead messages
//! (listed and put back in line) and the paced purge of published ones, on any driver's
//! [`Handle`].

use std::future::Future;
use std::time::{Duration, Instant};

use idem_core::Error;

use idem_core::outbox::OutboxHealth;

use crate::driver::{connect, fetch_each, fetch_first};
use crate::driver::{db_error, failed};
use crate::{Column, Connection, Decode, Driver, Handle, Row, millis, read_health};

/// A message that exhausted its attempts (or that its sink refused).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadMessage {
    /// The message id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its aggregate, blocked until the message is retried.
    pub aggregate: Option<String>,
    /// Its position in the aggregate.
    pub aggregate_seq: Option<i64>,
    /// Attempts made.
    pub attempts: u32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was staged (epoch ms, database clock).
    pub created_at_ms: i64,
}

impl DeadMessage {
    /// The columns of [`Outbox::list_dead`](crate::Outbox::list_dead), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::Text,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::I32,
        Column::Text,
        Column::I64,
    ];

    /// A row of [`Outbox::list_dead`](crate::Outbox::list_dead) ([`DeadMessage::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(Self::from_columns(
            c.text()?,
            c.text()?,
            c.opt_text()?,
            c.opt_i64()?,
            c.int()?,
            c.opt_text()?,
            c.i64()?,
        ))
    }

    /// A row of [`Outbox::list_dead`](crate::Outbox::list_dead): `id, topic, aggregate,
    /// aggregate_seq, attempts, last_error, created_at_ms`.
    pub fn from_columns(
        id: String,
        topic: String,
        aggregate: Option<String>,
        aggregate_seq: Option<i64>,
        attempts: i32,
        last_error: Option<String>,
        created_at_ms: i64,
    ) -> Self {
        Self {
            id,
            topic,
            aggregate,
            aggregate_seq,
            attempts: u32::try_from(attempts).unwrap_or(0),
            last_error,
            created_at_ms,
        }
    }
}

/// Runs `delete` (one statement deleting at most `batch` rows, answering how many it deleted)
/// until it deletes fewer than `batch`, pausing after each one for as long as it took, so a
/// purge never holds more than half of the database's write time. Returns the total deleted.
pub async fn paced_purge<E, F, Fut>(batch: u32, mut delete: F) -> Result<u64, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, E>>,
{
    let mut total = 0;
    loop {
        let started = Instant::now();
        let deleted = delete().await?;
        total += deleted;
        if deleted < u64::from(batch) {
            return Ok(total);
        }
        tokio::time::sleep(started.elapsed()).await;
    }
}

/// The outbox's figures for a health endpoint or a metrics scrape: pending messages, the age
/// of the oldest one (database clock), dead messages. One statement.
pub async fn outbox_health<D: Driver, H: Handle<D>>(db: &H) -> Result<OutboxHealth, Error> {
    let doing = "reading the outbox's health";
    let (mut conn, sql) = connect(db, doing).await?;
    fetch_first(&mut conn, sql.outbox.outbox_health(), read_health)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))?
        .ok_or_else(|| Error::store(doing, "no row"))
}

/// Lists up to `limit` dead messages, oldest first: each blocks its aggregate until
/// [`retry_dead`] puts it back in line.
pub async fn dead_messages<D: Driver, H: Handle<D>>(
    db: &H,
    limit: u32,
) -> Result<Vec<DeadMessage>, Error> {
    let doing = "listing dead outbox messages";
    let (mut conn, sql) = connect(db, doing).await?;
    let list = sql.outbox.list_dead(i64::from(limit));
    fetch_each(&mut conn, list, DeadMessage::from_row)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))
}

/// Puts the dead message `message_id` back in line with fresh attempts, and wakes this
/// process's relays; `false` if no dead message has that id.
pub async fn retry_dead<D: Driver, H: Handle<D>>(db: &H, message_id: &str) -> Result<bool, Error> {
    let doing = "retrying a dead outbox message";
    let (mut conn, sql) = connect(db, doing).await?;
    let retried = conn
        .execute(sql.outbox.retry_dead(message_id))
        .await
        .map_err(|e| db_error::<D>(doing, e))?;
    if retried > 0 {
        idem_core::outbox::wake();
    }
    Ok(retried > 0)
}

/// Deletes messages published more than `retention` ago, `batch` rows per statement (each on
/// a connection of its own), pausing after each for as long as it took ([`paced_purge`], as
/// the purge of expired records does). Returns how many it deleted.
pub async fn purge_published<D: Driver, H: Handle<D>>(
    db: &H,
    retention: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let doing = "purging published outbox messages";
    let batch = batch.max(1);
    paced_purge(batch, || async move {
        let (mut conn, sql) = connect(db, doing).await?;
        let purge = sql
            .outbox
            .purge_published(millis(retention), i64::from(batch));
        conn.execute(purge)
            .await
            .map_err(|e| db_error::<D>(doing, e))
    })
    .await
}
