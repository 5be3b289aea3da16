//! A drop-in for tower's `ConcurrencyLimitLayer` that shows when the limit is too small.
//!
//! Services that do expensive work (a verifier subprocess, a judge call, a tool run) cap it with
//! a semaphore. When the cap is too small, work waits in a queue that no request metric shows:
//! the server looks slow without looking busy. [`ResourcesOperationLayer`] is that cap, and it
//! reports, as OpenTelemetry metrics, how long each operation waited for the limit, how long it
//! ran inside it, how it ended, and how many wait and run right now.
//!
//! It is the tower form of NeMo Gym's `nemo_gym.telemetry.resources_operations`, with the same
//! instrument names, attributes, bucket boundaries and outcome rules, and three instruments of
//! its own (the limit's capacity, the operations it turned away, the waits given up).
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use opentelemetry::metrics::MeterProvider as _;
//! use opentelemetry_sdk::metrics::SdkMeterProvider;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_resources_operation::{
//!     Executor, Operation, OperationMetrics, ResourcesOperationLayer,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Your provider, with your exporter's reader. The layer reports to it, and only to it.
//! let provider = SdkMeterProvider::builder().build();
//! let metrics = OperationMetrics::new(&provider.meter("my-server"));
//!
//! let verifier = ServiceBuilder::new()
//!     .layer(
//!         ResourcesOperationLayer::new(2)
//!             .operation(Operation::Verify)
//!             .executor(Executor::Subprocess)
//!             .metrics(metrics),
//!     )
//!     .service(service_fn(|answer: String| async move {
//!         Ok::<_, Infallible>(answer == "42")
//!     }));
//!
//! assert!(verifier.oneshot("42".to_owned()).await.unwrap());
//! # }
//! ```
//!
//! Without [`metrics`](ResourcesOperationLayer::metrics), a layer reports to the global meter
//! provider ([`OperationMetrics::global`]) installed when it first serves a request, so "build
//! the router, install the provider, serve" records.
//!
//! # Where the layer goes
//!
//! - **One layer per route or gRPC service** tags each with its [`Operation`] and
//!   [`Executor`]. Routes that share a cap get layers made
//!   [`with_limit`](ResourcesOperationLayer::with_limit) from clones of one [`Limit`]. The limit
//!   lives in the layer value, so it holds across connections (what tower's
//!   `GlobalConcurrencyLimitLayer` does; its `ConcurrencyLimitLayer` makes one per `layer()` call,
//!   and axum calls `layer()` per connection).
//! - **One layer over a whole axum `Router` or tonic `Server`** limits everything under it,
//!   `/metrics` and 404s included, under one tag. Give it
//!   [`per_request`](ResourcesOperationLayer::per_request) to choose each request's operation,
//!   or to leave it unlimited ([`ByMatchedPath`] with the `axum` feature, [`ByGrpcMethod`], or a
//!   closure). Such a layer takes its permit after `call`, in the response future.
//! - **Streams**: [`until_body_end`](ResourcesOperationLayer::until_body_end) holds each
//!   operation, its permit and its run time, until the `http::Response` body ends, and reads a
//!   gRPC status from the trailers.
//! - **Work that is not a tower service**: [`resources_operation`], NeMo Gym's context manager.
//! - **Any limit**: a [`Limit`], a tokio `Semaphore`, or an [`Acquire`] of your own (a pool, a
//!   weighted or a fleet-wide semaphore).
//!
//! # Metrics
//!
//! | instrument | kind | unit | attributes | recorded |
//! |---|---|---|---|---|
//! | [`QUEUE_DURATION_INSTRUMENT`] | histogram | `ms` | operation, executor | once per admitted operation, when it gets its permit (0 if it never waited) |
//! | [`DURATION_INSTRUMENT`] | histogram | `ms` | operation, executor, outcome | once per admitted operation, when it ends |
//! | [`QUEUED_INSTRUMENT`] | observable up-down counter | `{operation}` | operation, executor | waiting for a permit now |
//! | [`ACTIVE_INSTRUMENT`] | observable up-down counter | `{operation}` | operation, executor | holding a permit now |
//! | [`LIMIT_INSTRUMENT`] (this crate's) | observable gauge | `{operation}` | operation, executor | the capacity of the limits the series draws from |
//! | [`REJECTED_INSTRUMENT`] (this crate's) | counter | `{operation}` | operation, executor, rejection | once per operation turned away without a permit |
//! | [`ABANDONED_INSTRUMENT`] (this crate's) | counter | `{operation}` | operation, executor | once per operation whose caller went away while it waited |
//!
//! Both histograms use NeMo Gym's [`OPERATION_BOUNDARIES_MS`], from 1 ms to 30 minutes. Every
//! operation that asks for a permit is exactly one of admitted, rejected or abandoned.
//!
//! # Outcomes
//!
//! - The classifier ([`ClassifyOutcome`], by default [`DefaultClassifier`]) maps the inner
//!   result: `Ok` is `ok`, `Err` is `error`. [`TimeoutClassifier`] also makes tower's and
//!   tokio's `Elapsed` `timeout`; [`HttpClassifier`] and [`GrpcClassifier`] read the status.
//! - A response future dropped before it finished is `cancelled` (or `timeout`, once the
//!   request's deadline has passed: see [`Deadline`]), and so is a permit taken by
//!   `poll_ready` but never used by `call`.
//! - A panic in the inner `poll_ready` (once the permit is taken), in `call` or while polling
//!   its future (or its body) is `crashed`; the panic goes on.
//! - In the body-end form, the end of the stream, a body error and a body dropped early decide
//!   too (see [`ClassifyResponse`]).
//! - [`set_outcome`] inside the work wins over all of the above.
//!
//! Recording never fails a request: a classifier that panics costs the operation its outcome
//! (recorded as `error`), and a meter that panics when it records costs that measurement.
//!
//! # Where it differs from tower's `ConcurrencyLimitLayer`
//!
//! - One limit per layer value, shared by every service it makes (tower's
//!   `GlobalConcurrencyLimitLayer`), rather than one per `layer()` call.
//! - The permit goes back when the inner `poll_ready` fails or panics.
//! - A limit that cannot admit any more (a closed semaphore) panics at `poll_ready`, in every
//!   build, with a message naming the limit; waiters are woken to that panic, never left
//!   hanging. tower's limit panics there only in debug builds, and at `call` in release.
//! - A [bounded](ResourcesOperationLayer::bounded) layer answers an operation its limit turned
//!   away (`503`, RESOURCE_EXHAUSTED, or [`Rejected`] as the service's error) without calling
//!   the inner service, as tower's `LoadShed` does. Without it, nothing is ever turned away.
//!
//! # Cargo features
//!
//! - `tonic`: the layered services implement tonic's `NamedService`, so a layered gRPC
//!   service can go to `Server::add_service`.
//! - `axum`: [`ByMatchedPath`], which chooses each request's operation by axum's matched route.
//! - `serde`: [`Operation`], [`Executor`], [`Outcome`] and [`Rejection`] (de)serialize as their
//!   attribute strings.
//! - `experimental-bound-instruments`: records through OpenTelemetry's bound instruments
//!   (`Histogram::bind`), several times cheaper per record. Turn on `opentelemetry_sdk`'s
//!   `experimental_metrics_bound_instruments` feature too: without it the SDK silently drops
//!   every bound measurement.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(rustdoc::broken_intra_doc_links)]

mod attributes;
pub mod classify;
pub mod layer;
pub mod limit;
pub mod metrics;
mod operation;
pub mod per_request;
pub mod protocol;
mod scoped;

pub use attributes::{Executor, Operation, Outcome, ParseAttributeError, Rejection};
pub use layer::{ResourcesOperation, ResourcesOperationLayer};
pub use limit::{Acquire, Limit};
pub use metrics::OperationMetrics;
pub use operation::set_outcome;
pub use protocol::Rejected;
pub use scoped::{resources_operation, resources_operation_with};

/// Observable up-down counter: operations holding a permit now.
pub const ACTIVE_INSTRUMENT: &str = "gym.resources.operation.active";
/// Histogram, milliseconds: time an operation ran inside the limit, by outcome.
pub const DURATION_INSTRUMENT: &str = "gym.resources.operation.duration_ms";
/// Observable up-down counter: operations waiting for a permit now.
pub const QUEUED_INSTRUMENT: &str = "gym.resources.operation.queued";
/// Histogram, milliseconds: time an operation waited for the limit.
pub const QUEUE_DURATION_INSTRUMENT: &str = "gym.resources.operation.queue_duration_ms";

/// Attribute key of the [`Operation`].
pub const OPERATION_ATTRIBUTE: &str = "nemo.gym.resources.operation";
/// Attribute key of the [`Executor`].
pub const EXECUTOR_ATTRIBUTE: &str = "nemo.gym.resources.executor";
/// Attribute key of the [`Outcome`], on the duration histogram only.
pub const OUTCOME_ATTRIBUTE: &str = "nemo.gym.resources.operation.outcome";

/// Explicit bucket boundaries of both histograms, in milliseconds: 1 ms to 30 minutes.
pub const OPERATION_BOUNDARIES_MS: [f64; 13] = [
    1.0,
    5.0,
    10.0,
    50.0,
    100.0,
    500.0,
    1_000.0,
    5_000.0,
    10_000.0,
    30_000.0,
    60_000.0,
    300_000.0,
    1_800_000.0,
];

/// The values of [`OPERATION_ATTRIBUTE`], one per [`Operation`].
pub const OPERATIONS: &[&str] = &["verify", "tool", "judge", "other"];
/// The values of [`EXECUTOR_ATTRIBUTE`], one per [`Executor`].
pub const EXECUTORS: &[&str] = &["inline", "thread", "process", "subprocess", "other"];
/// The values of [`OUTCOME_ATTRIBUTE`], one per [`Outcome`].
pub const OUTCOMES: &[&str] = &["ok", "error", "timeout", "cancelled", "crashed"];

/// The README's examples, run as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
