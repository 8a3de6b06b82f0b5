#![deny(unused_variables)]

use idem::idempotent;

// The expansion must not hide the user's own lints: the unused `total` is still reported.
#[idempotent(scope = "orders.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
    let _ = store;
    let total = 1;
    Ok(2)
}

fn main() {}
