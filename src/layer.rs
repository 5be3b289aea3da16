//! [`ResourcesOperationLayer`]: one concurrency limit, tagged with what it limits.

use std::fmt;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::{
    DefaultClassifier, Executor, GrpcClassifier, HttpClassifier, Operation, OperationMetrics,
    ResourcesOperation,
};

/// Limits the wrapped service to a number of operations at once, like tower's
/// `ConcurrencyLimitLayer`, and reports how long each waited, how long it ran, and how it ended.
///
/// One layer value is one limit: the semaphore and the metrics handle are made in the
/// constructor and shared by every service [`layer`](Layer::layer) makes, so the limit holds
/// however many times a framework calls `layer()` (axum calls it per route, per method and per
/// connection). To put several routes under one cap, give each its own layer, with its own
/// [`Operation`] and [`Executor`], built [`with_semaphore`](Self::with_semaphore) from one
/// semaphore.
///
/// Defaults to [`Operation::Other`], [`Executor::Other`], [`OperationMetrics::global`] and the
/// [`DefaultClassifier`].
///
/// ```
/// use std::sync::Arc;
/// use tokio::sync::Semaphore;
/// use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
///
/// // Verification and judging share four slots.
/// let slots = Arc::new(Semaphore::new(4));
/// let verify = ResourcesOperationLayer::with_semaphore(slots.clone())
///     .operation(Operation::Verify)
///     .executor(Executor::Subprocess);
/// let judge = ResourcesOperationLayer::with_semaphore(slots)
///     .operation(Operation::Judge)
///     .executor(Executor::Inline);
/// # drop((verify, judge));
/// ```
#[derive(Clone)]
pub struct ResourcesOperationLayer<C = DefaultClassifier> {
    semaphore: Arc<Semaphore>,
    operation: Operation,
    executor: Executor,
    metrics: OperationMetrics,
    classifier: C,
}

impl ResourcesOperationLayer {
    /// A new limit of `max` operations at once.
    ///
    /// # Panics
    ///
    /// If `max` is above tokio's [`Semaphore::MAX_PERMITS`]; [`try_new`](Self::try_new) returns
    /// that as an error instead.
    #[track_caller]
    pub fn new(max: usize) -> Self {
        match Self::try_new(max) {
            Ok(layer) => layer,
            Err(error) => panic!("{error}"),
        }
    }

    /// A new limit of `max` operations at once, or an error if `max` is above tokio's
    /// [`Semaphore::MAX_PERMITS`].
    pub fn try_new(max: usize) -> Result<Self, LimitTooLarge> {
        if max > Semaphore::MAX_PERMITS {
            return Err(LimitTooLarge { max });
        }
        Ok(Self::with_semaphore(Arc::new(Semaphore::new(max))))
    }

    /// A limit that takes its permits from `semaphore`, which other layers (or your own code)
    /// may share.
    ///
    /// Closing the semaphore ends the limit: from then on a service that needs a permit panics
    /// in `poll_ready` with a message that says the semaphore was closed, and callers waiting
    /// for a permit are woken to that panic rather than left hanging. Operations that already
    /// hold a permit finish normally.
    pub fn with_semaphore(semaphore: Arc<Semaphore>) -> Self {
        Self {
            semaphore,
            operation: Operation::Other,
            executor: Executor::Other,
            metrics: OperationMetrics::global(),
            classifier: DefaultClassifier,
        }
    }
}

impl ResourcesOperationLayer<HttpClassifier> {
    /// [`new`](ResourcesOperationLayer::new) with the [`HttpClassifier`], for services that
    /// answer `http::Response`s (axum, hyper): `5xx` is `error`, `504`/`408` `timeout`, `499`
    /// `cancelled`.
    #[track_caller]
    pub fn new_for_http(max: usize) -> Self {
        ResourcesOperationLayer::new(max).classifier(HttpClassifier::new())
    }

    /// [`with_semaphore`](ResourcesOperationLayer::with_semaphore) with the [`HttpClassifier`].
    pub fn with_semaphore_for_http(semaphore: Arc<Semaphore>) -> Self {
        ResourcesOperationLayer::with_semaphore(semaphore).classifier(HttpClassifier::new())
    }
}

impl ResourcesOperationLayer<GrpcClassifier> {
    /// [`new`](ResourcesOperationLayer::new) with the [`GrpcClassifier`], for tonic services:
    /// the outcome comes from the `grpc-status` of a trailers-only response.
    #[track_caller]
    pub fn new_for_grpc(max: usize) -> Self {
        ResourcesOperationLayer::new(max).classifier(GrpcClassifier)
    }

    /// [`with_semaphore`](ResourcesOperationLayer::with_semaphore) with the [`GrpcClassifier`].
    pub fn with_semaphore_for_grpc(semaphore: Arc<Semaphore>) -> Self {
        ResourcesOperationLayer::with_semaphore(semaphore).classifier(GrpcClassifier)
    }
}

impl<C> ResourcesOperationLayer<C> {
    /// Tags this limit's operations with `operation`. Defaults to [`Operation::Other`].
    pub fn operation(mut self, operation: Operation) -> Self {
        self.operation = operation;
        self
    }

    /// Tags this limit's operations with `executor`. Defaults to [`Executor::Other`].
    pub fn executor(mut self, executor: Executor) -> Self {
        self.executor = executor;
        self
    }

    /// Reports through `metrics`. Defaults to [`OperationMetrics::global`].
    pub fn metrics(mut self, metrics: OperationMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Decides outcomes with `classifier`. Defaults to [`DefaultClassifier`].
    pub fn classifier<D>(self, classifier: D) -> ResourcesOperationLayer<D> {
        ResourcesOperationLayer {
            semaphore: self.semaphore,
            operation: self.operation,
            executor: self.executor,
            metrics: self.metrics,
            classifier,
        }
    }

    /// The semaphore this limit takes its permits from, e.g. to read `available_permits()`.
    pub fn semaphore(&self) -> &Arc<Semaphore> {
        &self.semaphore
    }
}

impl<S, C: Clone> Layer<S> for ResourcesOperationLayer<C> {
    type Service = ResourcesOperation<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        ResourcesOperation::new(
            inner,
            Arc::clone(&self.semaphore),
            self.metrics.series(self.operation, self.executor),
            self.classifier.clone(),
        )
    }
}

impl<C> fmt::Debug for ResourcesOperationLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResourcesOperationLayer")
            .field("available_permits", &self.semaphore.available_permits())
            .field("operation", &self.operation)
            .field("executor", &self.executor)
            .field("metrics_enabled", &self.metrics.is_enabled())
            .field("classifier", &std::any::type_name::<C>())
            .finish()
    }
}

/// A limit above tokio's [`Semaphore::MAX_PERMITS`], from [`ResourcesOperationLayer::try_new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitTooLarge {
    max: usize,
}

impl fmt::Display for LimitTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ResourcesOperationLayer: a limit of {} operations is above tokio's Semaphore::MAX_PERMITS ({})",
            self.max,
            Semaphore::MAX_PERMITS
        )
    }
}

impl std::error::Error for LimitTooLarge {}
