//! Every SQL statement the crate runs, rendered once per backend into one table, [`Sql`].
//!
//! Statements are written as templates and go through one function, [`render`]: `{ledger}`,
//! `{steps}`, `{outbox}`, `{heads}` and `{dead_letters}` stand for the table names below (so
//! each name is spelled once), `{now}` for the backend's database clock, and each `?` for a
//! bound value (numbered `$1`, `$2`, … on PostgreSQL). Each family of tables has a file:
//! the ledger (and the claim's savepoint), the steps of lease mode, the outbox.

mod lease;
mod ledger;

use std::sync::LazyLock;

use sea_orm::DbBackend;

pub(crate) use ledger::Purge;

/// Name of the ledger table.
pub const LEDGER_TABLE: &str = "idem_ledger";
/// Name of the table of recorded steps (recovery points) of calls in progress.
pub const STEPS_TABLE: &str = "idem_steps";
/// Name of the outbox table.
pub const OUTBOX_TABLE: &str = "idem_outbox";
/// Name of the table holding each aggregate's last sequence number.
pub const OUTBOX_HEADS_TABLE: &str = "idem_outbox_heads";
/// Name of the table of messages a consumer gave up on.
pub const DEAD_LETTERS_TABLE: &str = "idem_dead_letters";

/// The savepoint a claim takes before the handler's body runs.
const CLAIM_SAVEPOINT: &str = "idem_claim";

/// Every statement of one backend. Placeholders are positional, in the order the caller binds
/// them (each statement's doc says which).
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) backend: DbBackend,
    /// The database clock in epoch milliseconds, as an SQL expression (spliced into the
    /// statements; kept for tests that check every statement uses it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) now: &'static str,
    pub(crate) ledger: ledger::LedgerStatements,
    pub(crate) lease: lease::LeaseStatements,
}

impl Sql {
    /// The statements of `backend`.
    pub(crate) fn of(backend: DbBackend) -> &'static Sql {
        static POSTGRES: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::Postgres));
        static MYSQL: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::MySql));
        static SQLITE: LazyLock<Sql> = LazyLock::new(|| Sql::new(DbBackend::Sqlite));
        match backend {
            DbBackend::Postgres => &POSTGRES,
            DbBackend::MySql => &MYSQL,
            _ => &SQLITE,
        }
    }

    fn new(backend: DbBackend) -> Sql {
        Sql {
            backend,
            now: now(backend),
            ledger: ledger::statements(backend),
            lease: lease::statements(backend),
        }
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

/// Renders a statement template for `backend`: splices in the names and the database clock,
/// then numbers the placeholders ([`placeholders`]).
pub(crate) fn render(backend: DbBackend, template: &str) -> String {
    let sql = template
        // Index names are their table's name and a suffix.
        .replace("{ledger_expires}", "{ledger}_expires")
        .replace("{claim_savepoint}", CLAIM_SAVEPOINT)
        .replace("{ledger}", LEDGER_TABLE)
        .replace("{steps}", STEPS_TABLE)
        .replace("{outbox}", OUTBOX_TABLE)
        .replace("{heads}", OUTBOX_HEADS_TABLE)
        .replace("{dead_letters}", DEAD_LETTERS_TABLE)
        .replace("{now}", now(backend));
    placeholders(backend, &sql)
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
mod tests {
    use super::*;

    #[test]
    fn postgres_placeholders_are_numbered_in_order() {
        let d = &Sql::of(DbBackend::Postgres).ledger;
        assert!(d.claim.contains("VALUES ($1, $2, $3, $4, $5, $6, 0, NULL,"));
        assert!(
            d.claim
                .contains("+ $7) ON CONFLICT (id) DO NOTHING RETURNING owner,")
        );
        assert!(
            d.claim
                .ends_with("WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)")
        );
        assert!(d.record.contains("WHERE id = $3 AND owner = $4"));
        assert!(!d.read_locked.contains('?'));
    }

    #[test]
    fn every_statement_reads_the_database_clock() {
        for backend in [DbBackend::Postgres, DbBackend::MySql, DbBackend::Sqlite] {
            let sql = Sql::of(backend);
            let d = &sql.ledger;
            let purge = match &d.purge {
                Purge::ByIndex(sql) => vec![sql],
                Purge::Sweep {
                    delete,
                    delete_rest,
                    ..
                } => vec![delete, delete_rest],
            };
            for statement in [&d.claim, &d.read_locked, &d.take_over]
                .into_iter()
                .chain(purge)
            {
                assert!(statement.contains(sql.now), "{backend:?}: {statement}");
            }
        }
    }
}
