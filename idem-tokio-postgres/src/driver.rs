//! tokio-postgres on a deadpool-postgres pool as idem-sql's [`Driver`]: a pooled client
//! ([`TokioPostgresPooled`]), an owned transaction ([`TokioPostgresTx`]), a handler's body
//! (`&ClientWrapper`) and its nested savepoints ([`TokioPostgresNested`]). Every statement is
//! idem-sql's, sent unnamed with its values' types (`query_typed`): one round trip, and
//! nothing a transaction pooler's server connection would have to keep.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Waker};
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object, Pool, PoolError};
use futures_util::TryStreamExt;
use idem_sql::{Begin, Bound, Column, Connection, Dialect, Driver, Failure, Param, Row, Value};
use tokio_postgres::types::{ToSql, Type};

/// How a tokio-postgres user creates a missing ledger, quoted in the error.
const CREATE_TABLES: &str = "call `idem::tokio_postgres::create_tables(&pool, &[Family::Ledger])` at startup, or add \
     the output of `idem schema --backend postgres` to your migrations";

/// A deadpool-postgres pool as idem's driver ([`idem_sql::Driver`]): what idem's one store
/// runs on. Cloning it shares the pool. You rarely name it: `#[idempotent]` builds the store
/// from your `&deadpool_postgres::Pool`.
#[derive(Clone, Debug)]
pub struct TokioPostgres {
    pool: Pool,
}

impl From<Pool> for TokioPostgres {
    fn from(pool: Pool) -> Self {
        TokioPostgres { pool }
    }
}

impl From<&Pool> for TokioPostgres {
    fn from(pool: &Pool) -> Self {
        TokioPostgres::from(pool.clone())
    }
}

/// What the tokio-postgres driver met: a statement's error, or the pool's. Shown as the error
/// itself says (deadpool's `PoolError` would have put "Error occurred while creating a new
/// object" before every statement's error, a failed `INSERT` included).
#[derive(Debug)]
pub enum TokioPostgresError {
    /// A statement failed, or the connection it ran on ended.
    Statement(tokio_postgres::Error),
    /// The pool gave no client: none in time, the pool closed, or a new connection failed.
    Pool(PoolError),
}

impl fmt::Display for TokioPostgresError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokioPostgresError::Statement(e) => e.fmt(f),
            TokioPostgresError::Pool(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for TokioPostgresError {
    // Transparent: each shows its own cause, so the cause's cause is next in the chain.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TokioPostgresError::Statement(e) => e.source(),
            TokioPostgresError::Pool(e) => e.source(),
        }
    }
}

impl From<tokio_postgres::Error> for TokioPostgresError {
    fn from(e: tokio_postgres::Error) -> Self {
        TokioPostgresError::Statement(e)
    }
}

impl From<PoolError> for TokioPostgresError {
    fn from(e: PoolError) -> Self {
        TokioPostgresError::Pool(e)
    }
}

/// Runs `statement` on `client`, unnamed, its values sent with their types; returns its rows,
/// read at the types it declares, and the rows it changed.
async fn run(
    client: &tokio_postgres::Client,
    statement: Bound<'static>,
) -> Result<(Vec<Row>, u64), TokioPostgresError> {
    let params = statement.params.iter().map(typed);
    let rows = client.query_typed_raw(&statement.sql, params).await?;
    let mut rows = pin!(rows);
    let mut read = Vec::new();
    while let Some(row) = rows.try_next().await? {
        read.push(read_row(&row, statement.columns)?);
    }
    let changed = rows.rows_affected().unwrap_or(0);
    Ok((read, changed))
}

/// A value and the PostgreSQL type it is sent as.
fn typed(param: &Param) -> (&(dyn ToSql + Sync), Type) {
    match param {
        Param::I64(v) => (v, Type::INT8),
        Param::I32(v) => (v, Type::INT4),
        Param::I16(v) => (v, Type::INT2),
        Param::Bytes(v) => (v, Type::BYTEA),
        Param::Text(v) => (v, Type::TEXT),
    }
}

/// `row`'s columns at the types the statement declares, integers widened.
fn read_row(row: &tokio_postgres::Row, columns: &[Column]) -> Result<Row, tokio_postgres::Error> {
    let mut values = Vec::with_capacity(columns.len());
    for (at, column) in columns.iter().enumerate() {
        values.push(match column {
            Column::I16 => Value::from(row.try_get::<_, Option<i16>>(at)?),
            Column::I32 => Value::from(row.try_get::<_, Option<i32>>(at)?),
            Column::I64 => Value::from(row.try_get::<_, Option<i64>>(at)?),
            Column::Bytes => row
                .try_get::<_, Option<Vec<u8>>>(at)?
                .map_or(Value::Null, Value::Bytes),
            Column::Text => row
                .try_get::<_, Option<String>>(at)?
                .map_or(Value::Null, Value::Text),
        });
    }
    Ok(Row::new(values))
}

/// Sends `sql` (simple protocol) now, without waiting for its answer: for a `Drop`, which
/// cannot wait. tokio-postgres queues a request when its future is first polled, and its
/// connection task sends queued requests in order and reads every answer, awaited or not, so
/// `sql` runs before any later statement on this connection (its own `Transaction` queues
/// its `ROLLBACK` on drop the same way). The answer is dropped: a `ROLLBACK` that fails
/// leaves nothing to undo.
fn send_unawaited(client: &tokio_postgres::Client, sql: &str) {
    let sent = pin!(client.batch_execute(sql));
    let _ = sent.poll(&mut Context::from_waker(Waker::noop()));
}

/// Runs `sql` (simple protocol) on `client`.
async fn batch(client: &tokio_postgres::Client, sql: &str) -> Result<(), TokioPostgresError> {
    Ok(client.batch_execute(sql).await?)
}

/// Runs `statement` behind `begin` (a deferred `BEGIN`), both in one flight. `join` polls
/// the `BEGIN` first, so tokio-postgres queues it first and the statement runs inside the
/// transaction; a `BEGIN` that failed makes the statement's answer meaningless, so its
/// error is the one returned.
async fn after<T>(
    client: &tokio_postgres::Client,
    begin: Option<String>,
    statement: impl Future<Output = Result<T, TokioPostgresError>>,
) -> Result<T, TokioPostgresError> {
    let Some(begin) = begin else {
        return statement.await;
    };
    let (begun, answer) = futures_util::future::join(batch(client, &begin), statement).await;
    begun.and(answer)
}

/// A connection the port runs statements on: a pooled client, a transaction, a body.
/// `$flight` is its client and the deferred `BEGIN` to send first, if any; each answer goes
/// through the connection's `noted` (a pooled client notes a connection that ended).
macro_rules! connection {
    ($type:ty, |$this:ident| $flight:expr) => {
        impl Connection for $type {
            type Error = TokioPostgresError;

            async fn execute(
                &mut self,
                statement: Bound<'static>,
            ) -> Result<u64, TokioPostgresError> {
                let answer = {
                    let $this = &mut *self;
                    let (client, begin) = $flight;
                    after(client, begin, run(client, statement)).await
                };
                Ok(self.noted(answer)?.1)
            }

            async fn fetch_all(
                &mut self,
                statement: Bound<'static>,
            ) -> Result<Vec<Row>, TokioPostgresError> {
                let answer = {
                    let $this = &mut *self;
                    let (client, begin) = $flight;
                    after(client, begin, run(client, statement)).await
                };
                Ok(self.noted(answer)?.0)
            }

            async fn execute_unprepared(&mut self, sql: &str) -> Result<(), TokioPostgresError> {
                let answer = {
                    let $this = &mut *self;
                    let (client, begin) = $flight;
                    after(client, begin, batch(client, sql)).await
                };
                self.noted(answer)
            }
        }
    };
}

/// A client taken from the pool that leaves it, instead of going back, once a statement of
/// idem's found its connection ended (the server shut it down, the socket closed):
/// deadpool's recycling sees a connection closed only after the connection's task has read
/// its end, so a client given back sooner would fail the next caller's first statement.
#[derive(Debug)]
struct PoolClient {
    /// `None` only while it is dropped.
    object: Option<Object>,
    ended: bool,
}

impl PoolClient {
    fn new(object: Object) -> Self {
        PoolClient {
            object: Some(object),
            ended: false,
        }
    }

    fn get(&self) -> &ClientWrapper {
        match &self.object {
            Some(object) => object,
            None => unreachable!("a pooled client is used only before its drop"),
        }
    }

    /// Notes whether `answer` says the connection ended, and hands it back.
    fn noted<T>(&mut self, answer: Result<T, TokioPostgresError>) -> Result<T, TokioPostgresError> {
        if let Err(TokioPostgresError::Statement(e)) = &answer {
            self.ended |= ends_connection(e);
        }
        answer
    }
}

impl Drop for PoolClient {
    fn drop(&mut self) {
        if self.ended
            && let Some(object) = self.object.take()
        {
            // Out of the pool, and closed: its place is free for a new connection.
            drop(Object::take(object));
        }
    }
}

/// Whether `e` says the connection is gone: closed, broken, or ended by the server (a
/// `FATAL`: an administrator's or a shutdown's termination, say).
fn ends_connection(e: &tokio_postgres::Error) -> bool {
    let io = std::error::Error::source(e).is_some_and(|source| source.is::<std::io::Error>());
    let fatal = e
        .as_db_error()
        .is_some_and(|db| matches!(db.severity(), "FATAL" | "PANIC"));
    e.is_closed() || io || fatal
}

/// A pooled client outside any transaction: each statement commits alone.
#[derive(Debug)]
pub struct TokioPostgresPooled {
    client: PoolClient,
}

impl TokioPostgresPooled {
    fn noted<T>(&mut self, answer: Result<T, TokioPostgresError>) -> Result<T, TokioPostgresError> {
        self.client.noted(answer)
    }
}

connection!(TokioPostgresPooled, |this| (this.client.get(), None));

/// An owned transaction on a pooled client. Its `BEGIN` goes out with its first statement, in
/// one flight (a claim costs one round trip, not two). Dropped open (a claim whose call was
/// cut off, a `BEGIN` still in flight), it queues its `ROLLBACK` before the client goes back
/// to the pool, so the next user of the connection finds it outside any transaction; dropped
/// before its first statement, it sent nothing.
#[derive(Debug)]
pub struct TokioPostgresTx {
    client: PoolClient,
    /// The `BEGIN` not sent yet (empty once sent).
    begin: &'static [&'static str],
    /// Whether a `BEGIN` was sent and no `COMMIT` or `ROLLBACK` has answered yet.
    open: bool,
}

connection!(TokioPostgresTx, |this| this.flight());

impl TokioPostgresTx {
    /// The client, and the `BEGIN` to send before the next statement if it has not gone out.
    /// Open from here: cut off while the `BEGIN` is in flight, the drop queues its `ROLLBACK`.
    fn flight(&mut self) -> (&tokio_postgres::Client, Option<String>) {
        let begin = std::mem::take(&mut self.begin);
        self.open |= !begin.is_empty();
        (
            self.client.get(),
            (!begin.is_empty()).then(|| begin.join("; ")),
        )
    }

    fn noted<T>(&mut self, answer: Result<T, TokioPostgresError>) -> Result<T, TokioPostgresError> {
        self.client.noted(answer)
    }

    /// Sends `end` (`COMMIT` or `ROLLBACK`) and waits for its answer; nothing if no `BEGIN`
    /// was sent.
    async fn end(mut self, end: &str) -> Result<(), TokioPostgresError> {
        if !self.open {
            return Ok(());
        }
        let ended = batch(self.client.get(), end).await;
        // Answered, even with an error: the server ended the transaction (a failed COMMIT
        // rolls back) or the connection is gone, which the pool's recycling finds.
        self.open = false;
        self.noted(ended)
    }
}

impl idem_sql::Transaction for TokioPostgresTx {
    const PIPELINES: bool = true;

    async fn begun(&mut self) -> Result<(), TokioPostgresError> {
        let (client, begin) = self.flight();
        let begun = after(client, begin, async { Ok(()) }).await;
        self.noted(begun)
    }

    async fn commit(self) -> Result<(), TokioPostgresError> {
        self.end(idem_sql::COMMIT).await
    }

    async fn rollback(self) -> Result<(), TokioPostgresError> {
        self.end(idem_sql::ROLLBACK).await
    }

    async fn commit_after(mut self, last: Bound<'static>) -> Result<u64, TokioPostgresError> {
        let (client, begin) = self.flight();
        let last = after(client, begin, run(client, last));
        // Queued behind `last`: it commits, or meets the transaction `last` aborted and rolls
        // back. `last`'s error is the one that says what failed.
        let (last, ended) = futures_util::future::join(last, batch(client, idem_sql::COMMIT)).await;
        self.open = false;
        let changed = self.noted(last)?.1;
        self.noted(ended).map(|()| changed)
    }
}

impl Drop for TokioPostgresTx {
    fn drop(&mut self) {
        if self.open {
            send_unawaited(self.client.get(), idem_sql::ROLLBACK);
        }
    }
}

/// A pool as idem's operator functions take it ([`idem_sql::Handle`]): the purge, the
/// inspection and the check hold one pooled client while they run.
impl idem_sql::Handle<TokioPostgres> for Pool {
    type Conn<'h> = TokioPostgresPooled;

    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    async fn connection(&self) -> Result<TokioPostgresPooled, TokioPostgresError> {
        TokioPostgres::from(self).acquire().await
    }

    fn driver(&self) -> Option<TokioPostgres> {
        Some(TokioPostgres::from(self))
    }
}

/// A client as a connection: a handler's body (a claim's transaction, a final phase's), or a
/// transaction of the user's own (staging).
#[derive(Debug)]
pub struct OnBody<'t>(pub(crate) &'t tokio_postgres::Client);

impl OnBody<'_> {
    /// The body's client is its transaction's: that one notes a connection that ended.
    fn noted<T>(&mut self, answer: Result<T, TokioPostgresError>) -> Result<T, TokioPostgresError> {
        answer
    }
}

connection!(OnBody<'_>, |this| (this.0, None));

impl Driver for TokioPostgres {
    type Error = TokioPostgresError;
    type Pooled = TokioPostgresPooled;
    type Tx = TokioPostgresTx;
    type Body<'t> = &'t ClientWrapper;
    type Nested<'c> = TokioPostgresNested<'c>;

    const CREATE_TABLES: &'static str = CREATE_TABLES;
    const NESTED_CALL: &'static str = "pass the body's `db` to a function whose connection is a `&deadpool_postgres::ClientWrapper`, so it claims in a savepoint and commits with the outer call";

    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    fn identity(&self) -> Option<usize> {
        // The manager lives as long as the pool and is shared by its clones.
        Some(std::ptr::from_ref(self.pool.manager()).addr())
    }

    fn connection_wait(&self) -> Option<Duration> {
        self.pool.timeouts().wait
    }

    async fn acquire(&self) -> Result<TokioPostgresPooled, TokioPostgresError> {
        Ok(TokioPostgresPooled {
            client: PoolClient::new(self.pool.get().await?),
        })
    }

    async fn begin(&self, how: Begin) -> Result<TokioPostgresTx, TokioPostgresError> {
        Ok(TokioPostgresTx {
            client: PoolClient::new(self.pool.get().await?),
            begin: Dialect::Postgres.begin(how),
            open: false,
        })
    }

    fn body(tx: &mut TokioPostgresTx) -> &ClientWrapper {
        // idem runs a statement (the claim, the fence) or `begun` before it lends a body.
        // Were the `BEGIN` still deferred, it is queued now, ahead of the body's statements.
        debug_assert!(tx.begin.is_empty(), "a body lent before its BEGIN was sent");
        if let (client, Some(begin)) = tx.flight() {
            send_unawaited(client, &begin);
        }
        tx.client.get()
    }

    fn reborrow<'t, 'c: 't>(body: &'t mut &'c ClientWrapper) -> &'t ClientWrapper {
        body
    }

    fn on_body<'t, 'c: 't>(
        body: &'t mut &'c ClientWrapper,
    ) -> impl Connection<Error = TokioPostgresError> + 't {
        OnBody(body)
    }

    fn body_dialect(_: &&ClientWrapper) -> Dialect {
        Dialect::Postgres
    }

    fn nest<'c>(body: &'c ClientWrapper) -> TokioPostgresNested<'c>
    where
        Self: 'c,
    {
        TokioPostgresNested {
            client: body,
            open: 0,
        }
    }

    async fn savepoint<'n, 'c: 'n>(
        nested: &'n mut TokioPostgresNested<'c>,
    ) -> Result<(), TokioPostgresError> {
        // Counted before it is sent: cut off in flight, the drop rolls back to it after it.
        nested.open += 1;
        batch(nested.client, &idem_sql::nested_savepoint(nested.open)).await
    }

    async fn end_savepoint<'n, 'c: 'n>(
        nested: &'n mut TokioPostgresNested<'c>,
        keep: bool,
    ) -> Result<(), TokioPostgresError> {
        let end = if keep {
            idem_sql::release_nested_savepoint(nested.open)
        } else {
            idem_sql::roll_back_nested_savepoint(nested.open)
        };
        batch(nested.client, &end).await?;
        nested.open -= 1;
        Ok(())
    }

    fn nested_body<'t, 'c: 't>(nested: &'t mut TokioPostgresNested<'c>) -> &'t ClientWrapper {
        nested.client
    }

    fn unnest<'c>(mut nested: TokioPostgresNested<'c>) -> &'c ClientWrapper
    where
        Self: 'c,
    {
        nested.roll_back_open();
        nested.client
    }

    fn classify(error: &TokioPostgresError) -> Failure {
        match error {
            TokioPostgresError::Statement(e) | TokioPostgresError::Pool(PoolError::Backend(e)) => {
                classify(e)
            }
            // No connection in time, the pool closed, or a new connection failed its hook.
            _ => Failure::Unavailable,
        }
    }
}

/// What kind of failure a tokio-postgres error is, as far as the ledger cares.
fn classify(e: &tokio_postgres::Error) -> Failure {
    if let Some(db) = e.as_db_error() {
        return Failure::of_code(db.code().code(), None)
            .or_else(|| {
                Failure::names_missing_ledger(db.message()).then_some(Failure::MissingTable)
            })
            .unwrap_or(Failure::Other);
    }
    if ends_connection(e) {
        Failure::Unavailable
    } else {
        Failure::Other
    }
}

/// A body's client with the savepoints a nested call took in its transaction. Dropped with
/// some still open, it queues their rollbacks for the client's next statement, innermost
/// first, as a dropped `tokio_postgres::Transaction` queues its own.
#[derive(Debug)]
pub struct TokioPostgresNested<'c> {
    client: &'c ClientWrapper,
    /// The savepoints taken (or in flight) and not yet ended.
    open: usize,
}

impl TokioPostgresNested<'_> {
    /// Queues the rollback of every savepoint still open, innermost first.
    fn roll_back_open(&mut self) {
        while self.open > 0 {
            send_unawaited(
                self.client,
                &idem_sql::roll_back_nested_savepoint(self.open),
            );
            self.open -= 1;
        }
    }
}

impl Drop for TokioPostgresNested<'_> {
    fn drop(&mut self) {
        self.roll_back_open();
    }
}
