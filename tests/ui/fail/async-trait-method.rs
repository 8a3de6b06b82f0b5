// tonic's service traits are `#[tonic::async_trait]`, which is `#[async_trait]`.
use idem::idempotent;

#[async_trait::async_trait]
trait Payments {
    async fn pay(&self, key: String) -> Result<u32, idem::Error>;
}

struct Service {
    store: idem::MemoryStore,
}

#[async_trait::async_trait]
impl Payments for Service {
    #[idempotent(scope = "payments.pay", key = key, conn = self.store as db)]
    async fn pay(&self, key: String) -> Result<u32, idem::Error> {
        let _ = db;
        Ok(1)
    }
}

fn main() {}
