//! The shop's data model, shared by the examples (and by tests that include this file): the
//! order lifecycle declared as a state machine, and the order and payment tables.

#![allow(dead_code)] // each includer uses its own part of this shared module

use idem::sea_orm::Stateful;
use idem::{idempotent, transition};
use sea_orm::entity::prelude::*;
use sea_orm::sea_query::{ColumnDef, Table};
use sea_orm::{DatabaseConnection, QuerySelect, Schema};
use serde::{Deserialize, Serialize};

/// The order's lifecycle, declared once. `transition!` checks every use at compile time.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    EnumIter,
    DeriveActiveEnum,
    Serialize,
    Deserialize,
    idem::StateMachine,
)]
#[sea_orm(rs_type = "String", db_type = "String(StringLen::N(16))")]
#[serde(rename_all = "lowercase")]
#[transitions(Pending -> Paid, Pending -> Cancelled, Paid -> Shipped, Paid -> Refunded)]
pub(crate) enum OrderStatus {
    #[sea_orm(string_value = "pending")]
    Pending,
    #[sea_orm(string_value = "paid")]
    Paid,
    #[sea_orm(string_value = "cancelled")]
    Cancelled,
    #[sea_orm(string_value = "shipped")]
    Shipped,
    #[sea_orm(string_value = "refunded")]
    Refunded,
}

pub(crate) mod order {
    use super::OrderStatus;
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "shop_orders")]
    pub(crate) struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub(crate) id: String,
        pub(crate) customer: String,
        pub(crate) amount_cents: i64,
        pub(crate) currency: String,
        pub(crate) status: OrderStatus,
        /// Advanced by every applied transition and every conditional update (optimistic
        /// concurrency for other writers); the order's `ETag` is made from it.
        pub(crate) version: i64,
        /// A note from the customer (`PATCH /orders/{id}` with `If-Match`); nullable, so rows
        /// and writers from before it existed stay valid.
        #[sea_orm(column_type = "Text", nullable)]
        pub(crate) note: Option<String>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub(crate) mod payment {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "shop_payments")]
    pub(crate) struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub(crate) id: String,
        pub(crate) order_id: String,
        pub(crate) amount_cents: i64,
        pub(crate) charge_id: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

impl Stateful for order::Entity {
    type State = OrderStatus;
    fn state_column() -> order::Column {
        order::Column::Status
    }
    fn version_column() -> Option<order::Column> {
        Some(order::Column::Version)
    }
}

/// Creates the idem ledger and the shop's tables (if they do not exist).
pub(crate) async fn create_tables(
    db: &DatabaseConnection,
) -> Result<(), Box<dyn std::error::Error>> {
    idem::sea_orm::create_tables(db).await?;
    let schema = Schema::new(db.get_database_backend());
    for mut table in [
        schema.create_table_from_entity(order::Entity),
        schema.create_table_from_entity(payment::Entity),
    ] {
        db.execute(table.if_not_exists()).await?;
    }
    // Databases made before orders had a note: add the column (the example's one migration).
    let has_note = order::Entity::find()
        .select_only()
        .column(order::Column::Note)
        .limit(1)
        .into_tuple::<Option<String>>()
        .one(db)
        .await
        .is_ok();
    if !has_note {
        let mut add_note = Table::alter();
        add_note
            .table(order::Entity)
            .add_column(ColumnDef::new(order::Column::Note).text().null());
        db.execute(&add_note).await?;
    }
    Ok(())
}

/// Inserts a pending order.
pub(crate) async fn insert_order(
    db: &DatabaseConnection,
    id: &str,
    customer: &str,
    amount_cents: i64,
) -> Result<order::Model, DbErr> {
    order::Entity::insert(order::ActiveModel {
        id: sea_orm::ActiveValue::Set(id.to_owned()),
        customer: sea_orm::ActiveValue::Set(customer.to_owned()),
        amount_cents: sea_orm::ActiveValue::Set(amount_cents),
        currency: sea_orm::ActiveValue::Set("usd".to_owned()),
        status: sea_orm::ActiveValue::Set(OrderStatus::Pending),
        version: sea_orm::ActiveValue::Set(0),
        note: sea_orm::ActiveValue::Set(None),
    })
    .exec_with_returning(db)
    .await
}

/// The payment rows of an order.
pub(crate) async fn payments_of(db: &DatabaseConnection, order_id: &str) -> Result<u64, DbErr> {
    payment::Entity::find()
        .filter(payment::Column::OrderId.eq(order_id))
        .count(db)
        .await
}

/// A command on one order; `idempotency_key` comes from the client.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OrderCommand {
    pub(crate) idempotency_key: String,
    pub(crate) order_id: String,
}

/// Cancels a pending order; answers the transition's outcome (`Applied`, `AlreadyApplied`,
/// `NotFound`), or `InvalidTransition` for an order past `Pending`.
#[idempotent(scope = "shop.orders.cancel-order", key = cmd.idempotency_key)]
pub(crate) async fn cancel_order(
    db: &DatabaseConnection,
    cmd: OrderCommand,
) -> Result<String, idem::Error> {
    let outcome = order::Entity::apply_transition(
        db,
        cmd.order_id,
        transition!(OrderStatus: Pending -> Cancelled),
    )
    .await?;
    Ok(format!("{outcome:?}"))
}

/// Ships a paid order; answers like [`cancel_order`].
#[idempotent(scope = "shop.orders.ship-order", key = cmd.idempotency_key)]
pub(crate) async fn ship_order(
    db: &DatabaseConnection,
    cmd: OrderCommand,
) -> Result<String, idem::Error> {
    let outcome = order::Entity::apply_transition(
        db,
        cmd.order_id,
        transition!(OrderStatus: Paid -> Shipped),
    )
    .await?;
    Ok(format!("{outcome:?}"))
}
