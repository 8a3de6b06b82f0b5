use idem::idempotent;

// Every argument and signature mistake is reported at once.
#[idempotent(key = key, ttl = "soon", skip(clock))]
fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
