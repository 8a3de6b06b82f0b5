//! Group commit of lease mode's one-statement writes on SQLite, once for every store.
//!
//! SQLite has one writer, and each commit waits for its WAL frames to reach the disk: a lease
//! claim and a completion are a commit each, so concurrent calls queue for the disk one
//! commit at a time (P11: 16 clients ran no faster than one). Here the writes that arrive
//! while one is being applied wait together, and the next of them to arrive leads: it applies
//! them all in one transaction, so one commit (one flush) serves the whole group. A write that
//! finds nobody applying applies itself at once, outside a transaction, as before: a lone
//! call pays nothing for this.
//!
//! Every write answers only once its group has committed. Writes in one group are
//! independent statements on different keys, or duplicates of one key, which then see each
//! other as they would one after another. PostgreSQL and MySQL already flush concurrent
//! commits together, so a store groups only on SQLite. A store supplies how one write, and
//! one group in a transaction, are applied on its pool ([`GroupCommit`]); the queue, who
//! leads and who waits are here.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use tokio::sync::oneshot;

use crate::{Bound, ClaimRow};

/// One of lease mode's writes that commit on their own.
#[derive(Debug)]
pub enum LeaseWrite {
    /// The claim statement; when it returns no row, `read` reads the row it ran into.
    Claim {
        /// [`LeaseStep::at_once`](crate::LeaseStep::at_once)'s claim.
        claim: Bound<'static>,
        /// Its read of the row the claim ran into.
        read: Bound<'static>,
    },
    /// A fenced update (renewal, completion, release).
    Update(Bound<'static>),
}

/// What a [`LeaseWrite`] returned.
#[derive(Debug)]
pub enum LeaseWritten {
    /// The claimed or found row (`None`: none, the key was purged in between).
    Row(Option<ClaimRow>),
    /// Rows the update changed.
    Changed(u64),
}

/// How a store applies [`LeaseWrite`]s on one pool: alone (auto-committed), or in a
/// transaction of its own. Cloning shares the pool.
pub trait GroupCommit: Clone + Send + Sync + 'static {
    /// The driver's error.
    type Error: Send + std::fmt::Display + 'static;
    /// A transaction on the pool.
    type Tx: Send;

    /// Applies `write` on its own.
    fn apply(
        &self,
        write: LeaseWrite,
    ) -> impl Future<Output = Result<LeaseWritten, Self::Error>> + Send;

    /// Begins a write transaction (SQLite: `BEGIN IMMEDIATE`).
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, Self::Error>> + Send;

    /// Applies `write` in `tx`.
    fn apply_in(
        tx: &mut Self::Tx,
        write: LeaseWrite,
    ) -> impl Future<Output = Result<LeaseWritten, Self::Error>> + Send;

    /// Commits `tx`.
    fn commit(tx: Self::Tx) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The error of a write whose group could not answer it: `why`.
    fn group_failed(why: String) -> Self::Error;
}

/// Applies `group` in one transaction and answers each write, in order, once it committed: a
/// failed statement fails its own write (SQLite keeps the transaction for the rest), a failed
/// commit every write. Without a transaction (`BEGIN` failed), each on its own.
async fn apply_group<G: GroupCommit>(
    store: &G,
    group: Vec<LeaseWrite>,
) -> Vec<Result<LeaseWritten, G::Error>> {
    let mut answers = Vec::with_capacity(group.len());
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            tracing::debug!(error = %e, "group commit: BEGIN failed, writing one by one");
            for write in group {
                answers.push(store.apply(write).await);
            }
            return answers;
        }
    };
    for write in group {
        answers.push(G::apply_in(&mut tx, write).await);
    }
    match G::commit(tx).await {
        Ok(()) => answers,
        Err(e) => {
            let why = format!("the group commit failed: {e}");
            answers
                .iter()
                .map(|_| Err(G::group_failed(why.clone())))
                .collect()
        }
    }
}

type Reply<E> = oneshot::Sender<Result<LeaseWritten, E>>;

/// The writes of one pool waiting for the group being applied.
struct Queue<E> {
    waiting: Vec<(LeaseWrite, Reply<E>)>,
    /// Whether a group is being applied: a write that arrives meanwhile waits for the next.
    applying: bool,
}

type Shared<E> = Arc<Mutex<Queue<E>>>;

fn lock<E>(queue: &Shared<E>) -> std::sync::MutexGuard<'_, Queue<E>> {
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The queue of the pool `pool` (an identity its clones share) of store type `G`.
fn queue_of<G: GroupCommit>(pool: usize) -> Shared<G::Error> {
    type Queues = HashMap<(TypeId, usize), Arc<dyn Any + Send + Sync>>;
    static QUEUES: LazyLock<Mutex<Queues>> = LazyLock::new(Default::default);
    let mut queues = QUEUES.lock().unwrap_or_else(PoisonError::into_inner);
    let queue = queues.entry((TypeId::of::<G>(), pool)).or_insert_with(|| {
        let queue: Shared<G::Error> = Arc::new(Mutex::new(Queue {
            waiting: Vec::new(),
            applying: false,
        }));
        queue
    });
    Arc::clone(queue)
        .downcast::<Mutex<Queue<G::Error>>>()
        .unwrap_or_else(|_| unreachable!("each queue is keyed by its store's type"))
}

/// Applies `write` through `store`, whose pool is `pool` (an identity its clones share): at
/// once when nothing else is being written, else with the writes that arrive meanwhile, in
/// one transaction. For SQLite; a store calls [`GroupCommit::apply`] directly elsewhere.
pub async fn write_grouped<G: GroupCommit>(
    store: &G,
    pool: usize,
    write: LeaseWrite,
) -> Result<LeaseWritten, G::Error>
where
    G::Error: Send,
{
    let queue = queue_of::<G>(pool);
    let queued = {
        let mut waiting = lock(&queue);
        if waiting.applying {
            let (reply, answer) = oneshot::channel();
            waiting.waiting.push((write, reply));
            Err(answer)
        } else {
            waiting.applying = true;
            Ok(write)
        }
    };
    match queued {
        Ok(write) => {
            let written = store.apply(write).await;
            hand_on(store, queue);
            written
        }
        Err(answer) => answer.await.unwrap_or_else(|_| {
            let why = "the group commit applying this write ended without an answer";
            Err(G::group_failed(why.to_owned()))
        }),
    }
}

/// After a group: lets the next group's writes be applied by a task of their own, or marks
/// the queue idle.
fn hand_on<G: GroupCommit>(store: &G, queue: Shared<G::Error>) {
    let mut waiting = lock(&queue);
    if waiting.waiting.is_empty() {
        waiting.applying = false;
        return;
    }
    let group = std::mem::take(&mut waiting.waiting);
    drop(waiting);
    let store = store.clone();
    tokio::spawn(async move {
        let (writes, replies): (Vec<_>, Vec<_>) = group.into_iter().unzip();
        let answers = apply_group(&store, writes).await;
        for (answer, reply) in answers.into_iter().zip(replies) {
            let _ = reply.send(answer);
        }
        hand_on(&store, queue);
    });
}
