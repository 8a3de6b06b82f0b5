//! Resumable calls and their completers. Only calls in progress (and give-ups whose hook is
//! owed) have a row: the table stays small, and its scans need no index.

use crate::render::{render, upsert};
use crate::{Dialect, Tables};

/// The completer's statements for one server flavour.
#[derive(Debug)]
pub struct Completer {
    /// The calls table.
    pub tables: Tables,
    /// Binds record_id, scope, args, ttl_ms: a new execution's stored call.
    pub insert_call: String,
    /// Binds record_id.
    pub delete_call: String,
    /// `{ids}` is the list of scopes; `{limit}` the batch. Returns record_id, scope,
    /// principal, idem_key, args, attempts, last_error, gave_up, final_phase_done of due calls.
    pub due_calls: String,
    /// `{ids}` is the list of scopes. Returns milliseconds until the next call is due.
    pub next_due_in: String,
    /// `{ids}` is the list of scopes. Returns scope and count of calls due outside them.
    pub unregistered_calls: String,
    /// Binds backoff_ms, record_id, attempts.
    pub begin_attempt: String,
    /// Binds last_error, record_id.
    pub note_call_error: String,
    /// Binds response, record_id. The give-up, fenced: the lease must have ended, and the
    /// final phase not have committed (such a call is completed, never given up).
    pub give_up: String,
    /// Binds record_id. Run in a final phase's transaction.
    pub note_final_phase: String,
    /// Binds hook_retry_ms, record_id.
    pub owe_hook: String,
    /// Binds record_id.
    pub forget_given_up: String,
    /// Deletes the stored calls of records that no longer exist (purged).
    pub purge_orphaned_calls: String,
}

impl Completer {
    pub(crate) fn new(backend: Dialect) -> Self {
        let r = |template: &str| render(backend, template);
        Self {
            // Only calls in progress (and give-ups whose hook is owed) have a row: the table
            // stays small, and its scans need no index.
            tables: Tables {
                create: vec![r("CREATE TABLE IF NOT EXISTS {calls} (\
                record_id {hash} NOT NULL PRIMARY KEY, scope {string} NOT NULL, \
                args {blob} NOT NULL, ttl_ms {i64} NOT NULL, attempts {i32} NOT NULL, \
                next_attempt_at_ms {i64} NOT NULL, last_error TEXT NULL, \
                gave_up {i16} NOT NULL, final_phase_done {i16} NOT NULL, \
                created_at_ms {i64} NOT NULL){clustered}")],
                drop: vec![r("DROP TABLE IF EXISTS {calls}")],
            },
            insert_call: r(&upsert(
                backend,
                "INSERT INTO {calls} (record_id, scope, args, ttl_ms, attempts, \
            next_attempt_at_ms, last_error, gave_up, final_phase_done, created_at_ms) \
            VALUES (?, ?, ?, ?, 0, 0, NULL, 0, 0, {now})",
                "record_id",
                &[
                    "scope",
                    "args",
                    "ttl_ms",
                    "attempts",
                    "next_attempt_at_ms",
                    "last_error",
                    "gave_up",
                    "final_phase_done",
                    "created_at_ms",
                ],
            )),
            delete_call: r("DELETE FROM {calls} WHERE record_id = ?"),
            due_calls: r(
                "SELECT c.record_id, c.scope, l.principal, l.idem_key, c.args, \
            c.attempts, c.last_error, c.gave_up, c.final_phase_done \
            FROM {calls} c JOIN {ledger} l ON l.id = c.record_id \
            WHERE c.next_attempt_at_ms <= {now} \
            AND (c.gave_up = 1 OR (l.state = 0 AND l.expires_at_ms <= {now})) \
            AND c.scope IN ({ids}) ORDER BY c.next_attempt_at_ms LIMIT {limit}",
            ),
            next_due_in: r(
                "SELECT MIN(CASE WHEN c.gave_up = 0 AND l.expires_at_ms > c.next_attempt_at_ms \
            THEN l.expires_at_ms ELSE c.next_attempt_at_ms END) - {now} \
            FROM {calls} c JOIN {ledger} l ON l.id = c.record_id \
            WHERE (l.state = 0 OR c.gave_up = 1) AND c.scope IN ({ids})",
            ),
            unregistered_calls: r("SELECT c.scope, COUNT(*) FROM {calls} c \
            JOIN {ledger} l ON l.id = c.record_id \
            WHERE l.state = 0 AND l.expires_at_ms <= {now} AND c.scope NOT IN ({ids}) \
            GROUP BY c.scope"),
            begin_attempt: r("UPDATE {calls} SET attempts = attempts + 1, \
            next_attempt_at_ms = {now} + ? \
            WHERE record_id = ? AND attempts = ? AND next_attempt_at_ms <= {now}"),
            note_call_error: r("UPDATE {calls} SET last_error = ? WHERE record_id = ?"),
            // The next token fences out the last holder, as a takeover would.
            give_up: r(
                "UPDATE {ledger} SET state = {gave_up}, response = ?, owner = owner + 1, \
            expires_at_ms = {now} + (SELECT ttl_ms FROM {calls} WHERE record_id = {ledger}.id) \
            WHERE id = ? AND state = 0 AND expires_at_ms <= {now} AND NOT EXISTS (\
            SELECT 1 FROM {calls} WHERE record_id = {ledger}.id AND final_phase_done = 1)",
            ),
            note_final_phase: r("UPDATE {calls} SET final_phase_done = 1 WHERE record_id = ?"),
            owe_hook: r(
                "UPDATE {calls} SET gave_up = 1, next_attempt_at_ms = {now} + ? \
            WHERE record_id = ?",
            ),
            forget_given_up: r("DELETE FROM {calls} WHERE record_id = ? AND gave_up = 1"),
            purge_orphaned_calls: r(
                "DELETE FROM {calls} WHERE record_id NOT IN (SELECT id FROM {ledger})",
            ),
        }
    }
}
