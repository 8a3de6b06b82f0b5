use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key, mode = "observe")]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
