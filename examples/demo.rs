//! The seed scenarios of idem on an embedded SQLite file, one row each.
//!
//! Run with `cargo run --example demo`.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem::{FinalError, Outcome, idempotent, with_outcome};
use sea_orm::entity::prelude::*;
use sea_orm::{ActiveValue::Set, Database, DatabaseConnection, PaginatorTrait, Schema};
use serde::{Deserialize, Serialize};

/// The business table the handler writes to.
mod payment {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "payments")]
    pub(crate) struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub order_id: String,
        pub amount_cents: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// What the client sends; `idempotency_key` comes from its `Idempotency-Key` header.
#[derive(Debug, Clone, Serialize)]
struct PayOrder {
    idempotency_key: String,
    order_id: String,
    amount_cents: i64,
    card: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    payment_id: i64,
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
/// Set to 1 to make the next call's gateway time out (a transient error).
static FAIL_NEXT: AtomicUsize = AtomicUsize::new(0);

#[idempotent(scope = "orders.pay", key = cmd.idempotency_key)]
async fn pay_order(db: &DatabaseConnection, cmd: PayOrder) -> Result<Receipt, PayError> {
    BODY_RUNS.fetch_add(1, Ordering::SeqCst);
    // `db` is the claim's transaction here: this insert commits with the recorded receipt.
    let saved = payment::Entity::insert(payment::ActiveModel {
        order_id: Set(cmd.order_id.clone()),
        amount_cents: Set(cmd.amount_cents),
        ..Default::default()
    })
    .exec(db)
    .await
    .map_err(|e| idem::Error::store("saving the payment", e))?;
    if cmd.card.ends_with("0002") {
        return Err(PayError::Declined("insufficient funds".into()));
    }
    if FAIL_NEXT.swap(0, Ordering::SeqCst) == 1 {
        return Err(PayError::GatewayTimeout);
    }
    Ok(Receipt {
        payment_id: saved.last_insert_id,
        order_id: cmd.order_id,
        amount_cents: cmd.amount_cents,
    })
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
        Ok(r) => format!(
            "{how} (payment #{}, {} cents)",
            r.payment_id, r.amount_cents
        ),
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
    payment::Entity::find()
        .filter(payment::Column::OrderId.eq(order))
        .count(db)
        .await
        .unwrap_or_default()
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
    idem::sea_orm::create_tables(&db).await?;
    let backend = db.get_database_backend();
    db.execute(
        Schema::new(backend)
            .create_table_from_entity(payment::Entity)
            .if_not_exists(),
    )
    .await?;

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
    println!(
        "\n'body runs': executions of the handler body. 'payments': committed payment rows of the order."
    );
    Ok(())
}
