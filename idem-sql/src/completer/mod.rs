//! Resumable calls and their completers, once for every store: which statements a
//! completer's store runs and what their rows decide ([`due_calls`], [`begin_attempt`],
//! [`note_failure`], [`give_up`], [`steps`], [`forget`], [`unregistered`]). A store supplies
//! the connection ([`ResumeConnection`]: its pool, or a transaction it began for [`give_up`]
//! and [`forget`]), begins and commits, and implements idem-core's
//! [`ResumeStore`](idem_core::completer::ResumeStore) with these functions.

use std::future::Future;
use std::time::Duration;

use idem_core::completer::{Due, Steps, StoredCall};

mod statements;

pub use statements::{Completer, NewCall};

use crate::{Bound, Column, Decode, Row, Sql, millis};

/// The longest error text kept for a give-up: an error can be long (a response body); its
/// start says what failed.
const KEPT_ERROR_CHARS: usize = 2000;

/// A due call's columns as a driver decodes them, in the order
/// [`Completer::due_calls`] returns them: record_id, scope, principal, idem_key, args,
/// attempts, last_error, gave_up, final_phase_done.
pub type CallColumns = (
    Vec<u8>,
    String,
    String,
    String,
    Vec<u8>,
    i32,
    Option<String>,
    i16,
    i16,
);

/// The columns of [`Completer::due_calls`], in order: record_id, scope, principal, idem_key,
/// args, attempts, last_error, gave_up, final_phase_done.
pub const STORED_CALL: &[Column] = &[
    Column::Bytes,
    Column::Text,
    Column::Text,
    Column::Text,
    Column::Bytes,
    Column::I32,
    Column::Text,
    Column::I16,
    Column::I16,
];

/// A due call as [`Completer::due_calls`] returns it ([`STORED_CALL`]).
pub fn read_stored_call(row: Row) -> Result<StoredCall, Decode> {
    read_call_columns(row).map(stored_call)
}

/// A due call's columns ([`STORED_CALL`]) as the [`ResumeConnection`] port hands them over.
pub fn read_call_columns(row: Row) -> Result<CallColumns, Decode> {
    let mut c = row.read();
    Ok((
        c.bytes()?,
        c.text()?,
        c.text()?,
        c.text()?,
        c.bytes()?,
        c.int()?,
        c.opt_text()?,
        c.int()?,
        c.int()?,
    ))
}

/// A row of [`Completer::unregistered_calls`]: a scope and how many of its calls are due.
pub fn read_count(row: Row) -> Result<(String, i64), Decode> {
    let mut c = row.read();
    Ok((c.text()?, c.i64()?))
}

/// A connection of a completer's store, as the completer's statements run on it: a pooled
/// connection, or a transaction the store began.
pub trait ResumeConnection: Send {
    /// The driver's error.
    type Error: Send;

    /// Runs `statement` and returns how many rows it changed.
    fn execute(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Runs `statement`, which returns due calls ([`Completer::due_calls`]), and decodes
    /// each row's [`CallColumns`].
    fn fetch_calls(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<CallColumns>, Self::Error>> + Send;

    /// Runs `statement`, which returns one nullable integer ([`Completer::next_due_in`]), and
    /// reads it (`None`: no row, or NULL).
    fn fetch_millis(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Option<i64>, Self::Error>> + Send;

    /// Runs `statement`, which returns `scope, count` rows
    /// ([`Completer::unregistered_calls`]), and reads them.
    fn fetch_counts(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<(String, i64)>, Self::Error>> + Send;

    /// Runs `statement`, which returns `name, result` rows ([`crate::Lease::select_steps`]),
    /// and reads them.
    fn fetch_steps(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<(String, Vec<u8>)>, Self::Error>> + Send;
}

/// A due call from its columns.
fn stored_call(columns: CallColumns) -> StoredCall {
    let (id, scope, principal, key, args, attempts, last_error, gave_up, final_phase_done) =
        columns;
    StoredCall::new(
        id,
        scope,
        principal,
        key,
        args,
        u32::try_from(attempts).unwrap_or(0),
        last_error,
        gave_up == 1,
    )
    .with_final_phase_done(final_phase_done == 1)
}

/// The attempts count a conditional update compares with: the one read.
fn attempts(call: &StoredCall) -> i32 {
    i32::try_from(call.attempts).unwrap_or(i32::MAX)
}

/// Up to `limit` calls of `scopes` that are due, and when the next one will be. An error
/// says what the store was doing.
pub async fn due_calls<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    scopes: &[&str],
    limit: u32,
) -> Result<Due, (&'static str, C::Error)> {
    let failed = |e| ("finding resumable calls", e);
    let calls = conn
        .fetch_calls(d.completer.due_calls(scopes, limit))
        .await
        .map_err(failed)?
        .into_iter()
        .map(stored_call)
        .collect();
    let next_in = conn
        .fetch_millis(d.completer.next_due_in(scopes))
        .await
        .map_err(failed)?
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    Ok(Due::new(calls, next_in))
}

/// Claims the next attempt at `call`, the one after it due `backoff` from now: `false` when
/// another completer claimed it first (the count moved on since `call` was read).
pub async fn begin_attempt<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    backoff: Duration,
) -> Result<bool, (&'static str, C::Error)> {
    let begin = d
        .completer
        .begin_attempt(&call.id, attempts(call), millis(backoff));
    conn.execute(begin)
        .await
        .map(|changed| changed == 1)
        .map_err(|e| ("claiming an attempt", e))
}

/// Keeps the start of `error`, the attempt's that just failed, for the next give-up.
pub async fn note_failure<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    error: &str,
) -> Result<(), (&'static str, C::Error)> {
    let error: String = error.chars().take(KEPT_ERROR_CHARS).collect();
    conn.execute(d.completer.note_call_error(&call.id, error))
        .await
        .map(drop)
        .map_err(|e| ("keeping an attempt's error", e))
}

/// Gives `call` up with `payload` in `conn`, a transaction the store began, if it is still in
/// progress with its lease ended and its final phase not committed, and owes its hook
/// (retried `hook_retry` from now). `false` (nothing written) when it finished or was taken
/// over meanwhile: the store rolls back; otherwise it commits.
pub async fn give_up<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    payload: Vec<u8>,
    hook_retry: Duration,
) -> Result<bool, (&'static str, C::Error)> {
    let failed = |e| ("giving a call up", e);
    let gave_up = conn
        .execute(d.completer.give_up(&call.id, payload))
        .await
        .map_err(failed)?
        == 1;
    if !gave_up {
        return Ok(false);
    }
    conn.execute(d.completer.owe_hook(&call.id, millis(hook_retry)))
        .await
        .map_err(failed)?;
    Ok(true)
}

/// The steps `call` recorded, by name.
pub async fn steps<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
) -> Result<Steps, (&'static str, C::Error)> {
    conn.fetch_steps(d.lease.select_steps(&call.id))
        .await
        .map_err(|e| ("reading a call's steps", e))
}

/// Forgets a given-up `call` whose hook ran, in `conn`, a transaction the store began and
/// commits: its stored call and its steps go together.
pub async fn forget<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
) -> Result<(), (&'static str, C::Error)> {
    for forget in [
        d.completer.forget_given_up(&call.id),
        d.lease.delete_steps(&call.id),
    ] {
        conn.execute(forget)
            .await
            .map_err(|e| ("forgetting a given-up call", e))?;
    }
    Ok(())
}

/// Scopes other than `scopes` with resumable calls whose lease ended, and how many each.
pub async fn unregistered<C: ResumeConnection>(
    conn: &mut C,
    d: &'static Sql,
    scopes: &[&str],
) -> Result<Vec<(String, u64)>, (&'static str, C::Error)> {
    let counts = conn
        .fetch_counts(d.completer.unregistered_calls(scopes))
        .await
        .map_err(|e| ("counting calls nobody resumes", e))?;
    Ok(counts
        .into_iter()
        .map(|(scope, count)| (scope, u64::try_from(count).unwrap_or(0)))
        .collect())
}
