use idem::idempotent;

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) {
    let _ = (store, key);
}

fn main() {}
