//! Every SQL statement idem's stores run, driver-neutral: rendered once per server flavour
//! into one table, [`Sql`], grouped by feature ([`Ledger`], [`Lease`], [`Completer`],
//! [`Inspect`], [`Outbox`], [`Inbox`]).
//!
//! A statement is written once, as a template, wherever the backends agree; where they differ,
//! its field matches on the [`Dialect`]. Templates go through one function, `render`, which
//! splices in:
//! - the table names (`{ledger}`, `{steps}`, `{outbox}`, `{heads}`, `{dead_letters}`) and
//!   index names, each spelled once in [`names`], and all of them as a list of string literals
//!   (`{table_names}`, or `{table_rows}` for a `VALUES` list);
//! - the shared fragments (`{read_row}`, `{due}`, …);
//! - the state codes (`{gave_up}`, and the outbox's `{pending}`, `{published}`, `{dead}`);
//! - the backend's column types and table options, so each table's columns are listed once;
//! - `{now}`, the backend's database clock;
//!
//! and numbers the `?` placeholders on PostgreSQL. An `{ids}` list stays for [`with_ids`].
//!
//! This crate names no database driver: the SeaORM store (`idem-sea-orm`) and the sqlx
//! store (`idem-sqlx`) execute these statements, and run the same algorithms over them. A
//! driver implements the port, [`Driver`] (with a [`Connection`] and a [`Transaction`]),
//! reading each row's columns at the types its statement declares ([`Bound::columns`],
//! [`Column`]). Over its [`Connection`] run the atomic-mode claim ([`claim`]), lease mode's
//! claim, fence and completion ([`claim_lease`], [`fence`], [`complete`], …), the completer's
//! reads and fenced updates ([`due_calls`], [`give_up`], …) and the outbox's relay ([`Relay`],
//! its claims and marks: [`claim_messages`], [`record_outcomes`]); the one store,
//! [`SqlStore`], implements idem-core's store traits with them, once for every driver. On a
//! user's [`Handle`] (a pool, a transaction) run the operator's functions, once for every
//! store: the purge ([`purge_expired`]), the inspection ([`inspect`]), the pre-deploy check
//! ([`check`]), the lease and outbox lists, and [`create_tables`]. [`state`] writes the guarded
//! transitions of a table the application names.
//!
//! It is an implementation crate of idem: its API follows idem's versions, with no promise of its own.

// One file per feature's statements (a folder where a feature has more than one role: lease
// mode's, the completer's and the outbox's statements and algorithms); `statement/` holds what
// they are all made of.
mod atomic;
pub mod check;
mod completer;
mod driver;
mod failure;
mod inbox;
pub mod inspect;
mod lease;
mod ledger;
mod outbox;
mod schema;
pub mod state;
mod statement;
mod store;

pub use statement::names;

use std::sync::LazyLock;

pub use atomic::{
    ClaimStep, Claimed, ClaimedTx, ConnClaimed, ConnStore, Nested, NestedClaim, claim,
};
pub use completer::{
    Completer, STORED_CALL, begin_attempt, due_calls, forget, give_up, note_failure, read_count,
    read_stored_call, steps, unregistered,
};
pub use driver::{
    Begin, COMMIT, Connection, Driver, Fault, Handle, ListenError, ROLLBACK, Transaction,
    fetch_each, fetch_first, learn_flavour, nested_savepoint, release_nested_savepoint,
    roll_back_nested_savepoint,
};
pub use failure::{Failure, claim_lost};
pub use inbox::{DeadLetterTable, Inbox, NewDeadLetter};
pub use inspect::statements::Inspect;
pub use lease::{
    ExpiredLease, GroupCommit, Lease, LeaseStep, LeaseWrite, LeaseWritten, StuckLease,
    WritesFuture, claim_lease, complete, completion, expired_leases, fence, final_phase, read_step,
    record_final_step, record_step, release_lease, settled, stuck_leases, write_grouped,
};
pub use ledger::{
    ClaimRow, ExpiredPurge, Ledger, NewCall, NewRecord, Purge, PurgeByIndex, PurgeSweep,
    database_now_ms, purge_expired,
};
pub use names::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};
pub use outbox::{
    ClaimedMessage, ClaimedRow, DeadMessage, FailedAttempt, NewMessage, Outbox, Relay,
    RelayCounters, RelayRound, claim_messages, dead_messages, health_of, outbox_health,
    paced_purge, purge_published, read_health, record_outcomes, retry_dead, stage_message,
    wake_on_each,
};
pub use schema::{Family, SCHEMA_DIALECTS, create_tables, schema};
pub use statement::bound::{Bound, Param};
pub use statement::flavour::{
    Dialect, FORCE_MYSQL8_ENV, Flavour, GALERA_SYNC_WAIT_ENV, MySqlServer, SELECT_VERSION,
    SELECT_WSREP_ON, has_returning, mysql_flavour,
};
pub use statement::render::{millis, placeholders, with_ids};
pub use statement::row::{Column, Columns, Decode, Row, Value, read_each, read_first};
pub use store::SqlStore;

/// Every statement of one server flavour, by feature. Placeholders are positional, in the
/// order each field's documentation gives.
#[derive(Debug)]
pub struct Sql {
    /// The flavour these statements are for.
    pub flavour: Flavour,
    /// The dialect they are written in.
    pub dialect: Dialect,
    /// The database clock in epoch milliseconds, as an SQL expression (spliced into the
    /// statements; kept for tests that check every statement uses it).
    pub now: &'static str,
    /// The ledger: claims, takeovers, records, the purge.
    pub ledger: Ledger,
    /// Lease mode: steps and the fenced updates of a held row.
    pub lease: Lease,
    /// Resumable calls and their completers.
    pub completer: Completer,
    /// What an operator's tools read.
    pub inspect: Inspect,
    /// The outbox and its relay.
    pub outbox: Outbox,
    /// The inbox's dead letters.
    pub inbox: Inbox,
}

/// The DDL of one family of tables.
#[derive(Debug)]
pub struct Tables {
    /// Creates the tables and their indexes, if missing.
    pub create: Vec<String>,
    /// Undoes `create` (a migration's `down`).
    pub drop: Vec<String>,
}

impl Sql {
    /// The statements of `flavour`, rendered once per process.
    pub fn of(flavour: Flavour) -> &'static Sql {
        static POSTGRES: LazyLock<Sql> = LazyLock::new(|| Sql::new(Flavour::Postgres));
        static MARIADB: LazyLock<Sql> = LazyLock::new(|| Sql::new(Flavour::MariaDb));
        static GALERA: LazyLock<Sql> = LazyLock::new(|| Sql::new(Flavour::Galera));
        static MYSQL8: LazyLock<Sql> = LazyLock::new(|| Sql::new(Flavour::MySql8));
        static SQLITE: LazyLock<Sql> = LazyLock::new(|| Sql::new(Flavour::Sqlite));
        match flavour {
            Flavour::Postgres => &POSTGRES,
            Flavour::MariaDb => &MARIADB,
            Flavour::Galera => &GALERA,
            Flavour::MySql8 => &MYSQL8,
            Flavour::Sqlite => &SQLITE,
        }
    }

    /// The statements every server of `dialect` runs alike: all but the claim's (the ledger's
    /// `claim`, its `nowait` form, the locked and committed reads, `claim_at_once`) and the
    /// lease's fence ([`Lease::fence_by_write`]), which differ between the MySQL families and
    /// need the server's [`Flavour`]. For the statements
    /// a caller runs without knowing the server's version: an operator's reads and writes, a
    /// handler's staging, the DDL (`tests.rs` checks that the families agree on them).
    pub fn common(dialect: Dialect) -> &'static Sql {
        Sql::of(match dialect {
            Dialect::Postgres => Flavour::Postgres,
            Dialect::MySql => Flavour::MariaDb,
            Dialect::Sqlite => Flavour::Sqlite,
        })
    }

    /// Renders every statement of `flavour`.
    fn new(flavour: Flavour) -> Sql {
        let dialect = flavour.dialect();
        // MariaDB's statements on the MySQL protocol (`RETURNING`, `SET STATEMENT`), unless
        // the server is of the MySQL 8 family.
        let mariadb = flavour != Flavour::MySql8;
        let ledger = Ledger::new(dialect, mariadb);
        Sql {
            flavour,
            dialect,
            now: statement::render::now(dialect),
            ledger: if flavour == Flavour::Galera {
                ledger.galera()
            } else {
                ledger
            },
            lease: if flavour == Flavour::Galera {
                Lease::new(dialect).galera()
            } else {
                Lease::new(dialect)
            },
            completer: Completer::new(dialect),
            inspect: Inspect::new(dialect),
            outbox: Outbox::new(dialect),
            inbox: Inbox::new(dialect),
        }
    }
}

#[cfg(test)]
mod tests;
