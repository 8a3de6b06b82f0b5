use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(key: String, store: &idem::MemoryStore) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
