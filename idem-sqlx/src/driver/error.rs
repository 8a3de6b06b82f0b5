//! sqlx's errors as idem's, without leaking SQL text.

use idem_core::Error;
use idem_sql::Failure;

/// How a sqlx user creates a missing ledger, quoted in the error.
pub(crate) const CREATE_TABLES: &str = "call `idem::sqlx::create_tables(&pool, &[Family::Ledger])` at startup, or add the \
     output of `idem schema --backend <postgres|mysql|sqlite>` to your migrations";

/// What kind of failure `e` is, as far as the ledger cares.
pub(crate) fn classify(e: &sqlx::Error) -> Failure {
    use sqlx::Error as E;
    match e {
        E::Io(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Tls(_) => {
            Failure::Unavailable
        }
        E::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            #[cfg(feature = "mysql")]
            let number = db
                .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .map(|my| my.number());
            #[cfg(not(feature = "mysql"))]
            let number = None;
            Failure::of_code(&code, number)
                .or_else(|| {
                    Failure::names_missing_ledger(db.message()).then_some(Failure::MissingTable)
                })
                .unwrap_or(Failure::Other)
        }
        _ => Failure::Other,
    }
}

/// Converts a database error met while `doing` something into an idem error.
pub(crate) fn store_error(doing: &str, e: sqlx::Error) -> Error {
    classify(&e).error(doing, e, CREATE_TABLES)
}
