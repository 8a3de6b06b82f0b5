//! What an operator asks of the outbox, once for every store: the dead messages' rows, and the
//! paced purge of published ones. Each store runs [`Outbox::list_dead`](crate::Outbox::list_dead)
//! and [`Outbox::purge_published`](crate::Outbox::purge_published) on its own connection.

use std::future::Future;
use std::time::Instant;

use crate::{Column, Decode, Row};

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
