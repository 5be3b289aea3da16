//! [`ResourcesOperationLayer`]: the limit, its metrics and its tags, shared by every service the
//! layer makes.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use crate::attributes::{Executor, Operation};
use crate::body::AtBodyEnd;
use crate::classify::{DefaultClassifier, HttpClassifier};
use crate::config::Config;
use crate::limit::{Acquire, Capacity, IntoLimit, Limit};
use crate::metrics::{MetricsSource, OperationMetrics};
use crate::protocol::Http;
use crate::service::ResourcesOperation;

/// Limits the wrapped service to a number of operations at once, like tower's
/// `ConcurrencyLimitLayer`, and reports how long each waited, how long it ran, and how it ended.
///
/// One layer value is one limit: the limit and the metrics are shared by every service
/// [`layer`](Layer::layer) makes, so the limit holds however many times a framework calls
/// `layer()` (axum calls it per route, per method and per connection). To put several routes
/// under one cap, give each its own layer, with its own [`Operation`] and [`Executor`], made from
/// clones of one [`Limit`].
///
/// Three constructors choose the protocol, each with a limit: a number, or any [`Acquire`].
///
/// | constructor | classifier | a rejection is answered | deadline |
/// |---|---|---|---|
/// | [`new`](Self::new) | [`DefaultClassifier`]: what the response says ([`OperationOutput`](crate::classify::OperationOutput)) | never (no protocol, `()`): the layer refuses a limit that may reject | none |
/// | [`new_for_http`](Self::new_for_http) | [`HttpClassifier`] | `503` | [`server_timeout`](Self::server_timeout), a header |
/// | [`new_for_grpc`](Self::new_for_grpc) | [`HttpClassifier::grpc`]: each call by its `grpc-status` | RESOURCE_EXHAUSTED | `grpc-timeout`, [`server_timeout`](Self::server_timeout) |
///
/// ```
/// use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};
///
/// // Verification and judging share four slots.
/// let slots = Limit::new(4);
/// let verify = ResourcesOperationLayer::new_for_http(slots.clone())
///     .operation(Operation::Verify)
///     .executor(Executor::Subprocess);
/// let judge = ResourcesOperationLayer::new_for_http(slots)
///     .operation(Operation::Judge)
///     .executor(Executor::Inline);
/// # drop((verify, judge));
/// ```
///
/// Defaults: [`Operation::Other`], [`Executor::Other`], the metrics of the global meter
/// provider (decided when a service of the layer first serves a request; see
/// [`metrics`](Self::metrics)), and the operation ending when the inner service answers. The
/// type parameters are set by the builder methods: `C` the classifier
/// ([`classifier`](Self::classifier)), `L` the limit, `P` the protocol
/// ([`protocol`](Self::protocol)), `E` where the operation ends: `()` when the inner service
/// answers, [`AtBodyEnd`] when the response body ends ([`until_body_end`](Self::until_body_end)). [`HttpLayer`] names the HTTP and gRPC
/// ones; [`per_request`](Self::per_request) makes a
/// [`PerRequestLayer`](crate::per_request::PerRequestLayer).
pub struct ResourcesOperationLayer<C = DefaultClassifier, L = Limit, P = (), E = ()> {
    pub(crate) config: Arc<Config<C, L, P>>,
    _end: PhantomData<fn() -> E>,
}

/// The layer [`new_for_http`](ResourcesOperationLayer::new_for_http) and
/// [`new_for_grpc`](ResourcesOperationLayer::new_for_grpc) make, on a limit `L`.
pub type HttpLayer<L = Limit, E = ()> = ResourcesOperationLayer<HttpClassifier, L, Http, E>;

impl ResourcesOperationLayer {
    /// A generic layer on `limit`: a number of operations at once (a new [`Limit`]), or any
    /// [`Acquire`] (a [`Limit`] whose clones share it, an `Arc<Semaphore>`, a limit of your
    /// own). It has no protocol (`()`): like tower's limit it never answers a rejection, so it
    /// refuses a limit that may turn operations away (give it [`protocol`](Self::protocol)
    /// first).
    ///
    /// Its classifier is the [`DefaultClassifier`]: each response says how its operation ended
    /// ([`OperationOutput`](crate::classify::OperationOutput)). An `http::Response` is read by
    /// its status (a `5xx` is `error`) or its `grpc-status`, so this layer, put where tower's
    /// `ConcurrencyLimitLayer::new` was on an axum route or a tonic service, counts a `500` as
    /// an error; a process's `Output` by its exit status; a plain value is `ok`. A response type
    /// of your own implements `OperationOutput`, or the layer is given a
    /// [`classifier`](Self::classifier) of its own.
    ///
    /// # Panics
    ///
    /// If `limit` is a number that is 0 or above tokio's `Semaphore::MAX_PERMITS` (use
    /// [`Limit::try_new`] to get an error instead).
    #[track_caller]
    pub fn new<T: IntoLimit>(limit: T) -> ResourcesOperationLayer<DefaultClassifier, T::Limit> {
        ResourcesOperationLayer::from_config(Config::new(
            limit.into_limit(),
            DefaultClassifier,
            (),
            false,
        ))
    }

    /// A layer for `http::Response` services (axum, hyper) on `limit`: the [`HttpClassifier`]
    /// (`5xx` is `error`, `504`/`408` `timeout`, `499` `cancelled`), and the [`Http`] protocol
    /// (a rejection is `503 Service Unavailable`).
    #[track_caller]
    pub fn new_for_http<T: IntoLimit>(limit: T) -> HttpLayer<T::Limit> {
        ResourcesOperationLayer::from_config(Config::new(
            limit.into_limit(),
            HttpClassifier::new(),
            Http::new(),
            true,
        ))
    }

    /// A layer for tonic services on `limit`: gRPC's form of the [`HttpClassifier`], which reads
    /// each call's `grpc-status`, and gRPC's form of the [`Http`] protocol
    /// ([`Http::grpc`]: a rejection is RESOURCE_EXHAUSTED; a call dropped past its
    /// `grpc-timeout` is `timeout`).
    #[track_caller]
    pub fn new_for_grpc<T: IntoLimit>(limit: T) -> HttpLayer<T::Limit> {
        ResourcesOperationLayer::from_config(Config::new(
            limit.into_limit(),
            HttpClassifier::grpc(),
            Http::grpc(),
            true,
        ))
    }
}

impl<C, L, P, E> ResourcesOperationLayer<C, L, P, E> {
    fn from_config(config: Config<C, L, P>) -> Self {
        Self {
            config: Arc::new(config),
            _end: PhantomData,
        }
    }

    /// The limit.
    pub fn limit(&self) -> &L {
        &self.config.limit
    }
}

impl<C: Clone, L: Clone, P: Clone, E> ResourcesOperationLayer<C, L, P, E> {
    /// Changes the configuration (how its operations record is decided anew).
    fn configure(mut self, change: impl FnOnce(&mut Config<C, L, P>)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.changed();
        change(config);
        self
    }

    /// Changes the configuration's type.
    fn reconfigure<D, M, Q>(
        self,
        change: impl FnOnce(Config<C, L, P>) -> Config<D, M, Q>,
    ) -> ResourcesOperationLayer<D, M, Q, E> {
        let config = Arc::try_unwrap(self.config).unwrap_or_else(|shared| (*shared).clone());
        ResourcesOperationLayer::from_config(change(config))
    }

    /// Tags this layer's operations with `operation`. Defaults to [`Operation::Other`].
    pub fn operation(self, operation: Operation) -> Self {
        self.configure(|config| config.operation = operation)
    }

    /// Tags this layer's operations with `executor`. Defaults to [`Executor::Other`].
    pub fn executor(self, executor: Executor) -> Self {
        self.configure(|config| config.executor = executor)
    }

    /// Reports through `metrics`; then the global provider is never consulted, and the series
    /// reports 0 from the moment the layer makes its first service.
    ///
    /// Defaults to [`OperationMetrics::global`], decided as late as possible: when a service of
    /// this layer first serves a request, not when the layer is built. So "build the router,
    /// install the global provider, serve" records into that provider.
    pub fn metrics(self, metrics: OperationMetrics) -> Self {
        self.configure(|config| config.metrics = MetricsSource::Given(metrics))
    }

    /// Reports `capacity` as this layer's limit in `gym.resources.operation.limit`, for a limit
    /// that does not know its own (an `Arc<Semaphore>`); a [`Limit`] reports its own. Give
    /// clones of one [`Capacity`] to layers that share one semaphore, so it counts once.
    pub fn capacity(self, capacity: Capacity) -> Self {
        self.configure(|config| config.capacity = Some(capacity))
    }

    /// Turns away, with [`Rejection::QueueTimeout`](crate::Rejection::QueueTimeout), an
    /// operation of this layer that has waited `timeout` for its permit; `None` lets it wait as
    /// long as it takes (the default). The layer's type stays the same either way, so a
    /// timeout read from a config file can be set or not:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resources_operation::ResourcesOperationLayer;
    ///
    /// let from_config: Option<u64> = Some(250);
    /// let layer = ResourcesOperationLayer::new_for_http(4)
    ///     .queue_timeout(from_config.map(Duration::from_millis));
    /// # drop(layer);
    /// ```
    ///
    /// # Panics
    ///
    /// A queue timeout turns operations away, so the layer must answer rejections: a layer
    /// that has none (`()`, the protocol of [`new`](ResourcesOperationLayer::new)) panics here,
    /// saying so. Give it a
    /// [`protocol`](Self::protocol) that answers first.
    ///
    /// ```should_panic
    /// use std::time::Duration;
    /// use tower_resources_operation::ResourcesOperationLayer;
    ///
    /// // No protocol: no answer to a queue timeout.
    /// let layer = ResourcesOperationLayer::new(4).queue_timeout(Duration::from_millis(250));
    /// ```
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resources_operation::protocol::RejectAsError;
    /// use tower_resources_operation::ResourcesOperationLayer;
    ///
    /// let layer = ResourcesOperationLayer::new(4)
    ///     .protocol(RejectAsError)
    ///     .queue_timeout(Duration::from_millis(250));
    /// # drop(layer);
    /// ```
    #[track_caller]
    pub fn queue_timeout(self, timeout: impl Into<Option<Duration>>) -> Self {
        let timeout = timeout.into();
        if timeout.is_some() && !self.config.answers {
            panic!(
                "tower-resources-operation: a queue timeout turns operations away, but this \
                 layer has no protocol (the generic layer of new(..)), so it cannot answer a rejection: \
                 give the layer .protocol(RejectAsError) (a BoxError service) before \
                 .queue_timeout(..), or use new_for_http / new_for_grpc"
            );
        }
        self.configure(|config| config.queue_timeout = timeout)
    }

    /// Decides outcomes with `classifier`, a
    /// [`ClassifyOutcome`](crate::classify::ClassifyOutcome) (closures included), cloned for each
    /// operation that records.
    pub fn classifier<D: Clone>(self, classifier: D) -> ResourcesOperationLayer<D, L, P, E> {
        self.reconfigure(|config| config.map(|_| classifier, |limit| limit, |protocol| protocol))
    }

    /// Speaks `protocol`: how a rejection is answered, and where a caller's deadline is read
    /// (see [`protocol`](crate::protocol); a closure `Fn(Rejected) -> Result<Res, Err>` answers
    /// with what it returns). The layer then answers rejections: every protocol does but `()`,
    /// the generic layer's none.
    pub fn protocol<Q: Clone>(self, protocol: Q) -> ResourcesOperationLayer<C, L, Q, E> {
        self.reconfigure(|config| {
            let mut config = config.map(|classifier| classifier, |limit| limit, |_| protocol);
            config.answers = true;
            config
        })
    }

    /// Holds each operation until its `http::Response` body ends, rather than until the inner
    /// service answers: the permit, the `active` count and the run time last while the body
    /// streams (server-sent events, streamed tokens, gRPC server streams), and the outcome can
    /// come from the trailers. The response body becomes an
    /// [`OperationBody`](crate::OperationBody).
    pub fn until_body_end(self) -> ResourcesOperationLayer<C, L, P, AtBodyEnd> {
        ResourcesOperationLayer {
            config: self.config,
            _end: PhantomData,
        }
    }
}

impl<C: Clone, L: Clone, E> ResourcesOperationLayer<C, L, Http, E> {
    /// The server gives up on every request after `timeout` (tower-http's `TimeoutLayer`
    /// outside this layer, or Router-wide; tonic's `Server::timeout`): an operation it drops
    /// past that is `timeout`, not `cancelled`. See [`Http::server_timeout`].
    pub fn server_timeout(self, timeout: Duration) -> Self {
        self.configure(|config| config.protocol = config.protocol.clone().server_timeout(timeout))
    }
}

// The service's own constructor builds through the layer, so that both resolve a limit and
// the metrics alike; it stands here, beside what it calls.
impl<S> ResourcesOperation<S> {
    /// `inner`, limited by `limit` (a number of operations at once, or any [`Acquire`]), tagged
    /// `other`/`other` and reporting to the global meter provider (see
    /// [`ResourcesOperationLayer::new`], whose `layer` this is).
    #[track_caller]
    pub fn new<T>(inner: S, limit: T) -> ResourcesOperation<S, DefaultClassifier, T::Limit>
    where
        T: IntoLimit,
        T::Limit: Clone,
    {
        ResourcesOperationLayer::new(limit).layer(inner)
    }
}

impl<S, C, L, P, E> Layer<S> for ResourcesOperationLayer<C, L, P, E>
where
    L: Acquire + Clone,
{
    type Service = ResourcesOperation<S, C, L, P, E>;

    #[track_caller]
    fn layer(&self, inner: S) -> Self::Service {
        self.config.check();
        if let MetricsSource::Given(_) = self.config.metrics {
            // Given metrics report the series from now on.
            self.config.series();
        }
        ResourcesOperation::from_config(inner, Arc::clone(&self.config))
    }
}

impl<C, L, P, E> Clone for ResourcesOperationLayer<C, L, P, E> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
            _end: PhantomData,
        }
    }
}

impl<C, L: Acquire, P, E> fmt::Debug for ResourcesOperationLayer<C, L, P, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = &*self.config;
        f.debug_struct("ResourcesOperationLayer")
            .field("operation", &config.operation)
            .field("executor", &config.executor)
            .field("limit", &config.described_limit())
            .field("answers_rejections", &config.answers)
            .field("metrics", &config.metrics)
            .finish_non_exhaustive()
    }
}
