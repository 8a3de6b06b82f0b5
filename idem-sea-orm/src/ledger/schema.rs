//! Creating idem's tables: at start-up ([`create_tables`], only the families a database
//! lacks) or as DDL for a service's own migrations ([`schema`]).

use idem_core::Error;
use idem_sql::Family;
use sea_orm::ConnectionTrait;

use crate::driver::error::store_error;
use crate::inspect;
use crate::{
    CALLS_TABLE, DEAD_LETTERS_TABLE, LEDGER_TABLE, OUTBOX_HEADS_TABLE, OUTBOX_TABLE, STEPS_TABLE,
};

/// Creates the ledger, the steps and calls tables of lease mode, and the outbox tables (with
/// their indexes) where they do not exist. Call it once at startup (or use the migrations,
/// feature `migration`).
///
/// On PostgreSQL and MySQL it reads the catalogue first and runs DDL only for a family of
/// tables that is missing: on a cluster (Galera) even `CREATE TABLE IF NOT EXISTS` is
/// replicated as DDL and aborts the transactions committing on that table cluster-wide, so
/// starting a service must not issue it against a live ledger. (On a cluster, prefer migrating
/// once to creating at start.)
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// idem_sea_orm::create_tables(&db).await?;
/// idem_sea_orm::create_tables(&db).await?; // finds everything there: no DDL
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub async fn create_tables<C: ConnectionTrait>(db: &C) -> Result<(), Error> {
    let sql = crate::driver::of(db.get_database_backend());
    // SQLite runs its (idempotent) DDL every time: it is embedded, so no other node aborts,
    // and it drops the expiry index that ledgers of earlier versions have.
    let missing = match crate::driver::backend(sql) {
        sea_orm::DbBackend::Sqlite => crate::driver::ALL_TABLES.to_vec(),
        _ => inspect::missing_tables(db).await?,
    };
    let exists = |table: &str| !missing.contains(&table);
    let families = [
        (
            &sql.ledger.tables,
            &[LEDGER_TABLE][..],
            "creating the ledger table",
        ),
        (
            &sql.lease.tables,
            &[STEPS_TABLE][..],
            "creating the steps table",
        ),
        (
            &sql.completer.tables,
            &[CALLS_TABLE][..],
            "creating the calls table",
        ),
        (
            &sql.outbox.tables,
            &[OUTBOX_TABLE, OUTBOX_HEADS_TABLE, DEAD_LETTERS_TABLE][..],
            "creating the outbox tables",
        ),
    ];
    for (tables, names, doing) in families {
        if names.iter().all(|&name| exists(name)) {
            continue;
        }
        for statement in &tables.create {
            db.execute_unprepared(statement)
                .await
                .map_err(|e| store_error(doing, e))?;
        }
    }
    Ok(())
}

/// The DDL of `family`'s tables for `backend`, as a migration file (comment, then each
/// statement ending in `;`): what a service puts in its own migrations to create only the
/// tables of the features it uses (`idem schema --backend … --only …` prints the same, and
/// `idem-sql/schema/` holds every file). Atomic mode needs [`Family::Ledger`] alone.
pub fn schema(backend: sea_orm::DbBackend, family: Family) -> String {
    let dialect = match backend {
        sea_orm::DbBackend::Postgres => idem_sql::Dialect::Postgres,
        sea_orm::DbBackend::MySql => idem_sql::Dialect::MySql,
        _ => idem_sql::Dialect::Sqlite,
    };
    idem_sql::schema(dialect, family)
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Database};

    #[tokio::test]
    async fn create_tables_makes_a_missing_family_and_leaves_the_others() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        super::create_tables(&db).await.expect("create");
        db.execute_unprepared("DROP TABLE idem_calls")
            .await
            .expect("drop");
        super::create_tables(&db).await.expect("create again");
        db.execute_unprepared("SELECT COUNT(*) FROM idem_calls")
            .await
            .expect("made again");
    }
}
