//! [`ResourcesOperation`]: where a service takes its permit ([`Admission`]), runs the inner
//! service as the operation, and answers a rejection.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::Body;
use tower_service::Service;

use crate::admission::{Admission, Admit};
use crate::body::{AtBodyEnd, OperationBody};
use crate::classify::{ClassifyOutcome, DefaultClassifier, HttpClassifier};
use crate::config::Config;
use crate::diagnostics::{self, Mistake};
use crate::future::ResponseFuture;
use crate::guard::guarded;
use crate::limit::{Acquire, Limit};
use crate::operation::{Ending, Free, Lifecycle};
use crate::protocol::{unanswerable, Http, Protocol};
use crate::rejected::{limit_failed, Rejected};

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
pub struct ResourcesOperation<S, C = DefaultClassifier, L: Acquire = Limit, P = (), E = ()> {
    inner: S,
    config: Arc<Config<C, L, P>>,
    next: Admission<L>,
    _end: PhantomData<fn() -> E>,
}

/// The service of an [`HttpLayer`](crate::HttpLayer) on a limit `L`: an HTTP or gRPC service.
pub type HttpService<S, L = Limit, E = ()> = ResourcesOperation<S, HttpClassifier, L, Http, E>;

impl<S, C, L: Acquire, P, E> ResourcesOperation<S, C, L, P, E> {
    #[inline]
    pub(crate) fn from_config(inner: S, config: Arc<Config<C, L, P>>) -> Self {
        Self {
            inner,
            config,
            next: Admission::new(),
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

/// The request's path, from `poll_ready` and `call`.
impl<S, C, L, P, E> ResourcesOperation<S, C, L, P, E>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    /// `poll_ready`: admits the next operation, then asks the inner service, as the
    /// operation, whether it is ready.
    #[inline(always)]
    fn poll_admitted<Request>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>>
    where
        S: Service<Request>,
        P: Protocol<Request, S::Response, S::Error>,
    {
        let config = &*self.config;
        if !P::ANSWERS && config.answers {
            // No protocol, given after the layer was told to answer (`.protocol(())`).
            config.refuse_unanswerable();
        }
        // The path of a free permit stays in line; the rest is one step of `poll`.
        let free = self.next.admit_free(config);
        if free != Free::Admitted {
            let deadline = || config.protocol.server_deadline();
            match std::task::ready!(self.next.poll(config, free == Free::Busy, deadline, cx)) {
                Admit::Admitted => {}
                Admit::Nested => return self.poll_nested(cx),
                Admit::Refused(refused) => return self.refused::<_, Request>(refused),
                // `call` answers it.
                Admit::Answer => return Poll::Ready(Ok(())),
            }
        }
        let inner = &mut self.inner;
        let ready = self.next.operation().run(|| inner.poll_ready(cx));
        if let Poll::Ready(Err(_)) = ready {
            // It will not be called: the operation ends, and its permit goes back.
            self.next.operation().end(Ending::Failed, |_| None);
        }
        ready
    }

    /// `call`: runs the inner service as the admitted operation, and hands the operation to
    /// the response future; or answers a rejection.
    #[inline(always)]
    fn call_admitted<Request>(&mut self, request: Request) -> ResponseFuture<S::Future, C, L, E>
    where
        S: Service<Request>,
        C: Clone,
        P: Protocol<Request, S::Response, S::Error>,
    {
        if !self.next.is_admitted() {
            if self.next.take_nested() {
                // On the place its request holds: the operation around it records it.
                return ResponseFuture::called(self.inner.call(request), Lifecycle::new());
            }
            return ResponseFuture::answered(self.answer(request));
        }
        if self.next.operation().is_recording() {
            return self.call_recorded(request);
        }
        // Nothing to record: the future takes only the permit, and the service's empty record
        // is left as it is.
        let inner = &mut self.inner;
        let operation = self.next.operation();
        // The work is called as the service's operation, in place; the future then takes it.
        let future = operation.call(|| inner.call(request));
        ResponseFuture::called(future, operation.called_unrecorded())
    }

    /// `call` of an admitted operation that records.
    #[inline(always)]
    fn call_recorded<Request>(&mut self, request: Request) -> ResponseFuture<S::Future, C, L, E>
    where
        S: Service<Request>,
        C: Clone,
        P: Protocol<Request, S::Response, S::Error>,
    {
        let config = &*self.config;
        let unrouted = guarded(|| config.protocol.unrouted(&request));
        if !config.per_request && unrouted == Some(true) {
            diagnostics::report(Mistake::RouterWide, String::new);
        }
        let deadline = guarded(|| config.protocol.deadline(&request)).flatten();
        let inner = &mut self.inner;
        let operation = self.next.operation();
        let future = operation.call(|| inner.call(request));
        let recording = config.recording();
        let operation = operation.called(
            || (guarded(|| config.classifier.clone()), deadline),
            || recording.capacity.as_ref(),
        );
        ResponseFuture::called(future, operation)
    }

    /// The request already holds a place of this limit: it is admitted on that place (waiting
    /// for a second one would halve the limit, or deadlock once every place is held by a
    /// request that waits for another), says so once, and is not an operation of its own.
    #[cold]
    fn poll_nested<Request>(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>>
    where
        S: Service<Request>,
    {
        if !self.next.is_nested() {
            diagnostics::report(Mistake::NestedLimit, || self.config.named_limit());
        }
        let ready = self.inner.poll_ready(cx);
        self.next.nest(!matches!(ready, Poll::Ready(Err(_))));
        ready
    }

    /// The limit turned the operation away, or could not admit it: `call` answers it, if this
    /// layer can; a layer that cannot ends the caller, naming the limit.
    #[cold]
    fn refused<Error, Request>(&mut self, refused: Rejected) -> Poll<Result<(), Error>>
    where
        S: Service<Request>,
        P: Protocol<Request, S::Response, S::Error>,
    {
        if !self.config.answers || !P::ANSWERS {
            if refused.is_failure() {
                limit_failed::<L>(&refused);
            }
            unanswerable::<L>(refused);
        }
        self.next.reject(refused);
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
        match self.next.take_rejection() {
            Some(rejected) => self.config.protocol.answer(rejected),
            None => panic!(
                "ResourcesOperation::call without a permit: poll_ready must return \
                 Ready(Ok(())) before each call (use tower::ServiceExt::ready or oneshot)"
            ),
        }
    }
}

impl<S, C, L, P, Request> Service<Request> for ResourcesOperation<S, C, L, P>
where
    S: Service<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, C, L>;

    // Left to the inliner, unlike `call`: forced in line, the path of a free permit kept a
    // check of the record that it otherwise folds away.
    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_admitted(cx)
    }

    #[inline(always)]
    fn call(&mut self, request: Request) -> Self::Future {
        self.call_admitted(request)
    }
}

impl<S, C, L, P, B, Request> Service<Request> for ResourcesOperation<S, C, L, P, AtBodyEnd>
where
    S: Service<Request, Response = http::Response<B>>,
    B: Body,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error>,
{
    type Response = http::Response<OperationBody<B, L>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, C, L, AtBodyEnd>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_admitted(cx)
    }

    #[inline(always)]
    fn call(&mut self, request: Request) -> Self::Future {
        self.call_admitted(request)
    }
}

impl<S: Clone, C, L: Acquire, P, E> Clone for ResourcesOperation<S, C, L, P, E> {
    /// Shares the limit and the metrics; the clone starts without a permit.
    #[inline]
    fn clone(&self) -> Self {
        Self::from_config(self.inner.clone(), Arc::clone(&self.config))
    }
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
        f.debug_struct("ResourcesOperation")
            .field("inner", &self.inner)
            .field("limit", &self.config.described_limit())
            .field("state", &self.next.describe())
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
