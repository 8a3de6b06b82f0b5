use idem::idempotent;

#[idempotent(scope = "orders.charge", key = key, lease = "30s", resumable)]
async fn charge(store: &idem::MemoryStore, key: String, note: &str) -> Result<u32, idem::Error> {
    let _ = (store, note);
    Ok(1)
}

fn main() {}
