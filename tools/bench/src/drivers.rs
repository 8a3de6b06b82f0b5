//! F1 per driver (PostgreSQL): the pay-order handler bare, idem first and idem replay on each
//! of idem's three drivers (SeaORM, sqlx, tokio-postgres on deadpool-postgres), every pool of
//! the main pool's size on the bench's schema, taking turns call by call with one round trip
//! timed on each driver's own pool. Each driver's F1 is `(idem first − bare) / (2 × its round
//! trip)`, against its own bare measured in the same phase.
//!
//! The bodies send the same three statements on every driver: SeaORM's and sqlx's prepared
//! (cached after the warm-up), tokio-postgres's unnamed with their types (`query_typed`), as
//! idem's own statements are there: one round trip each.

use idem::idempotent;
use idem::tokio_postgres::deadpool_postgres::tokio_postgres::types::{ToSql, Type};
use idem::tokio_postgres::deadpool_postgres::tokio_postgres::{self, Client};
use idem::tokio_postgres::deadpool_postgres::{self, ClientWrapper, Pool};
use sea_orm::{ConnectionTrait, Statement, TransactionTrait};
use sqlx::PgConnection;

use crate::Res;
use crate::harness::{median, on_one_cpu, take_turns, us};
use crate::latency::{IDEM_EXTRA_STATEMENTS, Latencies};
use crate::setup::{Bench, Plan, SLOT_LATENCY, Target};
use crate::variants::Variant;
use crate::workload::{PayOrder, Receipt, Sql, now_ms};

/// idem's drivers, in the order of the first round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Driver {
    SeaOrm,
    Sqlx,
    TokioPostgres,
}

impl Driver {
    pub(crate) const ALL: [Driver; 3] = [Driver::SeaOrm, Driver::Sqlx, Driver::TokioPostgres];

    /// The name in the table.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Driver::SeaOrm => "SeaORM",
            Driver::Sqlx => "sqlx",
            Driver::TokioPostgres => "tokio-postgres",
        }
    }

    /// The name in the JSON.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Driver::SeaOrm => "sea_orm",
            Driver::Sqlx => "sqlx",
            Driver::TokioPostgres => "tokio_postgres",
        }
    }
}

/// What takes a turn: a variant's call on a driver, or one round trip on its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Call(Driver, Variant),
    RoundTrip(Driver),
}

/// The variants each driver runs (three-commit is SeaORM's own and stays in P1–P4).
const VARIANTS: [Variant; 3] = [Variant::Bare, Variant::IdemFirst, Variant::IdemReplay];

/// One driver's latencies in the phase.
#[derive(Debug, Default)]
pub(crate) struct DriverFigures {
    pub(crate) bare: Latencies,
    pub(crate) first: Latencies,
    pub(crate) replay: Latencies,
    pub(crate) round_trip: Latencies,
}

impl DriverFigures {
    /// F1 on this driver: `(idem first − bare) / (2 × round trip)`.
    pub(crate) fn first_beyond_floor(&self) -> f64 {
        (self.first.median() - self.bare.median())
            / (IDEM_EXTRA_STATEMENTS * self.round_trip.median())
    }

    /// idem first over bare on this driver.
    pub(crate) fn first_vs_bare(&self) -> f64 {
        self.first.median() / self.bare.median()
    }

    /// idem replay over bare on this driver.
    pub(crate) fn replay_vs_bare(&self) -> f64 {
        self.replay.median() / self.bare.median()
    }
}

/// F1 per driver; `None` off PostgreSQL.
#[derive(Debug, Default)]
pub(crate) struct ByDriver {
    /// In [`Driver::ALL`]'s order.
    pub(crate) drivers: Vec<(Driver, DriverFigures)>,
    /// Whether the phase ran pinned to one CPU.
    pub(crate) pinned: bool,
}

/// The pools of the three drivers on the bench's database.
struct Pools {
    sqlx: sqlx::PgPool,
    deadpool: Pool,
}

async fn pools(target: &Target) -> Res<Pools> {
    let size = target.pool.unwrap_or(16);
    let schema = target.schema.unwrap_or("public");
    let options: sqlx::postgres::PgConnectOptions = target.url.parse()?;
    let sqlx = sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options.options([("search_path", schema)]))
        .await?;
    let mut config: tokio_postgres::Config = target.url.parse()?;
    config.options(format!("-c search_path={schema}"));
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let deadpool = Pool::builder(manager)
        .max_size(size as usize)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()?;
    Ok(Pools { sqlx, deadpool })
}

/// Measures F1 on each driver, pinned to one CPU where it can be; nothing off PostgreSQL.
pub(crate) async fn measure(b: &Bench, target: &Target, plan: &Plan) -> Res<Option<ByDriver>> {
    if b.sql.backend != sea_orm::DbBackend::Postgres {
        return Ok(None);
    }
    let pools = pools(target).await?;
    let mut recorded: [Vec<PayOrder>; 3] = Default::default();
    // Warm-up: connections, statement caches, and replays' keys.
    for driver in Driver::ALL {
        for variant in VARIANTS {
            for i in 0..plan.latency_calls.min(20) {
                call(b, &pools, driver, variant, i, i, &mut recorded).await?;
            }
        }
    }
    let pinned = on_one_cpu(async || phase(b, &pools, plan, &mut recorded).await).await?;
    let by_driver = match pinned {
        Some(drivers) => ByDriver {
            drivers,
            pinned: true,
        },
        None => ByDriver {
            drivers: phase(b, &pools, plan, &mut recorded).await?,
            pinned: false,
        },
    };
    pools.sqlx.close().await;
    pools.deadpool.close();
    b.progress("f1 per driver done");
    Ok(Some(by_driver))
}

/// Every driver's variants and round trip taking turns, `plan.latency_rounds` rounds of
/// `plan.latency_calls` each.
async fn phase(
    b: &Bench,
    pools: &Pools,
    plan: &Plan,
    recorded: &mut [Vec<PayOrder>; 3],
) -> Res<Vec<(Driver, DriverFigures)>> {
    let n = plan.latency_calls;
    let turns: Vec<Turn> = Driver::ALL
        .iter()
        .flat_map(|&d| {
            VARIANTS
                .iter()
                .map(move |&v| Turn::Call(d, v))
                .chain([Turn::RoundTrip(d)])
        })
        .collect();
    let turn = async |turn, t| match turn {
        Turn::Call(d, v) => {
            let (round, i) = (t / n, t % n);
            call(b, pools, d, v, i, round * n + i * 7, recorded).await
        }
        Turn::RoundTrip(d) => round_trip(b, pools, d).await,
    };
    let progress = |t: usize| {
        let round = t / n;
        if t % n == n - 1 && round % 5 == 4 {
            let rounds = plan.latency_rounds;
            b.progress(&format!("f1 per driver: round {}/{rounds}", round + 1));
        }
    };
    let samples = take_turns(&turns, plan.latency_rounds * n, turn, progress).await?;
    let mut out: Vec<(Driver, DriverFigures)> = Driver::ALL
        .iter()
        .map(|&d| (d, DriverFigures::default()))
        .collect();
    for (&turn, calls) in turns.iter().zip(samples) {
        let latencies = Latencies {
            round_medians: calls.chunks(n).map(median).collect(),
            calls,
        };
        let (driver, slot) = match turn {
            Turn::Call(d, v) => (d, Some(v)),
            Turn::RoundTrip(d) => (d, None),
        };
        let figures = &mut out[driver as usize].1;
        match slot {
            Some(Variant::Bare) => figures.bare = latencies,
            Some(Variant::IdemFirst) => figures.first = latencies,
            Some(_) => figures.replay = latencies,
            None => figures.round_trip = latencies,
        }
    }
    Ok(out)
}

/// One call of `variant` on `driver`: its µs. idem first's requests are recorded for the
/// replays, which send the recorded request `replay` (modulo their number).
async fn call(
    b: &Bench,
    pools: &Pools,
    driver: Driver,
    variant: Variant,
    i: usize,
    replay: usize,
    recorded: &mut [Vec<PayOrder>; 3],
) -> Res<f64> {
    let mine = &mut recorded[driver as usize];
    let cmd = match variant {
        Variant::IdemReplay => mine[replay % mine.len()].clone(),
        _ => b.command(SLOT_LATENCY, i),
    };
    let keep = (variant == Variant::IdemFirst).then(|| cmd.clone());
    let (sql, sqlx, deadpool) = (&b.sql, &pools.sqlx, &pools.deadpool);
    let start = std::time::Instant::now();
    match (driver, variant) {
        (Driver::SeaOrm, _) => {
            b.call(variant, cmd).await?;
        }
        (Driver::Sqlx, Variant::Bare) => {
            let mut tx = sqlx.begin().await?;
            pay_sqlx(&mut tx, sql, &cmd).await?;
            tx.commit().await?;
        }
        (Driver::Sqlx, _) => {
            pay_idem_sqlx(sqlx, cmd, sql).await?;
        }
        (Driver::TokioPostgres, Variant::Bare) => {
            let mut client = deadpool.get().await?;
            let tx = client.transaction().await?;
            pay_tokio_postgres(tx.client(), sql, &cmd).await?;
            tx.commit().await?;
        }
        (Driver::TokioPostgres, _) => {
            pay_idem_tokio_postgres(deadpool, cmd, sql).await?;
        }
    }
    let took = us(start.elapsed());
    // SeaORM's calls are counted by `Bench::call`.
    if driver != Driver::SeaOrm && variant.executes() {
        b.executed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    recorded[driver as usize].extend(keep);
    Ok(took)
}

/// One `SELECT 1` on a connection of `driver`'s pool, inside a transaction begun and rolled
/// back outside the timing.
async fn round_trip(b: &Bench, pools: &Pools, driver: Driver) -> Res<f64> {
    match driver {
        Driver::SeaOrm => {
            let tx = b.db.begin().await?;
            let start = std::time::Instant::now();
            tx.query_one_raw(Statement::from_string(b.sql.backend, "SELECT 1"))
                .await?;
            let took = us(start.elapsed());
            tx.rollback().await?;
            Ok(took)
        }
        Driver::Sqlx => {
            let mut tx = pools.sqlx.begin().await?;
            let start = std::time::Instant::now();
            sqlx::query("SELECT 1").fetch_one(&mut *tx).await?;
            let took = us(start.elapsed());
            tx.rollback().await?;
            Ok(took)
        }
        Driver::TokioPostgres => {
            let mut client = pools.deadpool.get().await?;
            let tx = client.transaction().await?;
            let start = std::time::Instant::now();
            tx.query_typed("SELECT 1", &[]).await?;
            let took = us(start.elapsed());
            tx.rollback().await?;
            Ok(took)
        }
    }
}

/// The pay-order body on sqlx: read the order, insert the payment, update the order.
async fn pay_sqlx(
    db: &mut PgConnection,
    sql: &Sql,
    cmd: &PayOrder,
) -> Result<Receipt, sqlx::Error> {
    let (_, total, paid, version): (String, i64, i64, i64) =
        sqlx::query_as(sqlx::AssertSqlSafe(sql.read_order.as_str()))
            .bind(cmd.order_id)
            .fetch_one(&mut *db)
            .await?;
    let now = now_ms();
    let payment_id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.insert_payment.as_str()))
        .bind(cmd.order_id)
        .bind(cmd.amount_cents)
        .bind(&cmd.currency)
        .bind(&cmd.payment_method.card_token)
        .bind(&cmd.idempotency_key)
        .bind(now)
        .fetch_one(&mut *db)
        .await?;
    let receipt = Receipt::of(cmd, payment_id, total, paid, version);
    sqlx::query(sqlx::AssertSqlSafe(sql.update_order.as_str()))
        .bind(cmd.amount_cents)
        .bind(receipt.status())
        .bind(now)
        .bind(cmd.order_id)
        .execute(&mut *db)
        .await?;
    Ok(receipt)
}

/// The pay-order body on tokio-postgres, each statement unnamed with its values' types.
async fn pay_tokio_postgres(
    db: &Client,
    sql: &Sql,
    cmd: &PayOrder,
) -> Result<Receipt, tokio_postgres::Error> {
    let row = db
        .query_typed_one(&sql.read_order, &[(&cmd.order_id, Type::INT8)])
        .await?;
    let (total, paid, version): (i64, i64, i64) = (row.get(1), row.get(2), row.get(3));
    let now = now_ms();
    let values: [(&(dyn ToSql + Sync), Type); 6] = [
        (&cmd.order_id, Type::INT8),
        (&cmd.amount_cents, Type::INT8),
        (&cmd.currency, Type::TEXT),
        (&cmd.payment_method.card_token, Type::TEXT),
        (&cmd.idempotency_key, Type::TEXT),
        (&now, Type::INT8),
    ];
    let payment_id: i64 = db
        .query_typed_one(&sql.insert_payment, &values)
        .await?
        .get(0);
    let receipt = Receipt::of(cmd, payment_id, total, paid, version);
    let status = receipt.status();
    let values: [(&(dyn ToSql + Sync), Type); 4] = [
        (&cmd.amount_cents, Type::INT8),
        (&status, Type::TEXT),
        (&now, Type::INT8),
        (&cmd.order_id, Type::INT8),
    ];
    db.query_typed(&sql.update_order, &values).await?;
    Ok(receipt)
}

#[idempotent(scope = "bench.pay.sqlx", key = cmd.idempotency_key, skip(sql))]
async fn pay_idem_sqlx(
    db: &sqlx::PgPool,
    cmd: PayOrder,
    sql: &Sql,
) -> Result<Receipt, idem::Error> {
    pay_sqlx(db, sql, &cmd)
        .await
        .map_err(|e| idem::Error::store("paying the order", e))
}

#[idempotent(scope = "bench.pay.tokio-postgres", key = cmd.idempotency_key, skip(sql))]
async fn pay_idem_tokio_postgres(
    db: &Pool,
    cmd: PayOrder,
    sql: &Sql,
) -> Result<Receipt, idem::Error> {
    let client: &ClientWrapper = db;
    pay_tokio_postgres(client, sql, &cmd)
        .await
        .map_err(|e| idem::Error::store("paying the order", e))
}

impl ByDriver {
    /// The table's lines.
    pub(crate) fn lines(&self, plan: &Plan) -> Vec<String> {
        let mut out = vec![format!(
            "F1 per driver (PostgreSQL): median of {} rounds x {} calls per driver and variant, \
             each driver's round trip timed in turn on its own pool{}",
            plan.latency_rounds,
            plan.latency_calls,
            if self.pinned {
                ", pinned to one CPU"
            } else {
                ", not pinned"
            }
        )];
        out.push(format!(
            "  {:<15} {:>9} {:>9} {:>9} {:>9} {:>13} {:>14} {:>6}",
            "driver",
            "bare µs",
            "first µs",
            "replay µs",
            "1 RT µs",
            "first / bare",
            "replay / bare",
            "F1"
        ));
        for (driver, f) in &self.drivers {
            out.push(format!(
                "  {:<15} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>13.2} {:>14.2} {:>6.2}",
                driver.name(),
                f.bare.median(),
                f.first.median(),
                f.replay.median(),
                f.round_trip.median(),
                f.first_vs_bare(),
                f.replay_vs_bare(),
                f.first_beyond_floor()
            ));
        }
        out
    }

    /// The JSON object (key `f1_by_driver`).
    pub(crate) fn json(&self) -> serde_json::Value {
        use crate::harness::r3;
        let mut drivers = serde_json::Map::new();
        for (driver, f) in &self.drivers {
            drivers.insert(
                driver.key().to_owned(),
                serde_json::json!({
                    "f1": r3(f.first_beyond_floor()),
                    "bare_us": r3(f.bare.median()),
                    "first_us": r3(f.first.median()),
                    "replay_us": r3(f.replay.median()),
                    "round_trip_us": r3(f.round_trip.median()),
                    "first_vs_bare": r3(f.first_vs_bare()),
                    "replay_vs_bare": r3(f.replay_vs_bare()),
                }),
            );
        }
        drivers.insert("pinned".to_owned(), self.pinned.into());
        serde_json::Value::Object(drivers)
    }
}
