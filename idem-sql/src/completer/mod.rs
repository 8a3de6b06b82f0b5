//! Resumable calls and their completers, once for every store: which statements a
//! completer's store runs and what their rows decide ([`due_calls`], [`begin_attempt`],
//! [`note_failure`], [`give_up`], [`steps`], [`forget`], [`unregistered`]), over any
//! driver's [`Connection`] (its pooled connection, or a transaction begun for [`give_up`] and
//! [`forget`]); `store.rs` implements idem-core's
//! [`ResumeStore`](idem_core::completer::ResumeStore) with them, once, for every driver.

use std::time::Duration;

use idem_core::completer::{Due, Steps, StoredCall};

mod statements;
mod store;

pub use statements::Completer;

use crate::driver::{fetch_each, fetch_first};
use crate::{Column, Connection, Decode, Fault, Row, Sql, millis, read_step};

/// The longest error text kept for a give-up: an error can be long (a response body); its
/// start says what failed.
const KEPT_ERROR_CHARS: usize = 2000;

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
    let mut c = row.read();
    let (id, scope, principal, key, args) =
        (c.bytes()?, c.text()?, c.text()?, c.text()?, c.bytes()?);
    let attempts: i32 = c.int()?;
    let last_error = c.opt_text()?;
    let (gave_up, final_phase_done): (i16, i16) = (c.int()?, c.int()?);
    Ok(StoredCall::new(
        id,
        scope,
        principal,
        key,
        args,
        u32::try_from(attempts).unwrap_or(0),
        last_error,
        gave_up == 1,
    )
    .with_final_phase_done(final_phase_done == 1))
}

/// A row of [`Completer::unregistered_calls`]: a scope and how many of its calls are due.
pub fn read_count(row: Row) -> Result<(String, i64), Decode> {
    let mut c = row.read();
    Ok((c.text()?, c.i64()?))
}

/// The attempts count a conditional update compares with: the one read.
fn attempts(call: &StoredCall) -> i32 {
    i32::try_from(call.attempts).unwrap_or(i32::MAX)
}

/// What a completer's step returns: its answer, or what it was doing when the statement
/// failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// Up to `limit` calls of `scopes` that are due, and when the next one will be. An error
/// says what the store was doing.
pub async fn due_calls<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    scopes: &[&str],
    limit: u32,
) -> Done<Due, C> {
    let failed = |e| ("finding resumable calls", e);
    let calls = fetch_each(conn, d.completer.due_calls(scopes, limit), read_stored_call)
        .await
        .map_err(failed)?;
    let next_in = fetch_first(conn, d.completer.next_due_in(scopes), Row::into_opt_i64)
        .await
        .map_err(failed)?
        .flatten()
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    Ok(Due::new(calls, next_in))
}

/// Claims the next attempt at `call`, the one after it due `backoff` from now: `false` when
/// another completer claimed it first (the count moved on since `call` was read).
pub async fn begin_attempt<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    backoff: Duration,
) -> Done<bool, C> {
    let begin = d
        .completer
        .begin_attempt(&call.id, attempts(call), millis(backoff));
    conn.execute(begin)
        .await
        .map(|changed| changed == 1)
        .map_err(|e| ("claiming an attempt", Fault::Db(e)))
}

/// Keeps the start of `error`, the attempt's that just failed, for the next give-up.
pub async fn note_failure<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    error: &str,
) -> Done<(), C> {
    let error: String = error.chars().take(KEPT_ERROR_CHARS).collect();
    conn.execute(d.completer.note_call_error(&call.id, error))
        .await
        .map(drop)
        .map_err(|e| ("keeping an attempt's error", Fault::Db(e)))
}

/// Gives `call` up with `payload` in `conn`, a transaction the store began, if it is still in
/// progress with its lease ended and its final phase not committed, and owes its hook
/// (retried `hook_retry` from now). `false` (nothing written) when it finished or was taken
/// over meanwhile: the store rolls back; otherwise it commits.
pub async fn give_up<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
    payload: Vec<u8>,
    hook_retry: Duration,
) -> Done<bool, C> {
    let failed = |e| ("giving a call up", Fault::Db(e));
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
pub async fn steps<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
) -> Done<Steps, C> {
    fetch_each(conn, d.lease.select_steps(&call.id), read_step)
        .await
        .map_err(|e| ("reading a call's steps", e))
}

/// Forgets a given-up `call` whose hook ran, in `conn`, a transaction the store began and
/// commits: its stored call and its steps go together.
pub async fn forget<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    call: &StoredCall,
) -> Done<(), C> {
    for forget in [
        d.completer.forget_given_up(&call.id),
        d.lease.delete_steps(&call.id),
    ] {
        conn.execute(forget)
            .await
            .map_err(|e| ("forgetting a given-up call", Fault::Db(e)))?;
    }
    Ok(())
}

/// Scopes other than `scopes` with resumable calls whose lease ended, and how many each.
pub async fn unregistered<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    scopes: &[&str],
) -> Done<Vec<(String, u64)>, C> {
    let counts = fetch_each(conn, d.completer.unregistered_calls(scopes), read_count)
        .await
        .map_err(|e| ("counting calls nobody resumes", e))?;
    Ok(counts
        .into_iter()
        .map(|(scope, count)| (scope, u64::try_from(count).unwrap_or(0)))
        .collect())
}
