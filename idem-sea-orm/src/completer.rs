//! The completer's store on the SeaORM ledger: resumable calls live in the calls table
//! ([`CALLS_TABLE`](crate::CALLS_TABLE)), one row per call in progress, written with its claim
//! and deleted when the call is recorded (or, once given up, when its hook ran). What the
//! completer's statements are and what their rows decide is idem-sql's
//! ([`idem_sql::due_calls`] and its neighbours), and so is the store that runs them, written
//! once for every driver ([`idem_sql::SqlStore`]), which the lease store names.

use crate::lease::SeaOrmLeaseStore;

/// A [`Completer`](idem_core::Completer) on the SeaORM ledger: finishes resumable lease-mode
/// calls whose clients did not come back. `Completer::new(SeaOrmLeaseStore::new(db))`.
pub type Completer = idem_core::Completer<SeaOrmLeaseStore>;
