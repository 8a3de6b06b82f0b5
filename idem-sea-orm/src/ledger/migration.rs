//! The ledger, the outbox and the steps of lease mode as `sea-orm-migration` migrations.

use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{MigrationName, MigrationTrait, SchemaManager, async_trait};

use crate::driver::Sql;

/// Creates the ledger table ([`LEDGER_TABLE`](crate::LEDGER_TABLE)); add it to your Migrator's
/// list:
///
/// ```text
/// fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///     vec![Box::new(idem::sea_orm::Migration), Box::new(m20260101_create_orders::Migration)]
/// }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Migration;

/// Creates the outbox tables ([`OUTBOX_TABLE`](crate::OUTBOX_TABLE),
/// [`OUTBOX_HEADS_TABLE`](crate::OUTBOX_HEADS_TABLE),
/// [`DEAD_LETTERS_TABLE`](crate::DEAD_LETTERS_TABLE)); add it after [`Migration`]:
///
/// ```text
/// vec![Box::new(idem::sea_orm::Migration), Box::new(idem::sea_orm::OutboxMigration), ...]
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct OutboxMigration;

/// Creates the steps table of lease mode ([`STEPS_TABLE`](crate::STEPS_TABLE)); add it after
/// [`Migration`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseMigration;

/// Creates the table of resumable calls ([`CALLS_TABLE`](crate::CALLS_TABLE)), which
/// [`Completer`](crate::Completer)s work from; add it after [`LeaseMigration`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CompleterMigration;

/// Implements a migration of one family of tables (`$tables`, a field of [`Sql`]) named
/// `$name`: `up` creates the tables, `down` drops them.
macro_rules! tables_migration {
    ($migration:ident, $name:literal, $tables:ident) => {
        impl MigrationName for $migration {
            fn name(&self) -> &str {
                $name
            }
        }

        // The elided lifetime must stay elided: `async_trait` expands the trait's
        // `&SchemaManager` with a late-bound lifetime, and `<'_>` would make it early-bound
        // (E0195).
        #[allow(elided_lifetimes_in_paths)]
        #[async_trait::async_trait]
        impl MigrationTrait for $migration {
            async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                execute(manager, |sql| &sql.$tables.tables.create).await
            }

            async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                execute(manager, |sql| &sql.$tables.tables.drop).await
            }
        }
    };
}

tables_migration!(Migration, "m20261122_000001_create_idem_ledger", ledger);
tables_migration!(
    OutboxMigration,
    "m20261123_000001_create_idem_outbox",
    outbox
);
tables_migration!(LeaseMigration, "m20261123_000002_create_idem_steps", lease);

tables_migration!(
    CompleterMigration,
    "m20261124_000001_create_idem_calls",
    completer
);

/// Runs the `statements` of the connection's backend, in order.
async fn execute(
    manager: &SchemaManager<'_>,
    statements: fn(&Sql) -> &[String],
) -> Result<(), DbErr> {
    let db = manager.get_connection();
    for sql in statements(crate::driver::of(db.get_database_backend())) {
        db.execute_unprepared(sql).await?;
    }
    Ok(())
}

/// Every idem migration, in order: the ledger, the outbox, the steps of lease mode, the
/// resumable calls. Put them
/// first in your Migrator's list: `let mut all = idem::sea_orm::migrations(); all.push(..)`.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![
        Box::new(Migration),
        Box::new(OutboxMigration),
        Box::new(LeaseMigration),
        Box::new(CompleterMigration),
    ]
}
