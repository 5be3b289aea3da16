//! One layer over a whole axum `Router` or tonic `Server`, where each request chooses its
//! operation and executor, or to go unlimited.
//!
//! A layer made [`per_request`](crate::ResourcesOperationLayer::per_request) needs the request to
//! choose, which `poll_ready` does not have, so it takes its permit after `call`: its
//! `poll_ready` is always ready, and each limited request goes through a clone of the inner
//! service (which must be `Clone`) that waits for its permit in the response future, as the
//! layer's per-route form does. `queued` counts a request from `call` on (a per-route layer
//! counts it from its first `poll_ready`, which under hyper and axum is the same moment); an
//! unlimited request is neither limited nor recorded. Every choice is one of the bounded values,
//! whatever the request; a chooser that panics costs the request its choice (it is limited as
//! [`Choice::OTHER`]), never its answer.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tower::util::Oneshot;
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use crate::classify::ClassifyOutcome;
use crate::diagnostics::{self, Mistake};
use crate::guard::guarded;
use crate::layer::{Config, End, ResourcesOperation, ResourcesOperationLayer};
use crate::limit::Acquire;
use crate::metrics::MetricsSource;
use crate::protocol::Protocol;
use crate::{Executor, Operation};

const SERIES: usize = Operation::ALL.len() * Executor::ALL.len();

/// What a request is, to a layer over many routes: an operation of some series, under the
/// layer's limit or one of its [named limits](crate::ResourcesOperationLayer::limits), or not
/// limited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Limited, and recorded as `operation` on `executor`.
    Limited {
        /// The request's operation.
        operation: Operation,
        /// Where it runs.
        executor: Executor,
        /// The name of the limit it takes its permit from, among the layer's
        /// [`limits`](crate::ResourcesOperationLayer::limits); `None` for the layer's own.
        limit: Option<&'static str>,
    },
    /// Not limited and not recorded: a health check, `/metrics`.
    Unlimited,
}

impl Choice {
    /// [`Choice::Limited`] with `operation` and `executor`, under the layer's own limit.
    pub const fn limited(operation: Operation, executor: Executor) -> Self {
        Choice::Limited {
            operation,
            executor,
            limit: None,
        }
    }

    /// This choice, under the layer's limit named `limit` (see
    /// [`limits`](crate::ResourcesOperationLayer::limits)) rather than its own. An unlimited
    /// choice stays unlimited.
    ///
    /// ```
    /// use tower_resources_operation::per_request::Choice;
    /// use tower_resources_operation::{Executor, Operation};
    ///
    /// let verify = Choice::limited(Operation::Verify, Executor::Subprocess).on("verifiers");
    /// assert!(matches!(verify, Choice::Limited { limit: Some("verifiers"), .. }));
    /// ```
    pub const fn on(self, limit: &'static str) -> Self {
        match self {
            Choice::Limited {
                operation,
                executor,
                ..
            } => Choice::Limited {
                operation,
                executor,
                limit: Some(limit),
            },
            Choice::Unlimited => Choice::Unlimited,
        }
    }

    /// What a request that no rule names is, unless told otherwise: limited, as
    /// `other`/`other`.
    pub const OTHER: Choice = Choice::limited(Operation::Other, Executor::Other);
}

/// Chooses, from a request, its operation and executor, or that it is not limited.
///
/// Every `Fn(&Req) -> Choice` is one. The choice is bounded whatever the request: it is one of
/// NeMo Gym's values or none.
pub trait ChooseOperation<Req> {
    /// What `request` is.
    fn choose(&self, request: &Req) -> Choice;

    /// Every choice this chooser can make, if it knows them (rules do; a closure does not):
    /// a layer reports their series from the start, 0 included, and checks, when it makes its
    /// service, that each limit they name is one it has. Defaults to none.
    fn choices(&self) -> Vec<Choice> {
        Vec::new()
    }
}

impl<F, Req> ChooseOperation<Req> for F
where
    F: Fn(&Req) -> Choice,
{
    fn choose(&self, request: &Req) -> Choice {
        self(request)
    }
}

/// Chooses by gRPC service and method, from the request path (`/package.Service/Method`).
///
/// A method's rule wins over its service's; a request that no rule names is
/// [`otherwise`](Self::otherwise) (by default `other`/`other`, limited).
///
/// ```
/// use tower_resources_operation::per_request::{ByGrpcMethod, Choice, ChooseOperation};
/// use tower_resources_operation::{Executor, Operation};
///
/// let chooser = ByGrpcMethod::new()
///     .service("nemo.Verifier", Choice::limited(Operation::Verify, Executor::Subprocess))
///     .method("nemo.Verifier/Judge", Choice::limited(Operation::Judge, Executor::Inline))
///     .service("grpc.health.v1.Health", Choice::Unlimited);
/// let request = |path: &str| http::Request::post(path).body(()).unwrap();
/// assert_eq!(
///     chooser.choose(&request("/nemo.Verifier/Check")),
///     Choice::limited(Operation::Verify, Executor::Subprocess)
/// );
/// assert_eq!(
///     chooser.choose(&request("/nemo.Verifier/Judge")),
///     Choice::limited(Operation::Judge, Executor::Inline)
/// );
/// assert_eq!(chooser.choose(&request("/grpc.health.v1.Health/Check")), Choice::Unlimited);
/// assert_eq!(chooser.choose(&request("/unknown.Service/Call")), Choice::OTHER);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ByGrpcMethod {
    table: Arc<Table>,
}

/// Rules by name, and what a request no rule names is.
#[derive(Clone, Debug)]
struct Table {
    exact: HashMap<Box<str>, Choice>,
    prefix: HashMap<Box<str>, Choice>,
    otherwise: Choice,
}

impl Table {
    /// Every choice of the rules, and the choice for a request that no rule names.
    fn choices(&self) -> Vec<Choice> {
        let mut choices: Vec<Choice> = Vec::new();
        let rules = self.exact.values().chain(self.prefix.values());
        for choice in rules.chain([&self.otherwise]) {
            if !choices.contains(choice) {
                choices.push(*choice);
            }
        }
        choices
    }
}

impl Default for Table {
    fn default() -> Self {
        Self {
            exact: HashMap::new(),
            prefix: HashMap::new(),
            otherwise: Choice::OTHER,
        }
    }
}

impl ByGrpcMethod {
    /// No rules: every request is `other`/`other`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests to `service` (`package.Service`) are `choice`.
    pub fn service(mut self, service: &str, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table)
            .prefix
            .insert(service.trim_matches('/').into(), choice);
        self
    }

    /// Requests to `method` (`package.Service/Method`) are `choice`.
    pub fn method(mut self, method: &str, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table)
            .exact
            .insert(method.trim_matches('/').into(), choice);
        self
    }

    /// Requests that no rule names are `choice`.
    pub fn otherwise(mut self, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table).otherwise = choice;
        self
    }
}

impl<B> ChooseOperation<http::Request<B>> for ByGrpcMethod {
    fn choose(&self, request: &http::Request<B>) -> Choice {
        let path = request.uri().path().trim_start_matches('/');
        let table = &*self.table;
        if let Some(choice) = table.exact.get(path) {
            return *choice;
        }
        let service = path.split_once('/').map_or(path, |(service, _)| service);
        table
            .prefix
            .get(service)
            .copied()
            .unwrap_or(table.otherwise)
    }

    fn choices(&self) -> Vec<Choice> {
        self.table.choices()
    }
}

/// Chooses by the route axum matched (`axum::extract::MatchedPath`, such as `/users/{id}`).
///
/// A request whose route no rule names, or that matched no route (a 404 from the fallback), is
/// [`otherwise`](Self::otherwise) (by default `other`/`other`, limited). Put the layer on the
/// `Router` with `Router::layer` (axum applies it to each route, after matching); around the
/// whole router, from outside, no route is matched yet.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_resources_operation::per_request::{ByMatchedPath, Choice};
/// use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
///
/// let chooser = ByMatchedPath::new()
///     .route("/verify", Choice::limited(Operation::Verify, Executor::Subprocess))
///     .route("/judge/{model}", Choice::limited(Operation::Judge, Executor::Inline))
///     .route("/metrics", Choice::Unlimited)
///     .otherwise(Choice::Unlimited);
/// let app: Router = Router::new()
///     .route("/verify", get(|| async { "verified" }))
///     .route("/judge/{model}", get(|| async { "judged" }))
///     .route("/metrics", get(|| async { "" }))
///     .layer(ResourcesOperationLayer::new_for_http(8).per_request(chooser));
/// # drop(app);
/// ```
#[cfg(feature = "axum")]
#[derive(Clone, Debug, Default)]
pub struct ByMatchedPath {
    table: Arc<Table>,
}

#[cfg(feature = "axum")]
impl ByMatchedPath {
    /// No rules: every request is `other`/`other`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests that matched `route` (as written in `Router::route`) are `choice`.
    pub fn route(mut self, route: &str, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table)
            .exact
            .insert(route.into(), choice);
        self
    }

    /// Requests that no rule names, or that matched no route, are `choice`.
    pub fn otherwise(mut self, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table).otherwise = choice;
        self
    }
}

#[cfg(feature = "axum")]
impl<B> ChooseOperation<http::Request<B>> for ByMatchedPath {
    fn choose(&self, request: &http::Request<B>) -> Choice {
        let table = &*self.table;
        request
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .and_then(|matched| table.exact.get(matched.as_str()))
            .copied()
            .unwrap_or(table.otherwise)
    }

    fn choices(&self) -> Vec<Choice> {
        self.table.choices()
    }
}

/// The tags of a layer whose requests each choose their operation with `F`, and the named
/// limits `L` they may choose: see [`per_request`](crate::ResourcesOperationLayer::per_request).
#[derive(Clone, Debug)]
pub struct PerRequest<F, L> {
    chooser: F,
    /// The limits a choice can name, each with its name.
    limits: Arc<[(&'static str, L)]>,
}

/// A service whose requests each choose their operation, made by a layer built
/// [`per_request`](crate::ResourcesOperationLayer::per_request).
///
/// Its `poll_ready` is always ready; `call` sends each limited request through a clone of the
/// inner service that takes its permit as [`ResourcesOperation`] does, and each unlimited one
/// straight to a clone of the inner service.
pub struct PerRequestOperation<S, F, C, L, P, E> {
    inner: S,
    choosing: Arc<Choosing<F, C, L, P>>,
    _end: PhantomData<fn() -> E>,
}

/// A configuration made when a request first needs it.
type Made<C, L, P> = OnceLock<Arc<Config<C, L, P>>>;

/// What the services of one per-request layer share.
struct Choosing<F, C, L, P> {
    chooser: F,
    /// The layer's own configuration, then one per named limit (its limit in place of the
    /// layer's).
    bases: Vec<Arc<Config<C, L, P>>>,
    /// The names of the named limits, in the order of `bases[1..]`.
    names: Vec<&'static str>,
    /// The configuration of each (limit, operation, executor), made when a request first
    /// chooses it: `SERIES` per entry of `bases`.
    by_series: Box<[Made<C, L, P>]>,
    /// Whether the chooser's series were announced to the metrics.
    announced: OnceLock<()>,
}

impl<S, F: Clone, C: Clone, L: Clone, P: Clone, E> PerRequestOperation<S, F, C, L, P, E> {
    fn new(inner: S, tags: &PerRequest<F, L>, base: &Arc<Config<C, L, P>>) -> Self {
        let mut bases = vec![Arc::clone(base)];
        for (_, limit) in tags.limits.iter() {
            let mut config = (**base).clone();
            config.limit = limit.clone();
            // The layer's capacity describes its own limit, not this one.
            config.capacity = None;
            bases.push(Arc::new(config));
        }
        Self {
            inner,
            choosing: Arc::new(Choosing {
                chooser: tags.chooser.clone(),
                names: tags.limits.iter().map(|(name, _)| *name).collect(),
                by_series: (0..bases.len() * SERIES).map(|_| OnceLock::new()).collect(),
                bases,
                announced: OnceLock::new(),
            }),
            _end: PhantomData,
        }
    }
}

impl<S, F, C, L, P, E> PerRequestOperation<S, F, C, L, P, E> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<F, C: Clone, L: Acquire + Clone, P: Clone> Choosing<F, C, L, P> {
    /// Where the limit named `limit` sits in `bases` (0, the layer's own, for `None`); a name
    /// the layer was not given is reported once and takes the layer's own limit.
    fn slot(&self, limit: Option<&'static str>) -> usize {
        let Some(name) = limit else { return 0 };
        match self.names.iter().position(|known| *known == name) {
            Some(index) => index + 1,
            None => {
                diagnostics::report(Mistake::UnknownLimit, &format!(": {name:?}"));
                0
            }
        }
    }

    /// The configuration of the operations of (`operation`, `executor`) under the limit in
    /// `slot`.
    fn config(
        &self,
        slot: usize,
        operation: Operation,
        executor: Executor,
    ) -> &Arc<Config<C, L, P>> {
        let index = slot * SERIES + operation.index() * Executor::ALL.len() + executor.index();
        self.by_series[index].get_or_init(|| {
            let mut config = (*self.bases[slot]).clone();
            config.operation = operation;
            config.executor = executor;
            Arc::new(config)
        })
    }

    /// Reports the series of every choice the chooser knows it can make, from now on, and
    /// reports once a choice that names a limit the layer was not given.
    fn announce<Req>(&self)
    where
        F: ChooseOperation<Req>,
    {
        self.announce_choices(|| guarded(|| self.chooser.choices()).unwrap_or_default());
    }

    /// [`announce`](Self::announce), with the choices that `choices` lists.
    fn announce_choices(&self, choices: impl FnOnce() -> Vec<Choice>) {
        self.announced.get_or_init(|| {
            for choice in choices() {
                if let Choice::Limited {
                    operation,
                    executor,
                    limit,
                } = choice
                {
                    let slot = self.slot(limit);
                    self.config(slot, operation, executor).series();
                }
            }
        });
    }
}

/// The choices of `chooser` if it is one of the crate's rule tables, which know them without
/// being asked about a request.
fn rules_of(chooser: &dyn Any) -> Option<Vec<Choice>> {
    #[cfg(feature = "axum")]
    if let Some(rules) = chooser.downcast_ref::<ByMatchedPath>() {
        return Some(rules.table.choices());
    }
    chooser
        .downcast_ref::<ByGrpcMethod>()
        .map(|rules| rules.table.choices())
}

impl<S, F, C, L, P, E, Request> Service<Request> for PerRequestOperation<S, F, C, L, P, E>
where
    S: Service<Request> + Clone,
    F: ChooseOperation<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error> + Clone,
    E: End<S::Response, S::Error, C, L::Permit>,
{
    type Response = E::Response;
    type Error = S::Error;
    type Future = PerRequestFuture<
        Oneshot<ResourcesOperation<S, C, L, P, E>, Request>,
        Oneshot<S, Request>,
        E,
        C,
        L::Permit,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let choosing = &*self.choosing;
        if choosing.announced.get().is_none() {
            // The first request: the series of every known choice report from now on.
            choosing.announce::<Request>();
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let choosing = &*self.choosing;
        let choice = guarded(|| choosing.chooser.choose(&request)).unwrap_or(Choice::OTHER);
        match choice {
            Choice::Limited {
                operation,
                executor,
                limit,
            } => {
                let slot = choosing.slot(limit);
                let config = Arc::clone(choosing.config(slot, operation, executor));
                let service = ResourcesOperation::from_config(self.inner.clone(), config);
                PerRequestFuture::limited(service.oneshot(request))
            }
            Choice::Unlimited => PerRequestFuture::unlimited(self.inner.clone().oneshot(request)),
        }
    }
}

impl<S: Clone, F, C, L, P, E> Clone for PerRequestOperation<S, F, C, L, P, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            choosing: Arc::clone(&self.choosing),
            _end: PhantomData,
        }
    }
}

impl<S: fmt::Debug, F, C, L, P, E> fmt::Debug for PerRequestOperation<S, F, C, L, P, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerRequestOperation")
            .field("inner", &self.inner)
            .field("limit", &std::any::type_name::<L>())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tonic")]
impl<S, F, C, L, P, E> tonic::server::NamedService for PerRequestOperation<S, F, C, L, P, E>
where
    S: tonic::server::NamedService,
{
    /// The wrapped gRPC service's name, so the layered service can go to tonic's `add_service`.
    const NAME: &'static str = S::NAME;
}

pin_project! {
    /// The response future of [`PerRequestOperation`]: a limited request's, or an unlimited
    /// one's.
    pub struct PerRequestFuture<A, U, E, K, P> {
        #[pin]
        kind: Kind<A, U>,
        _end: PhantomData<fn() -> (E, K, P)>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<A, U> {
        Limited { #[pin] future: A },
        Unlimited { #[pin] future: U },
    }
}

impl<A, U, E, K, P> PerRequestFuture<A, U, E, K, P> {
    fn limited(future: A) -> Self {
        Self {
            kind: Kind::Limited { future },
            _end: PhantomData,
        }
    }

    fn unlimited(future: U) -> Self {
        Self {
            kind: Kind::Unlimited { future },
            _end: PhantomData,
        }
    }
}

impl<A, U, E, K, P, Res, Err> Future for PerRequestFuture<A, U, E, K, P>
where
    A: Future<Output = Result<E::Response, Err>>,
    U: Future<Output = Result<Res, Err>>,
    E: End<Res, Err, K, P>,
{
    type Output = Result<E::Response, Err>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Limited { future } => future.poll(cx),
            KindProj::Unlimited { future } => future.poll(cx).map(E::unmetered),
        }
    }
}

impl<A, U, E, K, P> fmt::Debug for PerRequestFuture<A, U, E, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Limited { .. } => "limited",
            Kind::Unlimited { .. } => "unlimited",
        };
        f.debug_struct("PerRequestFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<C: Clone, L: Clone, P: Clone, E> ResourcesOperationLayer<C, L, P, E> {
    /// Lets each request choose its operation and executor, or to go unlimited, with
    /// `chooser`: for one layer over a whole axum `Router` or tonic `Server`. See
    /// [`per_request`](crate::per_request).
    pub fn per_request<F>(
        self,
        chooser: F,
    ) -> ResourcesOperationLayer<C, L, P, E, PerRequest<F, L>> {
        ResourcesOperationLayer {
            config: self.config,
            tags: PerRequest {
                chooser,
                limits: Arc::new([]),
            },
            _end: PhantomData,
        }
    }
}

impl<C, L: Acquire, P, E, F> ResourcesOperationLayer<C, L, P, E, PerRequest<F, L>> {
    /// Named limits that a request's [`Choice`] can take its permit from, by name
    /// ([`Choice::on`]), instead of the layer's own: one layer over a whole `Router` can cap
    /// `/verify` at 4 and `/judge` at 8.
    ///
    /// ```
    /// # #[cfg(feature = "axum")]
    /// # fn main() {
    /// use axum::{routing::post, Router};
    /// use tower_resources_operation::per_request::{ByMatchedPath, Choice};
    /// use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};
    ///
    /// let verifiers = Limit::builder(4).name("verifiers").build();
    /// let judges = Limit::builder(8).name("judges").build();
    /// let chooser = ByMatchedPath::new()
    ///     .route("/verify", Choice::limited(Operation::Verify, Executor::Subprocess).on("verifiers"))
    ///     .route("/judge", Choice::limited(Operation::Judge, Executor::Inline).on("judges"))
    ///     .otherwise(Choice::Unlimited);
    /// let app: Router = Router::new()
    ///     .route("/verify", post(|| async { "verified" }))
    ///     .route("/judge", post(|| async { "judged" }))
    ///     .layer(
    ///         ResourcesOperationLayer::new_for_http(16)
    ///             .per_request(chooser)
    ///             .limits([verifiers, judges]),
    ///     );
    /// # drop(app);
    /// # }
    /// # #[cfg(not(feature = "axum"))]
    /// # fn main() {}
    /// ```
    ///
    /// # Panics
    ///
    /// If a limit has no [name](crate::limit::LimitBuilder::name), or two share one.
    #[track_caller]
    pub fn limits(mut self, limits: impl IntoIterator<Item = L>) -> Self {
        let mut named: Vec<(&'static str, L)> = Vec::new();
        for limit in limits {
            let Some(name) = limit.capacity().and_then(|capacity| capacity.name()) else {
                panic!(
                    "tower-resources-operation: a per-request layer's limits are chosen by name: \
                     name each one (Limit::builder(n).name(\"..\").build())"
                );
            };
            if named.iter().any(|(known, _)| *known == name) {
                panic!("tower-resources-operation: two of a per-request layer's limits are named {name:?}");
            }
            named.push((name, limit));
        }
        self.tags.limits = named.into();
        self
    }
}

impl<S, C, L, P, E, F> Layer<S> for ResourcesOperationLayer<C, L, P, E, PerRequest<F, L>>
where
    C: Clone,
    L: Acquire + Clone,
    P: Clone,
    F: Clone + 'static,
{
    type Service = PerRequestOperation<S, F, C, L, P, E>;

    #[track_caller]
    fn layer(&self, inner: S) -> Self::Service {
        self.config.check();
        for (_, limit) in self.tags.limits.iter() {
            if !self.config.answers && limit.may_reject() {
                // The layer's own check, for each named limit.
                let mut config = (*self.config).clone();
                config.limit = limit.clone();
                config.check();
            }
        }
        let service = PerRequestOperation::new(inner, &self.tags, &self.config);
        if let MetricsSource::Given(_) = self.config.metrics {
            // Given metrics report the series that rules name from now on, as a layer of one
            // operation does; the global ones are decided at the first request.
            if let Some(choices) = rules_of(&self.tags.chooser) {
                service.choosing.announce_choices(|| choices);
            }
        }
        service
    }
}
