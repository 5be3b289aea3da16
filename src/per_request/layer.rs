//! [`PerRequestLayer`]: one layer over many routes, and the builder method that makes it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use tower_layer::Layer;

use super::choice::KnownChoices;
use super::service::PerRequestOperation;
use crate::classify::DefaultClassifier;
use crate::config::Config;
use crate::layer::ResourcesOperationLayer;
use crate::limit::{Acquire, Limit};
use crate::metrics::MetricsSource;

/// A layer whose requests each choose their operation and executor with `F`, or to go
/// unlimited; made by [`ResourcesOperationLayer::per_request`]. Its other parameters are the
/// layer's it was made from.
pub struct PerRequestLayer<F, C = DefaultClassifier, L = Limit, P = (), E = ()> {
    config: Arc<Config<C, L, P>>,
    chooser: F,
    /// The limits a choice can name, each with its name.
    limits: Arc<[(Arc<str>, L)]>,
    _end: PhantomData<fn() -> E>,
}

impl<C, L, P, E> ResourcesOperationLayer<C, L, P, E> {
    /// Lets each request choose its operation and executor, or to go unlimited, with
    /// `chooser`: for one layer over a whole axum `Router` or tonic `Server`. See
    /// [`per_request`](crate::per_request).
    pub fn per_request<F>(self, chooser: F) -> PerRequestLayer<F, C, L, P, E> {
        PerRequestLayer {
            config: self.config,
            chooser,
            limits: Arc::new([]),
            _end: PhantomData,
        }
    }
}

impl<F, C, L: Acquire, P, E> PerRequestLayer<F, C, L, P, E> {
    /// Named limits that a request's [`Choice`](super::Choice) can take its permit from, by
    /// name ([`Choice::on`](super::Choice::on)), instead of the layer's own: one layer over a
    /// whole `Router` can cap `/verify` at 4 and `/judge` at 8.
    ///
    /// ```
    /// # #[cfg(feature = "axum")]
    /// # fn main() {
    /// use axum::{routing::post, Router};
    /// use tower_resources_operation::per_request::{ByRoute, Choice};
    /// use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};
    ///
    /// let verifiers = Limit::builder(4).name("verifiers").build();
    /// let judges = Limit::builder(8).name("judges").build();
    /// let chooser = ByRoute::new()
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
    /// If a limit has no [name](crate::LimitBuilder::name), or two share one.
    #[track_caller]
    pub fn limits(mut self, limits: impl IntoIterator<Item = L>) -> Self {
        let mut named: Vec<(Arc<str>, L)> = Vec::new();
        for limit in limits {
            let name = limit.capacity().and_then(|c| c.shared_name().cloned());
            let Some(name) = name else {
                panic!(
                    "tower-resources-operation: a per-request layer's limits are chosen by name: \
                     name each one (Limit::builder(n).name(\"..\").build())"
                );
            };
            if named.iter().any(|(known, _)| *known == name) {
                panic!(
                    "tower-resources-operation: two of a per-request layer's limits are named \
                     {name:?}"
                );
            }
            named.push((name, limit));
        }
        self.limits = named.into();
        self
    }

    /// The layer's own limit.
    pub fn limit(&self) -> &L {
        &self.config.limit
    }
}

impl<S, F, C, L, P, E> Layer<S> for PerRequestLayer<F, C, L, P, E>
where
    F: KnownChoices + Clone,
    C: Clone,
    L: Acquire + Clone,
    P: Clone,
{
    type Service = PerRequestOperation<S, F, C, L, P, E>;

    #[track_caller]
    fn layer(&self, inner: S) -> Self::Service {
        self.config.check();
        for (_, limit) in self.limits.iter() {
            if !self.config.answers && limit.may_reject() {
                // The layer's own check, for each named limit.
                let mut config = (*self.config).clone();
                config.hears = limit.hears_ends();
                config.limit = limit.clone();
                config.check();
            }
        }
        let service = PerRequestOperation::new(inner, &self.chooser, &self.limits, &self.config);
        if let MetricsSource::Given(_) = self.config.metrics {
            // Given metrics report the series that the rules name from now on, as a layer of
            // one operation does; the global ones are decided at the first request.
            service.announce();
        }
        service
    }
}

impl<F: Clone, C, L, P, E> Clone for PerRequestLayer<F, C, L, P, E> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
            chooser: self.chooser.clone(),
            limits: Arc::clone(&self.limits),
            _end: PhantomData,
        }
    }
}

impl<F: fmt::Debug, C, L: Acquire, P, E> fmt::Debug for PerRequestLayer<F, C, L, P, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.limits.iter().map(|(name, _)| &**name).collect();
        f.debug_struct("PerRequestLayer")
            .field("chooser", &self.chooser)
            .field("limit", &self.config.described_limit())
            .field("limits", &names)
            .field("metrics", &self.config.metrics)
            .finish_non_exhaustive()
    }
}
