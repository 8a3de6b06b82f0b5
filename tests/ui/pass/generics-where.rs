use idem::idempotent;
use serde::Serialize;
use serde::de::DeserializeOwned;

#[idempotent(scope = "generic.echo", key = key)]
async fn echo<T, K>(store: &idem::MemoryStore, key: K, value: T) -> Result<T, idem::Error>
where
    T: Serialize + DeserializeOwned + Send,
    K: idem::KeySource + Serialize,
{
    let _ = store;
    Ok(value)
}

#[idempotent(scope = "generic.wrap", key = key)]
async fn wrap<C: Serialize>(
    store: &idem::MemoryStore,
    key: &str,
    cmd: C,
) -> Result<String, idem::Error> {
    let _ = store;
    Ok(format!("{}", std::mem::size_of_val(&cmd)))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    assert_eq!(echo(&store, 1_u64, "x".to_owned()).await.unwrap(), "x");
    wrap(&store, "k", 3_u8).await.unwrap();
}
