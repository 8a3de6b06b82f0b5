//! Running a call to completion on a task of its own, so that a client that hangs up stops
//! only the wait for the answer, never the call.

use std::future::Future;
use std::panic::{AssertUnwindSafe, resume_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::Instrument;

/// Runs `future` to completion on a tokio task of its own (inside the current tracing span)
/// and waits for its output: dropping the returned future stops the wait, never the work.
/// The adapters' `respond` runs calls this way; use it for other handler work that must not be cut off
/// mid-statement when a client disconnects, such as a read that shares the pool.
///
/// A panic in `future` is resumed in the caller. Outside a tokio runtime `future` runs in
/// place. A future answered at its first poll never leaves the caller ([`spawn_and_wait`]).
pub fn run_to_completion<F>(future: F) -> impl Future<Output = F::Output> + Send + 'static
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    // Boxed at once: a call's future can be large (tens of KiB in debug builds), and holding
    // it inline in every wrapping future, or moving it by value down the spawn path,
    // multiplies that and overflows small stacks (test threads).
    let future = Box::pin(future);
    async move {
        match spawn_and_wait(future).await {
            Ok(output) => output,
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                // Nothing aborts the task; only a runtime shutting down cancels it, and that
                // drops the waiting handler too.
                Err(e) => unreachable!("a call's task was cancelled: {e}"),
            },
        }
    }
}

/// Runs `future` on a tokio task (inside the current tracing span) and waits for it: the
/// work finishes even if the wait is dropped. `Err` is the task's panic. Outside a tokio
/// runtime `future` runs in place.
///
/// `future` is polled once in place first: a call answered without waiting (a replay of an
/// answer this process keeps in memory, a refused key) needs no task, and on a multi-threaded
/// runtime handing it to one costs more than the answer (measured: a layer's replay from
/// memory took 50-58 µs spawned, 13 µs in place). A call that waits is moved to its task
/// within that same poll, before anything can drop it, so only the wait is ever cancelled.
pub fn spawn_and_wait<F>(
    future: Pin<Box<F>>,
) -> impl Future<Output = Result<F::Output, tokio::task::JoinError>> + Send + 'static
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    SpawnAndWait::First(Some(future))
}

/// [`spawn_and_wait`]'s future: a pointer to the call or to its task, nothing inline.
enum SpawnAndWait<F: Future> {
    /// Not polled yet.
    First(Option<Pin<Box<F>>>),
    /// Outside a tokio runtime: polled in place to the end.
    InPlace(Pin<Box<F>>),
    /// On its task.
    Spawned(tokio::task::JoinHandle<F::Output>),
}

impl<F> Future for SpawnAndWait<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = Result<F::Output, tokio::task::JoinError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Every field is a pointer (a box, a task handle): moving them is fine.
        let this = self.get_mut();
        loop {
            match this {
                SpawnAndWait::First(slot) => {
                    let Some(mut future) = slot.take() else {
                        return Poll::Pending; // unreachable: `First` is left at once
                    };
                    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                        *this = SpawnAndWait::InPlace(future);
                        continue;
                    };
                    // In the caller's task and tracing span, as a spawned task would be in
                    // its span.
                    let polled =
                        std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
                    let task = match polled {
                        Ok(Poll::Ready(output)) => return Poll::Ready(Ok(output)),
                        Ok(Poll::Pending) => runtime.spawn(future.in_current_span()),
                        // The panic as a task's, as if the first poll had run on the task.
                        Err(panic) => runtime.spawn(async move { resume_unwind(panic) }),
                    };
                    *this = SpawnAndWait::Spawned(task);
                }
                SpawnAndWait::InPlace(future) => return future.as_mut().poll(cx).map(Ok),
                SpawnAndWait::Spawned(task) => return Pin::new(task).poll(cx),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call answered without waiting runs in place, on the caller's task.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_answered_at_once_runs_on_the_callers_task() {
        // A test's body is no task: the caller is one.
        let caller = tokio::spawn(async {
            let caller = tokio::task::id();
            let ran_on = spawn_and_wait(Box::pin(async { tokio::task::id() })).await;
            (caller, ran_on.expect("answered"))
        });
        let (caller, ran_on) = caller.await.expect("caller");
        assert_eq!(ran_on, caller);
    }

    /// A call that waits moves to a task of its own: its wait, dropped after the first poll,
    /// does not stop it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_that_waits_finishes_on_its_own_task_when_its_wait_is_dropped() {
        tokio::spawn(waits_and_finishes()).await.expect("caller");
    }

    async fn waits_and_finishes() {
        let caller = tokio::task::id();
        let (open, gate) = tokio::sync::oneshot::channel::<()>();
        let (done, finished) = tokio::sync::oneshot::channel();
        let mut wait = Box::pin(spawn_and_wait(Box::pin(async move {
            let _ = gate.await;
            let _ = done.send(tokio::task::id());
        })));
        // One poll: the call starts, waits at the gate, and is handed to its task.
        let polled = std::future::poll_fn(|cx| Poll::Ready(wait.as_mut().poll(cx))).await;
        assert!(polled.is_pending());
        drop(wait);
        let _ = open.send(());
        let finished_on = tokio::time::timeout(std::time::Duration::from_secs(5), finished)
            .await
            .expect("the call finished")
            .expect("and said where");
        assert_ne!(finished_on, caller, "on a task of its own");
    }

    /// A panic in the first poll reaches the caller as the task's panic.
    #[tokio::test]
    async fn a_panic_in_the_first_poll_is_the_tasks_panic() {
        let panicked = spawn_and_wait(Box::pin(async {
            panic!("at once");
            #[allow(unreachable_code)]
            0_u8
        }))
        .await;
        let panic = panicked.expect_err("a panic").into_panic();
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"at once"));
    }
}
