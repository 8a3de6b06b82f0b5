//! How SeaORM runs [`idem_sql`]'s statements: which flavour a connection speaks (`flavour`),
//! the dialect as SeaORM names it, a bound statement as a SeaORM `Statement`, and what a
//! database error means (`error`).

pub(crate) mod error;
pub(crate) mod flavour;

use sea_orm::{DatabaseConnection, DbBackend, Statement, Value};

pub(crate) use idem_sql::names::ALL_TABLES;
pub(crate) use idem_sql::{
    Bound, Dialect, NewDeadLetter, NewMessage, NewRecord, Param, Sql, millis,
};
pub use idem_sql::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};

/// The statements `backend` runs outside a claim: the same on every server of its dialect
/// ([`Sql::common`]).
pub(crate) fn of(backend: DbBackend) -> &'static Sql {
    Sql::common(dialect(backend))
}

/// Every statement of the server `db` talks to, the claim's included (on MySQL, of its
/// family: [`flavour`]).
pub(crate) async fn of_server(db: &DatabaseConnection) -> &'static Sql {
    Sql::of(flavour::of(db).await)
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
