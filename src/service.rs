//! [`ResourcesOperation`]: where the permit is taken, the wait is timed, and a rejection is
//! answered.

use std::fmt;
use std::marker::PhantomData;
use std::task::{Context, Poll};

use tower::load::Load;
use tower_service::Service;

use crate::acquire::limit_failed;
use crate::classify::MakeClassifier;
use crate::end::{Admitted, AtHead, End};
use crate::future::ResponseFuture;
use crate::lifecycle::{self, Running, Waiting};
use crate::metrics::Series;
use crate::reject::{unanswerable, Rejections, RespondRejected};
use crate::{
    scope, Acquire, AcquireError, Capacity, DefaultClassifier, Limit, Outcome, PollAcquire,
    Rejected, ResourcesOperationLayer, SharedClassifier, Unbounded,
};

/// A service limited to a number of operations at once, made by
/// [`ResourcesOperationLayer`](crate::ResourcesOperationLayer).
///
/// It behaves as tower's `ConcurrencyLimit`: `poll_ready` takes a permit (waiters are served
/// first come, first served), `call` spends it, and the permit goes back when the response
/// future is dropped (which `.await` does once it completes), or when a service holding an unused
/// permit is dropped. A clone shares the limit but starts without a permit. Where it differs:
///
/// - the limit lives in the layer value, not in each `layer()` call: what tower's
///   `GlobalConcurrencyLimitLayer` does, so the limit holds across connections;
/// - the permit also goes back when the inner `poll_ready` fails, or panics;
/// - a [bounded](crate::ResourcesOperationLayer::bounded) layer's `poll_ready` is ready for an
///   operation the limit turned away, and its `call` answers that rejection without calling the
///   inner service, as tower's `LoadShed` does.
pub struct ResourcesOperation<
    S,
    C = SharedClassifier<DefaultClassifier>,
    L: Acquire = Limit,
    R: Rejections = Unbounded,
    E = AtHead,
> {
    inner: S,
    classifier: C,
    limit: PollAcquire<L>,
    rejections: R,
    /// What `poll_ready` prepared for the next `call`.
    ready: Ready<L::Permit, R::Held>,
    /// The metrics side; `None` when metrics are disabled, so that path checks one field.
    tracked: Option<Tracked>,
    _end: PhantomData<fn() -> E>,
}

/// What the next `call` serves.
enum Ready<P, H> {
    /// Nothing yet: `poll_ready` has to take a permit first.
    Empty,
    /// A permit taken by `poll_ready`.
    Permit(P),
    /// An operation the limit turned away, for `call` to answer. Uninhabited for a layer that
    /// cannot answer one.
    Rejected(H),
}

/// The metrics side of a service: its series, and the operation it is preparing.
struct Tracked {
    series: Series,
    /// The capacity the layer was given for its limit, kept while the service lives, so that
    /// the series counts it (the metrics forget a limit nothing else describes).
    capacity: Option<Capacity>,
    /// Counted in `queued` from the first `poll_ready` that had to wait.
    waiting: Option<Waiting<Series>>,
    /// The operation admitted by the permit `poll_ready` took; empty until then.
    running: Running<Series>,
}

impl Tracked {
    fn new(series: Series, capacity: Option<Capacity>) -> Self {
        Self {
            series,
            capacity,
            waiting: None,
            running: Running::EMPTY,
        }
    }

    /// `poll_ready` has to wait: the operation counts as queued, from the first such call.
    fn wait(&mut self) {
        if self.waiting.is_none() {
            self.waiting = Waiting::start(self.series.clone());
        }
    }

    /// `poll_ready` took the permit.
    fn admit(&mut self) {
        self.running = match self.waiting.take() {
            Some(waiting) => waiting.admit(),
            None => lifecycle::admit(self.series.clone(), None),
        };
    }
}

impl<S> ResourcesOperation<S> {
    /// `inner`, limited to `max` operations at once, tagged `other`/`other` and reporting to the
    /// global meter provider installed when it first serves a request (see
    /// [`ResourcesOperationLayer::new`], whose `layer` this is).
    #[track_caller]
    pub fn new(inner: S, max: usize) -> Self {
        tower_layer::Layer::layer(&ResourcesOperationLayer::new(max), inner)
    }
}

impl<S, L> ResourcesOperation<S, SharedClassifier<DefaultClassifier>, L>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    /// `inner`, limited by `limit` (see [`ResourcesOperationLayer::with_limit`], whose `layer`
    /// this is).
    #[track_caller]
    pub fn with_limit(inner: S, limit: L) -> Self {
        tower_layer::Layer::layer(&ResourcesOperationLayer::with_limit(limit), inner)
    }
}

impl<S, C, L, R, E> ResourcesOperation<S, C, L, R, E>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    R: Rejections,
{
    pub(crate) fn from_parts(
        inner: S,
        classifier: C,
        limit: L,
        rejections: R,
        series: Option<Series>,
        capacity: Option<Capacity>,
    ) -> Self {
        Self {
            inner,
            classifier,
            limit: PollAcquire::new(limit),
            rejections,
            ready: Ready::Empty,
            tracked: series.map(|series| Tracked::new(series, capacity)),
            _end: PhantomData,
        }
    }
}

impl<S, C, L: Acquire, R: Rejections, E> ResourcesOperation<S, C, L, R, E> {
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

    /// The limit.
    pub fn limit(&self) -> &L {
        self.limit.get_ref()
    }
}

impl<S, C, L, R, E, Request> Service<Request> for ResourcesOperation<S, C, L, R, E>
where
    S: Service<Request>,
    C: MakeClassifier<Request, S::Response, S::Error>,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    R: RespondRejected<S::Response, S::Error>,
    E: End<S::Response, S::Error, C::Classifier, L::Permit>,
{
    type Response = E::Response;
    type Error = S::Error;
    type Future = ResponseFuture<
        S::Future,
        C::Classifier,
        L::Permit,
        R::Answered<Result<S::Response, S::Error>>,
        E,
    >;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self.ready {
            Ready::Empty => {
                match self
                    .limit
                    .poll_acquire_within(cx, self.rejections.queue_timeout())
                {
                    Poll::Pending => {
                        if let Some(tracked) = &mut self.tracked {
                            tracked.wait();
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(permit)) => {
                        if let Some(tracked) = &mut self.tracked {
                            tracked.admit();
                        }
                        self.ready = Ready::Permit(permit);
                    }
                    Poll::Ready(Err(error)) => return self.refused(&error),
                }
            }
            Ready::Permit(_) => {}
            Ready::Rejected(_) => return Poll::Ready(Ok(())),
        }
        if let Some(tracked) = &mut self.tracked {
            if tracked.running.is_recording() {
                return poll_inner_ready(&mut self.inner, &mut self.ready, tracked, cx);
            }
        }
        let ready = self.inner.poll_ready(cx);
        if let Poll::Ready(Err(_)) = ready {
            // The inner service will not be called: give the permit back.
            self.ready = Ready::Empty;
        }
        ready
    }

    #[inline]
    fn call(&mut self, request: Request) -> Self::Future {
        let permit = match std::mem::replace(&mut self.ready, Ready::Empty) {
            Ready::Permit(permit) => permit,
            Ready::Rejected(held) => {
                return ResponseFuture::answered(self.rejections.respond(held));
            }
            Ready::Empty => call_without_permit(),
        };
        let mut running = match &mut self.tracked {
            Some(tracked) if tracked.running.is_recording() => {
                std::mem::replace(&mut tracked.running, Running::EMPTY)
            }
            _ => return ResponseFuture::unrecorded(self.inner.call(request), permit),
        };
        let classifier = self.classifier.make_classifier(&request);
        if let Some(deadline) = self.classifier.deadline(&request) {
            running.set_deadline(deadline);
        }
        let future = call_in_scope(&mut self.inner, &mut running, request);
        ResponseFuture::called(
            future,
            Admitted {
                running,
                classifier,
                permit: Some(permit),
            },
        )
    }
}

impl<S, C, L, R, E> ResourcesOperation<S, C, L, R, E>
where
    L: Acquire,
    R: Rejections,
{
    /// The limit admitted no operation: a rejection is answered by `call` (or, for a layer that
    /// cannot answer one, ends the caller); a limit that failed ends the caller.
    #[cold]
    #[inline(never)]
    fn refused<Error>(&mut self, error: &AcquireError) -> Poll<Result<(), Error>> {
        let waiting = self.tracked.as_mut().and_then(|t| t.waiting.take());
        let series = self.tracked.as_ref().map(|t| &t.series);
        let Some(rejection) = error.rejection() else {
            match (waiting, series) {
                (Some(waiting), _) => drop(waiting),
                (None, Some(series)) => lifecycle::abandon(series),
                (None, None) => {}
            }
            limit_failed::<L>(error)
        };
        match (waiting, series) {
            (Some(waiting), _) => waiting.reject(rejection),
            (None, Some(series)) => lifecycle::reject(series, rejection),
            (None, None) => {}
        }
        match R::hold(rejection) {
            Ok(held) => {
                self.ready = Ready::Rejected(held);
                Poll::Ready(Ok(()))
            }
            Err(rejection) => unanswerable::<L>(Rejected::new(rejection)),
        }
    }
}

/// The inner `poll_ready` of an admitted operation that records metrics, run as that
/// operation: a panic ends it as `crashed` and gives its permit back (the permit is out of the
/// service while the inner service is polled); an error ends it as `error` and gives the permit
/// back too, as the inner service will not be called.
#[inline(never)]
fn poll_inner_ready<S, Request, P, H>(
    inner: &mut S,
    ready: &mut Ready<P, H>,
    tracked: &mut Tracked,
    cx: &mut Context<'_>,
) -> Poll<Result<(), S::Error>>
where
    S: Service<Request>,
{
    let permit = std::mem::replace(ready, Ready::Empty);
    let polled = scope::enter(&mut tracked.running, || inner.poll_ready(cx));
    if let Poll::Ready(Err(_)) = polled {
        tracked.running.finish(Outcome::Error);
    } else {
        *ready = permit;
    }
    polled
}

/// The inner `call` of an operation that records metrics, run as that operation.
#[inline(never)]
fn call_in_scope<S, Request>(
    inner: &mut S,
    running: &mut Running<Series>,
    request: Request,
) -> S::Future
where
    S: Service<Request>,
{
    scope::enter(running, || inner.call(request))
}

/// Panics for a `call` that no `poll_ready` prepared. Out of line: it never happens in a correct
/// program, and its message is the whole diagnosis.
#[cold]
#[inline(never)]
#[track_caller]
fn call_without_permit() -> ! {
    panic!(
        "ResourcesOperation::call without a permit: poll_ready must return Ready(Ok(())) before \
         each call (use tower::ServiceExt::ready or oneshot)"
    )
}

impl<S, C, L, R, E> Clone for ResourcesOperation<S, C, L, R, E>
where
    S: Clone,
    C: Clone,
    L: Acquire + Clone,
    R: Rejections,
{
    /// Shares the limit and the metrics; the clone starts without a permit.
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            classifier: self.classifier.clone(),
            limit: self.limit.clone(),
            rejections: self.rejections.clone(),
            ready: Ready::Empty,
            tracked: self
                .tracked
                .as_ref()
                .map(|tracked| Tracked::new(tracked.series.clone(), tracked.capacity.clone())),
            _end: PhantomData,
        }
    }
}

impl<S: Load, C, L: Acquire, R: Rejections, E> Load for ResourcesOperation<S, C, L, R, E> {
    type Metric = S::Metric;

    /// The inner service's load.
    fn load(&self) -> S::Metric {
        self.inner.load()
    }
}

impl<S, C, L, R, E> fmt::Debug for ResourcesOperation<S, C, L, R, E>
where
    S: fmt::Debug,
    L: Acquire,
    R: Rejections,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.ready {
            Ready::Permit(_) => "admitted",
            Ready::Rejected(_) => "rejected",
            Ready::Empty if self.limit.is_waiting() => "waiting",
            Ready::Empty => "idle",
        };
        f.debug_struct("ResourcesOperation")
            .field("inner", &self.inner)
            .field("limit", &self.limit)
            .field("metrics_enabled", &self.tracked.is_some())
            .field("state", &state)
            .finish()
    }
}

#[cfg(feature = "tonic")]
impl<S, C, L, R, E> tonic::server::NamedService for ResourcesOperation<S, C, L, R, E>
where
    S: tonic::server::NamedService,
    L: Acquire,
    R: Rejections,
{
    /// The wrapped gRPC service's name, so the layered service can go to tonic's `add_service`.
    const NAME: &'static str = S::NAME;
}
