//! A MariaDB Galera cluster, across its nodes: duplicates sent to different nodes end as one
//! execution and its replays (never a 503, never a 409 while the first call already
//! finished), in atomic and lease mode; a node killed mid-storm loses and doubles nothing,
//! and the surviving nodes keep answering.
//!
//! Runs when `IDEM_TEST_GALERA_URLS` names the nodes (comma-separated, e.g. what
//! `scripts/galera urls` prints after `scripts/galera start`); a named node that cannot be
//! reached FAILS the test. Unset, every test here returns at once. The node-kill test drives
//! the cluster with `scripts/galera` and restarts the node it killed.
//!
//! `IDEM_TEST_GALERA_NO_RETRY=1` turns conflict retries off
//! (`idem::conflict::set_max_attempts(1)`) in the duplicate storms: the control that shows
//! they fail without them.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, Statement, Value};
use serde::{Deserialize, Serialize};

use common::{connect, unique};

const URLS: &str = "IDEM_TEST_GALERA_URLS";
/// Keys per storm, and concurrent duplicates of each.
const KEYS: usize = 50;
const DUPLICATES: usize = 10;
/// Keys whose duplicates run at once (a wave), so pools and nodes stay within limits.
const WAVE: usize = 10;

/// The cluster's nodes, one pool each (a service per node), or `None` when no cluster is
/// named.
async fn nodes() -> Option<Vec<DatabaseConnection>> {
    let urls = std::env::var(URLS).ok()?;
    let mut nodes = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        nodes.push(connect(url, 24).await);
    }
    assert!(
        nodes.len() >= 2,
        "{URLS} names {} node(s); at least 2 are needed",
        nodes.len()
    );
    prepare(&nodes[0]).await;
    Some(nodes)
}

/// The tables, made through one node (and only those missing: DDL on a live table aborts
/// every transaction writing to it, cluster-wide).
async fn prepare(db: &DatabaseConnection) {
    common::prepare_with(
        db,
        &[
            "CREATE TABLE IF NOT EXISTS galera_orders (run_id VARCHAR(100) NOT NULL, \
             k VARCHAR(100) NOT NULL, state VARCHAR(16) NOT NULL, execution VARCHAR(120) NULL, \
             PRIMARY KEY (run_id, k))",
            "CREATE TABLE IF NOT EXISTS galera_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             run_id VARCHAR(100) NOT NULL, k VARCHAR(100) NOT NULL, what VARCHAR(16) NOT NULL, \
             execution VARCHAR(120) NOT NULL, INDEX (run_id))",
        ],
    )
    .await;
}

#[derive(Debug)]
enum TestError {
    Idem(idem::Error),
    Db(DbErr),
}

impl std::fmt::Display for TestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Idem(e) => e.fmt(f),
            Self::Db(e) => write!(f, "database: {e}"),
        }
    }
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl From<DbErr> for TestError {
    fn from(e: DbErr) -> Self {
        Self::Db(e)
    }
}

/// What a call answered: the execution that produced it (a replay carries the first's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Paid {
    key: String,
    execution: String,
}

async fn exec<C: ConnectionTrait>(db: &C, sql: &str, values: Vec<Value>) -> Result<u64, DbErr> {
    let statement = Statement::from_sql_and_values(db.get_database_backend(), sql, values);
    Ok(db.execute_raw(statement).await?.rows_affected())
}

async fn count(db: &DatabaseConnection, sql: &str, values: Vec<Value>) -> i64 {
    let statement = Statement::from_sql_and_values(db.get_database_backend(), sql, values);
    let row = db
        .query_one_raw(statement)
        .await
        .expect("count")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("a count")
}

/// The order goes Pending -> Paid (`why` it must be pending) and a payment row is written, on
/// `db`: both modes' database effects.
async fn record_payment<C: ConnectionTrait>(
    db: &C,
    run: &str,
    key: &str,
    execution: &str,
    why: &str,
) -> Result<(), TestError> {
    let paid = exec(
        db,
        "UPDATE galera_orders SET state = 'paid', execution = ? \
         WHERE run_id = ? AND k = ? AND state = 'pending'",
        vec![execution.into(), run.into(), key.into()],
    )
    .await?;
    if paid != 1 {
        panic!(
            "{why} (this execution: {execution}): {}",
            why_not_pending(db, run, key).await
        );
    }
    exec(
        db,
        "INSERT INTO galera_effects (run_id, k, what, execution) VALUES (?, ?, 'payment', ?)",
        vec![run.into(), key.into(), execution.into()],
    )
    .await?;
    Ok(())
}

/// What `db` sees of key `key` when its order was not pending: the order, its effects, the
/// ledger row and its steps (the final phase's `execution` names the holder's token).
async fn why_not_pending<C: ConnectionTrait>(db: &C, run: &str, key: &str) -> String {
    let of_run_and_key = || vec![Value::from(run), Value::from(key)];
    let of_key = || vec![Value::from(key)];
    let mut seen = Vec::new();
    for (what, sql, values) in [
        (
            "order",
            "SELECT CONCAT(state, ' ', COALESCE(execution, '-')) FROM galera_orders \
             WHERE run_id = ? AND k = ?",
            of_run_and_key(),
        ),
        (
            "effects",
            "SELECT CONCAT(id, ' ', what, ' ', execution) FROM galera_effects \
             WHERE run_id = ? AND k = ? ORDER BY id",
            of_run_and_key(),
        ),
        (
            "ledger",
            "SELECT CONCAT('owner ', owner, ' state ', state, ' expires in ', \
             expires_at_ms - ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000), ' ms') FROM idem_ledger \
             WHERE idem_key = ?",
            of_key(),
        ),
        (
            "steps",
            "SELECT CONCAT(s.name, ' token ', s.token) FROM idem_steps s \
             JOIN idem_ledger l ON l.id = s.record_id WHERE l.idem_key = ?",
            of_key(),
        ),
    ] {
        let statement = Statement::from_sql_and_values(db.get_database_backend(), sql, values);
        let rows = match db.query_all_raw(statement).await {
            Ok(rows) => rows
                .iter()
                .map(|row| row.try_get_by_index::<String>(0).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("; "),
            Err(e) => format!("unread: {e}"),
        };
        seen.push(format!("{what}: [{rows}]"));
    }
    seen.join(", ")
}

/// Atomic mode: the order goes Pending -> Paid and a payment row is written, in the claim's
/// transaction.
#[idempotent(scope = "galera.orders.pay", key = key)]
async fn pay_atomic(db: &DatabaseConnection, key: String, run: String) -> Result<Paid, TestError> {
    let execution = unique("exec");
    record_payment(
        db,
        &run,
        &key,
        &execution,
        "an execution always finds its order pending",
    )
    .await?;
    Ok(Paid { key, execution })
}

/// The "gateway" of lease mode: every charge it is asked for is a row, so a doubled charge
/// shows. Its rows are written through a live node, which stalls while the cluster evicts a
/// dead one (about 5 s): how long a call spent in it is counted apart from idem's own time.
#[derive(Debug, Clone)]
struct Gateway {
    db: DatabaseConnection,
    run: String,
    /// Time spent in `charge`, in microseconds, by the calls sharing this clone.
    spent_us: Arc<std::sync::atomic::AtomicU64>,
}

impl Gateway {
    fn new(db: DatabaseConnection, run: &str) -> Self {
        Gateway {
            db,
            run: run.to_owned(),
            spent_us: Arc::default(),
        }
    }

    /// The same gateway with a clock of its own, for one call.
    fn timed(&self) -> Self {
        Gateway::new(self.db.clone(), &self.run)
    }

    fn spent(&self) -> Duration {
        Duration::from_micros(self.spent_us.load(std::sync::atomic::Ordering::SeqCst))
    }

    async fn charge(&self, key: &str, charge_key: String) -> Result<String, TestError> {
        let started = Instant::now();
        let charged = self.write_charge(key, &charge_key).await;
        let spent = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.spent_us
            .fetch_add(spent, std::sync::atomic::Ordering::SeqCst);
        charged.map(|()| charge_key)
    }

    async fn write_charge(&self, key: &str, charge_key: &str) -> Result<(), TestError> {
        exec(
            &self.db,
            "INSERT INTO galera_effects (run_id, k, what, execution) VALUES (?, ?, 'charge', ?)",
            vec![self.run.clone().into(), key.into(), charge_key.into()],
        )
        .await?;
        Ok(())
    }
}

/// Lease mode: a charge at the gateway (a step), then the order's transition and the payment
/// row in the final phase, recorded with the result.
#[idempotent(scope = "galera.orders.charge", key = key, lease = "3s", on_concurrent = wait("5s"), skip(gateway))]
async fn pay_lease(
    db: &DatabaseConnection,
    gateway: &Gateway,
    key: String,
    run: String,
) -> Result<Paid, TestError> {
    let charged = idem::step("charge", |charge_key| gateway.charge(&key, charge_key)).await?;
    // The holder's token in the order's row, for a failure to name who paid it.
    let token = idem::lease::LeaseHandle::current("pay_lease")?
        .ticket()
        .token;
    idem::sea_orm::finish(db, "record-payment", move |tx| {
        Box::pin(async move {
            let execution = format!("{charged} token {token}");
            record_payment(tx, &run, &key, &execution, "the final phase runs once").await?;
            Ok(Paid {
                key,
                execution: charged,
            })
        })
    })
    .await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Atomic,
    Lease,
}

/// One request's answer, as a client sees it.
#[derive(Debug)]
struct Answer {
    key: String,
    node: usize,
    result: Result<Paid, String>,
    /// HTTP status the answer maps to (200 for a value).
    status: u16,
    conflict_retries: u32,
    latency: Duration,
    /// Of `latency`, the time spent at the gateway (lease mode's charge).
    in_gateway: Duration,
}

async fn call(
    mode: Mode,
    db: &DatabaseConnection,
    gateway: &Gateway,
    key: &str,
    run: &str,
) -> Answer {
    let gateway = &gateway.timed();
    let started = Instant::now();
    let (result, report) = idem::conflict::with_report(async {
        match mode {
            Mode::Atomic => pay_atomic(db, key.to_owned(), run.to_owned()).await,
            Mode::Lease => pay_lease(db, gateway, key.to_owned(), run.to_owned()).await,
        }
    })
    .await;
    let status = match &result {
        Ok(_) => 200,
        Err(TestError::Idem(e)) => e.http_status(),
        // The body's own statement failed (its node killed under it): nothing committed, and
        // the service answers as the shop example does, 503, so the client retries elsewhere.
        Err(TestError::Db(_)) => 503,
    };
    Answer {
        key: key.to_owned(),
        node: 0,
        result: result.map_err(|e| e.to_string()),
        status,
        conflict_retries: report.conflict_retries,
        latency: started.elapsed(),
        in_gateway: gateway.spent(),
    }
}

/// Sends `DUPLICATES` concurrent requests for each of `KEYS` keys, spread over the nodes,
/// a wave of keys at a time.
async fn storm(
    mode: Mode,
    nodes: &[DatabaseConnection],
    run: &str,
    keys: &[String],
) -> Vec<Answer> {
    let gateways: Vec<Gateway> = nodes
        .iter()
        .map(|db| Gateway::new(db.clone(), run))
        .collect();
    let mut answers = Vec::new();
    for wave in keys.chunks(WAVE) {
        let mut set = tokio::task::JoinSet::new();
        for key in wave {
            for duplicate in 0..DUPLICATES {
                let node = duplicate % nodes.len();
                let (db, gateway) = (nodes[node].clone(), gateways[node].clone());
                let (key, run) = (key.clone(), run.to_owned());
                set.spawn(async move {
                    let mut answer = call(mode, &db, &gateway, &key, &run).await;
                    answer.node = node;
                    answer
                });
            }
        }
        while let Some(answer) = set.join_next().await {
            answers.push(answer.expect("a request task"));
        }
    }
    answers
}

async fn seed_orders(db: &DatabaseConnection, run: &str, keys: &[String]) {
    for key in keys {
        exec(
            db,
            "INSERT INTO galera_orders (run_id, k, state) VALUES (?, ?, 'pending')",
            vec![run.into(), key.clone().into()],
        )
        .await
        .expect("seed an order");
    }
}

/// What the database holds for a run, read through `db`: effects of `what` per key (with
/// `distinct`, counted once per execution id: a gateway deduplicates by the charge's key).
async fn effects_per_key(
    db: &DatabaseConnection,
    run: &str,
    what: &str,
    distinct: bool,
) -> BTreeMap<String, i64> {
    let counted = if distinct { "DISTINCT execution" } else { "*" };
    let statement = Statement::from_sql_and_values(
        db.get_database_backend(),
        format!(
            "SELECT k, COUNT({counted}) FROM galera_effects WHERE run_id = ? AND what = ? GROUP BY k"
        ),
        vec![run.into(), what.into()],
    );
    db.query_all_raw(statement)
        .await
        .expect("effects")
        .iter()
        .map(|row| {
            (
                row.try_get_by_index::<String>(0).expect("k"),
                row.try_get_by_index::<i64>(1).expect("n"),
            )
        })
        .collect()
}

fn percentile<T: Copy + Ord>(values: &mut [T], p: f64) -> T {
    values.sort_unstable();
    let at = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[at]
}

/// Prints what the storm cost: statuses, conflict retries per request, latency.
fn report(label: &str, answers: &[Answer]) {
    let mut statuses = BTreeMap::new();
    for a in answers {
        *statuses.entry(a.status).or_insert(0) += 1;
    }
    let mut retries: Vec<u32> = answers.iter().map(|a| a.conflict_retries).collect();
    let retried = retries.iter().filter(|&&r| r > 0).count();
    let mut latency: Vec<Duration> = answers.iter().map(|a| a.latency).collect();
    let mut retried_latency: Vec<Duration> = answers
        .iter()
        .filter(|a| a.conflict_retries > 0)
        .map(|a| a.latency)
        .collect();
    println!(
        "{label}: {} requests, statuses {statuses:?}; conflict retries per request p50 {} p99 {} max {} ({retried} requests retried); latency p50 {:?} p99 {:?}; retried requests p50 {:?}",
        answers.len(),
        percentile(&mut retries, 0.5),
        percentile(&mut retries, 0.99),
        retries.iter().max().copied().unwrap_or(0),
        percentile(&mut latency, 0.5),
        percentile(&mut latency, 0.99),
        if retried_latency.is_empty() {
            Duration::ZERO
        } else {
            percentile(&mut retried_latency, 0.5)
        },
    );
}

/// Every answer is the key's one execution (its first result or a replay), and the database
/// holds exactly one of each effect per key. With `gateway_dedupes`, charges count once per
/// charge key (a takeover after a crash between a charge and its record charges again under
/// the same key, which the gateway deduplicates).
async fn assert_exactly_once(
    mode: Mode,
    db: &DatabaseConnection,
    run: &str,
    keys: &[String],
    answers: &[Answer],
    gateway_dedupes: bool,
) {
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.result.is_err()).collect();
    assert!(
        refused.is_empty(),
        "{mode:?}: {} of {} requests were not answered with the result: {:#?}",
        refused.len(),
        answers.len(),
        refused.iter().take(5).collect::<Vec<_>>()
    );
    let mut per_key: BTreeMap<&str, HashSet<&str>> = BTreeMap::new();
    for a in answers {
        let paid = a.result.as_ref().expect("checked above");
        assert_eq!(paid.key, a.key);
        per_key.entry(&a.key).or_default().insert(&paid.execution);
    }
    for (key, executions) in &per_key {
        assert_eq!(
            executions.len(),
            1,
            "{mode:?}: key {key} answered with {executions:?}"
        );
    }
    let whats: &[&str] = match mode {
        Mode::Atomic => &["payment"],
        Mode::Lease => &["payment", "charge"],
    };
    for what in whats {
        let effects = effects_per_key(db, run, what, gateway_dedupes && *what == "charge").await;
        let wrong: Vec<_> = keys
            .iter()
            .filter(|k| effects.get(*k).copied() != Some(1))
            .map(|k| (k, effects.get(k).copied().unwrap_or(0)))
            .collect();
        assert!(
            wrong.is_empty(),
            "{mode:?}: keys without exactly one {what}: {wrong:?}"
        );
    }
    let paid = count(
        db,
        "SELECT COUNT(*) FROM galera_orders WHERE run_id = ? AND state = 'paid'",
        vec![run.into()],
    )
    .await;
    assert_eq!(paid, keys.len() as i64, "{mode:?}: every order paid once");
}

async fn duplicates_through_two_nodes(mode: Mode) {
    let Some(nodes) = nodes().await else {
        eprintln!("{URLS} is not set: no cluster to test");
        return;
    };
    // The control: with retrying turned off these tests must fail (conflicts reach clients).
    if std::env::var("IDEM_TEST_GALERA_NO_RETRY").is_ok_and(|v| v == "1") {
        idem::conflict::set_max_attempts(1);
    }
    let two = &nodes[..2];
    let run = unique("galera");
    let keys: Vec<String> = (0..KEYS).map(|i| format!("{run}-k{i}")).collect();
    seed_orders(&two[0], &run, &keys).await;
    let answers = storm(mode, two, &run, &keys).await;
    report(&format!("{mode:?} mode, 2 nodes"), &answers);
    assert_exactly_once(mode, &two[1], &run, &keys, &answers, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn atomic_duplicates_through_two_nodes_end_as_one_execution_and_replays() {
    duplicates_through_two_nodes(Mode::Atomic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_duplicates_through_two_nodes_end_as_one_execution_and_replays() {
    duplicates_through_two_nodes(Mode::Lease).await;
}

const GALERA_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/galera");

/// Runs `scripts/galera` with `args`.
fn cluster(args: &[&str]) {
    let status = std::process::Command::new(GALERA_SCRIPT)
        .args(args)
        .status()
        .expect("run scripts/galera");
    assert!(status.success(), "scripts/galera {args:?} failed: {status}");
}

/// A node SIGKILLed in the middle of a storm through all three: the surviving nodes keep
/// answering (a request on the dead node is told `503` promptly, and its client retries on
/// another node, as behind a load balancer; a `409` is retried after a pause); nothing is
/// lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_mid_storm_loses_and_doubles_nothing() {
    if std::env::var(URLS).is_ok() {
        // Every node up (a node an earlier, failed run killed is started again).
        cluster(&["start"]);
    }
    let Some(nodes) = nodes().await else {
        eprintln!("{URLS} is not set: no cluster to test");
        return;
    };
    assert!(nodes.len() >= 3, "the node-kill test needs three nodes");
    let nodes = Arc::new(nodes);
    let victim = nodes.len(); // scripts/galera numbers nodes from 1
    for mode in [Mode::Atomic, Mode::Lease] {
        let run = unique("galera-kill");
        let keys: Vec<String> = (0..KEYS).map(|i| format!("{run}-k{i}")).collect();
        seed_orders(&nodes[0], &run, &keys).await;
        // The gateway is outside the cluster: it does not die with a node.
        let gateway = Gateway::new(nodes[0].clone(), &run);
        let started = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for (i, key) in keys.iter().enumerate() {
            for duplicate in 0..DUPLICATES {
                let (nodes, gateway) = (Arc::clone(&nodes), gateway.clone());
                let (key, run) = (key.clone(), run.clone());
                // Spread over a second, so the kill lands mid-storm.
                let start_after = Duration::from_millis((i * 1000 / KEYS) as u64);
                set.spawn(async move {
                    tokio::time::sleep(start_after).await;
                    let mut node = (i + duplicate) % nodes.len();
                    let mut answers: Vec<Answer> = Vec::new();
                    // A client: a 503 goes to the next node at once, a 409 after a pause.
                    for _ in 0..60 {
                        let mut answer = call(mode, &nodes[node], &gateway, &key, &run).await;
                        answer.node = node;
                        let status = answer.status;
                        answers.push(answer);
                        match status {
                            503 => node = (node + 1) % nodes.len(),
                            409 => tokio::time::sleep(Duration::from_millis(500)).await,
                            _ => break,
                        }
                    }
                    answers
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        let killed_at = started.elapsed();
        // Returns once the other nodes have evicted the dead one (about 6 s).
        cluster(&["kill", &victim.to_string()]);
        let _restart = RestartOnDrop(victim);
        let mut answers = Vec::new();
        let mut last = Vec::new();
        while let Some(client) = set.join_next().await {
            let mut client = client.expect("a client");
            last.extend(client.pop());
            answers.extend(client);
        }
        let outages: Vec<&Answer> = answers
            .iter()
            .chain(&last)
            .filter(|a| a.node == victim - 1 && a.status == 503)
            .collect();
        // Idem's part of an outage's answer: a charge at the gateway (a live node) waits while
        // the cluster evicts the dead node, before the step is recorded on the dead one.
        let slowest_outage = outages
            .iter()
            .map(|a| a.latency.saturating_sub(a.in_gateway))
            .max()
            .unwrap_or_default();
        let slowest_with_gateway = outages.iter().map(|a| a.latency).max().unwrap_or_default();
        let stalled_at_gateway = outages
            .iter()
            .filter(|a| a.in_gateway > Duration::from_secs(1))
            .count();
        let mut statuses = BTreeMap::new();
        for a in answers.iter().chain(&last) {
            *statuses.entry(a.status).or_insert(0) += 1;
        }
        println!(
            "{mode:?} mode, 3 nodes, node {victim} killed at {killed_at:?}: {} requests from {} clients, statuses {statuses:?}; {} answers from the dead node were 503, the slowest after {slowest_with_gateway:?} ({slowest_outage:?} outside the gateway; {stalled_at_gateway} waited over 1 s at the gateway)",
            answers.len() + last.len(),
            last.len(),
            outages.len()
        );
        report(&format!("{mode:?} mode, each client's last answer"), &last);
        assert_exactly_once(mode, &nodes[0], &run, &keys, &last, true).await;
        // A dead node is an outage, told within the connection wait (5 s) and a margin, once:
        // a release awaited after a failed step would wait it out a second time.
        assert!(
            slowest_outage < Duration::from_secs(8),
            "{mode:?}: the dead node took {slowest_outage:?} outside the gateway to answer 503"
        );
    }
}

/// Starts a killed node again when dropped, also when the test fails after the kill: the
/// tests that run after it need every node.
struct RestartOnDrop(usize);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        let node = self.0.to_string();
        if std::thread::panicking() {
            // A second panic would abort the test binary: a failed start is only printed.
            let started = std::process::Command::new(GALERA_SCRIPT)
                .args(["start-node", &node])
                .status();
            eprintln!("restarting node {node} after the failure: {started:?}");
        } else {
            cluster(&["start-node", &node]);
        }
    }
}

/// One staged event: staged by an atomic-mode call, one per key.
#[idempotent(scope = "galera.events.stage", key = key)]
async fn stage_event(
    db: &DatabaseConnection,
    key: String,
    aggregate: String,
) -> Result<String, TestError> {
    use idem::sea_orm::Outbox;
    let message = idem::outbox::Message::new("galera.events", key.clone().into_bytes());
    Ok(db.stage(message.aggregate(aggregate)).await?)
}

/// Relays on every node: each staged message reaches the sink at least once; deduplicated
/// by its id (what JetStream does with `Nats-Msg-Id`) each arrives once; and the messages
/// of every aggregate first arrive in commit order, whichever relay sent them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_on_every_node_deliver_everything_in_order_per_aggregate() {
    const AGGREGATES: usize = 24;
    const PER_AGGREGATE: usize = 20;
    let Ok(urls) = std::env::var(URLS) else {
        eprintln!("{URLS} is not set: no cluster to test");
        return;
    };
    // An outbox of the test's own: a relay claims every message of its table.
    let urls: Vec<&str> = urls.split(',').map(str::trim).collect();
    let database = unique("galera_relay").replace('-', "_");
    connect(urls[0], 2)
        .await
        .execute_unprepared(&format!("CREATE DATABASE {database}"))
        .await
        .expect("create the test's database");
    let mut nodes = Vec::new();
    for url in &urls {
        let base = url.rsplit_once('/').map_or(*url, |(base, _)| base);
        nodes.push(connect(&format!("{base}/{database}"), 16).await);
    }
    idem::sea_orm::create_tables(&nodes[0])
        .await
        .expect("tables");

    let delivered = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = {
        let delivered = Arc::clone(&delivered);
        idem::outbox::FnSink::new(move |message: idem::outbox::OutboxMessage| {
            let delivered = Arc::clone(&delivered);
            async move {
                delivered.lock().expect("sink").push(message);
                Ok(())
            }
        })
    };
    let sink = Arc::new(sink);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let relays: Vec<_> = nodes
        .iter()
        .map(|db| {
            let relay = idem::sea_orm::Relay::new(db.clone(), Arc::clone(&sink))
                .batch_size(8)
                .lease(Duration::from_secs(5))
                .poll_interval(Duration::from_millis(20));
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                relay
                    .run(async move {
                        let _ = stopped.wait_for(|stop| *stop).await;
                    })
                    .await
                    .map(|()| relay.counters().published)
            })
        })
        .collect();

    // Stage while the relays run: the calls of one aggregate one after another (their order
    // is the aggregate's), through alternating nodes; aggregates at once.
    let mut staging = tokio::task::JoinSet::new();
    for a in 0..AGGREGATES {
        let nodes = nodes.clone();
        let aggregate = format!("agg-{a}");
        staging.spawn(async move {
            let mut ids = Vec::new();
            for m in 0..PER_AGGREGATE {
                let db = &nodes[(a + m) % 2];
                let key = format!("{aggregate}-m{m}");
                let id = stage_event(db, key, aggregate.clone())
                    .await
                    .expect("a staging call is answered");
                ids.push(id);
            }
            (aggregate, ids)
        });
    }
    let mut staged = BTreeMap::new();
    while let Some(done) = staging.join_next().await {
        let (aggregate, ids) = done.expect("a staging task");
        staged.insert(aggregate, ids);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let health = idem::sea_orm::outbox_health(&nodes[0])
            .await
            .expect("health");
        if health.pending == 0 {
            assert_eq!(health.dead, 0, "no message died");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} messages still pending",
            health.pending
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(true).expect("relays listening");
    let mut published_by_relay = Vec::new();
    for relay in relays {
        published_by_relay.push(
            relay
                .await
                .expect("a relay task")
                .expect("a relay ends cleanly"),
        );
    }

    let delivered = delivered.lock().expect("sink").clone();
    let total = AGGREGATES * PER_AGGREGATE;
    let mut first_seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen = HashSet::new();
    for message in &delivered {
        if seen.insert(message.id.clone()) {
            let aggregate = message.aggregate.clone().expect("an aggregate");
            first_seen
                .entry(aggregate)
                .or_default()
                .push(message.id.clone());
        }
    }
    println!(
        "relays on {} nodes: {total} messages staged, {} deliveries, {} duplicates (removed by id); published per relay {published_by_relay:?}",
        nodes.len(),
        delivered.len(),
        delivered.len() - seen.len()
    );
    assert_eq!(seen.len(), total, "every staged message was delivered");
    assert_eq!(
        first_seen, staged,
        "each aggregate's messages first arrived in commit order"
    );
    nodes[0]
        .execute_unprepared(&format!("DROP DATABASE {database}"))
        .await
        .expect("drop the test's database");
}

/// What a claim costs on a node: 200 first calls one after another, then their replays, each
/// answered once (`IDEM_GALERA_SYNC_WAIT=0` measures it without the causal wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_calls_on_one_node_answer_once_each() {
    const CALLS: usize = 200;
    let Some(nodes) = nodes().await else {
        eprintln!("{URLS} is not set: no cluster to test");
        return;
    };
    let run = unique("galera-seq");
    let keys: Vec<String> = (0..CALLS).map(|i| format!("{run}-k{i}")).collect();
    seed_orders(&nodes[0], &run, &keys).await;
    let gateway = Gateway::new(nodes[0].clone(), &run);
    let mut first = Vec::new();
    let mut replay = Vec::new();
    for (latencies, pass) in [(&mut first, "first"), (&mut replay, "replay")] {
        for key in &keys {
            let answer = call(Mode::Atomic, &nodes[0], &gateway, key, &run).await;
            assert_eq!(answer.status, 200, "{pass}: {:?}", answer.result);
            latencies.push(answer.latency);
        }
    }
    println!(
        "one node, {CALLS} sequential calls (sync wait {}): first p50 {:?} p99 {:?}; replay p50 {:?} p99 {:?}",
        std::env::var("IDEM_GALERA_SYNC_WAIT").unwrap_or_else(|_| "on".to_owned()),
        percentile(&mut first, 0.5),
        percentile(&mut first, 0.99),
        percentile(&mut replay, 0.5),
        percentile(&mut replay, 0.99),
    );
    assert_exactly_once(Mode::Atomic, &nodes[1], &run, &keys, &[], false).await;
}

/// Where a paced lease-mode call is held, and what it writes when let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FencedWrite {
    /// A step ([`idem::step`]): its record is fenced by the lease.
    Step,
    /// A final phase committed alone (the handler works on after it): its writes, fenced.
    PhaseCommittedAlone,
}

/// The test's hold on a paced call: the call waits for `go` before its fenced write, says
/// `written` once it has committed, and returns at `end`.
#[derive(Default)]
struct Pace {
    go: tokio::sync::Notify,
    written: tokio::sync::Notify,
    end: tokio::sync::Notify,
}

/// A lease-mode call paced by the test ([`Pace`]): one fenced write, `what`, of an effect row.
#[idempotent(scope = "galera.fence", key = key, lease = "30s", skip(what, pace))]
async fn paced(
    db: &DatabaseConnection,
    key: String,
    run: String,
    what: FencedWrite,
    pace: &Pace,
) -> Result<(), TestError> {
    pace.go.notified().await;
    match what {
        FencedWrite::Step => {
            idem::step("charge", |_| async { Ok::<_, TestError>(1) }).await?;
        }
        FencedWrite::PhaseCommittedAlone => {
            let (run, key) = (run.clone(), key.clone());
            idem::sea_orm::finish(db, "pay", move |tx| {
                Box::pin(async move {
                    exec(
                        tx,
                        "INSERT INTO galera_effects (run_id, k, what, execution) \
                         VALUES (?, ?, 'payment', 'paced')",
                        vec![run.into(), key.into()],
                    )
                    .await?;
                    Ok::<_, TestError>(())
                })
            })
            .await?;
            // Past the open phase's fuse (50 ms): the phase commits alone.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    pace.written.notify_one();
    pace.end.notified().await;
    Ok(())
}

/// A Galera node certifies a transaction by the rows it writes, never by the locks it read
/// under: a lease's fenced write on one node must conflict with a takeover on another node
/// that read the ledger row before that write committed, or both commit and the new holder
/// runs again what the old one just wrote (seen in the node-kill storm: a final phase run
/// twice). The takeover here is the claim's own sequence by hand (a locked read of the
/// ledger row, then its update), on node 2, around a fenced write on node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_write_conflicts_with_a_takeover_that_read_before_it_on_another_node() {
    use sea_orm::TransactionTrait;
    let Some(nodes) = nodes().await else {
        eprintln!("{URLS} is not set: no cluster to test");
        return;
    };
    let nodes = Arc::new(nodes);
    for what in [FencedWrite::Step, FencedWrite::PhaseCommittedAlone] {
        let run = unique("galera-fence");
        let key = format!("{run}-k");
        let pace = Arc::new(Pace::default());
        let call = tokio::spawn({
            let (nodes, pace, key, run) = (
                Arc::clone(&nodes),
                Arc::clone(&pace),
                key.clone(),
                run.clone(),
            );
            async move { paced(&nodes[0], key, run, what, &pace).await }
        });
        // The takeover's read, on node 2 once the call's lease is there (the causal wait
        // makes node 2 see every commit before it; the row is awaited unlocked, since a locked
        // read of a missing row holds a gap the claim's insert would abort).
        let read = "SET STATEMENT wsrep_sync_wait = 7 FOR SELECT owner FROM idem_ledger \
                    WHERE scope = 'galera.fence' AND idem_key = ?";
        let started = Instant::now();
        while count(
            &nodes[1],
            &read.replace("SELECT owner", "SELECT COUNT(*)"),
            vec![key.clone().into()],
        )
        .await
            == 0
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{what:?}: the call never claimed its lease"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let takeover = nodes[1].begin().await.expect("begin the takeover");
        let statement = Statement::from_sql_and_values(
            takeover.get_database_backend(),
            format!("{read} FOR UPDATE"),
            [key.clone().into()],
        );
        let owner = takeover
            .query_one_raw(statement)
            .await
            .expect("the takeover's read")
            .expect("the call's lease")
            .try_get_by_index::<i64>(0)
            .expect("an owner");
        // The fenced write commits on node 1 while the takeover holds what it read.
        pace.go.notify_one();
        tokio::time::timeout(Duration::from_secs(10), pace.written.notified())
            .await
            .unwrap_or_else(|_| panic!("{what:?}: the fenced write did not commit"));
        let took_over = async {
            exec(
                &takeover,
                "UPDATE idem_ledger SET owner = ? WHERE scope = 'galera.fence' AND idem_key = ? AND owner = ?",
                vec![(owner + 1).into(), key.clone().into(), owner.into()],
            )
            .await?;
            takeover.commit().await
        }
        .await;
        pace.end.notify_one();
        let answered = call.await.expect("the paced call");
        assert!(
            took_over.is_err(),
            "{what:?}: a takeover that read the ledger row before a fenced write on another \
             node committed beside it (the call answered {answered:?})"
        );
        assert!(
            answered.is_ok(),
            "{what:?}: the holder kept its lease: {answered:?}"
        );
    }
}
