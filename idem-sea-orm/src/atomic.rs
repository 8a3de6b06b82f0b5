//! Atomic mode on SeaORM: idem-sql's one store on a [`DatabaseConnection`], or, for a call
//! nested in another's body, in savepoints of that body's [`DatabaseTransaction`].
//!
//! [`DatabaseConnection`]: sea_orm::DatabaseConnection
//! [`DatabaseTransaction`]: sea_orm::DatabaseTransaction

use crate::driver::port::SeaOrm;

/// The ledger on a SeaORM connection (SQLite, PostgreSQL, MySQL/MariaDB): idem-sql's one
/// store on the [`SeaOrm`] driver.
///
/// `#[idempotent]` builds one from the handler's `&DatabaseConnection`; you rarely name it.
/// The handler's body runs in the claim's `DatabaseTransaction`, so the claim, the body's
/// writes and the recorded result commit together or not at all. `SeaOrmStore::new(&db)`
/// builds one on the pool.
///
/// Called with another call's body `db` (a `&DatabaseTransaction`), an `#[idempotent]`
/// function claims in a savepoint of that transaction instead ([`NestedStore`]): the inner
/// call's claim, writes and record commit with the outer call, or not at all; dropped before
/// it ends, it leaves nothing.
pub type SeaOrmStore = idem_sql::SqlStore<SeaOrm>;

/// The ledger in another call's body: an `#[idempotent]` function called with that body's
/// `&DatabaseTransaction` claims its key in a savepoint of it (`NestedStore::new(tx)`).
pub type NestedStore<'c> = idem_sql::Nested<'c, SeaOrm>;

/// The ledger on whichever a `DatabaseExecutor` is: the pool, or another call's body.
pub type ExecutorStore<'c> = idem_sql::ConnStore<SeaOrm, NestedStore<'c>>;

/// A key claimed on the SeaORM ledger: the claim's transaction, which the handler's body runs
/// in (or a savepoint of the outer call's, nested).
pub type ClaimedTx = idem_sql::ClaimedTx<SeaOrm>;
