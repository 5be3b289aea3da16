//! [`ResourcesOperation`]: where a service takes its permit, runs the inner service as the
//! operation, and answers a rejection.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{self, ManuallyDrop};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tower_service::Service;

use super::body::{AtHead, End};
use super::future::ResponseFuture;
use super::Config;
use crate::attributes::SeriesKey;
use crate::classify::{ClassifyOutcome, DefaultClassifier};
use crate::diagnostics::{self, Mistake};
use crate::guard::guarded;
use crate::limit::{limit_failed, Acquire, IntoLimit, Limit, LimitId, Stands, Waiting};
use crate::operation::{scope, Ending, Free, Lifecycle};
use crate::protocol::{unanswerable, Plain, Protocol, Rejected};

/// A service limited to a number of operations at once, made by
/// [`ResourcesOperationLayer`](crate::ResourcesOperationLayer).
///
/// It behaves as tower's `ConcurrencyLimit`: `poll_ready` takes a permit (waiters are served
/// first come, first served), `call` spends it, and the permit goes back when the response
/// future is dropped (which `.await` does once it completes), or when a service holding an
/// unused permit is dropped. A clone shares the limit but starts without a permit. Where it
/// differs:
///
/// - the limit lives in the layer value, not in each `layer()` call: what tower's
///   `GlobalConcurrencyLimitLayer` does, so the limit holds across connections;
/// - the permit also goes back when the inner `poll_ready` fails, or panics;
/// - when its limit turns an operation away, or cannot admit it (closed, its store out of
///   reach), `poll_ready` is ready and `call` answers the rejection as the layer's
///   [protocol](crate::protocol) says, without calling the inner service, as tower's
///   `LoadShed` does.
pub struct ResourcesOperation<S, C = DefaultClassifier, L: Acquire = Limit, P = Plain, E = AtHead> {
    inner: S,
    config: Arc<Config<C, L, P>>,
    next: Next<L>,
    _end: PhantomData<fn() -> E>,
}

/// What a service holds for its next operation.
///
/// Dropped empty, as every `clone().oneshot()` service is once it was called, it costs a few
/// compares in line. The drop glue of the two, out of line, cost a tenth of tower's limit per
/// `clone().oneshot()` (the layer at 0.96x of it with the glue, 0.82x to 0.89x without, in
/// `cargo bench --bench interleaved`): so they are `ManuallyDrop`, and
/// [`release`](Self::release) drops them, by value, only when one of them holds something.
/// What it leaves in their place is empty and owns nothing.
struct Next<L: Acquire> {
    /// The wait for the next operation's permit, if it has to wait, and why the limit turned
    /// it away, if it did (for `call` to answer).
    waiting: ManuallyDrop<Waiting<L::Permit>>,
    /// The next operation, which `poll_ready` prepares and `call` hands to its future.
    operation: ManuallyDrop<Lifecycle<L>>,
}

impl<L: Acquire> Next<L> {
    fn new() -> Self {
        Self {
            waiting: ManuallyDrop::new(Waiting::new()),
            operation: ManuallyDrop::new(Lifecycle::new()),
        }
    }

    /// Drops what they hold: a wait's allocation, a rejection, a permit, a record (which then
    /// ends as its drop means).
    #[cold]
    #[inline(never)]
    fn release(&mut self) {
        let waiting = mem::replace(&mut *self.waiting, Waiting::new());
        let operation = mem::replace(&mut *self.operation, Lifecycle::new());
        drop(waiting);
        drop(operation);
    }
}

impl<L: Acquire> Drop for Next<L> {
    #[inline]
    fn drop(&mut self) {
        if !self.waiting.is_empty() || !self.operation.is_empty() {
            self.release();
        }
    }
}

impl<S> ResourcesOperation<S> {
    /// `inner`, limited by `limit` (a number of operations at once, or any
    /// [`Acquire`]), tagged `other`/`other` and reporting to the global meter provider (see
    /// [`ResourcesOperationLayer::new`](crate::ResourcesOperationLayer::new), whose `layer`
    /// this is).
    #[track_caller]
    pub fn new<T>(inner: S, limit: T) -> ResourcesOperation<S, DefaultClassifier, T::Limit>
    where
        T: IntoLimit,
        T::Limit: Clone + Send + Sync + 'static,
        <T::Limit as Acquire>::Permit: Send + 'static,
    {
        tower_layer::Layer::layer(&super::ResourcesOperationLayer::new(limit), inner)
    }
}

impl<S, C, L: Acquire, P, E> ResourcesOperation<S, C, L, P, E> {
    pub(crate) fn from_config(inner: S, config: Arc<Config<C, L, P>>) -> Self {
        Self {
            inner,
            config,
            next: Next::new(),
            _end: PhantomData,
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

    /// The limit.
    pub fn limit(&self) -> &L {
        &self.config.limit
    }
}

impl<S, C, L, P, E, Request> Service<Request> for ResourcesOperation<S, C, L, P, E>
where
    S: Service<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error>,
    E: End<S::Response, S::Error, C, L>,
{
    type Response = E::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, C, L, Result<S::Response, S::Error>, E>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.next.operation.is_admitted() {
            let config = &*self.config;
            let recording = config.recording();
            // One check on the path of a free permit: an idle service whose request holds no
            // place of its limit.
            let idle = self.next.waiting.is_idle();
            if !idle || holds(recording.limit_id) {
                match self.next.waiting.stands() {
                    // `call` answers it.
                    Stands::Rejected => return Poll::Ready(Ok(())),
                    Stands::Idle | Stands::Nested => return self.poll_nested(cx),
                    // The wait in progress goes on below.
                    Stands::Waiting => {}
                }
            }
            // A wait in progress is asked, not the limit: a place freed meanwhile goes to the
            // head of its queue.
            let mut busy = false;
            if idle {
                match self
                    .next
                    .operation
                    .admit_free(&config.limit, recording.records)
                {
                    Free::Admitted => return self.poll_inner(cx),
                    Free::Busy => busy = true,
                    Free::Ask => {}
                }
            }
            let admitted = {
                let mut asking =
                    self.next
                        .waiting
                        .asking(&config.limit, &config.queue_timeout, busy);
                let deadline = || {
                    Protocol::<Request, S::Response, S::Error>::server_deadline(&config.protocol)
                };
                ready!(self.next.operation.poll_admit(
                    &mut asking,
                    recording.series.as_ref(),
                    recording.records,
                    SeriesKey::new(config.operation, config.executor),
                    || recording.capacity.as_ref(),
                    deadline,
                    cx
                ))
            };
            if let Err(refused) = admitted {
                return self.rejected(refused);
            }
        }
        self.poll_inner(cx)
    }

    #[inline]
    fn call(&mut self, request: Request) -> Self::Future {
        if !self.next.operation.is_admitted() {
            if self.next.waiting.take_nested() {
                // On the place its request holds: the operation around it records it.
                return ResponseFuture::called(self.inner.call(request), Lifecycle::new());
            }
            return ResponseFuture::answered(self.answer(request));
        }
        let config = &*self.config;
        let deadline = match self.next.operation.is_recording() {
            true => {
                let unrouted = guarded(|| config.protocol.unrouted(&request));
                if !config.per_request && unrouted == Some(true) {
                    diagnostics::report(Mistake::RouterWide, String::new);
                }
                guarded(|| config.protocol.deadline(&request)).flatten()
            }
            false => None,
        };
        let inner = &mut self.inner;
        // The work is called as the service's operation, in place; the future then takes it.
        let future = self.next.operation.call(|| inner.call(request));
        let operation = self
            .next
            .operation
            .called(|| (guarded(|| config.classifier.clone()), deadline));
        ResponseFuture::called(future, operation)
    }
}

impl<S, C, L, P, E> ResourcesOperation<S, C, L, P, E>
where
    L: Acquire,
{
    /// Admitted: the inner service's readiness, as the operation.
    #[inline(always)]
    fn poll_inner<Request>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>>
    where
        S: Service<Request>,
    {
        let inner = &mut self.inner;
        let ready = self.next.operation.run(|| inner.poll_ready(cx));
        if let Poll::Ready(Err(_)) = ready {
            // It will not be called: the operation ends, and its permit goes back.
            self.next.operation.end(Ending::Failed, |_| None);
        }
        ready
    }

    /// The request already holds a place of this limit: it is admitted on that place (waiting
    /// for a second one would halve the limit, or deadlock once every place is held by a
    /// request that waits for another), says so once, and is not an operation of its own.
    #[cold]
    fn poll_nested<Request, Error>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>>
    where
        S: Service<Request, Error = Error>,
    {
        if !self.next.waiting.is_nested() {
            diagnostics::report(Mistake::NestedLimit, || self.config.named_limit());
        }
        let ready = self.inner.poll_ready(cx);
        self.next
            .waiting
            .nest(!matches!(ready, Poll::Ready(Err(_))));
        ready
    }

    /// The limit turned the operation away, or could not admit it: `call` answers it, if this
    /// layer can; a layer that cannot ends the caller, naming the limit.
    #[cold]
    fn rejected<Error>(&mut self, refused: Rejected) -> Poll<Result<(), Error>> {
        if !self.config.answers {
            if refused.is_failure() {
                limit_failed::<L>(&refused);
            }
            unanswerable::<L>(refused);
        }
        self.next.waiting.reject(refused);
        Poll::Ready(Ok(()))
    }

    /// `call` of an operation that holds no permit: it answers a rejection, or panics for a
    /// `call` that no `poll_ready` prepared.
    #[cold]
    #[track_caller]
    fn answer<Request, Res, Err>(&mut self, _request: Request) -> Result<Res, Err>
    where
        P: Protocol<Request, Res, Err>,
    {
        match self.next.waiting.take_rejection() {
            Some(rejected) => self.config.protocol.answer(rejected),
            None => panic!(
                "ResourcesOperation::call without a permit: poll_ready must return \
                 Ready(Ok(())) before each call (use tower::ServiceExt::ready or oneshot)"
            ),
        }
    }
}

impl<S: Clone, C, L: Acquire, P, E> Clone for ResourcesOperation<S, C, L, P, E> {
    /// Shares the limit and the metrics; the clone starts without a permit.
    fn clone(&self) -> Self {
        Self::from_config(self.inner.clone(), Arc::clone(&self.config))
    }
}

/// Whether an operation around this one, on its request's path, holds a place of the limit
/// `id`.
#[inline(always)]
fn holds(id: Option<LimitId>) -> bool {
    id.is_some_and(scope::holds)
}

#[cfg(feature = "load")]
#[cfg_attr(docsrs, doc(cfg(feature = "load")))]
impl<S: tower::load::Load, C, L: Acquire, P, E> tower::load::Load
    for ResourcesOperation<S, C, L, P, E>
{
    type Metric = S::Metric;

    /// The inner service's load.
    fn load(&self) -> S::Metric {
        self.inner.load()
    }
}

impl<S: fmt::Debug, C, L: Acquire, P, E> fmt::Debug for ResourcesOperation<S, C, L, P, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.next.waiting.stands() {
            _ if self.next.operation.is_admitted() => "admitted",
            Stands::Rejected => "rejected",
            Stands::Nested => "on its request's place",
            Stands::Waiting => "waiting",
            Stands::Idle => "idle",
        };
        f.debug_struct("ResourcesOperation")
            .field("inner", &self.inner)
            .field("limit", &self.config.described_limit())
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl<S, C, L, P, E> tonic::server::NamedService for ResourcesOperation<S, C, L, P, E>
where
    S: tonic::server::NamedService,
    L: Acquire,
{
    /// The wrapped gRPC service's name, so the layered service can go to tonic's `add_service`.
    const NAME: &'static str = S::NAME;
}
