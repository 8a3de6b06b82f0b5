use idem::idempotent;

#[derive(Debug)]
enum PayError {
    Declined,
}

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, PayError> {
    let _ = store;
    if key.is_empty() {
        return Err(PayError::Declined);
    }
    Ok(1)
}

fn main() {}
