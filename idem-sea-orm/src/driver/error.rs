//! Classifies database errors into idem errors, without leaking SQL text.

use idem_core::Error;
use sea_orm::DbErr;

pub(crate) use idem_sql::Failure;

/// How a SeaORM user creates a missing ledger, quoted in the error.
pub(crate) const CREATE_TABLES: &str = "call `idem::sea_orm::create_tables(&db)` at startup, or add \
     `idem::sea_orm::Migration` to your sea-orm-migration Migrator";

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
fn database_code(_: &DbErr) -> Option<(String, Option<u16>)> {
    None
}

/// The SQLSTATE (or SQLite result code) and, on MySQL, the error number.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn database_code(e: &DbErr) -> Option<(String, Option<u16>)> {
    use sea_orm::RuntimeErr;
    use std::ops::Deref;

    let (DbErr::Exec(RuntimeErr::SqlxError(err)) | DbErr::Query(RuntimeErr::SqlxError(err))) = e
    else {
        return None;
    };
    let sea_orm::sqlx::Error::Database(db) = err.deref() else {
        return None;
    };
    let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sea_orm::sqlx::mysql::MySqlDatabaseError>() {
        return Some((code, Some(my.number())));
    }
    Some((code, None))
}

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
fn connection_lost(_: &DbErr) -> bool {
    false
}

/// Whether the connection went away under a statement: the server died or was cut off.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn connection_lost(e: &DbErr) -> bool {
    use sea_orm::RuntimeErr;
    use sea_orm::sqlx::Error as Sqlx;

    let (DbErr::Exec(RuntimeErr::SqlxError(err)) | DbErr::Query(RuntimeErr::SqlxError(err))) = e
    else {
        return false;
    };
    matches!(
        &**err,
        Sqlx::Io(_) | Sqlx::PoolTimedOut | Sqlx::PoolClosed | Sqlx::WorkerCrashed
    )
}

pub(crate) fn classify(e: &DbErr) -> Failure {
    if matches!(e, DbErr::ConnectionAcquire(_) | DbErr::Conn(_)) || connection_lost(e) {
        return Failure::Unavailable;
    }
    if let Some(failure) =
        database_code(e).and_then(|(code, number)| Failure::of_code(&code, number))
    {
        return failure;
    }
    if Failure::names_missing_ledger(&e.to_string()) {
        return Failure::MissingTable;
    }
    Failure::Other
}

/// Converts a database error met while `doing` something into an idem error.
pub(crate) fn store_error(doing: &str, e: DbErr) -> Error {
    classify(&e).error(doing, e, CREATE_TABLES)
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Database};

    use super::*;
    use crate::LEDGER_TABLE;

    #[tokio::test]
    async fn a_missing_ledger_is_named_with_the_fix() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        let e = db
            .execute_unprepared(&format!("SELECT id FROM {LEDGER_TABLE}"))
            .await
            .expect_err("no ledger yet");
        assert_eq!(classify(&e), Failure::MissingTable);
        let message = store_error("claiming the key", e).to_string();
        assert!(
            message.contains(&format!("`{LEDGER_TABLE}` is missing")),
            "{message}"
        );
        assert!(message.contains("create_tables"), "{message}");
    }
}
