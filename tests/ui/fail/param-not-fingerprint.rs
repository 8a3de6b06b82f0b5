use idem::idempotent;

struct Clock;

#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String, clock: Clock) -> Result<u32, idem::Error> {
    let _ = (store, clock);
    Ok(1)
}

fn main() {}
