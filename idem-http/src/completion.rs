//! Running a call to completion on a task of its own, so that a client that hangs up stops
//! only the wait for the answer, never the call.

use std::future::Future;
use std::pin::Pin;

/// Runs `future` to completion on a tokio task of its own (inside the current tracing span)
/// and waits for its output: dropping the returned future stops the wait, never the work.
/// The adapters' `respond` runs calls this way; use it for other handler work that must not be cut off
/// mid-statement when a client disconnects, such as a read that shares the pool.
///
/// A panic in `future` is resumed in the caller. Outside a tokio runtime `future` runs in
/// place.
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
pub async fn spawn_and_wait<F>(future: Pin<Box<F>>) -> Result<F::Output, tokio::task::JoinError>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Ok(future.await);
    };
    runtime
        .spawn(tracing::Instrument::in_current_span(future))
        .await
}
