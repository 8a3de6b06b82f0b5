use idem::idempotent;

struct Orders {
    store: idem::MemoryStore,
}

impl Orders {
    #[idempotent(scope = "orders.pay", key = key, conn = self.store as store)]
    async fn pay(&self, key: String, amount: u64) -> Result<u64, idem::Error> {
        let _: &idem::MemoryTx = store;
        Ok(amount)
    }

    #[idempotent(scope = "orders.bump", key = key, conn = self.store.clone() as tx)]
    async fn bump(&mut self, key: u64) -> Result<(), idem::Error> {
        let _ = tx;
        Ok(())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut orders = Orders {
        store: idem::MemoryStore::new(),
    };
    assert_eq!(orders.pay("k-1".to_owned(), 5).await.unwrap(), 5);
    assert_eq!(orders.pay("k-1".to_owned(), 5).await.unwrap(), 5);
    orders.bump(7).await.unwrap();
}
