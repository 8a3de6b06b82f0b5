//! What an operator asks of lease mode on a sqlx pool (a health check, an alert, a hung
//! holder): the same reads and the same fenced release as the SeaORM store's and the `idem`
//! command's, over idem-sql's statements.

use std::time::Duration;

use idem_core::Error;
use idem_sql::{
    CALLS_TABLE, Connection, Driver, ExpiredLease, Row, Sql, StuckLease, fetch_each, millis,
};
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::error::{failed, store_error};
use crate::driver::port::{Sqlx, SqlxPooled};

/// A connection of `pool` and the statements of its dialect; `doing` names an acquire that
/// fails.
async fn acquire<DB: Backend>(
    pool: &Pool<DB>,
    doing: &'static str,
) -> Result<(SqlxPooled<DB>, &'static Sql), Error> {
    let conn = Sqlx::new(pool.clone())
        .acquire()
        .await
        .map_err(|e| store_error(doing, e))?;
    Ok((conn, Sql::common(DB::DIALECT)))
}

/// A connection of `pool`, the statements of its dialect, and whether the calls table exists
/// (a schema without resumable calls may leave it out).
async fn reading<DB: Backend>(
    pool: &Pool<DB>,
    doing: &'static str,
) -> Result<(SqlxPooled<DB>, &'static Sql, bool), Error> {
    let (mut conn, sql) = acquire(pool, doing).await?;
    let tables = fetch_each(&mut conn, sql.inspect.existing_tables(), Row::into_text)
        .await
        .map_err(|e| failed(("listing idem's tables", e)))?;
    let calls_table = tables.iter().any(|name| name == CALLS_TABLE);
    Ok((conn, sql, calls_table))
}

/// Lists up to `limit` leases that ended without their call finishing, oldest first (see
/// [`ExpiredLease`]): a retry takes each over, and a completer a resumable one.
pub async fn expired_leases<DB: Backend>(
    pool: &Pool<DB>,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let doing = "listing expired leases";
    let (mut conn, sql, calls_table) = reading(pool, doing).await?;
    let list = sql.lease.expired_leases(i64::from(limit), calls_table);
    fetch_each(&mut conn, list, ExpiredLease::from_row)
        .await
        .map_err(|e| failed((doing, e)))
}

/// Lists up to `limit` live leases held for longer than `held_for`, longest held first (see
/// [`StuckLease`]): their holders may hang, renewing for ever. [`release_lease`] ends one.
pub async fn stuck_leases<DB: Backend>(
    pool: &Pool<DB>,
    held_for: Duration,
    limit: u32,
) -> Result<Vec<StuckLease>, Error> {
    let doing = "listing stuck leases";
    let (mut conn, sql, calls_table) = reading(pool, doing).await?;
    let list = sql
        .lease
        .stuck_leases(millis(held_for), i64::from(limit), calls_table);
    fetch_each(&mut conn, list, StuckLease::from_row)
        .await
        .map_err(|e| failed((doing, e)))
}

/// Ends the lease of the call in progress under record `id` by hand, fenced (`idem release`):
/// its token goes up by one and the lease ends now, so a holder still running is refused its
/// next step, renewal and completion, and the next retry (or a completer) takes the call over
/// from its recorded steps. `false`: no record, or no live lease to release.
pub async fn release_lease<DB: Backend>(pool: &Pool<DB>, id: &[u8]) -> Result<bool, Error> {
    let doing = "releasing a lease";
    let (mut conn, sql) = acquire(pool, doing).await?;
    let released = conn
        .execute(sql.lease.release_by_hand(id))
        .await
        .map_err(|e| store_error(doing, e))?;
    Ok(released > 0)
}
