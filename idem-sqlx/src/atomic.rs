//! Atomic mode on sqlx: idem-sql's one store ([`idem_sql::SqlStore`]) on a sqlx pool, and
//! [`Conn`], the connection of a function called both at the top of a request (on a pool)
//! and inside another call's body (on that body's `&mut PgConnection`).

use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::port::Sqlx;

/// The ledger on a sqlx pool (PostgreSQL, MySQL/MariaDB, SQLite): idem-sql's one store on
/// the [`Sqlx`] driver.
///
/// `#[idempotent]` builds one from the handler's `&PgPool` (`&MySqlPool`, `&SqlitePool`);
/// you rarely name it. The handler's body runs in the claim's transaction, lent to it as
/// `&mut PgConnection` (what sqlx's executors take: `query.execute(&mut *db)`), so the claim,
/// the body's writes and the recorded result commit together or not at all. Build one with
/// `SqlxStore::new(Sqlx::new(pool.clone()))`; the ledger table must exist
/// ([`crate::create_tables`], or `idem schema` in your migrations).
pub type SqlxStore<DB> = idem_sql::SqlStore<Sqlx<DB>>;

/// A key claimed on a sqlx pool: the claim's transaction, which the handler's body runs in.
pub type ClaimedTx<DB> = idem_sql::ClaimedTx<Sqlx<DB>>;

/// Another call's body, lent to the calls nested in it ([`Conn::Nested`]).
pub type Nested<'c, DB> = idem_sql::Nested<'c, Sqlx<DB>>;

/// A key claimed in a savepoint of another call's transaction.
pub type NestedClaim<'c, DB> = idem_sql::NestedClaim<'c, Sqlx<DB>>;

/// The store behind a [`Conn`]: the pool's, or savepoints in another call's transaction.
pub type ConnStore<'a, 'c, DB> = idem_sql::ConnStore<Sqlx<DB>, &'a Nested<'c, DB>>;

/// A key claimed through a [`Conn`].
pub type ConnClaimed<'c, DB> = idem_sql::ConnClaimed<Sqlx<DB>, NestedClaim<'c, DB>>;

/// The connection of an `#[idempotent]` function that is called at the top of a request (on
/// a pool) and inside another call's body (on that body's transaction). Build it with `.into()`
/// from either:
///
/// ```text
/// #[idempotent(scope = "shop.charge", key = cmd.key)]
/// async fn charge(db: idem::sqlx::Conn<'_, Postgres>, cmd: Charge) -> Result<Receipt, ShopError> {
///     sqlx::query("INSERT INTO charges ...").execute(&mut *db).await?;   // db: &mut PgConnection
///     ...
/// }
/// charge((&pool).into(), cmd).await                  // at the top: a transaction of its own
/// charge((&mut *db).into(), cmd).await               // in another call's body: a savepoint in it
/// ```
///
/// Nested, the call claims its key in a savepoint of the outer transaction: its record and its
/// writes commit when the outer call commits, and vanish if it rolls back (the outer call's
/// retry then runs the inner one again, with the same key). A final error of the inner call is
/// recorded and the outer body goes on. Its record is invisible to other transactions until
/// the outer commit, so a duplicate elsewhere waits for the outer call's lock on the key. A
/// nested call dropped before it ends leaves nothing in the outer commit: its savepoint is
/// sqlx's own nested transaction, rolled back to before the body's next statement.
pub enum Conn<'c, DB: Backend> {
    /// At the top: the claim begins a transaction on the pool.
    Pool(&'c Pool<DB>),
    /// Inside another call's body: the claim is a savepoint of that body's transaction.
    Nested(Nested<'c, DB>),
}

impl<'c, DB: Backend> From<&'c Pool<DB>> for Conn<'c, DB> {
    fn from(pool: &'c Pool<DB>) -> Self {
        Self::Pool(pool)
    }
}

impl<'c, DB: Backend> From<&'c mut DB::Connection> for Conn<'c, DB> {
    fn from(conn: &'c mut DB::Connection) -> Self {
        Self::Nested(idem_sql::Nested::new(conn))
    }
}

impl<'c, DB: Backend> Conn<'c, DB> {
    /// The store of this connection: the pool's, or savepoints in the body it holds.
    pub fn store(&self) -> ConnStore<'_, 'c, DB> {
        match self {
            Conn::Pool(pool) => idem_sql::ConnStore::new(*pool),
            Conn::Nested(nested) => idem_sql::ConnStore::Nested(nested),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Conn<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Self::Pool(_) => "Pool",
            Self::Nested(_) => "Nested",
        };
        f.debug_tuple(kind).field(&DB::NAME).finish()
    }
}
