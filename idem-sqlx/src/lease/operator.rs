//! What an operator asks of lease mode on a sqlx pool (a health check, an alert, a hung
//! holder): idem-sql's reads and fenced release ([`idem_sql::expired_leases`], ...), the same
//! as the SeaORM store's and the `idem` command's, on a pooled connection.

use std::time::Duration;

use idem_core::Error;
use idem_sql::{Driver, ExpiredLease, Sql, StuckLease};
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::error::store_error;
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

/// Lists up to `limit` leases that ended without their call finishing, oldest first (see
/// [`ExpiredLease`]): a retry takes each over, and a completer a resumable one.
pub async fn expired_leases<DB: Backend>(
    pool: &Pool<DB>,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let (mut conn, sql) = acquire(pool, "listing expired leases").await?;
    idem_sql::expired_leases::<Sqlx<DB>>(&mut conn, sql, limit).await
}

/// Lists up to `limit` live leases held for longer than `held_for`, longest held first (see
/// [`StuckLease`]): their holders may hang, renewing for ever. [`release_lease`] ends one.
pub async fn stuck_leases<DB: Backend>(
    pool: &Pool<DB>,
    held_for: Duration,
    limit: u32,
) -> Result<Vec<StuckLease>, Error> {
    let (mut conn, sql) = acquire(pool, "listing stuck leases").await?;
    idem_sql::stuck_leases::<Sqlx<DB>>(&mut conn, sql, held_for, limit).await
}

/// Ends the lease of the call in progress under record `id` by hand, fenced (`idem release`;
/// see [`idem_sql::release_lease`]). `false`: no record, or no live lease to release.
pub async fn release_lease<DB: Backend>(pool: &Pool<DB>, id: &[u8]) -> Result<bool, Error> {
    let (mut conn, sql) = acquire(pool, "releasing a lease").await?;
    idem_sql::release_lease::<Sqlx<DB>>(&mut conn, sql, id).await
}
