//! Lease mode: the body runs on the connection itself, with recovery points.
use idem::idempotent;

#[derive(serde::Serialize)]
struct Charge {
    key: String,
    amount_cents: i64,
}

async fn gateway(idempotency_key: String, amount_cents: i64) -> Result<String, idem::Error> {
    Ok(format!("{idempotency_key}:{amount_cents}"))
}

#[idempotent(scope = "orders.charge", key = cmd.key, lease = "45s", on_concurrent = wait("2s"))]
async fn charge(store: &idem::MemoryStore, cmd: Charge) -> Result<String, idem::Error> {
    let _ = store.len();
    idem::step("charge", |key| gateway(key, cmd.amount_cents)).await
}

#[idempotent(scope = "orders.notify", key = key, lease, deadline = "1h30m")]
async fn notify(store: &idem::MemoryStore, key: String) -> Result<(), idem::Error> {
    let _ = store;
    Ok(())
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = idem::MemoryStore::new();
    let first = rt.block_on(charge(&store, Charge { key: "k".into(), amount_cents: 5 })).unwrap();
    let again = rt.block_on(charge(&store, Charge { key: "k".into(), amount_cents: 5 })).unwrap();
    assert_eq!(first, again);
    rt.block_on(notify(&store, "n".into())).unwrap();
}
