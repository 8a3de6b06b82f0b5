//! R13 client disconnects: 1,000 pays of the payments example over raw sockets whose clients
//! hang up at random points (before the body, mid-body, after the body, mid-response). axum
//! drops a handler's future when its client goes away; a handler statement dropped in flight
//! could return its pooled connection inside a transaction (PostgreSQL) or lose it (MariaDB)
//! with sqlx 0.9 (docs/RELIABILITY.md, finding 2). `idem::axum::respond` finishes every call
//! it started on a task of its own, so afterwards: no session idle in transaction, no
//! connection lost, every order paid exactly once, every key's retry replays.
//!
//! SeaORM's store only: this row is about the HTTP adapter dropping (or no longer dropping)
//! calls, and the payments example it serves runs on SeaORM. R4 drops calls at every poll
//! through both stores.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::isolated::{Isolated, isolated};
use crate::support::{Rng, quick, stmt, unique};
use crate::{app, model};

/// Where a client hangs up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum HangUp {
    /// Headers sent (with a `content-length`), no body.
    BeforeBody,
    /// Half the body sent.
    MidBody,
    /// The whole request sent, then gone after a random delay while the call runs.
    AfterBody,
    /// The first bytes of the response read.
    MidResponse,
    /// No hang-up: the whole answer read (the control group).
    Never,
}

/// One client's plan, drawn from the seeded PRNG.
#[derive(Debug, Clone, Copy)]
struct Plan {
    at: HangUp,
    /// Pause before hanging up (`AfterBody`, `MidBody`).
    delay: Duration,
    /// Close with a TCP reset (`SO_LINGER` 0) instead of a FIN.
    reset: bool,
}

impl Plan {
    fn draw(rng: &mut Rng, call: Duration) -> Self {
        let at = match rng.below(100) {
            0..10 => HangUp::BeforeBody,
            10..20 => HangUp::MidBody,
            20..80 => HangUp::AfterBody,
            80..90 => HangUp::MidResponse,
            _ => HangUp::Never,
        };
        // Up to twice a call's measured duration, so most hang-ups land while the call
        // runs; drawn in thousandths of it, so a seed replays the same schedule.
        let permille = rng.below(2_000);
        Self {
            at,
            delay: call.mul_f64(permille as f64 / 1_000.0),
            reset: rng.chance(50),
        }
    }
}

/// A whole answer read from a socket.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

fn pay_request(addr: SocketAddr, order: &str, key: &str) -> (String, String) {
    let body = r#"{"amount_cents":1200}"#.to_owned();
    let head = format!(
        "POST /orders/{order}/pay HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    (head, body)
}

fn parse(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let replayed = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("idempotent-replayed: true"));
    Answer {
        status,
        replayed,
        body: body.to_owned(),
    }
}

/// Sends a request and reads the whole answer (bounded).
async fn send(addr: SocketAddr, head: &str, body: &str) -> Result<Answer, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        stream
            .write_all(format!("{head}{body}").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .map_err(|e| e.to_string())?;
        Ok(parse(&raw))
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| "no answer within 30 s".to_owned())?
}

/// Plays one client that hangs up as `plan` says; returns the answer when it read one.
async fn play(addr: SocketAddr, order: &str, key: &str, plan: Plan) -> Result<(), String> {
    let (head, body) = pay_request(addr, order, key);
    if plan.at == HangUp::Never {
        let answer = send(addr, &head, &body).await?;
        return match answer.status {
            200 => Ok(()),
            other => Err(format!("a patient client got {other}: {}", answer.body)),
        };
    }
    let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    match plan.at {
        HangUp::BeforeBody => {
            let _ = stream.write_all(head.as_bytes()).await;
        }
        HangUp::MidBody => {
            let half = &body[..body.len() / 2];
            let _ = stream.write_all(format!("{head}{half}").as_bytes()).await;
            tokio::time::sleep(plan.delay).await;
        }
        HangUp::AfterBody => {
            let _ = stream.write_all(format!("{head}{body}").as_bytes()).await;
            tokio::time::sleep(plan.delay).await;
        }
        HangUp::MidResponse => {
            let _ = stream.write_all(format!("{head}{body}").as_bytes()).await;
            let mut first = [0_u8; 12];
            let _ = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut first)).await;
        }
        HangUp::Never => unreachable!("answered above"),
    }
    if plan.reset {
        let _ = stream.set_zero_linger();
    }
    drop(stream);
    Ok(())
}

/// The ledger rows of the pay scope by state (the database is this test's own).
async fn pay_records(db: &DatabaseConnection) -> BTreeMap<i64, i64> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT state, COUNT(*) FROM idem_ledger WHERE scope = ? \
             GROUP BY state",
            vec!["shop.orders.pay".into()],
        ))
        .await
        .expect("ledger states");
    rows.iter()
        .map(|r| {
            (
                i64::from(r.try_get_by_index::<i16>(0).expect("state")),
                r.try_get_by_index::<i64>(1).expect("count"),
            )
        })
        .collect()
}

/// The recorded pay answers, by key.
async fn recorded_keys(db: &DatabaseConnection) -> BTreeMap<String, i64> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT idem_key, state FROM idem_ledger WHERE scope = ?",
            vec!["shop.orders.pay".into()],
        ))
        .await
        .expect("ledger keys");
    rows.iter()
        .map(|r| {
            (
                r.try_get_by_index::<String>(0).expect("key"),
                i64::from(r.try_get_by_index::<i16>(1).expect("state")),
            )
        })
        .collect()
}

/// Payment rows per order, and the payment id of each paid order.
async fn payments(db: &DatabaseConnection) -> BTreeMap<String, (i64, String)> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT order_id, COUNT(*), MIN(id) FROM shop_payments GROUP BY order_id",
            vec![],
        ))
        .await
        .expect("payments");
    rows.iter()
        .map(|r| {
            (
                r.try_get_by_index::<String>(0).expect("order"),
                (
                    r.try_get_by_index::<i64>(1).expect("count"),
                    r.try_get_by_index::<String>(2).expect("id"),
                ),
            )
        })
        .collect()
}

/// What the server sees of the app's pool once it is quiet: connections left inside a
/// transaction (PostgreSQL: sessions of the pool's `application_name` `idle in transaction`;
/// MariaDB: `@@in_transaction` on each pooled connection and InnoDB transactions of sleeping
/// sessions of the test's database), and connections that never came back (the pool cannot
/// hand out all of its connections at once).
#[derive(Debug, Default)]
struct PoolHealth {
    size: u32,
    idle: usize,
    acquired: usize,
    /// Server sessions the PostgreSQL check saw (so its filter is known to match the pool).
    sessions: i64,
    in_transaction: i64,
}

async fn pool_health(
    b: &Isolated,
    pool: &DatabaseConnection,
    app_name: &str,
    max: u32,
) -> PoolHealth {
    use sea_orm::sqlx;
    let acquire = Duration::from_secs(5);
    match b.name {
        "postgres" => {
            let raw = pool.get_postgres_connection_pool();
            let mut held = Vec::new();
            for _ in 0..max {
                match tokio::time::timeout(acquire, raw.acquire()).await {
                    Ok(Ok(mut c)) => {
                        // Its next use flushes a rollback sqlx may have queued on a drop.
                        sqlx::query("SELECT 1")
                            .execute(&mut *c)
                            .await
                            .expect("a usable connection");
                        held.push(c);
                    }
                    _ => break,
                }
            }
            let acquired = held.len();
            drop(held);
            tokio::time::sleep(Duration::from_millis(100)).await;
            let row =
                b.db.query_one_raw(stmt(
                    &b.db,
                    "SELECT COUNT(*), \
                     COUNT(CASE WHEN state LIKE 'idle in transaction%' THEN 1 END) \
                     FROM pg_stat_activity WHERE application_name = ?",
                    vec![app_name.into()],
                ))
                .await
                .expect("pg_stat_activity")
                .expect("a row");
            PoolHealth {
                size: raw.size(),
                idle: raw.num_idle(),
                acquired,
                sessions: row.try_get_by_index(0).expect("count"),
                in_transaction: row.try_get_by_index(1).expect("count"),
            }
        }
        "mysql" => {
            let raw = pool.get_mysql_connection_pool();
            let mut held = Vec::new();
            let mut in_transaction = 0;
            for _ in 0..max {
                match tokio::time::timeout(acquire, raw.acquire()).await {
                    Ok(Ok(mut c)) => {
                        let (flag,): (i64,) =
                            sqlx::query_as("SELECT CAST(@@in_transaction AS SIGNED)")
                                .fetch_one(&mut *c)
                                .await
                                .expect("a usable connection");
                        in_transaction += flag;
                        held.push(c);
                    }
                    _ => break,
                }
            }
            let acquired = held.len();
            drop(held);
            tokio::time::sleep(Duration::from_millis(100)).await;
            let database = b.url.rsplit_once('/').map_or("", |(_, db)| db).to_owned();
            let row =
                b.db.query_one_raw(stmt(
                    &b.db,
                    "SELECT COUNT(*) FROM information_schema.INNODB_TRX t \
                     JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
                     WHERE p.DB = ? AND p.COMMAND = 'Sleep'",
                    vec![database.into()],
                ))
                .await
                .expect("innodb_trx")
                .expect("a row");
            let sleeping: i64 = row.try_get_by_index(0).expect("count");
            PoolHealth {
                size: raw.size(),
                idle: raw.num_idle(),
                acquired,
                sessions: 0,
                in_transaction: in_transaction + sleeping,
            }
        }
        _ => {
            let raw = pool.get_sqlite_connection_pool();
            let acquired = match tokio::time::timeout(acquire, raw.acquire()).await {
                Ok(Ok(_)) => 1,
                _ => 0,
            };
            PoolHealth {
                size: raw.size(),
                idle: raw.num_idle(),
                acquired,
                sessions: 0,
                in_transaction: 0,
            }
        }
    }
}

/// Serves the payments app on an ephemeral port with a pool of at most `max` connections
/// (SQLite: one); the pool's PostgreSQL sessions carry `app_name`.
async fn serve(b: &Isolated, max: u32, app_name: &str) -> (SocketAddr, DatabaseConnection) {
    let url = match b.name {
        "postgres" => format!("{}&application_name={app_name}", b.url),
        _ => b.url.clone(),
    };
    let pool = crate::common::connect(&url, max).await;
    if b.name == "sqlite" {
        // Write-ahead log, synced at checkpoints: the SQLite run (one connection, the bugs
        // under test are the servers') stays within its time budget.
        for pragma in ["PRAGMA journal_mode = WAL", "PRAGMA synchronous = NORMAL"] {
            pool.execute_unprepared(pragma).await.expect(pragma);
        }
    }
    app::create_tables(&pool).await.expect("payments tables");
    let router = app::router(app::AppState {
        db: pool.clone(),
        gateway: app::Gateway::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    (addr, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_hanging_up_at_random_points_never_poison_the_pool() {
    let pays = if quick() { 300 } else { 1_000 };
    let clients = 32;
    let max = 8;
    let mut failures = Vec::new();
    for b in isolated().await {
        let started = Instant::now();
        let name = b.name;
        let app_name = unique("r13").replace('-', "_");
        let (addr, pool) = serve(&b, max, &app_name).await;
        let mut rng = Rng::new(&format!("r13 {name}"));

        // The orders, written directly; then one patient pay to measure a call.
        let orders: Vec<String> = (0..=pays).map(|i| format!("ord_{app_name}_{i}")).collect();
        for chunk in orders.chunks(200) {
            model::order::Entity::insert_many(chunk.iter().map(|id| model::order::ActiveModel {
                id: sea_orm::ActiveValue::Set(id.clone()),
                customer: sea_orm::ActiveValue::Set("c-1".to_owned()),
                amount_cents: sea_orm::ActiveValue::Set(1200),
                currency: sea_orm::ActiveValue::Set("usd".to_owned()),
                status: sea_orm::ActiveValue::Set(model::OrderStatus::Pending),
                version: sea_orm::ActiveValue::Set(0),
                note: sea_orm::ActiveValue::Set(None),
            }))
            .exec(&pool)
            .await
            .expect("orders");
        }
        let (head, body) = pay_request(addr, &orders[pays], &format!("{app_name}-warm"));
        let timed = Instant::now();
        let warm = send(addr, &head, &body).await.expect("a warm-up pay");
        assert_eq!(warm.status, 200, "{name}: {}", warm.body);
        let call = timed.elapsed();

        // The storm: `clients` at a time, each hanging up as its plan says.
        let keys: Vec<String> = (0..pays).map(|i| format!("{app_name}-k{i}")).collect();
        let plans: Vec<Plan> = (0..pays).map(|_| Plan::draw(&mut rng, call)).collect();
        let mut by_point = BTreeMap::<HangUp, usize>::new();
        for p in &plans {
            *by_point.entry(p.at).or_default() += 1;
        }
        let storm = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..clients {
            let (next, orders, keys, plans) =
                (next.clone(), orders.clone(), keys.clone(), plans.clone());
            tasks.spawn(async move {
                let mut errors = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= keys.len() {
                        break errors;
                    }
                    if let Err(e) = play(addr, &orders[i], &keys[i], plans[i]).await {
                        errors.push(format!("{}: {e}", keys[i]));
                    }
                }
            });
        }
        let client_errors: Vec<String> = tasks.join_all().await.concat();
        let storm_took = storm.elapsed();
        if !client_errors.is_empty() {
            failures.push(format!(
                "{name}: {} clients that waited got no 200: {:?}",
                client_errors.len(),
                &client_errors[..client_errors.len().min(5)]
            ));
        }

        // Quiet: every call that started must finish (its lease completes) within 10 s.
        let quiet = Instant::now();
        let mut states = pay_records(&pool).await;
        while states.get(&0).copied().unwrap_or(0) > 0 && quiet.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            states = pay_records(&pool).await;
        }
        let unfinished = states.get(&0).copied().unwrap_or(0);
        let recorded = recorded_keys(&pool).await;
        let completed_before_retry = keys.iter().filter(|k| recorded.get(*k) == Some(&1)).count();
        if unfinished > 0 {
            failures.push(format!(
                "{name}: {unfinished} calls started and left unfinished (lease still held)"
            ));
        }

        // The pool: nothing left in a transaction, nothing lost, N requests at once served.
        let health = pool_health(&b, &pool, &app_name, max).await;
        let expected = if name == "sqlite" { 1 } else { max as usize };
        if name == "postgres" && health.sessions == 0 {
            failures.push(format!(
                "{name}: no session carries application_name {app_name}: the check saw nothing"
            ));
        }
        if health.in_transaction != 0 {
            failures.push(format!(
                "{name}: {} pooled connections left inside a transaction",
                health.in_transaction
            ));
        }
        if health.acquired != expected {
            failures.push(format!(
                "{name}: only {} of {expected} pooled connections could be acquired (lost)",
                health.acquired
            ));
        }
        let concurrent = {
            let mut tasks = tokio::task::JoinSet::new();
            for order in orders.iter().take(expected * 2) {
                let head = format!(
                    "GET /orders/{order} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
                );
                tasks.spawn(async move { send(addr, &head, "").await.map(|a| a.status) });
            }
            tasks.join_all().await
        };
        let served = concurrent.iter().filter(|r| **r == Ok(200)).count();
        if served != concurrent.len() {
            failures.push(format!(
                "{name}: {served} of {} concurrent GETs served: {concurrent:?}",
                concurrent.len()
            ));
        }

        // Payments before the retries: never two for an order.
        let paid_before = payments(&pool).await;
        let doubled = paid_before.values().filter(|(n, _)| *n > 1).count();
        if doubled > 0 {
            failures.push(format!("{name}: {doubled} orders paid twice"));
        }

        // The retries (skipped when calls were left unfinished: each would wait out its lease).
        let mut replay_mismatch = Vec::new();
        let (mut replayed_first, mut executed_first) = (0, 0);
        if unfinished == 0 {
            let mut firsts = BTreeMap::new();
            for round in 0..2 {
                let next = Arc::new(AtomicUsize::new(0));
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..clients {
                    let (next, orders, keys) = (next.clone(), orders.clone(), keys.clone());
                    tasks.spawn(async move {
                        let mut answers = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::SeqCst);
                            if i >= keys.len() {
                                break answers;
                            }
                            let (head, body) = pay_request(addr, &orders[i], &keys[i]);
                            answers.push((i, send(addr, &head, &body).await));
                        }
                    });
                }
                for (i, answer) in tasks.join_all().await.into_iter().flatten() {
                    let key = &keys[i];
                    let answer = match answer {
                        Ok(a) if a.status == 200 => a,
                        other => {
                            replay_mismatch.push(format!("{key} round {round}: {other:?}"));
                            continue;
                        }
                    };
                    let was_recorded = recorded.get(key) == Some(&1);
                    if round == 0 {
                        if was_recorded && !answer.replayed {
                            replay_mismatch
                                .push(format!("{key}: recorded before, but not replayed"));
                        }
                        if answer.replayed {
                            replayed_first += 1;
                        } else {
                            executed_first += 1;
                        }
                        firsts.insert(i, answer);
                    } else {
                        let first = firsts.get(&i).map(|a| (a.status, a.body.as_str()));
                        if !answer.replayed || first != Some((answer.status, &answer.body)) {
                            replay_mismatch.push(format!(
                                "{key}: the second retry {answer:?} is not a replay of {first:?}"
                            ));
                        }
                    }
                }
            }
            // Each answer names the order's one payment.
            let paid = payments(&pool).await;
            for (i, answer) in &firsts {
                let Some((_, id)) = paid.get(&orders[*i]) else {
                    replay_mismatch.push(format!("{}: no payment row", orders[*i]));
                    continue;
                };
                if !answer.body.contains(id.as_str()) {
                    replay_mismatch.push(format!(
                        "{}: answer {} names another payment",
                        keys[*i], answer.body
                    ));
                }
            }
        }
        if !replay_mismatch.is_empty() {
            failures.push(format!(
                "{name}: {} retries did not replay as they should: {:?}",
                replay_mismatch.len(),
                &replay_mismatch[..replay_mismatch.len().min(5)]
            ));
        }
        let paid = payments(&pool).await;
        let paid_orders = paid.keys().filter(|o| orders[..pays].contains(o)).count();
        let paid_twice = paid.values().filter(|(n, _)| *n != 1).count();
        if unfinished == 0 && (paid_orders != pays || paid_twice != 0) {
            failures.push(format!(
                "{name}: {paid_orders} of {pays} orders paid, {paid_twice} not exactly once"
            ));
        }
        eprintln!(
            "R13 {name}: {pays} pays by {clients} clients in {storm_took:.1?} (a call ≈ {call:.1?}); \
             hang-ups {by_point:?}; completed before any retry {completed_before_retry}, \
             left unfinished {unfinished}; pool size {} idle {} acquired {}/{expected}, \
             server sessions seen {}, in transaction {}; concurrent GETs {served}/{}; first retries replayed \
             {replayed_first}, executed {executed_first}; orders paid {paid_orders}, \
             not exactly once {paid_twice}; {:.1?}",
            health.size,
            health.idle,
            health.acquired,
            health.sessions,
            health.in_transaction,
            concurrent.len(),
            started.elapsed()
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
