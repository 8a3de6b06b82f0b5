//! idem's tables: created at start-up on any driver's [`Handle`] ([`create_tables`], only the
//! families a database lacks), or as DDL a service puts in its own migrations: one file per
//! family of tables and dialect (the files under `idem-sql/schema/`, or `idem schema
//! --backend …`), so a service creates only the tables of the features it uses.

use std::time::Duration;

use idem_core::Error;
use idem_core::retry::Backoff;

use crate::driver::connect;
use crate::driver::{db_error, failed};
use crate::inspect::existing_tables;
use crate::statement::names::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};
use crate::{Connection, Dialect, Driver, Failure, Handle, Sql, Tables};

/// A family of idem's tables, created together. Atomic mode needs the ledger alone; lease
/// mode the ledger and the steps; resumable calls (and their completer) the calls table too;
/// the outbox (and the inbox's dead letters) its own three.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `idem_ledger`: one row per key.
    Ledger,
    /// `idem_steps`: lease mode's recorded steps.
    Lease,
    /// `idem_calls`: resumable calls, for the completer.
    Completer,
    /// `idem_outbox`, `idem_outbox_heads`, `idem_dead_letters`.
    Outbox,
}

impl Family {
    /// Every family, in the order they are created.
    pub const ALL: [Family; 4] = [
        Family::Ledger,
        Family::Lease,
        Family::Completer,
        Family::Outbox,
    ];

    /// The family's name, as `idem schema --only` takes it.
    pub const fn name(self) -> &'static str {
        match self {
            Family::Ledger => "ledger",
            Family::Lease => "lease",
            Family::Completer => "completer",
            Family::Outbox => "outbox",
        }
    }

    /// The family named `name` (see [`Family::name`]).
    pub fn named(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|family| family.name() == name)
    }

    /// The tables the family creates.
    pub const fn tables(self) -> &'static [&'static str] {
        match self {
            Family::Ledger => &[LEDGER_TABLE],
            Family::Lease => &[STEPS_TABLE],
            Family::Completer => &[CALLS_TABLE],
            Family::Outbox => &[OUTBOX_TABLE, OUTBOX_HEADS_TABLE, DEAD_LETTERS_TABLE],
        }
    }

    /// What the family is for, in a line.
    const fn serves(self) -> &'static str {
        match self {
            Family::Ledger => "every #[idempotent] call (atomic and lease mode)",
            Family::Lease => "lease mode's recorded steps (`lease = ...`)",
            Family::Completer => "resumable lease-mode calls and their completer (`resumable`)",
            Family::Outbox => "the outbox and its relay, and the inbox's dead letters",
        }
    }
}

/// The dialects schema files are written for, with the directory name of each.
pub const SCHEMA_DIALECTS: [(Dialect, &str); 3] = [
    (Dialect::Postgres, "postgres"),
    (Dialect::MySql, "mysql"),
    (Dialect::Sqlite, "sqlite"),
];

impl Sql {
    /// The DDL of `family`'s tables.
    pub fn tables(&self, family: Family) -> &Tables {
        match family {
            Family::Ledger => &self.ledger.tables,
            Family::Lease => &self.lease.tables,
            Family::Completer => &self.completer.tables,
            Family::Outbox => &self.outbox.tables,
        }
    }
}

/// `family`'s tables for `dialect` as a migration file: a comment saying what they serve, then
/// each statement ending in `;`. The same statements as `create_tables` runs; every one is
/// idempotent (`IF NOT EXISTS`).
pub fn schema(dialect: Dialect, family: Family) -> String {
    let mut out = format!(
        "-- idem's {} tables ({}): {}.\n",
        family.name(),
        family.tables().join(", "),
        family.serves()
    );
    for statement in &Sql::common(dialect).tables(family).create {
        out.push('\n');
        out.push_str(statement);
        out.push_str(";\n");
    }
    out
}

/// How many times a family's DDL runs on a pool before its error is the answer. Replicas of a
/// service that start at once on a new PostgreSQL database create the same tables at once,
/// and every concurrent `CREATE … IF NOT EXISTS` but one fails on the catalogue (a unique
/// violation on `pg_type`, or "already exists"). Run again, the statements find the tables
/// the other replica made.
const CREATE_ATTEMPTS: u32 = 6;

/// The pause before a family's DDL runs again: 20 ms doubling, half of it random, so creators
/// that failed together spread out. Five pauses come to at most 620 ms.
const CREATE_AGAIN: Backoff = Backoff {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(320),
};

/// Creates the tables of `families` (atomic mode needs [`Family::Ledger`] alone) where they
/// do not exist. On PostgreSQL and MySQL it reads the catalogue first and runs DDL only for a
/// family with a missing table: on a cluster (Galera) even `CREATE TABLE IF NOT EXISTS` is
/// replicated as DDL and aborts the transactions committing on that table cluster-wide, so
/// starting a service must not issue it against a live ledger. SQLite runs its (idempotent)
/// DDL every time: it is embedded, so no other node aborts, and the DDL drops the expiry index
/// that ledgers of earlier versions have.
///
/// On a pool, services starting at once may all call it: a family whose DDL fails runs again,
/// up to 6 times over at most 620 ms, unless the server is unreachable. In a transaction of
/// the caller's, the first error is the answer (PostgreSQL has aborted the transaction).
pub async fn create_tables<D: Driver, H: Handle<D>>(
    db: &H,
    families: &[Family],
) -> Result<(), Error> {
    let doing = "creating idem's tables";
    let (mut conn, sql) = connect(db, doing).await?;
    let attempts = if db.driver().is_some() {
        CREATE_ATTEMPTS
    } else {
        1
    };
    let existing = match sql.dialect {
        Dialect::Sqlite => None,
        _ => Some(
            existing_tables(&mut conn, sql)
                .await
                .map_err(|fault| failed::<D>(("listing idem's tables", fault)))?,
        ),
    };
    for &family in families {
        let present = |table: &&str| existing.iter().flatten().any(|name| name == table);
        if existing.is_some() && family.tables().iter().all(present) {
            continue;
        }
        let mut attempt = 1;
        while let Err(e) = create_family(&mut conn, sql, family).await {
            if attempt >= attempts || D::classify(&e) == Failure::Unavailable {
                return Err(db_error::<D>(doing, e));
            }
            tokio::time::sleep(CREATE_AGAIN.delay(attempt)).await;
            attempt += 1;
        }
    }
    Ok(())
}

/// Runs `family`'s DDL on `conn`, every statement `IF NOT EXISTS`.
async fn create_family<C: Connection>(
    conn: &mut C,
    sql: &'static Sql,
    family: Family,
) -> Result<(), C::Error> {
    for statement in &sql.tables(family).create {
        conn.execute_unprepared(statement).await?;
    }
    Ok(())
}
