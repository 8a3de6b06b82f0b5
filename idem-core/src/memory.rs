//! An in-memory [`Store`] for unit tests and examples without a database.
//!
//! It keeps the ledger semantics (claim, wait or reject, replay, expiry, release on drop) but
//! not transactions around your own data: there is no database for the body to write to.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::sync::OwnedMutexGuard;

use crate::error::Error;
use crate::store::{Claim, ClaimRequest, Concurrency, RecordStatus, Recorded, Store};

/// An in-memory ledger. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    records: Mutex<HashMap<[u8; 32], Entry>>,
    locks: Mutex<HashMap<[u8; 32], Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug)]
struct Entry {
    recorded: Recorded,
    expires: Instant,
}

/// The "transaction" of a [`MemoryStore`] claim: holds the key's lock until it is recorded
/// or dropped.
#[derive(Debug)]
pub struct MemoryTx {
    _lock: OwnedMutexGuard<()>,
}

impl MemoryStore {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many unexpired records it holds.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.records().values().filter(|e| e.expires > now).count()
    }

    /// Whether it holds no unexpired record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Entry>> {
        self.inner
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store for MemoryStore {
    type Tx = MemoryTx;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<MemoryTx>, Error> {
        let lock = Arc::clone(
            self.inner
                .locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(req.id)
                .or_default(),
        );
        let guard = match req.concurrency {
            Concurrency::Reject => match lock.try_lock_owned() {
                Ok(guard) => guard,
                Err(_) => return Ok(Claim::InFlight),
            },
            _ => lock.lock_owned().await,
        };
        if let Some(entry) = self.records().get(&req.id)
            && entry.expires > Instant::now()
        {
            return Ok(Claim::Recorded(entry.recorded.clone()));
        }
        Ok(Claim::Execute(MemoryTx { _lock: guard }))
    }

    async fn record(
        &self,
        tx: MemoryTx,
        req: &ClaimRequest<'_>,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        let entry = Entry {
            recorded: Recorded {
                fingerprint: req.fingerprint,
                status,
                payload: payload.to_vec(),
            },
            expires: Instant::now() + req.ttl,
        };
        self.records().insert(req.id, entry);
        drop(tx);
        Ok(())
    }

    async fn release(&self, tx: MemoryTx) -> Result<(), Error> {
        drop(tx);
        Ok(())
    }
}
