//! The statements of lease mode: the steps table, and the fenced updates of a held ledger row
//! (the claim reuses the ledger's own statements).

use sea_orm::DbBackend;

use super::render;

/// The lease statements of one backend.
#[derive(Debug)]
pub(crate) struct LeaseStatements {
    pub(crate) create: Vec<String>,
    /// Undoes `create` (a migration's `down`).
    #[cfg_attr(not(feature = "migration"), allow(dead_code))]
    pub(crate) drop: Vec<String>,
    /// Binds record_id.
    pub(crate) select_steps: String,
    /// Binds record_id, name, token, result.
    pub(crate) insert_step: String,
    /// Binds record_id.
    pub(crate) delete_steps: String,
    /// Binds lease_ms, id, token.
    pub(crate) renew: String,
    /// Binds state, response, ttl_ms, id, token.
    pub(crate) complete: String,
    /// Binds id, token.
    pub(crate) release: String,
    /// Returns id, scope, idem_key, owner, expires_at_ms, now_ms of leases that ended.
    pub(crate) expired: String,
    /// Deletes the steps of records that no longer exist (purged).
    pub(crate) purge_orphans: String,
}

pub(super) fn statements(backend: DbBackend) -> LeaseStatements {
    let r = |template: &str| render(backend, template);
    let create = match backend {
        DbBackend::Postgres => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BYTEA NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, \
            result BYTEA NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name))"
        }
        DbBackend::MySql => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BINARY(32) NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, \
            result LONGBLOB NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        }
        _ => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BLOB NOT NULL, name TEXT NOT NULL, token INTEGER NOT NULL, \
            result BLOB NOT NULL, created_at_ms INTEGER NOT NULL, PRIMARY KEY (record_id, name)\
            ) WITHOUT ROWID"
        }
    };
    let insert = "INSERT INTO {steps} (record_id, name, token, result, created_at_ms) \
        VALUES (?, ?, ?, ?, {now})";
    let insert_step = match backend {
        DbBackend::MySql => format!(
            "{insert} ON DUPLICATE KEY UPDATE token = VALUES(token), result = VALUES(result)"
        ),
        _ => format!(
            "{insert} ON CONFLICT (record_id, name) DO UPDATE SET token = excluded.token, result = excluded.result"
        ),
    };
    LeaseStatements {
        create: vec![r(create)],
        drop: vec![r("DROP TABLE IF EXISTS {steps}")],
        select_steps: r("SELECT name, result FROM {steps} WHERE record_id = ?"),
        insert_step: r(&insert_step),
        delete_steps: r("DELETE FROM {steps} WHERE record_id = ?"),
        renew: r("UPDATE {ledger} SET expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0"),
        complete: r(
            "UPDATE {ledger} SET state = ?, response = ?, expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0",
        ),
        release: r("UPDATE {ledger} SET expires_at_ms = {now} \
            WHERE id = ? AND owner = ? AND state = 0"),
        expired: r(
            "SELECT id, scope, idem_key, owner, expires_at_ms, {now} AS now_ms FROM {ledger} \
            WHERE state = 0 AND expires_at_ms <= {now} ORDER BY expires_at_ms LIMIT ?",
        ),
        purge_orphans: r("DELETE FROM {steps} WHERE record_id NOT IN (SELECT id FROM {ledger})"),
    }
}
