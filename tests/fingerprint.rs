//! Requests that evolve keep their fingerprint (issue 29, item 3), on every backend of the
//! run: a deploy that adds an `Option` field, reorders fields or adds a parameter replays a
//! byte-identical retry instead of answering `KeyReused`; records written under fingerprint
//! version 1 keep replaying; the tower layer compares JSON bodies as JSON and query
//! parameters in any order. Each handler writes an effect row, so the tests count executions.

mod common;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::http::Call;
use common::{Backend, backends, insert_effect, unique};
use idem::axum::IdempotencyLayer;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::{Fingerprinter, idempotent};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The command as version A of the service declares it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PayA {
    key: String,
    run: String,
    amount: i64,
}

/// The same command after a deploy: fields reordered, an optional one added.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PayB {
    amount: i64,
    note: Option<String>,
    run: String,
    key: String,
}

impl PayB {
    /// What version B reads from the same request body version A got.
    fn from_a(a: &PayA) -> Self {
        serde_json::from_value(serde_json::to_value(a).expect("json")).expect("version B")
    }
}

fn pay_a(run: &str) -> PayA {
    PayA {
        key: format!("{run}-key"),
        run: run.to_owned(),
        amount: 700,
    }
}

#[idempotent(scope = "evolve.pay", key = cmd.key)]
async fn pay_version_a(db: &DatabaseConnection, cmd: PayA) -> Result<String, idem::Error> {
    insert_effect(db, &cmd.run, "a", cmd.amount).await;
    Ok(unique("exec"))
}

#[idempotent(scope = "evolve.pay", key = cmd.key)]
async fn pay_version_b(
    db: &DatabaseConnection,
    cmd: PayB,
    coupon: Option<String>,
) -> Result<String, idem::Error> {
    insert_effect(db, &cmd.run, "b", cmd.amount).await;
    Ok(unique(coupon.as_deref().unwrap_or("exec")))
}

#[idempotent(scope = "evolve.lease", key = cmd.key, lease = "5s")]
async fn lease_version_a(db: &DatabaseConnection, cmd: PayA) -> Result<String, idem::Error> {
    insert_effect(db, &cmd.run, "a", cmd.amount).await;
    Ok(unique("exec"))
}

#[idempotent(scope = "evolve.lease", key = cmd.key, lease = "5s")]
async fn lease_version_b(
    db: &DatabaseConnection,
    coupon: Option<String>,
    cmd: PayB,
) -> Result<String, idem::Error> {
    insert_effect(db, &cmd.run, "b", cmd.amount).await;
    Ok(unique(coupon.as_deref().unwrap_or("exec")))
}

#[tokio::test]
async fn a_deploy_that_adds_an_option_field_reorders_fields_or_adds_a_parameter_replays() {
    for b in backends().await {
        // Atomic mode: version A records, version B's identical retry replays.
        let run = unique("evolve-atomic");
        let first = pay_version_a(&b.db, pay_a(&run)).await.expect("version A");
        let retry = pay_version_b(&b.db, PayB::from_a(&pay_a(&run)), None)
            .await
            .expect("version B replays");
        assert_eq!(first, retry, "{}", b.name);
        b.assert_effects(&run, 1, "the retry after the deploy replays")
            .await;
        // A retry that does carry a value in the new field is another request.
        let mut noted = PayB::from_a(&pay_a(&run));
        noted.note = Some("leave it at the door".to_owned());
        let reused = pay_version_b(&b.db, noted, None).await;
        assert!(
            matches!(reused, Err(idem::Error::KeyReused { .. })),
            "{}: {reused:?}",
            b.name
        );
        let coupon = pay_version_b(&b.db, PayB::from_a(&pay_a(&run)), Some("c".to_owned())).await;
        assert!(
            matches!(coupon, Err(idem::Error::KeyReused { .. })),
            "{}: {coupon:?}",
            b.name
        );
        b.assert_effects(&run, 1, "other requests under the key never run")
            .await;

        // Lease mode, and the other direction of a rolling deploy: B records, A replays.
        let run = unique("evolve-lease");
        let first = lease_version_b(&b.db, None, PayB::from_a(&pay_a(&run)))
            .await
            .expect("version B");
        let retry = lease_version_a(&b.db, pay_a(&run))
            .await
            .expect("version A replays");
        assert_eq!(first, retry, "{}", b.name);
        b.assert_effects(&run, 1, "the retry of an older pod replays")
            .await;
    }
}

/// Rewrites the fingerprint of `key`'s ledger row, as a release before version 2 would have
/// written it.
async fn set_fingerprint(db: &DatabaseConnection, key: &str, fingerprint: &[u8; 32]) {
    let backend = db.get_database_backend();
    let sql = match backend {
        DbBackend::Postgres => "UPDATE idem_ledger SET fingerprint = $1 WHERE idem_key = $2",
        _ => "UPDATE idem_ledger SET fingerprint = ? WHERE idem_key = ?",
    };
    let updated = db
        .execute_raw(Statement::from_sql_and_values(
            backend,
            sql,
            [fingerprint.to_vec().into(), key.into()],
        ))
        .await
        .expect("update the fingerprint");
    assert_eq!(updated.rows_affected(), 1);
}

/// The fingerprint a release before version 2 gave a call: arguments unnamed, in order.
fn v1_of(scope: &str, args: &[&dyn erased::Arg]) -> [u8; 32] {
    let mut f = Fingerprinter::new(scope);
    for arg in args {
        arg.add(&mut f);
    }
    let fingerprints = f.finish_versions();
    assert_ne!(fingerprints.v1(), fingerprints.current());
    fingerprints.v1().0
}

mod erased {
    use idem::Fingerprinter;

    /// An argument of any type, for [`super::v1_of`].
    pub(super) trait Arg {
        fn add(&self, f: &mut Fingerprinter);
    }

    impl<T: serde::Serialize> Arg for T {
        fn add(&self, f: &mut Fingerprinter) {
            f.arg(self).expect("serialisable");
        }
    }
}

#[tokio::test]
async fn records_written_under_fingerprint_v1_keep_replaying() {
    for b in backends().await {
        for lease in [false, true] {
            let run = unique("evolve-v1");
            let cmd = pay_a(&run);
            let (scope, first) = if lease {
                ("evolve.lease", lease_version_a(&b.db, cmd.clone()).await)
            } else {
                ("evolve.pay", pay_version_a(&b.db, cmd.clone()).await)
            };
            let first = first.expect("first");
            // The row as the release before version 2 wrote it: same id, same answer, the
            // version 1 fingerprint.
            set_fingerprint(&b.db, &cmd.key, &v1_of(scope, &[&cmd])).await;
            let retry = if lease {
                lease_version_a(&b.db, cmd.clone()).await
            } else {
                pay_version_a(&b.db, cmd.clone()).await
            };
            assert_eq!(retry.expect("replays"), first, "{} lease {lease}", b.name);
            b.assert_effects(&run, 1, "a v1 record replays").await;
            let mut other = cmd.clone();
            other.amount += 1;
            let reused = if lease {
                lease_version_a(&b.db, other).await
            } else {
                pay_version_a(&b.db, other).await
            };
            assert!(
                matches!(reused, Err(idem::Error::KeyReused { .. })),
                "{}: {reused:?}",
                b.name
            );
        }
    }
}

async fn create(State(db): State<DatabaseConnection>, body: axum::body::Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let run = body["run"].as_str().unwrap_or("none").to_owned();
    insert_effect(&db, &run, "layer", 1).await;
    (StatusCode::CREATED, unique("exec")).into_response()
}

fn router(b: &Backend) -> Router {
    // Nothing replayed from memory: a retry as another pod would meet it, from the ledger.
    let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "evolve.layer")
        .remember_answers(0);
    Router::new()
        .route("/orders", post(create).route_layer(layer))
        .with_state(b.db.clone())
}

#[tokio::test]
async fn the_layer_compares_json_bodies_as_json_and_query_parameters_in_any_order() {
    for b in backends().await {
        let router = router(&b);
        let run = unique("evolve-layer");
        let key = format!("{run}-key");
        let first = Call::post("/orders?b=2&a=1")
            .key(&key)
            .raw_json(format!(r#"{{"run":"{run}","amount":5,"items":[1,2]}}"#))
            .send(&router)
            .await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", b.name);
        let retry = Call::post("/orders?a=1&b=2")
            .key(&key)
            .raw_json(format!(
                "{{ \"items\" : [ 1, 2 ],\n  \"amount\": 5, \"run\": \"{run}\" }}"
            ))
            .send(&router)
            .await;
        assert!(retry.replayed, "{}: {:?}", b.name, retry.text);
        assert_eq!(retry.text, first.text, "{}", b.name);
        b.assert_effects(&run, 1, "a re-serialised retry replays")
            .await;
        // Another body is still another request.
        let other = Call::post("/orders?a=1&b=2")
            .key(&key)
            .json(&json!({"run": run, "amount": 5, "items": [2, 1]}))
            .send(&router)
            .await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", b.name);

        // A record the layer wrote under version 1 (raw bytes) keeps replaying a
        // byte-identical retry.
        let run = unique("evolve-layer-v1");
        let key = format!("{run}-key");
        let body = format!(r#"{{"run":"{run}"}}"#);
        let first = Call::post("/orders?z=1&a=2")
            .key(&key)
            .raw_json(body.clone())
            .send(&router)
            .await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", b.name);
        let v1 = v1_of(
            "evolve.layer",
            &[&"POST", &"/orders?z=1&a=2", &Bytes(body.as_bytes())],
        );
        set_fingerprint(&b.db, &key, &v1).await;
        let retry = Call::post("/orders?z=1&a=2")
            .key(&key)
            .raw_json(body)
            .send(&router)
            .await;
        assert!(retry.replayed, "{}: {:?}", b.name, retry.text);
        b.assert_effects(&run, 1, "a v1 layer record replays").await;
    }
}

/// Bytes serialized as bytes, as the layer fingerprints a body.
struct Bytes<'a>(&'a [u8]);

impl Serialize for Bytes<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}
