//! An in-memory [`Store`] for unit tests and examples without a database.
//!
//! It keeps the ledger semantics (claim, wait or reject, replay, expiry, release on drop) but
//! not transactions around your own data: there is no database for the body to write to.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use std::time::Duration;

use tokio::sync::OwnedMutexGuard;

use crate::call::Request;
use crate::error::Error;
use crate::ledger::ids::random_token;
use crate::ledger::{BoxFuture, Claim, Concurrency, LeaseClaim, RecordStatus, Recorded, Ticket};
use crate::store::{LeaseStore, Store};

/// An in-memory ledger. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    records: Mutex<HashMap<[u8; 32], Entry>>,
    locks: Mutex<HashMap<[u8; 32], Arc<tokio::sync::Mutex<()>>>>,
    leases: Mutex<HashMap<[u8; 32], Lease>>,
}

/// A lease-mode call in progress.
#[derive(Debug)]
struct Lease {
    token: i64,
    fingerprint: crate::Fingerprint,
    ends: Instant,
    steps: HashMap<String, Vec<u8>>,
}

#[derive(Debug)]
struct Entry {
    recorded: Recorded,
    expires: Instant,
}

impl Entry {
    /// The record of `req`'s outcome, kept for its TTL from now.
    fn new(req: &Request, status: RecordStatus, payload: &[u8]) -> Self {
        Self {
            recorded: Recorded {
                fingerprint: req.fingerprint(),
                status,
                payload: payload.to_vec(),
            },
            expires: Instant::now() + req.ttl(),
        }
    }
}

/// The "transaction" of a [`MemoryStore`] claim: holds the key's lock until it is recorded
/// or dropped.
#[derive(Debug)]
pub struct MemoryTx {
    // `None` for a call run with idem switched off: it holds no key.
    _lock: Option<OwnedMutexGuard<()>>,
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
    type Tx<'t> = &'t MemoryTx;
    type Claimed = MemoryTx;

    fn tx(claimed: &mut MemoryTx) -> &MemoryTx {
        claimed
    }

    async fn claim(&self, req: &Request) -> Result<Claim<MemoryTx>, Error> {
        let lock = Arc::clone(
            self.inner
                .locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(*req.id())
                .or_default(),
        );
        let guard = match req.concurrency() {
            Concurrency::Reject => match lock.try_lock_owned() {
                Ok(guard) => guard,
                Err(_) => return Ok(Claim::InFlight),
            },
            _ => lock.lock_owned().await,
        };
        if let Some(entry) = self.records().get(req.id())
            && entry.expires > Instant::now()
        {
            return Ok(Claim::Recorded(entry.recorded.clone()));
        }
        Ok(Claim::Execute(MemoryTx { _lock: Some(guard) }))
    }

    async fn record(
        &self,
        tx: MemoryTx,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        // In memory the insert is the commit: a crash test's crash before it keeps nothing.
        crate::testing::crash_points::fault(
            crate::testing::crash_points::CrashPoint::BeforeCommit,
        )?;
        self.records()
            .insert(*req.id(), Entry::new(req, status, payload));
        drop(tx);
        Ok(())
    }

    async fn release(&self, tx: MemoryTx) -> Result<(), Error> {
        drop(tx);
        Ok(())
    }

    async fn begin(&self) -> Result<MemoryTx, Error> {
        Ok(MemoryTx { _lock: None })
    }

    async fn commit(&self, tx: MemoryTx) -> Result<(), Error> {
        drop(tx);
        Ok(())
    }

    fn ledger_identity(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.inner) as usize)
    }
}

impl MemoryStore {
    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Lease>> {
        self.inner
            .leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `change` on the lease `ticket` holds, or reports it lost.
    fn holding<T>(
        &self,
        ticket: &Ticket,
        change: impl FnOnce(&mut Lease) -> T,
    ) -> Result<T, Error> {
        match self.leases().get_mut(&ticket.id) {
            Some(lease) if lease.token == ticket.token => Ok(change(lease)),
            _ => Err(Error::LeaseLost {
                scope: String::new(),
            }),
        }
    }
}

/// Milliseconds from now to `at` on this store's clock, as an epoch-like figure for tickets.
fn ticket_ms(ends: Instant) -> i64 {
    let from_now = ends.saturating_duration_since(Instant::now());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from((now + from_now).as_millis()).unwrap_or(i64::MAX)
}

impl LeaseStore for MemoryStore {
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut records = self.records();
            let id = *req.id();
            if let Some(entry) = records.get(&id) {
                if entry.expires > now {
                    return Ok(LeaseClaim::Recorded(entry.recorded.clone()));
                }
                records.remove(&id);
            }
            let mut leases = self.leases();
            let claim = match leases.get_mut(&id) {
                Some(held) if !req.fingerprints().matches(&held.fingerprint) => {
                    LeaseClaim::Recorded(Recorded {
                        fingerprint: held.fingerprint,
                        status: RecordStatus::Pending,
                        payload: Vec::new(),
                    })
                }
                Some(held) if held.ends > now => LeaseClaim::InFlight {
                    retry_after: held.ends - now,
                },
                Some(held) => {
                    held.token = held.token.wrapping_add(1);
                    held.ends = now + lease;
                    LeaseClaim::Execute {
                        ticket: Ticket::new(id, held.token, ticket_ms(held.ends)),
                        steps: held
                            .steps
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                    }
                }
                None => {
                    let token = random_token();
                    leases.insert(
                        id,
                        Lease {
                            token,
                            fingerprint: req.fingerprint(),
                            ends: now + lease,
                            steps: HashMap::new(),
                        },
                    );
                    LeaseClaim::Execute {
                        ticket: Ticket::new(id, token, ticket_ms(now + lease)),
                        steps: Vec::new(),
                    }
                }
            };
            Ok(claim)
        })
    }

    fn renew<'a>(
        &'a self,
        ticket: &'a Ticket,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { self.holding(ticket, |held| held.ends = Instant::now() + lease) })
    }

    fn record_step<'a>(
        &'a self,
        ticket: &'a Ticket,
        name: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.holding(ticket, |held| {
                held.steps.insert(name.to_owned(), payload.to_vec());
            })
        })
    }

    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        req: &'a Request,
        status: RecordStatus,
        payload: &'a [u8],
        _steps: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        // The steps go with the lease, whichever they are.
        Box::pin(async move {
            self.holding(ticket, |_| ())?;
            self.leases().remove(&ticket.id);
            self.records()
                .insert(ticket.id, Entry::new(req, status, payload));
            Ok(())
        })
    }

    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { self.holding(ticket, |held| held.ends = Instant::now()) })
    }
}
