#![allow(dead_code)]

// A local `mod idem` must not capture the expansion's `::idem` paths.
mod idem {
    pub struct MemoryStore;
    pub mod __private {}
}

#[::idem::idempotent(scope = "hygiene.local-idem", key = key)]
async fn pay(store: &::idem::MemoryStore, key: String) -> Result<u8, ::idem::Error> {
    let _ = store;
    Ok(1)
}

fn main() {}
