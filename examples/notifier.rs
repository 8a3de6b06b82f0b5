//! A receipt service that consumes `shop.orders.paid`: `cargo run --example notifier`.
//!
//! `NATS_URL` (required) and `DATABASE_URL` (default: an SQLite file in the temp directory).
//! It consumes stream `SHOP` with the durable consumer `notifier` and "sends a receipt" for
//! each paid order: one row in its table `receipts`. The handler is `#[idempotent]`, keyed by
//! the message id, so the ledger is its inbox: a redelivered message (the relay published it
//! twice, or this process died between its commit and its ack) is acknowledged without a
//! second receipt. Restarting resumes where the durable consumer left off.

use idem::idempotent;
use idem::nats::{Consumer, Delivery, async_nats, ensure_stream};
use idem::sea_orm::DeadLetterTable;
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, ConnectOptions, Database, DatabaseConnection, Schema};
use serde::Deserialize;

mod receipt {
    use sea_orm::entity::prelude::*;

    /// One receipt sent: what the notifier's effect looks like in its own database.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "receipts")]
    pub(crate) struct Model {
        /// The message that caused it (the inbox key).
        #[sea_orm(primary_key, auto_increment = false)]
        pub(crate) message_id: String,
        #[sea_orm(indexed)]
        pub(crate) order_id: String,
        pub(crate) payment_id: String,
        pub(crate) amount_cents: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// The event the payments service publishes (its own copy: services share a contract, not
/// code).
#[derive(Debug, Deserialize)]
struct OrderPaid {
    order_id: String,
    payment_id: String,
    amount_cents: i64,
}

/// Sends the receipt for one paid order. The claim of `(notifier.receipt, message id)`, the
/// receipt row and the recorded result commit together: a redelivery replays.
#[idempotent(scope = "notifier.receipt", key = delivery.id())]
async fn send_receipt(db: &DatabaseConnection, delivery: Delivery) -> Result<String, idem::Error> {
    let paid: OrderPaid = delivery
        .json()
        .map_err(|e| idem::Error::store("the message is not an OrderPaid event", e))?;
    receipt::Entity::insert(receipt::ActiveModel {
        message_id: Set(delivery.id().to_owned()),
        order_id: Set(paid.order_id.clone()),
        payment_id: Set(paid.payment_id),
        amount_cents: Set(paid.amount_cents),
    })
    .exec(db)
    .await
    .map_err(|e| idem::Error::store("saving the receipt", e))?;
    tracing::info!(order_id = %paid.order_id, amount_cents = paid.amount_cents, "receipt sent");
    Ok(paid.order_id)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let nats_url = std::env::var("NATS_URL")
        .map_err(|_| "set NATS_URL (e.g. NATS_URL=nats://127.0.0.1:4222)")?;
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("idem-notifier.db");
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let mut options = ConnectOptions::new(url.clone());
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    idem::sea_orm::create_tables(&db).await?;
    let schema = Schema::new(db.get_database_backend());
    db.execute(
        schema
            .create_table_from_entity(receipt::Entity)
            .if_not_exists(),
    )
    .await?;

    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(&nats_url)
        .await?;
    let jetstream = async_nats::jetstream::new(client);
    ensure_stream(&jetstream, "SHOP", &["shop.>"]).await?;
    tracing::info!(%nats_url, database = %url.split('?').next().unwrap_or_default(), "notifier consuming shop.orders.paid");

    Consumer::new(jetstream, "SHOP", "notifier")
        .filter_subject("shop.orders.paid")
        .run(
            |delivery| send_receipt(&db, delivery),
            &DeadLetterTable::new(db.clone()),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    Ok(())
}
