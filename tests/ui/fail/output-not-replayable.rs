use idem::idempotent;

struct Receipt {
    amount: u64,
}

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<Receipt, idem::Error> {
    let _ = store;
    Ok(Receipt { amount: 1 })
}

fn main() {}
