//! The ledger as a `sea-orm-migration` migration.

use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{MigrationName, MigrationTrait, SchemaManager, async_trait};

use crate::outbox::outbox_ddl;
use crate::sql::Sql;

/// Creates the ledger table; add it to your Migrator's list:
///
/// ```text
/// fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///     vec![Box::new(idem::sea_orm::Migration), Box::new(m20260101_create_orders::Migration)]
/// }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000001_create_idem_ledger"
    }
}

// The elided lifetime must stay elided: `async_trait` expands the trait's `&SchemaManager`
// with a late-bound lifetime, and `<'_>` would make it early-bound (E0195).
#[allow(elided_lifetimes_in_paths)]
#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in &Sql::of(db.get_database_backend()).ledger_tables.create {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in &Sql::of(db.get_database_backend()).ledger_tables.drop {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }
}

/// Creates the outbox tables (`idem_outbox`, `idem_outbox_heads`, `idem_dead_letters`); add
/// it after [`Migration`]:
///
/// ```text
/// vec![Box::new(idem::sea_orm::Migration), Box::new(idem::sea_orm::OutboxMigration), ...]
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct OutboxMigration;

impl MigrationName for OutboxMigration {
    fn name(&self) -> &str {
        "m20261123_000001_create_idem_outbox"
    }
}

#[allow(elided_lifetimes_in_paths)]
#[async_trait::async_trait]
impl MigrationTrait for OutboxMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in outbox_ddl(db.get_database_backend()).0 {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in outbox_ddl(db.get_database_backend()).1 {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }
}

/// Creates the steps table of lease mode (`idem_steps`); add it after [`Migration`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseMigration;

impl MigrationName for LeaseMigration {
    fn name(&self) -> &str {
        "m20261123_000002_create_idem_steps"
    }
}

#[allow(elided_lifetimes_in_paths)]
#[async_trait::async_trait]
impl MigrationTrait for LeaseMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in &Sql::of(db.get_database_backend()).steps_tables.create {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in &Sql::of(db.get_database_backend()).steps_tables.drop {
            db.execute_unprepared(sql).await?;
        }
        Ok(())
    }
}

/// Every idem migration, in order: the ledger, the outbox, the steps of lease mode. Put them
/// first in your Migrator's list: `let mut all = idem::sea_orm::migrations(); all.push(..)`.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![
        Box::new(Migration),
        Box::new(OutboxMigration),
        Box::new(LeaseMigration),
    ]
}
