//! Lease mode: the steps table, and the fenced updates of a held ledger row (the claim
//! reuses the ledger's own statements).

use crate::statement::names::{CALLS_TABLE, LEDGER_TABLE};
use crate::statement::render::{render, upsert};
use crate::{
    Bound, Column, Decode, Dialect, ExpiredLease, Param, Row, StuckLease, Tables, with_ids,
};

/// Live leases held too long (see `Lease::stuck_leases`).
const STUCK_LEASES: &str = "SELECT l.id, l.scope, l.idem_key, l.owner, l.created_at_ms, \
    l.expires_at_ms, {now} AS now_ms, c.attempts FROM {ledger} l \
    LEFT JOIN {calls} c ON c.record_id = l.id \
    WHERE l.state = {in_progress} AND l.expires_at_ms > {now} AND l.created_at_ms <= {now} - ? \
    ORDER BY l.created_at_ms LIMIT ?";

/// Leases that ended unfinished (see `Lease::expired_leases`).
const EXPIRED_LEASES: &str = "SELECT l.id, l.scope, l.idem_key, l.owner, l.expires_at_ms, \
    {now} AS now_ms, c.attempts FROM {ledger} l LEFT JOIN {calls} c ON c.record_id = l.id \
    WHERE l.state = {in_progress} AND l.expires_at_ms <= {now} ORDER BY l.expires_at_ms LIMIT ?";

/// A statement that reads `c.attempts` from the calls table, and the same for a schema
/// without that table (a lease-mode service with no resumable calls): attempts NULL.
fn with_and_without_calls(sql: &str) -> [String; 2] {
    let without = sql.replacen(
        &format!(
            "c.attempts FROM {LEDGER_TABLE} l LEFT JOIN {CALLS_TABLE} c ON c.record_id = l.id"
        ),
        &format!("NULL AS attempts FROM {LEDGER_TABLE} l"),
        1,
    );
    debug_assert_ne!(without, sql, "the join is spelt as expected");
    [sql.to_owned(), without]
}

/// Lease mode's statements for one server flavour.
#[derive(Debug)]
pub struct Lease {
    dialect: Dialect,
    /// The steps table.
    pub tables: Tables,
    /// Binds record_id.
    pub(crate) select_steps: String,
    /// Binds record_id, name, token, result.
    pub(crate) insert_step: String,
    /// Binds name, result, id, token. The step inserted only if the token still holds the
    /// in-progress record, whose row the locking read (`FOR UPDATE`: without it MySQL's
    /// `INSERT … SELECT` reads without a lock under `READ COMMITTED`) holds until the
    /// statement commits (SQLite's one writer holds the database): the fence and the insert
    /// in one auto-committed statement (on SQLite, committed with the group of concurrent
    /// lease writes). Galera `None` (see `Lease::galera`): the fence is a write, and the
    /// fence and the insert go in a transaction.
    pub(crate) insert_step_fenced: Option<String>,
    /// Binds record_id.
    pub(crate) delete_steps: String,
    /// MySQL: binds record_id, then `{ids}` is the list of step names: deletes by primary key,
    /// so completion takes no gap lock (a range delete's next-key lock would meet another
    /// call's step insert, on Galera another node's, and abort one of them). Elsewhere `None`:
    /// `delete_steps` takes no gap locks.
    pub(crate) delete_steps_by_key: Option<String>,
    /// Galera: binds id, token. The fence as a write of the ledger row, where a locking read
    /// is no fence (see `Lease::galera`). Elsewhere `None`: the ledger's locked read fences.
    pub(crate) fence_by_write: Option<String>,
    /// Binds lease_ms, id, token.
    pub(crate) renew_lease: String,
    /// Binds state, response, ttl_ms, id, token.
    pub(crate) complete_lease: String,
    /// PostgreSQL: binds state, response, ttl_ms, id, token. `complete_lease` that also
    /// deletes the steps of the record it completes, and with the calls table (`[0]`) its
    /// stored call: one statement where a transaction takes three, its deletes fed only by
    /// the row the fenced update returns (a holder that lost its lease deletes nothing).
    /// Elsewhere `None` (MySQL deletes steps by key after a read; SQLite's writes are
    /// grouped).
    pub(crate) complete_and_forget: Option<[String; 2]>,
    /// Binds id, token.
    pub(crate) release_lease: String,
    /// Binds id. An operator ends a live lease by hand, fenced: the next token (as a
    /// takeover's) refuses the holder's later writes, and the lease ends now.
    pub(crate) release_by_hand: String,
    /// Binds limit. Returns id, scope, idem_key, owner, expires_at_ms, now_ms, attempts (NULL
    /// unless resumable) of leases that ended. With the calls table, and without it.
    pub(crate) expired_leases: [String; 2],
    /// Binds held_ms, limit. Returns id, scope, idem_key, owner, created_at_ms, expires_at_ms,
    /// now_ms, attempts (NULL unless resumable) of live leases held longer than held_ms. With
    /// the calls table, and without it.
    pub(crate) stuck_leases: [String; 2],
    /// Deletes the steps of records that no longer exist (purged).
    pub(crate) purge_orphaned_steps: String,
}

impl Lease {
    pub(crate) fn new(backend: Dialect) -> Self {
        let r = |template: &str| render(backend, template);
        Self {
            dialect: backend,
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
            insert_step_fenced: {
                // SQLite's one writer makes the statement's read and insert atomic; its parser
                // needs the `WHERE` before `ON CONFLICT`, which the fence gives.
                let lock = if backend == Dialect::Sqlite {
                    ""
                } else {
                    " FOR UPDATE"
                };
                Some(r(&upsert(
                    backend,
                    &format!(
                        "INSERT INTO {{steps}} (record_id, name, token, result, created_at_ms) \
                        SELECT id, ?, owner, ?, {{now}} FROM {{ledger}} \
                        WHERE id = ? AND owner = ? AND state = {{in_progress}}{lock}"
                    ),
                    "record_id, name",
                    &["token", "result"],
                )))
            },
            delete_steps: r("DELETE FROM {steps} WHERE record_id = ?"),
            fence_by_write: None,
            delete_steps_by_key: (backend == Dialect::MySql)
                .then(|| r("DELETE FROM {steps} WHERE record_id = ? AND name IN ({ids})")),
            renew_lease: r("UPDATE {ledger} SET expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = {in_progress}"),
            complete_lease: r(
                "UPDATE {ledger} SET state = ?, response = ?, expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = {in_progress}",
            ),
            // `= (SELECT id FROM done)`, not `IN`: `done` returns at most one row, and with
            // an equality PostgreSQL can probe the key's index where `IN` joined `done` with a
            // read of the whole table; it still scans a table whose key the churn between
            // vacuums has bloated (docs/RELIABILITY.md, R22).
            complete_and_forget: (backend == Dialect::Postgres).then(|| {
                let steps = "WITH done AS (UPDATE {ledger} \
                SET state = ?, response = ?, expires_at_ms = {now} + ? \
                WHERE id = ? AND owner = ? AND state = {in_progress} RETURNING id), \
                steps AS (DELETE FROM {steps} WHERE record_id = (SELECT id FROM done))";
                let call = ", call AS (DELETE FROM {calls} \
                WHERE record_id = (SELECT id FROM done))";
                [
                    r(&format!("{steps}{call} SELECT id FROM done")),
                    r(&format!("{steps} SELECT id FROM done")),
                ]
            }),
            release_lease: r("UPDATE {ledger} SET expires_at_ms = {now} \
            WHERE id = ? AND owner = ? AND state = {in_progress}"),
            release_by_hand: r(
                "UPDATE {ledger} SET owner = owner + 1, expires_at_ms = {now} \
            WHERE id = ? AND state = {in_progress} AND expires_at_ms > {now}",
            ),
            stuck_leases: with_and_without_calls(&r(STUCK_LEASES)),
            expired_leases: with_and_without_calls(&r(EXPIRED_LEASES)),
            purge_orphaned_steps: r(
                "DELETE FROM {steps} WHERE record_id NOT IN (SELECT id FROM {ledger})",
            ),
        }
    }

    /// Lease mode's statements for a node of a Galera cluster. A node certifies a transaction
    /// by the rows it writes, never by the locks it read under (those are the node's own): a
    /// holder's write fenced by a locked read commits beside a takeover on another node that
    /// read the ledger row before it, and the new holder runs again what the old one wrote
    /// (seen in `tests/galera.rs`: a final phase run twice). The fence writes the ledger row
    /// instead, so either one fails certification: the lease one millisecond longer (the row
    /// must change to be in the write set), after the causal wait the claim's reads have.
    pub(crate) fn galera(mut self) -> Self {
        let wait = crate::statement::flavour::GALERA_SYNC_WAIT;
        self.insert_step_fenced = None;
        self.fence_by_write = Some(render(
            Dialect::MySql,
            &format!(
                "SET STATEMENT {wait} FOR UPDATE {{ledger}} \
                SET expires_at_ms = expires_at_ms + 1 \
                WHERE id = ? AND owner = ? AND state = {{in_progress}}"
            ),
        ));
        self
    }
}

/// The values a completion binds, in their order: state, response, ttl_ms, id, token.
fn completion_params(
    id: &[u8],
    token: i64,
    state: i16,
    response: Vec<u8>,
    ttl_ms: i64,
) -> [Param; 5] {
    [
        state.into(),
        response.into(),
        ttl_ms.into(),
        id.into(),
        token.into(),
    ]
}

/// A recorded step as [`Lease::select_steps`] returns it: its name and result.
pub fn read_step(row: Row) -> Result<(String, Vec<u8>), Decode> {
    let mut c = row.read();
    Ok((c.text()?, c.bytes()?))
}

impl Lease {
    /// The recorded steps of record `id`: returns name, result ([`read_step`]).
    pub fn select_steps(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.select_steps, [id.into()]).reads(&[Column::Text, Column::Bytes])
    }

    /// Records step `name` of record `id` with its `result`, under the holder's `token` (over
    /// a step of the same name).
    pub fn insert_step(&self, id: &[u8], name: &str, token: i64, result: &[u8]) -> Bound<'_> {
        Bound::new(
            &self.insert_step,
            [id.into(), name.into(), token.into(), result.into()],
        )
    }

    /// Records step `name` of record `id` with its `result` in one statement, if `token` still
    /// holds the in-progress record (it changes one row then, none otherwise); `None` where the
    /// fence and the insert go in a transaction ([`Lease::insert_step`]).
    pub fn insert_step_fenced(
        &self,
        id: &[u8],
        name: &str,
        token: i64,
        result: &[u8],
    ) -> Option<Bound<'_>> {
        let sql = self.insert_step_fenced.as_ref()?;
        Some(Bound::new(
            sql,
            [name.into(), result.into(), id.into(), token.into()],
        ))
    }

    /// Deletes the steps of record `id`.
    pub fn delete_steps(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.delete_steps, [id.into()])
    }

    /// Where a range delete would take gap locks (MySQL): deletes the steps `names` of record
    /// `id` by primary key. `None` elsewhere: [`Lease::delete_steps`] takes no gap lock.
    pub fn delete_steps_by_key(&self, id: &[u8], names: &[String]) -> Option<Bound<'static>> {
        let sql = self.delete_steps_by_key.as_ref()?;
        let mut params: Vec<Param> = vec![id.into()];
        params.extend(names.iter().map(|name| name.as_str().into()));
        Some(Bound::owned(
            with_ids(self.dialect, sql, names.len()),
            params,
        ))
    }

    /// Where a locked read is no fence (a Galera node certifies a transaction by the rows it
    /// writes): the fence as a write of record `id`, which changes one row if `token` still
    /// holds the in-progress record, none otherwise. `None` elsewhere: the ledger's
    /// [`read_locked`](crate::Ledger::read_locked) fences.
    pub fn fence_by_write(&self, id: &[u8], token: i64) -> Option<Bound<'_>> {
        let sql = self.fence_by_write.as_ref()?;
        Some(Bound::new(sql, [id.into(), token.into()]))
    }

    /// Renews the lease on record `id` for `lease_ms` from now, if `token` still holds it.
    pub fn renew(&self, id: &[u8], token: i64, lease_ms: i64) -> Bound<'_> {
        Bound::new(
            &self.renew_lease,
            [lease_ms.into(), id.into(), token.into()],
        )
    }

    /// Records the outcome of the call holding record `id` (state code, response, kept for
    /// `ttl_ms` from now), if `token` still holds the lease.
    pub fn complete(
        &self,
        id: &[u8],
        token: i64,
        state: i16,
        response: Vec<u8>,
        ttl_ms: i64,
    ) -> Bound<'_> {
        Bound::new(
            &self.complete_lease,
            completion_params(id, token, state, response, ttl_ms),
        )
    }

    /// Whether [`Lease::complete_and_forget`] records an outcome and forgets the call's
    /// steps and stored call in one statement (PostgreSQL).
    pub fn completes_in_one_statement(&self) -> bool {
        self.complete_and_forget.is_some()
    }

    /// [`Lease::complete`] that also deletes the record's steps and, for a `resumable` call,
    /// its stored call, in one statement, if `token` still holds the lease: it answers one
    /// row then, none otherwise (and deletes nothing). `None` where that takes a transaction
    /// ([`Lease::completes_in_one_statement`]).
    pub fn complete_and_forget(
        &self,
        id: &[u8],
        token: i64,
        state: i16,
        response: Vec<u8>,
        ttl_ms: i64,
        resumable: bool,
    ) -> Option<Bound<'_>> {
        let sql = &self.complete_and_forget.as_ref()?[usize::from(!resumable)];
        Some(Bound::new(
            sql,
            completion_params(id, token, state, response, ttl_ms),
        ))
    }

    /// Ends the lease on record `id` now, if `token` still holds it.
    pub fn release(&self, id: &[u8], token: i64) -> Bound<'_> {
        Bound::new(&self.release_lease, [id.into(), token.into()])
    }

    /// An operator ends the live lease on record `id` by hand, fenced: the next token (as a
    /// takeover's) refuses the holder's later writes, and the lease ends now.
    pub fn release_by_hand(&self, id: &[u8]) -> Bound<'_> {
        Bound::new(&self.release_by_hand, [id.into()])
    }

    /// Up to `limit` leases that ended without their call finishing, oldest first: returns
    /// id, scope, idem_key, owner, expires_at_ms, now_ms, attempts (NULL unless resumable;
    /// always NULL where the schema has no calls table: `calls_table` false).
    pub fn expired_leases(&self, limit: i64, calls_table: bool) -> Bound<'_> {
        Bound::new(
            &self.expired_leases[usize::from(!calls_table)],
            [limit.into()],
        )
        .reads(ExpiredLease::COLUMNS)
    }

    /// Up to `limit` live leases held for longer than `held_ms`, longest held first: returns
    /// id, scope, idem_key, owner, created_at_ms, expires_at_ms, now_ms, attempts (NULL
    /// unless resumable; always NULL where the schema has no calls table).
    pub fn stuck_leases(&self, held_ms: i64, limit: i64, calls_table: bool) -> Bound<'_> {
        Bound::new(
            &self.stuck_leases[usize::from(!calls_table)],
            [held_ms.into(), limit.into()],
        )
        .reads(StuckLease::COLUMNS)
    }

    /// Deletes the steps of records that no longer exist (purged).
    pub fn purge_orphaned_steps(&self) -> Bound<'_> {
        Bound::unbound(&self.purge_orphaned_steps)
    }
}
