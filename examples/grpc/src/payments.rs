//! The `shop.Payments` service on idem: `Pay` over an `#[idempotent]` function, `Refund` a
//! plain method the whole-call layer records.

use std::net::SocketAddr;

use idem::idempotent;
use idem::sea_orm::{SeaOrmLeaseStore, placeholders};
use idem::tonic::{IdempotencyKey, IdempotencyLayer, idempotency_key, respond};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, Value};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::shop::payments_server::{Payments, PaymentsServer};
use crate::shop::{PayReply, PayRequest, RefundReply, RefundRequest};

/// The service: a pool on the shop's database, which holds idem's ledger too.
#[derive(Clone, Debug)]
pub struct Shop {
    db: DatabaseConnection,
}

impl Shop {
    /// The service on `db` (prepared by [`prepare`]).
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }

    /// Charges an order once per key: the payment row and the recorded reply commit in one
    /// transaction, and a retry with the same key and message gets the same reply.
    #[idempotent(scope = "shop.pay", key = key, conn = self.db as db)]
    async fn pay_once(
        &self,
        key: IdempotencyKey,
        request: PayRequest,
    ) -> Result<PayReply, idem::Error> {
        let payment_id = format!("pay-{}", idem::store::random_token());
        insert(
            db,
            "INSERT INTO grpc_payments (id, order_id, amount_cents) VALUES (?, ?, ?)",
            vec![
                payment_id.clone().into(),
                request.order_id.clone().into(),
                request.amount_cents.into(),
            ],
        )
        .await?;
        Ok(PayReply {
            payment_id,
            order_id: request.order_id,
            amount_cents: request.amount_cents,
        })
    }
}

// tonic's service traits are `#[tonic::async_trait]`, which runs before `#[idempotent]`
// could: the trait method reads the key and delegates to the idempotent inherent one.
#[tonic::async_trait]
impl Payments for Shop {
    async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
        let key = idempotency_key(&request)?;
        let shop = self.clone();
        respond(async move { shop.pay_once(key, request.into_inner()).await }).await
    }

    /// A plain method: `IdempotencyLayer` records its whole answer (see [`serve`]).
    async fn refund(
        &self,
        request: Request<RefundRequest>,
    ) -> Result<Response<RefundReply>, Status> {
        let request = request.into_inner();
        let paid = self
            .db
            .query_one_raw(statement(
                self.db.get_database_backend(),
                "SELECT amount_cents FROM grpc_payments WHERE id = ?",
                vec![request.payment_id.clone().into()],
            ))
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let Some(paid) = paid else {
            return Err(Status::not_found(format!(
                "no payment {}",
                request.payment_id
            )));
        };
        let paid: i64 = paid
            .try_get_by_index(0)
            .map_err(|e| Status::internal(e.to_string()))?;
        if request.amount_cents <= 0 || request.amount_cents > paid {
            return Err(Status::invalid_argument(format!(
                "a refund of {} cents on a payment of {paid}",
                request.amount_cents
            )));
        }
        let refund_id = format!("ref-{}", idem::store::random_token());
        insert(
            &self.db,
            "INSERT INTO grpc_refunds (id, payment_id, amount_cents) VALUES (?, ?, ?)",
            vec![
                refund_id.clone().into(),
                request.payment_id.into(),
                request.amount_cents.into(),
            ],
        )
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(RefundReply {
            refund_id,
            amount_cents: request.amount_cents,
        }))
    }
}

fn statement(backend: DbBackend, sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(backend, placeholders(backend, sql), values)
}

async fn insert<C: ConnectionTrait>(
    db: &C,
    sql: &str,
    values: Vec<Value>,
) -> Result<(), idem::Error> {
    db.execute_raw(statement(db.get_database_backend(), sql, values))
        .await
        .map(drop)
        .map_err(|e| idem::Error::store("writing the shop's rows", e))
}

/// Creates idem's tables and the shop's.
pub async fn prepare(db: &DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
    idem::sea_orm::create_tables(db).await?;
    for table in [
        "grpc_payments (id VARCHAR(64) PRIMARY KEY, order_id VARCHAR(255) NOT NULL, amount_cents BIGINT NOT NULL)",
        "grpc_refunds (id VARCHAR(64) PRIMARY KEY, payment_id VARCHAR(64) NOT NULL, amount_cents BIGINT NOT NULL)",
    ] {
        db.execute_unprepared(&format!("CREATE TABLE IF NOT EXISTS {table}"))
            .await?;
    }
    Ok(())
}

/// Serves the shop on `listener` until the task is dropped: `Pay` idempotent through its
/// function, `Refund` through the layer.
pub async fn serve(
    db: DatabaseConnection,
    listener: tokio::net::TcpListener,
) -> Result<(), tonic::transport::Error> {
    let refunds = IdempotencyLayer::new(SeaOrmLeaseStore::new(db.clone()))
        .method::<RefundRequest>("/shop.Payments/Refund");
    Server::builder()
        .layer(refunds)
        .add_service(PaymentsServer::new(Shop::new(db)))
        .serve_with_incoming(TcpIncoming::from(listener))
        .await
}

/// Binds a free port on 127.0.0.1 and serves the shop there in the background; its address.
pub async fn spawn(db: DatabaseConnection) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(db, listener).await {
            eprintln!("the shop stopped: {e}");
        }
    });
    Ok(addr)
}
