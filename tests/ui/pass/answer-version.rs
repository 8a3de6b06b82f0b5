use idem::{Versioned, idempotent};
use serde::{Deserialize, Serialize};

// A versioned answer type, pinned at the handler; and an unversioned one beside it.
#[derive(Serialize, Deserialize)]
struct Receipt {
    cents: i64,
    currency: String,
}

impl Versioned for Receipt {
    const VERSION: u32 = 2;
    fn upcast(from: u32, mut answer: serde_json::Value) -> serde_json::Result<serde_json::Value> {
        if from == 1 {
            answer["currency"] = "EUR".into();
        }
        Ok(answer)
    }
}

#[idempotent(scope = "orders.pay", key = key, answer_version = 2)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<Receipt, idem::Error> {
    let _ = store;
    Ok(Receipt { cents: 1, currency: "EUR".into() })
}

#[idempotent(scope = "orders.ship", key = key, lease = "30s")]
async fn ship(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {
    let _ = (pay, ship);
}
