//! The inspection's statements (read only): a record, its steps and call, ids by range, a
//! scope's recent records, and which of idem's tables exist.

use crate::statement::render::render;
use crate::{Bound, Column, Dialect};

/// The inspection's statements for one server flavour.
#[derive(Debug)]
pub struct Inspect {
    /// Returns the names of those of idem's tables ([`ALL_TABLES`]) the connection sees, as
    /// its own statements would resolve them.
    pub(crate) existing_tables: String,
    /// Binds id. Returns id, scope, principal, idem_key, owner, fingerprint, state,
    /// response, created_at_ms, expires_at_ms, now_ms.
    pub(crate) inspect_record: String,
    /// Binds record_id. Returns name, token, result, created_at_ms, oldest first.
    pub(crate) inspect_steps: String,
    /// Binds record_id. Returns attempts, last_error, gave_up, next_attempt_at_ms, args,
    /// created_at_ms.
    pub(crate) inspect_call: String,
    /// Binds the lowest and the highest id a prefix covers, and a limit. Returns the ids in
    /// that range, in order (a range of the primary key: no scan).
    pub(crate) ids_in_range: String,
    /// Binds scope, since_ms, state (-1: any), state, limit. Returns what `inspect_record`
    /// returns for the scope's records claimed in the last since_ms, newest first. No index
    /// leads with the scope: the statement reads the whole ledger (an operator's look, not
    /// a service's query).
    pub(crate) list_records: String,
}

impl Inspect {
    pub(crate) fn new(backend: Dialect) -> Self {
        use Dialect::{MySql, Postgres};
        let r = |template: &str| render(backend, template);
        Self {
            existing_tables: r(match backend {
                // `to_regclass` resolves a name through the search path, as every statement
                // of the crate does: a table in another schema does not count.
                Postgres => {
                    "SELECT name FROM (VALUES {table_rows}) AS idem_tables (name) \
                WHERE to_regclass(name) IS NOT NULL"
                }
                MySql => {
                    "SELECT table_name FROM information_schema.tables \
                WHERE table_schema = DATABASE() AND table_name IN ({table_names})"
                }
                _ => {
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({table_names})"
                }
            }),
            inspect_record: r(
                "SELECT id, scope, principal, idem_key, owner, fingerprint, state, response, \
            created_at_ms, expires_at_ms, {now} AS now_ms FROM {ledger} WHERE id = ?",
            ),
            inspect_steps: r("SELECT name, token, result, created_at_ms FROM {steps} \
            WHERE record_id = ? ORDER BY created_at_ms, name"),
            inspect_call: r(
                "SELECT attempts, last_error, gave_up, next_attempt_at_ms, args, created_at_ms \
            FROM {calls} WHERE record_id = ?",
            ),
            ids_in_range: r(
                "SELECT id FROM {ledger} WHERE id >= ? AND id <= ? ORDER BY id LIMIT ?",
            ),
            list_records: r(
                "SELECT id, scope, principal, idem_key, owner, fingerprint, state, response, \
            created_at_ms, expires_at_ms, {now} AS now_ms FROM {ledger} \
            WHERE scope = ? AND created_at_ms >= {now} - ? AND (? = -1 OR state = ?) \
            ORDER BY created_at_ms DESC LIMIT ?",
            ),
        }
    }
}

impl Inspect {
    /// The columns of [`Inspect::record`] and [`Inspect::list_records`], in order: id, scope,
    /// principal, idem_key, owner, fingerprint, state, response, created_at_ms,
    /// expires_at_ms, now_ms.
    pub const RECORD: &'static [Column] = &[
        Column::Bytes,
        Column::Text,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::Bytes,
        Column::I16,
        Column::Bytes,
        Column::I64,
        Column::I64,
        Column::I64,
    ];

    /// The columns of [`Inspect::steps`], in order: name, token, result, created_at_ms.
    pub const STEP: &'static [Column] = &[Column::Text, Column::I64, Column::Bytes, Column::I64];

    /// The columns of [`Inspect::call`], in order: attempts, last_error, gave_up,
    /// next_attempt_at_ms, args, created_at_ms.
    pub const CALL: &'static [Column] = &[
        Column::I32,
        Column::Text,
        Column::I16,
        Column::I64,
        Column::Bytes,
        Column::I64,
    ];

    /// The names of those of idem's tables the connection sees, as its own statements would
    /// resolve them.
    pub fn existing_tables(&self) -> Bound<'_> {
        Bound::unbound(&self.existing_tables).reads(&[Column::Text])
    }

    /// Record `id`: returns id, scope, principal, idem_key, owner, fingerprint, state,
    /// response, created_at_ms, expires_at_ms, now_ms.
    pub fn record(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.inspect_record, [id.into()]).reads(Self::RECORD)
    }

    /// Record `id`'s steps, oldest first: returns name, token, result, created_at_ms.
    pub fn steps(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.inspect_steps, [id.into()]).reads(Self::STEP)
    }

    /// Record `id`'s stored call: returns attempts, last_error, gave_up, next_attempt_at_ms,
    /// args, created_at_ms.
    pub fn call(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.inspect_call, [id.into()]).reads(Self::CALL)
    }

    /// Up to `limit` ids from `low` to `high`, in order (a range of the primary key: no scan).
    pub fn ids_in_range(&self, low: &[u8], high: &[u8], limit: i64) -> Bound<'_> {
        Bound::new(&self.ids_in_range, [low.into(), high.into(), limit.into()])
            .reads(&[Column::Bytes])
    }

    /// Up to `limit` records of `scope` claimed in the last `since_ms`, of state `state`
    /// (`None`: any), newest first: returns what [`Inspect::record`] returns. No index leads
    /// with the scope: the statement reads the whole ledger (an operator's look, not a
    /// service's query).
    pub fn list_records(
        &self,
        scope: &str,
        since_ms: i64,
        state: Option<i16>,
        limit: i64,
    ) -> Bound<'_> {
        let state = state.unwrap_or(-1);
        Bound::new(
            &self.list_records,
            [
                scope.into(),
                since_ms.into(),
                state.into(),
                state.into(),
                limit.into(),
            ],
        )
        .reads(Self::RECORD)
    }
}
