use idem::idempotent;

// An argument whose value does not parse is reported, and so is every mistake after it.
#[idempotent(scope = orders_pay, key = key, principal = tenant(1 2), ttl = "0s", on_concurent = reject, lease = 30, lease)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
