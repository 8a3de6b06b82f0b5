// A crate that re-exports idem and points the macro at its own path.
mod reexport {
    pub use ::idem;
}

use reexport::idem::idempotent;

#[idempotent(scope = "reexport.pay", key = key, crate = "crate::reexport::idem")]
async fn pay(
    store: &reexport::idem::MemoryStore,
    key: String,
) -> Result<u8, reexport::idem::Error> {
    let _ = store;
    Ok(1)
}

#[idempotent(scope = "reexport.absolute", key = key, crate = "::idem")]
async fn absolute(store: &::idem::MemoryStore, key: String) -> Result<u8, ::idem::Error> {
    let _ = store;
    Ok(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = ::idem::MemoryStore::new();
    assert_eq!(pay(&store, "k".to_owned()).await.unwrap(), 1);
    assert_eq!(absolute(&store, "k".to_owned()).await.unwrap(), 2);
}
