use idem::idempotent;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    Declined,
    #[serde(skip)]
    Idem(idem::Error),
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl idem::FinalError for PayError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined)
    }
}

#[idempotent(scope = "orders.declined", key = key)]
async fn pay(store: &idem::MemoryStore, key: String) -> Result<u8, PayError> {
    let _ = store;
    Err(PayError::Declined)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    for _ in 0..2 {
        match pay(&store, "k".into()).await {
            Err(PayError::Declined) => {}
            Err(PayError::Idem(e)) => panic!("idem error: {e}"),
            Ok(n) => panic!("unexpected success: {n}"),
        }
    }
}
