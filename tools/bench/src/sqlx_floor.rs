//! P13, the sqlx user's floor: idem's sqlx store against the idempotency a sqlx service writes
//! by hand (zero2prod's pattern: insert-or-fetch a key row, run the body, save the response in
//! the same transaction), on the same route and the same pool; and against idem's SeaORM store
//! on a SeaORM pool of the same size to the same database.
//!
//! The route pays an order: one payment row inserted in the call's transaction, a small
//! receipt recorded and replayed. First calls (a new key each, one client), replays (the same
//! key again, one client), and throughput (16 clients, new keys) are measured in alternating
//! rounds (the variants' order turns each round), and reported as medians with their ratios
//! against the hand-written floor (goals: first ≤ 1.25x, replay ≤ 1.0x, throughput ≥ 0.8x).
//!
//! ```text
//! cargo run --release -p idem-bench -- --p13 [--backend sqlite|postgres] [--url URL] [--quick]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde::{Deserialize, Serialize};

use crate::Res;
use crate::setup::Backend;

/// The command: the key and what the payment writes.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Pay {
    key: String,
    order_id: i64,
    amount_cents: i64,
}

/// The answer recorded and replayed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct Receipt {
    order_id: i64,
    amount_cents: i64,
}

/// Which way a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// zero2prod's pattern, by hand, on the sqlx pool.
    Hand,
    /// `#[idempotent]` on the sqlx pool.
    IdemSqlx,
    /// `#[idempotent]` on a SeaORM pool.
    IdemSeaOrm,
}

const VARIANTS: [Variant; 3] = [Variant::Hand, Variant::IdemSqlx, Variant::IdemSeaOrm];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Hand => "hand-written sqlx (zero2prod)",
            Variant::IdemSqlx => "idem, sqlx store",
            Variant::IdemSeaOrm => "idem, SeaORM store",
        }
    }
}

/// Medians of one variant.
#[derive(Debug, Default)]
struct Figures {
    first: Vec<f64>,
    replay: Vec<f64>,
    throughput: Vec<f64>,
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn command(run: &str) -> Pay {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    Pay {
        key: format!("{run}-{n}"),
        order_id: i64::try_from(n).unwrap_or(0),
        amount_cents: 1200,
    }
}

/// The variants of one backend, written once per sqlx database by a macro (the hand-written
/// SQL differs only in its placeholders).
macro_rules! backend {
    ($module:ident, $pool:ty, [$($begin:tt)*], $insert_key:literal, $select_key:literal, $save:literal, $payment:literal) => {
        mod $module {
            use super::*;

            #[idempotent(scope = "bench.p13.pay", key = cmd.key)]
            pub(crate) async fn idem_sqlx(db: &$pool, cmd: Pay) -> Result<Receipt, idem::Error> {
                sqlx::query($payment)
                    .bind(cmd.order_id)
                    .bind(cmd.amount_cents)
                    .execute(&mut *db)
                    .await
                    .map_err(|e| idem::Error::store("saving the payment", e))?;
                Ok(Receipt {
                    order_id: cmd.order_id,
                    amount_cents: cmd.amount_cents,
                })
            }

            /// zero2prod's `try_processing` + `save_response`, in one transaction.
            pub(crate) async fn hand(pool: &$pool, cmd: Pay) -> Result<Receipt, sqlx::Error> {
                let mut tx = pool.$($begin)*.await?;
                let inserted = sqlx::query($insert_key)
                    .bind(&cmd.key)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if inserted == 0 {
                    let saved: Option<Vec<u8>> = sqlx::query_scalar($select_key)
                        .bind(&cmd.key)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.rollback().await?;
                    let saved = saved.ok_or(sqlx::Error::RowNotFound)?;
                    return serde_json::from_slice(&saved)
                        .map_err(|e| sqlx::Error::Decode(Box::new(e)));
                }
                sqlx::query($payment)
                    .bind(cmd.order_id)
                    .bind(cmd.amount_cents)
                    .execute(&mut *tx)
                    .await?;
                let receipt = Receipt {
                    order_id: cmd.order_id,
                    amount_cents: cmd.amount_cents,
                };
                let body =
                    serde_json::to_vec(&receipt).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
                sqlx::query($save)
                    .bind(body)
                    .bind(&cmd.key)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(receipt)
            }
        }
    };
}

backend!(
    sqlite,
    sqlx::SqlitePool,
    [begin_with("BEGIN IMMEDIATE")],
    "INSERT INTO bench_p13_idempotency (idempotency_key) VALUES (?) ON CONFLICT DO NOTHING",
    "SELECT response FROM bench_p13_idempotency WHERE idempotency_key = ?",
    "UPDATE bench_p13_idempotency SET response = ? WHERE idempotency_key = ?",
    "INSERT INTO bench_p13_payments (order_id, amount_cents) VALUES (?, ?)"
);

backend!(
    postgres,
    sqlx::PgPool,
    [begin()],
    "INSERT INTO bench_p13_idempotency (idempotency_key) VALUES ($1) ON CONFLICT DO NOTHING",
    "SELECT response FROM bench_p13_idempotency WHERE idempotency_key = $1",
    "UPDATE bench_p13_idempotency SET response = $1 WHERE idempotency_key = $2",
    "INSERT INTO bench_p13_payments (order_id, amount_cents) VALUES ($1, $2)"
);

#[idempotent(scope = "bench.p13.pay", key = cmd.key)]
async fn idem_sea_orm(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, idem::Error> {
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        idem::sea_orm::placeholders(
            backend,
            "INSERT INTO bench_p13_payments (order_id, amount_cents) VALUES (?, ?)",
        ),
        [cmd.order_id.into(), cmd.amount_cents.into()],
    ))
    .await
    .map_err(|e| idem::Error::store("saving the payment", e))?;
    Ok(Receipt {
        order_id: cmd.order_id,
        amount_cents: cmd.amount_cents,
    })
}

/// The two pools on one database, and how a call of each variant runs.
#[derive(Clone)]
enum Pools {
    Sqlite(sqlx::SqlitePool, DatabaseConnection),
    Postgres(sqlx::PgPool, DatabaseConnection),
}

impl Pools {
    async fn call(&self, variant: Variant, cmd: Pay) -> Res<Receipt> {
        Ok(match (self, variant) {
            (Pools::Sqlite(pool, _), Variant::Hand) => sqlite::hand(pool, cmd).await?,
            (Pools::Sqlite(pool, _), Variant::IdemSqlx) => sqlite::idem_sqlx(pool, cmd).await?,
            (Pools::Postgres(pool, _), Variant::Hand) => postgres::hand(pool, cmd).await?,
            (Pools::Postgres(pool, _), Variant::IdemSqlx) => postgres::idem_sqlx(pool, cmd).await?,
            (Pools::Sqlite(_, db) | Pools::Postgres(_, db), Variant::IdemSeaOrm) => {
                idem_sea_orm(db, cmd).await?
            }
        })
    }

    async fn execute(&self, sql: &str) -> Res<()> {
        match self {
            Pools::Sqlite(pool, _) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await?;
            }
            Pools::Postgres(pool, _) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await?;
            }
        }
        Ok(())
    }
}

/// Runs P13 on `backend` and prints its table.
pub(crate) async fn run(backend: Backend, url: Option<&str>, quick: bool) -> Res<()> {
    const CONNECTIONS: u32 = 16;
    let pools = match backend {
        Backend::Sqlite => {
            let path =
                std::env::temp_dir().join(format!("idem-bench-p13-{}.db", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let url = format!("sqlite://{}?mode=rwc", path.display());
            let options: sqlx::sqlite::SqliteConnectOptions = url.parse()?;
            // WAL, as a served SQLite database runs; the same for both pools.
            let options = options.journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(CONNECTIONS)
                .connect_with(options)
                .await?;
            let db = sea_orm::Database::connect(&url).await?;
            Pools::Sqlite(pool, db)
        }
        Backend::Postgres => {
            let url = url.unwrap_or("postgres://postgres@127.0.0.1:5432/test");
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(CONNECTIONS)
                .connect(url)
                .await?;
            let mut options = sea_orm::ConnectOptions::new(url.to_owned());
            options.max_connections(CONNECTIONS).sqlx_logging(false);
            let db = sea_orm::Database::connect(options).await?;
            Pools::Postgres(pool, db)
        }
        Backend::Mysql => return Err("P13 runs on sqlite and postgres".into()),
    };
    let (bytes, bigint) = match backend {
        Backend::Postgres => ("BYTEA", "BIGINT"),
        _ => ("BLOB", "INTEGER"),
    };
    pools
        .execute(&format!(
            "CREATE TABLE IF NOT EXISTS bench_p13_idempotency (idempotency_key VARCHAR(64) PRIMARY KEY, response {bytes} NULL)"
        ))
        .await?;
    pools
        .execute(&format!(
            "CREATE TABLE IF NOT EXISTS bench_p13_payments (order_id {bigint} NOT NULL, amount_cents {bigint} NOT NULL)"
        ))
        .await?;
    match &pools {
        Pools::Sqlite(pool, _) => {
            idem::sqlx::create_tables(pool, &[idem::sqlx::Family::Ledger]).await?
        }
        Pools::Postgres(pool, _) => {
            idem::sqlx::create_tables(pool, &[idem::sqlx::Family::Ledger]).await?
        }
    }
    for table in ["bench_p13_idempotency", "bench_p13_payments"] {
        pools.execute(&format!("DELETE FROM {table}")).await?;
    }
    pools
        .execute("DELETE FROM idem_ledger WHERE scope = 'bench.p13.pay'")
        .await?;

    let (rounds, calls, tput_calls) = if quick { (3, 30, 200) } else { (9, 200, 2_000) };
    let run_id = format!("p13-{}", std::process::id());
    let mut figures: Vec<Figures> = VARIANTS.iter().map(|_| Figures::default()).collect();
    // Warm every pool and statement cache.
    for &variant in &VARIANTS {
        for _ in 0..20 {
            pools.call(variant, command(&run_id)).await?;
        }
    }
    for round in 0..rounds {
        let mut order: Vec<(usize, Variant)> = VARIANTS.iter().copied().enumerate().collect();
        order.rotate_left(round % VARIANTS.len());
        for (i, variant) in order {
            let mut firsts = Vec::with_capacity(calls);
            let mut replays = Vec::with_capacity(calls);
            for _ in 0..calls {
                let cmd = command(&run_id);
                let started = Instant::now();
                let receipt = pools.call(variant, cmd.clone()).await?;
                firsts.push(started.elapsed().as_secs_f64() * 1e6);
                let started = Instant::now();
                let again = pools.call(variant, cmd).await?;
                replays.push(started.elapsed().as_secs_f64() * 1e6);
                assert_eq!(
                    receipt,
                    again,
                    "{}: a replay answers as the first call",
                    variant.name()
                );
            }
            figures[i].first.push(median(&firsts));
            figures[i].replay.push(median(&replays));
            figures[i]
                .throughput
                .push(throughput(&pools, variant, &run_id, tput_calls).await?);
        }
    }
    let hand = &figures[0];
    let (hand_first, hand_replay, hand_tput) = (
        median(&hand.first),
        median(&hand.replay),
        median(&hand.throughput),
    );
    println!(
        "P13 the sqlx user's floor, {} ({rounds} rounds; first and replay: medians of {calls} calls, one client; throughput: {tput_calls} new keys over 16 clients)",
        backend.name()
    );
    println!(
        "{:<32} {:>11} {:>11} {:>13}",
        "variant", "first p50", "replay p50", "calls/s @16"
    );
    for (variant, f) in VARIANTS.iter().zip(&figures) {
        let (first, replay, tput) = (median(&f.first), median(&f.replay), median(&f.throughput));
        println!(
            "{:<32} {:>8.0} µs {:>8.0} µs {:>13.0}   vs hand: first {:.2}x, replay {:.2}x, throughput {:.2}x",
            variant.name(),
            first,
            replay,
            tput,
            first / hand_first,
            replay / hand_replay,
            tput / hand_tput
        );
    }
    println!("goals for the sqlx store: first <= 1.25x, replay <= 1.0x, throughput >= 0.8x");
    Ok(())
}

/// Calls per second of `n` new keys spread over 16 clients.
async fn throughput(pools: &Pools, variant: Variant, run_id: &str, n: usize) -> Res<f64> {
    let left = Arc::new(AtomicU64::new(n as u64));
    let started = Instant::now();
    let clients = (0..16).map(|_| {
        let (pools, left, run_id) = (pools.clone(), Arc::clone(&left), run_id.to_owned());
        tokio::spawn(async move {
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(1))
                .is_ok()
            {
                pools
                    .call(variant, command(&run_id))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        })
    });
    for client in futures_util::future::join_all(clients).await {
        client??;
    }
    let elapsed = started.elapsed().max(Duration::from_micros(1));
    Ok(n as f64 / elapsed.as_secs_f64())
}
