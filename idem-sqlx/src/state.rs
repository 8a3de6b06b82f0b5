//! Guarded state transitions on a table of the application's: one conditional update inside
//! the handler's transaction, so two different requests can never both move one row (the
//! key guards the gate, the transition guards the inside). The twin of
//! `idem::sea_orm::Stateful` for services that write their own SQL.

use idem_core::{Error, StateMachine, Transition, TransitionOutcome};
use idem_sql::state::Guarded;
use sqlx::{Database, Decode, Encode, Type};

use crate::driver::Backend;
use crate::driver::error::store_error;

/// A table whose rows move through a declared state machine: its name, its key column, its
/// state column and, optionally, a version column that every applied transition increments
/// (optimistic concurrency for other writers; [`EntityTag::from_version`] makes an `ETag`
/// of it).
///
/// ```
/// use idem_sqlx::StateTable;
///
/// const ORDERS: StateTable = StateTable::new("orders", "id", "status").version("version");
/// ```
///
/// Inside an `#[idempotent]` body, where `db` is the claim's transaction:
/// `ORDERS.apply_transition(&mut *db, &order_id, idem::transition!(OrderStatus: Pending -> Paid)).await?`.
/// The state is bound and read as its own sqlx type: `#[derive(sqlx::Type)]` on the state
/// enum maps it to a PostgreSQL enum, a text or an integer column as sqlx does.
///
/// The names are written into the statements as they are (unquoted, as a migration usually
/// creates them), so each must be an identifier (`[A-Za-z_][A-Za-z0-9_]*`, a table may be
/// `schema.table`); any other name is an [`Error::Store`] before anything runs. The statements
/// are idem-sql's ([`idem_sql::state::guarded`]); this type binds the values.
///
/// [`EntityTag::from_version`]: idem_core::EntityTag::from_version
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateTable {
    table: &'static str,
    key: &'static str,
    state: &'static str,
    version: Option<&'static str>,
}

impl StateTable {
    /// The table `table`, whose rows are found by `key` and hold their state in `state`.
    pub const fn new(table: &'static str, key: &'static str, state: &'static str) -> Self {
        Self {
            table,
            key,
            state,
            version: None,
        }
    }

    /// A version column (an integer) that every applied transition increments.
    pub const fn version(mut self, column: &'static str) -> Self {
        self.version = Some(column);
        self
    }

    /// Applies `transition` to the row whose key is `id`, in one guarded statement
    /// (`UPDATE <table> SET <state> = to[, <version> = <version> + 1] WHERE <key> = id AND
    /// <state> = from`), on `conn`, the handler's transaction:
    /// - the row is in `from`: it moves to `to` → [`TransitionOutcome::Applied`];
    /// - the row is already in `to`: nothing is written → [`TransitionOutcome::AlreadyApplied`];
    /// - the row is in another state: nothing is written → [`Error::InvalidTransition`] with
    ///   the row's actual state;
    /// - no such row → [`TransitionOutcome::NotFound`].
    ///
    /// Concurrent transitions on one row queue on its row lock (SQLite: on the database's
    /// write lock, which the claim took) and exactly one of them applies.
    pub async fn apply_transition<C, S, K>(
        &self,
        conn: &mut C,
        id: K,
        transition: Transition<S>,
    ) -> Result<TransitionOutcome, Error>
    where
        C: StateConnection + ?Sized,
        S: StateMachine + Bindable<C::Database> + for<'r> Decode<'r, C::Database>,
        K: Bindable<C::Database> + Clone,
    {
        let Self {
            table,
            key,
            state,
            version,
        } = *self;
        let dialect = <C::Database as Backend>::DIALECT;
        let Guarded { update, read } =
            idem_sql::state::guarded(table, key, state, version, dialect)?;
        let updated = conn
            .guarded_update(update, transition.to(), id.clone(), transition.from())
            .await
            .map_err(|e| store_error("applying a state transition", e))?;
        if updated == 1 {
            return Ok(TransitionOutcome::Applied);
        }
        // Nothing matched: a locking read sees the latest committed state even under MySQL's
        // REPEATABLE READ.
        let current = conn
            .read_state(read, id)
            .await
            .map_err(|e| store_error("reading the row's state", e))?;
        transition.unchanged_row(current)
    }
}

/// A value sqlx binds for `DB` by value: what a state or a key is.
pub trait Bindable<DB: Database>: for<'q> Encode<'q, DB> + Type<DB> + Send + 'static {}

impl<DB: Database, T> Bindable<DB> for T where T: for<'q> Encode<'q, DB> + Type<DB> + Send + 'static {}

mod sealed {
    pub trait Sealed {}
}

/// A sqlx connection a [`StateTable`] runs its statements on: `PgConnection`,
/// `MySqlConnection` or `SqliteConnection` (the body's `db` is one, behind `&mut`). Sealed;
/// its items are plumbing.
pub trait StateConnection: Send + sealed::Sealed {
    /// The database the connection talks to.
    type Database: Backend;

    /// Runs the guarded update; how many rows it changed.
    #[doc(hidden)]
    fn guarded_update<'c, S, K>(
        &'c mut self,
        sql: String,
        to: S,
        id: K,
        from: S,
    ) -> crate::driver::Step<'c, u64>
    where
        S: Bindable<Self::Database>,
        K: Bindable<Self::Database>;

    /// Reads the row's state, if the row exists.
    #[doc(hidden)]
    fn read_state<'c, S, K>(&'c mut self, sql: String, id: K) -> crate::driver::Step<'c, Option<S>>
    where
        S: Bindable<Self::Database> + for<'r> Decode<'r, Self::Database>,
        K: Bindable<Self::Database>;
}

// Unused when no database feature is on.
#[allow(unused_macros)]
macro_rules! state_connection {
    ($conn:ty, $db:ty) => {
        impl sealed::Sealed for $conn {}

        impl StateConnection for $conn {
            type Database = $db;

            fn guarded_update<'c, S, K>(
                &'c mut self,
                sql: String,
                to: S,
                id: K,
                from: S,
            ) -> crate::driver::Step<'c, u64>
            where
                S: Bindable<Self::Database>,
                K: Bindable<Self::Database>,
            {
                Box::pin(async move {
                    let query = sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(to)
                        .bind(id)
                        .bind(from);
                    Ok(query.execute(&mut *self).await?.rows_affected())
                })
            }

            fn read_state<'c, S, K>(
                &'c mut self,
                sql: String,
                id: K,
            ) -> crate::driver::Step<'c, Option<S>>
            where
                S: Bindable<Self::Database> + for<'r> Decode<'r, Self::Database>,
                K: Bindable<Self::Database>,
            {
                Box::pin(async move {
                    use sqlx::Row as _;
                    let query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id);
                    let row = query.fetch_optional(&mut *self).await?;
                    row.map(|row| row.try_get::<S, _>(0)).transpose()
                })
            }
        }
    };
}

#[cfg(feature = "postgres")]
state_connection!(sqlx::PgConnection, sqlx::Postgres);
#[cfg(feature = "mysql")]
state_connection!(sqlx::MySqlConnection, sqlx::MySql);
#[cfg(feature = "sqlite")]
state_connection!(sqlx::SqliteConnection, sqlx::Sqlite);
