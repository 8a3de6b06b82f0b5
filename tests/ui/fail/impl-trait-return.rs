use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<impl serde::Serialize, idem::Error> {
    let _ = store;
    Ok(1_u32)
}

fn main() {}
