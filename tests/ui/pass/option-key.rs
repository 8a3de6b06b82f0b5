use idem::idempotent;

#[idempotent(scope = "orders.optional", key = key)]
async fn pay(store: &idem::MemoryStore, key: Option<String>) -> Result<u8, idem::Error> {
    let _ = store;
    Ok(1)
}

#[idempotent(scope = "orders.header", key = header.as_deref())]
async fn from_header(store: &idem::MemoryStore, header: Option<String>) -> Result<u8, idem::Error> {
    let _ = store;
    Ok(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    assert_eq!(pay(&store, Some("k".into())).await.unwrap(), 1);
    let missing = pay(&store, None).await.unwrap_err();
    assert_eq!(missing.kind(), idem::ErrorKind::MissingKey);
    assert_eq!(from_header(&store, Some("h".into())).await.unwrap(), 2);
}
