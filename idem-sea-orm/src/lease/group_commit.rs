//! Group commit of lease mode's one-statement writes on SQLite.
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
//! commits together, so only SQLite groups.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, QueryResult, RuntimeErr, Statement,
};
use tokio::sync::oneshot;

use crate::atomic::begin;

/// One of lease mode's writes that commit on their own.
pub(crate) enum Write {
    /// The claim statement; when it returns no row, `read` reads the row it ran into.
    Claim { claim: Statement, read: Statement },
    /// A fenced update (renewal, completion, release).
    Update(Statement),
}

/// What a [`Write`] returned.
pub(crate) enum Written {
    /// The claimed or found row (`None`: none, the key was purged in between).
    Row(Option<QueryResult>),
    /// Rows the update changed.
    Changed(u64),
}

async fn apply<C: ConnectionTrait>(c: &C, write: Write) -> Result<Written, DbErr> {
    match write {
        Write::Claim { claim, read } => match c.query_one_raw(claim).await? {
            Some(row) => Ok(Written::Row(Some(row))),
            None => c.query_one_raw(read).await.map(Written::Row),
        },
        Write::Update(update) => c
            .execute_raw(update)
            .await
            .map(|done| Written::Changed(done.rows_affected())),
    }
}

type Reply = oneshot::Sender<Result<Written, DbErr>>;

/// The writes of one pool waiting for the group being applied.
#[derive(Default)]
struct Queue {
    waiting: Vec<(Write, Reply)>,
    /// Whether a group is being applied: a write that arrives meanwhile waits for the next.
    applying: bool,
}

type Shared = Arc<Mutex<Queue>>;

fn lock(queue: &Shared) -> std::sync::MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The queue of `db`'s pool (one per pool: its clones share it).
fn queue_of(db: &DatabaseConnection) -> Shared {
    static QUEUES: LazyLock<Mutex<HashMap<usize, Shared>>> = LazyLock::new(Default::default);
    let pool = pool_identity(db);
    let mut queues = QUEUES.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(queues.entry(pool).or_default())
}

fn pool_identity(db: &DatabaseConnection) -> usize {
    #[cfg(feature = "sqlite")]
    if let sea_orm::DatabaseConnectionType::SqlxSqlitePoolConnection(_) = &db.inner {
        return std::ptr::from_ref(db.get_sqlite_connection_pool().options()) as usize;
    }
    // Not a pool of its own (a mock, a proxy): one queue for all of them.
    let _ = db;
    0
}

/// Applies `write` on `db`: at once when nothing else is being written (SQLite) or always
/// (the other backends); else with the writes that arrive meanwhile, in one transaction.
pub(crate) async fn write(db: &DatabaseConnection, write: Write) -> Result<Written, DbErr> {
    if db.get_database_backend() != DbBackend::Sqlite {
        return apply(db, write).await;
    }
    let queue = queue_of(db);
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
            let written = apply(db, write).await;
            hand_on(db, &queue);
            written
        }
        Err(answer) => answer.await.unwrap_or_else(|_| {
            Err(DbErr::Custom(
                "the group commit applying this write ended without an answer".into(),
            ))
        }),
    }
}

/// After a group: lets the next group's writes be applied by a task of their own, or marks
/// the queue idle.
fn hand_on(db: &DatabaseConnection, queue: &Shared) {
    let mut waiting = lock(queue);
    if waiting.waiting.is_empty() {
        waiting.applying = false;
        return;
    }
    let group = std::mem::take(&mut waiting.waiting);
    drop(waiting);
    let (db, queue) = (db.clone(), Arc::clone(queue));
    tokio::spawn(async move {
        apply_group(&db, group).await;
        hand_on(&db, &queue);
    });
}

/// Applies `group` in one transaction and answers each write once it committed.
async fn apply_group(db: &DatabaseConnection, group: Vec<(Write, Reply)>) {
    let tx = match begin(db).await {
        Ok(tx) => tx,
        Err(e) => {
            // No transaction: each write on its own, as without grouping.
            tracing::debug!(error = %e, "group commit: BEGIN failed, writing one by one");
            for (write, reply) in group {
                let _ = reply.send(apply(db, write).await);
            }
            return;
        }
    };
    let mut answers = Vec::with_capacity(group.len());
    for (write, reply) in group {
        // A failed statement fails its own write; SQLite keeps the transaction for the rest.
        answers.push((apply(&tx, write).await, reply));
    }
    match tx.commit().await {
        Ok(()) => {
            for (written, reply) in answers {
                let _ = reply.send(written);
            }
        }
        Err(e) => {
            let message = e.to_string();
            for (_, reply) in answers {
                let _ = reply.send(Err(DbErr::Conn(RuntimeErr::Internal(format!(
                    "the group commit failed: {message}"
                )))));
            }
        }
    }
}
