//! Metrics (feature `metrics`): with a Prometheus recorder installed, each call of an atomic or
//! lease-mode handler is counted once per scope and outcome, and timed, on every backend of
//! the run. The counts are read from the recorder's rendered text, as a scraper would; the
//! payments example's `GET /metrics` shows them after a few pays.

mod common;
mod shop;

use shop::app;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use common::http::{get, post_json};
use common::{Gate, backends, effects, insert_effect, unique};
use idem::idempotent;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};
use serde_json::json;

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
            let outcome = label("outcome").expect("an outcome label");
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
