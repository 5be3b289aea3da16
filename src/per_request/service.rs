//! [`PerRequestOperation`]: where each request chooses, and goes through a limited service or
//! straight to the inner one.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http_body::Body;
use tower::util::{Either, MapResponse, Oneshot};
use tower_service::Service;

use super::choice::{Choice, ChooseOperation, KnownChoices};
use crate::attributes::{Executor, Operation};
use crate::body::{AtBodyEnd, OperationBody};
use crate::classify::{ClassifyOutcome, DefaultClassifier};
use crate::config::Config;
use crate::diagnostics::{self, Mistake};
use crate::guard::guarded;
use crate::limit::{Acquire, Limit};
use crate::protocol::Protocol;
use crate::service::ResourcesOperation;

const SERIES: usize = Operation::ALL.len() * Executor::ALL.len();

/// A service whose requests each choose their operation, made by a [`PerRequestLayer`](super::PerRequestLayer).
///
/// Its `poll_ready` is always ready; `call` sends each limited request through a clone of the
/// inner service that takes its permit as [`ResourcesOperation`] does, and each unlimited one
/// straight to a clone of the inner service.
pub struct PerRequestOperation<S, F, C = DefaultClassifier, L = Limit, P = (), E = ()> {
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
    names: Vec<Arc<str>>,
    /// The configuration of each (limit, operation, executor), made when a request first
    /// chooses it: `SERIES` per entry of `bases`.
    by_series: Box<[Made<C, L, P>]>,
    /// Whether the chooser's series were announced to the metrics.
    announced: OnceLock<()>,
}

impl<S, F: Clone, C: Clone, L: Acquire + Clone, P: Clone, E> PerRequestOperation<S, F, C, L, P, E> {
    pub(super) fn new(
        inner: S,
        chooser: &F,
        limits: &[(Arc<str>, L)],
        base: &Arc<Config<C, L, P>>,
    ) -> Self {
        // The layer's own configuration, marked as choosing: a request that matched no route
        // is its chooser's to place.
        let mut own = (**base).clone();
        own.per_request = true;
        let mut bases = vec![Arc::new(own)];
        for (_, limit) in limits.iter() {
            let mut config = (*bases[0]).clone();
            config.hears = limit.hears_ends();
            config.limit = limit.clone();
            // The layer's capacity describes its own limit, not this one.
            config.capacity = None;
            bases.push(Arc::new(config));
        }
        Self {
            inner,
            choosing: Arc::new(Choosing {
                chooser: chooser.clone(),
                names: limits.iter().map(|(name, _)| Arc::clone(name)).collect(),
                by_series: (0..bases.len() * SERIES).map(|_| OnceLock::new()).collect(),
                bases,
                announced: OnceLock::new(),
            }),
            _end: PhantomData,
        }
    }
}

impl<S, F: KnownChoices, C: Clone, L: Acquire + Clone, P: Clone, E>
    PerRequestOperation<S, F, C, L, P, E>
{
    /// Reports the series of every choice its chooser knows, from now on.
    pub(super) fn announce(&self) {
        self.choosing.announce();
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
    pub(super) fn slot(&self, limit: Option<&'static str>) -> usize {
        let Some(name) = limit else { return 0 };
        match self.names.iter().position(|known| &**known == name) {
            Some(index) => index + 1,
            None => {
                diagnostics::report(Mistake::UnknownLimit, || format!(": {name:?}"));
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
    pub(super) fn announce(&self)
    where
        F: KnownChoices,
    {
        self.announce_choices(|| guarded(|| self.chooser.choices()).unwrap_or_default());
    }

    /// [`announce`](Self::announce), with the choices that `choices` lists.
    pub(super) fn announce_choices(&self, choices: impl FnOnce() -> Vec<Choice>) {
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

/// An unlimited request's answer in the body-end form: a body no operation measures.
type Unmetered<B, L> = fn(http::Response<B>) -> http::Response<OperationBody<B, L>>;

impl<S, F, C, L, P, Request> Service<Request> for PerRequestOperation<S, F, C, L, P>
where
    S: Service<Request> + Clone,
    F: ChooseOperation<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Oneshot<Either<ResourcesOperation<S, C, L, P>, S>, Request>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.announce_now();
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let service = match self.limited(&request) {
            Some(config) => {
                Either::Left(ResourcesOperation::from_config(self.inner.clone(), config))
            }
            None => Either::Right(self.inner.clone()),
        };
        Oneshot::new(service, request)
    }
}

impl<S, F, C, L, P, B, Request> Service<Request> for PerRequestOperation<S, F, C, L, P, AtBodyEnd>
where
    S: Service<Request, Response = http::Response<B>> + Clone,
    B: Body,
    F: ChooseOperation<Request>,
    C: ClassifyOutcome<S::Response, S::Error> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<Request, S::Response, S::Error> + Clone,
{
    type Response = http::Response<OperationBody<B, L>>;
    type Error = S::Error;
    type Future = Oneshot<
        Either<ResourcesOperation<S, C, L, P, AtBodyEnd>, MapResponse<S, Unmetered<B, L>>>,
        Request,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.announce_now();
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let service = match self.limited(&request) {
            Some(config) => {
                Either::Left(ResourcesOperation::from_config(self.inner.clone(), config))
            }
            None => {
                let unmetered: Unmetered<B, L> =
                    |response| response.map(OperationBody::unmetered_body);
                Either::Right(MapResponse::new(self.inner.clone(), unmetered))
            }
        };
        Oneshot::new(service, request)
    }
}

impl<S, F, C, L, P, E> PerRequestOperation<S, F, C, L, P, E>
where
    C: Clone,
    L: Acquire + Clone,
    P: Clone,
{
    /// The first request: the series of every known choice report from now on.
    fn announce_now(&self)
    where
        F: KnownChoices,
    {
        if self.choosing.announced.get().is_none() {
            self.choosing.announce();
        }
    }

    /// The configuration of `request`'s operation, or `None` if it is not limited.
    fn limited<Request>(&self, request: &Request) -> Option<Arc<Config<C, L, P>>>
    where
        F: ChooseOperation<Request>,
    {
        let choosing = &*self.choosing;
        let choice = guarded(|| choosing.chooser.choose(request)).unwrap_or(Choice::OTHER);
        match choice {
            Choice::Limited {
                operation,
                executor,
                limit,
            } => {
                let slot = choosing.slot(limit);
                Some(Arc::clone(choosing.config(slot, operation, executor)))
            }
            Choice::Unlimited => None,
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

impl<S: fmt::Debug, F, C, L: Acquire, P, E> fmt::Debug for PerRequestOperation<S, F, C, L, P, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerRequestOperation")
            .field("inner", &self.inner)
            .field("limit", &self.choosing.bases[0].described_limit())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl<S, F, C, L, P, E> tonic::server::NamedService for PerRequestOperation<S, F, C, L, P, E>
where
    S: tonic::server::NamedService,
{
    /// The wrapped gRPC service's name, so the layered service can go to tonic's `add_service`.
    const NAME: &'static str = S::NAME;
}
