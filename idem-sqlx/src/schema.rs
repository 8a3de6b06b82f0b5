//! Creating idem's tables from the application, for services that do not keep them in their
//! own migrations (`idem schema` prints the same statements as files).

use idem_core::Error;
use idem_sql::{Dialect, Family, Row, Sql};
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::error::store_error;

/// Creates the tables of `families` (atomic mode needs [`Family::Ledger`] alone; see
/// [`Family`]) if they are missing. It reads the catalogue first and runs DDL only for a
/// family with a missing table, so a restart runs no DDL against a live ledger (on a Galera
/// cluster even `CREATE TABLE IF NOT EXISTS` aborts transactions cluster-wide). SQLite runs
/// its (idempotent) DDL every time, as SeaORM's store does: it is embedded, so no other node
/// aborts, and the DDL drops the expiry index that ledgers of earlier versions have.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// idem_sqlx::create_tables(&pool, &[idem_sqlx::Family::Ledger]).await?;
/// idem_sqlx::create_tables(&pool, &[idem_sqlx::Family::Ledger]).await?; // already there
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
pub async fn create_tables<DB: Backend>(pool: &Pool<DB>, families: &[Family]) -> Result<(), Error> {
    let sql = Sql::of(DB::flavour(pool).await);
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| store_error("creating idem's tables", e))?;
    // SQLite reruns every family's DDL: no need to read its catalogue.
    let existing = if sql.dialect == Dialect::Sqlite {
        None
    } else {
        let named = crate::driver::pooler::named(pool);
        let existing = DB::fetch_each(
            &mut *conn,
            sql.inspect.existing_tables(),
            named,
            Row::into_text,
        )
        .await
        .map_err(|e| store_error("listing idem's tables", e))?;
        Some(existing)
    };
    for &family in families {
        let present = |table: &&str| existing.iter().flatten().any(|name| name == table);
        if existing.is_some() && family.tables().iter().all(present) {
            continue;
        }
        for statement in &sql.tables(family).create {
            DB::execute_unprepared(&mut *conn, statement)
                .await
                .map_err(|e| store_error("creating idem's tables", e))?;
        }
    }
    Ok(())
}
