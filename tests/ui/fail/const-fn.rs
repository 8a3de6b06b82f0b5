use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key)]
const async fn pay(store: &idem::MemoryStore, key: u64) -> Result<u32, idem::Error> {
    let _ = (store, key);
    Ok(1)
}

fn main() {}
