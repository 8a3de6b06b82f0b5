//! What an operator asks of lease mode, once for every store, on any driver's [`Handle`]:
//! leases that ended without their call finishing, live leases held for long (a hung holder),
//! and the fenced release by hand.

use std::time::Duration;

use idem_core::Error;

use crate::driver::{connect, fetch_each};
use crate::driver::{db_error, failed};
use crate::inspect::existing_tables;
use crate::{CALLS_TABLE, Column, Connection, Decode, Driver, Handle, Row, Sql, millis};

/// A lease that ended without its call finishing (the holder crashed, hung or was dropped): a
/// retry takes it over, and so does a completer when the call is
/// [`resumable`](Self::resumable) and its scope has a resumer; alert on the others.
/// `purge_expired` removes those never taken over with the other expired records.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExpiredLease {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The last holder's fencing token.
    pub token: i64,
    /// How long ago the lease ended (database clock).
    pub ended_ms_ago: i64,
    /// Whether the call is resumable (its arguments are stored): a completer with a resumer
    /// for its scope finishes it. Otherwise only a client retry can.
    pub resumable: bool,
    /// Attempts completers made at it (0 when it is not resumable).
    pub attempts: u32,
}

impl ExpiredLease {
    /// The columns of [`Lease::expired_leases`](crate::Lease::expired_leases), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::Bytes,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I32,
    ];

    /// A row of [`Lease::expired_leases`](crate::Lease::expired_leases)
    /// ([`ExpiredLease::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(Self::from_columns(
            c.bytes()?,
            c.text()?,
            c.text()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.opt_int()?,
        ))
    }

    /// A row of [`Lease::expired_leases`](crate::Lease::expired_leases): `id, scope, idem_key,
    /// token, expires_at_ms, now_ms, attempts` (`attempts` is `NULL` for a call that is not
    /// resumable).
    pub fn from_columns(
        id: Vec<u8>,
        scope: String,
        key: String,
        token: i64,
        expires_at_ms: i64,
        now_ms: i64,
        attempts: Option<i32>,
    ) -> Self {
        Self {
            id,
            scope,
            key,
            token,
            ended_ms_ago: now_ms - expires_at_ms,
            resumable: attempts.is_some(),
            attempts: attempts.map_or(0, |n| u32::try_from(n).unwrap_or(0)),
        }
    }
}

/// A lease still live whose call has run for longer than a threshold: its holder may be hung
/// (renewals keep a lease alive while the process lives). A store's `release_lease` ends it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckLease {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The holder's fencing token.
    pub token: i64,
    /// How long the holder has held it (since its claim or takeover; database clock).
    pub held_ms: i64,
    /// How long until the lease ends unless renewed.
    pub ends_in_ms: i64,
    /// Whether the call is resumable: once released, a completer finishes it.
    pub resumable: bool,
}

impl StuckLease {
    /// The columns of [`Lease::stuck_leases`](crate::Lease::stuck_leases), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::Bytes,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I32,
    ];

    /// A row of [`Lease::stuck_leases`](crate::Lease::stuck_leases)
    /// ([`StuckLease::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(Self::from_columns(
            c.bytes()?,
            c.text()?,
            c.text()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.opt_int()?,
        ))
    }

    /// A row of [`Lease::stuck_leases`](crate::Lease::stuck_leases): `id, scope, idem_key,
    /// token, created_at_ms, expires_at_ms, now_ms, attempts`.
    #[allow(clippy::too_many_arguments)] // one per selected column, in their order
    pub fn from_columns(
        id: Vec<u8>,
        scope: String,
        key: String,
        token: i64,
        created_at_ms: i64,
        expires_at_ms: i64,
        now_ms: i64,
        attempts: Option<i32>,
    ) -> Self {
        Self {
            id,
            scope,
            key,
            token,
            held_ms: now_ms - created_at_ms,
            ends_in_ms: expires_at_ms - now_ms,
            resumable: attempts.is_some(),
        }
    }
}

/// Whether the calls table exists on `conn`'s database (a schema without resumable calls may
/// leave it out): the lease lists join it when it does.
async fn has_calls_table<D: Driver>(
    conn: &mut impl Connection<Error = D::Error>,
    sql: &'static Sql,
) -> Result<bool, Error> {
    let tables = existing_tables(conn, sql)
        .await
        .map_err(|fault| failed::<D>(("listing idem's tables", fault)))?;
    Ok(tables.iter().any(|name| name == CALLS_TABLE))
}

/// Lists up to `limit` leases that ended without their call finishing, oldest first (see
/// [`ExpiredLease`]): a retry takes each over, and a completer a resumable one.
pub async fn expired_leases<D: Driver, H: Handle<D>>(
    db: &H,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let doing = "listing expired leases";
    let (mut conn, sql) = connect(db, doing).await?;
    let calls_table = has_calls_table::<D>(&mut conn, sql).await?;
    let list = sql.lease.expired_leases(i64::from(limit), calls_table);
    fetch_each(&mut conn, list, ExpiredLease::from_row)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))
}

/// Lists up to `limit` live leases held for longer than `held_for`, longest held first (see
/// [`StuckLease`]): their holders may hang, renewing for ever. [`release_lease`] ends one.
pub async fn stuck_leases<D: Driver, H: Handle<D>>(
    db: &H,
    held_for: Duration,
    limit: u32,
) -> Result<Vec<StuckLease>, Error> {
    let doing = "listing stuck leases";
    let (mut conn, sql) = connect(db, doing).await?;
    let calls_table = has_calls_table::<D>(&mut conn, sql).await?;
    let list = sql
        .lease
        .stuck_leases(millis(held_for), i64::from(limit), calls_table);
    fetch_each(&mut conn, list, StuckLease::from_row)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))
}

/// Ends the lease of the call in progress under record `id` by hand, fenced (`idem release`):
/// its token goes up by one and the lease ends now, so a holder still running is refused its
/// next step, renewal and completion
/// ([`Error::LeaseLost`](idem_core::Error::LeaseLost)), and the next retry (or a completer)
/// takes the call over at once from its recorded steps. Returns whether there was a live lease
/// to release (`false`: no record, or one whose lease already ended: the next retry takes that
/// one over anyway). For a holder that hangs: its renewals keep the lease alive for ever
/// otherwise; [`stuck_leases`] lists such calls.
pub async fn release_lease<D: Driver, H: Handle<D>>(db: &H, id: &[u8]) -> Result<bool, Error> {
    let doing = "releasing a lease";
    let (mut conn, sql) = connect(db, doing).await?;
    let released = conn
        .execute(sql.lease.release_by_hand(id))
        .await
        .map_err(|e| db_error::<D>(doing, e))?;
    Ok(released > 0)
}
