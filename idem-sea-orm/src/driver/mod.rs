//! How SeaORM runs [`idem_sql`]'s statements: which flavour a connection speaks (`flavour`),
//! the dialect as SeaORM names it, a bound statement as a SeaORM `Statement`, its rows read at
//! the column types the statement declares (idem-sql decodes them), SeaORM as the port's
//! driver (`port`), and what a database error means (`error`).

pub(crate) mod error;
pub(crate) mod flavour;
pub(crate) mod port;

use idem_sql::{Column, Row};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, QueryResult, Statement, Value,
};

pub(crate) use idem_sql::{Bound, Dialect, Param, Sql};
pub use idem_sql::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};

/// The statements `backend` runs outside a claim: the same on every server of its dialect
/// ([`Sql::common`]).
pub(crate) fn of(backend: DbBackend) -> &'static Sql {
    Sql::common(dialect(backend))
}

/// idem-sql's name for the dialect SeaORM calls `backend`.
pub(crate) fn dialect(backend: DbBackend) -> Dialect {
    match backend {
        DbBackend::Postgres => Dialect::Postgres,
        DbBackend::MySql => Dialect::MySql,
        _ => Dialect::Sqlite,
    }
}

/// A number the clones of `db`'s pool share and no other pool has (its shared options live
/// once per pool, whichever clone reaches them); `None` for other connection kinds (a mock, a
/// proxy), which fly without single flight.
pub(crate) fn pool_identity(db: &DatabaseConnection) -> Option<usize> {
    #[allow(unused_imports)]
    use sea_orm::DatabaseConnectionType as Kind;
    match &db.inner {
        #[cfg(feature = "sqlite")]
        Kind::SqlxSqlitePoolConnection(_) => {
            Some(std::ptr::from_ref(db.get_sqlite_connection_pool().options()) as usize)
        }
        #[cfg(feature = "postgres")]
        Kind::SqlxPostgresPoolConnection(_) => {
            Some(std::ptr::from_ref(db.get_postgres_connection_pool().options()) as usize)
        }
        #[cfg(feature = "mysql")]
        Kind::SqlxMySqlPoolConnection(_) => {
            Some(std::ptr::from_ref(db.get_mysql_connection_pool().options()) as usize)
        }
        #[allow(unreachable_patterns)]
        _ => None,
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
    let backend = match sql.dialect {
        Dialect::Postgres => DbBackend::Postgres,
        Dialect::MySql => DbBackend::MySql,
        Dialect::Sqlite => DbBackend::Sqlite,
    };
    Statement::from_sql_and_values(
        backend,
        bound.sql.into_owned(),
        bound.params.into_iter().map(value),
    )
}

/// Runs `bound` on `db` and reads each row's columns at the types the statement declares
/// ([`Bound::columns`]), for idem-sql's readers to decode.
pub(crate) async fn fetch_rows<C: ConnectionTrait + ?Sized>(
    db: &C,
    sql: &Sql,
    bound: Bound<'_>,
) -> Result<Vec<Row>, DbErr> {
    let columns = bound.columns;
    let rows = db.query_all_raw(statement(sql, bound)).await?;
    rows.iter().map(|row| read_columns(row, columns)).collect()
}

/// A row's `columns`, each read as its declared type (integers widened).
fn read_columns(row: &QueryResult, columns: &[Column]) -> Result<Row, DbErr> {
    columns
        .iter()
        .enumerate()
        .map(|(i, column)| {
            Ok::<idem_sql::Value, DbErr>(match column {
                Column::I16 => row.try_get_by_index::<Option<i16>>(i)?.into(),
                Column::I32 => row.try_get_by_index::<Option<i32>>(i)?.into(),
                Column::I64 => row.try_get_by_index::<Option<i64>>(i)?.into(),
                Column::Bytes => row.try_get_by_index::<Option<Vec<u8>>>(i)?.into(),
                Column::Text => row.try_get_by_index::<Option<String>>(i)?.into(),
            })
        })
        .collect::<Result<Vec<_>, DbErr>>()
        .map(Row::new)
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
