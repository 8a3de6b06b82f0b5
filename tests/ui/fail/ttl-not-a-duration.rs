use idem::idempotent;

struct Settings {
    record_ttl_secs: u64,
}

#[idempotent(scope = "orders.pay", key = key, ttl = settings.record_ttl_secs, skip(settings))]
async fn pay(
    store: &idem::MemoryStore,
    settings: &Settings,
    key: String,
) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
