//! The ledger, outbox and lease migrations run from a user's own sea-orm-migration Migrator, and the store
//! works on the table it creates.

use sea_orm::{ConnectionTrait, Database, Statement};
use sea_orm_migration::{MigrationTrait, MigratorTrait, async_trait};

struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        idem_sea_orm::migrations()
    }
}

async fn ledger_tables(db: &sea_orm::DatabaseConnection) -> i64 {
    let stmt = Statement::from_string(
        db.get_database_backend(),
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN \
        ('idem_ledger', 'idem_outbox', 'idem_outbox_heads', 'idem_dead_letters', 'idem_steps')",
    );
    db.query_one_raw(stmt)
        .await
        .expect("query")
        .expect("row")
        .try_get_by_index::<i64>(0)
        .expect("count")
}

#[tokio::test]
async fn the_migrations_create_and_drop_the_ledger_and_the_outbox() {
    let db = Database::connect("sqlite::memory:").await.expect("db");
    Migrator::up(&db, None).await.expect("up");
    assert_eq!(ledger_tables(&db).await, 5);
    assert_eq!(
        idem_sea_orm::purge_expired(&db, 100).await.expect("purge"),
        0
    );
    assert_eq!(
        idem_sea_orm::outbox_health(&db)
            .await
            .expect("health")
            .pending,
        0
    );
    Migrator::down(&db, None).await.expect("down");
    assert_eq!(ledger_tables(&db).await, 0);
}
