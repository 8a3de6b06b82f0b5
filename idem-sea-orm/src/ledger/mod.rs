//! The ledger table as a SeaORM entity, for inspection, admin tools and tests. The store
//! itself runs hand-written SQL (see the crate docs).

use sea_orm::entity::prelude::*;

#[cfg(feature = "migration")]
pub(crate) mod migration;
pub(crate) mod schema;

use crate::LEDGER_TABLE;

/// The ledger table, [`LEDGER_TABLE`].
#[derive(Copy, Clone, Default, Debug, DeriveEntity)]
pub struct Entity;

// Written out (not `#[sea_orm(table_name = "…")]`) so the name comes from the one constant.
impl EntityName for Entity {
    fn table_name(&self) -> &'static str {
        LEDGER_TABLE
    }
}

/// One record: a claimed, completed or failed `(scope, principal, key)`.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
pub struct Model {
    /// SHA-256 over scope, principal and key (length-prefixed).
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: Vec<u8>,
    /// The handler's scope, e.g. `orders.pay`.
    pub scope: String,
    /// The principal, or an empty string.
    pub principal: String,
    /// The idempotency key.
    pub idem_key: String,
    /// Random token of the attempt that wrote the record.
    pub owner: i64,
    /// SHA-256 fingerprint of the arguments.
    pub fingerprint: Vec<u8>,
    /// 0 pending, 1 completed, 2 failed (final error), 3 given up; see `idem::RecordStatus`.
    pub state: i16,
    /// The recorded value or error, as JSON bytes.
    pub response: Option<Vec<u8>>,
    /// Database time of the claim, epoch milliseconds.
    pub created_at_ms: i64,
    /// Database time after which the record is expired, epoch milliseconds.
    pub expires_at_ms: i64,
}

/// The ledger has no relations.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}

#[cfg(test)]
mod tests {
    use sea_orm::Database;

    use super::*;

    #[tokio::test]
    async fn the_entity_reads_the_table_create_tables_makes() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        crate::create_tables(&db).await.expect("tables");
        assert_eq!(Entity.table_name(), LEDGER_TABLE);
        assert_eq!(Entity::find().all(&db).await.expect("select"), Vec::new());
    }
}
