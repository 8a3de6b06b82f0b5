use idem::idempotent;

#[idempotent(scope = "orders.impl-arg", key = key, skip(log))]
async fn pay(
    store: &idem::MemoryStore,
    key: impl idem::KeySource + serde::Serialize,
    amount: impl serde::Serialize,
    log: impl FnOnce(&str),
) -> Result<u8, idem::Error> {
    let _ = (store, amount);
    log("paid");
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    assert_eq!(pay(&store, "k", 3_u64, |_| {}).await.unwrap(), 1);
}
