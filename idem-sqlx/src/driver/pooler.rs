//! Pools that reach PostgreSQL through a transaction pooler (PgBouncer, Supavisor, RDS Proxy
//! in transaction mode), where a named prepared statement lives on a server connection the
//! next transaction may not get, and another client's statement of the same name may already
//! be there (`42P05 prepared statement "sqlx_s_1" already exists`).

use std::sync::Mutex;

use sqlx::Pool;

use crate::driver::Backend;

/// The pools whose statements run unnamed, by [`identity`].
static UNNAMED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Says that `pool` goes through a transaction pooler: idem runs its statements on it as
/// unnamed prepared statements (sqlx's `persistent(false)`), which a pooler can hand to any
/// server connection. Call it once, after connecting; it holds for the pool and its clones.
/// Your own queries on such a pool need `.persistent(false)` too.
///
/// An unnamed statement is parsed for every execution: one round trip more per statement
/// than a cached one, so call it only where a pooler needs it.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// idem_sqlx::through_transaction_pooler(&pool);
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub fn through_transaction_pooler<DB: Backend>(pool: &Pool<DB>) {
    let mut unnamed = UNNAMED.lock().unwrap_or_else(|e| e.into_inner());
    let id = identity(pool);
    if !unnamed.contains(&id) {
        unnamed.push(id);
    }
}

/// Whether idem's statements on `pool` are named (cached) prepared statements.
pub(crate) fn named<DB: Backend>(pool: &Pool<DB>) -> bool {
    let unnamed = UNNAMED.lock().unwrap_or_else(|e| e.into_inner());
    !unnamed.contains(&identity(pool))
}

/// A number that a pool and its clones share: where their shared options live.
pub(crate) fn identity<DB: Backend>(pool: &Pool<DB>) -> usize {
    std::ptr::from_ref(pool.options()) as usize
}
