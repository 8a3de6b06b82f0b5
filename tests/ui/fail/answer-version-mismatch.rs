use idem::{Versioned, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Receipt {
    cents: i64,
}

impl Versioned for Receipt {
    const VERSION: u32 = 3;
}

// The handler pins version 2; the type writes version 3.
#[idempotent(scope = "orders.pay", key = key, answer_version = 2)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<Receipt, idem::Error> {
    let _ = store;
    Ok(Receipt { cents: 1 })
}

fn main() {
    let _ = pay;
}
