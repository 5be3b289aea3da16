//! [`resources_operation`]: NeMo Gym's context manager, for work that is not a tower service.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

#[cfg(doc)]
use crate::attributes::Rejection;
use crate::attributes::{Executor, Operation, SeriesKey};
use crate::classify::OperationOutput;
use crate::diagnostics::{self, Mistake};
use crate::limit::Acquire;
use crate::metrics::OperationMetrics;
use crate::operation::{scope, Asking, Ending, Lifecycle};
use crate::rejected::Rejected;

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
/// own. Its permit is held for exactly the work; [`OperationMetrics::resources_operation_with`] lends it to the
/// work. Called from work that already holds a place of `limit` (a handler behind a layer on the
/// same limit), it runs on that place rather than wait for a second one, and records nothing
/// of its own (see [one limit twice](crate#one-limit-twice-on-a-requests-path)). A limit that cannot admit the operation (a closed semaphore, a store out of reach)
/// turns it away: `Err(Rejected)` with [`Rejection::Unavailable`](Rejection::Unavailable),
/// never a panic or a hang.
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
        if holds(&limit) {
            // On the place that an operation around it holds, which records it.
            return Ok(work.await);
        }
        let (permit, running) = self.admit(&limit, operation, executor).await?;
        // The permit is held here, and the operation, declared after it, records its end and
        // tells the limit before the permit goes back, however the work ends.
        let mut running = Running {
            operation: running,
            permit: &permit,
        };
        let output = run(work, &mut running).await;
        drop(running);
        drop(permit);
        Ok(output)
    }

    /// [`resources_operation`] for work that uses its permit: `work` is given the permit (a
    /// resource checked out of a pool, say), and the permit goes back when the work is done.
    ///
    /// ```
    /// use tokio::sync::Semaphore;
    /// use tower_resources_operation::{Executor, Operation, OperationMetrics};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let slots = Semaphore::new(3);
    /// let held = OperationMetrics::global()
    ///     .resources_operation_with(&slots, Operation::Tool, Executor::Thread, async |permit| {
    ///         Ok::<_, std::io::Error>(permit.num_permits())
    ///     })
    ///     .await??;
    /// assert_eq!(held, 1);
    /// # Ok(())
    /// # }
    /// ```
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
        let (permit, running) = self.admit(&limit, operation, executor).await?;
        let mut running = Running {
            operation: running,
            permit: &permit,
        };
        let output = run(work(&permit), &mut running).await;
        drop(running);
        drop(permit);
        Ok(output)
    }

    /// Takes the permit of an operation of (`operation`, `executor`) from `limit`, waiting for it
    /// if it has to: the permit, and the admitted operation that borrows its place, or the
    /// rejection.
    async fn admit<A: Acquire>(
        &self,
        limit: &A,
        operation: Operation,
        executor: Executor,
    ) -> Result<(A::Permit, Lifecycle<A>), Rejected> {
        let capacity = limit.capacity();
        let series = self.series(operation, executor, capacity.as_ref());
        let mut asked = Lifecycle::new();
        let wait = pin!(limit.acquire());
        let mut asking = InPlace {
            limit,
            wait,
            waiting: false,
        };
        let records = series.is_some() || limit.hears_ends();
        // Turned away, the caller gets the limit's error as it was made (a failed limit's
        // cause is its `source()`).
        let key = SeriesKey::new(operation, executor);
        poll_fn(|cx| {
            asked.poll_admit(
                &mut asking,
                series,
                records,
                key,
                || capacity.as_ref(),
                || None,
                cx,
            )
        })
        .await?;
        // Its work is called at once, with no deadline of the caller's.
        Ok(asked
            .called(|| ((), None), || capacity.as_ref())
            .lend_permit())
    }
}

/// Whether the work around this call holds a place of `limit` (a handler that calls
/// `resources_operation` on the limit its own layer holds): the call then runs on that place,
/// and says so once.
fn holds<A: Acquire>(limit: &A) -> bool {
    let held = limit.id().is_some_and(scope::holds);
    if held {
        diagnostics::report(Mistake::NestedLimit, || {
            let name = limit.capacity().and_then(|c| c.name().map(str::to_owned));
            match name {
                Some(name) => format!(": the limit {name:?}"),
                None => format!(": the limit {}", std::any::type_name::<A>()),
            }
        });
    }
    held
}

/// Runs `work` as the admitted operation `running`, and ends it with the work's outcome.
/// An operation whose permit its work borrows: dropped before its work returned (the caller
/// went away), it ends as cancelled and tells its limit through the permit.
struct Running<'p, A: Acquire> {
    operation: Lifecycle<A>,
    permit: &'p A::Permit,
}

impl<A: Acquire> Drop for Running<'_, A> {
    fn drop(&mut self) {
        self.operation
            .end_lent(self.permit, Ending::Dropped, |()| None);
    }
}

async fn run<F, A>(work: F, running: &mut Running<'_, A>) -> F::Output
where
    F: Future,
    F::Output: OperationOutput,
    A: Acquire,
{
    let output = Scoped {
        work,
        running: &mut *running,
    }
    .await;
    let permit = running.permit;
    running
        .operation
        .end_lent(permit, Ending::Returned, |()| Some(output.outcome()));
    output
}

pin_project! {
    struct Scoped<'a, 'p, F, A: Acquire> {
        #[pin]
        work: F,
        running: &'a mut Running<'p, A>,
    }
}

impl<F: Future, A: Acquire> Future for Scoped<'_, '_, F, A> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let work = this.work;
        let running = &mut **this.running;
        let permit = running.permit;
        running.operation.run_lent(Some(permit), || work.poll(cx))
    }
}

/// A wait on the `async` block's stack: `limit`'s [`acquire`](Acquire::acquire) future, made up
/// front and polled only if the operation has to wait.
struct InPlace<'a, L, F> {
    limit: &'a L,
    wait: Pin<&'a mut F>,
    waiting: bool,
}

impl<L, F> Asking for InPlace<'_, L, F>
where
    L: Acquire,
    F: Future<Output = Result<L::Permit, Rejected>>,
{
    type Permit = L::Permit;

    fn is_waiting(&self) -> bool {
        self.waiting
    }

    fn try_now(&mut self) -> Option<Result<L::Permit, Rejected>> {
        self.limit.try_acquire()
    }

    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<L::Permit, Rejected>> {
        let polled = self.wait.as_mut().poll(cx);
        self.waiting = polled.is_pending();
        polled
    }
}
