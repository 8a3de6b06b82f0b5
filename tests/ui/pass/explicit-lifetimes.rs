use idem::idempotent;

#[idempotent(scope = "lifetimes.first", key = key)]
async fn first<'s, 'k>(
    store: &'s idem::MemoryStore,
    key: &'k str,
    words: &'k [String],
) -> Result<String, idem::Error>
where
    'k: 's,
{
    let _ = store;
    Ok(words.first().cloned().unwrap_or_default())
}

struct Service<'a> {
    store: &'a idem::MemoryStore,
}

impl<'a> Service<'a> {
    #[idempotent(scope = "lifetimes.method", key = key, conn = self.store as store)]
    async fn call<'k>(&self, key: &'k str, tag: &'a str) -> Result<usize, idem::Error> {
        let _ = store;
        Ok(tag.len())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    let words = vec!["a".to_owned()];
    assert_eq!(first(&store, "k", &words).await.unwrap(), "a");
    assert_eq!(Service { store: &store }.call("k", "tag").await.unwrap(), 3);
}
