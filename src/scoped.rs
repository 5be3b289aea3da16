//! [`resources_operation`]: NeMo Gym's context manager, for work that is not a tower service.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use crate::acquire::limit_failed;
use crate::classify::OperationOutput;
use crate::lifecycle::{self, Running, Waiting};
use crate::metrics::Series;
use crate::{scope, Acquire, AcquireError, Executor, Operation, OperationMetrics, Rejected};

/// Runs `work` inside `limit` and reports it through [`OperationMetrics::global`]; returns the
/// work's output, or [`Rejected`] if the limit turned the operation away.
///
/// The Rust form of NeMo Gym's
/// `async with resources_operation(limit, operation, executor) as op`. The global provider is
/// looked up on every call, so the provider installed when the call is made is the one that
/// records it; when you hold an [`OperationMetrics`] (your own provider, say one with a
/// Prometheus exporter that you never install globally), call
/// [`OperationMetrics::resources_operation`] instead.
///
/// The outcome follows the layer's rules: an `Err` output is `error` (or `timeout`, see
/// [`OperationOutput`]), dropping the returned future is `cancelled`, a panic in `work` is
/// `crashed` and goes on unchanged, and [`set_outcome`](crate::set_outcome) called inside `work`
/// wins over all of them.
///
/// `limit` is any [`Acquire`]: `&Semaphore`, `&Arc<Semaphore>`, `&Limit`, or a limit of your
/// own. Its permit is held for exactly the work. A limit that cannot admit any more (a closed
/// semaphore) panics with a message that says so instead of hanging.
///
/// ```
/// use tokio::sync::Semaphore;
/// use tower_resources_operation::{resources_operation, set_outcome, Executor, Operation, Outcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let verifiers = Semaphore::new(2);
/// let verdict: Result<bool, std::io::Error> =
///     resources_operation(&verifiers, Operation::Verify, Executor::Subprocess, async {
///         let timed_out = false; // run the verifier here
///         if timed_out {
///             set_outcome(Outcome::Timeout);
///         }
///         Ok(true)
///     })
///     .await?; // `Rejected`, if the limit turned the operation away
/// assert!(verdict?);
/// # Ok(())
/// # }
/// ```
pub async fn resources_operation<A, F>(
    limit: A,
    operation: Operation,
    executor: Executor,
    work: F,
) -> Result<F::Output, Rejected>
where
    A: Acquire,
    F: Future,
    F::Output: OperationOutput,
{
    OperationMetrics::global()
        .resources_operation(limit, operation, executor, work)
        .await
}

/// [`resources_operation`] for work that uses its permit: `work` is given the permit (a
/// resource checked out of a pool, say), and the permit goes back when the work is done.
///
/// ```
/// use tokio::sync::Semaphore;
/// use tower_resources_operation::{resources_operation_with, Executor, Operation};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let slots = Semaphore::new(3);
/// let held = resources_operation_with(&slots, Operation::Tool, Executor::Thread, async |permit| {
///     Ok::<_, std::io::Error>(permit.num_permits())
/// })
/// .await??;
/// assert_eq!(held, 1);
/// # Ok(())
/// # }
/// ```
pub async fn resources_operation_with<A, W, T>(
    limit: A,
    operation: Operation,
    executor: Executor,
    work: W,
) -> Result<T, Rejected>
where
    A: Acquire,
    W: AsyncFnOnce(&A::Permit) -> T,
    T: OperationOutput,
{
    OperationMetrics::global()
        .resources_operation_with(limit, operation, executor, work)
        .await
}

impl OperationMetrics {
    /// [`resources_operation`] reporting through these metrics instead of the global ones.
    ///
    /// ```
    /// use opentelemetry::metrics::MeterProvider as _;
    /// use opentelemetry_sdk::metrics::SdkMeterProvider;
    /// use tower_resources_operation::{Executor, Limit, Operation, OperationMetrics};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let provider = SdkMeterProvider::builder().build(); // with your exporter's reader
    /// let metrics = OperationMetrics::new(&provider.meter("my-server"));
    /// let judges = Limit::new(2);
    /// let grade = metrics
    ///     .resources_operation(&judges, Operation::Judge, Executor::Inline, async {
    ///         Ok::<_, std::io::Error>(7)
    ///     })
    ///     .await;
    /// assert_eq!(grade.unwrap().unwrap(), 7);
    /// # }
    /// ```
    pub async fn resources_operation<A, F>(
        &self,
        limit: A,
        operation: Operation,
        executor: Executor,
        work: F,
    ) -> Result<F::Output, Rejected>
    where
        A: Acquire,
        F: Future,
        F::Output: OperationOutput,
    {
        let (permit, running) = self.enter(&limit, operation, executor).await?;
        let output = run(work, running).await;
        drop(permit);
        Ok(output)
    }

    /// [`resources_operation_with`] reporting through these metrics instead of the global ones.
    pub async fn resources_operation_with<A, W, T>(
        &self,
        limit: A,
        operation: Operation,
        executor: Executor,
        work: W,
    ) -> Result<T, Rejected>
    where
        A: Acquire,
        W: AsyncFnOnce(&A::Permit) -> T,
        T: OperationOutput,
    {
        let (permit, running) = self.enter(&limit, operation, executor).await?;
        let output = run(work(&permit), running).await;
        drop(permit);
        Ok(output)
    }

    /// Takes the permit of an operation of (`operation`, `executor`) from `limit`, waiting for it
    /// if it has to: the operation is admitted, with what records it, or turned away.
    async fn enter<A: Acquire>(
        &self,
        limit: &A,
        operation: Operation,
        executor: Executor,
    ) -> Result<(A::Permit, Running<&Series>), Rejected> {
        let series = self.series(operation, executor, limit.capacity());
        match limit.try_acquire() {
            Some(Ok(permit)) => Ok((permit, admit(series, None))),
            Some(Err(error)) => Err(refused::<A>(series, None, &error)),
            None => {
                let waiting = series.and_then(Waiting::start);
                match limit.acquire().await {
                    Ok(permit) => Ok((permit, admit(series, waiting))),
                    Err(error) => Err(refused::<A>(series, waiting, &error)),
                }
            }
        }
    }
}

/// Runs `work` as the admitted operation that `running` records (just runs it when that records
/// nothing).
async fn run<F>(work: F, running: Running<&Series>) -> F::Output
where
    F: Future,
    F::Output: OperationOutput,
{
    if running.is_recording() {
        Scoped { work, running }.await
    } else {
        work.await
    }
}

/// The operation has its permit, after `waiting` if it waited.
fn admit<'a>(
    series: Option<&'a Series>,
    waiting: Option<Waiting<&'a Series>>,
) -> Running<&'a Series> {
    match (waiting, series) {
        (Some(waiting), _) => waiting.admit(),
        (None, Some(series)) => lifecycle::admit(series, None),
        (None, None) => Running::EMPTY,
    }
}

/// The limit admitted no operation: a rejection is returned, a failure ends the caller.
#[cold]
fn refused<A>(
    series: Option<&Series>,
    waiting: Option<Waiting<&Series>>,
    error: &AcquireError,
) -> Rejected {
    match error.rejection() {
        Some(rejection) => {
            match (waiting, series) {
                (Some(waiting), _) => waiting.reject(rejection),
                (None, Some(series)) => lifecycle::reject(series, rejection),
                (None, None) => {}
            }
            Rejected::new(rejection)
        }
        None => {
            match (waiting, series) {
                (Some(waiting), _) => drop(waiting),
                (None, Some(series)) => lifecycle::abandon(series),
                (None, None) => {}
            }
            limit_failed::<A>(error)
        }
    }
}

pin_project! {
    /// Polls the work as the current operation, and ends the operation with the work's outcome.
    struct Scoped<'a, F> {
        #[pin]
        work: F,
        running: Running<&'a Series>,
    }
}

impl<F> Future for Scoped<'_, F>
where
    F: Future,
    F::Output: OperationOutput,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let work = this.work;
        let output = ready!(scope::enter(this.running, || work.poll(cx)));
        this.running.finish_with(|| output.outcome());
        Poll::Ready(output)
    }
}
