//! Metrics (feature `metrics`): with a Prometheus recorder installed, each call of an atomic or
//! lease-mode handler is counted once per scope and outcome, and timed, on every backend of
//! the run. The counts are read from the recorder's rendered text, as a scraper would; the
//! payments example's `GET /metrics` shows them after a few pays. Observe mode's storm runs
//! the same calls enforced and observed and compares the decisions each reports.

mod common;
mod shop;

use shop::app;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use common::http::{get, post_json};
use common::{Gate, backends, connect, effects, insert_effect, sqlite_url, unique};
use idem::idempotent;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing_subscriber::layer::SubscriberExt;

/// The process-wide recorder (a recorder can be installed once per process).
fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("install the recorder")
    })
}

/// Every sample of `name` whose `scope` label is `scope`, by `outcome` label.
fn samples(name: &str, scope: &str) -> BTreeMap<String, u64> {
    parse(&recorder().render(), name, scope)
}

/// Every sample of `name` with `scope` in Prometheus text `text`, by `outcome` label.
fn parse(text: &str, name: &str, scope: &str) -> BTreeMap<String, u64> {
    parse_by(text, name, scope, "outcome")
}

/// Every sample of `name` with `scope` in Prometheus text `text`, by the label `by`.
fn parse_by(text: &str, name: &str, scope: &str, by: &str) -> BTreeMap<String, u64> {
    let mut found = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
        };
        if label("scope").as_deref() == Some(scope) {
            let outcome = label(by).unwrap_or_else(|| panic!("a `{by}` label"));
            let value: f64 = value.trim().parse().expect("a number");
            found.insert(outcome, value as u64);
        }
    }
    found
}

/// What changed in `name` for `scope` since `before`, leaving out outcomes that did not move.
fn delta(name: &str, scope: &str, before: &BTreeMap<String, u64>) -> BTreeMap<&'static str, u64> {
    changes(&samples(name, scope), before)
}

/// The outcomes whose counts differ between `now` and `before`, with the difference.
fn changes(
    now: &BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<&'static str, u64> {
    let outcomes = [
        "executed",
        "replayed",
        "key_reused",
        "in_flight",
        "released",
        "invalid_key",
        "error",
        "observed",
    ];
    let mut changed = BTreeMap::new();
    for (outcome, value) in now {
        let was = before.get(outcome).copied().unwrap_or(0);
        if *value != was {
            let known = outcomes
                .iter()
                .find(|o| **o == outcome.as_str())
                .unwrap_or_else(|| panic!("undocumented outcome `{outcome}`"));
            changed.insert(*known, value - was);
        }
    }
    changed
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pay {
    key: String,
    run: String,
    amount: i64,
}

#[derive(Debug)]
enum PayError {
    Idem(idem::Error),
    Flaky,
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

/// Both handlers' body: waits at `gate` if there is one, fails (transiently) on a negative
/// amount, else writes its effect.
async fn body<C: ConnectionTrait>(db: &C, cmd: Pay, gate: Option<&Gate>) -> Result<i64, PayError> {
    if let Some(gate) = gate {
        gate.pass().await;
    }
    if cmd.amount < 0 {
        return Err(PayError::Flaky);
    }
    insert_effect(db, &cmd.run, "pay", cmd.amount).await;
    Ok(cmd.amount)
}

#[idempotent(scope = "metrics.atomic", key = cmd.key, on_concurrent = reject, skip(gate))]
async fn pay(db: &DatabaseConnection, cmd: Pay, gate: Option<&Gate>) -> Result<i64, PayError> {
    body(db, cmd, gate).await
}

#[idempotent(scope = "metrics.lease", key = cmd.key, lease = "5s", on_concurrent = reject, skip(gate))]
async fn pay_lease(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<i64, PayError> {
    body(db, cmd, gate).await
}

/// Runs the same script against either handler: one of each outcome but `error`, and two
/// executions.
async fn script<F, Fut>(call: F, run: &str)
where
    F: Fn(Pay) -> Fut,
    Fut: std::future::Future<Output = Result<i64, PayError>>,
{
    let cmd = |key: &str, amount: i64| Pay {
        key: key.to_owned(),
        run: run.to_owned(),
        amount,
    };
    let key = unique("k");
    assert_eq!(call(cmd(&key, 100)).await.ok(), Some(100));
    assert_eq!(call(cmd(&key, 100)).await.ok(), Some(100));
    let reused = call(cmd(&key, 200)).await;
    assert!(
        matches!(reused, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::KeyReused),
        "{run}: {reused:?}"
    );
    let released = call(cmd(&unique("k"), -1)).await;
    assert!(matches!(released, Err(PayError::Flaky)));
    let invalid = call(cmd("", 100)).await;
    assert!(
        matches!(invalid, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::InvalidKey)
    );
    assert_eq!(call(cmd(&unique("k"), 300)).await.ok(), Some(300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_counted_per_scope_and_outcome_and_timed() {
    recorder();
    for b in backends().await {
        for scope in ["metrics.atomic", "metrics.lease"] {
            let counts = samples("idem_calls_total", scope);
            let timings = samples("idem_call_duration_seconds_count", scope);
            let run = unique(&format!("metrics-{}-{scope}", b.name));
            let db = &b.db;
            if scope == "metrics.atomic" {
                script(|cmd| pay(db, cmd, None), &run).await;
            } else {
                script(|cmd| pay_lease(db, cmd, None), &run).await;
            }

            // A duplicate while the first call is in its body.
            let gate = Gate::default();
            let held = gate.clone();
            let key = unique("k");
            let first = Pay {
                key: key.clone(),
                run: run.clone(),
                amount: 5,
            };
            let (db1, first1) = (b.db.clone(), first.clone());
            let holder = tokio::spawn(async move {
                if scope == "metrics.atomic" {
                    pay(&db1, first1, Some(&held)).await.ok()
                } else {
                    pay_lease(&db1, first1, Some(&held)).await.ok()
                }
            });
            gate.entered().await;
            let duplicate = if scope == "metrics.atomic" {
                pay(&b.db, first.clone(), None).await
            } else {
                pay_lease(&b.db, first.clone(), None).await
            };
            assert!(
                matches!(duplicate, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::InFlight),
                "{}/{scope}: {duplicate:?}",
                b.name
            );
            gate.release();
            assert_eq!(holder.await.expect("join"), Some(5));

            let expected: BTreeMap<&str, u64> = [
                ("executed", 3),
                ("replayed", 1),
                ("key_reused", 1),
                ("released", 1),
                ("invalid_key", 1),
                ("in_flight", 1),
            ]
            .into();
            assert_eq!(
                delta("idem_calls_total", scope, &counts),
                expected,
                "{}/{scope}",
                b.name
            );
            assert_eq!(
                delta("idem_call_duration_seconds_count", scope, &timings),
                expected,
                "{}/{scope}: one latency sample per call",
                b.name
            );
            assert_eq!(effects(&b.db, &run).await, 3, "{}/{scope}", b.name);
        }
    }
}

#[idempotent(scope = "metrics.store", key = cmd.key)]
async fn pay_unprepared(db: &DatabaseConnection, cmd: Pay) -> Result<i64, PayError> {
    insert_effect(db, &cmd.run, "pay", cmd.amount).await;
    Ok(cmd.amount)
}

#[tokio::test]
async fn a_store_failure_is_counted_as_error() {
    recorder();
    // A database without the ledger table: the claim fails.
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("sqlite");
    let before = samples("idem_calls_total", "metrics.store");
    let cmd = Pay {
        key: unique("k"),
        run: unique("metrics"),
        amount: 1,
    };
    let failed = pay_unprepared(&db, cmd).await;
    assert!(matches!(failed, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::Store));
    let expected: BTreeMap<&str, u64> = [("error", 1)].into();
    assert_eq!(
        delta("idem_calls_total", "metrics.store", &before),
        expected
    );
}

#[idempotent(scope = "observe.store", key = cmd.key, mode = observe)]
async fn pay_observed_unprepared(db: &DatabaseConnection, cmd: Pay) -> Result<i64, PayError> {
    insert_effect(db, &cmd.run, "pay", cmd.amount).await;
    Ok(cmd.amount)
}

#[tokio::test]
async fn observed_a_store_failure_is_reported_and_the_body_answers() {
    recorder();
    // A database with the effects table but no ledger: the claim fails, as enforcing counts
    // (`a_store_failure_is_counted_as_error`); observed, the body runs and answers anyway.
    let db = connect(&sqlite_url("idem-observe-store"), 1).await;
    db.execute_unprepared(
        "CREATE TABLE idem_test_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, label TEXT NOT NULL, amount INTEGER NOT NULL)",
    )
    .await
    .expect("the effects table");
    let decided = || {
        parse_by(
            &recorder().render(),
            "idem_observed_total",
            "observe.store",
            "decision",
        )
    };
    let (decisions_before, calls_before) =
        (decided(), samples("idem_calls_total", "observe.store"));
    let cmd = Pay {
        key: unique("k"),
        run: unique("observe-store"),
        amount: 1,
    };
    let answer = pay_observed_unprepared(&db, cmd.clone()).await;
    assert_eq!(answer.ok(), Some(1), "the body's own answer");
    assert_eq!(effects(&db, &cmd.run).await, 1, "its write committed");
    let error: BTreeMap<&str, u64> = [("error", 1)].into();
    assert_eq!(changes(&decided(), &decisions_before), error);
    let observed: BTreeMap<&str, u64> = [("observed", 1)].into();
    assert_eq!(
        changes(&samples("idem_calls_total", "observe.store"), &calls_before),
        observed
    );
}

/// `GET /metrics` on the payments service: the Prometheus text a scraper reads.
async fn scrape(router: &axum::Router) -> String {
    let answer = get(router, "/metrics").await;
    assert_eq!(answer.status, 200);
    let content_type = answer.header("content-type").expect("a content-type");
    assert!(content_type.starts_with("text/plain; version=0.0.4"));
    answer.text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_serves_the_counters_at_get_metrics() {
    let handle = recorder().clone();
    for b in backends().await {
        app::create_tables(&b.db).await.expect("tables");
        let state = app::AppState {
            db: b.db.clone(),
            gateway: app::Gateway::default(),
        };
        let router = app::router(state.clone()).merge(app::metrics_routes(handle.clone()));
        let scope = "shop.orders.pay";
        let before = parse(&scrape(&router).await, "idem_calls_total", scope);
        let refunds_before = parse(
            &scrape(&router).await,
            "idem_calls_total",
            "shop.orders.refund",
        );
        let order = json!({"customer": "c-1", "amount_cents": 500, "currency": "usd"});
        let created = post_json(&router, "/orders", &unique("create"), &order).await;
        assert_eq!(created.status, 201, "{}", b.name);
        let id = created.json["id"].as_str().expect("id").to_owned();
        let pay = format!("/orders/{id}/pay");
        let key = unique("pay");
        for _ in 0..3 {
            let paid = post_json(&router, &pay, &key, &json!({"amount_cents": 500})).await;
            assert_eq!(paid.status, 200, "{}", b.name);
        }
        let reused = post_json(&router, &pay, &key, &json!({"amount_cents": 501})).await;
        assert_eq!(reused.status, 422, "{}", b.name);

        // The refund route is a plain handler under `IdempotencyLayer`: counted the same way.
        let refund = format!("/orders/{id}/refund");
        let refund_key = unique("refund");
        for _ in 0..2 {
            let refunded = post_json(&router, &refund, &refund_key, &json!({})).await;
            assert_eq!(refunded.status, 200, "{}", b.name);
        }
        let scraped = scrape(&router).await;
        let refunds = parse(&scraped, "idem_calls_total", "shop.orders.refund");
        let expected: BTreeMap<&str, u64> = [("executed", 1), ("replayed", 1)].into();
        assert_eq!(changes(&refunds, &refunds_before), expected, "{}", b.name);

        let after = parse(&scraped, "idem_calls_total", scope);
        let expected: BTreeMap<&str, u64> =
            [("executed", 1), ("replayed", 2), ("key_reused", 1)].into();
        assert_eq!(changes(&after, &before), expected, "{}", b.name);
        assert_eq!(state.gateway.charges(), 1, "{}: one charge", b.name);
    }
}

/// Observe mode's storm handlers: each execution writes one effect row and answers with a
/// number no other execution gets, so an answer shows whose body it came from.
async fn storm_body<C: ConnectionTrait>(
    db: &C,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    if let Some(gate) = gate {
        gate.pass().await;
    }
    if cmd.amount < 0 {
        return Err(PayError::Flaky);
    }
    insert_effect(db, &cmd.run, "pay", cmd.amount).await;
    Ok(next_execution())
}

/// A number no other execution of a storm handler gets.
fn next_execution() -> u64 {
    static EXECUTIONS: AtomicU64 = AtomicU64::new(1);
    EXECUTIONS.fetch_add(1, Ordering::Relaxed)
}

#[idempotent(scope = "observe.storm.enforced", key = cmd.key)]
async fn storm_enforced(db: &DatabaseConnection, cmd: Pay) -> Result<u64, PayError> {
    storm_body(db, cmd, None).await
}

#[idempotent(scope = "observe.storm.observed", key = cmd.key, mode = observe)]
async fn storm_observed(db: &DatabaseConnection, cmd: Pay) -> Result<u64, PayError> {
    storm_body(db, cmd, None).await
}

#[idempotent(scope = "observe.held.enforced", key = cmd.key, on_concurrent = reject, skip(gate))]
async fn held_enforced(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    storm_body(db, cmd, gate).await
}

#[idempotent(scope = "observe.held.observed", key = cmd.key, on_concurrent = reject, skip(gate), mode = observe)]
async fn held_observed(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    storm_body(db, cmd, gate).await
}

/// The storm's body in lease mode: the execution's number is a recorded step, and its effect
/// row is written in a final phase (fenced by the lease when the call holds one of the ledger,
/// on its own when observe mode runs a body enforcing would not run).
async fn lease_body(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    if let Some(gate) = gate {
        gate.pass().await;
    }
    if cmd.amount < 0 {
        return Err(PayError::Flaky);
    }
    let execution = idem::step("execution", async |_| Ok::<_, PayError>(next_execution())).await?;
    idem::sea_orm::final_step(db, "effect", |tx| {
        Box::pin(async move {
            insert_effect(tx, &cmd.run, "pay", cmd.amount).await;
            Ok::<_, PayError>(execution)
        })
    })
    .await
}

#[idempotent(scope = "observe.lease.storm.enforced", key = cmd.key, lease = "30s", on_concurrent = wait("20s"))]
async fn lease_storm_enforced(db: &DatabaseConnection, cmd: Pay) -> Result<u64, PayError> {
    lease_body(db, cmd, None).await
}

#[idempotent(scope = "observe.lease.storm.observed", key = cmd.key, lease = "30s", on_concurrent = wait("20s"), mode = observe)]
async fn lease_storm_observed(db: &DatabaseConnection, cmd: Pay) -> Result<u64, PayError> {
    lease_body(db, cmd, None).await
}

#[idempotent(scope = "observe.lease.held.enforced", key = cmd.key, lease = "30s", skip(gate))]
async fn lease_held_enforced(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    lease_body(db, cmd, gate).await
}

#[idempotent(scope = "observe.lease.held.observed", key = cmd.key, lease = "30s", skip(gate), mode = observe)]
async fn lease_held_observed(
    db: &DatabaseConnection,
    cmd: Pay,
    gate: Option<&Gate>,
) -> Result<u64, PayError> {
    lease_body(db, cmd, gate).await
}

/// The same four handlers on sqlx's store (SQLite): the body's connection is the claim's
/// `&mut SqliteConnection`.
mod on_sqlx {
    use super::{Gate, Pay, PayError};
    use idem::idempotent;
    use sqlx::SqlitePool;

    async fn body(
        db: &mut sqlx::SqliteConnection,
        cmd: Pay,
        gate: Option<&Gate>,
    ) -> Result<u64, PayError> {
        if let Some(gate) = gate {
            gate.pass().await;
        }
        if cmd.amount < 0 {
            return Err(PayError::Flaky);
        }
        sqlx::query("INSERT INTO idem_test_effects (run_id, label, amount) VALUES (?, ?, ?)")
            .bind(&cmd.run)
            .bind("pay")
            .bind(cmd.amount)
            .execute(db)
            .await
            .expect("insert effect");
        Ok(super::next_execution())
    }

    #[idempotent(scope = "observe.sqlx.storm.enforced", key = cmd.key)]
    pub(super) async fn storm_enforced(db: &SqlitePool, cmd: Pay) -> Result<u64, PayError> {
        body(db, cmd, None).await
    }

    #[idempotent(scope = "observe.sqlx.storm.observed", key = cmd.key, mode = observe)]
    pub(super) async fn storm_observed(db: &SqlitePool, cmd: Pay) -> Result<u64, PayError> {
        body(db, cmd, None).await
    }

    #[idempotent(scope = "observe.sqlx.held.enforced", key = cmd.key, on_concurrent = reject, skip(gate))]
    pub(super) async fn held_enforced(
        db: &SqlitePool,
        cmd: Pay,
        gate: Option<&Gate>,
    ) -> Result<u64, PayError> {
        body(db, cmd, gate).await
    }

    #[idempotent(scope = "observe.sqlx.held.observed", key = cmd.key, on_concurrent = reject, skip(gate), mode = observe)]
    pub(super) async fn held_observed(
        db: &SqlitePool,
        cmd: Pay,
        gate: Option<&Gate>,
    ) -> Result<u64, PayError> {
        body(db, cmd, gate).await
    }
}

/// The store a storm goes through: SeaORM's on the backend's connection, or sqlx's on a pool
/// of its own to the same SQLite file.
#[derive(Clone)]
enum Through {
    SeaOrm(DatabaseConnection),
    Sqlx(sqlx::SqlitePool),
    /// Lease mode on SeaORM's store.
    Lease(DatabaseConnection),
}

impl Through {
    /// The storm's and the held call's scopes, enforced or observed.
    fn scopes(&self, observe: bool) -> (&'static str, &'static str) {
        match (self, observe) {
            (Self::SeaOrm(_), false) => ("observe.storm.enforced", "observe.held.enforced"),
            (Self::SeaOrm(_), true) => ("observe.storm.observed", "observe.held.observed"),
            (Self::Sqlx(_), false) => ("observe.sqlx.storm.enforced", "observe.sqlx.held.enforced"),
            (Self::Sqlx(_), true) => ("observe.sqlx.storm.observed", "observe.sqlx.held.observed"),
            (Self::Lease(_), false) => (
                "observe.lease.storm.enforced",
                "observe.lease.held.enforced",
            ),
            (Self::Lease(_), true) => (
                "observe.lease.storm.observed",
                "observe.lease.held.observed",
            ),
        }
    }

    /// A call of the storm's handler.
    async fn storm(self, observe: bool, cmd: Pay) -> Result<u64, PayError> {
        match (self, observe) {
            (Self::SeaOrm(db), false) => storm_enforced(&db, cmd).await,
            (Self::SeaOrm(db), true) => storm_observed(&db, cmd).await,
            (Self::Sqlx(pool), false) => on_sqlx::storm_enforced(&pool, cmd).await,
            (Self::Sqlx(pool), true) => on_sqlx::storm_observed(&pool, cmd).await,
            (Self::Lease(db), false) => lease_storm_enforced(&db, cmd).await,
            (Self::Lease(db), true) => lease_storm_observed(&db, cmd).await,
        }
    }

    /// A call of the held handler, held in its body at `gate` if there is one.
    async fn held(self, observe: bool, cmd: Pay, gate: Option<Gate>) -> Result<u64, PayError> {
        let gate = gate.as_ref();
        match (self, observe) {
            (Self::SeaOrm(db), false) => held_enforced(&db, cmd, gate).await,
            (Self::SeaOrm(db), true) => held_observed(&db, cmd, gate).await,
            (Self::Sqlx(pool), false) => on_sqlx::held_enforced(&pool, cmd, gate).await,
            (Self::Sqlx(pool), true) => on_sqlx::held_observed(&pool, cmd, gate).await,
            (Self::Lease(db), false) => lease_held_enforced(&db, cmd, gate).await,
            (Self::Lease(db), true) => lease_held_observed(&db, cmd, gate).await,
        }
    }
}

/// Observe mode's decision events seen in this process: `(scope, key_hash, decision)` of each
/// INFO event with a `decision` field.
static DECISIONS: Mutex<Vec<(String, String, String)>> = Mutex::new(Vec::new());

/// A tracing layer that keeps observe mode's decision events in [`DECISIONS`].
struct DecisionEvents;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for DecisionEvents {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields([String; 3]);
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                let slot = ["scope", "key_hash", "decision"]
                    .iter()
                    .position(|name| *name == field.name());
                if let Some(slot) = slot {
                    self.0[slot] = value.to_owned();
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        let [scope, key_hash, decision] = fields.0;
        if *event.metadata().level() == tracing::Level::INFO && !decision.is_empty() {
            let mut all = DECISIONS.lock().unwrap_or_else(PoisonError::into_inner);
            all.push((scope, key_hash, decision));
        }
    }
}

/// The decision events of `scopes` logged after the first `since`, counted by decision. Each
/// names its call by key hash (16 hex digits), but for an invalid key (no record id to hash).
fn logged_decisions(scopes: [&str; 2], since: usize) -> BTreeMap<&'static str, u64> {
    let all = DECISIONS.lock().unwrap_or_else(PoisonError::into_inner);
    let mut counted = BTreeMap::new();
    for (_, key_hash, decision) in all[since..]
        .iter()
        .filter(|(s, _, _)| scopes.contains(&s.as_str()))
    {
        let hashed = decision == "invalid_key" || key_hash.len() == 16;
        assert!(hashed, "`{decision}` logged with key hash {key_hash:?}");
        *counted.entry(decision.clone()).or_insert(0) += 1;
    }
    changes(&counted, &BTreeMap::new())
}

/// The same storm against the same store (SeaORM's on every backend, in atomic and lease mode;
/// sqlx's on SQLite), enforced and observed: eight concurrent duplicates,
/// the key reused with other arguments, a transient error, an invalid key, and a duplicate
/// while the first call is held in its body (`reject`). Observe mode runs the body on every
/// call and answers with its own answer, and reports, in its counter and its log lines,
/// exactly the decisions enforcing took.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observe_mode_runs_every_body_and_reports_exactly_the_decisions_enforcing_takes() {
    const DUPLICATES: usize = 8;
    recorder();
    let installed = tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(DecisionEvents),
    );
    installed.expect("the only global subscriber of this binary");
    for b in backends().await {
        let mut stores = vec![Through::SeaOrm(b.db.clone()), Through::Lease(b.db.clone())];
        if b.name == "sqlite" {
            let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(4);
            stores.push(Through::Sqlx(
                pool.connect(&b.url).await.expect("sqlx's pool"),
            ));
        }
        for through in stores {
            let name = match through {
                Through::SeaOrm(_) => b.name.to_owned(),
                Through::Sqlx(_) => "sqlite (sqlx)".to_owned(),
                Through::Lease(_) => format!("{} (lease mode)", b.name),
            };
            let mut decisions = Vec::new();
            let mut effects_of = Vec::new();
            for observe in [false, true] {
                let (storm, held) = through.scopes(observe);
                let counted = |scope: &str| match observe {
                    false => samples("idem_calls_total", scope),
                    true => parse_by(
                        &recorder().render(),
                        "idem_observed_total",
                        scope,
                        "decision",
                    ),
                };
                let (storm_before, held_before) = (counted(storm), counted(held));
                let calls_before = samples("idem_calls_total", storm);
                let logged_before = DECISIONS
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .len();
                let run = unique(&format!("observe-{name}-{observe}"));
                let cmd = |key: &str, amount: i64| Pay {
                    key: key.to_owned(),
                    run: run.clone(),
                    amount,
                };
                let call = |cmd: Pay| through.clone().storm(observe, cmd);

                // Concurrent duplicates: enforcing runs one body and replays it to the others.
                let key = unique("storm");
                let storm_calls = (0..DUPLICATES).map(|_| tokio::spawn(call(cmd(&key, 10))));
                let mut answers = Vec::new();
                for answer in futures_util::future::join_all(storm_calls).await {
                    answers.push(answer.expect("join").expect("every duplicate answers"));
                }
                answers.sort_unstable();
                answers.dedup();
                let distinct = if observe { DUPLICATES } else { 1 };
                assert_eq!(answers.len(), distinct, "{name}: answers {answers:?}");

                // The key reused with other arguments: 422, or the body's own answer.
                let reused = call(cmd(&key, 20)).await;
                match observe {
                    false => assert!(
                        matches!(reused, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::KeyReused),
                        "{name}: {reused:?}"
                    ),
                    true => assert!(
                        !answers.contains(&reused.expect("the body answers")),
                        "{name}: the body's own answer, not a replay"
                    ),
                }
                // A transient error: the body's error either way, nothing recorded or written.
                let released = call(cmd(&unique("storm"), -1)).await;
                assert!(matches!(released, Err(PayError::Flaky)), "{name}");
                // An invalid key: 400, or the body runs.
                let invalid = call(cmd("", 30)).await;
                match observe {
                    false => assert!(
                        matches!(invalid, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::InvalidKey),
                        "{name}: {invalid:?}"
                    ),
                    true => assert!(invalid.is_ok(), "{name}: {invalid:?}"),
                }

                // A duplicate while the first call is held in its body, under `reject`: 409 at
                // once when enforcing; observed, its body runs (on SQLite, once the first call's
                // transaction lets go of the write lock: the test lets it go once the
                // duplicate's decision is reported).
                let gate = Gate::default();
                let key = unique("held");
                let held_call = through
                    .clone()
                    .held(observe, cmd(&key, 40), Some(gate.clone()));
                let first = tokio::spawn(held_call);
                gate.entered().await;
                let duplicate = tokio::spawn(through.clone().held(observe, cmd(&key, 40), None));
                let in_flight_before = held_before.get("in_flight").copied().unwrap_or(0);
                let mut waited = 0;
                while counted(held).get("in_flight").copied().unwrap_or(0) == in_flight_before {
                    waited += 1;
                    assert!(waited < 500, "{name}: the duplicate's decision is reported");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                gate.release();
                let first = first.await.expect("join");
                let duplicate = duplicate.await.expect("join");
                assert!(first.is_ok(), "{name}: {first:?}");
                match observe {
                    false => assert!(
                        matches!(duplicate, Err(PayError::Idem(ref e)) if e.kind() == idem::ErrorKind::InFlight),
                        "{name}: {duplicate:?}"
                    ),
                    true => assert!(duplicate.is_ok(), "{name}: {duplicate:?}"),
                }

                let mut taken = changes(&counted(storm), &storm_before);
                for (decision, n) in changes(&counted(held), &held_before) {
                    *taken.entry(decision).or_insert(0) += n;
                }
                if observe {
                    let calls = changes(&samples("idem_calls_total", storm), &calls_before);
                    let storm_calls = (DUPLICATES + 3) as u64;
                    let all_observed: BTreeMap<&str, u64> = [("observed", storm_calls)].into();
                    assert_eq!(calls, all_observed, "{name}");
                    let logged = logged_decisions([storm, held], logged_before);
                    assert_eq!(logged, taken, "{name}: one log line per decision");
                }
                decisions.push(taken);
                effects_of.push(effects(&b.db, &run).await);
            }
            let expected: BTreeMap<&str, u64> = [
                ("executed", 2),
                ("replayed", DUPLICATES as u64 - 1),
                ("key_reused", 1),
                ("released", 1),
                ("invalid_key", 1),
                ("in_flight", 1),
            ]
            .into();
            assert_eq!(decisions[0], expected, "{name}: enforcing");
            assert_eq!(decisions[1], decisions[0], "{name}: observed as enforced");
            // Enforcing: the storm's one body and the held call's. Observed: every body but the
            // transient error's (rolled back).
            let observed_effects = DUPLICATES as i64 + 4;
            assert_eq!(effects_of, [2, observed_effects], "{name}: effect rows");
        }
    }
}
