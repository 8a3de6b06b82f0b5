use idem::idempotent;
use serde::Serialize;

#[derive(Serialize)]
struct Pay {
    tenant: String,
    request_id: String,
    amount: u64,
}

struct Clock;

#[idempotent(
    scope = "orders.pay",
    key = cmd.request_id,
    principal = cmd.tenant,
    skip(clock),
    ttl = "1h30m",
    on_concurrent = reject,
    conn = store,
    crate = "::idem",
)]
async fn pay(cmd: Pay, store: &idem::MemoryStore, clock: &Clock) -> Result<u64, idem::Error> {
    let _ = (store, clock);
    Ok(cmd.amount)
}

#[idempotent(scope = "orders.wait", key = key, on_concurrent = wait, ttl = "500ms")]
async fn wait(store: &idem::MemoryStore, key: u64) -> Result<(), idem::Error> {
    let _ = store;
    Ok(())
}

struct Settings {
    record_ttl: std::time::Duration,
}

/// The TTL read at run time, from the service's configuration.
#[idempotent(scope = "orders.configured", key = key, ttl = settings.record_ttl, skip(settings))]
async fn configured(
    store: &idem::MemoryStore,
    settings: &Settings,
    key: u64,
) -> Result<(), idem::Error> {
    let _ = store;
    Ok(())
}

/// Observe mode: every call runs the body and answers its own answer; idem reports what it
/// would have done.
#[idempotent(scope = "orders.observed", key = key, mode = observe)]
async fn observed(store: &idem::MemoryStore, key: u64, amount: u64) -> Result<u64, idem::Error> {
    let _ = store;
    Ok(amount)
}

/// `mode = enforce` is the default, written out.
#[idempotent(scope = "orders.enforced", key = key, mode = enforce)]
async fn enforced(store: &idem::MemoryStore, key: u64, amount: u64) -> Result<u64, idem::Error> {
    let _ = store;
    Ok(amount)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    let cmd = || Pay {
        tenant: "t".into(),
        request_id: "r".into(),
        amount: 9,
    };
    assert_eq!(pay(cmd(), &store, &Clock).await.unwrap(), 9);
    assert_eq!(pay(cmd(), &store, &Clock).await.unwrap(), 9);
    wait(&store, 1).await.unwrap();
    let settings = Settings {
        record_ttl: std::time::Duration::from_secs(3600),
    };
    configured(&store, &settings, 1).await.unwrap();
    assert_eq!(observed(&store, 1, 5).await.unwrap(), 5);
    assert_eq!(observed(&store, 1, 6).await.unwrap(), 6, "a reused key: the body answers");
    assert_eq!(enforced(&store, 1, 5).await.unwrap(), 5);
    assert!(enforced(&store, 1, 6).await.is_err(), "a reused key: 422");
}
