//! sqlx as idem-sql's [`Driver`]: a pool ([`Sqlx`]), a pooled connection ([`SqlxPooled`]), an
//! owned transaction ([`SqlxTx`]) and a borrowed connection ([`SqlxConn`], a claim's
//! transaction or a handler's body), each running idem-sql's bound statements through the
//! [`Backend`] primitives. The store's features run on them through [`Bridge`] ([`on`]).

use std::time::Duration;

use idem_sql::{Begin, Bound, Bridge, Connection, Dialect, Driver, Failure, MySqlServer, Row};
use sqlx::pool::PoolConnection;
use sqlx::{Pool, Transaction};

use super::Backend;
use super::error::{CREATE_TABLES, classify};
use super::pooler;

/// A sqlx pool as idem's driver. Cloning it shares the pool.
pub(crate) struct Sqlx<DB: Backend> {
    pool: Pool<DB>,
}

impl<DB: Backend> Sqlx<DB> {
    /// The driver on `pool`.
    pub(crate) fn new(pool: Pool<DB>) -> Self {
        Sqlx { pool }
    }
}

impl<DB: Backend> Clone for Sqlx<DB> {
    fn clone(&self) -> Self {
        Sqlx::new(self.pool.clone())
    }
}

impl<DB: Backend> std::fmt::Debug for Sqlx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Sqlx").field(&DB::NAME).finish()
    }
}

/// A borrowed sqlx connection (a transaction's, a body's, a pooled one's) as the port runs
/// statements on it.
pub(crate) struct SqlxConn<'c, DB: Backend> {
    conn: &'c mut DB::Connection,
    /// Whether statements are named ([`crate::through_transaction_pooler`]).
    named: bool,
}

impl<'c, DB: Backend> SqlxConn<'c, DB> {
    /// `conn`, its statements named or not.
    pub(crate) fn new(conn: &'c mut DB::Connection, named: bool) -> Self {
        SqlxConn { conn, named }
    }
}

/// A borrowed sqlx connection as every per-feature port of idem-sql (claim, lease, completer,
/// purge, outbox), its errors a [`Fault`](idem_sql::Fault).
pub(crate) type On<'c, DB> = Bridge<SqlxConn<'c, DB>, Sqlx<DB>>;

/// `conn` as the per-feature ports, its statements named or not.
pub(crate) fn on<DB: Backend>(conn: &mut DB::Connection, named: bool) -> On<'_, DB> {
    Bridge::new(SqlxConn::new(conn, named))
}

impl<DB: Backend> Connection for SqlxConn<'_, DB> {
    type Error = sqlx::Error;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, sqlx::Error> {
        DB::execute(self.conn, statement, self.named).await
    }

    async fn fetch_all(&mut self, statement: Bound<'static>) -> Result<Vec<Row>, sqlx::Error> {
        DB::fetch_rows(self.conn, statement, self.named).await
    }

    async fn execute_unprepared(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        DB::execute_unprepared(self.conn, sql).await
    }
}

/// A pooled sqlx connection outside any transaction.
pub(crate) struct SqlxPooled<DB: Backend> {
    conn: PoolConnection<DB>,
    named: bool,
}

impl<DB: Backend> Connection for SqlxPooled<DB> {
    type Error = sqlx::Error;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, sqlx::Error> {
        DB::execute(&mut self.conn, statement, self.named).await
    }

    async fn fetch_all(&mut self, statement: Bound<'static>) -> Result<Vec<Row>, sqlx::Error> {
        DB::fetch_rows(&mut self.conn, statement, self.named).await
    }

    async fn execute_unprepared(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        DB::execute_unprepared(&mut self.conn, sql).await
    }
}

/// An owned sqlx transaction. Dropped open, sqlx queues its `ROLLBACK` for the connection's
/// next use, before the pool hands it to anyone else.
pub(crate) struct SqlxTx<DB: Backend> {
    tx: Transaction<'static, DB>,
    named: bool,
}

impl<DB: Backend> Connection for SqlxTx<DB> {
    type Error = sqlx::Error;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, sqlx::Error> {
        DB::execute(&mut self.tx, statement, self.named).await
    }

    async fn fetch_all(&mut self, statement: Bound<'static>) -> Result<Vec<Row>, sqlx::Error> {
        DB::fetch_rows(&mut self.tx, statement, self.named).await
    }

    async fn execute_unprepared(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        DB::execute_unprepared(&mut self.tx, sql).await
    }
}

impl<DB: Backend> idem_sql::Transaction for SqlxTx<DB> {
    async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// A transaction on `pool` begun `how`, by idem-sql's text for the dialect.
pub(crate) async fn begin<DB: Backend>(
    pool: &Pool<DB>,
    how: Begin,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    match DB::DIALECT.begin(how) {
        [begin] => pool.begin_with(*begin).await,
        // A session setting first (MySQL's isolation level for the next transaction), then
        // the `BEGIN` on the same connection.
        statements => {
            let mut conn = pool.acquire().await?;
            let (begin, settings) = statements.split_last().ok_or(sqlx::Error::BeginFailed)?;
            for setting in settings {
                DB::execute_unprepared(&mut conn, setting).await?;
            }
            // `Transaction::begin` is hidden from sqlx's docs, but it is how its own
            // `Pool::begin_with` turns a pooled connection into an owned transaction.
            Transaction::begin(conn, Some(sqlx::SqlSafeStr::into_sql_str(*begin))).await
        }
    }
}

/// Begins a claim's (or a lease write's, a final phase's) transaction on `pool`: idem-sql's
/// [`Begin::Write`](idem_sql::Begin::Write), which takes SQLite's write lock up front.
pub(crate) async fn begin_claim<DB: Backend>(
    pool: &Pool<DB>,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    begin(pool, Begin::Write).await
}

impl<DB: Backend> Driver for Sqlx<DB> {
    type Error = sqlx::Error;
    type Pooled = SqlxPooled<DB>;
    type Tx = SqlxTx<DB>;
    type Body<'t> = &'t mut DB::Connection;

    const CREATE_TABLES: &'static str = CREATE_TABLES;

    fn dialect(&self) -> Dialect {
        DB::DIALECT
    }

    fn server(&self) -> Option<MySqlServer> {
        DB::server(&self.pool)
    }

    fn identity(&self) -> Option<usize> {
        Some(pooler::identity(&self.pool))
    }

    fn connection_wait(&self) -> Option<Duration> {
        (DB::DIALECT != Dialect::Sqlite).then(|| self.pool.options().get_acquire_timeout())
    }

    async fn acquire(&self) -> Result<SqlxPooled<DB>, sqlx::Error> {
        Ok(SqlxPooled {
            conn: self.pool.acquire().await?,
            named: pooler::named(&self.pool),
        })
    }

    async fn begin(&self, how: Begin) -> Result<SqlxTx<DB>, sqlx::Error> {
        Ok(SqlxTx {
            tx: begin(&self.pool, how).await?,
            named: pooler::named(&self.pool),
        })
    }

    fn body(tx: &mut SqlxTx<DB>) -> &mut DB::Connection {
        &mut tx.tx
    }

    fn reborrow<'t, 'c: 't>(body: &'t mut &'c mut DB::Connection) -> &'t mut DB::Connection {
        body
    }

    fn on_body<'t, 'c: 't>(
        body: &'t mut &'c mut DB::Connection,
    ) -> impl Connection<Error = sqlx::Error> + 't {
        // A body's connection may run the user's own named statements; idem's run unnamed
        // there, which any server connection (a pooler's too) takes.
        SqlxConn::<DB>::new(body, false)
    }

    fn classify(error: &sqlx::Error) -> Failure {
        classify(error)
    }
}
