#![allow(dead_code)]

use idem::idempotent;

// Dummy modules that shadow the paths a careless expansion would use.
mod core {}
mod std {}
mod serde {}
mod idem_dummy {
    pub mod __private {}
}
mod __private {}

#[idempotent(scope = "hygiene.pay", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u8, idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
