//! What `#[idempotent]` costs, measured side by side with the alternatives.
//!
//! ```text
//! cargo run --release --example bench -- [--backend sqlite|postgres|mysql] [--quick] [--json] [--url URL]
//! ```
//!
//! One process runs every workload, alternating the variants round by round (ABCD, DCBA, …)
//! so drift hits all of them equally, and reports medians. The workload is a "pay order"
//! handler (read the order, insert a payment row, update the order) whose argument struct is
//! about 1 KiB of JSON. Variants:
//!
//! - **bare**: the handler body in one plain transaction, no idempotency (the floor);
//! - **three-commit**: the hand-written pattern (commit a processing row, run the body in its
//!   own transaction, commit the result), written directly with SeaORM;
//! - **idem first**: `#[idempotent]`, every call a new key;
//! - **idem replay**: `#[idempotent]`, every call a key already recorded.
//!
//! The bench owns its tables: `bench_*` business tables and a ledger of its own (a SQLite file
//! in the temp directory; schema `bench_idem` on PostgreSQL; database `bench_idem` on MySQL),
//! so the test suite's `idem_ledger` is never touched. Its rows are deleted at the start and at
//! the end of every run. See `docs/BENCHMARKS.md` for the figures and their goals.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::{Fingerprinter, idempotent};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, DbErr, Statement,
    TransactionTrait, Value,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

const USAGE: &str = "usage: cargo run --release --example bench -- \
[--backend sqlite|postgres|mysql] [--quick] [--json] [--url URL]";

/// The schema (PostgreSQL) or database (MySQL) holding the bench's ledger and tables.
const BENCH_NAMESPACE: &str = "bench_idem";
/// Orders reserved per client, so concurrent clients never wait on each other's order rows.
const ORDERS_PER_SLOT: i64 = 64;
/// Order slots: 0..16 throughput clients, then the latency client, the storm, the profile.
const SLOT_LATENCY: i64 = 16;
const SLOT_STORM: i64 = 17;
const SLOT_PROFILE: i64 = 18;
const SLOTS: i64 = 19;
/// Rows per bulk insert of synthetic expired ledger records.
const BULK_CHUNK: u64 = 100_000;

// ---------------------------------------------------------------------------------------------
// The workload
// ---------------------------------------------------------------------------------------------

/// What the client sends (about 1 KiB as JSON).
#[derive(Debug, Clone, Serialize)]
struct PayOrder {
    idempotency_key: String,
    order_id: i64,
    customer_id: i64,
    amount_cents: i64,
    currency: String,
    payment_method: PaymentMethod,
    billing_address: Address,
    items: Vec<LineItem>,
    customer_note: String,
    metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
struct PaymentMethod {
    kind: String,
    card_token: String,
    brand: String,
    last4: String,
    exp_month: u8,
    exp_year: u16,
    holder_name: String,
}

#[derive(Debug, Clone, Serialize)]
struct Address {
    name: String,
    line1: String,
    line2: String,
    city: String,
    region: String,
    postcode: String,
    country: String,
}

#[derive(Debug, Clone, Serialize)]
struct LineItem {
    sku: String,
    description: String,
    quantity: u32,
    unit_price_cents: i64,
}

/// What the handler answers (recorded and replayed by idem).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
    currency: String,
    paid_cents: i64,
    order_version: i64,
    status: String,
}

/// A request whose JSON is 1024 bytes with a 36-character key and a 4-digit order id.
fn template() -> PayOrder {
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
struct Sql {
    backend: DbBackend,
    read_order: String,
    insert_payment: String,
    update_order: String,
    keys_insert: String,
    keys_read: String,
    keys_record: String,
    keys_release: String,
}

impl Sql {
    fn new(backend: DbBackend) -> Self {
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

    fn stmt(&self, sql: &str, values: Vec<Value>) -> Statement {
        Statement::from_sql_and_values(self.backend, sql, values)
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

/// The handler body shared by every variant: read the order, insert a payment, update the order.
async fn pay_body<C: ConnectionTrait>(db: &C, sql: &Sql, cmd: &PayOrder) -> Result<Receipt, DbErr> {
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
    let paid = paid + cmd.amount_cents;
    let status = if paid >= total {
        "paid"
    } else {
        "partially_paid"
    };
    db.execute_raw(sql.stmt(
        &sql.update_order,
        vec![
            cmd.amount_cents.into(),
            status.into(),
            now.into(),
            cmd.order_id.into(),
        ],
    ))
    .await?;
    Ok(Receipt {
        payment_id,
        order_id: cmd.order_id,
        amount_cents: cmd.amount_cents,
        currency: cmd.currency.clone(),
        paid_cents: paid,
        order_version: version + 1,
        status: status.to_owned(),
    })
}

/// **bare**: the body in one plain transaction, no idempotency.
async fn pay_bare(db: &DatabaseConnection, sql: &Sql, cmd: &PayOrder) -> Res<Receipt> {
    let tx = db.begin().await?;
    let receipt = pay_body(&tx, sql, cmd).await?;
    tx.commit().await?;
    Ok(receipt)
}

/// **three-commit**: the usual hand-written pattern. Each step is as cheap as it can be
/// written: steps 1 and 3 are single auto-committed statements.
async fn pay_three_commit(db: &DatabaseConnection, sql: &Sql, cmd: &PayOrder) -> Res<Receipt> {
    let mut hasher = Fingerprinter::new("bench.pay.manual");
    hasher.arg(cmd)?;
    let hash = hasher.finish().0.to_vec();
    let key = cmd.idempotency_key.as_str();
    // 1. Commit a "processing" row; a duplicate finds the row and answers from it.
    let inserted = db
        .execute_raw(sql.stmt(
            &sql.keys_insert,
            vec![key.into(), hash.clone().into(), now_ms().into()],
        ))
        .await?
        .rows_affected()
        == 1;
    if !inserted {
        let row = db
            .query_one_raw(sql.stmt(&sql.keys_read, vec![key.into()]))
            .await?
            .ok_or("the idempotency key vanished")?;
        let recorded_hash: Vec<u8> = row.try_get_by_index(0)?;
        let state: i16 = row.try_get_by_index(1)?;
        if recorded_hash != hash {
            return Err("idempotency key reused with other arguments".into());
        }
        if state != 1 {
            return Err("request in flight".into());
        }
        let response: Vec<u8> = row.try_get_by_index(2)?;
        return Ok(serde_json::from_slice(&response)?);
    }
    // 2. The body in its own transaction; on failure, free the key for a retry.
    let tx = db.begin().await?;
    let receipt = match pay_body(&tx, sql, cmd).await {
        Ok(receipt) => receipt,
        Err(e) => {
            let _ = tx.rollback().await;
            db.execute_raw(sql.stmt(&sql.keys_release, vec![key.into()]))
                .await?;
            return Err(e.into());
        }
    };
    tx.commit().await?;
    // 3. Commit the result.
    db.execute_raw(sql.stmt(
        &sql.keys_record,
        vec![serde_json::to_vec(&receipt)?.into(), key.into()],
    ))
    .await?;
    Ok(receipt)
}

/// **idem first** and **idem replay**.
#[idempotent(scope = "bench.pay", key = cmd.idempotency_key, skip(sql))]
async fn pay_idem(
    db: &DatabaseConnection,
    cmd: PayOrder,
    sql: &Sql,
) -> Result<Receipt, idem::Error> {
    pay_body(db, sql, &cmd)
        .await
        .map_err(|e| idem::Error::store("paying the order", e))
}

/// The ledger path alone (claim, record, commit) for P7.
#[idempotent(scope = "bench.claim", key = key)]
async fn claim_only(db: &DatabaseConnection, key: String) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Bare,
    ThreeCommit,
    IdemFirst,
    IdemReplay,
}

const VARIANTS: [Variant; 4] = [
    Variant::Bare,
    Variant::ThreeCommit,
    Variant::IdemFirst,
    Variant::IdemReplay,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::ThreeCommit => "three-commit",
            Self::IdemFirst => "idem first",
            Self::IdemReplay => "idem replay",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::ThreeCommit => "three_commit",
            Self::IdemFirst => "idem_first",
            Self::IdemReplay => "idem_replay",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

async fn call_variant(
    db: &DatabaseConnection,
    sql: &Sql,
    variant: Variant,
    cmd: PayOrder,
) -> Res<Receipt> {
    match variant {
        Variant::Bare => pay_bare(db, sql, &cmd).await,
        Variant::ThreeCommit => pay_three_commit(db, sql, &cmd).await,
        Variant::IdemFirst | Variant::IdemReplay => Ok(pay_idem(db, cmd, sql).await?),
    }
}

// ---------------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
    Mysql,
}

impl Backend {
    fn parse(s: &str) -> Res<Self> {
        match s {
            "sqlite" => Ok(Self::Sqlite),
            "postgres" | "postgresql" | "pg" => Ok(Self::Postgres),
            "mysql" | "mariadb" => Ok(Self::Mysql),
            _ => Err(format!("unknown backend `{s}` (sqlite, postgres, mysql)").into()),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Mysql => "mysql",
        }
    }
    fn accepts(self, url: &str) -> bool {
        match self {
            Self::Sqlite => url.starts_with("sqlite:"),
            Self::Postgres => url.starts_with("postgres://") || url.starts_with("postgresql://"),
            Self::Mysql => url.starts_with("mysql://") || url.starts_with("mariadb://"),
        }
    }
}

#[derive(Debug)]
struct Args {
    backend: Backend,
    quick: bool,
    json: bool,
    url: Option<String>,
}

fn parse_args() -> Res<Args> {
    let mut args = Args {
        backend: Backend::Sqlite,
        quick: false,
        json: false,
        url: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--backend" => {
                args.backend = Backend::parse(&it.next().ok_or("--backend needs a value")?)?;
            }
            "--url" => args.url = Some(it.next().ok_or("--url needs a value")?),
            "--quick" => args.quick = true,
            "--json" => args.json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                if let Some(v) = other.strip_prefix("--backend=") {
                    args.backend = Backend::parse(v)?;
                } else if let Some(v) = other.strip_prefix("--url=") {
                    args.url = Some(v.to_owned());
                } else {
                    return Err(format!("unknown argument `{other}`\n{USAGE}").into());
                }
            }
        }
    }
    Ok(args)
}

/// How much of everything a mode does.
#[derive(Debug, Clone, Copy)]
struct Plan {
    latency_rounds: usize,
    latency_calls: usize,
    tput_rounds: usize,
    tput_round: Duration,
    clients: usize,
    storm_rounds: usize,
    storm: usize,
    fp_rounds: usize,
    fp_iters: usize,
    profile_calls: usize,
    /// Synthetic records inserted to measure the ledger's size (quick mode).
    ledger_rows: u64,
    purge: Option<PurgePlan>,
}

#[derive(Debug, Clone, Copy)]
struct PurgePlan {
    rows: u64,
    baseline: Duration,
    /// One cycle per entry.
    cycles: &'static [PurgeHow],
}

/// How a P7 cycle purges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PurgeHow {
    /// `purge_expired(db, batch)`, as the README shows it (P7 is measured this way).
    Batch(u32),
    /// What would close P7: statements sized to take about [`PACED_BUDGET`] each, with an
    /// equal pause after each, built on `purge_expired_batch`.
    Paced,
}

/// The batch size the README shows for `purge_expired`.
const README_BATCH: u32 = 10_000;
/// Target duration of one paced purge statement.
const PACED_BUDGET: Duration = Duration::from_millis(2);

impl Plan {
    fn quick() -> Self {
        Self {
            latency_rounds: 20,
            latency_calls: 50,
            tput_rounds: 5,
            tput_round: Duration::from_secs(1),
            clients: 16,
            storm_rounds: 12,
            storm: 64,
            fp_rounds: 15,
            fp_iters: 5_000,
            profile_calls: 150,
            ledger_rows: 100_000,
            purge: None,
        }
    }
    fn full() -> Self {
        Self {
            latency_rounds: 50,
            latency_calls: 100,
            tput_rounds: 10,
            tput_round: Duration::from_secs(3),
            clients: 16,
            storm_rounds: 40,
            storm: 64,
            fp_rounds: 50,
            fp_iters: 20_000,
            profile_calls: 1_000,
            ledger_rows: 1_000_000,
            purge: Some(PurgePlan {
                rows: 1_000_000,
                baseline: Duration::from_secs(10),
                // Three cycles as documented, one paced (what would close P7).
                cycles: &[
                    PurgeHow::Batch(README_BATCH),
                    PurgeHow::Batch(README_BATCH),
                    PurgeHow::Batch(README_BATCH),
                    PurgeHow::Paced,
                ],
            }),
        }
    }
}

/// Replaces the database of a `mysql://` URL.
fn with_database(url: &str, database: &str) -> Res<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let host_start = base.find("://").ok_or("not a URL")? + 3;
    let host_end = base[host_start..]
        .find('/')
        .map_or(base.len(), |i| host_start + i);
    let mut out = format!("{}/{database}", &base[..host_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

async fn connect(url: &str, max: Option<u32>, schema: Option<&str>) -> Res<DatabaseConnection> {
    let mut options = ConnectOptions::new(url.to_owned());
    options.sqlx_logging(false);
    if let Some(max) = max {
        options.max_connections(max);
    }
    if let Some(schema) = schema {
        options.set_schema_search_path(schema);
    }
    Ok(Database::connect(options).await?)
}

/// Where the bench's tables live, and how to reach them.
#[derive(Debug)]
struct Target {
    url: String,
    schema: Option<&'static str>,
    sqlite_file: Option<std::path::PathBuf>,
    /// Pool size of the main pool (`None`: SeaORM's default, one connection on SQLite).
    pool: Option<u32>,
}

async fn target(args: &Args) -> Res<Target> {
    let env = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| args.backend.accepts(u));
    let given = args.url.clone().or(env);
    if let Some(url) = &given
        && !args.backend.accepts(url)
    {
        return Err(format!("--url {url} is not a {} URL", args.backend.name()).into());
    }
    Ok(match args.backend {
        Backend::Sqlite => match given {
            Some(url) => Target {
                url,
                schema: None,
                sqlite_file: None,
                pool: None,
            },
            None => {
                let path = std::env::temp_dir().join("bench_idem.db");
                remove_sqlite(&path);
                Target {
                    url: format!("sqlite://{}?mode=rwc", path.display()),
                    schema: None,
                    sqlite_file: Some(path),
                    pool: None,
                }
            }
        },
        Backend::Postgres => {
            let url = given.unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into());
            let admin = connect(&url, Some(1), None).await?;
            admin
                .execute_unprepared(&format!("CREATE SCHEMA IF NOT EXISTS {BENCH_NAMESPACE}"))
                .await?;
            admin.close().await?;
            Target {
                url,
                schema: Some(BENCH_NAMESPACE),
                sqlite_file: None,
                pool: Some(72),
            }
        }
        Backend::Mysql => {
            let url = given.unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
            let admin = connect(&url, Some(1), None).await?;
            admin
                .execute_unprepared(&format!("CREATE DATABASE IF NOT EXISTS {BENCH_NAMESPACE}"))
                .await?;
            admin.close().await?;
            Target {
                url: with_database(&url, BENCH_NAMESPACE)?,
                schema: None,
                sqlite_file: None,
                pool: Some(72),
            }
        }
    })
}

fn remove_sqlite(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

fn ddl(backend: DbBackend) -> &'static [&'static str] {
    match backend {
        DbBackend::Postgres => &[
            "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, \
             status VARCHAR(16) NOT NULL, total_cents BIGINT NOT NULL, paid_cents BIGINT NOT NULL, \
             version BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bench_payments (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, \
             amount_cents BIGINT NOT NULL, currency VARCHAR(3) NOT NULL, card_token VARCHAR(64) NOT NULL, \
             request_ref VARCHAR(255) NOT NULL, created_at_ms BIGINT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS bench_payments_order ON bench_payments (order_id)",
            "CREATE TABLE IF NOT EXISTS bench_idem_keys (idem_key VARCHAR(255) PRIMARY KEY, \
             request_hash BYTEA NOT NULL, state SMALLINT NOT NULL, response BYTEA NULL, \
             created_at_ms BIGINT NOT NULL)",
        ],
        DbBackend::MySql => &[
            "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, \
             status VARCHAR(16) NOT NULL, total_cents BIGINT NOT NULL, paid_cents BIGINT NOT NULL, \
             version BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS bench_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL, currency VARCHAR(3) NOT NULL, \
             card_token VARCHAR(64) NOT NULL, request_ref VARCHAR(255) NOT NULL, \
             created_at_ms BIGINT NOT NULL, INDEX bench_payments_order (order_id)) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS bench_idem_keys (idem_key VARCHAR(255) NOT NULL PRIMARY KEY, \
             request_hash BINARY(32) NOT NULL, state SMALLINT NOT NULL, response LONGBLOB NULL, \
             created_at_ms BIGINT NOT NULL) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        ],
        _ => &[
            "CREATE TABLE IF NOT EXISTS bench_orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL, \
             status TEXT NOT NULL, total_cents INTEGER NOT NULL, paid_cents INTEGER NOT NULL, \
             version INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bench_payments (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL, \
             amount_cents INTEGER NOT NULL, currency TEXT NOT NULL, card_token TEXT NOT NULL, \
             request_ref TEXT NOT NULL, created_at_ms INTEGER NOT NULL)",
            "CREATE INDEX IF NOT EXISTS bench_payments_order ON bench_payments (order_id)",
            "CREATE TABLE IF NOT EXISTS bench_idem_keys (idem_key TEXT NOT NULL PRIMARY KEY, \
             request_hash BLOB NOT NULL, state INTEGER NOT NULL, response BLOB NULL, \
             created_at_ms INTEGER NOT NULL) WITHOUT ROWID",
        ],
    }
}

const BENCH_TABLES: [&str; 4] = [
    "bench_orders",
    "bench_payments",
    "bench_idem_keys",
    idem::sea_orm::LEDGER_TABLE,
];

/// Deletes every row of the bench's tables (its own ledger included).
async fn clean(db: &DatabaseConnection) -> Res<()> {
    match db.get_database_backend() {
        DbBackend::Postgres => {
            db.execute_unprepared(&format!(
                "TRUNCATE {} RESTART IDENTITY",
                BENCH_TABLES.join(", ")
            ))
            .await?;
        }
        DbBackend::MySql => {
            for t in BENCH_TABLES {
                db.execute_unprepared(&format!("TRUNCATE TABLE {t}"))
                    .await?;
            }
        }
        _ => {
            for t in BENCH_TABLES {
                db.execute_unprepared(&format!("DELETE FROM {t}")).await?;
            }
        }
    }
    Ok(())
}

async fn seed_orders(db: &DatabaseConnection) -> Res<()> {
    let total = SLOTS * ORDERS_PER_SLOT;
    let now = now_ms();
    let mut id = 1;
    while id <= total {
        let end = (id + 99).min(total);
        let rows: Vec<String> = (id..=end)
            .map(|i| format!("({i}, {}, 'open', 500000000, 0, 0, {now})", 1_000_000 + i))
            .collect();
        db.execute_unprepared(&format!(
            "INSERT INTO bench_orders (id, customer_id, status, total_cents, paid_cents, version, updated_at_ms) \
             VALUES {}",
            rows.join(", ")
        ))
        .await?;
        id = end + 1;
    }
    Ok(())
}

/// The bench's shared state.
#[derive(Debug)]
struct Bench {
    db: DatabaseConnection,
    sql: Sql,
    template: PayOrder,
    run: u64,
    seq: AtomicU64,
    /// Calls that executed the body (payments the database must hold at the end).
    executed: AtomicU64,
    started: Instant,
}

impl Bench {
    /// A fresh UUID-shaped (36-character) key.
    fn new_key(&self) -> String {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            self.run & 0xffff_ffff,
            (self.run >> 32) & 0xffff,
            (n >> 60) & 0xfff,
            (n >> 48) & 0xfff,
            n & 0xffff_ffff_ffff
        )
    }

    /// A new request on one of `slot`'s orders.
    fn command(&self, slot: i64, i: usize) -> PayOrder {
        let mut cmd = self.template.clone();
        cmd.idempotency_key = self.new_key();
        cmd.order_id = 1 + slot * ORDERS_PER_SLOT + (i as i64 % ORDERS_PER_SLOT);
        cmd
    }

    async fn call(&self, variant: Variant, cmd: PayOrder) -> Res<Receipt> {
        let receipt = call_variant(&self.db, &self.sql, variant, cmd).await?;
        if variant != Variant::IdemReplay {
            self.executed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(receipt)
    }

    fn progress(&self, what: &str) {
        eprintln!("[{:>6.1} s] {what}", self.started.elapsed().as_secs_f64());
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------------------------

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Rounds to 3 significant decimals for the JSON.
fn r3(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        serde_json::Value::Null
    }
}

/// Alternating order: ABCD, DCBA, ABCD, …
fn alternate<T: Copy>(items: &[T], round: usize) -> Vec<T> {
    if round.is_multiple_of(2) {
        items.to_vec()
    } else {
        items.iter().rev().copied().collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Latency {
    /// Per variant: the median of every round.
    round_medians: [Vec<f64>; 4],
    /// Per variant: every call.
    calls: [Vec<f64>; 4],
}

impl Latency {
    fn median(&self, v: Variant) -> f64 {
        median(&self.round_medians[v.index()])
    }
}

/// Single-client latency of every variant (P1, P2, P4). Variants alternate call by call
/// (ABCD, DCBA, …): a slow or fast phase of the machine hits all of them alike.
async fn latency(b: &Bench, plan: &Plan) -> Res<Latency> {
    let n = plan.latency_calls;
    let mut recorded: Vec<PayOrder> = Vec::new();
    // Warm-up: prepared statements, pool connections, caches.
    for v in VARIANTS {
        for i in 0..n.min(20) {
            let cmd = match v {
                Variant::IdemReplay => recorded[i % recorded.len()].clone(),
                _ => b.command(SLOT_LATENCY, i),
            };
            let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
            b.call(v, cmd).await?;
            recorded.extend(keep);
        }
    }
    let mut out = Latency::default();
    for round in 0..plan.latency_rounds {
        let mut lat: [Vec<f64>; 4] = Default::default();
        for i in 0..n {
            for v in alternate(&VARIANTS, round * n + i) {
                let cmd = match v {
                    Variant::IdemReplay => recorded[(round * n + i * 7) % recorded.len()].clone(),
                    _ => b.command(SLOT_LATENCY, i),
                };
                let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
                let start = Instant::now();
                b.call(v, cmd).await?;
                lat[v.index()].push(us(start.elapsed()));
                recorded.extend(keep);
            }
        }
        for v in VARIANTS {
            out.round_medians[v.index()].push(median(&lat[v.index()]));
            out.calls[v.index()].append(&mut lat[v.index()]);
        }
        if round % 5 == 4 {
            b.progress(&format!(
                "latency: round {}/{}",
                round + 1,
                plan.latency_rounds
            ));
        }
    }
    Ok(out)
}

/// Calls completed by `clients` concurrent clients of `variant` in about `length`, and the
/// seconds they took.
async fn throughput_round(
    b: &Arc<Bench>,
    variant: Variant,
    clients: usize,
    length: Duration,
) -> Res<(u64, f64)> {
    let start = Instant::now();
    let deadline = start + length;
    let mut set = tokio::task::JoinSet::new();
    for client in 0..clients {
        let b = Arc::clone(b);
        set.spawn(async move {
            let mut done = 0_u64;
            let mut i = 0;
            while Instant::now() < deadline {
                let cmd = b.command(client as i64, i);
                b.call(variant, cmd).await?;
                done += 1;
                i += 1;
            }
            Ok::<u64, BoxError>(done)
        });
    }
    let mut total = 0;
    for done in set.join_all().await {
        total += done?;
    }
    Ok((total, start.elapsed().as_secs_f64()))
}

const TPUT_VARIANTS: [Variant; 3] = [Variant::Bare, Variant::ThreeCommit, Variant::IdemFirst];

#[derive(Debug, Default)]
struct Throughput {
    /// Per variant: calls per second of every round.
    rates: [Vec<f64>; 3],
    calls: [u64; 3],
    /// Per variant: server counter deltas summed over the rounds.
    counters: [BTreeMap<&'static str, f64>; 3],
}

/// Throughput of the executing variants with concurrent clients (P3).
async fn throughput(b: &Arc<Bench>, plan: &Plan) -> Res<Throughput> {
    for v in TPUT_VARIANTS {
        throughput_round(b, v, plan.clients, Duration::from_millis(300)).await?;
    }
    let mut out = Throughput::default();
    for round in 0..plan.tput_rounds {
        for i in alternate(&[0_usize, 1, 2], round) {
            let mut before = server_counters(&b.db).await;
            let cpu0 = machine_cpu();
            let (calls, secs) =
                throughput_round(b, TPUT_VARIANTS[i], plan.clients, plan.tput_round).await?;
            let cpu1 = machine_cpu();
            let mut after = server_counters(&b.db).await;
            if let (Some((busy0, all0)), Some((busy1, all1))) = (cpu0, cpu1) {
                // Machine CPU per call in µs (all cores, 100 jiffies a second), and how busy the
                // machine was (weighted by calls, so the per-call average is the mean).
                before.insert("machine_cpu_us", busy0 * 10_000.0);
                after.insert("machine_cpu_us", busy1 * 10_000.0);
                before.insert("machine_busy_pct", 0.0);
                after.insert(
                    "machine_busy_pct",
                    100.0 * (busy1 - busy0) / (all1 - all0).max(1.0) * calls as f64,
                );
            }
            out.rates[i].push(calls as f64 / secs);
            out.calls[i] += calls;
            for (k, v) in after {
                if let Some(z) = before.get(k) {
                    *out.counters[i].entry(k).or_default() += v - z;
                }
            }
        }
        b.progress(&format!(
            "throughput: round {}/{}",
            round + 1,
            plan.tput_rounds
        ));
    }
    Ok(out)
}

/// Busy and total jiffies of the whole machine (`/proc/stat`).
fn machine_cpu() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<f64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3)? + v.get(4)?;
    let total: f64 = v.iter().take(8).sum();
    Some((total - idle, total))
}

/// Server-wide counters that explain throughput: WAL bytes (PostgreSQL); row-lock waits,
/// deadlocks, log fsyncs and bytes (MySQL/MariaDB). Other clients of the server add noise.
async fn server_counters(db: &DatabaseConnection) -> BTreeMap<&'static str, f64> {
    let mut out = BTreeMap::new();
    let queries: &[(&'static str, &str)] = match db.get_database_backend() {
        DbBackend::Postgres => &[(
            "wal_bytes",
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::BIGINT",
        )],
        DbBackend::MySql => &[
            ("row_lock_waits", "INNODB_ROW_LOCK_WAITS"),
            ("row_lock_time_ms", "INNODB_ROW_LOCK_TIME"),
            ("deadlocks", "INNODB_DEADLOCKS"),
            ("log_fsyncs", "INNODB_OS_LOG_FSYNCS"),
            ("log_bytes", "INNODB_OS_LOG_WRITTEN"),
        ],
        _ => &[],
    };
    for (key, query) in queries {
        let sql = if db.get_database_backend() == DbBackend::MySql {
            format!(
                "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = '{query}'"
            )
        } else {
            (*query).to_owned()
        };
        if let Ok(v) = scalar(db, &sql).await
            && let Ok(v) = v.parse::<f64>()
        {
            out.insert(*key, v);
        }
    }
    out
}

/// `copies` concurrent calls with one new key: time until every one is answered.
async fn storm_once(b: &Arc<Bench>, copies: usize, i: usize) -> Res<f64> {
    let cmd = b.command(SLOT_STORM, i);
    let cmds: Vec<PayOrder> = (0..copies).map(|_| cmd.clone()).collect();
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmd in cmds {
        let b = Arc::clone(b);
        set.spawn(async move { pay_idem(&b.db, cmd, &b.sql).await });
    }
    let answers = set.join_all().await;
    let elapsed = us(start.elapsed());
    b.executed.fetch_add(1, Ordering::Relaxed);
    let mut first: Option<Receipt> = None;
    for answer in answers {
        let answer = answer?;
        match &first {
            None => first = Some(answer),
            Some(f) if *f != answer => return Err("a duplicate got a different receipt".into()),
            Some(_) => {}
        }
    }
    Ok(elapsed)
}

#[derive(Debug, Default)]
struct Storm {
    storm_us: Vec<f64>,
    single_us: Vec<f64>,
    /// Smaller storms, to see how the time grows with the number of duplicates.
    scaling: Vec<(usize, f64)>,
    /// 64 concurrent replays of one recorded key, and of 64 different recorded keys.
    replays_same_us: Vec<f64>,
    replays_distinct_us: Vec<f64>,
}

/// Runs `cmds` concurrently: µs until every one is answered.
async fn concurrently(b: &Arc<Bench>, cmds: Vec<PayOrder>) -> Res<f64> {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmd in cmds {
        let b = Arc::clone(b);
        set.spawn(async move { pay_idem(&b.db, cmd, &b.sql).await });
    }
    for answer in set.join_all().await {
        answer?;
    }
    Ok(us(start.elapsed()))
}

/// 64 concurrent duplicates of one key against one execution, alternating (P6).
async fn storm(b: &Arc<Bench>, plan: &Plan) -> Res<Storm> {
    storm_once(b, plan.storm, 0).await?; // opens the pool's connections
    let mut out = Storm::default();
    for round in 0..plan.storm_rounds {
        for which in alternate(&[true, false], round) {
            if which {
                out.storm_us
                    .push(storm_once(b, plan.storm, round + 1).await?);
            } else {
                let cmd = b.command(SLOT_STORM, round + 7);
                let start = Instant::now();
                b.call(Variant::IdemFirst, cmd).await?;
                out.single_us.push(us(start.elapsed()));
            }
        }
    }
    let sizes = [2, 8, 16, 32];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for round in 0..plan.storm_rounds.div_ceil(2) {
        for i in alternate(&[0_usize, 1, 2, 3], round) {
            times[i].push(storm_once(b, sizes[i], round + 3).await?);
        }
    }
    out.scaling = sizes
        .iter()
        .zip(&times)
        .map(|(n, t)| (*n, median(t)))
        .collect();
    // Replays only: one shared key (every call locks the same ledger row) against distinct keys.
    let mut recorded = Vec::with_capacity(plan.storm);
    for i in 0..plan.storm {
        let cmd = b.command(SLOT_STORM, i);
        recorded.push(cmd.clone());
        b.call(Variant::IdemFirst, cmd).await?;
    }
    for round in 0..plan.storm_rounds.div_ceil(2) {
        for same in alternate(&[true, false], round) {
            if same {
                let one = vec![recorded[round % recorded.len()].clone(); plan.storm];
                out.replays_same_us.push(concurrently(b, one).await?);
            } else {
                out.replays_distinct_us
                    .push(concurrently(b, recorded.clone()).await?);
            }
        }
    }
    Ok(out)
}

/// The fingerprint of the 1 KiB request, as `#[idempotent]` computes it (P5), in µs per call:
/// the whole fingerprint, and the canonical encoding alone (the rest is SHA-256).
fn fingerprint(cmd: &PayOrder, plan: &Plan) -> Res<(Vec<f64>, Vec<f64>)> {
    let (mut whole, mut encode) = (Vec::new(), Vec::new());
    for round in 0..plan.fp_rounds * 2 {
        let hash = round % 2 == 0;
        let start = Instant::now();
        for _ in 0..plan.fp_iters {
            let mut f = Fingerprinter::new(black_box("bench.pay"));
            f.arg(black_box(cmd))?;
            if hash {
                black_box(f.finish());
            } else {
                black_box(f.encoded().len());
            }
        }
        let per_call = us(start.elapsed()) / plan.fp_iters as f64;
        if hash {
            whole.push(per_call);
        } else {
            encode.push(per_call);
        }
    }
    Ok((whole, encode))
}

// ---------------------------------------------------------------------------------------------
// Profile: statements per call, time per statement, CPU on both sides
// ---------------------------------------------------------------------------------------------

/// Per (variant, statement label): count and µs.
type StatementStats = Arc<Mutex<BTreeMap<(usize, &'static str), (u64, f64)>>>;

fn label(sql: &str) -> &'static str {
    let verb = sql
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_ascii_uppercase();
    let table = [
        "idem_ledger",
        "bench_orders",
        "bench_payments",
        "bench_idem_keys",
    ]
    .into_iter()
    .find(|t| sql.contains(t));
    match (verb.as_str(), table) {
        ("INSERT", Some("idem_ledger")) => "ledger: claim INSERT",
        ("SELECT", Some("idem_ledger")) => "ledger: read FOR UPDATE",
        ("UPDATE", Some("idem_ledger")) if sql.contains("created_at_ms =") => {
            "ledger: take-over UPDATE"
        }
        ("UPDATE", Some("idem_ledger")) => "ledger: record UPDATE",
        ("SELECT", Some("bench_orders")) => "body: read order",
        ("INSERT", Some("bench_payments")) => "body: insert payment",
        ("UPDATE", Some("bench_orders")) => "body: update order",
        ("INSERT", Some("bench_idem_keys")) => "manual: insert key (commit 1)",
        ("SELECT", Some("bench_idem_keys")) => "manual: read key",
        ("UPDATE", Some("bench_idem_keys")) => "manual: record (commit 3)",
        _ => "other",
    }
}

/// CPU time of a process in µs (`/proc/<pid>/stat`, all threads, 10 ms ticks).
fn process_cpu_us(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks * 10_000.0)
}

/// CPU time of one server process (a PostgreSQL backend) in µs, ns precision.
fn schedstat_us(pid: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
    Some(s.split_whitespace().next()?.parse::<f64>().ok()? / 1000.0)
}

/// The server process whose CPU the profile reads, and how.
async fn server_process(db: &DatabaseConnection) -> Option<(String, bool)> {
    match db.get_database_backend() {
        DbBackend::Postgres => {
            let pid = scalar(db, "SELECT pg_backend_pid()").await.ok()?;
            Some((pid, true))
        }
        DbBackend::MySql => {
            let file = scalar(db, "SELECT @@pid_file").await.ok()?;
            let pid = std::fs::read_to_string(file).ok()?.trim().to_owned();
            Some((pid, false))
        }
        _ => None,
    }
}

fn server_cpu_us(server: Option<&(String, bool)>) -> Option<f64> {
    let (pid, precise) = server?;
    if *precise {
        schedstat_us(pid)
    } else {
        process_cpu_us(pid)
    }
}

/// WAL frames (pages) each variant's call appends to SQLite's WAL, over `calls` calls.
async fn sqlite_wal_frames(
    db: &DatabaseConnection,
    b: &Bench,
    recorded: &[PayOrder],
    calls: usize,
) -> Res<BTreeMap<&'static str, f64>> {
    let mut out = BTreeMap::new();
    for v in VARIANTS {
        db.execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
            .await?;
        for i in 0..calls {
            let cmd = match v {
                Variant::IdemReplay => recorded.get(i % recorded.len().max(1)).cloned(),
                _ => None,
            }
            .unwrap_or_else(|| b.command(SLOT_PROFILE, i));
            call_variant(db, &b.sql, v, cmd).await?;
            if v != Variant::IdemReplay {
                b.executed.fetch_add(1, Ordering::Relaxed);
            }
        }
        let row = db
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "PRAGMA wal_checkpoint(PASSIVE)",
            ))
            .await?
            .ok_or("no checkpoint row")?;
        let frames: i64 = row.try_get_by_index(1)?;
        out.insert(v.key(), frames as f64 / calls as f64);
    }
    Ok(out)
}

/// Where each variant's time goes: statements per call and their time (SeaORM's metric
/// callback), CPU of the bench and of the server, server counters. One connection, calls in
/// sequence, variants interleaved in chunks of five calls (ABCD, DCBA, …).
async fn profile(b: &Bench, target: &Target, plan: &Plan) -> Res<serde_json::Value> {
    let stats: StatementStats = Arc::default();
    let current = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    let mut db = connect(&target.url, Some(1), target.schema).await?;
    if b.sql.backend == DbBackend::Sqlite {
        db.execute_unprepared("PRAGMA synchronous = FULL").await?;
    }
    let (sink, variant_now) = (Arc::clone(&stats), Arc::clone(&current));
    db.set_metric_callback(move |info| {
        let v = variant_now.load(Ordering::Relaxed);
        if let Ok(mut m) = sink.lock() {
            let e = m.entry((v, label(&info.statement.sql))).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += us(info.elapsed);
        }
    });
    let server = server_process(&db).await;
    let chunk = 5;
    let rounds = plan.profile_calls.div_ceil(chunk);
    let n = (rounds * chunk) as f64;
    let mut recorded = Vec::new();
    // Warm the profile connection's statement cache; record keys for the replays.
    for v in [Variant::Bare, Variant::ThreeCommit, Variant::IdemFirst] {
        for i in 0..chunk.max(10) {
            let cmd = b.command(SLOT_PROFILE, i);
            recorded.push(cmd.clone());
            call_variant(&db, &b.sql, v, cmd).await?;
            b.executed.fetch_add(1, Ordering::Relaxed);
        }
    }
    recorded.drain(..recorded.len() - chunk.max(10));
    if let Ok(mut m) = stats.lock() {
        m.clear();
    }
    let (mut wall, mut client, mut server_cpu) = ([0.0; 4], [0.0; 4], [0.0; 4]);
    let mut counters: [BTreeMap<&'static str, f64>; 4] = Default::default();
    for round in 0..rounds {
        for v in alternate(&VARIANTS, round) {
            let vi = v.index();
            let before = server_counters(&db).await;
            current.store(vi, Ordering::Relaxed);
            let (c0, s0) = (process_cpu_us("self"), server_cpu_us(server.as_ref()));
            let start = Instant::now();
            for i in 0..chunk {
                let cmd = match v {
                    Variant::IdemReplay => recorded[(round * chunk + i) % recorded.len()].clone(),
                    _ => b.command(SLOT_PROFILE, i),
                };
                let keep = (v == Variant::IdemFirst).then(|| cmd.clone());
                call_variant(&db, &b.sql, v, cmd).await?;
                if v != Variant::IdemReplay {
                    b.executed.fetch_add(1, Ordering::Relaxed);
                }
                recorded.extend(keep);
            }
            wall[vi] += us(start.elapsed());
            client[vi] += process_cpu_us("self")
                .zip(c0)
                .map_or(f64::NAN, |(a, z)| a - z);
            server_cpu[vi] += server_cpu_us(server.as_ref())
                .zip(s0)
                .map_or(f64::NAN, |(a, z)| a - z);
            current.store(usize::MAX, Ordering::Relaxed);
            let after = server_counters(&db).await;
            for (k, x) in after {
                if let Some(z) = before.get(k) {
                    *counters[vi].entry(k).or_default() += x - z;
                }
            }
        }
    }
    let stats = stats.lock().map(|m| m.clone()).unwrap_or_default();
    let wal_frames = if b.sql.backend == DbBackend::Sqlite {
        Some(sqlite_wal_frames(&db, b, &recorded, 50).await?)
    } else {
        None
    };
    let mut variants = serde_json::Map::new();
    for v in VARIANTS {
        let vi = v.index();
        let mine: Vec<(&'static str, (u64, f64))> = stats
            .iter()
            .filter(|((i, _), _)| *i == vi)
            .map(|((_, l), e)| (*l, *e))
            .collect();
        let statements: u64 = mine.iter().map(|(_, e)| e.0).sum();
        let statement_us: f64 = mine.iter().map(|(_, e)| e.1).sum();
        let by: serde_json::Map<String, serde_json::Value> = mine
            .iter()
            .map(|(k, (count, t))| {
                (
                    (*k).to_owned(),
                    json!({"per_call": r3(*count as f64 / n), "us_per_call": r3(t / n)}),
                )
            })
            .collect();
        let per_call_counters: BTreeMap<&str, serde_json::Value> =
            counters[vi].iter().map(|(k, x)| (*k, r3(x / n))).collect();
        variants.insert(
            v.key().to_owned(),
            json!({
                "wall_us": r3(wall[vi] / n),
                "statements_per_call": r3(statements as f64 / n),
                "statement_us_per_call": r3(statement_us / n),
                "outside_statements_us_per_call": r3((wall[vi] - statement_us) / n),
                "client_cpu_us_per_call": r3(client[vi] / n),
                "server_cpu_us_per_call": r3(server_cpu[vi] / n),
                "server_counters_per_call": per_call_counters,
                "sqlite_wal_frames_per_call": wal_frames.as_ref().and_then(|w| w.get(v.key())).map(|f| r3(*f)),
                "by_statement": by,
            }),
        );
    }
    // Micro-costs of the transaction frame on the same connection.
    let (mut begin, mut select1, mut commit, mut rollback) = (vec![], vec![], vec![], vec![]);
    let one = Statement::from_string(b.sql.backend, "SELECT 1");
    let order = 1 + SLOT_PROFILE * ORDERS_PER_SLOT;
    for _ in 0..plan.profile_calls.min(300) {
        let t = Instant::now();
        let tx = db.begin().await?;
        begin.push(us(t.elapsed()));
        let t = Instant::now();
        tx.query_one_raw(one.clone()).await?;
        select1.push(us(t.elapsed()));
        tx.execute_raw(b.sql.stmt(
            &b.sql.update_order,
            vec![0_i64.into(), "open".into(), now_ms().into(), order.into()],
        ))
        .await?;
        let t = Instant::now();
        tx.commit().await?;
        commit.push(us(t.elapsed()));
        let tx = db.begin().await?;
        tx.query_one_raw(one.clone()).await?;
        let t = Instant::now();
        tx.rollback().await?;
        rollback.push(us(t.elapsed()));
    }
    db.close().await?;
    Ok(json!({
        "calls_per_variant": n,
        "variants": variants,
        "micro_us": {
            "acquire_ping_begin": r3(median(&begin)),
            "select_1_round_trip": r3(median(&select1)),
            "commit_after_one_update": r3(median(&commit)),
            "rollback_read_only": r3(median(&rollback)),
        },
    }))
}

// ---------------------------------------------------------------------------------------------
// The ledger's size and P7
// ---------------------------------------------------------------------------------------------

async fn scalar(db: &DatabaseConnection, sql: &str) -> Res<String> {
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await?
        .ok_or("no row")?;
    if let Ok(s) = row.try_get_by_index::<String>(0) {
        return Ok(s);
    }
    if let Ok(i) = row.try_get_by_index::<i64>(0) {
        return Ok(i.to_string());
    }
    if let Ok(i) = row.try_get_by_index::<i32>(0) {
        return Ok(i.to_string());
    }
    Ok(row.try_get_by_index::<u64>(0)?.to_string())
}

/// Bytes the ledger occupies on disk.
async fn ledger_bytes(db: &DatabaseConnection) -> Res<i64> {
    let v = match db.get_database_backend() {
        DbBackend::Postgres => {
            scalar(db, "SELECT pg_total_relation_size('idem_ledger')::BIGINT").await?
        }
        DbBackend::MySql => {
            db.execute_unprepared("ANALYZE TABLE idem_ledger").await?;
            scalar(
                db,
                "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.TABLES \
                 WHERE table_schema = DATABASE() AND table_name = 'idem_ledger'",
            )
            .await?
        }
        // Pages in use (freed pages are reused before the file grows).
        _ => {
            let pages: i64 = scalar(db, "PRAGMA page_count").await?.parse()?;
            let free: i64 = scalar(db, "PRAGMA freelist_count").await?.parse()?;
            let size: i64 = scalar(db, "PRAGMA page_size").await?.parse()?;
            return Ok((pages - free) * size);
        }
    };
    Ok(v.parse()?)
}

/// Inserts records `from..=to` that look like real ones (36-character keys, a recorded receipt)
/// but expired a minute ago, in bulk SQL.
async fn insert_expired(b: &Bench, from: u64, to: u64, response: &[u8]) -> Res<()> {
    let db = &b.db;
    let backend = db.get_database_backend();
    let base = idem::sea_orm::database_now_ms(db).await? - 60_000;
    let cols = "id, scope, principal, idem_key, owner, fingerprint, state, response, created_at_ms, expires_at_ms";
    let mut lo = from;
    while lo <= to {
        let hi = (lo + BULK_CHUNK - 1).min(to);
        let (lo_v, hi_v) = (i64::try_from(lo)?, i64::try_from(hi)?);
        let stmt = match backend {
            DbBackend::Postgres => Statement::from_sql_and_values(
                backend,
                format!(
                    "INSERT INTO idem_ledger ({cols}) SELECT sha256(('bench-expired-' || n)::bytea), \
                     'bench.pay', '', 'k-' || lpad(n::text, 34, '0'), n, sha256(('fp-' || n)::bytea), 1, \
                     $3::bytea, $4::bigint - 86400000 - n, $4::bigint - n \
                     FROM generate_series($1::bigint, $2::bigint) AS n"
                ),
                [
                    lo_v.into(),
                    hi_v.into(),
                    response.to_vec().into(),
                    base.into(),
                ],
            ),
            DbBackend::MySql => {
                let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9)";
                Statement::from_sql_and_values(
                    backend,
                    format!(
                        "INSERT INTO idem_ledger ({cols}) SELECT UNHEX(SHA2(CONCAT('bench-expired-', n), 256)), \
                         'bench.pay', '', CONCAT('k-', LPAD(n, 34, '0')), n, UNHEX(SHA2(CONCAT('fp-', n), 256)), 1, \
                         ?, ? - 86400000 - n, ? - n FROM (SELECT ? + a.d + 10 * b.d + 100 * c.d + 1000 * e.d \
                         + 10000 * f.d AS n FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) \
                         AS seq WHERE n <= ?"
                    ),
                    [
                        response.to_vec().into(),
                        base.into(),
                        base.into(),
                        lo_v.into(),
                        hi_v.into(),
                    ],
                )
            }
            _ => Statement::from_sql_and_values(
                backend,
                format!(
                    "WITH RECURSIVE s(n) AS (SELECT ? UNION ALL SELECT n + 1 FROM s WHERE n < ?) \
                     INSERT INTO idem_ledger ({cols}) SELECT randomblob(32), 'bench.pay', '', \
                     printf('k-%034d', n), n, randomblob(32), 1, ?, ? - 86400000 - n, ? - n FROM s"
                ),
                [
                    lo_v.into(),
                    hi_v.into(),
                    response.to_vec().into(),
                    base.into(),
                    base.into(),
                ],
            ),
        };
        db.execute_raw(stmt).await?;
        lo = hi + 1;
    }
    Ok(())
}

#[derive(Debug)]
struct LedgerSize {
    rows: u64,
    bytes_before: i64,
    bytes_after: i64,
    insert_s: f64,
}

impl LedgerSize {
    fn per_million(&self) -> f64 {
        (self.bytes_after - self.bytes_before) as f64 * 1e6 / self.rows as f64
    }
}

async fn insert_and_measure(b: &Bench, rows: u64, response: &[u8]) -> Res<LedgerSize> {
    let bytes_before = ledger_bytes(&b.db).await?;
    let start = Instant::now();
    insert_expired(b, 1, rows, response).await?;
    let insert_s = start.elapsed().as_secs_f64();
    if b.db.get_database_backend() == DbBackend::Postgres {
        b.db.execute_unprepared("ANALYZE idem_ledger").await?;
    }
    Ok(LedgerSize {
        rows,
        bytes_before,
        bytes_after: ledger_bytes(&b.db).await?,
        insert_s,
    })
}

/// One claim (claim, record, commit of an empty body), in µs.
async fn one_claim(b: &Bench) -> Res<f64> {
    let key = b.new_key();
    let start = Instant::now();
    claim_only(&b.db, key).await?;
    Ok(us(start.elapsed()))
}

#[derive(Debug)]
struct PurgeCycle {
    how: PurgeHow,
    statements: u64,
    /// Median rows per statement.
    batch: f64,
    size: LedgerSize,
    baseline_us: Vec<f64>,
    during_us: Vec<f64>,
    deleted: u64,
    purge_s: f64,
}

impl PurgeCycle {
    fn ratio(&self) -> f64 {
        percentile(&self.during_us, 0.99) / percentile(&self.baseline_us, 0.99)
    }
}

/// P7: p99 claim latency while `purge_expired` deletes `rows` expired records, against the p99
/// with the same records in place and no purge.
/// Deletes every expired record in statements sized to take about [`PACED_BUDGET`], pausing as
/// long as each statement took: returns rows deleted, statements, median rows per statement.
async fn purge_paced(db: &DatabaseConnection) -> Result<(u64, u64, f64), idem::Error> {
    let (mut batch, mut total, mut sizes) = (500_u32, 0_u64, Vec::new());
    loop {
        let start = Instant::now();
        let deleted = idem::sea_orm::purge_expired_batch(db, batch).await?;
        let took = start.elapsed();
        total += deleted;
        sizes.push(f64::from(batch));
        if deleted < u64::from(batch) {
            return Ok((total, sizes.len() as u64, median(&sizes)));
        }
        let scale = (PACED_BUDGET.as_secs_f64() / took.as_secs_f64().max(1e-5)).clamp(0.5, 2.0);
        batch = ((f64::from(batch) * scale) as u32).clamp(10, README_BATCH);
        tokio::time::sleep(took).await;
    }
}

/// P7: p99 claim latency while expired records are purged, against the p99 with the same
/// records in place and no purge.
async fn purge_cycle(
    b: &Arc<Bench>,
    p: &PurgePlan,
    how: PurgeHow,
    response: &[u8],
) -> Res<PurgeCycle> {
    let size = insert_and_measure(b, p.rows, response).await?;
    b.progress(&format!(
        "p7: inserted {} expired records in {:.1} s",
        p.rows, size.insert_s
    ));
    let mut baseline_us = Vec::new();
    let start = Instant::now();
    while start.elapsed() < p.baseline {
        baseline_us.push(one_claim(b).await?);
    }
    let db = b.db.clone();
    let purge = tokio::spawn(async move {
        let start = Instant::now();
        let done = match how {
            PurgeHow::Batch(batch) => idem::sea_orm::purge_expired(&db, batch)
                .await
                .map(|n| (n, n.div_ceil(u64::from(batch)).max(1), f64::from(batch))),
            PurgeHow::Paced => purge_paced(&db).await,
        };
        (done, start.elapsed())
    });
    let mut during_us = Vec::new();
    while !purge.is_finished() {
        during_us.push(one_claim(b).await?);
    }
    let (done, took) = purge.await?;
    let (deleted, statements, batch) = done?;
    b.progress(&format!(
        "p7 ({how:?}): purged {deleted} records in {:.1} s; {} claims meanwhile",
        took.as_secs_f64(),
        during_us.len()
    ));
    Ok(PurgeCycle {
        how,
        statements,
        batch,
        size,
        baseline_us,
        during_us,
        deleted,
        purge_s: took.as_secs_f64(),
    })
}

// ---------------------------------------------------------------------------------------------
// Machine and server facts
// ---------------------------------------------------------------------------------------------

fn read_proc(path: &str, key: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        l.strip_prefix(key)
            .map(|v| v.trim_start_matches([':', ' ', '\t']).trim().to_owned())
    })
}

fn peak_rss_bytes() -> Option<u64> {
    let v = read_proc("/proc/self/status", "VmHWM")?;
    Some(v.split_whitespace().next()?.parse::<u64>().ok()? * 1024)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Today's UTC date (civil-from-days, no dependency).
fn utc_date() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or_default() as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

async fn server_facts(db: &DatabaseConnection) -> Res<(String, String)> {
    Ok(match db.get_database_backend() {
        DbBackend::Postgres => (
            scalar(db, "SELECT version()").await?,
            format!(
                "synchronous_commit={}, fsync={}, wal_sync_method={}",
                scalar(db, "SHOW synchronous_commit").await?,
                scalar(db, "SHOW fsync").await?,
                scalar(db, "SHOW wal_sync_method").await?
            ),
        ),
        DbBackend::MySql => (
            format!("MySQL/MariaDB {}", scalar(db, "SELECT version()").await?),
            format!(
                "innodb_flush_log_at_trx_commit={}, binlog={}",
                scalar(db, "SELECT @@innodb_flush_log_at_trx_commit").await?,
                scalar(db, "SELECT @@log_bin").await?
            ),
        ),
        _ => (
            format!("SQLite {}", scalar(db, "SELECT sqlite_version()").await?),
            format!(
                "journal_mode={}, synchronous={} (2 = FULL)",
                scalar(db, "PRAGMA journal_mode").await?,
                scalar(db, "PRAGMA synchronous").await?
            ),
        ),
    })
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Figure {
    id: &'static str,
    key: &'static str,
    what: &'static str,
    value: Option<f64>,
    goal: f64,
    at_most: bool,
}

impl Figure {
    fn met(&self) -> Option<bool> {
        self.value.map(|v| {
            if self.at_most {
                v <= self.goal
            } else {
                v >= self.goal
            }
        })
    }
}

fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.decimals$}"))
}

#[tokio::main]
async fn main() -> Res<()> {
    let args = parse_args()?;
    let plan = if args.quick {
        Plan::quick()
    } else {
        Plan::full()
    };
    let mode = if args.quick { "quick" } else { "full" };
    let started = Instant::now();
    let load_start = loadavg();

    let target = target(&args).await?;
    let db = connect(&target.url, target.pool, target.schema).await?;
    if args.backend == Backend::Sqlite {
        db.execute_unprepared("PRAGMA journal_mode = WAL").await?;
        db.execute_unprepared("PRAGMA synchronous = FULL").await?;
    }
    idem::sea_orm::create_tables(&db).await?;
    for sql in ddl(db.get_database_backend()) {
        db.execute_unprepared(sql).await?;
    }
    clean(&db).await?;
    seed_orders(&db).await?;
    let (server, durability) = server_facts(&db).await?;

    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
        ^ (u64::from(std::process::id()) << 32);
    let bench = Arc::new(Bench {
        sql: Sql::new(db.get_database_backend()),
        db,
        template: template(),
        run,
        seq: AtomicU64::new(0),
        executed: AtomicU64::new(0),
        started,
    });
    let b = &bench;
    let sample = b.command(SLOT_LATENCY, 0);
    let request_json = serde_json::to_vec(&sample)?.len();
    let mut canonical = Fingerprinter::new("bench.pay");
    canonical.arg(&sample)?;
    let request_canonical = canonical.encoded().len();
    b.progress(&format!(
        "{} ({mode}): {server}; {durability}",
        args.backend.name()
    ));

    // P5
    let fp = fingerprint(&sample, &plan)?;
    b.progress("fingerprint done");
    // P1, P2, P4
    let lat = latency(b, &plan).await?;
    // P3
    let tput = throughput(b, &plan).await?;
    // P6
    let storm = storm(b, &plan).await?;
    b.progress("storm done");
    // Profile
    let prof = profile(b, &target, &plan).await?;
    b.progress("profile done");

    // The ledger's size per million records, and P7 in full mode.
    let receipt = pay_idem(&b.db, b.command(SLOT_LATENCY, 1), &b.sql).await?;
    b.executed.fetch_add(1, Ordering::Relaxed);
    let response = serde_json::to_vec(&receipt)?;
    let mut cycles = Vec::new();
    if let Some(p) = plan.purge {
        for &how in p.cycles {
            cycles.push(purge_cycle(b, &p, how, &response).await?);
        }
    }
    let quick_size;
    let mut purge_note = None;
    let size = match cycles.first() {
        Some(c) => &c.size,
        None => {
            quick_size = insert_and_measure(b, plan.ledger_rows, &response).await?;
            let start = Instant::now();
            let deleted = idem::sea_orm::purge_expired(&b.db, 10_000).await?;
            let took = start.elapsed().as_secs_f64();
            purge_note = Some((deleted, took));
            b.progress(&format!(
                "ledger: {} synthetic records inserted in {:.1} s, purged in {took:.1} s",
                plan.ledger_rows, quick_size.insert_s
            ));
            &quick_size
        }
    };

    // Every execution left exactly one payment; replays left none.
    let payments: u64 = scalar(&b.db, "SELECT COUNT(*) FROM bench_payments")
        .await?
        .parse()?;
    let executed = b.executed.load(Ordering::Relaxed);
    if payments != executed {
        return Err(format!("{payments} payments for {executed} executions").into());
    }
    let ledger_live: u64 = scalar(&b.db, "SELECT COUNT(*) FROM idem_ledger")
        .await?
        .parse()?;
    clean(&b.db).await?;
    b.db.close_by_ref().await?;
    if let Some(path) = &target.sqlite_file {
        remove_sqlite(path);
    }

    // ------------------------------------------------------------------ figures
    let m = |v: Variant| lat.median(v);
    let first_vs_bare = m(Variant::IdemFirst) / m(Variant::Bare);
    let tput_med: Vec<f64> = tput.rates.iter().map(|v| median(v)).collect();
    let p5 = median(&fp.0);
    let p5_encode = median(&fp.1);
    let p6 = median(&storm.storm_us) / median(&storm.single_us);
    let documented: Vec<f64> = cycles
        .iter()
        .filter(|c| c.how == PurgeHow::Batch(README_BATCH))
        .map(PurgeCycle::ratio)
        .collect();
    let p7 = (!documented.is_empty()).then(|| median(&documented));
    let figures = [
        Figure {
            id: "P1",
            key: "p1_first_vs_bare",
            what: "idem first / bare latency (PostgreSQL, durable)",
            value: (args.backend == Backend::Postgres).then_some(first_vs_bare),
            goal: 1.10,
            at_most: true,
        },
        Figure {
            id: "P2",
            key: "p2_replay_vs_first",
            what: "idem replay / idem first latency",
            value: Some(m(Variant::IdemReplay) / m(Variant::IdemFirst)),
            goal: 0.33,
            at_most: true,
        },
        Figure {
            id: "P3",
            key: "p3_vs_three_commit",
            what: "idem first / three-commit throughput, 16 clients",
            value: Some(tput_med[2] / tput_med[1]),
            goal: 2.0,
            at_most: false,
        },
        Figure {
            id: "P4",
            key: "p4_sqlite_first_vs_bare",
            what: "idem first / bare latency (SQLite file, WAL)",
            value: (args.backend == Backend::Sqlite).then_some(first_vs_bare),
            goal: 1.20,
            at_most: true,
        },
        Figure {
            id: "P5",
            key: "p5_fingerprint_us",
            what: "fingerprint of the 1 KiB request, µs",
            value: Some(p5),
            goal: 2.0,
            at_most: true,
        },
        Figure {
            id: "P6",
            key: "p6_storm_vs_single",
            what: "64 duplicates answered / one execution",
            value: Some(p6),
            goal: 3.0,
            at_most: true,
        },
        Figure {
            id: "P7",
            key: "p7_purge_p99_ratio",
            what: "claim p99 during purge of 1M / without (full)",
            value: p7,
            goal: 2.0,
            at_most: true,
        },
    ];

    // ------------------------------------------------------------------ the table
    let elapsed = started.elapsed().as_secs_f64();
    let peak = peak_rss_bytes();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mem = read_proc("/proc/meminfo", "MemTotal").unwrap_or_default();
    let cpu = read_proc("/proc/cpuinfo", "model name").unwrap_or_default();
    let date = utc_date();
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!(
        "idem bench {date}: backend {}, {mode} mode, {:.0} s",
        args.backend.name(),
        elapsed
    ));
    line(format!(
        "machine: {cores} cores ({cpu}), {mem} RAM; load {load_start} at start, {} at end",
        loadavg()
    ));
    line(format!("server: {server}"));
    line(format!("durability: {durability}"));
    line(format!(
        "request: {request_json} bytes of JSON ({request_canonical} canonical bytes fingerprinted); \
         fingerprint {p5:.2} µs = encoding {p5_encode:.2} µs + SHA-256 {:.2} µs",
        p5 - p5_encode
    ));
    line(String::new());
    line(format!(
        "latency, 1 client: median of {} rounds x {} calls per variant (variants alternate call \
         by call, ABCD/DCBA)",
        plan.latency_rounds, plan.latency_calls
    ));
    line(format!(
        "  {:<14} {:>10} {:>10} {:>10} {:>9}",
        "variant", "median µs", "p90 µs", "p99 µs", "vs bare"
    ));
    for v in VARIANTS {
        let calls = &lat.calls[v.index()];
        line(format!(
            "  {:<14} {:>10.0} {:>10.0} {:>10.0} {:>9.2}",
            v.name(),
            m(v),
            percentile(calls, 0.90),
            percentile(calls, 0.99),
            m(v) / m(Variant::Bare)
        ));
    }
    line(String::new());
    line(format!(
        "throughput, {} clients: median of {} rounds x {:.1} s",
        plan.clients,
        plan.tput_rounds,
        plan.tput_round.as_secs_f64()
    ));
    line(format!(
        "  {:<14} {:>10} {:>16}   server counters per call",
        "variant", "calls/s", "vs three-commit"
    ));
    for (i, v) in TPUT_VARIANTS.iter().enumerate() {
        let counters: Vec<String> = tput.counters[i]
            .iter()
            .map(|(k, total)| format!("{k} {:.2}", total / tput.calls[i].max(1) as f64))
            .collect();
        line(format!(
            "  {:<14} {:>10.0} {:>16.2}   {}",
            v.name(),
            tput_med[i],
            tput_med[i] / tput_med[1],
            counters.join(", ")
        ));
    }
    line(String::new());
    line(format!(
        "storm: {} concurrent duplicates of one key, median of {} rounds: {:.0} µs until all \
         answered; one execution {:.0} µs",
        plan.storm,
        plan.storm_rounds,
        median(&storm.storm_us),
        median(&storm.single_us)
    ));
    line(format!(
        "{n} concurrent replays (no execution), median µs until all answered: one key {:.0}, \
         {n} distinct keys {:.0}",
        median(&storm.replays_same_us),
        median(&storm.replays_distinct_us),
        n = plan.storm
    ));
    line(format!(
        "storm scaling (median µs until all answered): {}",
        storm
            .scaling
            .iter()
            .map(|(n, t)| format!("{n} copies {t:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for c in &cycles {
        let how = match c.how {
            PurgeHow::Batch(n) => format!("purge_expired(db, {n})"),
            PurgeHow::Paced => format!(
                "paced: ~{} ms statements + equal pauses, median {:.0} rows each",
                PACED_BUDGET.as_millis(),
                c.batch
            ),
        };
        line(format!(
            "purge [{how}]: {} expired records in {:.1} s, {} statements, {:.1} ms each (pauses \
             included); claim p99 \
             {:.0} µs during ({} claims) vs {:.0} µs without ({} claims): ratio {:.2}; p50 {:.0} vs {:.0} µs",
            c.deleted,
            c.purge_s,
            c.statements,
            c.purge_s * 1000.0 / c.statements.max(1) as f64,
            percentile(&c.during_us, 0.99),
            c.during_us.len(),
            percentile(&c.baseline_us, 0.99),
            c.baseline_us.len(),
            c.ratio(),
            percentile(&c.during_us, 0.5),
            percentile(&c.baseline_us, 0.5),
        ));
    }
    if let Some((deleted, s)) = purge_note {
        line(format!(
            "purge: {deleted} synthetic expired records deleted in {s:.1} s (batch 10000)"
        ));
    }
    line(String::new());
    line(format!(
        "  {:<3} {:<50} {:>8} {:>9} {:>5}",
        "", "figure", "value", "goal", "met"
    ));
    for f in &figures {
        line(format!(
            "  {:<3} {:<50} {:>8} {:>9} {:>5}",
            f.id,
            f.what,
            fmt_opt(f.value, 2),
            format!("{} {}", if f.at_most { "<=" } else { ">=" }, f.goal),
            match f.met() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        ));
    }
    line(String::new());
    line(format!(
        "peak memory (VmHWM): {}",
        fmt_opt(peak.map(|p| p as f64 / 1_048_576.0), 1) + " MiB"
    ));
    line(format!(
        "ledger on disk: {:.0} bytes per 1,000,000 records ({:.1} MiB; measured over {} records \
         with a {}-byte recorded receipt, inserted in {:.1} s)",
        size.per_million(),
        size.per_million() / 1_048_576.0,
        size.rows,
        response.len(),
        size.insert_s
    ));
    line(format!(
        "checked: {executed} executions, {payments} payments, {ledger_live} ledger records at the end"
    ));
    line(String::new());
    line(
        "profile (one connection, sequential; statements counted by SeaORM's metric callback):"
            .to_owned(),
    );
    line(format!(
        "  {:<14} {:>8} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "variant", "wall µs", "statements", "in stmts µs", "outside µs", "client CPU", "server CPU"
    ));
    for v in VARIANTS {
        let p = &prof["variants"][v.key()];
        let f = |k: &str| p[k].as_f64();
        line(format!(
            "  {:<14} {:>8} {:>10} {:>12} {:>12} {:>12} {:>12}",
            v.name(),
            fmt_opt(f("wall_us"), 0),
            fmt_opt(f("statements_per_call"), 1),
            fmt_opt(f("statement_us_per_call"), 0),
            fmt_opt(f("outside_statements_us_per_call"), 0),
            fmt_opt(f("client_cpu_us_per_call"), 0),
            fmt_opt(f("server_cpu_us_per_call"), 0),
        ));
        let mut extra: Vec<String> = p["server_counters_per_call"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, x)| format!("{k} {}", fmt_opt(x.as_f64(), 1)))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(frames) = f("sqlite_wal_frames_per_call") {
            extra.push(format!("WAL frames {frames:.1}"));
        }
        if !extra.is_empty() {
            line(format!("      per call: {}", extra.join(", ")));
        }
        if let Some(by) = p["by_statement"].as_object() {
            for (k, s) in by {
                line(format!(
                    "      {:<32} {:>5} per call {:>8} µs",
                    k,
                    fmt_opt(s["per_call"].as_f64(), 1),
                    fmt_opt(s["us_per_call"].as_f64(), 0)
                ));
            }
        }
    }
    let micro = &prof["micro_us"];
    line(format!(
        "  frame: acquire+ping+BEGIN {} µs, SELECT 1 round trip {} µs, COMMIT after one UPDATE {} µs, \
         ROLLBACK read-only {} µs",
        fmt_opt(micro["acquire_ping_begin"].as_f64(), 0),
        fmt_opt(micro["select_1_round_trip"].as_f64(), 0),
        fmt_opt(micro["commit_after_one_update"].as_f64(), 0),
        fmt_opt(micro["rollback_read_only"].as_f64(), 0),
    ));
    print!("{out}");

    if args.json {
        let mut report = serde_json::Map::new();
        for f in &figures {
            report.insert(f.key.to_owned(), f.value.map_or(json!(null), r3));
        }
        let variants: serde_json::Map<String, serde_json::Value> = VARIANTS
            .iter()
            .map(|v| {
                let calls = &lat.calls[v.index()];
                (
                    v.key().to_owned(),
                    json!({
                        "median_us": r3(m(*v)),
                        "p90_us": r3(percentile(calls, 0.90)),
                        "p99_us": r3(percentile(calls, 0.99)),
                    }),
                )
            })
            .collect();
        let throughput: serde_json::Map<String, serde_json::Value> = TPUT_VARIANTS
            .iter()
            .enumerate()
            .map(|(i, v)| (v.key().to_owned(), r3(tput_med[i])))
            .collect();
        let goals: serde_json::Map<String, serde_json::Value> = figures
            .iter()
            .map(|f| (f.key.to_owned(), json!(f.met())))
            .collect();
        report.extend([
            ("backend".to_owned(), json!(args.backend.name())),
            ("mode".to_owned(), json!(mode)),
            ("date".to_owned(), json!(date)),
            ("elapsed_s".to_owned(), r3(elapsed)),
            ("first_vs_bare".to_owned(), r3(first_vs_bare)),
            ("goals_met".to_owned(), json!(goals)),
            ("latency".to_owned(), json!(variants)),
            ("throughput_per_s".to_owned(), json!(throughput)),
            (
                "throughput_server_counters_per_call".to_owned(),
                json!(
                    TPUT_VARIANTS
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            let per_call: BTreeMap<&str, serde_json::Value> = tput.counters[i]
                                .iter()
                                .map(|(k, t)| (*k, r3(t / tput.calls[i].max(1) as f64)))
                                .collect();
                            (v.key(), per_call)
                        })
                        .collect::<BTreeMap<_, _>>()
                ),
            ),
            (
                "storm".to_owned(),
                json!({"copies": plan.storm, "all_answered_us": r3(median(&storm.storm_us)),
                       "single_us": r3(median(&storm.single_us)),
                       "replays_one_key_us": r3(median(&storm.replays_same_us)),
                       "replays_distinct_keys_us": r3(median(&storm.replays_distinct_us)),
                       "scaling_us": storm.scaling.iter()
                           .map(|(n, t)| json!({"copies": n, "all_answered_us": r3(*t)}))
                           .collect::<Vec<_>>()}),
            ),
            (
                "purge".to_owned(),
                json!(
                    cycles
                        .iter()
                        .map(|c| json!({
                            "deleted": c.deleted, "purge_s": r3(c.purge_s),
                            "p99_during_us": r3(percentile(&c.during_us, 0.99)),
                            "p99_baseline_us": r3(percentile(&c.baseline_us, 0.99)),
                            "claims_during": c.during_us.len(), "ratio": r3(c.ratio()),
                        }))
                        .collect::<Vec<_>>()
                ),
            ),
            ("peak_rss_bytes".to_owned(), json!(peak)),
            (
                "ledger_bytes_per_million".to_owned(),
                json!(size.per_million().round()),
            ),
            ("request_json_bytes".to_owned(), json!(request_json)),
            (
                "request_canonical_bytes".to_owned(),
                json!(request_canonical),
            ),
            ("fingerprint_encode_us".to_owned(), r3(p5_encode)),
            ("server".to_owned(), json!(server)),
            ("durability".to_owned(), json!(durability)),
            ("cores".to_owned(), json!(cores)),
            ("load_start".to_owned(), json!(load_start)),
            ("load_end".to_owned(), json!(loadavg())),
            ("profile".to_owned(), prof),
        ]);
        println!("{}", serde_json::Value::Object(report));
    }
    Ok(())
}
