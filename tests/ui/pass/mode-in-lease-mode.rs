use idem::idempotent;

#[idempotent(scope = "orders.charge", key = key, lease = "30s", mode = observe)]
async fn charge(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
