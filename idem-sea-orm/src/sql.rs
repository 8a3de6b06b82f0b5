//! Every SQL statement the crate runs, rendered once per backend into one table, [`Sql`].
//!
//! A statement is written once, as a template, wherever the backends agree; where they differ,
//! its field matches on the backend. Templates go through one function, [`render`], which
//! splices in:
//! - the table names (`{ledger}`, `{steps}`, `{outbox}`, `{heads}`, `{dead_letters}`) and
//!   index names, each spelled once below, and all of them as a list of string literals
//!   (`{table_names}`, or `{table_rows}` for a `VALUES` list);
//! - the shared fragments of [`FRAGMENTS`] (`{read_row}`, `{due}`, …);
//! - the outbox's state codes (`{pending}`, `{published}`, `{dead}`);
//! - the backend's column types and table options ([`COLUMN_TYPES`]), so each table's columns
//!   are listed once;
//! - `{now}`, the backend's database clock;
//!
//! and numbers the `?` placeholders on PostgreSQL. An `{ids}` list stays for [`with_ids`].

use std::sync::LazyLock;

use sea_orm::DbBackend;

/// Name of the ledger table.
pub const LEDGER_TABLE: &str = "idem_ledger";
/// Name of the table of recorded steps (recovery points) of calls in progress.
pub const STEPS_TABLE: &str = "idem_steps";
/// Name of the table of resumable calls in progress: their stored arguments, and their
/// completer attempts.
pub const CALLS_TABLE: &str = "idem_calls";
/// Name of the outbox table.
pub const OUTBOX_TABLE: &str = "idem_outbox";
/// Name of the table holding each aggregate's last sequence number.
pub const OUTBOX_HEADS_TABLE: &str = "idem_outbox_heads";
/// Name of the table of messages a consumer gave up on.
pub const DEAD_LETTERS_TABLE: &str = "idem_dead_letters";

/// Every table idem creates, in the order `create_tables` creates them.
pub(crate) const ALL_TABLES: [&str; 6] = [
    LEDGER_TABLE,
    STEPS_TABLE,
    CALLS_TABLE,
    OUTBOX_TABLE,
    OUTBOX_HEADS_TABLE,
    DEAD_LETTERS_TABLE,
];

/// The savepoint a claim takes before the handler's body runs.
const CLAIM_SAVEPOINT: &str = "idem_claim";
/// The PostgreSQL channel a staged message notifies relays on: the outbox's name.
pub(crate) const WAKE_CHANNEL: &str = OUTBOX_TABLE;

/// The `state` column of the outbox.
pub(crate) mod outbox_state {
    pub(crate) const PENDING: i16 = 0;
    pub(crate) const PUBLISHED: i16 = 1;
    pub(crate) const DEAD: i16 = 2;
}

/// Pieces several statements share, spliced before the names (they contain names).
const FRAGMENTS: [(&str, &str); 10] = [
    // Whether a ledger row may be purged: it ended (completed, failed or given up: never an
    // execution in progress, however long ago its lease ended), its TTL passed, and nothing
    // is owed on it (no stored call: a resumable call awaiting its completer, or a give-up
    // whose hook has not run). Purging any of those would let the next claim run the
    // recorded steps' effects again, and leave the completer nothing to finish.
    (
        "{purgeable}",
        "{ledger}.expires_at_ms <= {now} AND {ledger}.state <> 0 AND NOT EXISTS (\
        SELECT 1 FROM {calls} c WHERE c.record_id = {ledger}.id)",
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

/// Every statement of one backend. Placeholders are positional, in the order the caller binds
/// them.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) backend: DbBackend,
    /// The database clock in epoch milliseconds, as an SQL expression (spliced into the
    /// statements; kept for tests that check every statement uses it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) now: &'static str,

    // The ledger.
    pub(crate) ledger_tables: Tables,
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
    /// Run after `claim_nowait` (whatever it answered) where `before_nowait` changed the
    /// session.
    pub(crate) after_nowait: Option<&'static str>,
    /// Run before `claim_nowait` where the backend needs a separate statement.
    pub(crate) before_nowait: Option<&'static str>,
    /// Whether a lease claim is first tried as `claim` alone, outside a transaction. Not on
    /// the MySQL 8 family (its upsert returns no row), nor on a Galera node: a node re-runs
    /// an autocommit statement that failed certification after it returned its rows, so
    /// the caller could read a row it did not end up inserting (seen in `tests/galera.rs`).
    pub(crate) claim_at_once: bool,
    /// Binds id; returns owner, fingerprint, state, response, expires_at_ms, now_ms.
    pub(crate) read_locked: String,
    /// `read_locked` without the lock: a committed row, for answers a later commit cannot
    /// change (a completed record, a live lease).
    pub(crate) read_row: String,
    /// Binds owner, fingerprint, ttl_ms, id.
    pub(crate) take_over: String,
    /// Binds state, response, id, owner (with `claim_by_read`: see there).
    pub(crate) record: String,
    /// How expired records are found and deleted.
    pub(crate) purge: Purge,
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

    // Lease mode: the steps table, and the fenced updates of a held ledger row (the claim
    // reuses the ledger's own statements).
    pub(crate) steps_tables: Tables,
    /// Binds record_id.
    pub(crate) select_steps: String,
    /// Binds record_id, name, token, result.
    pub(crate) insert_step: String,
    /// Binds record_id.
    pub(crate) delete_steps: String,
    /// MySQL: binds record_id, then `{ids}` is the list of step names: deletes by primary key,
    /// so completion takes no gap lock (a range delete's next-key lock would meet another
    /// call's step insert, on Galera another node's, and abort one of them). Elsewhere `None`:
    /// `delete_steps` takes no gap locks.
    pub(crate) delete_steps_by_key: Option<String>,
    /// Binds lease_ms, id, token.
    pub(crate) renew_lease: String,
    /// Binds state, response, ttl_ms, id, token.
    pub(crate) complete_lease: String,
    /// Binds id, token.
    pub(crate) release_lease: String,
    /// Binds id. An operator ends a live lease by hand, fenced: the next token (as a
    /// takeover's) refuses the holder's later writes, and the lease ends now.
    pub(crate) release_by_hand: String,
    /// Binds limit. Returns id, scope, idem_key, owner, expires_at_ms, now_ms of leases that
    /// ended.
    pub(crate) expired_leases: String,
    /// Binds held_ms, limit. Returns id, scope, idem_key, owner, created_at_ms, expires_at_ms,
    /// now_ms, attempts (NULL unless resumable) of live leases held longer than held_ms.
    pub(crate) stuck_leases: String,
    /// Deletes the steps of records that no longer exist (purged).
    pub(crate) purge_orphaned_steps: String,

    // Resumable calls and their completers.
    pub(crate) calls_tables: Tables,
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

    // Inspection (read only): what an operator's tools show of one record.
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

    // The outbox.
    pub(crate) outbox_tables: Tables,
    /// Binds aggregate_key. Locks the aggregate's head row until commit, so messages of one
    /// aggregate get their sequence numbers (and ids) in commit order.
    pub(crate) bump_head: Option<String>,
    /// Binds aggregate_key, message_id, topic, aggregate_key, headers, payload (PostgreSQL:
    /// bumps the head and notifies relays in the same statement).
    pub(crate) insert_message_in_aggregate: String,
    /// Binds message_id, topic, headers, payload.
    pub(crate) insert_message: String,
    /// Binds lease_ms, token, batch. Claims due messages that are first in their aggregate
    /// and returns `{claimed_columns}` (PostgreSQL, SQLite). MySQL uses the three statements
    /// below in one transaction.
    pub(crate) claim_messages: String,
    /// MySQL: binds batch; ids of due messages that are first in their aggregate (plain read).
    pub(crate) select_eligible: String,
    /// MySQL: `{ids}` is the id list; locks those still claimable, skipping locked ones.
    pub(crate) lock_claimable: String,
    /// MySQL: binds lease_ms, token; `{ids}` is the id list.
    pub(crate) lease_messages: String,
    /// Binds token; `{ids}` is the id list.
    pub(crate) mark_published: String,
    /// Binds state, last_error, delay_ms, id, token.
    pub(crate) mark_failed: String,
    /// Binds retention_ms, batch.
    pub(crate) purge_published: String,
    /// Returns pending count, oldest pending created_at_ms, dead count, now_ms.
    pub(crate) outbox_health: String,
    /// Binds limit.
    pub(crate) list_dead: String,
    /// Binds message_id.
    pub(crate) retry_dead: String,
    /// Binds consumer, message_id, subject, payload, error, deliveries.
    pub(crate) record_dead_letter: String,
}

/// The DDL of one family of tables.
#[derive(Debug)]
pub(crate) struct Tables {
    pub(crate) create: Vec<String>,
    /// Undoes `create` (a migration's `down`).
    #[cfg_attr(not(feature = "migration"), allow(dead_code))]
    pub(crate) drop: Vec<String>,
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

impl Sql {
    /// The statements of `backend` (on MySQL, of the server family this process talks to:
    /// [`crate::flavour`]).
    pub(crate) fn of(backend: DbBackend) -> &'static Sql {
        static POSTGRES: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::Postgres, true));
        static MARIADB: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::MySql, true));
        static MYSQL: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::MySql, false));
        static GALERA: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::MySql, true).galera());
        static SQLITE: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::Sqlite, true));
        match backend {
            DbBackend::Postgres => &POSTGRES,
            DbBackend::MySql if crate::flavour::mysql_without_returning() => &MYSQL,
            DbBackend::MySql if crate::flavour::galera() => &GALERA,
            DbBackend::MySql => &MARIADB,
            _ => &SQLITE,
        }
    }

    /// MariaDB's statements for a node of a Galera cluster: those that decide a claim (what
    /// it inserts or reads locked) first wait until the node has applied every write the
    /// cluster committed before them (`wsrep_sync_wait` 7: reads, updates and inserts), so a
    /// duplicate sent to another node finds the first call's record or lease.
    fn galera(mut self) -> Sql {
        const WAIT: &str = "wsrep_sync_wait = 7";
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

    /// The statements of `backend`; `mariadb` picks MariaDB's on the MySQL protocol
    /// (`RETURNING`, `SET STATEMENT`), else those of the MySQL 8 family.
    fn new(backend: DbBackend, mariadb: bool) -> Sql {
        use sea_orm::DatabaseBackend::{MySql, Postgres, Sqlite};
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
        // The outbox's two other tables, the same whatever the outbox table's indexes.
        let heads_table = "CREATE TABLE IF NOT EXISTS {heads} (\
            aggregate_key {string} NOT NULL PRIMARY KEY, last_seq {i64} NOT NULL){clustered}";
        let dead_letters_table = "CREATE TABLE IF NOT EXISTS {dead_letters} (\
            consumer {string} NOT NULL, message_id {string} NOT NULL, \
            subject {string} NOT NULL, payload {blob} NOT NULL, error TEXT NOT NULL, \
            deliveries {i64} NOT NULL, created_at_ms {i64} NOT NULL, \
            PRIMARY KEY (consumer, message_id)){clustered}";
        Sql {
            backend,
            now: now(backend),

            ledger_tables: Tables {
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
                "UPDATE {ledger} SET owner = ?, fingerprint = ?, state = 0, response = NULL, \
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
            purge: match backend {
                // A row locked by a claim is skipped; one that a takeover made current again
                // while it waited is re-checked under its lock and kept.
                Postgres => Purge::ByIndex(r(
                    "DELETE FROM {ledger} WHERE id IN (SELECT id FROM {ledger} \
                    WHERE {purgeable} LIMIT ? FOR UPDATE SKIP LOCKED)",
                )),
                MySql => Purge::ByIndex(r("DELETE FROM {ledger} WHERE {purgeable} LIMIT ?")),
                _ => Purge::Sweep {
                    bound: r("SELECT id FROM {ledger} WHERE id > ? ORDER BY id LIMIT 1 OFFSET ?"),
                    delete: r("DELETE FROM {ledger} WHERE id > ? AND id <= ? AND {purgeable}"),
                    delete_rest: r("DELETE FROM {ledger} WHERE id > ? AND {purgeable}"),
                },
            },
            select_now: r("SELECT {now} AS now_ms"),
            savepoint: r("SAVEPOINT {claim_savepoint}"),
            rollback_to_savepoint: r("ROLLBACK TO SAVEPOINT {claim_savepoint}"),
            live_answers: r(
                "SELECT id, response FROM {ledger} WHERE scope = ? AND state = ? \
                AND expires_at_ms > {now} AND id > ? ORDER BY id LIMIT ?",
            ),

            steps_tables: Tables {
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
            delete_steps_by_key: (backend == MySql)
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

            // Only calls in progress (and give-ups whose hook is owed) have a row: the table
            // stays small, and its scans need no index.
            calls_tables: Tables {
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

            outbox_tables: Tables {
                create: match backend {
                    // MySQL has no partial indexes: its indexes are part of the table.
                    MySql => vec![
                        "CREATE TABLE IF NOT EXISTS {outbox} ({outbox_columns}, \
                        INDEX {outbox_pending} (state, id), \
                        INDEX {outbox_aggregate} (aggregate_key, id), \
                        INDEX {outbox_published} (state, published_at_ms)){clustered}",
                        heads_table,
                        dead_letters_table,
                    ],
                    _ => vec![
                        // Not `{clustered}` on SQLite: AUTOINCREMENT needs a rowid.
                        "CREATE TABLE IF NOT EXISTS {outbox} ({outbox_columns})",
                        // The relay's scan: unpublished messages in id order.
                        "CREATE INDEX IF NOT EXISTS {outbox_pending} ON {outbox} (id) \
                        WHERE state = {pending}",
                        // First-in-aggregate checks look only at unpublished messages.
                        "CREATE INDEX IF NOT EXISTS {outbox_aggregate} ON {outbox} \
                        (aggregate_key, id) WHERE state <> {published}",
                        "CREATE INDEX IF NOT EXISTS {outbox_published} ON {outbox} \
                        (published_at_ms) WHERE state = {published}",
                        heads_table,
                        dead_letters_table,
                    ],
                }
                .into_iter()
                .map(r)
                .collect(),
                drop: [
                    "DROP TABLE IF EXISTS {dead_letters}",
                    "DROP TABLE IF EXISTS {heads}",
                    "DROP TABLE IF EXISTS {outbox}",
                ]
                .map(r)
                .to_vec(),
            },
            bump_head: match backend {
                // The insert bumps the head itself.
                Postgres => None,
                MySql => Some(r(
                    "INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                    ON DUPLICATE KEY UPDATE last_seq = last_seq + 1",
                )),
                _ => Some(r(
                    "INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                    ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = last_seq + 1",
                )),
            },
            insert_message_in_aggregate: r(match backend {
                // One round trip: bump the head, insert, and notify listening relays at commit.
                Postgres => {
                    "WITH head AS (INSERT INTO {heads} (aggregate_key, last_seq) VALUES (?, 1) \
                        ON CONFLICT (aggregate_key) DO UPDATE SET last_seq = {heads}.last_seq + 1 \
                        RETURNING last_seq) \
                    INSERT INTO {outbox} ({insert_columns}) \
                    SELECT ?, ?, ?, head.last_seq, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
                    FROM head, (SELECT pg_notify('{wake_channel}', '')) AS wake"
                }
                _ => {
                    "INSERT INTO {outbox} ({insert_columns}) VALUES (?, ?, ?, \
                    (SELECT last_seq FROM {heads} WHERE aggregate_key = ?), \
                    ?, ?, {pending}, 0, {now}, 0, 0, {now})"
                }
            }),
            insert_message: r(match backend {
                Postgres => {
                    "INSERT INTO {outbox} ({insert_columns}) \
                    SELECT ?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now} \
                    FROM (SELECT pg_notify('{wake_channel}', '')) AS wake"
                }
                _ => {
                    "INSERT INTO {outbox} ({insert_columns}) \
                    VALUES (?, ?, NULL, NULL, ?, ?, {pending}, 0, {now}, 0, 0, {now})"
                }
            }),
            claim_messages: match backend {
                Postgres => r("UPDATE {outbox} \
                    SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                    WHERE id IN (SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                        ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED) \
                    RETURNING {claimed_columns}"),
                MySql => String::new(),
                // One statement is atomic on SQLite's single writer: no row locks needed.
                _ => r("UPDATE {outbox} \
                    SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                    WHERE id IN (SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                        ORDER BY o.id LIMIT ?) \
                    RETURNING {claimed_columns}"),
            },
            // InnoDB may lock (and so skip) the rows a subquery of a locking read visits, which
            // would let a message overtake a locked predecessor: the first-in-aggregate check
            // is a plain read, the lock a second statement.
            select_eligible: match backend {
                MySql => r(
                    "SELECT o.id FROM {outbox} o WHERE {due} AND {first_in_aggregate} \
                    ORDER BY o.id LIMIT ?",
                ),
                _ => String::new(),
            },
            lock_claimable: match backend {
                MySql => r(
                    "SELECT {claimed_columns} FROM {outbox} o WHERE id IN ({ids}) AND {due} \
                    ORDER BY id FOR UPDATE SKIP LOCKED",
                ),
                _ => String::new(),
            },
            lease_messages: match backend {
                MySql => r("UPDATE {outbox} \
                    SET locked_until_ms = {now} + ?, locked_by = ?, attempts = attempts + 1 \
                    WHERE id IN ({ids})"),
                _ => String::new(),
            },
            mark_published: r(
                "UPDATE {outbox} SET state = {published}, published_at_ms = {now}, \
                locked_until_ms = 0 WHERE locked_by = ? AND state = {pending} AND id IN ({ids})",
            ),
            mark_failed: r(
                "UPDATE {outbox} SET state = ?, last_error = ?, next_attempt_at_ms = {now} + ?, \
                locked_until_ms = 0 WHERE id = ? AND locked_by = ? AND state = {pending}",
            ),
            purge_published: r(match backend {
                Postgres => {
                    "DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                    WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ? \
                    FOR UPDATE SKIP LOCKED)"
                }
                MySql => {
                    "DELETE FROM {outbox} \
                    WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?"
                }
                _ => {
                    "DELETE FROM {outbox} WHERE id IN (SELECT id FROM {outbox} \
                    WHERE state = {published} AND published_at_ms <= {now} - ? LIMIT ?)"
                }
            }),
            outbox_health: r("SELECT \
                (SELECT COUNT(*) FROM {outbox} WHERE state = {pending}) AS pending, \
                (SELECT MIN(created_at_ms) FROM {outbox} WHERE state = {pending}) AS oldest_pending_ms, \
                (SELECT COUNT(*) FROM {outbox} WHERE state = {dead}) AS dead, \
                {now} AS now_ms"),
            list_dead: r(
                "SELECT message_id, topic, aggregate_key, aggregate_seq, attempts, last_error, \
                created_at_ms FROM {outbox} WHERE state = {dead} ORDER BY id LIMIT ?",
            ),
            retry_dead: r(
                "UPDATE {outbox} SET state = {pending}, attempts = 0, last_error = NULL, \
                next_attempt_at_ms = {now}, locked_until_ms = 0 WHERE message_id = ? AND state = {dead}",
            ),
            record_dead_letter: r(&upsert(
                backend,
                "INSERT INTO {dead_letters} \
                (consumer, message_id, subject, payload, error, deliveries, created_at_ms) \
                VALUES (?, ?, ?, ?, ?, ?, {now})",
                "consumer, message_id",
                &["error", "deliveries"],
            )),
        }
    }
}

/// `insert`, which updates `columns` to the inserted values where a row with its primary key
/// (`key`) exists.
fn upsert(backend: DbBackend, insert: &str, key: &str, columns: &[&str]) -> String {
    let set = |inserted: fn(&str) -> String| {
        columns
            .iter()
            .map(|column| format!("{column} = {}", inserted(column)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match backend {
        DbBackend::MySql => format!(
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
fn now(backend: DbBackend) -> &'static str {
    match backend {
        DbBackend::Postgres => {
            "CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)"
        }
        // UNIX_TIMESTAMP is independent of the session time zone.
        DbBackend::MySql => "CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)",
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
fn render(backend: DbBackend, template: &str) -> String {
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
        .replace("{claim_savepoint}", CLAIM_SAVEPOINT)
        .replace("{wake_channel}", WAKE_CHANNEL)
        .replace("{ledger}", LEDGER_TABLE)
        .replace("{steps}", STEPS_TABLE)
        .replace("{calls}", CALLS_TABLE)
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
        DbBackend::Postgres => 0,
        DbBackend::MySql => 1,
        _ => 2,
    };
    for (name, column_types) in COLUMN_TYPES {
        sql = sql.replace(name, column_types[column]);
    }
    placeholders(backend, &sql.replace("{now}", now(backend)))
}

/// Fills an `{ids}` list with `n` placeholders, numbered after those already in `sql`.
pub(crate) fn with_ids(backend: DbBackend, sql: &str, n: usize) -> String {
    let before = sql.split("{ids}").next().unwrap_or_default();
    let taken = if backend == DbBackend::Postgres {
        before.matches('$').count()
    } else {
        0
    };
    let list = if backend == DbBackend::Postgres {
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
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(i64::MAX / 4, |ms| ms.min(i64::MAX / 4))
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

#[cfg(test)]
mod tests;
