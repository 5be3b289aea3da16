//! [`ResourcesOperation`]: where the permit is taken and the wait is timed.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;
use tower_service::Service;

use crate::classify::ClassifyOutcome;
use crate::future::ResponseFuture;
use crate::metrics::{Running, Series, Waiting};
use crate::{scope, Outcome};

/// A service limited to a number of operations at once, made by
/// [`ResourcesOperationLayer`](crate::ResourcesOperationLayer).
///
/// It behaves as tower's `ConcurrencyLimit`: `poll_ready` takes a permit (waiters are served
/// first come, first served), `call` spends it, and the permit goes back when the response
/// future is dropped (which `.await` does once it completes), or when a service holding an unused
/// permit is dropped. A clone shares the limit but starts without a permit.
pub struct ResourcesOperation<S, C> {
    inner: S,
    semaphore: PollSemaphore,
    classifier: C,
    /// `None` when metrics are disabled, so the disabled path checks one field. Declared before
    /// `permit` so that, dropped together, an admitted operation records its end (`cancelled`)
    /// before the permit goes back.
    tracked: Option<Tracked>,
    /// A permit taken by `poll_ready` and not yet spent by `call`.
    permit: Option<OwnedSemaphorePermit>,
}

/// The metrics side of a service: its series and the operation it is preparing.
#[derive(Debug)]
struct Tracked {
    series: Series,
    /// When the first `poll_ready` that had to wait was made; counted in `queued` while set.
    waiting_since: Option<NonZeroU64>,
    /// The operation admitted by the permit that `poll_ready` took; empty until then.
    running: Running,
}

impl Tracked {
    fn new(series: Series) -> Self {
        Self {
            series,
            waiting_since: None,
            running: Running::EMPTY,
        }
    }

    /// `poll_ready` has to wait: counts the operation as queued, from the first such call.
    fn wait(&mut self) {
        if self.waiting_since.is_none() {
            let since = self.series.start_waiting();
            self.waiting_since = Some(NonZeroU64::new(since).unwrap_or(NonZeroU64::MIN));
        }
    }

    /// The wait ends without a permit: takes the operation out of `queued`.
    fn stop_waiting(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            drop(Waiting::new(&self.series, since.get()));
        }
    }

    /// `poll_ready` took the permit: the operation is admitted.
    fn admit(&mut self) {
        let waited = self
            .waiting_since
            .take()
            .map(|since| Waiting::new(&self.series, since.get()));
        self.running = self.series.admit(waited);
    }

    /// `poll_ready` of a service that records metrics: the wait is counted and timed, and the
    /// inner `poll_ready` runs as the admitted operation. Kept out of line so that the disabled
    /// path, which is tower's, stays small enough to inline.
    #[inline(never)]
    fn poll_ready<S, Request>(
        &mut self,
        semaphore: &mut PollSemaphore,
        permit: &mut Option<OwnedSemaphorePermit>,
        inner: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), S::Error>>
    where
        S: Service<Request>,
    {
        if permit.is_none() {
            match semaphore.poll_acquire(cx) {
                Poll::Ready(Some(acquired)) => {
                    self.admit();
                    *permit = Some(acquired);
                }
                Poll::Pending => {
                    self.wait();
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    self.stop_waiting();
                    semaphore_closed()
                }
            }
        }

        let ready = if self.running.is_recording() {
            // A panic in the inner `poll_ready` ends the operation as `crashed`.
            scope::enter(&mut self.running, || inner.poll_ready(cx))
        } else {
            inner.poll_ready(cx)
        };
        if let Poll::Ready(Err(_)) = ready {
            // The inner service failed before the operation could run: end it as an error and
            // give the permit back, as the service will not be called.
            self.running.finish(Outcome::Error);
            *permit = None;
        }
        ready
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.stop_waiting();
    }
}

impl<S, C> ResourcesOperation<S, C> {
    pub(crate) fn new(
        inner: S,
        semaphore: Arc<Semaphore>,
        series: Option<Series>,
        classifier: C,
    ) -> Self {
        Self {
            inner,
            semaphore: PollSemaphore::new(semaphore),
            classifier,
            tracked: series.map(Tracked::new),
            permit: None,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service; a permit this service held goes back.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, C, Request> Service<Request> for ResourcesOperation<S, C>
where
    S: Service<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, C>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let Some(tracked) = &mut self.tracked {
            return tracked.poll_ready(&mut self.semaphore, &mut self.permit, &mut self.inner, cx);
        }
        // Metrics disabled: tower's limit, and nothing else.
        if self.permit.is_none() {
            match ready!(self.semaphore.poll_acquire(cx)) {
                Some(permit) => self.permit = Some(permit),
                None => semaphore_closed(),
            }
        }
        let ready = self.inner.poll_ready(cx);
        if let Poll::Ready(Err(_)) = ready {
            // The service will not be called: give the permit back.
            self.permit = None;
        }
        ready
    }

    #[inline]
    fn call(&mut self, request: Request) -> Self::Future {
        let permit = self.permit.take().expect(
            "ResourcesOperation::call without a permit: poll_ready must return Ready(Ok(())) \
             before each call (use tower::ServiceExt::ready or oneshot)",
        );
        let mut running = match &mut self.tracked {
            Some(tracked) => std::mem::replace(&mut tracked.running, Running::EMPTY),
            None => Running::EMPTY,
        };
        let future = if running.is_recording() {
            call_in_scope(&mut self.inner, &mut running, request)
        } else {
            self.inner.call(request)
        };
        ResponseFuture::new(future, running, permit, self.classifier.clone())
    }
}

/// The inner `call` of an operation that records metrics, run as the current operation. Kept
/// out of line so that the disabled path, which is tower's, stays small enough to inline.
#[inline(never)]
fn call_in_scope<S, Request>(inner: &mut S, running: &mut Running, request: Request) -> S::Future
where
    S: Service<Request>,
{
    scope::enter(running, || inner.call(request))
}

/// Panics for a limit whose semaphore was closed. Kept out of line: it never happens in a
/// healthy server, and its message is the whole diagnosis.
#[inline(never)]
pub(crate) fn semaphore_closed() -> ! {
    panic!(
        "tower-resources-operation: the limit's semaphore was closed, so no permit can be \
         taken; a semaphore given to with_semaphore (or resources_operation) must stay open \
         while services use it"
    )
}

impl<S: Clone, C: Clone> Clone for ResourcesOperation<S, C> {
    /// Shares the limit and the metrics; the clone starts without a permit.
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            semaphore: self.semaphore.clone(),
            classifier: self.classifier.clone(),
            tracked: self
                .tracked
                .as_ref()
                .map(|tracked| Tracked::new(tracked.series.clone())),
            permit: None,
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for ResourcesOperation<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResourcesOperation")
            .field("inner", &self.inner)
            .field("metrics_enabled", &self.tracked.is_some())
            .field(
                "waiting",
                &self
                    .tracked
                    .as_ref()
                    .is_some_and(|t| t.waiting_since.is_some()),
            )
            .field("has_permit", &self.permit.is_some())
            .finish()
    }
}

#[cfg(feature = "tonic")]
impl<S: tonic::server::NamedService, C> tonic::server::NamedService for ResourcesOperation<S, C> {
    /// The wrapped gRPC service's name, so the layered service can go to tonic's `add_service`.
    const NAME: &'static str = S::NAME;
}
