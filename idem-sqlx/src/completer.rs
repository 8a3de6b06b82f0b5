//! The completer's store on a sqlx pool: resumable calls live in the calls table
//! ([`Family::Completer`](crate::Family::Completer)), one row per call in progress, written
//! with its claim and deleted when the call is recorded (or, once given up, when its hook
//! ran). What the completer's statements are and what their rows decide is idem-sql's
//! ([`idem_sql::due_calls`] and its neighbours), and so is the store that runs them, written
//! once for every driver ([`idem_sql::SqlStore`]), which the lease store names.

use crate::lease::SqlxLeaseStore;

/// A [`Completer`](idem_core::Completer) on a sqlx pool: finishes resumable lease-mode calls
/// whose clients did not come back. `Completer::new(SqlxLeaseStore::new(pool.clone()))`;
/// the calls table must exist ([`create_tables`](crate::create_tables) with
/// [`Family::Completer`](crate::Family::Completer), or `idem schema`).
pub type Completer<DB> = idem_core::Completer<SqlxLeaseStore<DB>>;
