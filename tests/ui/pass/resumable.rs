//! A resumable lease-mode handler: its stored arguments (all but the connection and skipped
//! ones) read back; a skipped argument needs no serde at all.
use idem::idempotent;

#[derive(serde::Serialize, serde::Deserialize)]
struct Charge {
    key: String,
    amount_cents: i64,
}

/// Supplied by whoever resumes the call: never stored.
struct Gateway;

#[idempotent(scope = "orders.charge", key = cmd.key, lease = "45s", resumable, skip(gateway))]
async fn charge(
    store: &idem::MemoryStore,
    gateway: &Gateway,
    cmd: Charge,
    attempt_note: Option<String>,
) -> Result<String, idem::Error> {
    let _ = (store.len(), gateway, attempt_note);
    idem::step("charge", |key| async move { Ok(format!("{key}:{}", cmd.amount_cents)) }).await
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = idem::MemoryStore::new();
    let cmd = || Charge { key: "k".into(), amount_cents: 5 };
    let first = rt.block_on(charge(&store, &Gateway, cmd(), None)).unwrap();
    let again = rt.block_on(charge(&store, &Gateway, cmd(), None)).unwrap();
    assert_eq!(first, again);
}
