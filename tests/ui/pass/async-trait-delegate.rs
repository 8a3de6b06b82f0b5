// The fix the async-trait error suggests: the idempotent logic in an inherent `async fn`, the
// `#[async_trait]` method (a tonic service's) calling it.
use idem::idempotent;

#[async_trait::async_trait]
trait Payments {
    async fn pay(&self, key: String) -> Result<u32, idem::Error>;
}

struct Service {
    store: idem::MemoryStore,
}

impl Service {
    #[idempotent(scope = "payments.pay", key = key, conn = self.store as db)]
    async fn pay_once(&self, key: String) -> Result<u32, idem::Error> {
        let _ = db;
        Ok(1)
    }
}

#[async_trait::async_trait]
impl Payments for Service {
    async fn pay(&self, key: String) -> Result<u32, idem::Error> {
        self.pay_once(key).await
    }
}

fn main() {
    let service = Service {
        store: idem::MemoryStore::new(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let first = runtime.block_on(service.pay("k".into())).expect("first");
    let again = runtime.block_on(service.pay("k".into())).expect("replay");
    assert_eq!(first, again);
}
