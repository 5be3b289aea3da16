//! The layer, its service, the service's response future, and the body of an operation that
//! ends with its response body.

mod body;
mod future;
mod service;

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tower_layer::Layer;

pub use body::{AtBodyEnd, AtHead, End, OperationBody};
pub use future::ResponseFuture;
pub use service::ResourcesOperation;

use crate::attributes::{Executor, Operation};
use crate::classify::{DefaultClassifier, GrpcClassifier, HttpClassifier};
use crate::limit::{Acquire, Capacity, IntoLimit, Limit, LimitId};
use crate::metrics::{MetricsSource, OperationMetrics, Series};
use crate::protocol::{CanAnswer, Grpc, Http, Plain};

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
/// The protocol brings its classifier, its answer to a rejection and its deadlines:
///
/// | constructor | classifier | a rejection is answered | deadline |
/// |---|---|---|---|
/// | [`new`](Self::new) | [`DefaultClassifier`]: what the response says ([`OperationOutput`](crate::classify::OperationOutput)), an `http::Response` by its status | never: the layer refuses a limit that may reject ([`Plain`]) | none |
/// | [`new_for_http`](Self::new_for_http) | [`HttpClassifier`] | `503` ([`Http`]) | [`server_timeout`](Self::server_timeout), a header |
/// | [`new_for_grpc`](Self::new_for_grpc) | [`GrpcClassifier`] | RESOURCE_EXHAUSTED ([`Grpc`]) | `grpc-timeout`, [`server_timeout`](ResourcesOperationLayer::server_timeout) |
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
/// [`metrics`](Self::metrics)), and the operation ending when the inner service answers
/// ([`AtHead`]). The type parameters are set by the builder methods: `C` the classifier
/// ([`classifier`](Self::classifier)), `L` the limit, `P` the protocol
/// ([`protocol`](Self::protocol)), `E` where an operation ends
/// ([`until_body_end`](Self::until_body_end)). [`HttpLayer`] and [`GrpcLayer`] name the
/// common ones; [`per_request`](Self::per_request) makes a
/// [`PerRequestLayer`](crate::per_request::PerRequestLayer).
pub struct ResourcesOperationLayer<C = DefaultClassifier, L = Limit, P = Plain, E = AtHead> {
    pub(crate) config: Arc<Config<C, L, P>>,
    pub(crate) _end: PhantomData<fn() -> E>,
}

/// The layer [`new_for_http`](ResourcesOperationLayer::new_for_http) makes, on a limit `L`.
pub type HttpLayer<L = Limit, E = AtHead> = ResourcesOperationLayer<HttpClassifier, L, Http, E>;

/// The layer [`new_for_grpc`](ResourcesOperationLayer::new_for_grpc) makes, on a limit `L`.
pub type GrpcLayer<L = Limit, E = AtHead> = ResourcesOperationLayer<GrpcClassifier, L, Grpc, E>;

/// What a layer shares with every service it makes.
pub(crate) struct Config<C, L, P> {
    pub(crate) limit: L,
    /// Whether the limit hears each operation's end ([`Acquire::hears_ends`]), asked once.
    pub(crate) hears: bool,
    pub(crate) classifier: C,
    pub(crate) protocol: P,
    /// Whether the protocol answers rejections (all but [`Plain`]).
    pub(crate) answers: bool,
    pub(crate) operation: Operation,
    pub(crate) executor: Executor,
    pub(crate) metrics: MetricsSource,
    /// The capacity given with [`ResourcesOperationLayer::capacity`].
    pub(crate) capacity: Option<Capacity>,
    /// How long an operation of the layer may wait ([`ResourcesOperationLayer::queue_timeout`]).
    pub(crate) queue_timeout: Option<Duration>,
    /// Whether a per-request layer chooses its operations (then a request that matched no
    /// route is its chooser's to place, not a mistake).
    pub(crate) per_request: bool,
    /// The series its operations record through, once decided.
    series: OnceLock<Recording>,
}

impl<C, L: Acquire, P> Config<C, L, P> {
    /// The series this layer's operations record through; `None` when metrics are disabled.
    /// The global metrics are decided here, at the first call.
    #[inline]
    pub(crate) fn series(&self) -> Option<&Series> {
        self.recording().series.as_ref()
    }

    /// How this layer's operations record: through which series, and whether an operation
    /// records at all (it does with metrics, or for a limit that hears ends). Decided at the
    /// first call, the global metrics with it.
    #[inline]
    pub(crate) fn recording(&self) -> &Recording {
        self.series.get_or_init(|| {
            let capacity = self.capacity.clone().or_else(|| self.limit.capacity());
            let series = self
                .metrics
                .resolve()
                .series(self.operation, self.executor, capacity.as_ref())
                .cloned();
            Recording {
                records: series.is_some() || self.hears,
                series,
                limit_id: self.limit.id(),
                capacity,
            }
        })
    }

    /// Whether a service of this layer could be left with a rejection it cannot answer.
    #[track_caller]
    pub(crate) fn check(&self) {
        if !self.answers && (self.limit.may_reject() || self.queue_timeout.is_some()) {
            panic!(
                "tower-resources-operation: this limit ({}, {:?}) may turn operations away (a \
                 queue bound or a queue timeout), but this layer cannot answer a rejection: give \
                 it a protocol that answers, such as .protocol(RejectAsError) for a BoxError \
                 service, or use new_for_http / new_for_grpc",
                std::any::type_name::<L>(),
                self.described_limit()
            );
        }
    }

    /// The limit, as a warning names it: `"workers"` (2 at once), or its type.
    pub(crate) fn named_limit(&self) -> String {
        let DescribedLimit { name, capacity } = self.described_limit();
        let name = match name {
            Some(name) => format!("{name:?}"),
            None => std::any::type_name::<L>().to_owned(),
        };
        match capacity {
            Some(capacity) => format!(": the limit {name} ({capacity} at once)"),
            None => format!(": the limit {name}"),
        }
    }

    /// The limit, as `Debug` shows it: its name and capacity, as the metrics see them.
    pub(crate) fn described_limit(&self) -> DescribedLimit {
        let capacity = self.capacity.clone().or_else(|| self.limit.capacity());
        DescribedLimit {
            name: capacity.as_ref().and_then(Capacity::shared_name).cloned(),
            capacity: capacity.as_ref().and_then(Capacity::get),
        }
    }
}

/// How a layer's operations record, decided once: see [`Config::recording`].
#[derive(Debug)]
pub(crate) struct Recording {
    /// `None` when metrics are disabled.
    pub(crate) series: Option<Series>,
    /// Whether an operation records anything: with a series, or for a limit that hears ends.
    pub(crate) records: bool,
    /// Which limit it is, if the limit says ([`Acquire::id`]).
    pub(crate) limit_id: Option<LimitId>,
    /// The limit's name and readings, for the operations' spans.
    pub(crate) capacity: Option<Capacity>,
}

/// A layer's limit in its `Debug` output.
pub(crate) struct DescribedLimit {
    name: Option<Arc<str>>,
    capacity: Option<usize>,
}

impl fmt::Debug for DescribedLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl<C: Clone, L: Clone, P: Clone> Clone for Config<C, L, P> {
    /// The same configuration, whose series is decided anew.
    fn clone(&self) -> Self {
        Self {
            limit: self.limit.clone(),
            hears: self.hears,
            classifier: self.classifier.clone(),
            protocol: self.protocol.clone(),
            answers: self.answers,
            operation: self.operation,
            executor: self.executor,
            metrics: self.metrics.clone(),
            capacity: self.capacity.clone(),
            queue_timeout: self.queue_timeout,
            per_request: self.per_request,
            series: OnceLock::new(),
        }
    }
}

impl<C, L, P> Config<C, L, P> {
    /// The same configuration with other parts: `change` gets it by value.
    fn map<D, M, Q>(
        self,
        change: impl FnOnce(Parts<C, L, P>) -> Parts<D, M, Q>,
    ) -> Config<D, M, Q> {
        let Parts {
            limit,
            classifier,
            protocol,
            answers,
        } = change(Parts {
            limit: self.limit,
            classifier: self.classifier,
            protocol: self.protocol,
            answers: self.answers,
        });
        Config {
            limit,
            hears: self.hears,
            classifier,
            protocol,
            answers,
            operation: self.operation,
            executor: self.executor,
            metrics: self.metrics,
            capacity: self.capacity,
            queue_timeout: self.queue_timeout,
            per_request: self.per_request,
            series: OnceLock::new(),
        }
    }
}

/// The parts of a configuration that a builder method can change the type of.
struct Parts<C, L, P> {
    limit: L,
    classifier: C,
    protocol: P,
    answers: bool,
}

impl ResourcesOperationLayer {
    /// A generic layer on `limit`: a number of operations at once (a new [`Limit`]), or any
    /// [`Acquire`] (a [`Limit`] whose clones share it, an `Arc<Semaphore>`, a limit of your
    /// own). Its protocol is [`Plain`]: like tower's limit it never answers a rejection, so it
    /// refuses a limit that may turn operations away (give it [`protocol`](Self::protocol)
    /// first).
    ///
    /// Its classifier is the [`DefaultClassifier`]: each response says how its operation ended
    /// ([`OperationOutput`](crate::classify::OperationOutput)). An `http::Response` is read by
    /// its status (a `5xx` is `error`), so this layer, put where tower's
    /// `ConcurrencyLimitLayer::new` was on an axum route or a tonic service, counts a `500` as
    /// an error; a process's `Output` by its exit status; a plain value is `ok`. A response type
    /// of your own implements `OperationOutput`, or the layer is given the
    /// [`ResultClassifier`](crate::classify::ResultClassifier).
    ///
    /// # Panics
    ///
    /// If `limit` is a number above tokio's `Semaphore::MAX_PERMITS` (use
    /// [`Limit::try_new`] to get an error instead).
    #[track_caller]
    pub fn new<T: IntoLimit>(limit: T) -> ResourcesOperationLayer<DefaultClassifier, T::Limit> {
        ResourcesOperationLayer::from_parts(limit.into_limit(), DefaultClassifier, Plain, false)
    }

    /// A layer for `http::Response` services (axum, hyper) on `limit`: the [`HttpClassifier`]
    /// (`5xx` is `error`, `504`/`408` `timeout`, `499` `cancelled`), and the [`Http`] protocol
    /// (a rejection is `503 Service Unavailable`).
    #[track_caller]
    pub fn new_for_http<T: IntoLimit>(
        limit: T,
    ) -> ResourcesOperationLayer<HttpClassifier, T::Limit, Http> {
        ResourcesOperationLayer::from_parts(
            limit.into_limit(),
            HttpClassifier::new(),
            Http::new(),
            true,
        )
    }

    /// A layer for tonic services on `limit`: the [`GrpcClassifier`] (the outcome comes from
    /// each call's `grpc-status`), and the [`Grpc`] protocol (a rejection is RESOURCE_EXHAUSTED;
    /// a call dropped past its `grpc-timeout` is `timeout`).
    #[track_caller]
    pub fn new_for_grpc<T: IntoLimit>(
        limit: T,
    ) -> ResourcesOperationLayer<GrpcClassifier, T::Limit, Grpc> {
        ResourcesOperationLayer::from_parts(limit.into_limit(), GrpcClassifier, Grpc::new(), true)
    }
}

impl<C, L: Acquire, P> ResourcesOperationLayer<C, L, P> {
    fn from_parts(limit: L, classifier: C, protocol: P, answers: bool) -> Self {
        Self {
            config: Arc::new(Config {
                hears: limit.hears_ends(),
                limit,
                classifier,
                protocol,
                answers,
                operation: Operation::Other,
                executor: Executor::Other,
                metrics: MetricsSource::Global,
                capacity: None,
                queue_timeout: None,
                per_request: false,
                series: OnceLock::new(),
            }),
            _end: PhantomData,
        }
    }
}

impl<C, L, P, E> ResourcesOperationLayer<C, L, P, E>
where
    C: Clone,
    L: Clone,
    P: Clone,
{
    /// Changes the configuration (its series is decided anew).
    fn configure(mut self, change: impl FnOnce(&mut Config<C, L, P>)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.series = OnceLock::new();
        change(config);
        self
    }

    /// Changes the configuration's type.
    fn reconfigure<D, M, Q>(
        self,
        change: impl FnOnce(Parts<C, L, P>) -> Parts<D, M, Q>,
    ) -> ResourcesOperationLayer<D, M, Q, E> {
        let config = Arc::try_unwrap(self.config).unwrap_or_else(|shared| (*shared).clone());
        ResourcesOperationLayer {
            config: Arc::new(config.map(change)),
            _end: PhantomData,
        }
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

    /// Decides outcomes with `classifier`, a
    /// [`ClassifyOutcome`](crate::classify::ClassifyOutcome) (closures included), cloned for each
    /// operation that records.
    pub fn classifier<D: Clone>(self, classifier: D) -> ResourcesOperationLayer<D, L, P, E> {
        self.reconfigure(|parts| Parts {
            classifier,
            limit: parts.limit,
            protocol: parts.protocol,
            answers: parts.answers,
        })
    }

    /// Speaks `protocol`: how a rejection is answered, and where a caller's deadline is read
    /// (see [`protocol`](crate::protocol); a closure `Fn(Rejected) -> Result<Res, Err>` answers
    /// with what it returns).
    ///
    /// # Panics
    ///
    /// If `protocol` cannot answer a rejection ([`Plain`]) and the layer has a
    /// [`queue_timeout`](Self::queue_timeout).
    #[track_caller]
    pub fn protocol<Q: CanAnswer>(self, protocol: Q) -> ResourcesOperationLayer<C, L, Q, E> {
        let answers = Q::CAN_ANSWER;
        if !answers && self.config.queue_timeout.is_some() {
            panic!(
                "tower-resources-operation: this layer has a queue timeout, which turns \
                 operations away, but {} cannot answer a rejection",
                std::any::type_name::<Q>()
            );
        }
        self.reconfigure(|parts| Parts {
            protocol,
            answers,
            limit: parts.limit,
            classifier: parts.classifier,
        })
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
    /// A layer with a queue timeout must answer rejections: a layer whose protocol cannot
    /// ([`Plain`], the protocol of [`new`](ResourcesOperationLayer::new)) is refused when the
    /// program is built, with an error at this call. Give it a [`protocol`](Self::protocol)
    /// that answers first:
    ///
    /// ```compile_fail,E0080
    /// use std::time::Duration;
    /// use tower_resources_operation::ResourcesOperationLayer;
    ///
    /// // `Plain` has no answer to a queue timeout: this does not build.
    /// let layer = ResourcesOperationLayer::new(4).queue_timeout(Duration::from_millis(250));
    /// # drop(layer);
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
    pub fn queue_timeout(self, timeout: impl Into<Option<Duration>>) -> Self
    where
        P: CanAnswer,
    {
        const {
            assert!(
                P::CAN_ANSWER,
                "tower-resources-operation: a queue timeout turns operations away, but this \
                 layer's protocol (Plain, the protocol of new(..)) cannot answer a rejection: \
                 give the layer .protocol(RejectAsError) (a BoxError service) before \
                 .queue_timeout(..), or use new_for_http / new_for_grpc"
            )
        };
        let timeout = timeout.into();
        self.configure(|config| config.queue_timeout = timeout)
    }

    /// Holds each operation until its `http::Response` body ends, rather than until the inner
    /// service answers: the permit, the `active` count and the run time last while the body
    /// streams (server-sent events, streamed tokens, gRPC server streams), and the outcome can
    /// come from the trailers. The response body becomes an [`OperationBody`].
    pub fn until_body_end(self) -> ResourcesOperationLayer<C, L, P, AtBodyEnd> {
        ResourcesOperationLayer {
            config: self.config,
            _end: PhantomData,
        }
    }

    /// The limit.
    pub fn limit(&self) -> &L {
        &self.config.limit
    }
}

impl<C: Clone, L: Clone, P: Clone, E> ResourcesOperationLayer<C, L, P, E> {
    /// Tags this layer's operations with `operation`. Defaults to [`Operation::Other`].
    pub fn operation(self, operation: Operation) -> Self {
        self.configure(|config| config.operation = operation)
    }

    /// Tags this layer's operations with `executor`. Defaults to [`Executor::Other`].
    pub fn executor(self, executor: Executor) -> Self {
        self.configure(|config| config.executor = executor)
    }
}

impl<C: Clone, L: Clone, E> ResourcesOperationLayer<C, L, Http, E> {
    /// The server gives up on every request after `timeout` (tower-http's `TimeoutLayer`
    /// outside this layer, or Router-wide): an operation it drops past that is `timeout`, not
    /// `cancelled`. See [`Http::server_timeout`].
    pub fn server_timeout(self, timeout: Duration) -> Self {
        self.configure(|config| config.protocol = config.protocol.clone().server_timeout(timeout))
    }
}

impl<C: Clone, L: Clone, E> ResourcesOperationLayer<C, L, Grpc, E> {
    /// The server gives up on every call after `timeout` (tonic's `Server::timeout`): a call it
    /// drops past that is `timeout`, not `cancelled`. See [`Grpc::server_timeout`].
    pub fn server_timeout(self, timeout: Duration) -> Self {
        self.configure(|config| config.protocol = config.protocol.clone().server_timeout(timeout))
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
