//! How SeaORM runs [`idem_sql`]'s statements: which flavour a connection speaks (`flavour`),
//! the dialect as SeaORM names it, a bound statement as a SeaORM `Statement`, and what a
//! database error means (`error`).

pub(crate) mod error;
pub(crate) mod flavour;

use sea_orm::{DbBackend, Statement, Value};

pub(crate) use idem_sql::names::ALL_TABLES;
pub(crate) use idem_sql::{
    Bound, Dialect, Flavour, NewDeadLetter, NewMessage, NewRecord, Param, Purge, Sql, millis,
};
pub use idem_sql::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};

/// The statements of `backend` (on MySQL, of the server family this process talks to:
/// [`crate::driver::flavour`]).
pub(crate) fn of(backend: DbBackend) -> &'static Sql {
    Sql::of(flavour(backend))
}

/// The flavour of `backend` (on MySQL, as far as this process knows yet).
pub(crate) fn flavour(backend: DbBackend) -> Flavour {
    match backend {
        DbBackend::Postgres => Flavour::Postgres,
        DbBackend::MySql if crate::driver::flavour::mysql_without_returning() => Flavour::MySql8,
        DbBackend::MySql if crate::driver::flavour::galera() => Flavour::Galera,
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

/// Writes `?` placeholders the way `backend` wants them: PostgreSQL numbers them (`$1`,
/// `$2`, …), MySQL and SQLite keep `?`. For raw SQL that runs on every backend; the template
/// must not contain `?` anywhere but in placeholders.
pub fn placeholders(backend: DbBackend, template: &str) -> String {
    idem_sql::placeholders(dialect(backend), template)
}

/// `bound` as SeaORM runs it, in the dialect of `sql`.
pub(crate) fn statement(sql: &Sql, bound: Bound<'_>) -> Statement {
    Statement::from_sql_and_values(
        backend(sql),
        bound.sql.into_owned(),
        bound.params.into_iter().map(value),
    )
}

/// A bound value as SeaORM binds it.
fn value(param: Param) -> Value {
    match param {
        Param::I64(v) => v.into(),
        Param::I32(v) => v.into(),
        Param::I16(v) => v.into(),
        Param::Bytes(v) => v.into(),
        Param::Text(v) => v.into(),
    }
}
