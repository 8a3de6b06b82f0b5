//! Lease mode on the SeaORM ledger: the lease is the ledger row itself (state in progress,
//! `owner` = the fencing token, `expires_at_ms` = the lease end while in progress), and
//! recovery points live in the steps table ([`STEPS_TABLE`](crate::STEPS_TABLE)). Every write
//! of a holder locks the ledger row and checks its token first, so a holder whose lease was
//! taken over cannot record anything. All of it is idem-sql's, written once for every driver
//! ([`idem_sql::SqlStore`]); this file names the store and writes the final phase for
//! SeaORM's users.

use sea_orm::{DatabaseConnection, DatabaseTransaction};

use crate::driver::port::SeaOrm;

/// The ledger in lease mode on a SeaORM connection: the same store as
/// [`SeaOrmStore`](crate::SeaOrmStore), named for lease mode. `#[idempotent(..., lease =
/// "…")]` builds one from the handler's connection; `SeaOrmLeaseStore::new(db)` by hand. Its
/// [`final_step`] and [`finish`] lend their writes the phase's `&DatabaseTransaction`.
pub type SeaOrmLeaseStore = idem_sql::SqlStore<SeaOrm>;

idem_sql::final_phases!([] DatabaseConnection, SeaOrm, |'t| &'t DatabaseTransaction, "idem::sea_orm");
