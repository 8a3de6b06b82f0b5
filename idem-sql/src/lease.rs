//! Lease mode: the steps table, and the fenced updates of a held ledger row (the claim
//! reuses the ledger's own statements).

use crate::render::{render, upsert};
use crate::{Dialect, Tables};

/// Lease mode's statements for one server flavour.
#[derive(Debug)]
pub struct Lease {
    /// The steps table.
    pub tables: Tables,
    /// Binds record_id.
    pub select_steps: String,
    /// Binds record_id, name, token, result.
    pub insert_step: String,
    /// Binds record_id.
    pub delete_steps: String,
    /// MySQL: binds record_id, then `{ids}` is the list of step names: deletes by primary key,
    /// so completion takes no gap lock (a range delete's next-key lock would meet another
    /// call's step insert, on Galera another node's, and abort one of them). Elsewhere `None`:
    /// `delete_steps` takes no gap locks.
    pub delete_steps_by_key: Option<String>,
    /// Binds lease_ms, id, token.
    pub renew_lease: String,
    /// Binds state, response, ttl_ms, id, token.
    pub complete_lease: String,
    /// Binds id, token.
    pub release_lease: String,
    /// Binds id. An operator ends a live lease by hand, fenced: the next token (as a
    /// takeover's) refuses the holder's later writes, and the lease ends now.
    pub release_by_hand: String,
    /// Binds limit. Returns id, scope, idem_key, owner, expires_at_ms, now_ms of leases that
    /// ended.
    pub expired_leases: String,
    /// Binds held_ms, limit. Returns id, scope, idem_key, owner, created_at_ms, expires_at_ms,
    /// now_ms, attempts (NULL unless resumable) of live leases held longer than held_ms.
    pub stuck_leases: String,
    /// Deletes the steps of records that no longer exist (purged).
    pub purge_orphaned_steps: String,
}

impl Lease {
    pub(crate) fn new(backend: Dialect) -> Self {
        let r = |template: &str| render(backend, template);
        Self {
            tables: Tables {
                create: vec![r("CREATE TABLE IF NOT EXISTS {steps} (\
                record_id {hash} NOT NULL, name {string} NOT NULL, token {i64} NOT NULL, \
                result {blob} NOT NULL, created_at_ms {i64} NOT NULL, \
                PRIMARY KEY (record_id, name)){clustered}")],
                drop: vec![r("DROP TABLE IF EXISTS {steps}")],
            },
            select_steps: r("SELECT name, result FROM {steps} WHERE record_id = ?"),
            insert_step: r(&upsert(
                backend,
                "INSERT INTO {steps} (record_id, name, token, result, created_at_ms) \
            VALUES (?, ?, ?, ?, {now})",
                "record_id, name",
                &["token", "result"],
            )),
            delete_steps: r("DELETE FROM {steps} WHERE record_id = ?"),
            delete_steps_by_key: (backend == Dialect::MySql)
                .then(|| r("DELETE FROM {steps} WHERE record_id = ? AND name IN ({ids})")),
            renew_lease: r("UPDATE {ledger} SET expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0"),
            complete_lease: r(
                "UPDATE {ledger} SET state = ?, response = ?, expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0",
            ),
            release_lease: r("UPDATE {ledger} SET expires_at_ms = {now} \
            WHERE id = ? AND owner = ? AND state = 0"),
            release_by_hand: r(
                "UPDATE {ledger} SET owner = owner + 1, expires_at_ms = {now} \
            WHERE id = ? AND state = 0 AND expires_at_ms > {now}",
            ),
            stuck_leases: r(
                "SELECT l.id, l.scope, l.idem_key, l.owner, l.created_at_ms, l.expires_at_ms, \
            {now} AS now_ms, c.attempts FROM {ledger} l \
            LEFT JOIN {calls} c ON c.record_id = l.id \
            WHERE l.state = 0 AND l.expires_at_ms > {now} AND l.created_at_ms <= {now} - ? \
            ORDER BY l.created_at_ms LIMIT ?",
            ),
            expired_leases: r(
                "SELECT l.id, l.scope, l.idem_key, l.owner, l.expires_at_ms, {now} AS now_ms, \
            c.attempts FROM {ledger} l LEFT JOIN {calls} c ON c.record_id = l.id \
            WHERE l.state = 0 AND l.expires_at_ms <= {now} ORDER BY l.expires_at_ms LIMIT ?",
            ),
            purge_orphaned_steps: r(
                "DELETE FROM {steps} WHERE record_id NOT IN (SELECT id FROM {ledger})",
            ),
        }
    }
}
