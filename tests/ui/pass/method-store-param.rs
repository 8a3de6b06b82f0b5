use idem::idempotent;

struct Orders;

impl Orders {
    #[idempotent(scope = "orders.pay", key = key)]
    async fn pay(&self, store: &idem::MemoryStore, key: String) -> Result<u64, idem::Error> {
        let _ = store;
        Ok(1)
    }

    #[idempotent(scope = "orders.refund", key = key, conn = store)]
    async fn refund(key: String, store: &idem::MemoryStore) -> Result<u64, idem::Error> {
        let _ = store;
        Ok(2)
    }
}

fn main() {
    let _ = Orders;
}
