//! The template engine: every statement is written once, as a template, and rendered per
//! backend by [`render`], which splices in the table names, the shared fragments, the state
//! codes, the column types and the database clock, and numbers the placeholders.

use crate::Dialect;
use crate::statement::names::{
    ALL_TABLES, CALLS_TABLE, CLAIM_SAVEPOINT, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE,
    OUTBOX_TABLE, STEPS_TABLE, WAKE_CHANNEL, outbox_state,
};

/// Pieces several statements share, spliced before the names (they contain names).
const FRAGMENTS: [(&str, &str); 11] = [
    // Whether a ledger row may be purged: it ended (completed, failed or given up: never an
    // execution in progress, however long ago its lease ended), its TTL passed, and nothing
    // is owed on it (no stored call: a resumable call awaiting its completer, or a give-up
    // whose hook has not run). Purging any of those would let the next claim run the
    // recorded steps' effects again, and leave the completer nothing to finish.
    (
        "{purgeable}",
        "{ledger}.expires_at_ms <= {now} AND {ledger}.state <> {in_progress} AND NOT EXISTS (\
        SELECT 1 FROM {calls} c WHERE c.record_id = {ledger}.id)",
    ),
    // `{purgeable}` where no calls table exists (a service of atomic calls only, whose
    // schema has the ledger alone): then no call can be stored.
    (
        "{purgeable_without_calls}",
        "{ledger}.expires_at_ms <= {now} AND {ledger}.state <> {in_progress}",
    ),
    // The ledger's columns.
    (
        "{ledger_columns}",
        "id {hash} NOT NULL PRIMARY KEY, scope {string} NOT NULL, principal {string} NOT NULL, \
        idem_key {string} NOT NULL, owner {i64} NOT NULL, fingerprint {hash} NOT NULL, \
        state {i16} NOT NULL, response {blob} NULL, created_at_ms {i64} NOT NULL, \
        expires_at_ms {i64} NOT NULL",
    ),
    // A claim's new row: binds id, scope, principal, key, owner, fingerprint, ttl_ms.
    (
        "{insert_claim}",
        "INSERT INTO {ledger} \
        (id, scope, principal, idem_key, owner, fingerprint, state, response, created_at_ms, expires_at_ms) \
        VALUES (?, ?, ?, ?, ?, ?, 0, NULL, {now}, {now} + ?)",
    ),
    // Returns what `{read_row}` reads.
    (
        "{returning_row}",
        "RETURNING owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms",
    ),
    // Binds id.
    (
        "{read_row}",
        "SELECT owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms \
        FROM {ledger} WHERE id = ?",
    ),
    // The outbox's columns.
    (
        "{outbox_columns}",
        "id {auto_id}, message_id {uuid} NOT NULL, topic {string} NOT NULL, \
        aggregate_key {string} NULL, aggregate_seq {i64} NULL, headers TEXT NULL, \
        payload {blob} NOT NULL, state {i16} NOT NULL, attempts {i32} NOT NULL, \
        last_error TEXT NULL, next_attempt_at_ms {i64} NOT NULL, locked_until_ms {i64} NOT NULL, \
        locked_by {i64} NOT NULL, created_at_ms {i64} NOT NULL, published_at_ms {i64} NULL",
    ),
    // The columns a staged message is inserted with, in this order.
    (
        "{insert_columns}",
        "message_id, topic, aggregate_key, aggregate_seq, headers, payload, \
        state, attempts, next_attempt_at_ms, locked_until_ms, locked_by, created_at_ms",
    ),
    // The columns the relay reads for each claimed message, in this order.
    (
        "{claimed_columns}",
        "id, message_id, topic, aggregate_key, aggregate_seq, headers, payload, attempts",
    ),
    // Whether message `o` is due: pending, its next attempt reached, not leased.
    (
        "{due}",
        "o.state = {pending} AND o.next_attempt_at_ms <= {now} AND o.locked_until_ms <= {now}",
    ),
    // Whether message `o` is first in its aggregate: no earlier message of the aggregate is
    // unpublished (pending or dead). Published never reverts, so a stale read of this is only
    // ever too cautious.
    (
        "{first_in_aggregate}",
        "(o.aggregate_key IS NULL OR NOT EXISTS (\
        SELECT 1 FROM {outbox} e WHERE e.aggregate_key = o.aggregate_key AND e.id < o.id AND e.state <> {published}))",
    ),
];

/// `insert`, which updates `columns` to the inserted values where a row with its primary key
/// (`key`) exists.
pub(crate) fn upsert(backend: Dialect, insert: &str, key: &str, columns: &[&str]) -> String {
    let set = |inserted: fn(&str) -> String| {
        columns
            .iter()
            .map(|column| format!("{column} = {}", inserted(column)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match backend {
        Dialect::MySql => format!(
            "{insert} ON DUPLICATE KEY UPDATE {}",
            set(|column| format!("VALUES({column})"))
        ),
        _ => format!(
            "{insert} ON CONFLICT ({key}) DO UPDATE SET {}",
            set(|column| format!("excluded.{column}"))
        ),
    }
}

/// The database clock in epoch milliseconds, as an SQL expression of `backend`.
pub(crate) fn now(backend: Dialect) -> &'static str {
    match backend {
        Dialect::Postgres => "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)",
        // UNIX_TIMESTAMP is independent of the session time zone.
        Dialect::MySql => "CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)",
        // julianday works on every SQLite; unixepoch('subsec') needs 3.42.
        _ => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

/// The DDL's column types and table options: what each stands for on PostgreSQL, MySQL and
/// SQLite.
const COLUMN_TYPES: [(&str, [&str; 3]); 9] = [
    // A SHA-256 hash.
    ("{hash}", ["BYTEA", "BINARY(32)", "BLOB"]),
    ("{blob}", ["BYTEA", "LONGBLOB", "BLOB"]),
    // Up to 255 characters.
    ("{string}", ["VARCHAR(255)", "VARCHAR(255)", "TEXT"]),
    ("{uuid}", ["VARCHAR(36)", "VARCHAR(36)", "TEXT"]),
    ("{i64}", ["BIGINT", "BIGINT", "INTEGER"]),
    ("{i32}", ["INTEGER", "INT", "INTEGER"]),
    ("{i16}", ["SMALLINT", "SMALLINT", "INTEGER"]),
    // A primary key the database numbers.
    (
        "{auto_id}",
        [
            "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
            "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
            "INTEGER PRIMARY KEY AUTOINCREMENT",
        ],
    ),
    // The options of a table stored in its primary key's order: InnoDB stores every table so
    // (binary collation: keys compare as bytes), SQLite needs WITHOUT ROWID.
    (
        "{clustered}",
        [
            "",
            " ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
            " WITHOUT ROWID",
        ],
    ),
];

/// Renders a statement template for `backend`: splices in the fragments, the names, the state
/// codes, the column types and the database clock, then numbers the placeholders
/// ([`placeholders`]). An `{ids}` list stays for [`with_ids`] to fill in when the ids are
/// known.
pub(crate) fn render(backend: Dialect, template: &str) -> String {
    let mut sql = template.to_owned();
    for (name, fragment) in FRAGMENTS {
        sql = sql.replace(name, fragment);
    }
    let quoted = ALL_TABLES.map(|table| format!("'{table}'"));
    sql = sql
        .replace("{table_names}", &quoted.join(", "))
        .replace("{table_rows}", &quoted.map(|q| format!("({q})")).join(", "));
    sql = sql
        // Index names are their table's name and a suffix.
        .replace("{ledger_expires}", "{ledger}_expires")
        .replace("{outbox_pending}", "{outbox}_pending")
        .replace("{outbox_aggregate}", "{outbox}_aggregate")
        .replace("{outbox_published}", "{outbox}_published")
        .replace("{outbox_dead}", "{outbox}_dead")
        .replace("{claim_savepoint}", CLAIM_SAVEPOINT)
        .replace("{wake_channel}", WAKE_CHANNEL)
        .replace("{ledger}", LEDGER_TABLE)
        .replace("{steps}", STEPS_TABLE)
        .replace("{calls}", CALLS_TABLE)
        // The ledger's state codes, written once (`RecordStatus::code`).
        .replace(
            "{in_progress}",
            &idem_core::RecordStatus::Pending.code().to_string(),
        )
        .replace(
            "{gave_up}",
            &idem_core::RecordStatus::GaveUp.code().to_string(),
        )
        .replace("{outbox}", OUTBOX_TABLE)
        .replace("{heads}", OUTBOX_HEADS_TABLE)
        .replace("{dead_letters}", DEAD_LETTERS_TABLE)
        .replace("{pending}", &outbox_state::PENDING.to_string())
        .replace("{published}", &outbox_state::PUBLISHED.to_string())
        .replace("{dead}", &outbox_state::DEAD.to_string());
    let column = match backend {
        Dialect::Postgres => 0,
        Dialect::MySql => 1,
        _ => 2,
    };
    for (name, column_types) in COLUMN_TYPES {
        sql = sql.replace(name, column_types[column]);
    }
    placeholders(backend, &sql.replace("{now}", now(backend)))
}

/// Fills an `{ids}` list with `n` placeholders, numbered after those already in `sql`.
pub fn with_ids(backend: Dialect, sql: &str, n: usize) -> String {
    let before = sql.split("{ids}").next().unwrap_or_default();
    let taken = if backend == Dialect::Postgres {
        before.matches('$').count()
    } else {
        0
    };
    let list = if backend == Dialect::Postgres {
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

/// A duration in milliseconds for a statement that adds it to the database clock: saturated
/// far below `i64::MAX`, so `{now} + ?` cannot overflow.
pub fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(i64::MAX / 4, |ms| ms.min(i64::MAX / 4))
}

/// Writes `?` placeholders the way `backend` wants them: PostgreSQL numbers them (`$1`,
/// `$2`, …), MySQL and SQLite keep `?`. For raw SQL that runs on every backend; the template
/// must not contain `?` anywhere but in placeholders.
pub fn placeholders(backend: Dialect, template: &str) -> String {
    if backend != Dialect::Postgres {
        return template.to_owned();
    }
    let mut out = String::with_capacity(template.len() + 8);
    let mut n = 0;
    for c in template.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}
