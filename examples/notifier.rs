//! A receipt service that consumes `shop.orders.paid`: `cargo run --example notifier`.
//!
//! `NATS_URL` or `AMQP_URL` (one is required) and `DATABASE_URL` (default: an SQLite file in the
//! temp directory). It consumes stream `SHOP` with the durable consumer `notifier` (NATS), or
//! the quorum queue `notifier.receipts` bound to `shop.orders.paid` on exchange `shop`
//! (RabbitMQ), and "sends a receipt" for
//! each paid order: one row in its table `receipts`. The handler is `#[idempotent]`, keyed by
//! the message id, so the ledger is its inbox: a redelivered message (the relay published it
//! twice, or this process died between its commit and its ack) is acknowledged without a
//! second receipt. Restarting resumes where the durable consumer left off.

#[path = "shop/service.rs"]
mod service;

use idem::idempotent;
use idem::inbox::Delivery;
use idem::sea_orm::DeadLetterTable;
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, DatabaseConnection};
use serde::Deserialize;
use service::BoxError;
use tracing_subscriber::fmt::format::FmtSpan;

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
async fn main() -> Result<(), BoxError> {
    service::init_tracing(FmtSpan::NONE);
    let (db, database) = service::database("notifier").await?;
    service::create_tables(&db, receipt::Entity).await?;
    let dead_letters = DeadLetterTable::new(db.clone());
    let handler = |delivery| send_receipt(&db, delivery);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match (std::env::var("NATS_URL"), std::env::var("AMQP_URL")) {
        (Ok(nats_url), _) => {
            let jetstream = service::shop_stream(&nats_url).await?;
            tracing::info!(%nats_url, %database, "notifier consuming shop.orders.paid (NATS)");
            idem::nats::Consumer::new(jetstream, "SHOP", "notifier")
                .filter_subject("shop.orders.paid")
                .run(handler, &dead_letters, shutdown)
                .await?;
        }
        (Err(_), Ok(amqp_url)) => {
            service::shop_queue(&amqp_url).await?;
            tracing::info!(%database, "notifier consuming shop.orders.paid (RabbitMQ)");
            idem::rabbitmq::Consumer::new(amqp_url, "notifier.receipts", "notifier")
                .run(handler, &dead_letters, shutdown)
                .await?;
        }
        (Err(_), Err(_)) => {
            return Err("set NATS_URL (e.g. nats://127.0.0.1:4222) or AMQP_URL \
                (e.g. amqp://guest:guest@127.0.0.1:5672/%2f)"
                .into());
        }
    }
    Ok(())
}
