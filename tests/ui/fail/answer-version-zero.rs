use idem::idempotent;

// Versions start at 1; and the version is a number.
#[idempotent(scope = "orders.pay", key = key, answer_version = 0)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

#[idempotent(scope = "orders.ship", key = key, answer_version = "2")]
async fn ship(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
