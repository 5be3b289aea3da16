//! [`ResourcesOperationLayer`]: one concurrency limit, tagged with what it limits.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::choose::PerRequestOperation;
use crate::metrics::MetricsSource;
use crate::reject::{Bounded, DefaultAnswer, Rejections};
use crate::{
    Acquire, AtBodyEnd, AtHead, Capacity, Deadline, DefaultClassifier, Executor, GrpcClassifier,
    HttpClassifier, Limit, LimitTooLarge, Operation, OperationMetrics, ResourcesOperation,
    SharedClassifier, Unbounded,
};

/// Limits the wrapped service to a number of operations at once, like tower's
/// `ConcurrencyLimitLayer`, and reports how long each waited, how long it ran, and how it ended.
///
/// One layer value is one limit: the limit and the metrics are shared by every service
/// [`layer`](Layer::layer) makes, so the limit holds however many times a framework calls
/// `layer()` (axum calls it per route, per method and per connection). To put several routes
/// under one cap, give each its own layer, with its own [`Operation`] and [`Executor`], made
/// [`with_limit`](Self::with_limit) from clones of one [`Limit`].
///
/// Defaults: [`Operation::Other`], [`Executor::Other`], the [`DefaultClassifier`], the metrics
/// of the global meter provider (decided when the layer first serves a request; see
/// [`metrics`](Self::metrics)), [`Unbounded`] waiting, and the operation ending when the inner
/// service answers ([`AtHead`]).
///
/// ```
/// use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};
///
/// // Verification and judging share four slots.
/// let slots = Limit::new(4);
/// let verify = ResourcesOperationLayer::with_limit(slots.clone())
///     .operation(Operation::Verify)
///     .executor(Executor::Subprocess);
/// let judge = ResourcesOperationLayer::with_limit(slots)
///     .operation(Operation::Judge)
///     .executor(Executor::Inline);
/// # drop((verify, judge));
/// ```
///
/// The type parameters are set by the builder methods: `C` the classifier
/// ([`classifier`](Self::classifier)), `L` the limit ([`with_limit`](Self::with_limit)), `R`
/// whether rejections are answered ([`bounded`](Self::bounded)), `E` where an operation ends
/// ([`until_body_end`](Self::until_body_end)), `T` how operations are tagged
/// ([`per_request`](Self::per_request)).
#[derive(Clone)]
pub struct ResourcesOperationLayer<
    C = SharedClassifier<DefaultClassifier>,
    L = Limit,
    R = Unbounded,
    E = AtHead,
    T = Fixed,
> {
    limit: L,
    classifier: C,
    rejections: R,
    tags: T,
    metrics: MetricsSource,
    capacity: Option<Capacity>,
    _end: PhantomData<fn() -> E>,
}

/// Every operation of a layer has the same [`Operation`] and [`Executor`], set with
/// [`operation`](ResourcesOperationLayer::operation) and
/// [`executor`](ResourcesOperationLayer::executor). The default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fixed {
    operation: Operation,
    executor: Executor,
}

/// Each request chooses its operation and executor, or to go unlimited, with `F`: see
/// [`per_request`](ResourcesOperationLayer::per_request).
#[derive(Clone, Debug)]
pub struct PerRequest<F>(pub(crate) F);

impl ResourcesOperationLayer {
    /// A new limit of `max` operations at once: [`with_limit`](Self::with_limit) of
    /// [`Limit::new(max)`](Limit::new).
    ///
    /// # Panics
    ///
    /// If `max` is above tokio's [`Semaphore::MAX_PERMITS`]; [`try_new`](Self::try_new) returns
    /// that as an error instead.
    #[track_caller]
    pub fn new(max: usize) -> Self {
        Self::with_limit(Limit::new(max))
    }

    /// A new limit of `max` operations at once, or an error if `max` is above tokio's
    /// [`Semaphore::MAX_PERMITS`].
    pub fn try_new(max: usize) -> Result<Self, LimitTooLarge> {
        Ok(Self::with_limit(Limit::try_new(max)?))
    }
}

impl<L: Acquire> ResourcesOperationLayer<SharedClassifier<DefaultClassifier>, L> {
    /// A layer on `limit`: a [`Limit`] (clones share it), an `Arc<Semaphore>`, or any
    /// [`Acquire`] of your own (a pool, a weighted or a distributed semaphore).
    pub fn with_limit(limit: L) -> Self {
        Self {
            limit,
            classifier: SharedClassifier::new(DefaultClassifier),
            rejections: Unbounded,
            tags: Fixed {
                operation: Operation::Other,
                executor: Executor::Other,
            },
            metrics: MetricsSource::Global,
            capacity: None,
            _end: PhantomData,
        }
    }
}

impl ResourcesOperationLayer<SharedClassifier<DefaultClassifier>, Arc<Semaphore>> {
    /// A layer that takes its permits from `semaphore`, which other layers (or your own code)
    /// may share.
    ///
    /// A semaphore does not know its capacity, so the series reports no
    /// `gym.resources.operation.limit` unless you give it one with
    /// [`capacity`](Self::capacity). Closing the semaphore ends the limit: from then on a
    /// service that needs a permit panics in `poll_ready` with a message that says the limit is
    /// closed, and callers waiting for a permit are woken to that panic rather than left
    /// hanging. Operations that already hold a permit finish normally.
    pub fn with_semaphore(semaphore: Arc<Semaphore>) -> Self {
        Self::with_limit(semaphore)
    }
}

impl ResourcesOperationLayer<SharedClassifier<HttpClassifier>> {
    /// [`new`](ResourcesOperationLayer::new) with the [`HttpClassifier`], for services that
    /// answer `http::Response`s (axum, hyper): `5xx` is `error`, `504`/`408` `timeout`, `499`
    /// `cancelled`.
    #[track_caller]
    pub fn new_for_http(max: usize) -> Self {
        ResourcesOperationLayer::new(max).classifier(HttpClassifier::new())
    }
}

impl<L: Acquire> ResourcesOperationLayer<SharedClassifier<HttpClassifier>, L> {
    /// [`with_limit`](ResourcesOperationLayer::with_limit) with the [`HttpClassifier`].
    pub fn with_limit_for_http(limit: L) -> Self {
        ResourcesOperationLayer::with_limit(limit).classifier(HttpClassifier::new())
    }
}

impl ResourcesOperationLayer<SharedClassifier<HttpClassifier>, Arc<Semaphore>> {
    /// [`with_semaphore`](ResourcesOperationLayer::with_semaphore) with the [`HttpClassifier`].
    pub fn with_semaphore_for_http(semaphore: Arc<Semaphore>) -> Self {
        Self::with_limit_for_http(semaphore)
    }
}

impl ResourcesOperationLayer<Deadline<GrpcClassifier>> {
    /// [`new`](ResourcesOperationLayer::new) with the [`GrpcClassifier`], for tonic services:
    /// the outcome comes from each call's `grpc-status`, and a call dropped past its
    /// `grpc-timeout` is `timeout` (see [`Deadline`]).
    #[track_caller]
    pub fn new_for_grpc(max: usize) -> Self {
        ResourcesOperationLayer::new(max).make_classifier(Deadline::grpc(GrpcClassifier))
    }
}

impl<L: Acquire> ResourcesOperationLayer<Deadline<GrpcClassifier>, L> {
    /// [`with_limit`](ResourcesOperationLayer::with_limit) with the gRPC classifier of
    /// [`new_for_grpc`](ResourcesOperationLayer::new_for_grpc).
    pub fn with_limit_for_grpc(limit: L) -> Self {
        ResourcesOperationLayer::with_limit(limit).make_classifier(Deadline::grpc(GrpcClassifier))
    }
}

impl ResourcesOperationLayer<Deadline<GrpcClassifier>, Arc<Semaphore>> {
    /// [`with_semaphore`](ResourcesOperationLayer::with_semaphore) with the gRPC classifier of
    /// [`new_for_grpc`](ResourcesOperationLayer::new_for_grpc).
    pub fn with_semaphore_for_grpc(semaphore: Arc<Semaphore>) -> Self {
        Self::with_limit_for_grpc(semaphore)
    }
}

impl<C, L, R, E> ResourcesOperationLayer<C, L, R, E, Fixed> {
    /// Tags this layer's operations with `operation`. Defaults to [`Operation::Other`].
    pub fn operation(mut self, operation: Operation) -> Self {
        self.tags.operation = operation;
        self
    }

    /// Tags this layer's operations with `executor`. Defaults to [`Executor::Other`].
    pub fn executor(mut self, executor: Executor) -> Self {
        self.tags.executor = executor;
        self
    }

    /// Lets each request choose its operation and executor, or to go unlimited, with
    /// `chooser`: for one layer over a whole axum `Router` or tonic `Server`.
    ///
    /// The choice needs the request, which `poll_ready` does not have, so such a layer waits
    /// for its permit after `call`, in the response future: its `poll_ready` is always ready,
    /// and `call` runs each limited request through a clone of the inner service (which must be
    /// `Clone`) that takes its permit as this layer's per-route form does. `queued` counts a
    /// request from `call` on, and an unlimited request is neither counted nor limited. See
    /// [`ByMatchedPath`](crate::ByMatchedPath) and [`ByGrpcMethod`](crate::ByGrpcMethod) for
    /// ready-made choosers.
    pub fn per_request<F>(self, chooser: F) -> ResourcesOperationLayer<C, L, R, E, PerRequest<F>> {
        ResourcesOperationLayer {
            limit: self.limit,
            classifier: self.classifier,
            rejections: self.rejections,
            tags: PerRequest(chooser),
            metrics: self.metrics,
            capacity: self.capacity,
            _end: PhantomData,
        }
    }
}

impl<C, L, R, E, T> ResourcesOperationLayer<C, L, R, E, T> {
    /// Reports through `metrics`; then the global provider is never consulted.
    ///
    /// Defaults to [`OperationMetrics::global`], resolved as late as possible: when a service of
    /// this layer first serves a request, not when the layer is built. So "build the router,
    /// install the global provider, serve" records into that provider.
    pub fn metrics(mut self, metrics: OperationMetrics) -> Self {
        self.metrics = MetricsSource::Given(metrics);
        self
    }

    /// Reports `capacity` as this layer's limit in `gym.resources.operation.limit`, for a limit
    /// that does not know its own (an `Arc<Semaphore>`); a [`Limit`] reports its own. Give
    /// clones of one [`Capacity`] to layers that share one semaphore, so it counts once.
    pub fn capacity(mut self, capacity: Capacity) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// Decides outcomes with `classifier`, a [`ClassifyOutcome`](crate::ClassifyOutcome)
    /// (closures included), cloned for each operation. Defaults to the [`DefaultClassifier`].
    pub fn classifier<D>(
        self,
        classifier: D,
    ) -> ResourcesOperationLayer<SharedClassifier<D>, L, R, E, T> {
        self.make_classifier(SharedClassifier::new(classifier))
    }

    /// Decides outcomes with a classifier made for each request by `make`, from the request
    /// (see [`MakeClassifier`](crate::MakeClassifier) and [`Deadline`]).
    pub fn make_classifier<M>(self, make: M) -> ResourcesOperationLayer<M, L, R, E, T> {
        ResourcesOperationLayer {
            limit: self.limit,
            classifier: make,
            rejections: self.rejections,
            tags: self.tags,
            metrics: self.metrics,
            capacity: self.capacity,
            _end: PhantomData,
        }
    }

    /// Holds each operation until its `http::Response` body ends, rather than until the inner
    /// service answers: the permit, the `active` count and the run time last while the body
    /// streams (server-sent events, streamed tokens, gRPC server streams), and the outcome can
    /// come from the trailers. The response body becomes an
    /// [`OperationBody`](crate::OperationBody). See [`ClassifyResponse`](crate::ClassifyResponse) for how
    /// such an operation ends.
    pub fn until_body_end(self) -> ResourcesOperationLayer<C, L, R, AtBodyEnd, T> {
        ResourcesOperationLayer {
            limit: self.limit,
            classifier: self.classifier,
            rejections: self.rejections,
            tags: self.tags,
            metrics: self.metrics,
            capacity: self.capacity,
            _end: PhantomData,
        }
    }

    /// Answers rejections with `answer`: an [`HttpRejection`](crate::HttpRejection) (503 or
    /// 429, `Retry-After`), a [`GrpcRejection`](crate::GrpcRejection), a
    /// [`RejectAsError`](crate::RejectAsError), or an
    /// [`AnswerRejection`](crate::AnswerRejection) of your own.
    pub fn reject_with<A>(self, answer: A) -> ResourcesOperationLayer<C, L, Bounded<A>, E, T>
    where
        R: Rejections,
    {
        let queue_timeout = self.rejections.queue_timeout();
        ResourcesOperationLayer {
            limit: self.limit,
            classifier: self.classifier,
            rejections: Bounded {
                answer,
                queue_timeout,
            },
            tags: self.tags,
            metrics: self.metrics,
            capacity: self.capacity,
            _end: PhantomData,
        }
    }

    /// The limit.
    pub fn limit(&self) -> &L {
        &self.limit
    }
}

impl<C: Clone, L, R, E, T> ResourcesOperationLayer<SharedClassifier<C>, L, R, E, T> {
    /// Reads each request's deadline from header `name` (a number of milliseconds, or
    /// `grpc-timeout`'s form): an operation dropped past it ends as `timeout`, not `cancelled`.
    /// See [`Deadline`].
    pub fn deadline_header(
        self,
        name: HeaderName,
    ) -> ResourcesOperationLayer<Deadline<C>, L, R, E, T> {
        let classifier = Deadline::header(name, self.classifier.get_ref().clone());
        self.make_classifier(classifier)
    }
}

impl<C: DefaultAnswer, L, E, T> ResourcesOperationLayer<C, L, Unbounded, E, T> {
    /// Answers rejections as the classifier's protocol does: an HTTP layer with
    /// `503 Service Unavailable`, a gRPC layer with RESOURCE_EXHAUSTED, a generic layer with its
    /// error type made from [`Rejected`](crate::Rejected) (which `BoxError` is). A layer that is
    /// not bounded cannot be put on a limit that bounds its queue
    /// ([`Limit::max_queued`]).
    pub fn bounded(self) -> ResourcesOperationLayer<C, L, Bounded<C::Answer>, E, T> {
        let answer = self.classifier.default_answer();
        self.reject_with(answer)
    }

    /// Turns away, with [`Rejection::QueueTimeout`](crate::Rejection::QueueTimeout), an
    /// operation of this layer that has waited `timeout` for its permit; the layer becomes
    /// [`bounded`](Self::bounded).
    pub fn queue_timeout(
        self,
        timeout: Duration,
    ) -> ResourcesOperationLayer<C, L, Bounded<C::Answer>, E, T> {
        self.bounded().queue_timeout(timeout)
    }
}

impl<C, L, A, E, T> ResourcesOperationLayer<C, L, Bounded<A>, E, T> {
    /// Turns away, with [`Rejection::QueueTimeout`](crate::Rejection::QueueTimeout), an
    /// operation of this layer that has waited `timeout` for its permit.
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        self.rejections.queue_timeout = Some(timeout);
        self
    }
}

impl<C, L, R, E, T> ResourcesOperationLayer<C, L, R, E, T>
where
    L: Acquire,
    R: Rejections,
{
    /// A layer that cannot answer a rejection refuses a limit that may reject.
    #[track_caller]
    fn check_rejections(&self) {
        if R::hold(crate::Rejection::QueueFull).is_err() && self.limit.may_reject() {
            panic!(
                "tower-resources-operation: this limit ({}) bounds its queue, but this layer \
                 cannot answer a rejection: make it bounded (.bounded(), .reject_with(..) or \
                 .queue_timeout(..))",
                std::any::type_name::<L>()
            );
        }
    }

    fn reported_capacity(&self) -> Option<&Capacity> {
        self.capacity.as_ref().or_else(|| self.limit.capacity())
    }
}

impl<S, C, L, R, E> Layer<S> for ResourcesOperationLayer<C, L, R, E, Fixed>
where
    C: Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    R: Rejections,
{
    type Service = ResourcesOperation<S, C, L, R, E>;

    #[track_caller]
    fn layer(&self, inner: S) -> Self::Service {
        self.check_rejections();
        let series = self.metrics.series(
            self.tags.operation,
            self.tags.executor,
            self.reported_capacity(),
        );
        ResourcesOperation::from_parts(
            inner,
            self.classifier.clone(),
            self.limit.clone(),
            self.rejections.clone(),
            series,
            self.capacity.clone(),
        )
    }
}

impl<S, C, L, R, E, F> Layer<S> for ResourcesOperationLayer<C, L, R, E, PerRequest<F>>
where
    C: Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    R: Rejections,
    F: Clone,
{
    type Service = PerRequestOperation<S, F, C, L, R, E>;

    #[track_caller]
    fn layer(&self, inner: S) -> Self::Service {
        self.check_rejections();
        PerRequestOperation::new(
            inner,
            self.tags.0.clone(),
            self.classifier.clone(),
            self.limit.clone(),
            self.rejections.clone(),
            self.metrics.clone(),
            self.reported_capacity().cloned(),
        )
    }
}

impl<C, L, R, E, T: fmt::Debug> fmt::Debug for ResourcesOperationLayer<C, L, R, E, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResourcesOperationLayer")
            .field("limit", &std::any::type_name::<L>())
            .field("tags", &self.tags)
            .field("metrics", &self.metrics)
            .field("classifier", &std::any::type_name::<C>())
            .field("rejections", &std::any::type_name::<R>())
            .field("end", &std::any::type_name::<E>())
            .finish()
    }
}
