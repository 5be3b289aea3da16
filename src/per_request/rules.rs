//! The crate's rule tables: [`ByGrpcMethod`] and, with the `axum` feature, [`ByMatchedPath`].

use std::collections::HashMap;
use std::sync::Arc;

use super::choice::{Choice, ChooseOperation, KnownChoices};

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
pub(super) struct Table {
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

impl KnownChoices for ByGrpcMethod {
    fn choices(&self) -> Vec<Choice> {
        self.table.choices()
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
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Clone, Debug, Default)]
pub struct ByMatchedPath {
    table: Arc<Table>,
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
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
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl KnownChoices for ByMatchedPath {
    fn choices(&self) -> Vec<Choice> {
        self.table.choices()
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
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
}
