use idem::idempotent;

#[derive(serde::Serialize)]
struct Charge {
    amount: u64,
}

#[idempotent(scope = "orders.charge", key = key, lease = "30s", resumable)]
async fn charge(store: &idem::MemoryStore, key: String, charge: Charge) -> Result<u32, idem::Error> {
    let _ = (store, charge);
    Ok(1)
}

fn main() {}
