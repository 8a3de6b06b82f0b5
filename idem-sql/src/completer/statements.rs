//! The completer's statements: the calls table (resumable calls' stored arguments), and the
//! reads and fenced updates a completer runs on it and on the ledger. Only calls in progress
//! (and give-ups whose hook is owed) have a row: the table stays small, and its scans need no
//! index.

use crate::statement::render::{render, upsert};
use crate::{Bound, Column, Dialect, NewCall, Param, Tables, with_ids};

/// The completer's statements for one server flavour.
#[derive(Debug)]
pub struct Completer {
    dialect: Dialect,
    /// The calls table.
    pub tables: Tables,
    /// Binds record_id, scope, args, ttl_ms: a new execution's stored call.
    pub(crate) insert_call: String,
    /// Binds record_id.
    pub(crate) delete_call: String,
    /// `{ids}` is the list of scopes; `{limit}` the batch. Returns record_id, scope,
    /// principal, idem_key, args, attempts, last_error, gave_up, final_phase_done of due calls.
    pub(crate) due_calls: String,
    /// `{ids}` is the list of scopes. Returns milliseconds until the next call is due.
    pub(crate) next_due_in: String,
    /// `{ids}` is the list of scopes. Returns scope and count of calls due outside them.
    pub(crate) unregistered_calls: String,
    /// Binds backoff_ms, record_id, attempts.
    pub(crate) begin_attempt: String,
    /// Binds last_error, record_id.
    pub(crate) note_call_error: String,
    /// Binds response, record_id. The give-up, fenced: the lease must have ended, and the
    /// final phase not have committed (such a call is completed, never given up).
    pub(crate) give_up: String,
    /// Binds record_id. Run in a final phase's transaction.
    pub(crate) note_final_phase: String,
    /// Binds hook_retry_ms, record_id.
    pub(crate) owe_hook: String,
    /// Binds record_id.
    pub(crate) forget_given_up: String,
    /// Deletes the stored calls of records that no longer exist (purged).
    pub(crate) purge_orphaned_calls: String,
}

impl Completer {
    pub(crate) fn new(backend: Dialect) -> Self {
        let r = |template: &str| render(backend, template);
        Self {
            dialect: backend,
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
            AND (c.gave_up = 1 OR (l.state = {in_progress} AND l.expires_at_ms <= {now})) \
            AND c.scope IN ({ids}) ORDER BY c.next_attempt_at_ms LIMIT {limit}",
            ),
            next_due_in: r(
                "SELECT MIN(CASE WHEN c.gave_up = 0 AND l.expires_at_ms > c.next_attempt_at_ms \
            THEN l.expires_at_ms ELSE c.next_attempt_at_ms END) - {now} \
            FROM {calls} c JOIN {ledger} l ON l.id = c.record_id \
            WHERE (l.state = {in_progress} OR c.gave_up = 1) AND c.scope IN ({ids})",
            ),
            unregistered_calls: r("SELECT c.scope, COUNT(*) FROM {calls} c \
            JOIN {ledger} l ON l.id = c.record_id \
            WHERE l.state = {in_progress} AND l.expires_at_ms <= {now} AND c.scope NOT IN ({ids}) \
            GROUP BY c.scope"),
            begin_attempt: r("UPDATE {calls} SET attempts = attempts + 1, \
            next_attempt_at_ms = {now} + ? \
            WHERE record_id = ? AND attempts = ? AND next_attempt_at_ms <= {now}"),
            note_call_error: r("UPDATE {calls} SET last_error = ? WHERE record_id = ?"),
            // The next token fences out the last holder, as a takeover would.
            give_up: r(
                "UPDATE {ledger} SET state = {gave_up}, response = ?, owner = owner + 1, \
            expires_at_ms = {now} + (SELECT ttl_ms FROM {calls} WHERE record_id = {ledger}.id) \
            WHERE id = ? AND state = {in_progress} AND expires_at_ms <= {now} AND NOT EXISTS (\
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

impl Completer {
    /// `sql` with its `{ids}` list filled with `scopes`, bound after `before`.
    fn over_scopes(&self, sql: &str, before: Vec<Param>, scopes: &[&str]) -> Bound<'static> {
        let mut params = before;
        params.extend(scopes.iter().map(|&scope| scope.into()));
        Bound::owned(with_ids(self.dialect, sql, scopes.len()), params)
    }

    /// Stores a new execution's call (over an earlier one of the record).
    pub fn insert_call(&self, call: &NewCall) -> Bound<'_> {
        Bound::new(
            &self.insert_call,
            [
                call.id.as_slice().into(),
                call.scope.as_str().into(),
                call.args.as_slice().into(),
                call.ttl_ms.into(),
            ],
        )
    }

    /// Deletes record `id`'s stored call.
    pub fn delete_call(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.delete_call, [id.into()])
    }

    /// Up to `limit` calls of `scopes` due for an attempt, earliest first: returns record_id,
    /// scope, principal, idem_key, args, attempts, last_error, gave_up, final_phase_done.
    pub fn due_calls(&self, scopes: &[&str], limit: u32) -> Bound<'static> {
        let sql = self.due_calls.replace("{limit}", &limit.max(1).to_string());
        self.over_scopes(&sql, Vec::new(), scopes)
            .reads(crate::completer::STORED_CALL)
    }

    /// Milliseconds until the next call of `scopes` is due (NULL: none).
    pub fn next_due_in(&self, scopes: &[&str]) -> Bound<'static> {
        self.over_scopes(&self.next_due_in, Vec::new(), scopes)
            .reads(&[Column::I64])
    }

    /// Scope and count of due calls outside `scopes` (none given: every scope).
    pub fn unregistered_calls(&self, scopes: &[&str]) -> Bound<'static> {
        // `NOT IN ()` is not SQL: with no scopes, match none.
        let scopes = if scopes.is_empty() { &[""][..] } else { scopes };
        self.over_scopes(&self.unregistered_calls, Vec::new(), scopes)
            .reads(&[Column::Text, Column::I64])
    }

    /// Claims the next attempt at record `id`'s call, if its count is still `attempts` and
    /// it is due; the attempt after it is due `backoff_ms` from now.
    pub fn begin_attempt(&self, id: &[u8], attempts: i32, backoff_ms: i64) -> Bound<'_> {
        Bound::new(
            &self.begin_attempt,
            [backoff_ms.into(), id.into(), attempts.into()],
        )
    }

    /// Keeps the last attempt's error of record `id`'s call.
    pub fn note_call_error(&self, id: &[u8], error: String) -> Bound<'_> {
        Bound::new(&self.note_call_error, [error.into(), id.into()])
    }

    /// Gives record `id`'s call up with `response`, fenced: the lease must have ended, and
    /// the final phase not have committed (such a call is completed, never given up).
    pub fn give_up(&self, id: &[u8], response: Vec<u8>) -> Bound<'_> {
        Bound::new(&self.give_up, [response.into(), id.into()])
    }

    /// Notes that record `id`'s final phase committed (in the final phase's transaction).
    pub fn note_final_phase(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.note_final_phase, [id.into()])
    }

    /// Marks record `id`'s give-up hook owed, retried `hook_retry_ms` from now.
    pub fn owe_hook(&self, id: &[u8], hook_retry_ms: i64) -> Bound<'_> {
        Bound::new(&self.owe_hook, [hook_retry_ms.into(), id.into()])
    }

    /// Deletes record `id`'s stored call once given up (its hook ran).
    pub fn forget_given_up(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.forget_given_up, [id.into()])
    }

    /// Deletes the stored calls of records that no longer exist (purged).
    pub fn purge_orphaned_calls(&self) -> Bound<'_> {
        Bound::unbound(&self.purge_orphaned_calls)
    }
}
