//! The transactional outbox, once for every store: its statements ([`Outbox`]), what the
//! relay does with them over a connection ([`claim_messages`], [`record_outcomes`],
//! [`health_of`]) and the relay itself ([`Relay`]: one round claims, publishes to a
//! [`Sink`](idem_core::outbox::Sink) and marks each message published, retrying or dead;
//! the loop wakes on commits and polls), over any driver's [`Connection`]. A store supplies
//! the connection and, for the relay, its claim, marks and health over its pool
//! ([`RelayStore`]); staging is one call of [`Outbox::stage`]'s statements in the caller's
//! transaction.

use std::time::Duration;

use idem_core::outbox::{OutboxHealth, OutboxMessage};

mod operator;
mod relay;
mod statements;
mod store;

pub use operator::{
    DeadMessage, dead_messages, outbox_health, paced_purge, purge_published, retry_dead,
};
pub use relay::{Relay, RelayCounters, RelayRound, wake_on_each};
pub use statements::{NewMessage, Outbox};
pub use store::stage_message;

use crate::driver::fetch_each;
use crate::{Column, Connection, Decode, Fault, Row, millis};

/// What an outbox step returns: its answer, or what it was doing when the statement failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// A claimed outbox row, as the claim returns it: id, message_id, topic, aggregate_key,
/// aggregate_seq, headers, payload, attempts.
#[derive(Clone, Debug)]
pub struct ClaimedRow {
    /// The row id (the outbox's order).
    pub id: i64,
    /// The message id (a UUID v7).
    pub message_id: String,
    /// The topic.
    pub topic: String,
    /// The aggregate, if any.
    pub aggregate: Option<String>,
    /// The position in the aggregate.
    pub aggregate_seq: Option<i64>,
    /// The headers, as JSON pairs.
    pub headers: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Attempts so far (the claim's own included where the claim counted it).
    pub attempts: i32,
}

/// A claimed message: its row and what the sink gets.
#[derive(Clone, Debug)]
pub struct ClaimedMessage {
    /// The row id, for marking it.
    pub row: i64,
    /// The message, with its attempt number.
    pub message: OutboxMessage,
}

impl ClaimedRow {
    /// The columns of [`Outbox::claim_messages`] and [`Outbox::lock_claimable`], in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::I64,
        Column::Text,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::Text,
        Column::Bytes,
        Column::I32,
    ];

    /// A row of a claim ([`ClaimedRow::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(ClaimedRow {
            id: c.i64()?,
            message_id: c.text()?,
            topic: c.text()?,
            aggregate: c.opt_text()?,
            aggregate_seq: c.opt_i64()?,
            headers: c.opt_text()?,
            payload: c.bytes()?,
            attempts: c.int()?,
        })
    }

    /// The message the sink gets; an error if the stored headers do not decode.
    fn into_message(self) -> Result<ClaimedMessage, String> {
        let headers = self
            .headers
            .map(|h| serde_json::from_str::<Vec<(String, String)>>(&h))
            .transpose()
            .map_err(|e| format!("outbox headers do not decode: {e}"))?
            .unwrap_or_default();
        let mut message = OutboxMessage::new(self.message_id, self.topic, self.payload);
        message.aggregate = self.aggregate;
        message.aggregate_seq = self.aggregate_seq;
        message.headers = headers;
        message.attempt = u32::try_from(self.attempts).unwrap_or(0);
        Ok(ClaimedMessage {
            row: self.id,
            message,
        })
    }
}

fn messages<E>(rows: Vec<ClaimedRow>) -> Result<Vec<ClaimedMessage>, Fault<E>> {
    rows.into_iter()
        .map(|row| row.into_message().map_err(Fault::Undecodable))
        .collect()
}

/// Claims up to `batch` due messages that are first in their aggregate for `lease`, leased
/// to `token`, in row order. Where [`Outbox::claims_in_three_steps`] (MySQL), `conn` is a
/// READ COMMITTED transaction the store began and commits after; elsewhere one statement,
/// on any connection. An error says what failed.
pub async fn claim_messages<C: Connection>(
    conn: &mut C,
    outbox: &'static Outbox,
    batch: u32,
    lease: Duration,
    token: i64,
) -> Done<Vec<ClaimedMessage>, C> {
    let failed = |e| ("claiming outbox messages", e);
    let (batch, lease_ms) = (i64::from(batch), millis(lease));
    let mut claimed = if outbox.claims_in_three_steps() {
        let eligible = fetch_each(conn, outbox.select_eligible(batch), Row::into_i64)
            .await
            .map_err(failed)?;
        if eligible.is_empty() {
            return Ok(Vec::new());
        }
        let rows = fetch_each(conn, outbox.lock_claimable(&eligible), ClaimedRow::from_row)
            .await
            .map_err(failed)?;
        let mut locked = messages(rows).map_err(failed)?;
        if !locked.is_empty() {
            let ids: Vec<i64> = locked.iter().map(|c| c.row).collect();
            conn.execute(outbox.lease_messages(&ids, token, lease_ms))
                .await
                .map_err(|e| failed(Fault::Db(e)))?;
            // The rows were read before the lease counted this attempt.
            for c in &mut locked {
                c.message.attempt += 1;
            }
        }
        locked
    } else {
        let claim = outbox.claim_messages(token, lease_ms, batch);
        let rows = fetch_each(conn, claim, ClaimedRow::from_row)
            .await
            .map_err(failed)?;
        messages(rows).map_err(failed)?
    };
    claimed.sort_by_key(|c| c.row);
    Ok(claimed)
}

/// A publish that failed: the message goes back in line after `delay`, or dead.
#[derive(Clone, Debug)]
pub struct FailedAttempt {
    /// The message's row.
    pub row: i64,
    /// Whether it is dead (the sink refused it for good, or this was its last attempt).
    pub dead: bool,
    /// What failed.
    pub error: String,
    /// How long it waits before its next attempt.
    pub delay: Duration,
}

/// Records a round's outcomes in `conn` for the relay holding `token`: `published` rows
/// published, each of `failures` retrying or dead. A row whose lease `token` lost is left
/// alone (another relay holds it now).
pub async fn record_outcomes<C: Connection>(
    conn: &mut C,
    outbox: &'static Outbox,
    token: i64,
    published: &[i64],
    failures: &[FailedAttempt],
) -> Done<(), C> {
    if !published.is_empty() {
        conn.execute(outbox.mark_published(published, token))
            .await
            .map_err(|e| ("marking outbox messages published", Fault::Db(e)))?;
    }
    for failure in failures {
        // Keep the stored error short: it is for an operator's eyes, not a log archive.
        let error: String = failure.error.chars().take(2000).collect();
        let delay_ms = millis(failure.delay);
        conn.execute(outbox.mark_failed(failure.row, token, failure.dead, error, delay_ms))
            .await
            .map_err(|e| ("recording a failed outbox attempt", Fault::Db(e)))?;
    }
    Ok(())
}

/// The outbox's figures from the row of [`Outbox::outbox_health`].
pub fn read_health(row: Row) -> Result<OutboxHealth, Decode> {
    let mut c = row.read();
    Ok(health_of(
        c.opt_i64()?,
        c.opt_i64()?,
        c.opt_i64()?,
        c.opt_i64()?,
    ))
}

/// The outbox's figures from the columns of [`Outbox::outbox_health`]: pending count, oldest
/// pending created_at_ms, dead count, the database's now_ms.
pub fn health_of(
    pending: Option<i64>,
    oldest_pending: Option<i64>,
    dead: Option<i64>,
    now_ms: Option<i64>,
) -> OutboxHealth {
    let mut health = OutboxHealth::default();
    health.pending = pending.unwrap_or(0).max(0) as u64;
    health.dead = dead.unwrap_or(0).max(0) as u64;
    health.oldest_pending_ms = oldest_pending
        .zip(now_ms)
        .map(|(o, n)| (n - o).max(0) as u64);
    health.sink_restarts = idem_core::outbox::sink_restarts();
    health
}
