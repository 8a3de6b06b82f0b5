//! How a transaction begins ([`Begin`], the text per dialect): the transaction statements a
//! driver runs, written once. A nested call's savepoints are the driver's own nested
//! transactions ([`Driver::savepoint`](crate::Driver::savepoint)).

use crate::Dialect;

/// How a transaction begins. A driver maps it to its own API (SeaORM's transaction options)
/// or runs the text [`Dialect::begin`] gives, so `BEGIN IMMEDIATE` and the isolation levels
/// are written once, here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Begin {
    /// Claims, lease writes, final phases and group commits. SQLite takes its write lock up
    /// front (a deferred transaction that reads, then writes, fails with `SQLITE_BUSY` instead
    /// of waiting); PostgreSQL stays READ COMMITTED (REPEATABLE READ turns two claims of one
    /// key into a serialization failure); MySQL stays REPEATABLE READ (the claim reads with
    /// `FOR UPDATE`).
    Write,
    /// READ COMMITTED: the outbox's three-step claim on MySQL
    /// ([`Outbox::claims_in_three_steps`](crate::Outbox::claims_in_three_steps)), whose plain
    /// read must see messages committed after the transaction began.
    ReadCommitted,
    /// One read-only snapshot: a record, its steps and its call read together (inspection).
    Snapshot,
}

impl Dialect {
    /// The statements that begin a transaction `how` on this dialect, in order (a session
    /// setting first where the level is set before `BEGIN`). For a driver that begins with
    /// text; a driver with its own options maps [`Begin`] to them instead.
    pub const fn begin(self, how: Begin) -> &'static [&'static str] {
        match (self, how) {
            (Dialect::Sqlite, Begin::Write) => &["BEGIN IMMEDIATE"],
            // SQLite's transactions are serializable; a deferred one reads a snapshot.
            (Dialect::Sqlite, _) => &["BEGIN"],
            (_, Begin::Write) => &["BEGIN"],
            (Dialect::Postgres, Begin::ReadCommitted) => &["BEGIN ISOLATION LEVEL READ COMMITTED"],
            (Dialect::Postgres, Begin::Snapshot) => {
                &["BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"]
            }
            (Dialect::MySql, Begin::ReadCommitted) => &MYSQL_READ_COMMITTED,
            (Dialect::MySql, Begin::Snapshot) => {
                &["START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY"]
            }
        }
    }
}

/// Ends a transaction, keeping its writes (for a driver that ends its transactions with text).
pub const COMMIT: &str = "COMMIT";

/// Ends a transaction, undoing its writes.
pub const ROLLBACK: &str = "ROLLBACK";

/// Takes the savepoint of a nested call at `depth` (1 for the first), for a driver without
/// nested transactions of its own (tokio-postgres; sqlx and SeaORM number theirs).
pub fn nested_savepoint(depth: usize) -> String {
    format!("SAVEPOINT idem_nested_{depth}")
}

/// Keeps what was written since the savepoint at `depth` and ends it.
pub fn release_nested_savepoint(depth: usize) -> String {
    format!("RELEASE SAVEPOINT idem_nested_{depth}")
}

/// Undoes what was written since the savepoint at `depth` and ends it (a rollback to a
/// savepoint keeps it, so it is released too).
pub fn roll_back_nested_savepoint(depth: usize) -> String {
    format!("ROLLBACK TO SAVEPOINT idem_nested_{depth}; RELEASE SAVEPOINT idem_nested_{depth}")
}

/// MySQL: makes the next transaction READ COMMITTED (run before `BEGIN`), so the outbox's
/// three-step claim's plain read of eligible ids sees messages committed since a snapshot
/// would have been taken.
const SET_NEXT_READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// MySQL sets the next transaction's level before it begins.
const MYSQL_READ_COMMITTED: [&str; 2] = [SET_NEXT_READ_COMMITTED, "START TRANSACTION"];

#[cfg(test)]
mod tests {
    use super::Begin;
    use crate::Dialect;

    #[test]
    fn a_write_transaction_takes_sqlite_s_lock_up_front_and_no_other_dialect_changes_its_level() {
        assert_eq!(Dialect::Sqlite.begin(Begin::Write), ["BEGIN IMMEDIATE"]);
        assert_eq!(Dialect::Postgres.begin(Begin::Write), ["BEGIN"]);
        assert_eq!(Dialect::MySql.begin(Begin::Write), ["BEGIN"]);
        // MySQL sets the level of the next transaction, so the setting comes first.
        let read_committed = Dialect::MySql.begin(Begin::ReadCommitted);
        assert_eq!(read_committed.len(), 2);
        assert!(
            read_committed[0].contains("READ COMMITTED"),
            "{read_committed:?}"
        );
        for dialect in [Dialect::Postgres, Dialect::MySql] {
            let snapshot = dialect.begin(Begin::Snapshot).join("; ");
            assert!(snapshot.contains("READ ONLY"), "{dialect:?}: {snapshot}");
        }
    }
}
