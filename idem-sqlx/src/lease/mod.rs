//! Lease mode on a sqlx pool: the lease is the ledger row itself (state in progress, `owner`
//! the fencing token, `expires_at_ms` the lease end while in progress), and recovery points
//! live in the steps table. Everything the lease store does is idem-sql's, written once for
//! every driver ([`idem_sql::SqlStore`]: the claim, the fence, the steps, the completion, the
//! final phase); this file names the store and writes the final phase for sqlx's users.

use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::port::Sqlx;

/// The ledger in lease mode on a sqlx pool (PostgreSQL, MySQL/MariaDB, SQLite): the same
/// store as [`SqlxStore`](crate::SqlxStore), named for lease mode.
/// `#[idempotent(..., lease = "…")]` builds one from the handler's `&PgPool` (`&MySqlPool`,
/// `&SqlitePool`); `SqlxLeaseStore::new(pool)` builds one by hand. The ledger and steps tables
/// must exist ([`create_tables`](crate::create_tables) with
/// [`Family::Ledger`](crate::Family::Ledger) and [`Family::Lease`](crate::Family::Lease), or
/// `idem schema` in your migrations).
///
/// The lease commits at once and outlives any transaction: the body runs on the pool, its
/// [`idem::step`](idem_core::lease::step)s are recorded fenced by the lease's token, and its
/// database writes go in [`final_step`] or [`finish`], which record them with a step in one
/// fenced transaction (`writes` gets `&mut PgConnection`, as sqlx's executors take it).
pub type SqlxLeaseStore<DB> = idem_sql::SqlStore<Sqlx<DB>>;

idem_sql::final_phases!([DB: Backend,] Pool<DB>, Sqlx<DB>, |'t| &'t mut DB::Connection, "idem::sqlx");
