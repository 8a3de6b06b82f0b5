//! The tonic front door (issue 32 item 3) against a real tonic server and a real tonic
//! client, on every backend of the run (SQLite always; PostgreSQL and MariaDB/MySQL when
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` are set, FAILING if set but unreachable):
//! `Pay` through `#[idempotent]` + `respond`, `Refund` through `IdempotencyLayer`. Every case
//! counts the rows the service wrote.

use std::sync::Arc;
use std::time::Duration;

use idem_example_grpc::payments::{self, Shop};
use idem_example_grpc::shop::payments_client::PaymentsClient;
use idem_example_grpc::shop::payments_server::{Payments, PaymentsServer};
use idem_example_grpc::shop::{PayReply, PayRequest, RefundReply, RefundRequest};
use prost::Message;
use sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement};
use tokio::sync::Semaphore;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Every database of the run, prepared, with its name.
async fn backends() -> Vec<(&'static str, DatabaseConnection)> {
    let sqlite = std::env::temp_dir().join(format!("idem-grpc-{}.db", run_id()));
    let mut urls = vec![("sqlite", format!("sqlite://{}?mode=rwc", sqlite.display()))];
    for (name, var) in [
        ("postgres", "IDEM_TEST_POSTGRES_URL"),
        ("mysql", "IDEM_TEST_MYSQL_URL"),
    ] {
        if let Ok(url) = std::env::var(var) {
            urls.push((name, url));
        }
    }
    let mut all = Vec::new();
    for (name, url) in urls {
        let db = match Database::connect(&url).await {
            Ok(db) => db,
            Err(e) => {
                panic!("cannot connect to {url} (set by the environment, so this fails): {e}")
            }
        };
        // Two tests may create the tables at once: the loser of the race retries.
        for attempt in 1..=5 {
            match payments::prepare(&db).await {
                Ok(()) => break,
                Err(e) if attempt == 5 => panic!("{name}: preparing: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(100 * attempt)).await,
            }
        }
        all.push((name, db));
    }
    all
}

fn run_id() -> String {
    idem::store::random_token().to_string()
}

async fn client(addr: std::net::SocketAddr) -> PaymentsClient<Channel> {
    PaymentsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
}

fn keyed<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    request
}

fn replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get("idempotent-replayed").is_some()
}

fn problem(status: &Status) -> &str {
    status
        .metadata()
        .get("idem-problem")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

async fn count(db: &DatabaseConnection, sql: &str, value: &str) -> i64 {
    let backend = db.get_database_backend();
    let sql = idem::sea_orm::placeholders(backend, sql);
    let row = db
        .query_one_raw(Statement::from_sql_and_values(backend, sql, [value.into()]))
        .await
        .expect("count")
        .expect("a row");
    row.try_get_by_index(0).expect("a number")
}

async fn payments_of(db: &DatabaseConnection, order: &str) -> i64 {
    count(
        db,
        "SELECT COUNT(*) FROM grpc_payments WHERE order_id = ?",
        order,
    )
    .await
}

async fn refunds_of(db: &DatabaseConnection, payment: &str) -> i64 {
    count(
        db,
        "SELECT COUNT(*) FROM grpc_refunds WHERE payment_id = ?",
        payment,
    )
    .await
}

fn pay_request(order: &str, amount_cents: i64) -> PayRequest {
    PayRequest {
        order_id: order.to_owned(),
        amount_cents,
        labels: [("channel", "web"), ("campaign", "autumn")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into(),
    }
}

/// A payment to refund: paid through the service, its id.
async fn paid(client: &mut PaymentsClient<Channel>, amount_cents: i64) -> String {
    let order = format!("o-{}", run_id());
    let reply = client
        .pay(keyed(
            pay_request(&order, amount_cents),
            &format!("k-{order}"),
        ))
        .await
        .expect("paid");
    reply.into_inner().payment_id
}

#[tokio::test]
async fn a_payment_runs_once_and_its_retry_is_replayed() {
    for (name, db) in backends().await {
        let mut client = client(payments::spawn(db.clone()).await.expect("serve")).await;
        let order = format!("o-{}", run_id());
        let key = format!("k-{order}");
        let first = client
            .pay(keyed(pay_request(&order, 4200), &key))
            .await
            .expect("paid");
        assert!(!replayed(&first), "{name}: a first call is no replay");
        let retry = client
            .pay(keyed(pay_request(&order, 4200), &key))
            .await
            .expect("replayed");
        assert!(replayed(&retry), "{name}: the retry carries the marker");
        assert_eq!(first.get_ref(), retry.get_ref(), "{name}: the same reply");
        assert_eq!(payments_of(&db, &order).await, 1, "{name}: charged once");

        let reused = client
            .pay(keyed(pay_request(&order, 9900), &key))
            .await
            .expect_err("another amount under the same key");
        assert_eq!(reused.code(), Code::FailedPrecondition, "{name}");
        assert_eq!(problem(&reused), "key-reused", "{name}");
        assert_eq!(payments_of(&db, &order).await, 1, "{name}: still once");

        let missing = client
            .pay(Request::new(pay_request(&order, 4200)))
            .await
            .expect_err("no key");
        assert_eq!(missing.code(), Code::InvalidArgument, "{name}");
        assert_eq!(problem(&missing), "missing-key", "{name}");
        assert_eq!(
            payments_of(&db, &order).await,
            1,
            "{name}: no key, no charge"
        );
    }
}

#[tokio::test]
async fn concurrent_duplicates_of_a_payment_run_once() {
    for (name, db) in backends().await {
        let addr = payments::spawn(db.clone()).await.expect("serve");
        let order = format!("o-{}", run_id());
        let key = format!("k-{order}");
        let calls = (0..10).map(|_| {
            let (request, key) = (pay_request(&order, 700), key.clone());
            tokio::spawn(async move { client(addr).await.pay(keyed(request, &key)).await })
        });
        let mut replies = Vec::new();
        for call in calls {
            match call.await.expect("joined") {
                Ok(reply) => replies.push(reply.into_inner()),
                Err(status) => {
                    assert_eq!(status.code(), Code::Aborted, "{name}: {status:?}");
                    assert_eq!(problem(&status), "in-flight", "{name}");
                    assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
                }
            }
        }
        assert!(
            !replies.is_empty(),
            "{name}: one call at least was answered"
        );
        assert!(
            replies.iter().all(|r| r == &replies[0]),
            "{name}: one reply"
        );
        assert_eq!(payments_of(&db, &order).await, 1, "{name}: charged once");
    }
}

/// The wire form of a message, written field by field: protobuf lets encoders order fields
/// and map entries as they like.
fn field(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    prost::encoding::bytes::encode(tag, &bytes.to_vec(), out);
}

fn pay_wire(order: &str, amount_cents: i64, labels: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::int64::encode(2, &amount_cents, &mut out);
    for (k, v) in labels {
        let mut entry = Vec::new();
        prost::encoding::string::encode(1, &(*k).to_owned(), &mut entry);
        prost::encoding::string::encode(2, &(*v).to_owned(), &mut entry);
        field(3, &entry, &mut out);
    }
    prost::encoding::string::encode(1, &order.to_owned(), &mut out);
    out
}

fn refund_wire(payment: &str, amount_cents: i64, amount_first: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if amount_first {
        prost::encoding::int64::encode(2, &amount_cents, &mut out);
    }
    prost::encoding::string::encode(1, &payment.to_owned(), &mut out);
    if !amount_first {
        prost::encoding::int64::encode(2, &amount_cents, &mut out);
    }
    out
}

/// Sends pre-encoded request bytes, as another client's encoder would have written them.
struct Raw<T>(std::marker::PhantomData<fn() -> T>);

impl<T> Raw<T> {
    fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: Message + Default + Send + 'static> Codec for Raw<T> {
    type Encode = Vec<u8>;
    type Decode = T;
    type Encoder = Raw<T>;
    type Decoder = Raw<T>;

    fn encoder(&mut self) -> Raw<T> {
        Raw::new()
    }

    fn decoder(&mut self) -> Raw<T> {
        Raw::new()
    }
}

impl<T> Encoder for Raw<T> {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl<T: Message + Default> Decoder for Raw<T> {
    type Item = T;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<T>, Status> {
        T::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

async fn raw<T: Message + Default + Send + 'static>(
    addr: std::net::SocketAddr,
    path: &'static str,
    wire: Vec<u8>,
    key: &str,
) -> Result<Response<T>, Status> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let path = http::uri::PathAndQuery::from_static(path);
    grpc.unary(keyed(wire, key), path, Raw::new()).await
}

/// Two encodings of one message are one request: the fingerprint is the decoded message
/// (a fingerprint of the bytes would answer the second `FAILED_PRECONDITION`).
#[tokio::test]
async fn another_encoding_of_the_same_message_is_a_retry() {
    for (name, db) in backends().await {
        let addr = payments::spawn(db.clone()).await.expect("serve");
        let order = format!("o-{}", run_id());
        let key = format!("k-{order}");
        let labels = [("channel", "web"), ("campaign", "autumn")];
        let mut reversed = labels;
        reversed.reverse();
        let first: Response<PayReply> = raw(
            addr,
            "/shop.Payments/Pay",
            pay_wire(&order, 500, &labels),
            &key,
        )
        .await
        .expect("paid");
        let retry: Response<PayReply> = raw(
            addr,
            "/shop.Payments/Pay",
            pay_wire(&order, 500, &reversed),
            &key,
        )
        .await
        .expect("map entries in another order: a retry");
        assert!(replayed(&retry), "{name}");
        assert_eq!(first.get_ref(), retry.get_ref(), "{name}");
        assert_eq!(payments_of(&db, &order).await, 1, "{name}");

        // The layer decodes the message itself: fields in another order are the same call.
        let payment = first.into_inner().payment_id;
        let key = format!("r-{payment}");
        let first: Response<RefundReply> = raw(
            addr,
            "/shop.Payments/Refund",
            refund_wire(&payment, 100, true),
            &key,
        )
        .await
        .expect("refunded");
        let retry: Response<RefundReply> = raw(
            addr,
            "/shop.Payments/Refund",
            refund_wire(&payment, 100, false),
            &key,
        )
        .await
        .expect("fields in another order: a retry");
        assert!(replayed(&retry), "{name}: replayed by the layer");
        assert_eq!(first.get_ref(), retry.get_ref(), "{name}");
        assert_eq!(refunds_of(&db, &payment).await, 1, "{name}");
        let reused = raw::<RefundReply>(
            addr,
            "/shop.Payments/Refund",
            refund_wire(&payment, 200, true),
            &key,
        )
        .await
        .expect_err("another amount");
        assert_eq!(reused.code(), Code::FailedPrecondition, "{name}");
        assert_eq!(problem(&reused), "key-reused", "{name}");
        assert_eq!(refunds_of(&db, &payment).await, 1, "{name}");
    }
}

#[tokio::test]
async fn the_layer_records_refunds_and_their_final_errors() {
    for (name, db) in backends().await {
        let mut client = client(payments::spawn(db.clone()).await.expect("serve")).await;
        let payment = paid(&mut client, 1000).await;
        let refund = RefundRequest {
            payment_id: payment.clone(),
            amount_cents: 300,
        };
        let key = format!("r-{payment}");
        let first = client
            .refund(keyed(refund.clone(), &key))
            .await
            .expect("refunded");
        assert!(!replayed(&first), "{name}");
        let retry = client
            .refund(keyed(refund.clone(), &key))
            .await
            .expect("replayed");
        assert!(replayed(&retry), "{name}");
        assert_eq!(first.get_ref(), retry.get_ref(), "{name}");
        assert_eq!(refunds_of(&db, &payment).await, 1, "{name}: refunded once");

        let missing = client
            .refund(Request::new(refund.clone()))
            .await
            .expect_err("no key");
        assert_eq!(missing.code(), Code::InvalidArgument, "{name}");
        assert_eq!(problem(&missing), "missing-key", "{name}");

        // A status the client must act on is the call's answer: recorded and replayed.
        let too_much = RefundRequest {
            payment_id: payment.clone(),
            amount_cents: 5000,
        };
        let key = format!("r2-{payment}");
        let first = client
            .refund(keyed(too_much.clone(), &key))
            .await
            .expect_err("more than was paid");
        assert_eq!(first.code(), Code::InvalidArgument, "{name}");
        assert!(first.metadata().get("idempotent-replayed").is_none());
        let retry = client
            .refund(keyed(too_much, &key))
            .await
            .expect_err("replayed");
        assert_eq!(retry.code(), Code::InvalidArgument, "{name}");
        assert_eq!(retry.message(), first.message(), "{name}");
        assert!(
            retry.metadata().get("idempotent-replayed").is_some(),
            "{name}: a recorded error is replayed"
        );
        assert_eq!(refunds_of(&db, &payment).await, 1, "{name}");
    }
}

/// Holds `Refund` inside the layer's call until released: the shop's service behind a gate.
#[derive(Clone)]
struct Held {
    shop: Shop,
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

#[tonic::async_trait]
impl Payments for Held {
    async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
        self.shop.pay(request).await
    }

    async fn refund(
        &self,
        request: Request<RefundRequest>,
    ) -> Result<Response<RefundReply>, Status> {
        self.entered.add_permits(1);
        self.release.acquire().await.expect("open").forget();
        self.shop.refund(request).await
    }
}

/// A duplicate of a running call is answered `ABORTED` with a retry delay; a client that
/// gives up mid-call (its deadline passes) does not stop the call, whose retry is replayed.
#[tokio::test]
async fn a_call_in_flight_finishes_without_its_client() {
    for (name, db) in backends().await {
        let held = Held {
            shop: Shop::new(db.clone()),
            entered: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let layer =
            idem::tonic::IdempotencyLayer::new(idem::sea_orm::SeaOrmLeaseStore::new(db.clone()))
                .method::<RefundRequest>("/shop.Payments/Refund");
        let server = tonic::transport::Server::builder()
            .layer(layer)
            .add_service(PaymentsServer::new(held.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(server);
        let mut client = client(addr).await;
        let payment = paid(&mut client, 1000).await;
        let refund = RefundRequest {
            payment_id: payment.clone(),
            amount_cents: 100,
        };
        let key = format!("r-{payment}");

        let mut first = keyed(refund.clone(), &key);
        first.set_timeout(Duration::from_millis(300));
        let first = tokio::spawn({
            let mut client = client.clone();
            async move { client.refund(first).await }
        });
        held.entered.acquire().await.expect("open").forget();
        let duplicate = client
            .refund(keyed(refund.clone(), &key))
            .await
            .expect_err("in flight");
        assert_eq!(duplicate.code(), Code::Aborted, "{name}");
        assert_eq!(problem(&duplicate), "in-flight", "{name}");
        assert!(duplicate.metadata().get("retry-after").is_some(), "{name}");
        let gave_up = first.await.expect("joined").expect_err("past its deadline");
        assert!(
            matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{name}: {gave_up:?}"
        );
        assert_eq!(refunds_of(&db, &payment).await, 0, "{name}: still held");

        held.release.add_permits(1);
        let mut retry = None;
        for _ in 0..100 {
            match client.refund(keyed(refund.clone(), &key)).await {
                Ok(reply) => {
                    retry = Some(reply);
                    break;
                }
                Err(status) if status.code() == Code::Aborted => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(status) => panic!("{name}: {status:?}"),
            }
        }
        let retry = retry.expect("the held call finished and recorded");
        assert!(
            replayed(&retry),
            "{name}: the retry is the held call's answer"
        );
        assert_eq!(refunds_of(&db, &payment).await, 1, "{name}: refunded once");
    }
}

/// The shop served on a free port with `Refund` recorded whole by a layer in `mode`.
async fn spawn_in(db: &DatabaseConnection, mode: idem::Mode) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer =
        idem::tonic::IdempotencyLayer::new(idem::sea_orm::SeaOrmLeaseStore::new(db.clone()))
            .method::<RefundRequest>("/shop.Payments/Refund")
            .mode(mode);
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(PaymentsServer::new(Shop::new(db.clone())))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    addr
}

/// Observe mode on the tonic layer: a retry and a call without a key run the method and get
/// its own answer (enforcing would replay and refuse them), and the ledger is the one
/// enforcing writes: the same method enforced afterwards replays the first observed answer.
#[tokio::test]
async fn observed_every_call_runs_the_method_and_enforcing_then_replays_the_first_answer() {
    for (name, db) in backends().await {
        let mut observed = client(spawn_in(&db, idem::Mode::Observe).await).await;
        let payment = paid(&mut observed, 1000).await;
        let refund = RefundRequest {
            payment_id: payment.clone(),
            amount_cents: 100,
        };
        let key = format!("r-{payment}");
        let first = observed
            .refund(keyed(refund.clone(), &key))
            .await
            .expect("refunded");
        let retry = observed
            .refund(keyed(refund.clone(), &key))
            .await
            .expect("refunded again");
        assert!(!replayed(&retry), "{name}: the method's own answer");
        assert_ne!(first.get_ref(), retry.get_ref(), "{name}: another refund");
        let keyless = observed.refund(Request::new(refund.clone())).await;
        assert!(keyless.is_ok(), "{name}: {keyless:?}");
        assert_eq!(refunds_of(&db, &payment).await, 3, "{name}: every call ran");

        let mut enforced = client(spawn_in(&db, idem::Mode::Enforce).await).await;
        let replay = enforced
            .refund(keyed(refund.clone(), &key))
            .await
            .expect("replayed");
        assert!(replayed(&replay), "{name}");
        assert_eq!(
            first.get_ref(),
            replay.get_ref(),
            "{name}: the first answer"
        );
        assert_eq!(
            refunds_of(&db, &payment).await,
            3,
            "{name}: enforcing ran nothing"
        );
    }
}
