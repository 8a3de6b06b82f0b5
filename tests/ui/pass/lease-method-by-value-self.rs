//! Lease mode on a method that takes `self` by value (`self`, `self: Arc<Self>`): it compiles
//! and its body runs once per call (atomic mode, whose tries would share `self`, refuses it).
use std::sync::Arc;

use idem::idempotent;

struct Payments {
    fee: u32,
}

impl Payments {
    #[idempotent(scope = "payments.charge", key = key, lease = "30s")]
    async fn charge(self: Arc<Self>, store: &idem::MemoryStore, key: String, amount: u32) -> Result<u32, idem::Error> {
        let _ = store;
        let fee = self.fee;
        idem::step("charge", |_key| async move { Ok::<_, idem::Error>(amount + fee) }).await
    }

    #[idempotent(scope = "payments.close", key = key, lease = "30s")]
    async fn close(self, store: &idem::MemoryStore, key: String) -> Result<u32, idem::Error> {
        let _ = store;
        Ok(self.fee)
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = idem::MemoryStore::new();
    let payments = Arc::new(Payments { fee: 2 });
    let first = rt.block_on(Arc::clone(&payments).charge(&store, "k".into(), 5)).unwrap();
    let again = rt.block_on(payments.charge(&store, "k".into(), 5)).unwrap();
    assert_eq!((first, again), (7, 7));
    assert_eq!(rt.block_on(Payments { fee: 3 }.close(&store, "c".into())).unwrap(), 3);
}
