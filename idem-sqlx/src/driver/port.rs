//! sqlx as idem-sql's [`Driver`]: a pool ([`Sqlx`]), and a connection ([`SqlxConn`]) held
//! pooled ([`SqlxPooled`]), as an owned transaction ([`SqlxTx`]) or borrowed (a handler's
//! body), running idem-sql's bound statements through the [`Backend`] primitives; and a pool
//! as the operator functions' [`Handle`].

use std::marker::PhantomData;
use std::ops::DerefMut;
use std::time::Duration;

use idem_core::BoxFuture;
use idem_sql::{
    Begin, Bound, Connection, Dialect, Driver, Failure, Handle, ListenError, MySqlServer, Row,
};
use sqlx::pool::PoolConnection;
use sqlx::{Pool, Transaction};
use sqlx_core::transaction::TransactionManager;

use super::Backend;
use super::error::{CREATE_TABLES, classify};
use super::pooler;

/// A sqlx pool as idem's driver ([`idem_sql::Driver`]): what idem's one store runs on.
/// Cloning it shares the pool. You rarely name it: `#[idempotent]` builds the store from
/// your `&PgPool` (`&MySqlPool`, `&SqlitePool`).
pub struct Sqlx<DB: Backend> {
    pool: Pool<DB>,
}

impl<DB: Backend> Sqlx<DB> {
    /// The driver on `pool`.
    pub fn new(pool: Pool<DB>) -> Self {
        Sqlx { pool }
    }
}

impl<DB: Backend> From<Pool<DB>> for Sqlx<DB> {
    fn from(pool: Pool<DB>) -> Self {
        Sqlx::new(pool)
    }
}

impl<DB: Backend> From<&Pool<DB>> for Sqlx<DB> {
    fn from(pool: &Pool<DB>) -> Self {
        Sqlx::new(pool.clone())
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

/// A sqlx connection as the port runs idem's statements on it, held as `C`: borrowed (a
/// body's connection, [`Driver::on_body`]), pooled ([`SqlxPooled`]) or an owned transaction
/// ([`SqlxTx`]). Each of them derefs to the driver's `DB::Connection`, so one [`Connection`]
/// serves all three.
pub struct SqlxConn<DB: Backend, C> {
    conn: C,
    /// Whether statements are named ([`crate::through_transaction_pooler`]).
    named: bool,
    database: PhantomData<fn() -> DB>,
}

/// A pooled sqlx connection outside any transaction.
pub type SqlxPooled<DB> = SqlxConn<DB, PoolConnection<DB>>;

/// An owned sqlx transaction. Dropped open, sqlx queues its `ROLLBACK` for the connection's
/// next use, before the pool hands it to anyone else.
pub type SqlxTx<DB> = SqlxConn<DB, Transaction<'static, DB>>;

impl<DB: Backend, C> SqlxConn<DB, C> {
    /// `conn`, its statements named or not.
    fn new(conn: C, named: bool) -> Self {
        SqlxConn {
            conn,
            named,
            database: PhantomData,
        }
    }
}

impl<DB: Backend, C: DerefMut<Target = DB::Connection> + Send> Connection for SqlxConn<DB, C> {
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

impl<DB: Backend, C> std::fmt::Debug for SqlxConn<DB, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxConn")
            .field("database", &DB::NAME)
            .field("named", &self.named)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> idem_sql::Transaction for SqlxTx<DB> {
    async fn commit(self) -> Result<(), sqlx::Error> {
        self.conn.commit().await
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        self.conn.rollback().await
    }
}

/// A pool as idem's operator functions take it ([`Handle`]): the purge, the inspection and
/// the check hold one pooled connection while they run.
impl<DB: Backend> Handle<Sqlx<DB>> for Pool<DB> {
    type Conn<'h> = SqlxPooled<DB>;

    fn dialect(&self) -> Dialect {
        DB::DIALECT
    }

    async fn connection(&self) -> Result<SqlxPooled<DB>, sqlx::Error> {
        Sqlx::new(self.clone()).acquire().await
    }

    fn driver(&self) -> Option<Sqlx<DB>> {
        Some(Sqlx::new(self.clone()))
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

impl<DB: Backend> Driver for Sqlx<DB> {
    type Error = sqlx::Error;
    type Pooled = SqlxPooled<DB>;
    type Tx = SqlxTx<DB>;
    type Body<'t> = &'t mut DB::Connection;

    type Nested<'c> = SqlxNested<'c, DB>;

    const CREATE_TABLES: &'static str = CREATE_TABLES;
    const NESTED_CALL: &'static str = "pass the body's `db` to a function whose connection is an `idem::sqlx::Conn` (`(&mut *db).into()`), so it claims in a savepoint and commits with the outer call";

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
        let conn = self.pool.acquire().await?;
        Ok(SqlxConn::new(conn, pooler::named(&self.pool)))
    }

    async fn begin(&self, how: Begin) -> Result<SqlxTx<DB>, sqlx::Error> {
        let tx = begin(&self.pool, how).await?;
        Ok(SqlxConn::new(tx, pooler::named(&self.pool)))
    }

    fn body(tx: &mut SqlxTx<DB>) -> &mut DB::Connection {
        &mut tx.conn
    }

    fn reborrow<'t, 'c: 't>(body: &'t mut &'c mut DB::Connection) -> &'t mut DB::Connection {
        body
    }

    fn on_body<'t, 'c: 't>(
        body: &'t mut &'c mut DB::Connection,
    ) -> impl Connection<Error = sqlx::Error> + 't {
        // A body's connection does not say whether it came through a transaction pooler, so
        // on PostgreSQL idem's statements run unnamed there, which any server connection (a
        // pooler's too) takes, in the same round trip. On MySQL an unnamed statement costs a
        // prepare, an execute and a close, and the close (which has no answer) stalls the
        // next statement for a delayed ACK, about 40 ms: named there (no pooler in between).
        SqlxConn::<DB, _>::new(&mut **body, DB::DIALECT != Dialect::Postgres)
    }

    fn body_dialect(_: &&mut DB::Connection) -> Dialect {
        DB::DIALECT
    }

    fn nest<'c>(body: &'c mut DB::Connection) -> SqlxNested<'c, DB>
    where
        Self: 'c,
    {
        SqlxNested {
            conn: Some(body),
            open: 0,
        }
    }

    async fn savepoint<'n, 'c: 'n>(nested: &'n mut SqlxNested<'c, DB>) -> Result<(), sqlx::Error> {
        // sqlx's own nested transaction: `SAVEPOINT _sqlx_savepoint_<depth>`, and the depth
        // that `start_rollback` (on drop) and the user's own `begin()` in the body go by.
        <DB::TransactionManager as TransactionManager>::begin(nested.conn(), None).await?;
        nested.open += 1;
        Ok(())
    }

    async fn end_savepoint<'n, 'c: 'n>(
        nested: &'n mut SqlxNested<'c, DB>,
        keep: bool,
    ) -> Result<(), sqlx::Error> {
        let conn = nested.conn();
        if keep {
            <DB::TransactionManager as TransactionManager>::commit(conn).await?;
        } else {
            <DB::TransactionManager as TransactionManager>::rollback(conn).await?;
        }
        nested.open -= 1;
        Ok(())
    }

    fn nested_body<'t, 'c: 't>(nested: &'t mut SqlxNested<'c, DB>) -> &'t mut DB::Connection {
        nested.conn()
    }

    fn unnest<'c>(mut nested: SqlxNested<'c, DB>) -> &'c mut DB::Connection
    where
        Self: 'c,
    {
        nested.roll_back_open();
        nested
            .conn
            .take()
            .expect("a nested body's connection is taken only here, which consumes it")
    }

    fn classify(error: &sqlx::Error) -> Failure {
        classify(error)
    }

    fn wake_on_commits(&self) -> Option<BoxFuture<'static, Result<(), ListenError>>> {
        #[cfg(feature = "postgres")]
        if let Some(pool) =
            (&self.pool as &dyn std::any::Any).downcast_ref::<Pool<sqlx::Postgres>>()
        {
            let pool = pool.clone();
            return Some(Box::pin(async move {
                use sqlx::postgres::PgListener;
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.listen(idem_sql::names::WAKE_CHANNEL).await?;
                Ok(idem_sql::wake_on_each(listener.into_stream()).await?)
            }));
        }
        None
    }
}

/// A body's connection with the savepoints a nested call took in it: sqlx's nested
/// transactions, counted. Dropped with some still open, it queues their rollbacks for the
/// connection's next statement, as a dropped `sqlx::Transaction` does.
pub struct SqlxNested<'c, DB: Backend> {
    /// Always `Some` but in [`Driver::unnest`], which takes it.
    conn: Option<&'c mut DB::Connection>,
    /// The savepoints taken and not yet ended.
    open: usize,
}

impl<DB: Backend> SqlxNested<'_, DB> {
    fn conn(&mut self) -> &mut DB::Connection {
        self.conn
            .as_deref_mut()
            .expect("a nested body's connection is taken only by `unnest`, which consumes it")
    }

    /// Queues the rollback of every savepoint still open, innermost first.
    fn roll_back_open(&mut self) {
        if let Some(conn) = self.conn.as_deref_mut() {
            for _ in 0..self.open {
                <DB::TransactionManager as TransactionManager>::start_rollback(conn);
            }
        }
        self.open = 0;
    }
}

impl<DB: Backend> Drop for SqlxNested<'_, DB> {
    fn drop(&mut self) {
        self.roll_back_open();
    }
}

impl<DB: Backend> std::fmt::Debug for SqlxNested<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxNested")
            .field("database", &DB::NAME)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}
