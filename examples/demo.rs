//! The seed scenarios of idem on an embedded SQLite file, one row each.
//!
//! Run with `cargo run --example demo`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::completer::Resumed;
use idem::nats::Delivery;
use idem::outbox::{FnSink, Message, OutboxMessage, SinkError};
use idem::sea_orm::{Completer, Outbox, Relay, SeaOrmLeaseStore, Stateful};
use idem::{FinalError, Outcome, TransitionOutcome, idempotent, transition, with_outcome};
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, Database, DatabaseConnection, Statement};
use serde::{Deserialize, Serialize};

#[path = "shop/model.rs"]
mod model;

use model::{OrderCommand, OrderStatus, cancel_order, order, payment, ship_order};

/// What the client sends; `idempotency_key` comes from its `Idempotency-Key` header.
/// `Deserialize` too: the resumable pay of row 12 stores it with its claim.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PayOrder {
    idempotency_key: String,
    order_id: String,
    amount_cents: i64,
    card: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    payment_id: String,
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    /// idem's own errors (bad key, key reused, store failures) are never recorded.
    #[serde(skip)]
    Idem(idem::Error),
    /// The card was declined: deterministic, so it is recorded and replayed.
    Declined(String),
    /// The gateway timed out: transient, so the key is released and a retry runs again.
    GatewayTimeout,
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl FinalError for PayError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined(_))
    }
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Idem(e) => write!(f, "{} (HTTP {})", e.kind().as_str(), e.http_status()),
            Self::Declined(why) => write!(f, "declined: {why}"),
            Self::GatewayTimeout => f.write_str("gateway timeout"),
        }
    }
}

/// Counts how often the body really ran (the demo's proof that replays skip it).
static BODY_RUNS: AtomicUsize = AtomicUsize::new(0);
/// Numbers payment ids (a rolled-back payment leaves a gap, as a database sequence would).
static PAYMENTS: AtomicUsize = AtomicUsize::new(0);
/// Set to 1 to make the next call's gateway time out (a transient error).
static FAIL_NEXT: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "orders.pay", key = cmd.idempotency_key)]
async fn pay_order(db: &DatabaseConnection, cmd: PayOrder) -> Result<Receipt, PayError> {
    BODY_RUNS.fetch_add(1, Ordering::SeqCst);
    // `db` is the claim's transaction here: the transition, the payment row and the recorded
    // receipt commit together. The key stops the same request twice; the transition stops
    // two different requests from paying one order twice.
    let moved = order::Entity::apply_transition(
        db,
        cmd.order_id.clone(),
        transition!(OrderStatus: Pending -> Paid),
    )
    .await?;
    if moved == TransitionOutcome::AlreadyApplied {
        let existing = payment::Entity::find()
            .filter(payment::Column::OrderId.eq(cmd.order_id.as_str()))
            .one(db)
            .await
            .map_err(|e| idem::Error::store("reading the payment", e))?;
        if let Some(p) = existing {
            return Ok(Receipt {
                payment_id: p.id,
                order_id: p.order_id,
                amount_cents: p.amount_cents,
            });
        }
    }
    let payment_id = format!("pay-{}", PAYMENTS.fetch_add(1, Ordering::SeqCst) + 1);
    payment::Entity::insert(payment::ActiveModel {
        id: Set(payment_id.clone()),
        order_id: Set(cmd.order_id.clone()),
        amount_cents: Set(cmd.amount_cents),
        charge_id: Set(format!("ch-{}", cmd.card)),
    })
    .exec(db)
    .await
    .map_err(|e| idem::Error::store("saving the payment", e))?;
    // The event for other services commits with the payment, or not at all.
    db.stage(
        Message::json(
            "shop.orders.paid",
            &(&cmd.order_id, &payment_id, cmd.amount_cents),
        )?
        .aggregate(cmd.order_id.clone()),
    )
    .await?;
    if cmd.card.ends_with("0002") {
        return Err(PayError::Declined("insufficient funds".into()));
    }
    if FAIL_NEXT.swap(0, Ordering::SeqCst) == 1 {
        return Err(PayError::GatewayTimeout);
    }
    Ok(Receipt {
        payment_id,
        order_id: cmd.order_id,
        amount_cents: cmd.amount_cents,
    })
}

/// Counts how often the receipt handler's body really ran.
static RECEIPT_RUNS: AtomicUsize = AtomicUsize::new(0);

/// The consuming side: sends a receipt for a paid order. Keyed by the message id, so the
/// ledger is its inbox: a message delivered again replays instead of sending again.
#[idempotent(scope = "demo.receipt", key = delivery.id())]
async fn send_receipt(db: &DatabaseConnection, delivery: Delivery) -> Result<String, idem::Error> {
    RECEIPT_RUNS.fetch_add(1, Ordering::SeqCst);
    let (order_id, _payment_id, _amount): (String, String, i64) = delivery
        .json()
        .map_err(|e| idem::Error::store("decoding the event", e))?;
    db.execute_raw(Statement::from_sql_and_values(
        db.get_database_backend(),
        "INSERT INTO demo_receipts (message_id, order_id) VALUES (?, ?)",
        [delivery.id().into(), order_id.clone().into()],
    ))
    .await
    .map_err(|e| idem::Error::store("saving the receipt", e))?;
    Ok(order_id)
}

async fn scalar(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .ok()
        .flatten();
    row.and_then(|r| r.try_get_by_index::<i64>(0).ok())
        .unwrap_or_default()
}

/// The outbox and the inbox end to end: the relay delivers the messages the pays above
/// staged to the receipt handler; once it is interrupted after delivering and before marking,
/// so one message is delivered twice.
async fn effects_outside(
    db: &DatabaseConnection,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS demo_receipts (message_id TEXT PRIMARY KEY, order_id TEXT NOT NULL)",
    )
    .await?;
    let staged = scalar(db, "SELECT COUNT(*) FROM idem_outbox").await;
    let deliveries = std::sync::Arc::new(AtomicUsize::new(0));
    let sink = |stall_first: bool| {
        let (db, deliveries) = (db.clone(), deliveries.clone());
        FnSink::new(move |m: OutboxMessage| {
            let (db, deliveries) = (db.clone(), deliveries.clone());
            async move {
                let n = deliveries.fetch_add(1, Ordering::SeqCst);
                send_receipt(&db, Delivery::new(m.id, m.topic, m.payload))
                    .await
                    .map_err(|e| SinkError::transient(e.to_string()))?;
                if stall_first && n == 0 {
                    // Delivered, but the relay dies before it marks the message published.
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        })
    };
    let lease = std::time::Duration::from_millis(300);
    let interrupted = Relay::new(db.clone(), sink(true))
        .batch_size(1)
        .lease(lease);
    let _ = tokio::time::timeout(lease / 3, interrupted.run_once()).await;
    tokio::time::sleep(lease).await; // the dead relay's lease lapses
    let relay = Relay::new(db.clone(), sink(false)).lease(lease);
    while relay.run_once().await?.claimed > 0 {}
    let receipts = scalar(db, "SELECT COUNT(*) FROM demo_receipts").await;
    let mut lines = vec![format!(
        "{:<38} {:>10} {:>8}  {staged} messages staged by the pays above (declined and failed pays staged none); relay cut after its first delivery, before marking it: redelivered, replayed by the inbox",
        "10. relay interrupted mid-publish",
        deliveries.load(Ordering::SeqCst),
        receipts,
    )];

    let runs_before = RECEIPT_RUNS.load(Ordering::SeqCst);
    let event = Delivery::new(
        "evt-redelivered",
        "shop.orders.paid",
        serde_json::to_vec(&("o-3", "pay-x", 500))?,
    );
    let mut answers = Vec::new();
    for _ in 0..3 {
        let (result, outcome) = with_outcome(send_receipt(db, event.clone())).await;
        answers.push(match (result, outcome) {
            (Ok(_), Some(Outcome::Executed)) => "executed",
            (Ok(_), Some(Outcome::Replayed)) => "replayed",
            _ => "failed",
        });
    }
    lines.push(format!(
        "{:<38} {:>10} {:>8}  handler body ran {} time(s): {}",
        "11. one message delivered three times",
        3,
        scalar(
            db,
            "SELECT COUNT(*) FROM demo_receipts WHERE message_id = 'evt-redelivered'"
        )
        .await,
        RECEIPT_RUNS.load(Ordering::SeqCst) - runs_before,
        answers.join(", then "),
    ));
    Ok(lines)
}

/// Counts the calls the payment gateway of row 12 gets (a retried call with a key it has seen
/// returns the charge it made then).
static GATEWAY_CALLS: AtomicUsize = AtomicUsize::new(0);

/// The payment gateway of row 12: deduplicates on the idempotency key, as Stripe does, and
/// keeps its charges in a table of its own (in the demo's file, to be counted).
#[derive(Clone)]
struct Gateway {
    db: DatabaseConnection,
    /// Set: the gateway makes the charge, signals it here, and never answers (the caller's
    /// process dies while it waits).
    holds_answer: Option<Arc<tokio::sync::Notify>>,
}

impl Gateway {
    async fn charge(&self, idempotency_key: String, amount_cents: i64) -> Result<String, PayError> {
        GATEWAY_CALLS.fetch_add(1, Ordering::SeqCst);
        let gateway_error = |e| PayError::Idem(idem::Error::store("the gateway's charges", e));
        let backend = self.db.get_database_backend();
        self.db
            .execute_raw(Statement::from_sql_and_values(
                backend,
                "INSERT OR IGNORE INTO demo_gateway_charges (idem_key, charge_id, amount_cents) \
                 VALUES (?, 'ch-' || (SELECT COUNT(*) + 1 FROM demo_gateway_charges), ?)",
                [idempotency_key.clone().into(), amount_cents.into()],
            ))
            .await
            .map_err(gateway_error)?;
        let charge_id = self
            .db
            .query_one_raw(Statement::from_sql_and_values(
                backend,
                "SELECT charge_id FROM demo_gateway_charges WHERE idem_key = ?",
                [idempotency_key.into()],
            ))
            .await
            .map_err(gateway_error)?
            .and_then(|row| row.try_get_by_index::<String>(0).ok())
            .unwrap_or_default();
        if let Some(charged) = &self.holds_answer {
            charged.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(charge_id)
    }
}

/// The scope of [`pay_through_gateway`], which the completer of row 12 resumes.
const REMOTE_PAY_SCOPE: &str = "demo.pay-through-gateway";

/// Pays through a gateway that charges over the network, so in lease mode: the claim commits
/// first, the charge is a recorded step and the final phase writes the payment. `resumable`
/// stores `cmd` with the claim, so a completer can finish the call without its client. The
/// lease is 300 ms so that the demo runs in a second; a service would give it 30 s.
#[idempotent(
    scope = "demo.pay-through-gateway",
    key = cmd.idempotency_key,
    lease = "300ms",
    resumable,
    skip(gateway)
)]
async fn pay_through_gateway(
    db: &DatabaseConnection,
    gateway: &Gateway,
    cmd: PayOrder,
) -> Result<Receipt, PayError> {
    BODY_RUNS.fetch_add(1, Ordering::SeqCst);
    let amount_cents = cmd.amount_cents;
    let charge_id: String = idem::step("charge", |key| gateway.charge(key, amount_cents)).await?;
    // The last work: `finish` records the answer in this transaction too.
    idem::sea_orm::finish(db, "record-payment", move |tx| {
        Box::pin(async move {
            let moved = order::Entity::apply_transition(
                tx,
                cmd.order_id.clone(),
                transition!(OrderStatus: Pending -> Paid),
            )
            .await?;
            if moved != TransitionOutcome::Applied {
                // Paid under another key, or cancelled: deterministic, so recorded.
                return Err(PayError::Declined(format!(
                    "order {} is not pending",
                    cmd.order_id
                )));
            }
            let payment_id = format!("pay-{}", PAYMENTS.fetch_add(1, Ordering::SeqCst) + 1);
            payment::Entity::insert(payment::ActiveModel {
                id: Set(payment_id.clone()),
                order_id: Set(cmd.order_id.clone()),
                amount_cents: Set(amount_cents),
                charge_id: Set(charge_id),
            })
            .exec(tx)
            .await
            .map_err(|e| idem::Error::store("saving the payment", e))?;
            Ok(Receipt {
                payment_id,
                order_id: cmd.order_id,
                amount_cents,
            })
        })
    })
    .await
}

/// Row 12: the process dies while its pay waits for the gateway's answer (the charge made),
/// and the client never comes back. The pay's task is dropped mid-charge, as a SIGKILL would
/// stop it; a completer then takes the call over once its lease ends and finishes it. The
/// figures are counted afterwards: gateway calls, charges in the gateway's table, payments of
/// the order.
async fn killed_mid_pay(db: &DatabaseConnection) -> Result<String, Box<dyn std::error::Error>> {
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS demo_gateway_charges (idem_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    )
    .await?;
    let (order_id, call) = ("o-12", cmd("k-12", "o-12", 900, "4242"));
    let (body_runs, gateway_calls) = (
        BODY_RUNS.load(Ordering::SeqCst),
        GATEWAY_CALLS.load(Ordering::SeqCst),
    );
    let charged = Arc::new(tokio::sync::Notify::new());
    let holding = Gateway {
        db: db.clone(),
        holds_answer: Some(Arc::clone(&charged)),
    };
    let killed = {
        let (db, call) = (db.clone(), call.clone());
        tokio::spawn(async move { pay_through_gateway(&db, &holding, call).await })
    };
    // Bounded: a pay that fails before the gateway would otherwise leave the demo waiting.
    if tokio::time::timeout(Duration::from_secs(10), charged.notified())
        .await
        .is_err()
    {
        return Err("row 12: the pay did not reach the gateway within 10 s".into());
    }
    killed.abort();
    let _ = killed.await;
    let kill = std::time::Instant::now();

    // The restarted process's completer; no client retries meanwhile.
    let gateway = Gateway {
        db: db.clone(),
        holds_answer: None,
    };
    let resumer_gateway = gateway.clone();
    let resumer_db = db.clone();
    let completer = Completer::new(SeaOrmLeaseStore::new(db.clone())).resume(
        REMOTE_PAY_SCOPE,
        move |resumed: Resumed<(PayOrder,)>| {
            let (db, gateway) = (resumer_db.clone(), resumer_gateway.clone());
            async move { pay_through_gateway(&db, &gateway, resumed.args.0).await }
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(completer.run(async {
        let _ = stopped.await;
    }));
    let finished_after = loop {
        let status = order::Entity::find_by_id(order_id).one(db).await?;
        if status.is_some_and(|o| o.status == OrderStatus::Paid) {
            break Some(kill.elapsed());
        }
        if kill.elapsed() > Duration::from_secs(10) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let _ = stop.send(());
    running.await?;
    let finished = match finished_after {
        Some(after) => format!(
            "finished by the completer {} ms after the kill (lease 300 ms)",
            after.as_millis()
        ),
        None => "NOT finished by the completer within 10 s".to_owned(),
    };

    let (late, outcome) = with_outcome(pay_through_gateway(db, &gateway, call)).await;
    let charges = scalar(db, "SELECT COUNT(*) FROM demo_gateway_charges").await;
    Ok(format!(
        "{:<38} {:>9} {:>8} {:>8}  client never returns: {finished}, {} gateway calls with one key; the client's late retry: {}",
        "12. process killed mid-pay",
        BODY_RUNS.load(Ordering::SeqCst) - body_runs,
        charges,
        payments(db, order_id).await,
        GATEWAY_CALLS.load(Ordering::SeqCst) - gateway_calls,
        describe(&late, outcome),
    ))
}

fn cmd(key: &str, order: &str, amount_cents: i64, card: &str) -> PayOrder {
    PayOrder {
        idempotency_key: key.into(),
        order_id: order.into(),
        amount_cents,
        card: card.into(),
    }
}

/// One call, described the way a reader of the table wants it.
fn describe(result: &Result<Receipt, PayError>, outcome: Option<Outcome>) -> String {
    let how = match (outcome, result) {
        (Some(Outcome::Executed), _) => "executed",
        (Some(Outcome::Replayed), _) => "replayed",
        (None, Err(PayError::Idem(_))) => "rejected",
        (None, _) => "failed, key released",
    };
    match result {
        Ok(r) => format!("{how} ({}, {} cents)", r.payment_id, r.amount_cents),
        Err(e) => format!("{how} ({e})"),
    }
}

struct Row {
    scenario: &'static str,
    answer: String,
    body_runs: usize,
    payments: u64,
}

async fn payments(db: &DatabaseConnection, order: &str) -> u64 {
    model::payments_of(db, order).await.unwrap_or_default()
}

/// Runs the calls one after another (a client retrying) and describes each answer.
async fn sequential(
    db: &DatabaseConnection,
    scenario: &'static str,
    calls: Vec<PayOrder>,
    gateway_times_out_once: bool,
) -> Row {
    let before = BODY_RUNS.load(Ordering::SeqCst);
    let order = calls
        .first()
        .map(|c| c.order_id.clone())
        .unwrap_or_default();
    let mut answers = Vec::new();
    FAIL_NEXT.store(usize::from(gateway_times_out_once), Ordering::SeqCst);
    for call in calls {
        let (result, outcome) = with_outcome(pay_order(db, call)).await;
        answers.push(describe(&result, outcome));
    }
    Row {
        scenario,
        answer: answers.join(", then "),
        body_runs: BODY_RUNS.load(Ordering::SeqCst) - before,
        payments: payments(db, &order).await,
    }
}

/// Sends `copies` of one call at once (a double-clicking client, a retrying proxy).
async fn concurrent(
    db: &DatabaseConnection,
    scenario: &'static str,
    call: PayOrder,
    copies: usize,
) -> Row {
    let before = BODY_RUNS.load(Ordering::SeqCst);
    let order = call.order_id.clone();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..copies {
        let (db, call) = (db.clone(), call.clone());
        tasks.spawn(async move { pay_order(&db, call).await });
    }
    let answers: Vec<Result<Receipt, PayError>> = tasks.join_all().await;
    let first = answers.first().and_then(|a| a.as_ref().ok());
    let identical = answers.iter().filter(|a| a.as_ref().ok() == first).count();
    Row {
        scenario,
        answer: format!(
            "{} answers, {identical} identical Ok receipts",
            answers.len()
        ),
        body_runs: BODY_RUNS.load(Ordering::SeqCst) - before,
        payments: payments(db, &order).await,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("idem-demo.db");
    let _ = std::fs::remove_file(&path);
    let db = Database::connect(format!("sqlite://{}?mode=rwc", path.display())).await?;
    model::create_tables(&db).await?;
    for id in ["o-1", "o-3", "o-5", "o-6", "o-7", "o-8", "o-12"] {
        model::insert_order(&db, id, "c-1", 1200).await?;
    }

    let card = "4242";
    let rows = [
        sequential(
            &db,
            "1. first call",
            vec![cmd("k-1", "o-1", 1200, card)],
            false,
        )
        .await,
        sequential(
            &db,
            "2. network retry, same key",
            vec![cmd("k-1", "o-1", 1200, card)],
            false,
        )
        .await,
        concurrent(
            &db,
            "3. 16 concurrent duplicates",
            cmd("k-3", "o-3", 500, card),
            16,
        )
        .await,
        sequential(
            &db,
            "4. same key, other amount",
            vec![cmd("k-1", "o-1", 9900, card)],
            false,
        )
        .await,
        sequential(
            &db,
            "5. transient failure, then retry",
            vec![cmd("k-5", "o-5", 700, card), cmd("k-5", "o-5", 700, card)],
            true,
        )
        .await,
        sequential(
            &db,
            "6. card declined (final), then retry",
            vec![
                cmd("k-6", "o-6", 300, "4000-0002"),
                cmd("k-6", "o-6", 300, "4000-0002"),
            ],
            false,
        )
        .await,
    ];

    let order_cmd = |key: &str, order: &str| OrderCommand {
        idempotency_key: key.into(),
        order_id: order.into(),
    };
    let mut lifecycle = Vec::new();
    let before = BODY_RUNS.load(Ordering::SeqCst);
    let first = pay_order(&db, cmd("k-7a", "o-7", 2500, card)).await;
    let again = pay_order(&db, cmd("k-7b", "o-7", 2500, card)).await;
    lifecycle.push(Row {
        scenario: "7. pay twice, two different keys",
        answer: format!(
            "{}; second key: already paid, same payment {}",
            describe(&first, Some(Outcome::Executed)),
            again
                .as_ref()
                .map(|r| r.payment_id.as_str())
                .unwrap_or_default()
        ),
        body_runs: BODY_RUNS.load(Ordering::SeqCst) - before,
        payments: payments(&db, "o-7").await,
    });
    let cancelled = cancel_order(&db, order_cmd("k-8c", "o-8")).await?;
    let mut row = sequential(
        &db,
        "8. cancel, then pay the cancelled order",
        vec![cmd("k-8p", "o-8", 900, card)],
        false,
    )
    .await;
    row.answer = format!("cancel: {cancelled}; pay: {}", row.answer);
    lifecycle.push(row);
    let shipped = ship_order(&db, order_cmd("k-7s", "o-7")).await?;
    lifecycle.push(Row {
        scenario: "9. ship the paid order",
        answer: format!("ship: {shipped}"),
        body_runs: 0,
        payments: payments(&db, "o-7").await,
    });

    println!("idem demo: SQLite file {}\n", path.display());
    println!(
        "{:<38} {:>9} {:>8}  answer",
        "scenario", "body runs", "payments"
    );
    println!("{}", "-".repeat(118));
    for r in &rows {
        println!(
            "{:<38} {:>9} {:>8}  {}",
            r.scenario, r.body_runs, r.payments, r.answer
        );
    }
    println!("\norder lifecycle (declared transitions, guarded in the database):");
    for r in &lifecycle {
        println!(
            "{:<38} {:>9} {:>8}  {}",
            r.scenario, r.body_runs, r.payments, r.answer
        );
    }
    println!("\neffects outside the database (outbox, then inbox):");
    println!(
        "{:<38} {:>10} {:>8}  what happened",
        "scenario", "deliveries", "receipts"
    );
    for line in effects_outside(&db).await? {
        println!("{line}");
    }
    println!("\nlease mode (the pay calls a payment gateway; resumable, a completer running):");
    println!(
        "{:<38} {:>9} {:>8} {:>8}  what happened",
        "scenario", "body runs", "charges", "payments"
    );
    println!("{}", killed_mid_pay(&db).await?);
    let states: Vec<(String, OrderStatus)> = order::Entity::find()
        .all(&db)
        .await?
        .into_iter()
        .map(|o| (o.id, o.status))
        .collect();
    println!("\nfinal order states: {states:?}");
    println!(
        "\n'body runs': executions of the pay handler's body. 'payments': committed payment rows of the order. 'charges': rows in the gateway's table."
    );
    println!(
        "\nthe order lifecycle as declared (Mermaid):\n\n{}",
        OrderStatus::to_mermaid()
    );
    Ok(())
}
