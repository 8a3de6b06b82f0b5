//! Serves the shop on an SQLite file (or `DATABASE_URL`) and calls it as a client would: a
//! payment, its retry (replayed, not charged again), the same key with another amount
//! (refused), and a refund with its retry through the whole-call layer.

use idem_example_grpc::payments;
use idem_example_grpc::shop::payments_client::PaymentsClient;
use idem_example_grpc::shop::{PayRequest, RefundRequest};
use tonic::Request;

fn keyed<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    let key = key.parse().expect("an ASCII key");
    request.metadata_mut().insert("idempotency-key", key);
    request
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response.metadata().get("idempotent-replayed").is_some()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("idem-grpc-shop.db");
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let db = sea_orm::Database::connect(&url).await?;
    payments::prepare(&db).await?;
    let addr = payments::spawn(db).await?;
    let mut client = PaymentsClient::connect(format!("http://{addr}")).await?;
    let run = idem::store::random_token();

    let pay = PayRequest {
        order_id: format!("o-{run}"),
        amount_cents: 4200,
        labels: [("channel".to_owned(), "web".to_owned())].into(),
    };
    let key = format!("pay-{run}");
    let first = client.pay(keyed(pay.clone(), &key)).await?;
    println!(
        "Pay:            {:?} (replayed: {})",
        first.get_ref(),
        replayed(&first)
    );
    let retry = client.pay(keyed(pay.clone(), &key)).await?;
    println!(
        "Pay, retried:   {:?} (replayed: {})",
        retry.get_ref(),
        replayed(&retry)
    );
    let other = PayRequest {
        amount_cents: 9900,
        ..pay
    };
    let refused = client
        .pay(keyed(other, &key))
        .await
        .expect_err("a reused key");
    println!(
        "Pay, reused:    {:?}: {}",
        refused.code(),
        refused.message()
    );

    let refund = RefundRequest {
        payment_id: first.get_ref().payment_id.clone(),
        amount_cents: 1000,
    };
    let key = format!("refund-{run}");
    let first = client.refund(keyed(refund.clone(), &key)).await?;
    println!(
        "Refund:         {:?} (replayed: {})",
        first.get_ref(),
        replayed(&first)
    );
    let retry = client.refund(keyed(refund, &key)).await?;
    println!(
        "Refund, retried: {:?} (replayed: {})",
        retry.get_ref(),
        replayed(&retry)
    );
    Ok(())
}
