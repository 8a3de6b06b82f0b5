//! SeaORM as idem-sql's [`Driver`]: a `DatabaseConnection` ([`SeaOrm`]), its transactions, and
//! [`On`], any SeaORM connection (the pool, a transaction, a body's transaction) running
//! idem-sql's bound statements; and SeaORM's connections as the operator functions'
//! [`Handle`]s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use idem_sql::{
    Begin, Bound, Connection, Dialect, Driver, Failure, Handle, ListenError, MySqlServer, Row,
};
use sea_orm::{
    AccessMode, ConnectionTrait, DatabaseConnection, DatabaseExecutor, DatabaseTransaction,
    DbBackend, DbErr, IsolationLevel, SqliteTransactionMode, TransactionOptions, TransactionTrait,
};

use super::error::{CREATE_TABLES, classify};

/// The longest a claim waits for a pooled connection, in milliseconds ([`set_connection_wait`]).
static CONNECTION_WAIT_MS: AtomicU64 = AtomicU64::new(5_000);

/// Sets how long a claim waits for a pooled connection before the call fails with
/// [`Error::Unavailable`](idem_core::Error::Unavailable) (HTTP 503 with `Retry-After`): a dead or
/// unreachable database, or a pool whose connections are all busy, is an outage, told
/// promptly, not a duplicate in flight. Default 5 s; process-wide. In atomic mode the wait is
/// also kept under the call's wait bound (`on_concurrent = wait("…")`), so a missing connection
/// is never mistaken for another call holding the key. PostgreSQL and MySQL only: an embedded
/// SQLite database cannot go away, and its one pooled connection is queued for under load.
pub fn set_connection_wait(wait: Duration) {
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
    CONNECTION_WAIT_MS.store(ms, Ordering::Relaxed);
}

/// The connection wait ([`set_connection_wait`]) of a call with no bound of its own (lease
/// mode); an atomic call keeps it under its bound ([`Concurrency::connection_wait`](idem_core::Concurrency::connection_wait)).
pub(crate) fn connection_wait() -> Duration {
    Duration::from_millis(CONNECTION_WAIT_MS.load(Ordering::Relaxed))
}

/// A SeaORM pool as idem's driver ([`idem_sql::Driver`]): what idem's one store runs on.
/// Cloning it shares the pool. You rarely name it: `#[idempotent]` builds the store from your
/// `&DatabaseConnection`.
#[derive(Clone, Debug)]
pub struct SeaOrm {
    db: DatabaseConnection,
}

impl SeaOrm {
    /// The driver on `db`.
    pub fn new(db: DatabaseConnection) -> Self {
        SeaOrm { db }
    }
}

impl From<DatabaseConnection> for SeaOrm {
    fn from(db: DatabaseConnection) -> Self {
        SeaOrm::new(db)
    }
}

impl From<&DatabaseConnection> for SeaOrm {
    fn from(db: &DatabaseConnection) -> Self {
        SeaOrm::new(db.clone())
    }
}

/// A SeaORM connection as the port runs statements on it: `C` is the pool
/// (`DatabaseConnection`, each statement on a pooled connection of its own, committing
/// alone), a transaction (`DatabaseTransaction`), or a borrowed one of either.
#[derive(Debug)]
pub struct On<C>(pub(crate) C);

/// What [`On`] runs statements on: a SeaORM connection, owned or borrowed.
pub trait Runs: Send + Sync {
    /// The connection.
    fn db(&self) -> &(impl ConnectionTrait + ?Sized);
}

impl<C: ConnectionTrait + ?Sized> Runs for &C {
    fn db(&self) -> &(impl ConnectionTrait + ?Sized) {
        *self
    }
}

impl Runs for DatabaseConnection {
    fn db(&self) -> &(impl ConnectionTrait + ?Sized) {
        self
    }
}

impl Runs for DatabaseTransaction {
    fn db(&self) -> &(impl ConnectionTrait + ?Sized) {
        self
    }
}

impl<C: Runs> Connection for On<C> {
    type Error = DbErr;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, DbErr> {
        let db = self.0.db();
        let sql = super::of(db.get_database_backend());
        Ok(db
            .execute_raw(super::statement(sql, statement))
            .await?
            .rows_affected())
    }

    async fn fetch_all(&mut self, statement: Bound<'static>) -> Result<Vec<Row>, DbErr> {
        let db = self.0.db();
        let sql = super::of(db.get_database_backend());
        super::fetch_rows(db, sql, statement).await
    }

    async fn execute_unprepared(&mut self, sql: &str) -> Result<(), DbErr> {
        self.0.db().execute_unprepared(sql).await.map(drop)
    }
}

impl idem_sql::Transaction for On<DatabaseTransaction> {
    async fn commit(self) -> Result<(), DbErr> {
        self.0.commit().await
    }

    async fn rollback(self) -> Result<(), DbErr> {
        self.0.rollback().await
    }
}

/// SeaORM's connections as idem's operator functions take them ([`Handle`]): the purge, the
/// inspection and the check run their statements on the pool (a pooled connection each) or in
/// the transaction; only the pool begins a snapshot of its own.
macro_rules! handle {
    (<$($l:lifetime),*> $handle:ty, $driver:expr) => {
        impl<$($l),*> Handle<SeaOrm> for $handle {
            type Conn<'h> = On<&'h $handle> where Self: 'h;

            fn dialect(&self) -> Dialect {
                super::dialect(self.get_database_backend())
            }

            async fn connection(&self) -> Result<On<&$handle>, DbErr> {
                Ok(On(self))
            }

            fn driver(&self) -> Option<SeaOrm> {
                ($driver)(self)
            }
        }
    };
}

handle!(<> DatabaseConnection, |db: &DatabaseConnection| Some(SeaOrm::new(db.clone())));
handle!(<> DatabaseTransaction, |_| None);
handle!(<'e> DatabaseExecutor<'e>, |_| None);

/// SeaORM's options for a transaction begun `how` on `backend`.
pub(crate) fn options(backend: DbBackend, how: Begin) -> TransactionOptions {
    match (backend, how) {
        // SQLite takes its write lock up front for a write (a deferred transaction that reads,
        // then writes, fails with SQLITE_BUSY instead of waiting); its transactions are
        // serializable and it has no access modes.
        (DbBackend::Sqlite, Begin::Write) => TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        },
        (DbBackend::Sqlite, _) | (_, Begin::Write) => TransactionOptions::default(),
        (_, Begin::ReadCommitted) => TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..TransactionOptions::default()
        },
        (_, Begin::Snapshot) => TransactionOptions {
            isolation_level: Some(IsolationLevel::RepeatableRead),
            access_mode: Some(AccessMode::ReadOnly),
            ..TransactionOptions::default()
        },
    }
}

/// A transaction on `db` begun `how`.
pub(crate) async fn begin<
    C: TransactionTrait<Transaction = DatabaseTransaction> + ConnectionTrait,
>(
    db: &C,
    how: Begin,
) -> Result<DatabaseTransaction, DbErr> {
    db.begin_with_options(options(db.get_database_backend(), how))
        .await
}

impl Driver for SeaOrm {
    type Error = DbErr;
    /// The pool itself: SeaORM lends a connection per statement.
    type Pooled = On<DatabaseConnection>;
    type Tx = On<DatabaseTransaction>;
    type Body<'t> = &'t DatabaseTransaction;
    type Nested<'c> = SeaOrmNested<'c>;

    const CREATE_TABLES: &'static str = CREATE_TABLES;
    const NESTED_CALL: &'static str =
        "pass the body's `db` (its `&DatabaseTransaction`) so the call commits with the outer one";

    fn dialect(&self) -> Dialect {
        super::dialect(self.db.get_database_backend())
    }

    fn server(&self) -> Option<MySqlServer> {
        super::flavour::server(&self.db)
    }

    fn identity(&self) -> Option<usize> {
        super::pool_identity(&self.db)
    }

    fn connection_wait(&self) -> Option<Duration> {
        (self.db.get_database_backend() != DbBackend::Sqlite).then(connection_wait)
    }

    async fn acquire(&self) -> Result<On<DatabaseConnection>, DbErr> {
        Ok(On(self.db.clone()))
    }

    async fn begin(&self, how: Begin) -> Result<On<DatabaseTransaction>, DbErr> {
        begin(&self.db, how).await.map(On)
    }

    fn body(tx: &mut On<DatabaseTransaction>) -> &DatabaseTransaction {
        &tx.0
    }

    fn reborrow<'t, 'c: 't>(body: &'t mut &'c DatabaseTransaction) -> &'t DatabaseTransaction {
        body
    }

    fn on_body<'t, 'c: 't>(
        body: &'t mut &'c DatabaseTransaction,
    ) -> impl Connection<Error = DbErr> + 't {
        On(*body)
    }

    fn body_dialect(body: &&DatabaseTransaction) -> Dialect {
        super::dialect(body.get_database_backend())
    }

    fn nest<'c>(body: &'c DatabaseTransaction) -> SeaOrmNested<'c>
    where
        Self: 'c,
    {
        SeaOrmNested {
            outer: body,
            levels: Vec::new(),
        }
    }

    async fn savepoint<'n, 'c: 'n>(nested: &'n mut SeaOrmNested<'c>) -> Result<(), DbErr> {
        // SeaORM's nested transaction: sqlx's savepoint at the connection's depth, rolled
        // back to on drop before the connection's next statement.
        let level = nested.body().begin().await?;
        nested.levels.push(level);
        Ok(())
    }

    async fn end_savepoint<'n, 'c: 'n>(
        nested: &'n mut SeaOrmNested<'c>,
        keep: bool,
    ) -> Result<(), DbErr> {
        match nested.levels.pop() {
            Some(level) if keep => level.commit().await,
            Some(level) => level.rollback().await,
            None => Ok(()),
        }
    }

    fn nested_body<'t, 'c: 't>(nested: &'t mut SeaOrmNested<'c>) -> &'t DatabaseTransaction {
        nested.body()
    }

    fn unnest<'c>(nested: SeaOrmNested<'c>) -> &'c DatabaseTransaction
    where
        Self: 'c,
    {
        // Dropping it rolls back to the savepoints still open, innermost first.
        nested.outer
    }

    fn classify(error: &DbErr) -> Failure {
        classify(error)
    }

    fn wake_on_commits(&self) -> Option<BoxFuture<'static, Result<(), ListenError>>> {
        #[cfg(feature = "postgres")]
        if self.db.get_database_backend() == DbBackend::Postgres {
            let pool = self.db.get_postgres_connection_pool().clone();
            return Some(Box::pin(async move {
                use sea_orm::sqlx::postgres::PgListener;
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.listen(idem_sql::names::WAKE_CHANNEL).await?;
                Ok(idem_sql::wake_on_each(listener.into_stream()).await?)
            }));
        }
        None
    }
}

/// A body's transaction with the savepoints a nested call took in it: SeaORM's nested
/// transactions. Dropped with some still open, each queues its rollback for the connection's
/// next statement, innermost first.
#[derive(Debug)]
pub struct SeaOrmNested<'c> {
    outer: &'c DatabaseTransaction,
    levels: Vec<DatabaseTransaction>,
}

impl SeaOrmNested<'_> {
    /// The innermost transaction: the latest savepoint, or the outer body.
    fn body(&self) -> &DatabaseTransaction {
        self.levels.last().unwrap_or(self.outer)
    }
}

impl Drop for SeaOrmNested<'_> {
    fn drop(&mut self) {
        while let Some(level) = self.levels.pop() {
            drop(level);
        }
    }
}
