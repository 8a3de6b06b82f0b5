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
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::Error;
use idem_core::outbox::{
    Message, OutboxHealth, OutboxMessage, RelayOptions, Sink, SinkError, random_token,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, IsolationLevel, QueryResult, TransactionTrait};

use crate::atomic::{detached, list_rows};
use crate::driver::error::store_error;
use crate::driver::{Bound, NewDeadLetter, NewMessage, Sql, millis, statement};

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

/// A claimed message: its row and what the sink gets.
#[derive(Debug)]
struct Claimed {
    row: i64,
    message: OutboxMessage,
}

fn read_claimed(row: &QueryResult) -> Result<Claimed, sea_orm::DbErr> {
    let headers: Option<String> = row.try_get_by_index(5)?;
    let headers = headers
        .map(|h| serde_json::from_str::<Vec<(String, String)>>(&h))
        .transpose()
        .map_err(|e| sea_orm::DbErr::Custom(format!("outbox headers do not decode: {e}")))?
        .unwrap_or_default();
    let attempts: i32 = row.try_get_by_index(7)?;
    let mut message = OutboxMessage::new(
        row.try_get_by_index::<String>(1)?,
        row.try_get_by_index::<String>(2)?,
        row.try_get_by_index(6)?,
    );
    message.aggregate = row.try_get_by_index(3)?;
    message.aggregate_seq = row.try_get_by_index(4)?;
    message.headers = headers;
    message.attempt = u32::try_from(attempts).unwrap_or(0);
    Ok(Claimed {
        row: row.try_get_by_index(0)?,
        message,
    })
}

/// Claims up to `batch` due messages that are first in their aggregate, leased to `token`.
async fn claim(
    db: &DatabaseConnection,
    batch: u32,
    lease: Duration,
    token: i64,
) -> Result<Vec<Claimed>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let doing = "claiming outbox messages";
    let mut claimed = if sql.outbox.claims_in_three_steps() {
        let tx = db
            .begin_with_config(Some(IsolationLevel::ReadCommitted), None)
            .await
            .map_err(|e| store_error(doing, e))?;
        let eligible: Vec<i64> = tx
            .query_all_raw(statement(sql, sql.outbox.select_eligible(i64::from(batch))))
            .await
            .and_then(|rows| rows.iter().map(|r| r.try_get_by_index(0)).collect())
            .map_err(|e| store_error(doing, e))?;
        if eligible.is_empty() {
            let _ = tx.rollback().await;
            return Ok(Vec::new());
        }
        let mut locked: Vec<Claimed> = tx
            .query_all_raw(statement(sql, sql.outbox.lock_claimable(&eligible)))
            .await
            .and_then(|rows| rows.iter().map(read_claimed).collect())
            .map_err(|e| store_error(doing, e))?;
        if !locked.is_empty() {
            let ids: Vec<i64> = locked.iter().map(|c| c.row).collect();
            tx.execute_raw(statement(
                sql,
                sql.outbox.lease_messages(&ids, token, millis(lease)),
            ))
            .await
            .map_err(|e| store_error(doing, e))?;
            for c in &mut locked {
                c.message.attempt += 1;
            }
        }
        tx.commit().await.map_err(|e| store_error(doing, e))?;
        locked
    } else {
        db.query_all_raw(statement(
            sql,
            sql.outbox
                .claim_messages(token, millis(lease), i64::from(batch)),
        ))
        .await
        .and_then(|rows| rows.iter().map(read_claimed).collect())
        .map_err(|e| store_error(doing, e))?
    };
    claimed.sort_by_key(|c| c.row);
    Ok(claimed)
}

/// Marks `rows` published (if `token` still holds their lease).
async fn mark_published(db: &DatabaseConnection, rows: &[i64], token: i64) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let sql = crate::driver::of(db.get_database_backend());
    exec(db, sql, sql.outbox.mark_published(rows, token))
        .await
        .map(drop)
        .map_err(|e| store_error("marking outbox messages published", e))
}

/// Records a failed attempt: back to pending after `delay`, or dead.
async fn mark_failed(
    db: &DatabaseConnection,
    row: i64,
    token: i64,
    dead: bool,
    error: &str,
    delay: Duration,
) -> Result<(), Error> {
    let sql = crate::driver::of(db.get_database_backend());
    // Keep the stored error short: it is for an operator's eyes, not a log archive.
    let error: String = error.chars().take(2000).collect();
    exec(
        db,
        sql,
        sql.outbox
            .mark_failed(row, token, dead, error, millis(delay)),
    )
    .await
    .map(drop)
    .map_err(|e| store_error("recording a failed outbox attempt", e))
}

/// What one relay round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayRound {
    /// Messages claimed.
    pub claimed: usize,
    /// Messages the sink accepted and that were marked published.
    pub published: usize,
    /// Attempts that failed and will be retried.
    pub retrying: usize,
    /// Messages that became dead.
    pub dead: usize,
}

/// Counters of a relay since it was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayCounters {
    /// Messages published.
    pub published: u64,
    /// Failed attempts that will be retried.
    pub retried: u64,
    /// Messages that became dead.
    pub dead: u64,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
}

/// Publishes committed outbox messages to a [`Sink`]: claims a batch (leased, so several
/// relays in several processes share the work), publishes, marks.
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
#[derive(Debug)]
pub struct Relay<S> {
    db: DatabaseConnection,
    sink: S,
    options: RelayOptions,
    counters: Arc<Counters>,
}

impl<S: Sink> Relay<S> {
    /// A relay from `db`'s outbox to `sink`, with [`RelayOptions::default`].
    pub fn new(db: DatabaseConnection, sink: S) -> Self {
        Self {
            db,
            sink,
            options: RelayOptions::default(),
            counters: Arc::default(),
        }
    }

    /// Messages claimed per round trip (default 100, at least 1).
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.options.batch_size = batch_size.max(1);
        self
    }

    /// How long a claimed message stays reserved (default 30 s). Also the longest a publish
    /// may take before it counts as failed.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease.max(Duration::from_millis(10));
        self
    }

    /// Attempts before a message is dead (default 10, at least 1).
    #[must_use]
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.options.max_attempts = max_attempts.max(1);
        self
    }

    /// Delays between attempts (default 0.5 s doubling to 60 s, with jitter).
    #[must_use]
    pub fn backoff(mut self, backoff: idem_core::outbox::Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }

    /// Longest sleep when nothing wakes the relay (default 500 ms).
    #[must_use]
    pub fn poll_interval(mut self, poll_interval: Duration) -> Self {
        self.options.poll_interval = poll_interval;
        self
    }

    /// How often [`run`](Self::run) logs the outbox's figures (default 30 s).
    #[must_use]
    pub fn report_interval(mut self, report_interval: Duration) -> Self {
        self.options.report_interval = report_interval;
        self
    }

    /// The options in effect.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// Counters since this relay was built.
    pub fn counters(&self) -> RelayCounters {
        RelayCounters {
            published: self.counters.published.load(Ordering::Relaxed),
            retried: self.counters.retried.load(Ordering::Relaxed),
            dead: self.counters.dead.load(Ordering::Relaxed),
        }
    }

    /// One round: claims a batch, publishes it (concurrently: a batch holds at most one
    /// message per aggregate), and marks each message published, retrying or dead.
    pub async fn run_once(&self) -> Result<RelayRound, Error> {
        let token = random_token();
        let options = self.options;
        let db = self.db.clone();
        let claimed =
            detached(async move { claim(&db, options.batch_size, options.lease, token).await })
                .await?;
        let mut round = RelayRound {
            claimed: claimed.len(),
            ..RelayRound::default()
        };
        if claimed.is_empty() {
            return Ok(round);
        }
        let outcomes = futures_util::future::join_all(claimed.iter().map(|c| async {
            if c.message.attempt > options.max_attempts {
                // Earlier attempts ended without a verdict (the relay died or lost its lease
                // every time): this message may be what kills it.
                return Err(SinkError::permanent(format!(
                    "gave up after {} attempts that ended without a result (relay stopped or lease lost)",
                    options.max_attempts
                )));
            }
            match tokio::time::timeout(options.lease, self.sink.publish(&c.message)).await {
                Ok(result) => result,
                Err(_) => Err(SinkError::transient(format!(
                    "the sink did not answer within the lease ({} ms)",
                    options.lease.as_millis()
                ))),
            }
        }))
        .await;
        let mut published = Vec::new();
        let mut failures = Vec::new();
        for (c, outcome) in claimed.iter().zip(outcomes) {
            match outcome {
                Ok(()) => published.push(c.row),
                Err(e) => {
                    let dead = e.is_permanent() || c.message.attempt >= options.max_attempts;
                    tracing::warn!(
                        id = %c.message.id,
                        topic = %c.message.topic,
                        attempt = c.message.attempt,
                        dead,
                        error = %e,
                        "outbox message not delivered"
                    );
                    failures.push((c.row, dead, e.to_string(), c.message.attempt));
                }
            }
        }
        let db = self.db.clone();
        let backoff = options.backoff;
        let failures_to_mark = failures.clone();
        let published_rows = published.clone();
        detached(async move {
            mark_published(&db, &published_rows, token).await?;
            for (row, dead, error, attempt) in failures_to_mark {
                mark_failed(&db, row, token, dead, &error, backoff.delay(attempt)).await?;
            }
            Ok(())
        })
        .await?;
        round.published = published.len();
        round.dead = failures.iter().filter(|f| f.1).count();
        round.retrying = failures.len() - round.dead;
        self.counters
            .published
            .fetch_add(round.published as u64, Ordering::Relaxed);
        self.counters
            .retried
            .fetch_add(round.retrying as u64, Ordering::Relaxed);
        self.counters
            .dead
            .fetch_add(round.dead as u64, Ordering::Relaxed);
        Ok(round)
    }

    /// Runs rounds until `shutdown` completes: right after a round that found work, on a
    /// wake-up (a call in this process committed messages; on PostgreSQL, a `NOTIFY` from any
    /// process), or after the poll interval. Database and sink failures are logged and
    /// retried with backoff; they never end the loop. A round in progress finishes before
    /// the relay stops.
    pub async fn run(&self, shutdown: impl Future) -> Result<(), Error> {
        let mut shutdown = pin!(shutdown);
        let mut wake = idem_core::outbox::wake_signal();
        let listener = listen_for_notifications(&self.db);
        let mut failures: u32 = 0;
        let mut last_report = Instant::now();
        let mut published_at_report = 0;
        loop {
            wake.borrow_and_update();
            let pause = match self.run_once().await {
                Ok(round) if round.claimed > 0 => {
                    failures = 0;
                    None
                }
                Ok(_) => {
                    failures = 0;
                    Some(self.options.poll_interval)
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let pause = self.options.backoff.delay(failures);
                    tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "outbox relay round failed");
                    Some(pause)
                }
            };
            if last_report.elapsed() >= self.options.report_interval {
                let published = self.counters.published.load(Ordering::Relaxed);
                let per_s =
                    (published - published_at_report) as f64 / last_report.elapsed().as_secs_f64();
                match outbox_health(&self.db).await {
                    Ok(h) => tracing::info!(
                        pending = h.pending,
                        oldest_pending_ms = h.oldest_pending_ms.unwrap_or(0),
                        dead = h.dead,
                        published_per_s = per_s,
                        "outbox relay"
                    ),
                    Err(e) => tracing::warn!(error = %e, "outbox health unavailable"),
                }
                last_report = Instant::now();
                published_at_report = published;
            }
            match pause {
                None => {
                    // More work may be waiting; still stop promptly when asked.
                    tokio::select! {
                        biased;
                        _ = shutdown.as_mut() => break,
                        () = std::future::ready(()) => {}
                    }
                }
                Some(pause) => {
                    tokio::select! {
                        _ = shutdown.as_mut() => break,
                        _ = wake.changed() => {}
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
        if let Some(listener) = listener {
            listener.abort();
        }
        Ok(())
    }
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
    let row = db
        .query_one_raw(statement(sql, sql.outbox.outbox_health()))
        .await
        .map_err(|e| store_error(doing, e))?
        .ok_or_else(|| Error::store(doing, "no row"))?;
    let get = |i| row.try_get_by_index::<Option<i64>>(i);
    let (pending, oldest, dead, now) = (|| Ok((get(0)?, get(1)?, get(2)?, get(3)?)))()
        .map_err(|e: sea_orm::DbErr| store_error(doing, e))?;
    let mut health = OutboxHealth::default();
    health.pending = pending.unwrap_or(0).max(0) as u64;
    health.dead = dead.unwrap_or(0).max(0) as u64;
    health.oldest_pending_ms = oldest.zip(now).map(|(o, n)| (n - o).max(0) as u64);
    Ok(health)
}

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

/// Lists up to `limit` dead messages, oldest first.
pub async fn dead_messages<C: ConnectionTrait>(
    db: &C,
    limit: u32,
) -> Result<Vec<DeadMessage>, Error> {
    let list = crate::driver::of(db.get_database_backend())
        .outbox
        .list_dead(i64::from(limit));
    list_rows(db, list, "listing dead outbox messages", |row| {
        let (id, topic, aggregate, aggregate_seq, attempts, last_error, created_at_ms) =
            row.try_get_many_by_index::<(_, _, _, _, i32, _, _)>()?;
        Ok(DeadMessage {
            id,
            topic,
            aggregate,
            aggregate_seq,
            attempts: u32::try_from(attempts).unwrap_or(0),
            last_error,
            created_at_ms,
        })
    })
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
    let mut total = 0;
    loop {
        let started = Instant::now();
        let deleted = exec(
            db,
            sql,
            sql.outbox
                .purge_published(millis(retention), i64::from(batch)),
        )
        .await
        .map_err(|e| store_error("purging published outbox messages", e))?;
        total += deleted;
        if deleted < u64::from(batch) {
            return Ok(total);
        }
        tokio::time::sleep(started.elapsed()).await;
    }
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
