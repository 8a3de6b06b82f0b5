//! The outbox's statements: staged messages, their aggregates' heads, and the relay's claims.

use crate::statement::names::outbox_state;
use crate::statement::render::render;
use crate::{Bound, ClaimedRow, Column, DeadMessage, Dialect, Param, Sql, Tables, with_ids};

/// The outbox's statements for one server flavour.
#[derive(Debug)]
pub struct Outbox {
    dialect: Dialect,
    /// The outbox, its aggregates' heads, and the inbox's dead letters (created with the outbox).
    pub tables: Tables,
    /// Binds aggregate_key. Locks the aggregate's head row until commit, so messages of one
    /// aggregate get their sequence numbers (and ids) in commit order.
    pub(crate) bump_head: Option<String>,
    /// Binds aggregate_key, message_id, topic, aggregate_key, headers, payload (PostgreSQL:
    /// bumps the head and notifies relays in the same statement).
    pub(crate) insert_message_in_aggregate: String,
    /// Binds message_id, topic, headers, payload.
    pub(crate) insert_message: String,
    /// Binds lease_ms, token, batch. Claims due messages that are first in their aggregate
    /// and returns `{claimed_columns}` (PostgreSQL, SQLite). MySQL uses the three statements
    /// below in one transaction.
    pub(crate) claim_messages: String,
    /// MySQL: binds batch; ids of due messages that are first in their aggregate (plain read).
    pub(crate) select_eligible: String,
    /// MySQL: `{ids}` is the id list; locks those still claimable, skipping locked ones.
    pub(crate) lock_claimable: String,
    /// MySQL: binds lease_ms, token; `{ids}` is the id list.
    pub(crate) lease_messages: String,
    /// Binds token; `{ids}` is the id list.
    pub(crate) mark_published: String,
    /// Binds state, last_error, delay_ms, id, token.
    pub(crate) mark_failed: String,
    /// Binds retention_ms, batch.
    pub(crate) purge_published: String,
    /// Returns pending count, oldest pending created_at_ms, dead count, now_ms.
    pub(crate) outbox_health: String,
    /// Binds limit.
    pub(crate) list_dead: String,
    /// Binds message_id.
    pub(crate) retry_dead: String,
}

impl Outbox {
    pub(crate) fn new(backend: Dialect) -> Self {
        use Dialect::{MySql, Postgres};
        let r = |template: &str| render(backend, template);
        // The outbox's two other tables, the same whatever the outbox table's indexes.
        let heads_table = "CREATE TABLE IF NOT EXISTS {heads} (\
        aggregate_key {string} NOT NULL PRIMARY KEY, last_seq {i64} NOT NULL){clustered}";
        let dead_letters_table = "CREATE TABLE IF NOT EXISTS {dead_letters} (\
        consumer {string} NOT NULL, message_id {string} NOT NULL, \
        subject {string} NOT NULL, payload {blob} NOT NULL, error TEXT NOT NULL, \
        deliveries {i64} NOT NULL, created_at_ms {i64} NOT NULL, \
        PRIMARY KEY (consumer, message_id)){clustered}";
        Self {
            dialect: backend,
            tables: Tables {
                create: match backend {
                    // MySQL has no partial indexes: its indexes are part of the table.
                    MySql => vec![
                        "CREATE TABLE IF NOT EXISTS {outbox} ({outbox_columns}, \
                    INDEX {outbox_pending} (state, id), \
                    INDEX {outbox_aggregate} (aggregate_key, id), \
                    INDEX {outbox_published} (state, published_at_ms)){clustered}",
                        heads_table,
                        dead_letters_table,
                    ],
                    _ => vec![
                        // Not `{clustered}` on SQLite: AUTOINCREMENT needs a rowid.
                        "CREATE TABLE IF NOT EXISTS {outbox} ({outbox_columns})",
                        // The relay's scan: unpublished messages in id order.
                        "CREATE INDEX IF NOT EXISTS {outbox_pending} ON {outbox} (id) \
                    WHERE state = {pending}",
                        // First-in-aggregate checks look only at unpublished messages.
                        "CREATE INDEX IF NOT EXISTS {outbox_aggregate} ON {outbox} \
                    (aggregate_key, id) WHERE state <> {published}",
                        "CREATE INDEX IF NOT EXISTS {outbox_published} ON {outbox} \
                    (published_at_ms) WHERE state = {published}",
                        // The health check's dead count and the dead list (MySQL's `(state,
                        // id)` index serves them): SQLite cannot use the aggregate index's
                        // `state <> published` for `state = dead` and scanned every message
                        // the retention keeps (16 ms at 200,000); PostgreSQL read every
                        // unpublished one.
                        "CREATE INDEX IF NOT EXISTS {outbox_dead} ON {outbox} (id) \
                    WHERE state = {dead}",
                        heads_table,
                        dead_letters_table,
                    ],
                }
                .into_iter()
                .map(r)
                .collect(),
                drop: [
                    "DROP TABLE IF EXISTS {dead_letters}",
                    "DROP TABLE IF EXISTS {heads}",
                    "DROP TABLE IF EXISTS {outbox}",
                ]
                .map(r)
                .to_vec(),
            },
            bump_head: match backend {
                // The insert bumps the head itself.
                Postgres => None,
                MySql => Some(r(
                    "INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                ON DUPLICATE KEY UPDATE last_seq = last_seq + 1",
                )),
                _ => Some(r(
                    "INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = last_seq + 1",
                )),
            },
            insert_message_in_aggregate: r(match backend {
                // One round trip: bump the head, insert, and notify listening relays at commit.
                Postgres => {
                    "WITH head AS (INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                    ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = {heads}.last_seq + 1 \
                    RETURNING last_seq) \
                INSERT INTO {outbox} ({insert_columns}) \
                SELECT ?, ?, ?, head.last_seq, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
                FROM head, (SELECT pg_notify('{wake_channel}', '')) AS wake"
                }
                _ => {
                    "INSERT INTO {outbox} ({insert_columns}) VALUES (?, ?, ?, \
                (SELECT last_seq FROM {heads} WHERE aggregate_key = ?), \
                ?, ?, {pending}, 0, {now}, 0, 0, {now})"
                }
            }),
            insert_message: r(match backend {
                Postgres => {
                    "INSERT INTO {outbox} ({insert_columns}) \
                SELECT ?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
                FROM (SELECT pg_notify('{wake_channel}', '')) AS wake"
                }
                _ => {
                    "INSERT INTO {outbox} ({insert_columns}) \
                VALUES (?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now})"
                }
            }),
            claim_messages: match backend {
                Postgres => r("UPDATE {outbox} \
                SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                WHERE id IN (SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                    ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED) \
                RETURNING {claimed_columns}"),
                MySql => String::new(),
                // One statement is atomic on SQLite's single writer: no row locks needed.
                _ => r("UPDATE {outbox} \
                SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                WHERE id IN (SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                    ORDER BY o.id LIMIT ?) \
                RETURNING {claimed_columns}"),
            },
            // InnoDB may lock (and so skip) the rows a subquery of a locking read visits, which
            // would let a message overtake a locked predecessor: the first-in-aggregate check
            // is a plain read, the lock a second statement.
            select_eligible: match backend {
                MySql => r(
                    "SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                ORDER BY o.id LIMIT ?",
                ),
                _ => String::new(),
            },
            lock_claimable: match backend {
                MySql => r(
                    "SELECT {claimed_columns} FROM {outbox} o WHERE id IN ({ids}) AND {due} \
                ORDER BY id FOR UPDATE SKIP LOCKED",
                ),
                _ => String::new(),
            },
            lease_messages: match backend {
                MySql => r("UPDATE {outbox} \
                SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                WHERE id IN ({ids})"),
                _ => String::new(),
            },
            mark_published: r(
                "UPDATE {outbox} SET state = {published}, published_at_ms = {now}, \
            locked_until_ms = 0 WHERE locked_by = ? AND state = {pending} AND id IN ({ids})",
            ),
            mark_failed: r(
                "UPDATE {outbox} SET state = ?, last_error = ?, next_attempt_at_ms = {now} + ?, \
            locked_until_ms = 0 WHERE id = ? AND locked_by = ? AND state = {pending}",
            ),
            purge_published: r(match backend {
                // The clock read once, so the published index bounds the scan (as the
                // ledger's purge: a volatile clock cannot, and the planner read the table).
                Postgres => {
                    "DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                WHERE state = {published} AND published_at_ms <= (SELECT {now} - ?) \
                ORDER BY published_at_ms LIMIT ? FOR UPDATE SKIP LOCKED)"
                }
                MySql => {
                    "DELETE FROM {outbox} \
                WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?"
                }
                _ => {
                    "DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?)"
                }
            }),
            outbox_health: r("SELECT \
            (SELECT COUNT(*) FROM {outbox} WHERE state = {pending}) AS pending, \
            (SELECT MIN(created_at_ms) FROM {outbox} WHERE state = {pending}) AS oldest_pending_ms, \
            (SELECT COUNT(*) FROM {outbox} WHERE state = {dead}) AS dead, \
            {now} AS now_ms"),
            list_dead: r(
                "SELECT message_id, topic, aggregate_key, aggregate_seq, attempts, last_error, \
            created_at_ms FROM {outbox} WHERE state = {dead} ORDER BY id LIMIT ?",
            ),
            retry_dead: r(
                "UPDATE {outbox} SET state = {pending}, attempts = 0, last_error = NULL, \
            next_attempt_at_ms = {now}, locked_until_ms = 0 WHERE message_id = ? AND state = {dead}",
            ),
        }
    }
}

/// A message to stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewMessage {
    /// Its id (a UUID v7).
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its aggregate: messages of one aggregate are published in staging order.
    pub aggregate: Option<String>,
    /// Its headers, as JSON (`None`: none).
    pub headers: Option<String>,
    /// Its payload.
    pub payload: Vec<u8>,
}

impl Outbox {
    /// The outbox's statements for `dialect`: the same for every server flavour of it, so a
    /// caller that knows its database but not its server's version (a handler staging on a
    /// connection) has them.
    pub fn of(dialect: Dialect) -> &'static Outbox {
        &Sql::common(dialect).outbox
    }

    /// `sql`'s `{ids}` list filled with `ids`, bound after `before`.
    fn over_ids(&self, sql: &str, before: Vec<Param>, ids: &[i64]) -> Bound<'static> {
        let mut params = before;
        params.extend(ids.iter().map(|&id| id.into()));
        Bound::owned(with_ids(self.dialect, sql, ids.len()), params)
    }

    /// The statements that stage `message`, in order: bumping its aggregate's head where that
    /// is a statement of its own, then the insert (on PostgreSQL one statement bumps the head,
    /// inserts and notifies listening relays).
    pub fn stage(&self, message: &NewMessage) -> Vec<Bound<'_>> {
        let (id, topic, headers, payload) = (
            Param::from(message.id.as_str()),
            Param::from(message.topic.as_str()),
            Param::Text(message.headers.clone()),
            Param::from(message.payload.as_slice()),
        );
        let Some(aggregate) = &message.aggregate else {
            return vec![Bound::new(
                &self.insert_message,
                [id, topic, headers, payload],
            )];
        };
        let aggregate = Param::from(aggregate.as_str());
        match &self.bump_head {
            Some(bump) => vec![
                Bound::new(bump, [aggregate.clone()]),
                Bound::new(
                    &self.insert_message_in_aggregate,
                    [id, topic, aggregate.clone(), aggregate, headers, payload],
                ),
            ],
            None => vec![Bound::new(
                &self.insert_message_in_aggregate,
                [aggregate.clone(), id, topic, aggregate, headers, payload],
            )],
        }
    }

    /// Whether the relay claims in three statements of one transaction
    /// ([`Outbox::select_eligible`], [`Outbox::lock_claimable`], [`Outbox::lease_messages`]:
    /// MySQL, where a locking read's subquery may lock and skip the rows it visits) rather
    /// than with [`Outbox::claim_messages`].
    pub fn claims_in_three_steps(&self) -> bool {
        self.dialect == Dialect::MySql
    }

    /// Claims up to `batch` due messages that are first in their aggregate for `lease_ms`,
    /// leased to `token`: returns id, message_id, topic, aggregate_key, aggregate_seq,
    /// headers, payload, attempts (PostgreSQL, SQLite).
    pub fn claim_messages(&self, token: i64, lease_ms: i64, batch: i64) -> Bound<'_> {
        Bound::new(
            &self.claim_messages,
            [lease_ms.into(), token.into(), batch.into()],
        )
        .reads(ClaimedRow::COLUMNS)
    }

    /// MySQL: ids of up to `batch` due messages that are first in their aggregate (a plain
    /// read).
    pub fn select_eligible(&self, batch: i64) -> Bound<'_> {
        Bound::new(&self.select_eligible, [batch.into()]).reads(&[Column::I64])
    }

    /// MySQL: locks those of `ids` still claimable, skipping locked ones; returns what
    /// [`Outbox::claim_messages`] returns.
    pub fn lock_claimable(&self, ids: &[i64]) -> Bound<'static> {
        self.over_ids(&self.lock_claimable, Vec::new(), ids)
            .reads(ClaimedRow::COLUMNS)
    }

    /// MySQL: leases `ids` to `token` for `lease_ms`.
    pub fn lease_messages(&self, ids: &[i64], token: i64, lease_ms: i64) -> Bound<'static> {
        self.over_ids(
            &self.lease_messages,
            vec![lease_ms.into(), token.into()],
            ids,
        )
    }

    /// Marks `ids` published, if `token` still holds their lease.
    pub fn mark_published(&self, ids: &[i64], token: i64) -> Bound<'static> {
        self.over_ids(&self.mark_published, vec![token.into()], ids)
    }

    /// Records a failed attempt at message `id` leased to `token`: back to pending after
    /// `delay_ms`, or dead.
    pub fn mark_failed(
        &self,
        id: i64,
        token: i64,
        dead: bool,
        error: String,
        delay_ms: i64,
    ) -> Bound<'_> {
        let state = if dead {
            outbox_state::DEAD
        } else {
            outbox_state::PENDING
        };
        Bound::new(
            &self.mark_failed,
            [
                state.into(),
                error.into(),
                delay_ms.into(),
                id.into(),
                token.into(),
            ],
        )
    }

    /// Deletes up to `batch` messages published more than `retention_ms` ago.
    pub fn purge_published(&self, retention_ms: i64, batch: i64) -> Bound<'_> {
        Bound::new(&self.purge_published, [retention_ms.into(), batch.into()])
    }

    /// Returns pending count, oldest pending created_at_ms, dead count, now_ms.
    pub fn outbox_health(&self) -> Bound<'_> {
        Bound::unbound(&self.outbox_health).reads(&[Column::I64; 4])
    }

    /// Up to `limit` dead messages, oldest first: returns message_id, topic, aggregate_key,
    /// aggregate_seq, attempts, last_error, created_at_ms.
    pub fn list_dead(&self, limit: i64) -> Bound<'_> {
        Bound::new(&self.list_dead, [limit.into()]).reads(DeadMessage::COLUMNS)
    }

    /// Puts dead message `message_id` back in line with fresh attempts.
    pub fn retry_dead(&self, message_id: &str) -> Bound<'_> {
        Bound::new(&self.retry_dead, [message_id.into()])
    }
}
