use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key, skip(clock))]
async fn pay(store: &idem::MemoryStore, key: String, now: u64) -> Result<u32, idem::Error> {
    let _ = (store, now);
    Ok(1)
}

fn main() {}
