//! The crate's rule table, [`ByRoute`]: a choice per route of an axum `Router`, or per method or
//! service of a gRPC server.

use std::collections::HashMap;
use std::sync::Arc;

use super::choice::{Choice, ChooseOperation, KnownChoices};

/// Chooses by route: the route axum matched (`axum::extract::MatchedPath`, such as
/// `/users/{id}`, with the `axum` feature), or the request's path, which is how gRPC names a
/// method (`/package.Service/Method`), or the gRPC service that path names.
///
/// A route's rule wins over its gRPC service's; a request that no rule names, or that matched
/// no route (a 404 from axum's fallback), is [`otherwise`](Self::otherwise) (by default
/// `other`/`other`, limited). Under axum, put the layer on the `Router` with `Router::layer`
/// (axum applies it to each route, after matching); around the whole router, from outside, no
/// route is matched yet.
///
/// ```
/// use tower_resources_operation::per_request::{ByRoute, Choice, ChooseOperation};
/// use tower_resources_operation::{Executor, Operation};
///
/// // A gRPC server: a service, and one of its methods apart.
/// let chooser = ByRoute::new()
///     .service("nemo.Verifier", Choice::limited(Operation::Verify, Executor::Subprocess))
///     .route("/nemo.Verifier/Judge", Choice::limited(Operation::Judge, Executor::Inline))
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
///
/// An axum `Router`, by the routes as written in `Router::route`:
///
/// ```
/// # #[cfg(feature = "axum")]
/// # fn main() {
/// use axum::{routing::get, Router};
/// use tower_resources_operation::per_request::{ByRoute, Choice};
/// use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
///
/// let chooser = ByRoute::new()
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
/// # }
/// # #[cfg(not(feature = "axum"))]
/// # fn main() {}
/// ```
#[derive(Clone, Debug, Default)]
pub struct ByRoute {
    table: Arc<Table>,
}

/// Rules by route and by gRPC service, and what a request no rule names is.
#[derive(Clone, Debug)]
struct Table {
    /// By route, with its leading `/`.
    routes: HashMap<Box<str>, Choice>,
    /// By gRPC service (`package.Service`): the first segment of a request's path.
    services: HashMap<Box<str>, Choice>,
    otherwise: Choice,
}

impl Default for Table {
    fn default() -> Self {
        Self {
            routes: HashMap::new(),
            services: HashMap::new(),
            otherwise: Choice::OTHER,
        }
    }
}

impl ByRoute {
    /// No rules: every request is `other`/`other`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests to `route` are `choice`: an axum route as written in `Router::route`
    /// (`/judge/{model}`), or a gRPC method (`/package.Service/Method`; the leading `/` may be
    /// left out).
    pub fn route(mut self, route: &str, choice: Choice) -> Self {
        let route = format!("/{}", route.trim_start_matches('/'));
        Arc::make_mut(&mut self.table)
            .routes
            .insert(route.into(), choice);
        self
    }

    /// Requests to every method of the gRPC `service` (`package.Service`) are `choice`, but for
    /// a method that has a [`route`](Self::route) of its own.
    pub fn service(mut self, service: &str, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table)
            .services
            .insert(service.trim_matches('/').into(), choice);
        self
    }

    /// Requests that no rule names, or that matched no route, are `choice`.
    pub fn otherwise(mut self, choice: Choice) -> Self {
        Arc::make_mut(&mut self.table).otherwise = choice;
        self
    }
}

impl KnownChoices for ByRoute {
    fn choices(&self) -> Vec<Choice> {
        let table = &*self.table;
        let mut choices: Vec<Choice> = Vec::new();
        let rules = table.routes.values().chain(table.services.values());
        for choice in rules.chain([&table.otherwise]) {
            if !choices.contains(choice) {
                choices.push(*choice);
            }
        }
        choices
    }
}

impl<B> ChooseOperation<http::Request<B>> for ByRoute {
    fn choose(&self, request: &http::Request<B>) -> Choice {
        let table = &*self.table;
        #[cfg(feature = "axum")]
        if let Some(choice) = request
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .and_then(|matched| table.routes.get(matched.as_str()))
        {
            return *choice;
        }
        let path = request.uri().path();
        if let Some(choice) = table.routes.get(path) {
            return *choice;
        }
        let path = path.trim_start_matches('/');
        let service = path.split_once('/').map_or(path, |(service, _)| service);
        table
            .services
            .get(service)
            .copied()
            .unwrap_or(table.otherwise)
    }
}
