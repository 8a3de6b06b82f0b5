//! sqlx's errors as idem's, without leaking SQL text.

use idem_core::Error;
use idem_sql::{Failure, LEDGER_TABLE};

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
    let message = match classify(&e) {
        Failure::MissingTable => {
            return Error::Store {
                message: format!(
                    "the ledger table `{LEDGER_TABLE}` is missing: call \
                    `idem::sqlx::create_tables(&pool, &[Family::Ledger])` at startup, or add \
                    the output of `idem schema --backend <postgres|mysql|sqlite>` to your \
                    migrations"
                ),
                source: Some(Box::new(e)),
            };
        }
        Failure::Unavailable => {
            return Error::Unavailable {
                message: format!("no database connection while {doing} ({e})"),
                retry_after: std::time::Duration::from_secs(1),
            };
        }
        Failure::Transient => return Error::conflict(doing),
        Failure::LockTimeout => format!("lock wait timed out while {doing}"),
        Failure::Other => format!("database error while {doing}"),
    };
    Error::store(message, e)
}
