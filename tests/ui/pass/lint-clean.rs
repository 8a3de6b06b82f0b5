#![deny(warnings, unused_qualifications, clippy::all)]
#![deny(
    unreachable_code,
    unused_results,
    single_use_lifetimes,
    unused_lifetimes
)]
//! The expansion compiles warning-free under strict lints.

use idem::idempotent;
use serde::{Deserialize, Serialize};

/// A payment command.
#[derive(Debug, Serialize)]
pub struct Pay {
    /// The idempotency key.
    pub key: String,
    /// Amount in cents.
    pub amount: u64,
}

/// A receipt.
#[derive(Debug, Serialize, Deserialize)]
pub struct Receipt {
    /// Amount in cents.
    pub amount: u64,
}

/// Pays.
#[idempotent(scope = "lint.pay", key = cmd.key, ttl = "7d")]
pub async fn pay(store: &idem::MemoryStore, cmd: Pay) -> Result<Receipt, idem::Error> {
    let _ = store;
    Ok(Receipt { amount: cmd.amount })
}

/// A note that is not `Clone`: the call runs at most once per process (a conflict then
/// answers with an error instead of running it again).
#[derive(Debug, Serialize)]
pub struct Note(pub String);

/// Takes its arguments `mut`, by pattern, and one that is not `Clone`: each try of the body
/// gets its own, and nothing warns.
#[idempotent(scope = "lint.note", key = key)]
pub async fn note(
    store: &idem::MemoryStore,
    mut key: String,
    (first, _second): (u8, u8),
    note: Note,
    _unused: u8,
) -> Result<String, idem::Error> {
    let _ = store;
    key.push_str(&note.0);
    Ok(format!("{key}{first}"))
}

/// A service holding its store.
#[derive(Debug)]
pub struct Service {
    store: idem::MemoryStore,
}

impl Service {
    /// Refunds.
    #[idempotent(scope = "lint.refund", key = key, conn = self.store as tx, skip(reason))]
    pub async fn refund(&self, key: u64, reason: &str) -> Result<u64, idem::Error> {
        let _ = (tx, reason);
        Ok(key)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = idem::MemoryStore::new();
    let receipt = pay(
        &store,
        Pay {
            key: "k".to_owned(),
            amount: 5,
        },
    )
    .await;
    assert_eq!(receipt.map(|r| r.amount).ok(), Some(5));
    let noted = note(&store, "k".to_owned(), (1, 2), Note("n".to_owned()), 0).await;
    assert_eq!(noted.ok().as_deref(), Some("kn1"));
    let service = Service { store };
    assert_eq!(service.refund(1, "dup").await.ok(), Some(1));
}
