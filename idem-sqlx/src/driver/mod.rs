//! What differs between sqlx's drivers, as far as the store cares: how a statement's values
//! are bound and its columns read (at the types the statement declares; idem-sql decodes the
//! rows), which MySQL server a pool reaches. One impl per database,
//! written once by a macro over the concrete types (sqlx's generic bounds for "any database
//! whose connection executes queries" do not normalise).

pub(crate) mod error;
pub(crate) mod pooler;
pub(crate) mod port;

use std::future::Future;
use std::pin::Pin;

use idem_sql::{Bound, Dialect, MySqlServer, Row};
use sqlx::Pool;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
use {
    idem_sql::{Column, Param, Value},
    std::borrow::Cow,
};

/// A boxed future the store's generic code awaits.
pub(crate) type Step<'a, T> = Pin<Box<dyn Future<Output = Result<T, sqlx::Error>> + Send + 'a>>;

mod sealed {
    pub trait Sealed {}
}

/// A sqlx database idem's store runs on: `sqlx::Postgres` (feature `postgres`),
/// `sqlx::MySql` (`mysql`) and `sqlx::Sqlite` (`sqlite`). Sealed; its items are the
/// store's plumbing.
pub trait Backend: sqlx::Database + sealed::Sealed {
    /// The dialect of the database's statements.
    #[doc(hidden)]
    const DIALECT: Dialect;

    /// The MySQL server `pool` reaches, whose family this process learns once; `None` on
    /// the other databases.
    #[doc(hidden)]
    fn server(pool: &Pool<Self>) -> Option<MySqlServer>;

    /// Runs `statement` and reads each row's columns at the types the statement declares
    /// ([`Bound::columns`]). `named`: as a named (cached) prepared statement, or unnamed
    /// ([`crate::through_transaction_pooler`]); the same for every statement below.
    #[doc(hidden)]
    fn fetch_rows<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<Row>>;

    /// Runs `statement` and returns how many rows it changed.
    #[doc(hidden)]
    fn execute<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, u64>;

    /// Runs `sql`, which takes no values, as a simple (unprepared) query.
    #[doc(hidden)]
    fn execute_unprepared<'c>(conn: &'c mut Self::Connection, sql: &'c str) -> Step<'c, ()>;
}

// Unused when no database feature is on.
#[allow(unused_macros)]
macro_rules! backend {
    ($db:ty, $dialect:expr, server = |$pool:ident| $server:expr) => {
        impl sealed::Sealed for $db {}

        impl Backend for $db {
            const DIALECT: Dialect = $dialect;

            fn server($pool: &Pool<Self>) -> Option<MySqlServer> {
                $server
            }

            fn fetch_rows<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<Row>> {
                let columns = statement.columns;
                Box::pin(async move {
                    use sqlx::Row as _;
                    let rows = query::<Self>(statement, named)
                        .fetch_all(&mut *conn)
                        .await?;
                    rows.iter()
                        .map(|row| {
                            columns
                                .iter()
                                .enumerate()
                                .map(|(i, column)| -> Result<Value, sqlx::Error> {
                                    Ok(match column {
                                        Column::I16 => row.try_get::<Option<i16>, _>(i)?.into(),
                                        Column::I32 => row.try_get::<Option<i32>, _>(i)?.into(),
                                        Column::I64 => row.try_get::<Option<i64>, _>(i)?.into(),
                                        Column::Bytes => {
                                            row.try_get::<Option<Vec<u8>>, _>(i)?.into()
                                        }
                                        Column::Text => row.try_get::<Option<String>, _>(i)?.into(),
                                    })
                                })
                                .collect::<Result<Vec<_>, _>>()
                                .map(Row::new)
                        })
                        .collect()
                })
            }

            fn execute<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, u64> {
                Box::pin(async move {
                    let query = query::<Self>(statement, named);
                    Ok(query.execute(&mut *conn).await?.rows_affected())
                })
            }

            fn execute_unprepared<'c>(
                conn: &'c mut Self::Connection,
                sql: &'c str,
            ) -> Step<'c, ()> {
                Box::pin(async move {
                    use sqlx::Executor as _;
                    conn.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(sql)))
                        .await?;
                    Ok(())
                })
            }
        }

        impl Binds for $db {
            fn bind_one<'q>(
                query: sqlx::query::Query<'q, Self, <Self as sqlx::Database>::Arguments>,
                param: Param,
            ) -> sqlx::query::Query<'q, Self, <Self as sqlx::Database>::Arguments> {
                match param {
                    Param::I64(v) => query.bind(v),
                    Param::I32(v) => query.bind(v),
                    Param::I16(v) => query.bind(v),
                    Param::Bytes(v) => query.bind(v),
                    Param::Text(v) => query.bind(v),
                }
            }
        }
    };
}

/// Binds a [`Param`] the way one database takes it.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
trait Binds: sqlx::Database + sqlx::database::HasStatementCache {
    fn bind_one<'q>(
        query: sqlx::query::Query<'q, Self, <Self as sqlx::Database>::Arguments>,
        param: Param,
    ) -> sqlx::query::Query<'q, Self, <Self as sqlx::Database>::Arguments>;
}

/// `statement` as a sqlx query: its text (`'static`, so not copied), its values bound in
/// placeholder order, named ([`crate::through_transaction_pooler`]) or not.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn query<'q, DB: Binds>(
    statement: Bound<'static>,
    named: bool,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments> {
    use sqlx::SqlSafeStr;
    let sql = match statement.sql {
        Cow::Borrowed(sql) => sql.into_sql_str(),
        Cow::Owned(sql) => sqlx::AssertSqlSafe(sql).into_sql_str(),
    };
    let query = sqlx::query(sql).persistent(named);
    statement.params.into_iter().fold(query, DB::bind_one)
}

#[cfg(feature = "postgres")]
backend!(sqlx::Postgres, Dialect::Postgres, server = |_pool| None);

// The server a pool connects to, whose MySQL family this process learns once.
#[cfg(feature = "mysql")]
backend!(
    sqlx::MySql,
    Dialect::MySql,
    server = |pool| {
        let options = pool.connect_options();
        Some(MySqlServer::new(
            options.get_host(),
            options.get_port(),
            options.get_database(),
        ))
    }
);

#[cfg(feature = "sqlite")]
backend!(sqlx::Sqlite, Dialect::Sqlite, server = |_pool| None);
