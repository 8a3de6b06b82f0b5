//! What differs between sqlx's drivers, as far as the store cares: how a claim begins, how a
//! statement's values are bound and its ledger row decoded, which server flavour a pool
//! talks to. One impl per database, written once by a macro over the concrete types (sqlx's
//! generic bounds for "any database whose connection executes queries" do not normalise).

pub(crate) mod error;
pub(crate) mod pooler;

use std::future::Future;
use std::pin::Pin;

use idem_sql::{
    Bound, CallColumns, ClaimRow, ClaimedRow, DeadMessage, Dialect, ExpiredLease, Flavour,
    StuckLease,
};
use sqlx::{Pool, Transaction};
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
use {idem_sql::Param, std::borrow::Cow};

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

    /// The flavour of the server `pool` talks to (on the MySQL protocol, learnt once per
    /// server from its version).
    #[doc(hidden)]
    fn flavour(pool: &Pool<Self>) -> impl Future<Output = Flavour> + Send;

    /// Begins a claim's transaction (SQLite takes its write lock up front).
    #[doc(hidden)]
    fn begin_claim(pool: &Pool<Self>) -> Step<'_, Transaction<'static, Self>>;

    /// Runs `statement` and decodes the ledger row it returns, if any. `named`: as a named
    /// (cached) prepared statement, or unnamed ([`crate::through_transaction_pooler`]); the
    /// same for every statement below.
    #[doc(hidden)]
    fn fetch_row<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Option<ClaimRow>>;

    /// Runs `statement` and returns how many rows it changed.
    #[doc(hidden)]
    fn execute<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, u64>;

    /// Runs `statement` and reads the one text column of each row it returns.
    #[doc(hidden)]
    fn fetch_texts<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<String>>;

    /// Runs `statement` and reads each row's `name, result` (lease mode's recorded steps).
    #[doc(hidden)]
    fn fetch_steps<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<(String, Vec<u8>)>>;

    /// Runs `statement` and reads the one integer column of each row it returns (the
    /// outbox's eligible ids).
    #[doc(hidden)]
    fn fetch_ids<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<i64>>;

    /// Runs `statement` and reads the outbox rows it claimed.
    #[doc(hidden)]
    fn fetch_claimed<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<ClaimedRow>>;

    /// Runs `statement` and reads its one row of four nullable integers (the outbox's
    /// health figures).
    #[doc(hidden)]
    fn fetch_figures<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, [Option<i64>; 4]>;

    /// Runs `statement` and decodes each due call it returns (the completer's
    /// [`idem_sql::Completer::due_calls`]).
    #[doc(hidden)]
    fn fetch_calls<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<CallColumns>>;

    /// Runs `statement` and reads the one nullable integer it returns (`None`: no row, or
    /// NULL).
    #[doc(hidden)]
    fn fetch_millis<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Option<i64>>;

    /// Runs `statement` and reads the one bytes column of the row it returns, if any (the
    /// purge's next key).
    #[doc(hidden)]
    fn fetch_key<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Option<Vec<u8>>>;

    /// Runs `statement` and reads each row's `scope, count`.
    #[doc(hidden)]
    fn fetch_counts<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<(String, i64)>>;

    /// Runs `sql`, which takes no values, as a simple (unprepared) query.
    #[doc(hidden)]
    fn execute_unprepared<'c>(conn: &'c mut Self::Connection, sql: &'c str) -> Step<'c, ()>;

    /// Runs [`Lease::expired_leases`](idem_sql::Lease::expired_leases) and reads its rows.
    #[doc(hidden)]
    fn fetch_expired_leases<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<ExpiredLease>>;

    /// Runs [`Lease::stuck_leases`](idem_sql::Lease::stuck_leases) and reads its rows.
    #[doc(hidden)]
    fn fetch_stuck_leases<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<StuckLease>>;

    /// Runs [`Outbox::list_dead`](idem_sql::Outbox::list_dead) and reads its rows.
    #[doc(hidden)]
    fn fetch_dead_messages<'c>(
        conn: &'c mut Self::Connection,
        statement: Bound<'static>,
        named: bool,
    ) -> Step<'c, Vec<DeadMessage>>;
}

/// The body of a `Backend` method that runs `statement` and decodes each row it returns with
/// `decode` (inside the `backend!` impl, where `Self` is the database).
#[allow(unused_macros)]
macro_rules! each_row {
    ($conn:ident, $statement:ident, $named:ident, |$row:ident| $decode:expr) => {
        Box::pin(async move {
            use sqlx::Row as _;
            let rows = query::<Self>($statement, $named)
                .fetch_all(&mut *$conn)
                .await?;
            rows.iter().map(|$row| $decode).collect()
        })
    };
}

// Unused when no database feature is on.
#[allow(unused_macros)]
macro_rules! backend {
    ($db:ty, $dialect:expr, flavour = |$pool:ident| $flavour:expr, begin = |$bpool:ident| $begin:expr) => {
        impl sealed::Sealed for $db {}

        impl Backend for $db {
            const DIALECT: Dialect = $dialect;

            #[allow(clippy::manual_async_fn)]
            fn flavour($pool: &Pool<Self>) -> impl Future<Output = Flavour> + Send {
                async move { $flavour }
            }

            fn begin_claim($bpool: &Pool<Self>) -> Step<'_, Transaction<'static, Self>> {
                Box::pin(async move { $begin })
            }

            fn fetch_row<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Option<ClaimRow>> {
                Box::pin(async move {
                    use sqlx::Row as _;
                    let query = query::<Self>(statement, named);
                    let Some(row) = query.fetch_optional(&mut *conn).await? else {
                        return Ok(None);
                    };
                    Ok(Some(ClaimRow::from_columns(
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                    )))
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

            fn fetch_texts<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<String>> {
                each_row!(conn, statement, named, |row| row.try_get(0))
            }

            fn fetch_steps<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<(String, Vec<u8>)>> {
                each_row!(conn, statement, named, |row| Ok((
                    row.try_get(0)?,
                    row.try_get(1)?
                )))
            }

            fn fetch_ids<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<i64>> {
                each_row!(conn, statement, named, |row| row.try_get(0))
            }

            fn fetch_claimed<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<ClaimedRow>> {
                each_row!(conn, statement, named, |row| {
                    Ok(ClaimedRow {
                        id: row.try_get(0)?,
                        message_id: row.try_get(1)?,
                        topic: row.try_get(2)?,
                        aggregate: row.try_get(3)?,
                        aggregate_seq: row.try_get(4)?,
                        headers: row.try_get(5)?,
                        payload: row.try_get(6)?,
                        attempts: row.try_get(7)?,
                    })
                })
            }

            fn fetch_figures<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, [Option<i64>; 4]> {
                Box::pin(async move {
                    use sqlx::Row as _;
                    let query = query::<Self>(statement, named);
                    let row = query.fetch_one(&mut *conn).await?;
                    Ok([
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                    ])
                })
            }

            fn fetch_calls<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<CallColumns>> {
                each_row!(conn, statement, named, |row| {
                    Ok((
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                        row.try_get(6)?,
                        row.try_get(7)?,
                        row.try_get(8)?,
                    ))
                })
            }

            fn fetch_millis<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Option<i64>> {
                Box::pin(async move {
                    use sqlx::Row as _;
                    let query = query::<Self>(statement, named);
                    let row = query.fetch_optional(&mut *conn).await?;
                    Ok(row.map(|row| row.try_get(0)).transpose()?.flatten())
                })
            }

            fn fetch_key<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Option<Vec<u8>>> {
                Box::pin(async move {
                    use sqlx::Row as _;
                    let query = query::<Self>(statement, named);
                    let row = query.fetch_optional(&mut *conn).await?;
                    row.map(|row| row.try_get(0)).transpose()
                })
            }

            fn fetch_counts<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<(String, i64)>> {
                each_row!(conn, statement, named, |row| Ok((
                    row.try_get(0)?,
                    row.try_get(1)?
                )))
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

            fn fetch_expired_leases<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<ExpiredLease>> {
                each_row!(conn, statement, named, |row| {
                    Ok(ExpiredLease::from_columns(
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                        row.try_get(6)?,
                    ))
                })
            }

            fn fetch_stuck_leases<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<StuckLease>> {
                each_row!(conn, statement, named, |row| {
                    Ok(StuckLease::from_columns(
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                        row.try_get(6)?,
                        row.try_get(7)?,
                    ))
                })
            }

            fn fetch_dead_messages<'c>(
                conn: &'c mut Self::Connection,
                statement: Bound<'static>,
                named: bool,
            ) -> Step<'c, Vec<DeadMessage>> {
                each_row!(conn, statement, named, |row| {
                    Ok(DeadMessage::from_columns(
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                        row.try_get(6)?,
                    ))
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
backend!(
    sqlx::Postgres,
    Dialect::Postgres,
    flavour = |pool| {
        let _ = pool;
        Flavour::Postgres
    },
    // PostgreSQL stays at READ COMMITTED (REPEATABLE READ turns the race into 40001).
    begin = |pool| pool.begin().await
);

#[cfg(feature = "mysql")]
backend!(
    sqlx::MySql,
    Dialect::MySql,
    flavour = |pool| mysql::flavour(pool).await,
    // MySQL's REPEATABLE READ is fine: the claim reads with FOR UPDATE.
    begin = |pool| pool.begin().await
);

#[cfg(feature = "sqlite")]
backend!(
    sqlx::Sqlite,
    Dialect::Sqlite,
    flavour = |pool| {
        let _ = pool;
        Flavour::Sqlite
    },
    // Take SQLite's write lock up front: a deferred transaction that reads and then writes
    // fails with SQLITE_BUSY instead of waiting.
    begin = |pool| pool.begin_with("BEGIN IMMEDIATE").await
);

#[cfg(feature = "mysql")]
mod mysql {
    //! Which MySQL-protocol family a pool's server is, learnt once per server
    //! ([`MySqlServer`]).

    use idem_sql::{Flavour, MySqlServer};
    use sqlx::{MySql, Pool};

    pub(super) async fn flavour(pool: &Pool<MySql>) -> Flavour {
        let options = pool.connect_options();
        let server = MySqlServer::new(
            options.get_host(),
            options.get_port(),
            options.get_database(),
        );
        if let Some(flavour) = server.learnt() {
            return flavour;
        }
        let version: Option<String> = sqlx::query_scalar(idem_sql::SELECT_VERSION)
            .fetch_one(pool)
            .await
            .ok();
        let wsrep_on: Option<i64> = sqlx::query_scalar(idem_sql::SELECT_WSREP_ON)
            .fetch_one(pool)
            .await
            .ok();
        server.learn(version.as_deref(), wsrep_on)
    }
}
