//! The ledger's SQL, one dialect per backend. Every statement the store runs is here.

use std::sync::LazyLock;

use sea_orm::DbBackend;

/// Name of the ledger table.
pub const LEDGER_TABLE: &str = "idem_ledger";

/// SQL for one backend. Placeholders are positional, in the order the store binds them.
#[derive(Debug)]
pub(crate) struct Dialect {
    pub(crate) backend: DbBackend,
    /// The database clock in epoch milliseconds, as an SQL expression (spliced into the
    /// statements below; kept for tests that check every statement uses it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) now: &'static str,
    pub(crate) create: &'static [&'static str],
    /// Binds id, scope, principal, key, owner, fingerprint, ttl_ms. Returns owner,
    /// fingerprint, state, response, expires_at_ms, now_ms of the inserted row or of the row
    /// it ran into: locked and current on MariaDB, as the statement's snapshot saw it on
    /// PostgreSQL (SQLite claims by a read instead; its `claim` serves leases).
    pub(crate) claim: String,
    /// Whether the row `claim` returns is locked and current, so it decides without a
    /// second read.
    pub(crate) claim_locks_row: bool,
    /// Whether the atomic claim only reads (the transaction already holds the database's
    /// write lock: SQLite) and `record` writes the whole row (binds the row's values, then
    /// state and response).
    pub(crate) claim_by_read: bool,
    /// Same as `claim`, failing at once if another transaction holds the key.
    pub(crate) claim_nowait: String,
    /// Run before `claim_nowait` where the backend needs a separate statement.
    pub(crate) before_nowait: Option<&'static str>,
    /// Binds id; returns owner, fingerprint, state, response, expires_at_ms, now_ms.
    pub(crate) read_locked: String,
    /// Binds owner, fingerprint, ttl_ms, id.
    pub(crate) take_over: String,
    /// Binds state, response, id, owner (with `claim_by_read`: see there).
    pub(crate) record: String,
    /// How expired records are found and deleted.
    pub(crate) purge: Purge,
    /// Selects the database clock.
    pub(crate) select_now: String,
}

pub(crate) const PG_NOW: &str =
    "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)";
// UNIX_TIMESTAMP is independent of the session time zone.
pub(crate) const MYSQL_NOW: &str = "CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)";
// julianday works on every SQLite; unixepoch('subsec') needs 3.42.
pub(crate) const SQLITE_NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

const INSERT: &str = "INSERT INTO idem_ledger \
    (id, scope, principal, idem_key, owner, fingerprint, state, response, created_at_ms, expires_at_ms) \
    VALUES (?, ?, ?, ?, ?, ?, 0, NULL, {now}, {now} + ?)";
const READ: &str = "SELECT owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms \
    FROM idem_ledger WHERE id = ?";
const RETURNING_ROW: &str =
    "RETURNING owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms";
const TAKE_OVER: &str = "UPDATE idem_ledger SET owner = ?, fingerprint = ?, state = 0, response = NULL, \
    created_at_ms = {now}, expires_at_ms = {now} + ? WHERE id = ?";
// The expiry set by the claim stands (a record's TTL counts from its claim): leaving the
// indexed `expires_at_ms` alone lets PostgreSQL update the row in place (a HOT update).
const RECORD: &str = "UPDATE idem_ledger SET state = ?, response = ? WHERE id = ? AND owner = ?";

/// A duration in milliseconds for a statement that adds it to the database clock: saturated
/// far below `i64::MAX`, so `{now} + ?` cannot overflow.
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(i64::MAX / 4, |ms| ms.min(i64::MAX / 4))
}

pub(crate) fn render(template: &str, now: &str, backend: DbBackend) -> String {
    placeholders(backend, &template.replace("{now}", now))
}

/// Writes `?` placeholders the way `backend` wants them: PostgreSQL numbers them (`$1`,
/// `$2`, …), MySQL and SQLite keep `?`. For raw SQL that runs on every backend; the template
/// must not contain `?` anywhere but in placeholders.
pub fn placeholders(backend: DbBackend, template: &str) -> String {
    if backend != DbBackend::Postgres {
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

static POSTGRES: LazyLock<Dialect> = LazyLock::new(|| {
    let r = |t: &str| render(t, PG_NOW, DbBackend::Postgres);
    // One round trip answers a new key and a replay alike: the insert's row, or else the
    // committed row it ran into, read without a lock. A row committed while the insert waited
    // is not in the statement's snapshot: then no row, and the store reads it locked.
    let claim = r(&format!(
        "WITH claimed AS ({INSERT} ON CONFLICT (id) DO NOTHING {RETURNING_ROW}) \
        SELECT * FROM claimed UNION ALL \
        SELECT owner, fingerprint, state, response, expires_at_ms, {{now}} AS now_ms \
        FROM idem_ledger WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)"
    ));
    Dialect {
        backend: DbBackend::Postgres,
        now: PG_NOW,
        create: &[
            "CREATE TABLE IF NOT EXISTS idem_ledger (\
                id BYTEA NOT NULL PRIMARY KEY, \
                scope VARCHAR(255) NOT NULL, \
                principal VARCHAR(255) NOT NULL, \
                idem_key VARCHAR(255) NOT NULL, \
                owner BIGINT NOT NULL, \
                fingerprint BYTEA NOT NULL, \
                state SMALLINT NOT NULL, \
                response BYTEA NULL, \
                created_at_ms BIGINT NOT NULL, \
                expires_at_ms BIGINT NOT NULL) \
            WITH (fillfactor = 90)",
            "CREATE INDEX IF NOT EXISTS idem_ledger_expires ON idem_ledger (expires_at_ms)",
        ],
        claim_nowait: claim.clone(),
        claim,
        claim_locks_row: false,
        claim_by_read: false,
        // A lock wait longer than this is another transaction holding the key.
        before_nowait: Some("SET LOCAL lock_timeout = '50ms'"),
        read_locked: r(&format!("{READ} FOR UPDATE")),
        take_over: r(TAKE_OVER),
        record: r(RECORD),
        purge: Purge::ByIndex(r(
            "DELETE FROM idem_ledger WHERE id IN (SELECT id FROM idem_ledger \
            WHERE expires_at_ms <= {now} LIMIT ? FOR UPDATE SKIP LOCKED)",
        )),
        select_now: r("SELECT {now} AS now_ms"),
    }
});

static MYSQL: LazyLock<Dialect> = LazyLock::new(|| {
    let r = |t: &str| render(t, MYSQL_NOW, DbBackend::MySql);
    // MariaDB (10.5+) returns the row an upsert leaves: ours if inserted, else the existing
    // one, locked by the duplicate-key update and read as committed. One round trip decides.
    // (MySQL 8 has neither `RETURNING` nor `SET STATEMENT`: MariaDB is the supported server.)
    let claim = r(&format!(
        "{INSERT} ON DUPLICATE KEY UPDATE id = id {RETURNING_ROW}"
    ));
    Dialect {
        backend: DbBackend::MySql,
        now: MYSQL_NOW,
        create: &["CREATE TABLE IF NOT EXISTS idem_ledger (\
                id BINARY(32) NOT NULL PRIMARY KEY, \
                scope VARCHAR(255) NOT NULL, \
                principal VARCHAR(255) NOT NULL, \
                idem_key VARCHAR(255) NOT NULL, \
                owner BIGINT NOT NULL, \
                fingerprint BINARY(32) NOT NULL, \
                state SMALLINT NOT NULL, \
                response LONGBLOB NULL, \
                created_at_ms BIGINT NOT NULL, \
                expires_at_ms BIGINT NOT NULL, \
                INDEX idem_ledger_expires (expires_at_ms)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"],
        // MariaDB: a lock wait of 0 s fails at once with error 1205.
        claim_nowait: format!("SET STATEMENT innodb_lock_wait_timeout = 0 FOR {claim}"),
        claim,
        claim_locks_row: true,
        claim_by_read: false,
        before_nowait: None,
        read_locked: r(&format!("{READ} FOR UPDATE")),
        take_over: r(TAKE_OVER),
        record: r(RECORD),
        purge: Purge::ByIndex(r(
            "DELETE FROM idem_ledger WHERE expires_at_ms <= {now} LIMIT ?",
        )),
        select_now: r("SELECT {now} AS now_ms"),
    }
});

static SQLITE: LazyLock<Dialect> = LazyLock::new(|| {
    let r = |t: &str| render(t, SQLITE_NOW, DbBackend::Sqlite);
    // The write lock is taken by BEGIN IMMEDIATE, so reads need no FOR UPDATE (SQLite has
    // none) and a concurrent duplicate always waits in BEGIN.
    let claim = r(&format!(
        "{INSERT} ON CONFLICT (id) DO NOTHING {RETURNING_ROW}"
    ));
    Dialect {
        backend: DbBackend::Sqlite,
        now: SQLITE_NOW,
        create: &[
            "CREATE TABLE IF NOT EXISTS idem_ledger (\
                id BLOB NOT NULL PRIMARY KEY, \
                scope TEXT NOT NULL, \
                principal TEXT NOT NULL, \
                idem_key TEXT NOT NULL, \
                owner INTEGER NOT NULL, \
                fingerprint BLOB NOT NULL, \
                state INTEGER NOT NULL, \
                response BLOB NULL, \
                created_at_ms INTEGER NOT NULL, \
                expires_at_ms INTEGER NOT NULL\
            ) WITHOUT ROWID",
            // No expiry index: on SQLite every commit waits for its WAL frames to reach the
            // disk, and the index's page was a fifth of a first execution's frames (P4). The
            // purge sweeps the table in key order instead. Ledgers made by earlier versions
            // lose the index here.
            "DROP INDEX IF EXISTS idem_ledger_expires",
        ],
        claim_nowait: claim.clone(),
        claim,
        claim_locks_row: false,
        claim_by_read: true,
        before_nowait: None,
        read_locked: r(READ),
        take_over: r(TAKE_OVER),
        // Binds a whole row (`ledger_row`), then state and response.
        record: r("INSERT INTO idem_ledger \
            (id, scope, principal, idem_key, owner, fingerprint, expires_at_ms, state, response, created_at_ms) \
            VALUES (?, ?, ?, ?, ?, ?, {now} + ?, ?, ?, {now}) \
            ON CONFLICT (id) DO UPDATE SET scope = excluded.scope, principal = excluded.principal, \
            idem_key = excluded.idem_key, owner = excluded.owner, fingerprint = excluded.fingerprint, \
            state = excluded.state, response = excluded.response, \
            created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms"),
        purge: Purge::Sweep {
            bound: r("SELECT id FROM idem_ledger WHERE id > ? ORDER BY id LIMIT 1 OFFSET ?"),
            delete: r(
                "DELETE FROM idem_ledger WHERE id > ? AND id <= ? AND expires_at_ms <= {now}",
            ),
            delete_rest: r("DELETE FROM idem_ledger WHERE id > ? AND expires_at_ms <= {now}"),
        },
        select_now: r("SELECT {now} AS now_ms"),
    }
});

/// How a backend's purge finds expired records.
#[derive(Debug)]
pub(crate) enum Purge {
    /// By the expiry index. Binds batch size; deletes up to that many expired rows.
    ByIndex(String),
    /// The ledger has no expiry index: sweep the table in key order, a bounded range of keys
    /// per statement.
    Sweep {
        /// Binds a key and a count `n`: the key `n + 1` places after it (the range's last).
        bound: String,
        /// Binds the keys a range runs after and up to; deletes the expired rows in it.
        delete: String,
        /// Binds the key the last range runs after; deletes the expired rows after it.
        delete_rest: String,
    },
}

impl Dialect {
    /// The dialect of `backend`.
    pub(crate) fn of(backend: DbBackend) -> &'static Dialect {
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
    fn postgres_placeholders_are_numbered_in_order() {
        let d = Dialect::of(DbBackend::Postgres);
        assert!(d.claim.contains("VALUES ($1, $2, $3, $4, $5, $6, 0, NULL,"));
        assert!(
            d.claim
                .contains("+ $7) ON CONFLICT (id) DO NOTHING RETURNING owner,")
        );
        assert!(
            d.claim
                .ends_with("WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)")
        );
        assert!(d.record.contains("WHERE id = $3 AND owner = $4"));
        assert!(!d.read_locked.contains('?'));
    }

    #[test]
    fn every_statement_reads_the_database_clock() {
        for backend in [DbBackend::Postgres, DbBackend::MySql, DbBackend::Sqlite] {
            let d = Dialect::of(backend);
            let purge = match &d.purge {
                Purge::ByIndex(sql) => vec![sql],
                Purge::Sweep {
                    delete,
                    delete_rest,
                    ..
                } => vec![delete, delete_rest],
            };
            for sql in [&d.claim, &d.read_locked, &d.take_over]
                .into_iter()
                .chain(purge)
            {
                assert!(sql.contains(d.now), "{backend:?}: {sql}");
            }
        }
    }
}
