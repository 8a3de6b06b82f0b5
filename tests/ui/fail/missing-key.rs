use idem::idempotent;

#[idempotent(scope = "orders.pay")]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = (store, key);
    Ok(1)
}

fn main() {}
