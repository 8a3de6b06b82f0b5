//! The ledger's statements, and the savepoint a claim takes in the ledger's transaction.

use sea_orm::DbBackend;

use super::render;

/// The ledger's statements on one backend.
#[derive(Debug)]
pub(crate) struct LedgerStatements {
    pub(crate) create: Vec<String>,
    /// Undoes `create` (a migration's `down`).
    #[cfg_attr(not(feature = "migration"), allow(dead_code))]
    pub(crate) drop: Vec<String>,
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
    /// Taken after the claim, so a final error can undo the handler's writes.
    pub(crate) savepoint: String,
    /// Undoes the handler's writes, keeping the claim.
    pub(crate) rollback_to_savepoint: String,
}

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

const INSERT: &str = "INSERT INTO {ledger} \
    (id, scope, principal, idem_key, owner, fingerprint, state, response, created_at_ms, expires_at_ms) \
    VALUES (?, ?, ?, ?, ?, ?, 0, NULL, {now}, {now} + ?)";
const READ: &str = "SELECT owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms \
    FROM {ledger} WHERE id = ?";
const RETURNING_ROW: &str =
    "RETURNING owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms";

pub(super) fn statements(backend: DbBackend) -> LedgerStatements {
    let r = |template: &str| render(backend, template);
    let claim = r(&match backend {
        // One round trip answers a new key and a replay alike: the insert's row, or else the
        // committed row it ran into, read without a lock. A row committed while the insert
        // waited is not in the statement's snapshot: then no row, and the store reads it
        // locked.
        DbBackend::Postgres => format!(
            "WITH claimed AS ({INSERT} ON CONFLICT (id) DO NOTHING {RETURNING_ROW}) \
            SELECT * FROM claimed UNION ALL \
            SELECT owner, fingerprint, state, response, expires_at_ms, {{now}} AS now_ms \
            FROM {{ledger}} WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)"
        ),
        // MariaDB (10.5+) returns the row an upsert leaves: ours if inserted, else the
        // existing one, locked by the duplicate-key update and read as committed. One round
        // trip decides. (MySQL 8 has neither `RETURNING` nor `SET STATEMENT`: MariaDB is the
        // supported server.)
        DbBackend::MySql => format!("{INSERT} ON DUPLICATE KEY UPDATE id = id {RETURNING_ROW}"),
        // The write lock is taken by BEGIN IMMEDIATE, so reads need no FOR UPDATE (SQLite has
        // none) and a concurrent duplicate always waits in BEGIN.
        _ => format!("{INSERT} ON CONFLICT (id) DO NOTHING {RETURNING_ROW}"),
    });
    let create: &[&str] = match backend {
        DbBackend::Postgres => &[
            "CREATE TABLE IF NOT EXISTS {ledger} (\
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
            "CREATE INDEX IF NOT EXISTS {ledger_expires} ON {ledger} (expires_at_ms)",
        ],
        DbBackend::MySql => &["CREATE TABLE IF NOT EXISTS {ledger} (\
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
                INDEX {ledger_expires} (expires_at_ms)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"],
        _ => &[
            "CREATE TABLE IF NOT EXISTS {ledger} (\
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
            "DROP INDEX IF EXISTS {ledger_expires}",
        ],
    };
    LedgerStatements {
        create: create.iter().map(|template| r(template)).collect(),
        drop: vec![r("DROP TABLE IF EXISTS {ledger}")],
        claim_nowait: match backend {
            // MariaDB: a lock wait of 0 s fails at once with error 1205.
            DbBackend::MySql => format!("SET STATEMENT innodb_lock_wait_timeout = 0 FOR {claim}"),
            _ => claim.clone(),
        },
        claim,
        claim_locks_row: backend == DbBackend::MySql,
        claim_by_read: backend == DbBackend::Sqlite,
        before_nowait: match backend {
            // A lock wait longer than this is another transaction holding the key.
            DbBackend::Postgres => Some("SET LOCAL lock_timeout = '50ms'"),
            _ => None,
        },
        read_locked: match backend {
            DbBackend::Sqlite => r(READ),
            _ => r(&format!("{READ} FOR UPDATE")),
        },
        take_over: r(
            "UPDATE {ledger} SET owner = ?, fingerprint = ?, state = 0, response = NULL, \
            created_at_ms = {now}, expires_at_ms = {now} + ? WHERE id = ?",
        ),
        record: match backend {
            // Binds a whole row (`ledger_row`), then state and response.
            DbBackend::Sqlite => r("INSERT INTO {ledger} \
                (id, scope, principal, idem_key, owner, fingerprint, expires_at_ms, state, response, created_at_ms) \
                VALUES (?, ?, ?, ?, ?, ?, {now} + ?, ?, ?, {now}) \
                ON CONFLICT (id) DO UPDATE SET scope = excluded.scope, principal = excluded.principal, \
                idem_key = excluded.idem_key, owner = excluded.owner, fingerprint = excluded.fingerprint, \
                state = excluded.state, response = excluded.response, \
                created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms"),
            // The expiry set by the claim stands (a record's TTL counts from its claim):
            // leaving the indexed `expires_at_ms` alone lets PostgreSQL update the row in
            // place (a HOT update).
            _ => r("UPDATE {ledger} SET state = ?, response = ? WHERE id = ? AND owner = ?"),
        },
        purge: match backend {
            DbBackend::Postgres => Purge::ByIndex(r(
                "DELETE FROM {ledger} WHERE id IN (SELECT id FROM {ledger} \
                WHERE expires_at_ms <= {now} LIMIT ? FOR UPDATE SKIP LOCKED)",
            )),
            DbBackend::MySql => Purge::ByIndex(r(
                "DELETE FROM {ledger} WHERE expires_at_ms <= {now} LIMIT ?",
            )),
            _ => Purge::Sweep {
                bound: r("SELECT id FROM {ledger} WHERE id > ? ORDER BY id LIMIT 1 OFFSET ?"),
                delete: r(
                    "DELETE FROM {ledger} WHERE id > ? AND id <= ? AND expires_at_ms <= {now}",
                ),
                delete_rest: r("DELETE FROM {ledger} WHERE id > ? AND expires_at_ms <= {now}"),
            },
        },
        select_now: r("SELECT {now} AS now_ms"),
        savepoint: r("SAVEPOINT {claim_savepoint}"),
        rollback_to_savepoint: r("ROLLBACK TO SAVEPOINT {claim_savepoint}"),
    }
}
