//! Every SQL statement the crate runs, rendered once per backend into one table, [`Sql`].
//!
//! Statements are written as templates and go through one function, [`render`]: `{ledger}`,
//! `{steps}`, `{outbox}`, `{heads}` and `{dead_letters}` stand for the table names below (so
//! each name is spelled once), `{now}` for the backend's database clock, and each `?` for a
//! bound value (numbered `$1`, `$2`, … on PostgreSQL). Each family of tables has a file:
//! the ledger (and the claim's savepoint), the steps of lease mode, the outbox.

mod lease;
mod ledger;
mod outbox;

use std::sync::LazyLock;

use sea_orm::DbBackend;

pub(crate) use ledger::Purge;
pub(crate) use outbox::state as outbox_state;

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
/// The PostgreSQL channel a staged message notifies relays on: the outbox's name.
pub(crate) const WAKE_CHANNEL: &str = OUTBOX_TABLE;

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
    pub(crate) outbox: outbox::OutboxStatements,
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
            outbox: outbox::statements(backend),
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

/// Renders a statement template for `backend`: splices in the shared fragments, the names and
/// the database clock, then numbers the placeholders ([`placeholders`]). An `{ids}` list stays
/// for [`with_ids`] to fill in when the ids are known.
fn render(backend: DbBackend, template: &str) -> String {
    let sql = template
        // Fragments first: they contain names.
        .replace("{due}", outbox::DUE)
        .replace("{first_in_aggregate}", outbox::FIRST_IN_AGGREGATE)
        .replace("{claimed_columns}", outbox::CLAIMED_COLUMNS)
        .replace("{insert_columns}", outbox::INSERT_COLUMNS)
        // Index names are their table's name and a suffix.
        .replace("{ledger_expires}", "{ledger}_expires")
        .replace("{outbox_pending}", "{outbox}_pending")
        .replace("{outbox_aggregate}", "{outbox}_aggregate")
        .replace("{outbox_published}", "{outbox}_published")
        .replace("{claim_savepoint}", CLAIM_SAVEPOINT)
        .replace("{wake_channel}", WAKE_CHANNEL)
        .replace("{ledger}", LEDGER_TABLE)
        .replace("{steps}", STEPS_TABLE)
        .replace("{outbox}", OUTBOX_TABLE)
        .replace("{heads}", OUTBOX_HEADS_TABLE)
        .replace("{dead_letters}", DEAD_LETTERS_TABLE)
        .replace("{pending}", &outbox_state::PENDING.to_string())
        .replace("{published}", &outbox_state::PUBLISHED.to_string())
        .replace("{dead}", &outbox_state::DEAD.to_string())
        .replace("{now}", now(backend));
    placeholders(backend, &sql)
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
mod tests {
    use super::*;

    const BACKENDS: [DbBackend; 3] = [DbBackend::Postgres, DbBackend::MySql, DbBackend::Sqlite];

    /// Every statement of `sql` as it runs (`{ids}` lists filled with two ids).
    fn every_statement(sql: &Sql) -> Vec<String> {
        let (ledger, lease, outbox) = (&sql.ledger, &sql.lease, &sql.outbox);
        let purge = match &ledger.purge {
            Purge::ByIndex(purge) => vec![purge],
            Purge::Sweep {
                bound,
                delete,
                delete_rest,
            } => vec![bound, delete, delete_rest],
        };
        let ledger_statements = [
            &ledger.claim,
            &ledger.claim_nowait,
            &ledger.read_locked,
            &ledger.take_over,
            &ledger.record,
            &ledger.select_now,
            &ledger.savepoint,
            &ledger.rollback_to_savepoint,
        ];
        let lease_statements = [
            &lease.select_steps,
            &lease.insert_step,
            &lease.delete_steps,
            &lease.renew,
            &lease.complete,
            &lease.release,
            &lease.expired,
            &lease.purge_orphans,
        ];
        let outbox_statements = [
            &outbox.insert_with_aggregate,
            &outbox.insert,
            &outbox.claim,
            &outbox.select_eligible,
            &outbox.lock_claimable,
            &outbox.lease,
            &outbox.mark_published,
            &outbox.mark_failed,
            &outbox.purge_published,
            &outbox.health,
            &outbox.list_dead,
            &outbox.retry_dead,
            &outbox.record_dead_letter,
        ];
        [&ledger.create, &ledger.drop, &lease.create, &lease.drop]
            .into_iter()
            .chain([&outbox.create, &outbox.drop])
            .flatten()
            .chain(ledger_statements)
            .chain(purge)
            .chain(lease_statements)
            .chain(outbox.bump_head.iter())
            .chain(outbox_statements)
            .filter(|statement| !statement.is_empty())
            .map(|statement| with_ids(sql.backend, statement, 2))
            .collect()
    }

    #[test]
    fn every_name_in_a_template_is_spliced() {
        for backend in BACKENDS {
            for statement in every_statement(Sql::of(backend)) {
                assert!(!statement.contains('{'), "{backend:?}: {statement}");
            }
        }
    }

    #[test]
    fn postgres_placeholders_are_numbered_in_order() {
        for statement in every_statement(Sql::of(DbBackend::Postgres)) {
            assert!(!statement.contains('?'), "{statement}");
            let mut highest = 0;
            for number in statement.split('$').skip(1) {
                let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
                let n: u32 = digits.parse().expect(&statement);
                // A placeholder is new (the next number) or one already bound, as the
                // claim's `id = $1` is.
                assert!(n <= highest + 1, "${n} after ${highest}: {statement}");
                highest = highest.max(n);
            }
        }
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
    }

    #[test]
    fn id_lists_are_numbered_after_the_leading_placeholders() {
        let sql = &Sql::of(DbBackend::Postgres).outbox.mark_published;
        let filled = with_ids(DbBackend::Postgres, sql, 3);
        assert!(filled.contains("locked_by = $1"), "{filled}");
        assert!(filled.ends_with("id IN ($2, $3, $4)"), "{filled}");
        let sql = &Sql::of(DbBackend::MySql).outbox.mark_published;
        let filled = with_ids(DbBackend::MySql, sql, 2);
        assert!(filled.ends_with("id IN (?, ?)"), "{filled}");
    }

    #[test]
    fn expiry_and_leases_are_measured_on_the_database_clock() {
        for backend in BACKENDS {
            let sql = Sql::of(backend);
            let (ledger, lease) = (&sql.ledger, &sql.lease);
            let purge = match &ledger.purge {
                Purge::ByIndex(purge) => vec![purge],
                Purge::Sweep {
                    delete,
                    delete_rest,
                    ..
                } => vec![delete, delete_rest],
            };
            let clocked = [&ledger.claim, &ledger.read_locked, &ledger.take_over]
                .into_iter()
                .chain(purge)
                .chain([
                    &lease.renew,
                    &lease.complete,
                    &lease.release,
                    &lease.expired,
                ]);
            for statement in clocked {
                assert!(statement.contains(sql.now), "{backend:?}: {statement}");
            }
        }
    }
}
