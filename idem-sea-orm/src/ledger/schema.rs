//! Creating idem's tables: at start-up ([`create_tables`], only the families a database
//! lacks) or as DDL for a service's own migrations ([`schema`]).

use idem_core::Error;
use idem_sql::{Family, Handle};

use crate::SeaOrm;

/// Creates the ledger, the steps and calls tables of lease mode, and the outbox tables (with
/// their indexes) where they do not exist ([`idem_sql::create_tables`] of every family: DDL
/// only for a family with a missing table). Call it once at startup (or use the migrations,
/// feature `migration`; on a cluster, prefer migrating once to creating at start).
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// idem_sea_orm::create_tables(&db).await?;
/// idem_sea_orm::create_tables(&db).await?; // finds everything there: no DDL
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub async fn create_tables<C: Handle<SeaOrm>>(db: &C) -> Result<(), Error> {
    idem_sql::create_tables(db, &Family::ALL).await
}

/// The DDL of `family`'s tables for `backend`, as a migration file (comment, then each
/// statement ending in `;`): what a service puts in its own migrations to create only the
/// tables of the features it uses (`idem schema --backend … --only …` prints the same, and
/// `idem-sql/schema/` holds every file). Atomic mode needs [`Family::Ledger`] alone.
pub fn schema(backend: sea_orm::DbBackend, family: Family) -> String {
    idem_sql::schema(crate::driver::dialect(backend), family)
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Database};

    use idem_sql::inspect::{missing_tables, record};
    use idem_sql::names::ALL_TABLES;

    #[tokio::test]
    async fn a_fresh_database_lacks_every_table_until_create_tables() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        assert_eq!(missing_tables(&db).await.expect("list"), ALL_TABLES);
        super::create_tables(&db).await.expect("tables");
        assert_eq!(missing_tables(&db).await.expect("list"), Vec::<&str>::new());
        assert_eq!(record(&db, &[7; 32]).await.expect("read"), None);
    }

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
