use idem::idempotent;

#[idempotent(scope = "orders.charge", key = key, deadline = "5m")]
async fn charge(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
