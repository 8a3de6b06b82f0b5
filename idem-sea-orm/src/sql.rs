//! The SeaORM store's side of [`idem_sql`], where every statement lives: which flavour a
//! connection speaks ([`crate::flavour`]), and the dialect as SeaORM names it.

use sea_orm::DbBackend;

pub(crate) use idem_sql::names::{ALL_TABLES, WAKE_CHANNEL, outbox_state};
pub use idem_sql::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};
pub(crate) use idem_sql::{Dialect, Flavour, Purge, Sql, millis};

/// The statements of `backend` (on MySQL, of the server family this process talks to:
/// [`crate::flavour`]).
pub(crate) fn of(backend: DbBackend) -> &'static Sql {
    Sql::of(flavour(backend))
}

/// The flavour of `backend` (on MySQL, as far as this process knows yet).
pub(crate) fn flavour(backend: DbBackend) -> Flavour {
    match backend {
        DbBackend::Postgres => Flavour::Postgres,
        DbBackend::MySql if crate::flavour::mysql_without_returning() => Flavour::MySql8,
        DbBackend::MySql if crate::flavour::galera() => Flavour::Galera,
        DbBackend::MySql => Flavour::MariaDb,
        _ => Flavour::Sqlite,
    }
}

/// SeaORM's name for the dialect `sql` is written in.
pub(crate) fn backend(sql: &Sql) -> DbBackend {
    match sql.dialect {
        Dialect::Postgres => DbBackend::Postgres,
        Dialect::MySql => DbBackend::MySql,
        Dialect::Sqlite => DbBackend::Sqlite,
    }
}

fn dialect(backend: DbBackend) -> Dialect {
    match backend {
        DbBackend::Postgres => Dialect::Postgres,
        DbBackend::MySql => Dialect::MySql,
        _ => Dialect::Sqlite,
    }
}

/// Fills an `{ids}` list with `n` placeholders, numbered after those already in `sql`.
pub(crate) fn with_ids(backend: DbBackend, sql: &str, n: usize) -> String {
    idem_sql::with_ids(dialect(backend), sql, n)
}

/// Writes `?` placeholders the way `backend` wants them: PostgreSQL numbers them (`$1`,
/// `$2`, …), MySQL and SQLite keep `?`. For raw SQL that runs on every backend; the template
/// must not contain `?` anywhere but in placeholders.
pub fn placeholders(backend: DbBackend, template: &str) -> String {
    idem_sql::placeholders(dialect(backend), template)
}
