use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key, exclude(note))]
async fn pay(store: &idem::MemoryStore, key: String, note: String) -> Result<u32, idem::Error> {
    let _ = (store, note);
    Ok(1)
}

fn main() {}
