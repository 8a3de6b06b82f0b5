//! The ledger: one row per key, claimed, taken over, recorded, purged.

mod expiry;
mod row;

pub use expiry::{ExpiredPurge, database_now_ms, purge_expired};
pub use row::ClaimRow;

use idem_core::Request;

use crate::statement::render::{render, upsert};
use crate::{Bound, Column, Dialect, Param, Tables, millis};

/// The ledger's statements for one server flavour.
#[derive(Debug)]
pub struct Ledger {
    /// The ledger table and its expiry index.
    pub tables: Tables,
    /// Binds id, scope, principal, key, owner, fingerprint, ttl_ms. Returns owner,
    /// fingerprint, state, response, expires_at_ms, now_ms of the inserted row or of the row
    /// it ran into: locked and current on MariaDB, as the statement's snapshot saw it on
    /// PostgreSQL (SQLite claims by a read instead; its `claim` serves leases).
    pub(crate) claim: String,
    /// Whether the row `claim` returns is locked and current, so it decides without a
    /// second read.
    pub claim_locks_row: bool,
    /// Whether the atomic claim only reads (the transaction already holds the database's
    /// write lock: SQLite) and `record` writes the whole row (binds the row's values, then
    /// state and response).
    pub claim_by_read: bool,
    /// Same as `claim`, failing at once if another transaction holds the key.
    pub(crate) claim_nowait: String,
    /// Run after `claim_nowait` (whatever it answered) where `before_nowait` changed the
    /// session.
    pub after_nowait: Option<&'static str>,
    /// Run before `claim_nowait` where the backend needs a separate statement.
    pub before_nowait: Option<&'static str>,
    /// Whether a lease claim is first tried as `claim` alone, outside a transaction. Not on
    /// the MySQL 8 family (its upsert returns no row), nor on a Galera node: a node re-runs
    /// an autocommit statement that failed certification after it returned its rows, so
    /// the caller could read a row it did not end up inserting (seen in `tests/galera.rs`).
    pub claim_at_once: bool,
    /// Binds id; returns owner, fingerprint, state, response, expires_at_ms, now_ms.
    pub(crate) read_locked: String,
    /// `read_locked` without the lock: a committed row, for answers a later commit cannot
    /// change (a completed record, a live lease).
    pub(crate) read_row: String,
    /// Binds owner, fingerprint, ttl_ms, id.
    pub(crate) take_over: String,
    /// Binds state, response, id, owner (with `claim_by_read`: see there).
    pub(crate) record: String,
    /// `record` failing rather than change no row (PostgreSQL), so that a `COMMIT` sent
    /// behind it in the same flight rolls a lost claim back; binds as `record`.
    pub(crate) record_or_fail: Option<String>,
    /// How expired records are found and deleted.
    pub(crate) purge: Purge,
    /// `purge` for a schema without the calls table.
    pub(crate) purge_without_calls: Purge,
    /// Selects the database clock.
    pub(crate) select_now: String,
    /// Taken after the claim, so that a final error can undo the handler's writes.
    pub(crate) savepoint: String,
    /// Undoes the handler's writes, keeping the claim.
    pub(crate) rollback_to_savepoint: String,
    /// Binds scope, state, the last id read (empty bytes first), limit. Returns id, response
    /// of the scope's live records of that state after that id, in id order: the pages the
    /// pre-deploy check (`check_answers`) reads.
    pub(crate) live_answers: String,
}

impl Ledger {
    pub(crate) fn new(backend: Dialect, mariadb: bool) -> Self {
        use Dialect::{MySql, Postgres, Sqlite};
        let r = |template: &str| render(backend, template);
        let mysql8 = backend == MySql && !mariadb;
        let claim = r(match backend {
            // One round trip answers a new key and a replay alike: the insert's row, or else
            // the committed row it ran into, read without a lock. A row committed while the
            // insert waited is not in the statement's snapshot: then no row, and the store
            // reads it locked.
            Postgres => {
                "WITH claimed AS ({insert_claim} ON CONFLICT (id) DO NOTHING {returning_row}) \
            SELECT * FROM claimed UNION ALL \
            SELECT owner, fingerprint, state, response, expires_at_ms, {now} AS now_ms \
            FROM {ledger} WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)"
            }
            // MySQL 8, Aurora MySQL, TiDB, Vitess: no `RETURNING`. The upsert returns no row,
            // so the store reads the key locked: two round trips.
            MySql if mysql8 => "{insert_claim} ON DUPLICATE KEY UPDATE id = id",
            // MariaDB (10.5+) returns the row an upsert leaves: ours if inserted, else the
            // existing one, locked by the duplicate-key update and read as committed. One round
            // trip decides.
            MySql => "{insert_claim} ON DUPLICATE KEY UPDATE id = id {returning_row}",
            // The write lock is taken by BEGIN IMMEDIATE, so reads need no FOR UPDATE (SQLite
            // has none) and a concurrent duplicate always waits in BEGIN.
            _ => "{insert_claim} ON CONFLICT (id) DO NOTHING {returning_row}",
        });
        Self {
            tables: Tables {
                create: match backend {
                    Postgres => vec![
                        r("CREATE TABLE IF NOT EXISTS {ledger} ({ledger_columns}) \
                    WITH (fillfactor = 90)"),
                        r(
                            "CREATE INDEX IF NOT EXISTS {ledger_expires} ON {ledger} (expires_at_ms)",
                        ),
                    ],
                    MySql => vec![r("CREATE TABLE IF NOT EXISTS {ledger} \
                    ({ledger_columns}, INDEX {ledger_expires} (expires_at_ms)){clustered}")],
                    _ => vec![
                        r("CREATE TABLE IF NOT EXISTS {ledger} ({ledger_columns}){clustered}"),
                        // No expiry index: on SQLite every commit waits for its WAL frames to
                        // reach the disk, and the index's page was a fifth of a first
                        // execution's frames (P4). The purge sweeps the table in key order
                        // instead. Ledgers made by earlier versions lose the index here.
                        r("DROP INDEX IF EXISTS {ledger_expires}"),
                    ],
                },
                drop: vec![r("DROP TABLE IF EXISTS {ledger}")],
            },
            claim_nowait: match backend {
                // MariaDB: a lock wait of 0 s fails at once with error 1205.
                MySql if !mysql8 => {
                    format!("SET STATEMENT innodb_lock_wait_timeout = 0 FOR {claim}")
                }
                _ => claim.clone(),
            },
            claim,
            claim_locks_row: backend == MySql && !mysql8,
            claim_by_read: backend == Sqlite,
            before_nowait: match backend {
                // A lock wait longer than this is another transaction holding the key.
                Postgres => Some("SET LOCAL lock_timeout = '50ms'"),
                // The MySQL 8 family has no per-statement setting (`SET_VAR` is not in
                // MariaDB, where this path is tested) and no wait below 1 s: a rejected
                // duplicate is told within a second.
                MySql if mysql8 => Some("SET SESSION innodb_lock_wait_timeout = 1"),
                _ => None,
            },
            after_nowait: mysql8.then_some("SET SESSION innodb_lock_wait_timeout = DEFAULT"),
            claim_at_once: !mysql8,
            read_locked: match backend {
                Sqlite => r("{read_row}"),
                _ => r("{read_row} FOR UPDATE"),
            },
            read_row: r("{read_row}"),
            take_over: r(
                "UPDATE {ledger} SET owner = ?, fingerprint = ?, state = {in_progress}, response = NULL, \
            created_at_ms = {now}, expires_at_ms = {now} + ? WHERE id = ?",
            ),
            record: match backend {
                // Binds a whole row (`ledger_row`), then state and response.
                Sqlite => r(&upsert(
                    backend,
                    "INSERT INTO {ledger} (id, scope, principal, idem_key, owner, fingerprint, \
                expires_at_ms, state, response, created_at_ms) \
                VALUES (?, ?, ?, ?, ?, ?, {now} + ?, ?, ?, {now})",
                    "id",
                    &[
                        "scope",
                        "principal",
                        "idem_key",
                        "owner",
                        "fingerprint",
                        "state",
                        "response",
                        "created_at_ms",
                        "expires_at_ms",
                    ],
                )),
                // The expiry set by the claim stands (a record's TTL counts from its claim):
                // leaving the indexed `expires_at_ms` alone lets PostgreSQL update the row in
                // place (a HOT update).
                _ => r("UPDATE {ledger} SET state = ?, response = ? WHERE id = ? AND owner = ?"),
            },
            // The cast of the text fails at run time (the `CASE` reads an aggregate, so it is
            // not folded at plan time), and its error says why.
            record_or_fail: (backend == Postgres).then(|| {
                r(
                    "WITH recorded AS (UPDATE {ledger} SET state = ?, response = ? \
                WHERE id = ? AND owner = ? RETURNING 1) \
                SELECT CAST(CASE WHEN count(*) = 1 THEN '1' \
                ELSE 'the claim was lost before its result was recorded' END AS INTEGER) \
                FROM recorded",
                )
            }),
            purge: purge(backend, "{purgeable}"),
            purge_without_calls: purge(backend, "{purgeable_without_calls}"),
            select_now: r("SELECT {now} AS now_ms"),
            savepoint: r("SAVEPOINT {claim_savepoint}"),
            rollback_to_savepoint: r("ROLLBACK TO SAVEPOINT {claim_savepoint}"),
            live_answers: r(
                "SELECT id, response FROM {ledger} WHERE scope = ? AND state = ? \
            AND expires_at_ms > {now} AND id > ? ORDER BY id LIMIT ?",
            ),
        }
    }

    /// MariaDB's statements for a node of a Galera cluster: those that decide a claim (what
    /// it inserts or reads locked) first wait until the node has applied every write the
    /// cluster committed before them (`wsrep_sync_wait` 7: reads, updates and inserts), so a
    /// duplicate sent to another node finds the first call's record or lease.
    pub(crate) fn galera(mut self) -> Self {
        const WAIT: &str = crate::statement::flavour::GALERA_SYNC_WAIT;
        self.claim = format!("SET STATEMENT {WAIT} FOR {}", self.claim);
        self.claim_nowait = self.claim_nowait.replacen(
            "SET STATEMENT innodb_lock_wait_timeout = 0 FOR",
            &format!("SET STATEMENT innodb_lock_wait_timeout = 0, {WAIT} FOR"),
            1,
        );
        self.read_locked = format!("SET STATEMENT {WAIT} FOR {}", self.read_locked);
        self.read_row = format!("SET STATEMENT {WAIT} FOR {}", self.read_row);
        self.claim_at_once = false;
        self
    }
}

/// The purge of `backend`, deleting the records `purgeable` (a fragment) admits.
fn purge(backend: Dialect, purgeable: &str) -> Purge {
    let r = |template: &str| render(backend, &template.replace("{purgeable}", purgeable));
    match backend {
        // A row locked by a claim is skipped; one that a takeover made current again while it
        // waited is re-checked under its lock and kept. The clock is read once, by the
        // sub-select, so that the expiry index can bound the scan (a volatile
        // `clock_timestamp()` cannot be an index condition, and the planner, whose estimate
        // for it is a third of the ledger, read the whole table on every purge: 365 ms a
        // statement at 300 k rows in R22's soak); the order keeps the index preferred.
        Dialect::Postgres => Purge::ByIndex(PurgeByIndex {
            delete: r("DELETE FROM {ledger} WHERE id IN (SELECT id FROM {ledger} \
                WHERE {ledger}.expires_at_ms <= (SELECT {now}) AND {purgeable} \
                ORDER BY {ledger}.expires_at_ms LIMIT ? FOR UPDATE SKIP LOCKED)"),
        }),
        Dialect::MySql => Purge::ByIndex(PurgeByIndex {
            delete: r("DELETE FROM {ledger} WHERE {purgeable} LIMIT ?"),
        }),
        Dialect::Sqlite => Purge::Sweep(PurgeSweep {
            bound: r("SELECT id FROM {ledger} WHERE id > ? ORDER BY id LIMIT 1 OFFSET ?"),
            delete: r("DELETE FROM {ledger} WHERE id > ? AND id <= ? AND {purgeable}"),
            delete_rest: r("DELETE FROM {ledger} WHERE id > ? AND {purgeable}"),
        }),
    }
}

/// How a backend's purge finds expired records.
#[derive(Debug)]
pub enum Purge {
    /// By the expiry index.
    ByIndex(PurgeByIndex),
    /// The ledger has no expiry index: sweep the table in key order, a bounded range of keys
    /// per statement.
    Sweep(PurgeSweep),
}

/// The purge by the expiry index.
#[derive(Debug)]
pub struct PurgeByIndex {
    pub(crate) delete: String,
}

impl PurgeByIndex {
    /// Deletes up to `batch` purgeable records.
    pub fn delete(&self, batch: i64) -> Bound<'_> {
        Bound::new(&self.delete, [batch.into()])
    }
}

/// The purge that sweeps the ledger in key order.
#[derive(Debug)]
pub struct PurgeSweep {
    pub(crate) bound: String,
    pub(crate) delete: String,
    pub(crate) delete_rest: String,
}

impl PurgeSweep {
    /// Returns the key `n + 1` places after key `after` (a range's last), if any.
    pub fn bound(&self, after: &[u8], n: i64) -> Bound<'_> {
        Bound::new(&self.bound, [after.into(), n.into()]).reads(&[Column::Bytes])
    }

    /// Deletes the purgeable records after key `after` up to key `last`.
    pub fn delete(&self, after: &[u8], last: &[u8]) -> Bound<'_> {
        Bound::new(&self.delete, [after.into(), last.into()])
    }

    /// Deletes the purgeable records after key `after` (the last range).
    pub fn delete_rest(&self, after: &[u8]) -> Bound<'_> {
        Bound::new(&self.delete_rest, [after.into()])
    }
}

/// A resumable call's row in the calls table, written with its claim (bound by
/// [`Completer::insert_call`](crate::Completer::insert_call)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewCall {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The call's stored arguments.
    pub args: Vec<u8>,
    /// The record's TTL, for a give-up's record.
    pub ttl_ms: i64,
}

/// A claim's new ledger row: what [`Ledger::claim`] inserts, and what [`Ledger::record`]
/// writes whole where the claim only read ([`Ledger::claim_by_read`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRecord {
    /// The record id (SHA-256 of scope, principal and key).
    pub id: Vec<u8>,
    /// The call's scope.
    pub scope: String,
    /// The principal the key belongs to (empty: none).
    pub principal: String,
    /// The idempotency key.
    pub key: String,
    /// The claim's owner token.
    pub owner: i64,
    /// The arguments' fingerprint.
    pub fingerprint: Vec<u8>,
    /// How long the record lives (atomic mode) or the lease lasts, from the database clock.
    pub ttl_ms: i64,
}

impl NewRecord {
    /// The row a claim of `req` by `owner` writes, living `lives` from the database clock.
    pub fn of(req: &Request, owner: i64, lives: std::time::Duration) -> Self {
        NewRecord {
            id: req.id().to_vec(),
            scope: req.scope().to_owned(),
            principal: req.principal().to_owned(),
            key: req.key().to_owned(),
            owner,
            fingerprint: req.fingerprint().0.to_vec(),
            ttl_ms: millis(lives),
        }
    }

    /// The row's values in `claim`'s order: id, scope, principal, key, owner, fingerprint,
    /// ttl_ms.
    fn params(&self) -> Vec<Param> {
        vec![
            self.id.as_slice().into(),
            self.scope.as_str().into(),
            self.principal.as_str().into(),
            self.key.as_str().into(),
            self.owner.into(),
            self.fingerprint.as_slice().into(),
            self.ttl_ms.into(),
        ]
    }
}

impl Ledger {
    /// Inserts `row` unless its key has a row. Returns owner, fingerprint, state, response,
    /// expires_at_ms, now_ms of the inserted row or of the row it ran into: locked and
    /// current on MariaDB ([`Ledger::claim_locks_row`]), as the statement's snapshot saw it
    /// on PostgreSQL, nothing on the MySQL 8 family (SQLite's atomic claim reads instead:
    /// [`Ledger::claim_by_read`]; this serves its leases).
    pub fn claim(&self, row: &NewRecord) -> Bound<'_> {
        Bound::new(&self.claim, row.params()).reads(ClaimRow::COLUMNS)
    }

    /// [`Ledger::claim`], failing at once if another transaction holds the key (after
    /// [`Ledger::before_nowait`], before [`Ledger::after_nowait`]).
    pub fn claim_nowait(&self, row: &NewRecord) -> Bound<'_> {
        Bound::new(&self.claim_nowait, row.params()).reads(ClaimRow::COLUMNS)
    }

    /// Reads record `id` locked (on SQLite, under the transaction's write lock). Returns
    /// owner, fingerprint, state, response, expires_at_ms, now_ms.
    pub fn read_locked(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.read_locked, [id.into()]).reads(ClaimRow::COLUMNS)
    }

    /// [`Ledger::read_locked`] without the lock: the committed row, for answers a later
    /// commit cannot change (a completed record, a live lease).
    pub fn read_row(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.read_row, [id.into()]).reads(ClaimRow::COLUMNS)
    }

    /// Makes expired record `id` a new execution of `owner`, living `ttl_ms`.
    pub fn take_over(&self, id: &[u8], owner: i64, fingerprint: &[u8], ttl_ms: i64) -> Bound<'_> {
        Bound::new(
            &self.take_over,
            [owner.into(), fingerprint.into(), ttl_ms.into(), id.into()],
        )
    }

    /// Records the result of `row`'s execution: its state code and response, if `row.owner`
    /// still holds it. Where the claim only read ([`Ledger::claim_by_read`]), writes the
    /// whole row (over an expired one).
    pub fn record(&self, row: &NewRecord, state: i16, response: &[u8]) -> Bound<'_> {
        let params = if self.claim_by_read {
            let mut params = row.params();
            params.extend([state.into(), response.into()]);
            params
        } else {
            vec![
                state.into(),
                response.into(),
                row.id.as_slice().into(),
                row.owner.into(),
            ]
        };
        Bound::new(&self.record, params)
    }

    /// [`Ledger::record`] failing, rather than changing no row, when `row.owner` no longer
    /// holds the key: on PostgreSQL, where a failed statement aborts the transaction, so the
    /// `COMMIT` may go out with it ([`Transaction::commit_after`](crate::Transaction::commit_after)).
    /// `None` elsewhere.
    pub fn record_or_fail(
        &self,
        row: &NewRecord,
        state: i16,
        response: &[u8],
    ) -> Option<Bound<'_>> {
        let params = [
            state.into(),
            response.into(),
            row.id.as_slice().into(),
            row.owner.into(),
        ];
        Some(Bound::new(self.record_or_fail.as_deref()?, params).reads(&[Column::I32]))
    }

    /// How expired records are found and deleted: `calls_table` says whether the schema has
    /// the calls table (a record with a stored call is never purged; without the table there
    /// is none).
    pub fn purge(&self, calls_table: bool) -> &Purge {
        if calls_table {
            &self.purge
        } else {
            &self.purge_without_calls
        }
    }

    /// Selects the database clock, in epoch milliseconds.
    pub fn select_now(&self) -> Bound<'_> {
        Bound::unbound(&self.select_now).reads(&[Column::I64])
    }

    /// Taken after the claim, so that a final error can undo the handler's writes.
    pub fn savepoint(&self) -> Bound<'_> {
        Bound::unbound(&self.savepoint)
    }

    /// Undoes the handler's writes, keeping the claim.
    pub fn rollback_to_savepoint(&self) -> Bound<'_> {
        Bound::unbound(&self.rollback_to_savepoint)
    }

    /// A page of the scope's live records of `state` after id `after` (empty first), in id
    /// order: returns id, response. The pre-deploy check (`check_answers`) reads them.
    pub fn live_answers(&self, scope: &str, state: i16, after: &[u8], limit: i64) -> Bound<'_> {
        Bound::new(
            &self.live_answers,
            [scope.into(), state.into(), after.into(), limit.into()],
        )
        .reads(&[Column::Bytes, Column::Bytes])
    }
}
