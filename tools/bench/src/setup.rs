//! Everything before the first figure: the command line, how much each mode measures, where
//! the tables live, their DDL and seed rows, and the state every figure shares.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::Fingerprinter;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};

use crate::Res;
use crate::counters::server_facts;
use crate::ledger::{PurgeHow, README_BATCH};
use crate::variants::{Variant, call_variant};
use crate::workload::{PayOrder, Receipt, Sql, now_ms, template};

const USAGE: &str = "usage: cargo run --release -p idem-bench -- \
[--backend sqlite|postgres|mysql] [--quick] [--json] [--url URL] [--p7-records N] [--p11]
[--ledger-records N[,N...]] [--p5] [--p13] [--drivers] [--soak MINUTES [--clients N] [--window SECONDS]
[--ttl SECONDS] [--no-vacuum]]

--p5                  P5 alone (the fingerprint of the 1 KiB request against SHA-256 of its
                      bytes), no database: what a change to the fingerprint is measured with
--drivers             F1 per driver alone (SeaORM, sqlx, tokio-postgres; --backend postgres):
                      with --url through a slower network (scripts/delay-proxy), what the
                      pipelined first call saves
--p7-records N        measures P7 over N expired records, one cycle as the README purges and
                      one paced (full mode: three and one over 1,000,000; quick mode: no P7)
--p11                 P11 (the HTTP layer against axum-idempotent) at full size in quick mode:
                      2,000 keys per route and round, 16 clients for 5 s
--ledger-records N,…  P12: claim and replay latency with N live records in the ledger, for
                      each N (e.g. 100000,1000000), and the ledger's bytes per record
--soak MINUTES        the soak alone (R22): the payments example on the backend (database
                      idem_soak, made afresh; --url names the server) with the gateway example
                      as its provider, --clients N (8) creating and paying orders, a line per
                      --window SECONDS (300): throughput, p50/p99, RSS, ledger rows;
                      --ttl SECONDS: the records' TTL (the service's RECORD_TTL_SECS; a day
                      by default), which its purge, every 10 s, deletes behind; on a
                      PostgreSQL server whose autovacuum is off, the soak vacuums and
                      analyzes every 60 s as autovacuum would, unless --no-vacuum";

/// The schema (PostgreSQL) or database (MySQL) holding the bench's ledger and tables.
pub(crate) const BENCH_NAMESPACE: &str = "bench_idem";
/// Orders reserved per client, so concurrent clients never wait on each other's order rows.
pub(crate) const ORDERS_PER_SLOT: i64 = 64;
/// Order slots: 0..16 throughput clients, then the latency client, the storm, the profile.
pub(crate) const SLOT_LATENCY: i64 = 16;
pub(crate) const SLOT_STORM: i64 = 17;
pub(crate) const SLOT_PROFILE: i64 = 18;
const SLOTS: i64 = 19;
/// Rows per bulk insert of synthetic expired ledger records.
pub(crate) const BULK_CHUNK: u64 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
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
    pub(crate) fn name(self) -> &'static str {
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
pub(crate) struct Args {
    pub(crate) backend: Backend,
    pub(crate) quick: bool,
    pub(crate) json: bool,
    pub(crate) url: Option<String>,
    /// Expired records P7 purges, instead of the mode's.
    pub(crate) p7_records: Option<u64>,
    /// P11 at full size whatever the mode.
    pub(crate) p11_full: bool,
    /// P12's ledger sizes (live records); empty: no P12.
    pub(crate) ledger_records: Vec<u64>,
    /// P5 alone, without a database (what a change to the fingerprint is measured with).
    pub(crate) p5_only: bool,
    /// `--p13`: only P13, the sqlx store against hand-written sqlx idempotency.
    pub(crate) p13_only: bool,
    /// `--drivers`: only F1 per driver (PostgreSQL).
    pub(crate) drivers_only: bool,
    /// `--http`: only P11, the HTTP layer against the peer crate.
    pub(crate) http_only: bool,
    /// `--lease`: only P10, lease mode against atomic mode.
    pub(crate) lease_only: bool,
    /// `--soak MINUTES`: only the soak (R22), with its clients and window.
    pub(crate) soak: Option<crate::soak::Soak>,
}

/// A count from the command line: digits, with `_` or `,` between thousands allowed.
fn count(flag: &str, value: &str) -> Res<u64> {
    value
        .replace(['_', ','], "")
        .parse()
        .map_err(|_| format!("{flag} takes a number, not `{value}`").into())
}

/// A comma-separated list of counts (`100000,1000000` or `100_000,1_000_000`): the comma
/// separates counts here, only `_` groups digits.
fn counts(flag: &str, value: &str) -> Res<Vec<u64>> {
    let counts: Vec<u64> = value
        .split(',')
        .filter(|v| !v.trim().is_empty())
        .map(|v| count(flag, v.trim()))
        .collect::<Res<_>>()?;
    if counts.contains(&0) {
        return Err(format!("{flag} takes counts above 0, not `{value}`").into());
    }
    Ok(counts)
}

pub(crate) fn parse_args() -> Res<Args> {
    let mut args = Args {
        backend: Backend::Sqlite,
        quick: false,
        json: false,
        url: None,
        p7_records: None,
        p11_full: false,
        p5_only: false,
        p13_only: false,
        drivers_only: false,
        http_only: false,
        lease_only: false,
        ledger_records: Vec::new(),
        soak: None,
    };
    let (mut soak_minutes, mut soak_clients, mut soak_window) = (None, 8_u64, 300_u64);
    let mut soak_ttl = None;
    let mut soak_no_vacuum = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--backend" => {
                args.backend = Backend::parse(&it.next().ok_or("--backend needs a value")?)?;
            }
            "--url" => args.url = Some(it.next().ok_or("--url needs a value")?),
            "--p7-records" => {
                let n = it.next().ok_or("--p7-records needs a number")?;
                args.p7_records = Some(count("--p7-records", &n)?);
            }
            "--ledger-records" => {
                let n = it
                    .next()
                    .ok_or("--ledger-records needs a number or a list")?;
                args.ledger_records = counts("--ledger-records", &n)?;
            }
            "--soak" => {
                let minutes = it.next().ok_or("--soak needs minutes")?;
                soak_minutes = Some(
                    minutes
                        .parse::<f64>()
                        .ok()
                        .filter(|m| *m > 0.0 && m.is_finite())
                        .ok_or_else(|| format!("--soak takes minutes above 0, not `{minutes}`"))?,
                );
            }
            "--clients" => {
                soak_clients = count("--clients", &it.next().ok_or("--clients needs a number")?)?;
            }
            "--window" => {
                soak_window = count("--window", &it.next().ok_or("--window needs seconds")?)?;
            }
            "--no-vacuum" => soak_no_vacuum = true,
            "--ttl" => {
                let secs = count("--ttl", &it.next().ok_or("--ttl needs seconds")?)?;
                soak_ttl = Some(Duration::from_secs(secs));
            }
            "--p11" => args.p11_full = true,
            "--p5" => args.p5_only = true,
            "--p13" => args.p13_only = true,
            "--drivers" => args.drivers_only = true,
            "--http" => args.http_only = true,
            "--lease" => args.lease_only = true,
            "--quick" => args.quick = true,
            "--json" => args.json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                if let Some(v) = other.strip_prefix("--backend=") {
                    args.backend = Backend::parse(v)?;
                } else if let Some(v) = other.strip_prefix("--ledger-records=") {
                    args.ledger_records = counts("--ledger-records", v)?;
                } else if let Some(v) = other.strip_prefix("--url=") {
                    args.url = Some(v.to_owned());
                } else {
                    return Err(format!("unknown argument `{other}`\n{USAGE}").into());
                }
            }
        }
    }
    if let Some(minutes) = soak_minutes {
        if soak_clients == 0 || soak_window == 0 || soak_ttl.is_some_and(|ttl| ttl.is_zero()) {
            return Err("--clients, --window and --ttl take numbers above 0".into());
        }
        args.soak = Some(crate::soak::Soak {
            duration: Duration::from_secs_f64(minutes * 60.0),
            clients: usize::try_from(soak_clients)?,
            window: Duration::from_secs(soak_window),
            ttl: soak_ttl,
            no_vacuum: soak_no_vacuum,
        });
    }
    Ok(args)
}

/// How much of everything a mode does.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) latency_rounds: usize,
    pub(crate) latency_calls: usize,
    pub(crate) tput_rounds: usize,
    pub(crate) tput_round: Duration,
    pub(crate) clients: usize,
    pub(crate) storm_rounds: usize,
    pub(crate) storm: usize,
    pub(crate) fp_rounds: usize,
    pub(crate) fp_iters: usize,
    pub(crate) profile_calls: usize,
    /// Synthetic records inserted to measure the ledger's size (quick mode).
    pub(crate) ledger_rows: u64,
    pub(crate) purge: Option<PurgePlan>,
    /// P8: messages staged for each relay variant.
    pub(crate) relay_messages: usize,
    /// P9: messages sent one per call, for each relay variant.
    pub(crate) publish_latency_messages: usize,
    /// P10: timed first executions per mode.
    pub(crate) lease_calls: usize,
    /// P11: new keys per route and round, each sent twice (first request, replay).
    pub(crate) http_keys: usize,
    /// P11: rounds, the routes alternating.
    pub(crate) http_rounds: usize,
    /// P11: how long the concurrent clients send, per route and round.
    pub(crate) http_round: Duration,
    /// P12: timed claims (and as many replays) at each ledger size.
    pub(crate) growth_calls: usize,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PurgePlan {
    pub(crate) rows: u64,
    pub(crate) baseline: Duration,
    /// One cycle per entry.
    pub(crate) cycles: &'static [PurgeHow],
}

/// Full mode's P7: a million expired records, three cycles as documented, one paced (what
/// would close P7).
const FULL_PURGE: PurgePlan = PurgePlan {
    rows: 1_000_000,
    baseline: Duration::from_secs(10),
    cycles: &[
        PurgeHow::Batch(README_BATCH),
        PurgeHow::Batch(README_BATCH),
        PurgeHow::Batch(README_BATCH),
        PurgeHow::Paced,
    ],
};

impl Plan {
    pub(crate) fn quick() -> Self {
        Self {
            latency_rounds: 20,
            latency_calls: 50,
            tput_rounds: 5,
            tput_round: Duration::from_secs(1),
            clients: 16,
            storm_rounds: 40,
            storm: 64,
            fp_rounds: 15,
            fp_iters: 5_000,
            profile_calls: 150,
            ledger_rows: 100_000,
            purge: None,
            relay_messages: 2_000,
            publish_latency_messages: 200,
            lease_calls: 300,
            http_keys: 500,
            http_rounds: 3,
            http_round: Duration::from_secs(1),
            growth_calls: 2_000,
        }
    }

    pub(crate) fn full() -> Self {
        Self {
            latency_rounds: 50,
            latency_calls: 100,
            tput_rounds: 10,
            tput_round: Duration::from_secs(3),
            fp_rounds: 50,
            fp_iters: 20_000,
            profile_calls: 1_000,
            ledger_rows: 1_000_000,
            purge: Some(FULL_PURGE),
            relay_messages: 10_000,
            publish_latency_messages: 1_000,
            lease_calls: 2_000,
            growth_calls: 5_000,
            ..Self::quick().with_full_p11()
        }
    }

    /// P11 as the issue states it: 2,000 keys per route and round, 16 clients for 5 s.
    pub(crate) fn with_full_p11(self) -> Self {
        Self {
            http_keys: 2_000,
            http_round: Duration::from_secs(5),
            ..self
        }
    }

    /// P7 over `rows` expired records, in any mode: one cycle as documented, one paced.
    pub(crate) fn with_p7_records(self, rows: u64) -> Self {
        Self {
            purge: Some(PurgePlan {
                rows,
                cycles: &[PurgeHow::Batch(README_BATCH), PurgeHow::Paced],
                ..FULL_PURGE
            }),
            ..self
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

pub(crate) async fn connect(
    url: &str,
    max: Option<u32>,
    schema: Option<&str>,
) -> Res<DatabaseConnection> {
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
pub(crate) struct Target {
    pub(crate) url: String,
    pub(crate) schema: Option<&'static str>,
    pub(crate) sqlite_file: Option<std::path::PathBuf>,
    /// Pool size of the main pool (`None`: SeaORM's default, one connection on SQLite).
    pub(crate) pool: Option<u32>,
}

impl Target {
    fn new(url: String, schema: Option<&'static str>, pool: Option<u32>) -> Self {
        Self {
            url,
            schema,
            sqlite_file: None,
            pool,
        }
    }
}

pub(crate) async fn target(args: &Args) -> Res<Target> {
    let env = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| args.backend.accepts(u));
    let given = args.url.clone().or(env);
    if let Some(url) = &given
        && !args.backend.accepts(url)
    {
        return Err(format!("--url {url} is not a {} URL", args.backend.name()).into());
    }
    if args.backend == Backend::Sqlite {
        return Ok(match given {
            Some(url) => Target::new(url, None, None),
            None => {
                let path = std::env::temp_dir().join("bench_idem.db");
                remove_sqlite(&path);
                let url = format!("sqlite://{}?mode=rwc", path.display());
                Target {
                    sqlite_file: Some(path),
                    ..Target::new(url, None, None)
                }
            }
        });
    }
    // A server: the bench works in a schema (PostgreSQL) or database (MySQL) of its own.
    let (create, default) = match args.backend {
        Backend::Postgres => ("SCHEMA", "postgres://postgres@127.0.0.1:5432/test"),
        _ => ("DATABASE", "mysql://root@127.0.0.1:3306/test"),
    };
    let url = given.unwrap_or_else(|| default.into());
    let admin = connect(&url, Some(1), None).await?;
    admin
        .execute_unprepared(&format!("CREATE {create} IF NOT EXISTS {BENCH_NAMESPACE}"))
        .await?;
    admin.close().await?;
    Ok(match args.backend {
        Backend::Mysql => Target::new(with_database(&url, BENCH_NAMESPACE)?, None, Some(72)),
        _ => Target::new(url, Some(BENCH_NAMESPACE), Some(72)),
    })
}

pub(crate) fn remove_sqlite(path: &std::path::Path) {
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
            "CREATE TABLE IF NOT EXISTS bench_lease_rows (id BIGSERIAL PRIMARY KEY, reference VARCHAR(64) NOT NULL)",
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
            "CREATE TABLE IF NOT EXISTS bench_lease_rows (id BIGINT AUTO_INCREMENT PRIMARY KEY, reference VARCHAR(64) NOT NULL)",
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
            "CREATE TABLE IF NOT EXISTS bench_lease_rows (id INTEGER PRIMARY KEY AUTOINCREMENT, reference TEXT NOT NULL)",
        ],
    }
}

const BENCH_TABLES: [&str; 9] = [
    "bench_orders",
    "bench_payments",
    "bench_idem_keys",
    "bench_lease_rows",
    idem::sea_orm::LEDGER_TABLE,
    idem::sea_orm::STEPS_TABLE,
    idem::sea_orm::OUTBOX_TABLE,
    idem::sea_orm::OUTBOX_HEADS_TABLE,
    idem::sea_orm::DEAD_LETTERS_TABLE,
];

/// Deletes every row of the bench's tables (its own ledger, lease steps and outbox included).
pub(crate) async fn clean(db: &DatabaseConnection) -> Res<()> {
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
pub(crate) struct Bench {
    pub(crate) db: DatabaseConnection,
    pub(crate) sql: Sql,
    pub(crate) template: PayOrder,
    pub(crate) run: u64,
    pub(crate) seq: AtomicU64,
    /// Calls that executed the body (payments the database must hold at the end).
    pub(crate) executed: AtomicU64,
    pub(crate) started: Instant,
}

impl Bench {
    /// A fresh UUID-shaped (36-character) key.
    pub(crate) fn new_key(&self) -> String {
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
    pub(crate) fn command(&self, slot: i64, i: usize) -> PayOrder {
        let mut cmd = self.template.clone();
        cmd.idempotency_key = self.new_key();
        cmd.order_id = 1 + slot * ORDERS_PER_SLOT + (i as i64 % ORDERS_PER_SLOT);
        cmd
    }

    pub(crate) async fn call(&self, variant: Variant, cmd: PayOrder) -> Res<Receipt> {
        self.call_on(&self.db, variant, cmd).await
    }

    /// A call of `variant` on `db` (the main pool, or the profile's own connection), counted
    /// if it executes.
    pub(crate) async fn call_on(
        &self,
        db: &DatabaseConnection,
        variant: Variant,
        cmd: PayOrder,
    ) -> Res<Receipt> {
        let receipt = call_variant(db, &self.sql, variant, cmd).await?;
        if variant.executes() {
            self.executed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(receipt)
    }

    pub(crate) fn progress(&self, what: &str) {
        eprintln!("[{:>6.1} s] {what}", self.started.elapsed().as_secs_f64());
    }
}

pub(crate) async fn scalar(db: &DatabaseConnection, sql: &str) -> Res<String> {
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

/// Facts about the run that the report states before the figures.
#[derive(Debug)]
pub(crate) struct Facts {
    pub(crate) server: String,
    pub(crate) durability: String,
    /// The request P5 fingerprints.
    pub(crate) sample: PayOrder,
    pub(crate) request_json_bytes: usize,
    pub(crate) request_canonical_bytes: usize,
}

/// Connects, creates and empties the bench's tables, seeds the orders, and builds the state
/// every figure shares.
pub(crate) async fn prepare(args: &Args, started: Instant) -> Res<(Arc<Bench>, Target, Facts)> {
    let target = target(args).await?;
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
    let sample = bench.command(SLOT_LATENCY, 0);
    let request_json_bytes = serde_json::to_vec(&sample)?.len();
    let mut canonical = Fingerprinter::new("bench.pay");
    canonical.arg(&sample)?;
    let request_canonical_bytes = canonical.encoded().len();
    bench.progress(&format!(
        "{} ({}): {server}; {durability}",
        args.backend.name(),
        if args.quick { "quick" } else { "full" }
    ));
    let facts = Facts {
        server,
        durability,
        sample,
        request_json_bytes,
        request_canonical_bytes,
    };
    Ok((bench, target, facts))
}

/// What the end-of-run check counted.
#[derive(Debug)]
pub(crate) struct Checked {
    pub(crate) executed: u64,
    pub(crate) payments: u64,
    pub(crate) ledger_records: u64,
}

/// Every execution left exactly one payment; replays left none. Fails otherwise.
pub(crate) async fn check(b: &Bench) -> Res<Checked> {
    let payments: u64 = scalar(&b.db, "SELECT COUNT(*) FROM bench_payments")
        .await?
        .parse()?;
    let executed = b.executed.load(Ordering::Relaxed);
    if payments != executed {
        return Err(format!("{payments} payments for {executed} executions").into());
    }
    let ledger_records: u64 = scalar(&b.db, "SELECT COUNT(*) FROM idem_ledger")
        .await?
        .parse()?;
    Ok(Checked {
        executed,
        payments,
        ledger_records,
    })
}

/// Empties the bench's tables, closes the pool, and deletes the SQLite file the bench made.
pub(crate) async fn finish(b: &Bench, target: &Target) -> Res<()> {
    clean(&b.db).await?;
    b.db.close_by_ref().await?;
    if let Some(path) = &target.sqlite_file {
        remove_sqlite(path);
    }
    Ok(())
}
