//! The outbox's SQL, one dialect per backend. Every statement the outbox and its relay run is
//! here; table names are spliced in from the constants below, so each is written once.

use std::sync::LazyLock;

use sea_orm::DbBackend;

use crate::sql::{DEAD_LETTERS_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE};

/// The `state` column of the outbox.
pub(crate) mod state {
    pub(crate) const PENDING: i16 = 0;
    pub(crate) const PUBLISHED: i16 = 1;
    pub(crate) const DEAD: i16 = 2;
}

/// Columns the relay reads for each claimed message, in this order.
pub(crate) const CLAIMED_COLUMNS: &str =
    "id, message_id, topic, aggregate_key, aggregate_seq, headers, payload, attempts";

/// SQL for one backend. Placeholders are positional, in the order the caller binds them.
#[derive(Debug)]
pub(crate) struct OutboxSql {
    pub(crate) backend: DbBackend,
    pub(crate) create: Vec<String>,
    pub(crate) drop: Vec<String>,
    /// Binds aggregate_key. Locks the aggregate's head row until commit, so messages of one
    /// aggregate get their sequence numbers (and ids) in commit order.
    pub(crate) bump_head: Option<String>,
    /// Binds aggregate_key, message_id, topic, aggregate_key, headers, payload (PostgreSQL:
    /// bumps the head and notifies relays in the same statement).
    pub(crate) insert_with_aggregate: String,
    /// Binds message_id, topic, headers, payload.
    pub(crate) insert: String,
    /// Binds lease_ms, token, batch. Claims due messages that are first in their aggregate
    /// and returns [`CLAIMED_COLUMNS`] (PostgreSQL, SQLite). MySQL uses the three statements
    /// below in one transaction.
    pub(crate) claim: String,
    /// MySQL: binds batch; ids of due messages that are first in their aggregate (plain read).
    pub(crate) select_eligible: String,
    /// MySQL: `{ids}` is the id list; locks those still claimable, skipping locked ones.
    pub(crate) lock_claimable: String,
    /// MySQL: binds lease_ms, token; `{ids}` is the id list.
    pub(crate) lease: String,
    /// Binds token; `{ids}` is the id list.
    pub(crate) mark_published: String,
    /// Binds state, last_error, delay_ms, id, token.
    pub(crate) mark_failed: String,
    /// Binds retention_ms, batch.
    pub(crate) purge_published: String,
    /// Returns pending count, oldest pending created_at_ms, dead count, now_ms.
    pub(crate) health: String,
    /// Binds limit.
    pub(crate) list_dead: String,
    /// Binds message_id.
    pub(crate) retry_dead: String,
    /// Binds consumer, message_id, subject, payload, error, deliveries.
    pub(crate) record_dead_letter: String,
}

/// Whether a message is first in its aggregate: no earlier message of the aggregate is
/// unpublished (pending or dead). Published never reverts, so a stale read of this is only
/// ever too cautious.
const FIRST_IN_AGGREGATE: &str = "(o.aggregate_key IS NULL OR NOT EXISTS (\
    SELECT 1 FROM {outbox} e WHERE e.aggregate_key = o.aggregate_key AND e.id < o.id AND e.state <> {published}))";
const DUE: &str =
    "o.state = {pending} AND o.next_attempt_at_ms <= {now} AND o.locked_until_ms <= {now}";
const INSERT_COLUMNS: &str = "message_id, topic, aggregate_key, aggregate_seq, headers, payload, \
    state, attempts, next_attempt_at_ms, locked_until_ms, locked_by, created_at_ms";

fn render(template: &str, backend: DbBackend) -> String {
    let sql = template
        .replace("{eligible}", &format!("{DUE} AND {FIRST_IN_AGGREGATE}"))
        .replace("{columns}", INSERT_COLUMNS)
        .replace("{pending}", &state::PENDING.to_string())
        .replace("{published}", &state::PUBLISHED.to_string())
        .replace("{dead}", &state::DEAD.to_string());
    // `{ids}` stays for the caller to fill in; `render` only numbers the `?` before it.
    crate::sql::render(backend, &sql)
}

/// Fills an `{ids}` list with `n` placeholders, numbered after those already in `sql`.
pub(crate) fn with_ids(backend: DbBackend, sql: &str, n: usize) -> String {
    let before = sql.split("{ids}").next().unwrap_or_default();
    let taken = if backend == DbBackend::Postgres {
        before.matches('$').count()
    } else {
        0
    };
    let list = if backend == DbBackend::Postgres {
        (1..=n)
            .map(|i| format!("${}", taken + i))
            .collect::<Vec<_>>()
            .join(", ")
    } else {
        vec!["?"; n].join(", ")
    };
    // Placeholders after the list (none today) would need renumbering: keep lists last.
    debug_assert!(!sql.split("{ids}").nth(1).unwrap_or_default().contains('$'));
    sql.replace("{ids}", &list)
}

fn drops() -> Vec<String> {
    [DEAD_LETTERS_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE]
        .iter()
        .map(|t| format!("DROP TABLE IF EXISTS {t}"))
        .collect()
}

static POSTGRES: LazyLock<OutboxSql> = LazyLock::new(|| {
    let r = |t: &str| render(t, DbBackend::Postgres);
    OutboxSql {
        backend: DbBackend::Postgres,
        create: [
            "CREATE TABLE IF NOT EXISTS {outbox} (\
                id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
                message_id VARCHAR(36) NOT NULL, \
                topic VARCHAR(255) NOT NULL, \
                aggregate_key VARCHAR(255) NULL, \
                aggregate_seq BIGINT NULL, \
                headers TEXT NULL, \
                payload BYTEA NOT NULL, \
                state SMALLINT NOT NULL, \
                attempts INTEGER NOT NULL, \
                last_error TEXT NULL, \
                next_attempt_at_ms BIGINT NOT NULL, \
                locked_until_ms BIGINT NOT NULL, \
                locked_by BIGINT NOT NULL, \
                created_at_ms BIGINT NOT NULL, \
                published_at_ms BIGINT NULL)",
            // The relay's scan: unpublished messages in id order.
            "CREATE INDEX IF NOT EXISTS idem_outbox_pending ON {outbox} (id) WHERE state = {pending}",
            // First-in-aggregate checks look only at unpublished messages.
            "CREATE INDEX IF NOT EXISTS idem_outbox_aggregate ON {outbox} (aggregate_key, id) WHERE state <> {published}",
            "CREATE INDEX IF NOT EXISTS idem_outbox_published ON {outbox} (published_at_ms) WHERE state = {published}",
            "CREATE TABLE IF NOT EXISTS {heads} (\
                aggregate_key VARCHAR(255) NOT NULL PRIMARY KEY, \
                last_seq BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS {dead_letters} (\
                consumer VARCHAR(255) NOT NULL, \
                message_id VARCHAR(255) NOT NULL, \
                subject VARCHAR(255) NOT NULL, \
                payload BYTEA NOT NULL, \
                error TEXT NOT NULL, \
                deliveries BIGINT NOT NULL, \
                created_at_ms BIGINT NOT NULL, \
                PRIMARY KEY (consumer, message_id))",
        ]
        .iter()
        .map(|t| r(t))
        .collect(),
        drop: drops(),
        bump_head: None,
        // One round trip: bump the head, insert, and notify listening relays at commit.
        insert_with_aggregate: r(
            "WITH head AS (INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = {heads}.last_seq + 1 \
                RETURNING last_seq) \
            INSERT INTO {outbox} ({columns}) \
            SELECT ?, ?, ?, head.last_seq, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
            FROM head, (SELECT pg_notify('idem_outbox', '')) AS wake",
        ),
        insert: r("INSERT INTO {outbox} ({columns}) \
            SELECT ?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
            FROM (SELECT pg_notify('idem_outbox', '')) AS wake"),
        claim: r(&format!(
            "UPDATE {{outbox}} SET locked_until_ms = {{now}} + ?, locked_by = ?, attempts = attempts + 1 \
            WHERE id IN (SELECT o.id FROM {{outbox}} o WHERE {{eligible}} \
                ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED) \
            RETURNING {CLAIMED_COLUMNS}"
        )),
        select_eligible: String::new(),
        lock_claimable: String::new(),
        lease: String::new(),
        mark_published: r(MARK_PUBLISHED),
        mark_failed: r(MARK_FAILED),
        purge_published: r("DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
            WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ? FOR UPDATE SKIP LOCKED)"),
        health: r(HEALTH),
        list_dead: r(LIST_DEAD),
        retry_dead: r(RETRY_DEAD),
        record_dead_letter: r(&format!(
            "{DEAD_LETTER} ON CONFLICT (consumer, message_id) DO UPDATE \
            SET error = excluded.error, deliveries = excluded.deliveries"
        )),
    }
});

const MARK_PUBLISHED: &str = "UPDATE {outbox} SET state = {published}, published_at_ms = {now}, \
    locked_until_ms = 0 WHERE locked_by = ? AND state = {pending} AND id IN ({ids})";
const MARK_FAILED: &str = "UPDATE {outbox} SET state = ?, last_error = ?, next_attempt_at_ms = {now} + ?, \
    locked_until_ms = 0 WHERE id = ? AND locked_by = ? AND state = {pending}";
const HEALTH: &str = "SELECT \
    (SELECT COUNT(*) FROM {outbox} WHERE state = {pending}) AS pending, \
    (SELECT MIN(created_at_ms) FROM {outbox} WHERE state = {pending}) AS oldest_pending_ms, \
    (SELECT COUNT(*) FROM {outbox} WHERE state = {dead}) AS dead, \
    {now} AS now_ms";
const LIST_DEAD: &str = "SELECT message_id, topic, aggregate_key, aggregate_seq, attempts, last_error, \
    created_at_ms FROM {outbox} WHERE state = {dead} ORDER BY id LIMIT ?";
const RETRY_DEAD: &str = "UPDATE {outbox} SET state = {pending}, attempts = 0, last_error = NULL, \
    next_attempt_at_ms = {now}, locked_until_ms = 0 WHERE message_id = ? AND state = {dead}";
const DEAD_LETTER: &str = "INSERT INTO {dead_letters} \
    (consumer, message_id, subject, payload, error, deliveries, created_at_ms) \
    VALUES (?, ?, ?, ?, ?, ?, {now})";

static MYSQL: LazyLock<OutboxSql> = LazyLock::new(|| {
    let r = |t: &str| render(t, DbBackend::MySql);
    OutboxSql {
        backend: DbBackend::MySql,
        create: [
            "CREATE TABLE IF NOT EXISTS {outbox} (\
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
                message_id VARCHAR(36) NOT NULL, \
                topic VARCHAR(255) NOT NULL, \
                aggregate_key VARCHAR(255) NULL, \
                aggregate_seq BIGINT NULL, \
                headers TEXT NULL, \
                payload LONGBLOB NOT NULL, \
                state SMALLINT NOT NULL, \
                attempts INT NOT NULL, \
                last_error TEXT NULL, \
                next_attempt_at_ms BIGINT NOT NULL, \
                locked_until_ms BIGINT NOT NULL, \
                locked_by BIGINT NOT NULL, \
                created_at_ms BIGINT NOT NULL, \
                published_at_ms BIGINT NULL, \
                INDEX idem_outbox_pending (state, id), \
                INDEX idem_outbox_aggregate (aggregate_key, id), \
                INDEX idem_outbox_published (state, published_at_ms)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
            "CREATE TABLE IF NOT EXISTS {heads} (\
                aggregate_key VARCHAR(255) NOT NULL PRIMARY KEY, \
                last_seq BIGINT NOT NULL\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
            "CREATE TABLE IF NOT EXISTS {dead_letters} (\
                consumer VARCHAR(255) NOT NULL, \
                message_id VARCHAR(255) NOT NULL, \
                subject VARCHAR(255) NOT NULL, \
                payload LONGBLOB NOT NULL, \
                error TEXT NOT NULL, \
                deliveries BIGINT NOT NULL, \
                created_at_ms BIGINT NOT NULL, \
                PRIMARY KEY (consumer, message_id)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        ]
        .iter()
        .map(|t| r(t))
        .collect(),
        drop: drops(),
        bump_head: Some(r(
            "INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
            ON DUPLICATE KEY UPDATE last_seq = last_seq + 1",
        )),
        insert_with_aggregate: r("INSERT INTO {outbox} ({columns}) VALUES (?, ?, ?, \
            (SELECT last_seq FROM {heads} WHERE aggregate_key = ?), ?, ?, {pending}, 0, {now}, 0, 0, {now})"),
        insert: r("INSERT INTO {outbox} ({columns}) \
            VALUES (?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now})"),
        claim: String::new(),
        // InnoDB may lock (and so skip) the rows a subquery of a locking read visits, which
        // would let a message overtake a locked predecessor: the first-in-aggregate check is
        // a plain read, the lock a second statement.
        select_eligible: r("SELECT o.id FROM {outbox} o WHERE {eligible} ORDER BY o.id LIMIT ?"),
        lock_claimable: r(&format!(
            "SELECT {CLAIMED_COLUMNS} FROM {{outbox}} o WHERE id IN ({{ids}}) AND {DUE} \
            ORDER BY id FOR UPDATE SKIP LOCKED"
        )),
        lease: r(
            "UPDATE {outbox} SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
            WHERE id IN ({ids})",
        ),
        mark_published: r(MARK_PUBLISHED),
        mark_failed: r(MARK_FAILED),
        purge_published: r(
            "DELETE FROM {outbox} WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?",
        ),
        health: r(HEALTH),
        list_dead: r(LIST_DEAD),
        retry_dead: r(RETRY_DEAD),
        record_dead_letter: r(&format!(
            "{DEAD_LETTER} ON DUPLICATE KEY UPDATE error = VALUES(error), deliveries = VALUES(deliveries)"
        )),
    }
});

static SQLITE: LazyLock<OutboxSql> = LazyLock::new(|| {
    let r = |t: &str| render(t, DbBackend::Sqlite);
    OutboxSql {
        backend: DbBackend::Sqlite,
        create: [
            "CREATE TABLE IF NOT EXISTS {outbox} (\
                id INTEGER PRIMARY KEY AUTOINCREMENT, \
                message_id TEXT NOT NULL, \
                topic TEXT NOT NULL, \
                aggregate_key TEXT NULL, \
                aggregate_seq INTEGER NULL, \
                headers TEXT NULL, \
                payload BLOB NOT NULL, \
                state INTEGER NOT NULL, \
                attempts INTEGER NOT NULL, \
                last_error TEXT NULL, \
                next_attempt_at_ms INTEGER NOT NULL, \
                locked_until_ms INTEGER NOT NULL, \
                locked_by INTEGER NOT NULL, \
                created_at_ms INTEGER NOT NULL, \
                published_at_ms INTEGER NULL)",
            "CREATE INDEX IF NOT EXISTS idem_outbox_pending ON {outbox} (id) WHERE state = {pending}",
            "CREATE INDEX IF NOT EXISTS idem_outbox_aggregate ON {outbox} (aggregate_key, id) WHERE state <> {published}",
            "CREATE INDEX IF NOT EXISTS idem_outbox_published ON {outbox} (published_at_ms) WHERE state = {published}",
            "CREATE TABLE IF NOT EXISTS {heads} (\
                aggregate_key TEXT NOT NULL PRIMARY KEY, \
                last_seq INTEGER NOT NULL) WITHOUT ROWID",
            "CREATE TABLE IF NOT EXISTS {dead_letters} (\
                consumer TEXT NOT NULL, \
                message_id TEXT NOT NULL, \
                subject TEXT NOT NULL, \
                payload BLOB NOT NULL, \
                error TEXT NOT NULL, \
                deliveries INTEGER NOT NULL, \
                created_at_ms INTEGER NOT NULL, \
                PRIMARY KEY (consumer, message_id)) WITHOUT ROWID",
        ]
        .iter()
        .map(|t| r(t))
        .collect(),
        drop: drops(),
        bump_head: Some(r("INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
            ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = last_seq + 1")),
        insert_with_aggregate: r("INSERT INTO {outbox} ({columns}) VALUES (?, ?, ?, \
            (SELECT last_seq FROM {heads} WHERE aggregate_key = ?), ?, ?, {pending}, 0, {now}, 0, 0, {now})"),
        insert: r("INSERT INTO {outbox} ({columns}) \
            VALUES (?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now})"),
        // One statement is atomic on SQLite's single writer: no row locks needed.
        claim: r(&format!(
            "UPDATE {{outbox}} SET locked_until_ms = {{now}} + ?, locked_by = ?, attempts = attempts + 1 \
            WHERE id IN (SELECT o.id FROM {{outbox}} o WHERE {{eligible}} ORDER BY o.id LIMIT ?) \
            RETURNING {CLAIMED_COLUMNS}"
        )),
        select_eligible: String::new(),
        lock_claimable: String::new(),
        lease: String::new(),
        mark_published: r(MARK_PUBLISHED),
        mark_failed: r(MARK_FAILED),
        purge_published: r("DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
            WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?)"),
        health: r(HEALTH),
        list_dead: r(LIST_DEAD),
        retry_dead: r(RETRY_DEAD),
        record_dead_letter: r(&format!(
            "{DEAD_LETTER} ON CONFLICT (consumer, message_id) DO UPDATE \
            SET error = excluded.error, deliveries = excluded.deliveries"
        )),
    }
});

impl OutboxSql {
    /// The outbox SQL of `backend`.
    pub(crate) fn of(backend: DbBackend) -> &'static OutboxSql {
        match backend {
            DbBackend::Postgres => &POSTGRES,
            DbBackend::MySql => &MYSQL,
            _ => &SQLITE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lists_are_numbered_after_the_leading_placeholders() {
        let sql = &OutboxSql::of(DbBackend::Postgres).mark_published;
        let filled = with_ids(DbBackend::Postgres, sql, 3);
        assert!(filled.contains("locked_by = $1"), "{filled}");
        assert!(filled.ends_with("id IN ($2, $3, $4)"), "{filled}");
        let filled = with_ids(
            DbBackend::MySql,
            &OutboxSql::of(DbBackend::MySql).mark_published,
            2,
        );
        assert!(filled.ends_with("id IN (?, ?)"), "{filled}");
    }

    #[test]
    fn statements_name_tables_through_the_constants() {
        for backend in [DbBackend::Postgres, DbBackend::MySql, DbBackend::Sqlite] {
            let sql = OutboxSql::of(backend);
            for statement in sql.create.iter().chain([&sql.insert, &sql.mark_failed]) {
                assert!(!statement.contains('{'), "{backend:?}: {statement}");
            }
        }
    }
}
