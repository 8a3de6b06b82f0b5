//! The driver port: what idem's one store asks of a database driver. A driver crate (SeaORM,
//! sqlx, tokio-postgres) implements [`Driver`] once, on a type of its own that holds its pool,
//! with a [`Connection`] and a [`Transaction`]; every statement's text, every row's decoding
//! and every decision stay in idem-sql. It also implements [`Handle`] for the handles its
//! users hold (a pool, a transaction), which the operator functions take. The plan is
//! `docs/plans/driver-port.md`.

mod begin;
mod fault;
mod flavour;
mod handle;

use std::future::Future;
use std::time::Duration;

use futures_util::future::BoxFuture;

pub use begin::{
    Begin, COMMIT, ROLLBACK, nested_savepoint, release_nested_savepoint, roll_back_nested_savepoint,
};
pub use fault::Fault;
pub use flavour::learn_flavour;
pub use handle::Handle;
pub(crate) use handle::connect;

use crate::{Bound, Decode, Dialect, Failure, MySqlServer, Row, read_each};

/// Why a commit listener ([`Driver::wake_on_commits`]) stopped: logged, then it restarts.
pub type ListenError = Box<dyn std::error::Error + Send + Sync>;

/// Runs `statement` on `conn` and reads each row it returns with `read` (idem-sql's reader of
/// the statement's rows).
pub async fn fetch_each<C: Connection, T>(
    conn: &mut C,
    statement: Bound<'static>,
    read: fn(Row) -> Result<T, Decode>,
) -> Result<Vec<T>, Fault<C::Error>> {
    let rows = conn.fetch_all(statement).await.map_err(Fault::Db)?;
    Ok(read_each(rows, read)?)
}

/// Runs `statement` on `conn` and reads the first row it returns, if any, with `read`.
pub async fn fetch_first<C: Connection, T>(
    conn: &mut C,
    statement: Bound<'static>,
    read: fn(Row) -> Result<T, Decode>,
) -> Result<Option<T>, Fault<C::Error>> {
    let row = conn.fetch_optional(statement).await.map_err(Fault::Db)?;
    Ok(row.map(read).transpose()?)
}

/// Where bound statements run: a pooled connection outside any transaction (each statement
/// commits alone), a transaction, or a handler's body.
pub trait Connection: Send {
    /// The driver's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Runs `statement` and returns the number of rows it changed.
    fn execute(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Runs `statement` and reads each row's columns at the types `statement.columns`
    /// declares ([`Column`](crate::Column)), integers widened to `i64`.
    fn fetch_all(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<Row>, Self::Error>> + Send;

    /// The first row `statement` returns, if any; a driver may stop reading after it.
    fn fetch_optional(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Option<Row>, Self::Error>> + Send {
        async move { Ok(self.fetch_all(statement).await?.into_iter().next()) }
    }

    /// Runs `sql`, which takes no values, on the simple protocol: savepoints, session
    /// settings, DDL (nothing is prepared, which a transaction pooler would not keep).
    fn execute_unprepared(
        &mut self,
        sql: &str,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

impl<C: Connection + ?Sized> Connection for &mut C {
    type Error = C::Error;

    fn execute(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        (**self).execute(statement)
    }

    fn fetch_all(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<Row>, Self::Error>> + Send {
        (**self).fetch_all(statement)
    }

    fn fetch_optional(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Option<Row>, Self::Error>> + Send {
        (**self).fetch_optional(statement)
    }

    fn execute_unprepared(
        &mut self,
        sql: &str,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        (**self).execute_unprepared(sql)
    }
}

/// An owned transaction. Dropping one that is still open must leave its connection outside
/// any transaction before anyone else uses it: sqlx and SeaORM queue the `ROLLBACK` for the
/// connection's next use, a driver without that sends it from a task of its own.
pub trait Transaction: Connection + Sized {
    /// Sends a `BEGIN` the driver deferred to the transaction's first statement
    /// (tokio-postgres sends both in one flight), before the transaction is lent to a body
    /// that no statement of idem's preceded: the body's first statement must run inside it.
    /// Nothing to do for a driver that begins at once.
    fn begun(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Commits.
    fn commit(self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Rolls back.
    fn rollback(self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether [`Transaction::commit_after`] sends the statement and its `COMMIT` in one
    /// flight. Only then does the store record with [`Ledger::record_or_fail`](crate::Ledger::record_or_fail),
    /// a heavier statement to plan than the plain record, which waits for its answer.
    const PIPELINES: bool = false;

    /// Runs `last`, then commits: one round trip where the driver pipelines. Only for a
    /// statement that fails rather than change no row (the ledger's record on PostgreSQL): a
    /// `COMMIT` already sent behind a failed statement meets an aborted transaction and rolls
    /// back. Returns the rows `last` changed.
    fn commit_after(
        mut self,
        last: Bound<'static>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        async move {
            let changed = self.execute(last).await?;
            self.commit().await?;
            Ok(changed)
        }
    }
}

/// A database driver, as idem's store runs on it. Implemented once per driver crate on a type
/// of that crate which holds its pool (the orphan rule forbids implementing it for the
/// driver's own pool type there); cloning it shares the pool.
pub trait Driver: Clone + Send + Sync + 'static {
    /// The driver's error, kept as the `source` of idem's; [`Driver::classify`] reads it.
    type Error: std::error::Error + Send + Sync + 'static;
    /// A pooled connection outside any transaction.
    type Pooled: Connection<Error = Self::Error> + 'static;
    /// An owned transaction: a claim keeps it while the body runs.
    type Tx: Transaction<Error = Self::Error> + 'static;
    /// What a handler's body gets of a claim's transaction: the driver's own type, not a
    /// wrapper (`&'t DatabaseTransaction`, `&'t mut PgConnection`).
    type Body<'t>: Send;

    /// How this driver's users create a missing ledger, quoted in the error.
    const CREATE_TABLES: &'static str;

    /// How this driver's users call an `#[idempotent]` function inside another call's body so
    /// that it commits with it, quoted in the error of a call that reached the pool instead.
    const NESTED_CALL: &'static str;

    /// The dialect of the pool's server.
    fn dialect(&self) -> Dialect;

    /// The MySQL server the pool reaches, so that its family is asked once per server
    /// ([`learn_flavour`]); `None` elsewhere, or where the driver cannot tell (then each
    /// claim asks).
    fn server(&self) -> Option<MySqlServer> {
        None
    }

    /// A number the pool's clones share and no other pool has: claims in flight on one pool
    /// share single flight, group commits and the open-claim guard by it.
    fn identity(&self) -> Option<usize>;

    /// The longest wait for a pooled connection; `None` on SQLite (embedded: its connections
    /// are queued for, and it cannot go away).
    fn connection_wait(&self) -> Option<Duration>;

    /// A pooled connection.
    fn acquire(&self) -> impl Future<Output = Result<Self::Pooled, Self::Error>> + Send;

    /// A transaction begun `how`.
    fn begin(&self, how: Begin) -> impl Future<Output = Result<Self::Tx, Self::Error>> + Send;

    /// Lends a claim's transaction to the handler's body.
    fn body(tx: &mut Self::Tx) -> Self::Body<'_>;

    /// Lends a body that a nested claim holds to the nested call's own body.
    fn reborrow<'t, 'c: 't>(body: &'t mut Self::Body<'c>) -> Self::Body<'t>;

    /// A body as a connection, for the nested claims and the staging that run on it.
    fn on_body<'t, 'c: 't>(
        body: &'t mut Self::Body<'c>,
    ) -> impl Connection<Error = Self::Error> + 't;

    /// The dialect of the server a body's transaction is on.
    fn body_dialect(body: &Self::Body<'_>) -> Dialect;

    /// A body with the savepoints a nested call takes in its transaction (an `#[idempotent]`
    /// function called with another call's body). Dropped with savepoints still open, it
    /// rolls back to the first of them before the body's next statement, as the driver's own
    /// nested transactions do (sqlx's transaction depth, SeaORM's nested `begin`): a nested
    /// call cut off mid-body leaves nothing of its own in the outer call's commit.
    type Nested<'c>: Send;

    /// `body`, no savepoint taken yet.
    fn nest<'c>(body: Self::Body<'c>) -> Self::Nested<'c>;

    /// Takes one more savepoint.
    fn savepoint<'n, 'c: 'n>(
        nested: &'n mut Self::Nested<'c>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'n;

    /// Ends the latest savepoint: kept (released), or rolled back to.
    fn end_savepoint<'n, 'c: 'n>(
        nested: &'n mut Self::Nested<'c>,
        keep: bool,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'n;

    /// Lends the body inside the savepoints.
    fn nested_body<'t, 'c: 't>(nested: &'t mut Self::Nested<'c>) -> Self::Body<'t>;

    /// The body back; savepoints still open are rolled back to first (queued, as on drop).
    fn unnest<'c>(nested: Self::Nested<'c>) -> Self::Body<'c>;

    /// What kind of failure `error` is: a lost connection, a lock wait that gave up, a
    /// transient conflict, a missing table, or another error.
    fn classify(error: &Self::Error) -> Failure;

    /// Wakes this process's relays on each commit that staged a message, until the connection
    /// it listens on fails (PostgreSQL's `LISTEN`); the relay restarts it with its backoff.
    /// `None`: the relay polls.
    fn wake_on_commits(&self) -> Option<BoxFuture<'static, Result<(), ListenError>>> {
        None
    }
}

/// The driver's error met while `doing` something, as idem's.
pub(crate) fn db_error<D: Driver>(doing: &str, error: D::Error) -> idem_core::Error {
    failed::<D>((doing, Fault::Db(error)))
}

/// A step's failure, with what it was doing, as idem's error.
pub(crate) fn failed<D: Driver>((doing, fault): (&str, Fault<D::Error>)) -> idem_core::Error {
    fault.into_error(doing, D::classify, D::CREATE_TABLES)
}
