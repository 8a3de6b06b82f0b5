//! The workload every variant runs: a "pay order" handler (read the order, insert a payment,
//! update the order) whose request is about 1 KiB of JSON.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement, Value};
use serde::{Deserialize, Serialize};

/// What the client sends (about 1 KiB as JSON).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PayOrder {
    pub(crate) idempotency_key: String,
    pub(crate) order_id: i64,
    customer_id: i64,
    pub(crate) amount_cents: i64,
    pub(crate) currency: String,
    pub(crate) payment_method: PaymentMethod,
    billing_address: Address,
    items: Vec<LineItem>,
    customer_note: String,
    metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PaymentMethod {
    kind: String,
    pub(crate) card_token: String,
    brand: String,
    last4: String,
    exp_month: u8,
    exp_year: u16,
    holder_name: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Address {
    name: String,
    line1: String,
    line2: String,
    city: String,
    region: String,
    postcode: String,
    country: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct LineItem {
    sku: String,
    description: String,
    quantity: u32,
    unit_price_cents: i64,
}

/// What the handler answers (recorded and replayed by idem).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
    currency: String,
    paid_cents: i64,
    order_version: i64,
    status: String,
}

/// A request whose JSON is 1024 bytes with a 36-character key and a 4-digit order id.
pub(crate) fn template() -> PayOrder {
    let item = |sku: &str, description: &str, quantity: u32, unit_price_cents: i64| LineItem {
        sku: sku.into(),
        description: description.into(),
        quantity,
        unit_price_cents,
    };
    let mut metadata = BTreeMap::new();
    for (k, v) in [
        ("channel", "web"),
        ("client_ip", "203.0.113.42"),
        ("session", "s_7Hq2LrX9vK3mPz8YwT4n"),
        (
            "user_agent",
            "Mozilla/5.0 (X11; Linux x86_64) Chrome/131.0 Safari/537.36",
        ),
    ] {
        metadata.insert(k.to_owned(), v.to_owned());
    }
    let mut cmd = PayOrder {
        idempotency_key: "00000000-0000-4000-8000-000000000000".into(),
        order_id: 1000,
        customer_id: 4_200_017,
        amount_cents: 12_990,
        currency: "EUR".into(),
        payment_method: PaymentMethod {
            kind: "card".into(),
            card_token: "tok_1QbGx2Lk8sZr4PqW9mYtVn3Hc7Jd5Fa0Ee6Rb1Ux".into(),
            brand: "visa".into(),
            last4: "4242".into(),
            exp_month: 9,
            exp_year: 2029,
            holder_name: "Ada Lovelace".into(),
        },
        billing_address: Address {
            name: "Ada Lovelace".into(),
            line1: "12 Analytical Engine Street".into(),
            line2: "Flat 3".into(),
            city: "London".into(),
            region: "Greater London".into(),
            postcode: "NW1 6XE".into(),
            country: "GB".into(),
        },
        items: vec![
            item("SKU-10442", "Mechanical keyboard, brown switches", 1, 8_990),
            item("SKU-20871", "USB-C cable, braided, 2 m", 2, 1_250),
            item("SKU-31007", "Desk mat, felt, dark grey", 1, 1_500),
        ],
        customer_note: "Leave it with the concierge. ".into(),
        metadata,
    };
    // Pad the note so the request is 1 KiB of JSON (the shape, not the padding, is realistic).
    let len = serde_json::to_vec(&cmd).map(|v| v.len()).unwrap_or(1024);
    cmd.customer_note
        .extend(std::iter::repeat_n('.', 1024_usize.saturating_sub(len)));
    cmd
}

/// The business SQL, rendered once per backend (placeholders numbered for PostgreSQL).
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) backend: DbBackend,
    pub(crate) read_order: String,
    pub(crate) insert_payment: String,
    pub(crate) update_order: String,
    pub(crate) keys_insert: String,
    pub(crate) keys_read: String,
    pub(crate) keys_record: String,
    pub(crate) keys_release: String,
}

impl Sql {
    pub(crate) fn new(backend: DbBackend) -> Self {
        let r = |s: &str| idem::sea_orm::placeholders(backend, s);
        let returning = if backend == DbBackend::MySql {
            ""
        } else {
            " RETURNING id"
        };
        let keys_insert = if backend == DbBackend::MySql {
            "INSERT IGNORE INTO bench_idem_keys (idem_key, request_hash, state, response, created_at_ms) \
             VALUES (?, ?, 0, NULL, ?)"
                .to_owned()
        } else {
            r(
                "INSERT INTO bench_idem_keys (idem_key, request_hash, state, response, created_at_ms) \
               VALUES (?, ?, 0, NULL, ?) ON CONFLICT (idem_key) DO NOTHING",
            )
        };
        Self {
            backend,
            read_order: r(
                "SELECT status, total_cents, paid_cents, version FROM bench_orders WHERE id = ?",
            ),
            insert_payment: r(&format!(
                "INSERT INTO bench_payments (order_id, amount_cents, currency, card_token, request_ref, created_at_ms) \
                 VALUES (?, ?, ?, ?, ?, ?){returning}"
            )),
            update_order: r(
                "UPDATE bench_orders SET paid_cents = paid_cents + ?, status = ?, version = version + 1, \
                 updated_at_ms = ? WHERE id = ?",
            ),
            keys_insert,
            keys_read: r(
                "SELECT request_hash, state, response FROM bench_idem_keys WHERE idem_key = ?",
            ),
            keys_record: r("UPDATE bench_idem_keys SET state = 1, response = ? WHERE idem_key = ?"),
            keys_release: r("DELETE FROM bench_idem_keys WHERE idem_key = ? AND state = 0"),
        }
    }

    pub(crate) fn stmt(&self, sql: &str, values: Vec<Value>) -> Statement {
        Statement::from_sql_and_values(self.backend, sql, values)
    }
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

/// The handler body shared by every variant: read the order, insert a payment, update the order.
pub(crate) async fn pay_body<C: ConnectionTrait>(
    db: &C,
    sql: &Sql,
    cmd: &PayOrder,
) -> Result<Receipt, DbErr> {
    let row = db
        .query_one_raw(sql.stmt(&sql.read_order, vec![cmd.order_id.into()]))
        .await?
        .ok_or_else(|| DbErr::RecordNotFound(format!("order {}", cmd.order_id)))?;
    let status: String = row.try_get_by_index(0)?;
    let total: i64 = row.try_get_by_index(1)?;
    let paid: i64 = row.try_get_by_index(2)?;
    let version: i64 = row.try_get_by_index(3)?;
    if status == "cancelled" {
        return Err(DbErr::Custom(format!(
            "order {} is cancelled",
            cmd.order_id
        )));
    }
    let now = now_ms();
    let values = vec![
        cmd.order_id.into(),
        cmd.amount_cents.into(),
        cmd.currency.as_str().into(),
        cmd.payment_method.card_token.as_str().into(),
        cmd.idempotency_key.as_str().into(),
        now.into(),
    ];
    let payment_id = if sql.backend == DbBackend::MySql {
        let done = db
            .execute_raw(sql.stmt(&sql.insert_payment, values))
            .await?;
        i64::try_from(done.last_insert_id()).map_err(|e| DbErr::Custom(e.to_string()))?
    } else {
        db.query_one_raw(sql.stmt(&sql.insert_payment, values))
            .await?
            .ok_or_else(|| DbErr::RecordNotFound("the new payment's id".into()))?
            .try_get_by_index(0)?
    };
    let receipt = Receipt::of(cmd, payment_id, total, paid, version);
    db.execute_raw(sql.stmt(
        &sql.update_order,
        vec![
            cmd.amount_cents.into(),
            receipt.status.as_str().into(),
            now.into(),
            cmd.order_id.into(),
        ],
    ))
    .await?;
    Ok(receipt)
}

impl Receipt {
    /// The receipt of `cmd`'s payment `payment_id` on an order of `total` with `paid` paid
    /// before it, at `version`: what every driver's body answers.
    pub(crate) fn of(cmd: &PayOrder, payment_id: i64, total: i64, paid: i64, version: i64) -> Self {
        let paid = paid + cmd.amount_cents;
        let status = if paid >= total {
            "paid"
        } else {
            "partially_paid"
        };
        Receipt {
            payment_id,
            order_id: cmd.order_id,
            amount_cents: cmd.amount_cents,
            currency: cmd.currency.clone(),
            paid_cents: paid,
            order_version: version + 1,
            status: status.to_owned(),
        }
    }

    /// The order's new status.
    pub(crate) fn status(&self) -> &str {
        &self.status
    }
}
