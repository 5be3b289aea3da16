//! [`resources_operation`]: the seed's context manager, for work that is not a tower service.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::{Semaphore, TryAcquireError};

use crate::classify::OperationOutput;
use crate::metrics::Running;
use crate::service::semaphore_closed;
use crate::{scope, Executor, Operation, OperationMetrics, Outcome};

/// Runs `work` inside `limit` and reports it through [`OperationMetrics::global`]; returns the
/// work's output.
///
/// The Rust form of the seed's `async with resources_operation(limit, operation, executor) as op`.
/// The outcome follows the layer's rules: an `Err` output is `error` (or `timeout`, see
/// [`OperationOutput`]), dropping the returned future is `cancelled`, a panic in `work` is
/// `crashed` and goes on unchanged, and [`set_outcome`](crate::set_outcome) called inside `work`
/// wins over all of them.
///
/// `limit` is any `&Semaphore`, so `&Arc<Semaphore>` works too. It must stay open: waiting on a
/// closed semaphore panics with a message that says so instead of hanging.
///
/// ```
/// use tokio::sync::Semaphore;
/// use tower_resources_operation::{resources_operation, set_outcome, Executor, Operation, Outcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let verifiers = Semaphore::new(2);
/// let verdict: Result<bool, std::io::Error> =
///     resources_operation(&verifiers, Operation::Verify, Executor::Subprocess, async {
///         let timed_out = false; // run the verifier here
///         if timed_out {
///             set_outcome(Outcome::Timeout);
///         }
///         Ok(true)
///     })
///     .await;
/// assert!(verdict.unwrap());
/// # }
/// ```
pub async fn resources_operation<F>(
    limit: &Semaphore,
    operation: Operation,
    executor: Executor,
    work: F,
) -> F::Output
where
    F: Future,
    F::Output: OperationOutput,
{
    OperationMetrics::global()
        .resources_operation(limit, operation, executor, work)
        .await
}

impl OperationMetrics {
    /// [`resources_operation`] reporting through these metrics instead of the global ones.
    pub async fn resources_operation<F>(
        &self,
        limit: &Semaphore,
        operation: Operation,
        executor: Executor,
        work: F,
    ) -> F::Output
    where
        F: Future,
        F::Output: OperationOutput,
    {
        let series = self.series(operation, executor);
        let (_permit, running) = match limit.try_acquire() {
            Ok(permit) => (permit, series.as_ref().map(|series| series.admit(None))),
            Err(TryAcquireError::NoPermits) => {
                // Dropping this future while it waits drops `waiting`: the wait is taken back.
                let waiting = series.as_ref().map(|series| series.wait());
                let Ok(permit) = limit.acquire().await else {
                    drop(waiting);
                    semaphore_closed()
                };
                let running = series.as_ref().map(|series| series.admit(waiting));
                (permit, running)
            }
            Err(TryAcquireError::Closed) => semaphore_closed(),
        };
        match running {
            None => work.await,
            Some(running) => Scoped { work, running }.await,
        }
    }
}

pin_project! {
    /// Polls the work as the current operation, and ends the operation with the work's outcome.
    struct Scoped<F> {
        #[pin]
        work: F,
        running: Running,
    }
}

impl<F> Future for Scoped<F>
where
    F: Future,
    F::Output: OperationOutput,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let work = this.work;
        let output = ready!(scope::enter(this.running, || work.poll(cx)));
        let outcome = if this.running.chosen_outcome().is_some() {
            Outcome::Ok // ignored: the chosen outcome wins in `finish`
        } else {
            // A panicking `outcome()` costs the operation its outcome, not the work's output.
            catch_unwind(AssertUnwindSafe(|| output.outcome())).unwrap_or(Outcome::Error)
        };
        this.running.finish(outcome);
        Poll::Ready(output)
    }
}
