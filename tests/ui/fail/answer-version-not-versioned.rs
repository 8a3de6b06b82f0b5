use idem::idempotent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Receipt {
    cents: i64,
}

// `answer_version` needs the answer type to implement `idem::Versioned`.
#[idempotent(scope = "orders.pay", key = key, answer_version = 2)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<Receipt, idem::Error> {
    let _ = store;
    Ok(Receipt { cents: 1 })
}

fn main() {}
