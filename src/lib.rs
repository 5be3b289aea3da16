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
//! These docs are the reference; the README is the guide.
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
//! provider ([`OperationMetrics::global`]) installed when one of its services first serves a
//! request, so "build the router, install the provider, serve" records.
//!
//! ## With axum
//!
//! The README's Getting started: two routes share a [named](limit::LimitBuilder::name) limit of
//! 2 with at most 8 waiting, a Router-wide tower-http `TimeoutLayer` the layers are told of
//! ([`server_timeout`](ResourcesOperationLayer::server_timeout)), and Prometheus on `/metrics`.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{http::StatusCode, routing::get, Router};
//! use opentelemetry::metrics::MeterProvider as _;
//! use opentelemetry_sdk::metrics::SdkMeterProvider;
//! use tower_http::timeout::TimeoutLayer;
//! use tower_resources_operation::metrics::METER_NAME;
//! use tower_resources_operation::{
//!     Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
//! };
//!
//! async fn verify() -> &'static str {
//!     "verified" // run the verifier here
//! }
//!
//! async fn judge() -> &'static str {
//!     "judged"
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // `without_units()`: the names already end in `_ms`.
//!     let registry = prometheus::Registry::new();
//!     let exporter = opentelemetry_prometheus::exporter()
//!         .with_registry(registry.clone())
//!         .without_units()
//!         .build()?;
//!     let provider = SdkMeterProvider::builder().with_reader(exporter).build();
//!     let metrics = OperationMetrics::new(&provider.meter(METER_NAME));
//!
//!     let workers = Limit::builder(2).max_queued(8).name("workers").build();
//!     let server_timeout = Duration::from_secs(30);
//!     let limit = |operation, executor| {
//!         ResourcesOperationLayer::new_for_http(workers.clone())
//!             .operation(operation)
//!             .executor(executor)
//!             .server_timeout(server_timeout)
//!             .metrics(metrics.clone())
//!     };
//!     let app = Router::new()
//!         .route("/verify", get(verify).layer(limit(Operation::Verify, Executor::Subprocess)))
//!         .route("/judge", get(judge).layer(limit(Operation::Judge, Executor::Inline)))
//!         .route(
//!             "/metrics",
//!             get(move || {
//!                 let registry = registry.clone();
//!                 async move {
//!                     prometheus::TextEncoder::new()
//!                         .encode_to_string(&registry.gather())
//!                         .unwrap_or_default()
//!                 }
//!             }),
//!         )
//!         .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, server_timeout));
//!
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app).await?;
//!     Ok(())
//! }
//! ```
//!
//! ## With tonic
//!
//! One limit for one gRPC service, which keeps its `NamedService` (the `tonic` feature), so
//! `add_service` takes it.
//!
//! ```no_run
//! use opentelemetry::metrics::MeterProvider as _;
//! use opentelemetry_sdk::metrics::SdkMeterProvider;
//! use tonic::transport::Server;
//! use tower::ServiceBuilder;
//! use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};
//!
//! # #[cfg(feature = "tonic")]
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let provider = SdkMeterProvider::builder().build(); // with your exporter's reader
//!     let metrics = OperationMetrics::new(&provider.meter("my-grpc-server"));
//!
//!     // Wrap your generated server (here tonic-health's).
//!     let (_reporter, health) = tonic_health::server::health_reporter();
//!     let verifier = ServiceBuilder::new()
//!         .layer(
//!             ResourcesOperationLayer::new_for_grpc(2)
//!                 .operation(Operation::Verify)
//!                 .executor(Executor::Subprocess)
//!                 .metrics(metrics),
//!         )
//!         .service(health);
//!
//!     Server::builder()
//!         .add_service(verifier)
//!         .serve("127.0.0.1:50051".parse()?)
//!         .await?;
//!     Ok(())
//! }
//! # #[cfg(not(feature = "tonic"))]
//! # fn main() {}
//! ```
//!
//! # The pieces
//!
//! | you want | use |
//! |---|---|
//! | a limit on a tower service, axum route or tonic service | [`ResourcesOperationLayer`]: [`new`](ResourcesOperationLayer::new), [`new_for_http`](ResourcesOperationLayer::new_for_http), [`new_for_grpc`](ResourcesOperationLayer::new_for_grpc) |
//! | a cap that several routes share, resized while it serves, with a bounded queue | [`Limit`] |
//! | a cap that finds its own capacity from the run times and outcomes it sees | [`adaptive`] |
//! | one limit for a whole fleet of replicas, kept in Redis | the companion crate `tower-resources-operation-redis` (see [A limit for the whole fleet](#a-limit-for-the-whole-fleet)) |
//! | a limit of your own: a pool, a weighted semaphore, a fleet limit on another store | [`Acquire`], reporting through [`limit::Capacity::of_limit`] and hearing each end through [`Acquire::ended`] |
//! | how results become outcomes | [`classify`] |
//! | how a rejection is answered, and where a caller's deadline is read | [`protocol`] |
//! | one layer over a whole `Router` or tonic `Server` | [`per_request`], [`PerRequestLayer`](per_request::PerRequestLayer) |
//! | operations that last until the response body ends | [`until_body_end`](ResourcesOperationLayer::until_body_end), [`layer::OperationBody`] |
//! | work that is not a tower service | [`resources_operation`] |
//! | the outcome the classifier cannot see | [`set_outcome`] |
//! | the instruments, your own meter | [`OperationMetrics`], [`metrics`] |
//! | each operation's wait and run in its request's trace | the `tracing` feature, the [`trace`] module |
//!
//! # Metrics
//!
//! | instrument | kind | unit | attributes | recorded |
//! |---|---|---|---|---|
//! | [`QUEUE_DURATION_INSTRUMENT`] | histogram (f64) | `ms` | operation, executor | once per admitted operation, when it gets its permit: the time since it first had to wait, or 0 if the permit was free at once |
//! | [`DURATION_INSTRUMENT`] | histogram (f64) | `ms` | operation, executor, outcome | once per admitted operation, when it ends: from the permit to the end of the work (of its body, in the body-end form) |
//! | [`QUEUED_INSTRUMENT`] | observable up-down counter (i64) | `{operation}` | operation, executor | at each collection: operations waiting for a permit now |
//! | [`ACTIVE_INSTRUMENT`] | observable up-down counter (i64) | `{operation}` | operation, executor | at each collection: operations holding a permit now |
//! | [`LIMIT_INSTRUMENT`](metrics::LIMIT_INSTRUMENT) (this crate's) | observable gauge (i64) | `{operation}` | operation, executor | at each collection: the sum of the capacities of the distinct limits the series draws from |
//! | [`REJECTED_INSTRUMENT`](metrics::REJECTED_INSTRUMENT) (this crate's) | observable counter (u64) | `{operation}` | operation, executor, rejection | once per operation turned away without a permit: `queue_full`, `queue_timeout`, or `unavailable` (the limit is closed, or its store out of reach) |
//! | [`ABANDONED_INSTRUMENT`](metrics::ABANDONED_INSTRUMENT) (this crate's) | observable counter (u64) | `{operation}` | operation, executor | once per operation whose caller went away while it waited |
//! | [`LIMIT_CAPACITY_INSTRUMENT`](metrics::LIMIT_CAPACITY_INSTRUMENT) (this crate's) | observable gauge (i64) | `{operation}` | limit | at each collection: how many operations a named limit admits at once |
//! | [`LIMIT_ACTIVE_INSTRUMENT`](metrics::LIMIT_ACTIVE_INSTRUMENT) (this crate's) | observable up-down counter (i64) | `{operation}` | limit | at each collection: operations holding a place of a named limit now, whatever their series |
//! | [`LIMIT_QUEUED_INSTRUMENT`](metrics::LIMIT_QUEUED_INSTRUMENT) (this crate's) | observable up-down counter (i64) | `{operation}` | limit | at each collection: operations waiting for a named limit now |
//! | [`LIMIT_BASELINE_INSTRUMENT`](metrics::LIMIT_BASELINE_INSTRUMENT) (this crate's) | observable gauge (f64) | `ms` | limit | at each collection: the run time a named [adaptive] limit's algorithm takes as normal, once it has one |
//! | [`LIMIT_ESTIMATE_INSTRUMENT`](metrics::LIMIT_ESTIMATE_INSTRUMENT) (this crate's) | observable gauge (f64) | `ms` | limit | at each collection: the recent run time a named adaptive limit's algorithm compares with its baseline |
//!
//! - Attribute keys: [`OPERATION_ATTRIBUTE`] ([`OPERATIONS`]), [`EXECUTOR_ATTRIBUTE`]
//!   ([`EXECUTORS`]), [`OUTCOME_ATTRIBUTE`] ([`OUTCOMES`]), and this crate's
//!   [`REJECTION_ATTRIBUTE`](metrics::REJECTION_ATTRIBUTE) ([`REJECTIONS`](metrics::REJECTIONS)).
//!   They are enums, so the series are bounded whatever comes in; names from config go through
//!   [`Operation::from_str_lossy`] / [`Executor::from_str_lossy`] or `FromStr`, whose error lists
//!   the valid values.
//! - Both histograms use NeMo Gym's [`OPERATION_BOUNDARIES_MS`], from 1 ms to 30 minutes.
//! - Every operation that asks for a permit is exactly one of admitted (one queue sample, one
//!   duration sample with its outcome), rejected (by reason) or abandoned.
//! - `limit`: a limit shared by two series reports its full capacity under each; a series served
//!   by limits of 2 and 3 reports 5; one limit reached through two layers counts once. `active`
//!   is at most `limit`, except while a lowered capacity drains. `active` and `queued` count
//!   each operation as it sees its own place: as one ends and its place passes to a waiter, a
//!   read in between (until the waiter's task is polled) sees one fewer active and the waiter
//!   still queued; a named limit's `gym.resources.limit.active` counts places, and has no such
//!   gap. A [`Limit`] knows its capacity;
//!   an `Arc<Semaphore>` does not, unless the layer is given one
//!   ([`capacity`](ResourcesOperationLayer::capacity)).
//! - **A limit shared by several series** (`/verify` and `/judge` on one [`Limit`]) shows, on
//!   each series, its whole capacity as `limit` and only that series' share as `active`: neither
//!   looks full while together they are. [Name the limit](limit::LimitBuilder::name) and it
//!   reports `gym.resources.limit.{capacity,active,queued}` with
//!   [`LIMIT_ATTRIBUTE`](metrics::LIMIT_ATTRIBUTE) (`nemo.gym.resources.limit`) = its name,
//!   whichever series use it: read saturation there. A name is written in code, so the attribute
//!   stays bounded; limits that share a name add up (their run times: the largest). NeMo Gym's
//!   series stay as they are.
//! - **Whose capacity it is.** The named limit's instruments, and `limit`, carry
//!   [`LIMIT_SCOPE_ATTRIBUTE`](metrics::LIMIT_SCOPE_ATTRIBUTE)
//!   (`nemo.gym.resources.limit.scope`, a [`limit::Scope`]): `process` for a limit of the
//!   process, whose capacity adds up over the processes that report it; `fleet` for one limit
//!   shared by a whole fleet (the companion crate's `RedisLimit`), whose capacity every
//!   replica reports alike, to read once; `share` for a fleet limit running on its replica's
//!   share while its store is away, to add up. The shipped dashboard and alerts read each by
//!   its scope.
//! - **An [adaptive] limit** sets its own capacity: `limit` and
//!   `gym.resources.limit.capacity` follow it, and, named, it reports what its controller
//!   measured (`gym.resources.limit.adaptive.{baseline,estimate}_ms`), next to the queue time and
//!   run time its decisions come from.
//! - Live counts add up over every limit that reports through one [`OperationMetrics`] (clones
//!   share them). A series given explicit metrics reports 0 from the moment a layer makes a
//!   service for it; with the global metrics, from the first request a service of the layer
//!   serves. A [per-request](per_request) layer whose chooser knows its rules
//!   ([`ByMatchedPath`](per_request::ByMatchedPath), [`ByGrpcMethod`](per_request::ByGrpcMethod),
//!   or your own [`choices`](per_request::KnownChoices::choices)) reports every series they
//!   name the same way, before any request chooses it.
//! - Mistakes that would record nothing, or the wrong thing, are reported once each as a
//!   `tracing` warning: no meter provider installed (then [`OperationMetrics::global`] is
//!   disabled: `global().is_enabled()` is the check to call), a second [`OperationMetrics`]
//!   alive (two from one meter hide each other's live counts), a per-request choice naming a
//!   limit its layer was not given.
//! - [`OperationMetrics::disabled`] reports nothing: the layer then only enters the limit. An
//!   adaptive limit's controller hears each operation's end from the limit itself, so it learns
//!   with metrics off too.
//!
//! The histograms' buckets are NeMo Gym's ([`OPERATION_BOUNDARIES_MS`]), given to
//! OpenTelemetry as advice. A quantile is interpolated between two boundaries, and they are far
//! apart: a 205 ms verifier falls in (100, 500] and reads as a p50 of 300 ms, and waits of 1.1 s
//! fall in (1000, 5000] and read as a p95 of 4.7 s. The means (`_sum` / `_count`) are exact.
//! Where the buckets are too coarse for your work, replace them, for the queue time and the run
//! time, with an OpenTelemetry View on your meter provider; the crate does not change. (A
//! base-2 exponential histogram does not reach Prometheus through `opentelemetry-prometheus`
//! 0.33, which drops it: use explicit buckets there.)
//!
//! ```
//! use opentelemetry_sdk::metrics::{Aggregation, Instrument, SdkMeterProvider, Stream};
//! use tower_resources_operation::{DURATION_INSTRUMENT, QUEUE_DURATION_INSTRUMENT};
//!
//! let finer_run_times = |instrument: &Instrument| {
//!     let name = instrument.name();
//!     (name == DURATION_INSTRUMENT || name == QUEUE_DURATION_INSTRUMENT).then(|| {
//!         let boundaries = vec![50.0, 100.0, 200.0, 300.0, 500.0, 1000.0, 1500.0, 2000.0, 5000.0];
//!         Stream::builder()
//!             .with_aggregation(Aggregation::ExplicitBucketHistogram { boundaries, record_min_max: true })
//!             .build()
//!             .expect("valid boundaries")
//!     })
//! };
//! let provider = SdkMeterProvider::builder()
//!     // .with_reader(..) or .with_periodic_exporter(..), as usual
//!     .with_view(finer_run_times)
//!     .build();
//! # drop(provider);
//! ```
//!
//! # Outcomes
//!
//! Where an operation's outcome is decided, for every way it can end:
//!
//! 1. [`set_outcome`] inside the work wins over everything below (NeMo Gym's
//!    `op.outcome = ...`).
//! 2. The inner service answered: the classifier decides ([`classify::DefaultClassifier`]: the
//!    response says ([`classify::OperationOutput`]: an `http::Response` by its status or its
//!    `grpc-status`, a process's `Output` by its exit status, a plain value `ok`), `Err` is
//!    `error`; [`classify::TimeoutClassifier`] also makes tower's and tokio's `Elapsed`
//!    `timeout`; [`classify::HttpClassifier`] and [`classify::GrpcClassifier`] read the status,
//!    with rules you can change; [`classify::ResultClassifier`] counts every answer `ok`). A
//!    classifier that panics costs the operation its outcome (`error`), never the response.
//! 3. The inner `poll_ready` failed: `error`, and the permit goes back.
//! 4. A panic in the inner `poll_ready`, in `call`, or while polling its future or body:
//!    `crashed`, the permit goes back, and the panic goes on.
//! 5. Dropped before the end (the caller went away), or a permit taken by `poll_ready` that
//!    `call` never used: `cancelled`, or `timeout` once the caller's deadline has passed (see
//!    [`protocol`]).
//! 6. In the body-end form, the end of the stream ends the operation with the head's outcome,
//!    or the trailers' when the classifier lets them decide
//!    ([`ClassifyOutcome::classify_at_end`](classify::ClassifyOutcome::classify_at_end): a gRPC
//!    stream's status); a body error is `error`.
//!
//! An operation turned away (`rejected`) or given up while queued (`abandoned`) was never
//! admitted: it has no queue or duration sample. Recording never fails a request: a meter, a
//! classifier, a chooser or a deadline reader that panics costs a measurement, never an answer.
//!
//! # Where the other layers go
//!
//! What an operation records depends on whether the layer that ends it sits inside this one
//! (between it and the handler) or outside. In axum the last `.layer(..)` is the outermost;
//! in a `ServiceBuilder`, the first. Each row is pinned by a test in `tests/placement.rs`.
//!
//! | Layer | Inside this one | Outside this one |
//! |---|---|---|
//! | tower-http's `CatchPanicLayer` | the panic becomes a 500: `error` | this layer sees the panic: `crashed` (the client still gets the 500) |
//! | tower-http's `TimeoutLayer` (408) | the 408 is `timeout` | the operation is dropped: `cancelled`, unless the layer is told [`.server_timeout(t)`](ResourcesOperationLayer::server_timeout), then `timeout` |
//! | the same, Router-wide in front of a [per-request](per_request) layer | | `cancelled`, or `timeout` with `.server_timeout(t)` on the per-request layer |
//! | tower's `GlobalConcurrencyLimitLayer` | its wait counts as run time, and `active` counts operations that wait for it | its wait is invisible: queue time 0, the queue in front of it unseen |
//! | tower's `ConcurrencyLimitLayer`, under axum | as above, but per connection: axum makes a service (and tower a semaphore) per connection | |
//!
//! So: put `CatchPanicLayer` outside (a panic is then `crashed`, as NeMo Gym counts it; on an
//! axum route, name the error type of each `.layer::<_, Infallible>(..)`, which axum cannot
//! infer between two layers), the server's timeout inside, or outside with `.server_timeout(t)`
//! given the same figure, and replace tower's limit with this layer rather than stacking the
//! two. A caller's own deadline, sent in a header, is read with
//! [`Http::deadline_header`](protocol::Http::deadline_header) (gRPC's `grpc-timeout` is read by
//! default).
//!
//! ## One limit twice on a request's path
//!
//! A request that reaches a limit whose place it already holds (the same [`Limit`] on a route
//! and on the Router, in two layers of one stack, a per-request choice and a route's layer, or
//! a handler that calls [`resources_operation`] on its own layer's limit) is admitted on the
//! place it holds, and the crate says so once, naming the limit. Waiting for a second place
//! would halve the limit, and deadlock once every place is held by a request that waits for
//! another: what tower's limits do. The inner layer records nothing of its own: the operation
//! is the outer layer's, with its tags, its queue time, its run time (the inner work included)
//! and its outcome ([`set_outcome`] inside sets it), and it holds one place in `active`. The
//! limit is known by [`Acquire::id`] ([`Limit`], `Arc<Semaphore>`; a limit of your own says
//! which it is with [`limit::LimitId`]), and the place held is seen on the thread that polls
//! the request, as `set_outcome` is: work spawned on a task of its own is another request. A
//! request that passes another limit between the two layers of one is checked against the
//! innermost only.
//!
//! ## A verifier subprocess
//!
//! Spawn it with `kill_on_drop(true)`. `active` counts places: when a caller goes away, its
//! operation ends and its place goes back at once. tokio does not kill a child when its
//! handle is dropped, so a verifier spawned without it runs on after its request is gone: work
//! the limit no longer sees, while the limit admits another in its place.
//!
//! ```
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let verifier = ResourcesOperationLayer::new(2)
//!     .operation(Operation::Verify)
//!     .executor(Executor::Subprocess)
//!     .metrics(OperationMetrics::disabled())
//!     .layer(service_fn(|answer: String| async move {
//!         tokio::process::Command::new("test")
//!             .args([answer.as_str(), "=", "42"])
//!             .kill_on_drop(true) // the verifier ends with its operation
//!             .output()
//!             .await
//!     }));
//! // A process's `Output` says how its operation ended: `ok` by its exit status.
//! assert!(verifier.oneshot("42".to_owned()).await.unwrap().status.success());
//! # }
//! ```
//!
//! # In the request's trace
//!
//! The metrics say that a limit binds; a trace says which request waited, how long, and behind
//! how many. With the `tracing` feature (on by default), each operation makes a `DEBUG` wait span
//! while it waits for its limit and a run span while it runs, children of the span current when
//! the request reached the layer (tower-http's `TraceLayer` request span), with NeMo Gym's
//! attribute keys, the queue and run times the histograms record, and how it ended. Filtered
//! out, or with no subscriber, they cost a flag and a level read. The [`trace`] module has the
//! names, the fields, why two spans and why `DEBUG`, and what exemplars need.
//!
//! # A limit for the whole fleet
//!
//! A [`Limit`] of N on each of 8 replicas is a fleet limit of 8N, wrong as soon as one dies or
//! one is added. The companion crate `tower-resources-operation-redis` is one limit of N for
//! every process that names it, kept in the Redis they all reach: leases refreshed while held,
//! a queue served first come, first served across the fleet, a capacity changed at runtime for
//! the whole fleet. It is an [`Acquire`], so it goes wherever a [`Limit`] goes, and it reports
//! through the same seams any limit of your own can use: [`limit::Capacity::of_limit`] for its
//! name, capacity and live counts, [`Acquire::ended`] for what its controller hears. Each
//! replica reports its own queue time, run time, `queued` and `active`; the `limit` gauge is
//! the fleet's capacity, so the fleet's saturation is `active` summed over instances against
//! `limit` (the fleet row of `dashboards/grafana/resources-operations.json`).
//!
//! # Where it differs from tower's `ConcurrencyLimitLayer`
//!
//! - **One limit per layer value**, shared by every service the layer makes: tower's
//!   `GlobalConcurrencyLimitLayer`'s behaviour. tower's `ConcurrencyLimitLayer` makes a new
//!   semaphore on every `layer()` call, and axum calls `layer()` per route and per connection.
//! - **The permit goes back when the inner `poll_ready` fails or panics**; tower keeps it in the
//!   service until the service is dropped.
//! - **A limit that cannot admit any more** (a closed semaphore, a store out of reach) is
//!   answered, not a panic: the operation is turned away as `unavailable` (HTTP `503`, gRPC
//!   `UNAVAILABLE`, [`RejectAsError`](protocol::RejectAsError)'s error, `Err(Rejected)` from
//!   [`resources_operation`], with the limit's own error as the [`Rejected`]'s `source()`), and
//!   waiters are woken to that answer. Only a generic layer whose
//!   protocol cannot answer ([`Plain`](protocol::Plain), the default of
//!   [`new`](ResourcesOperationLayer::new)) still panics at `poll_ready`, in every build, with a
//!   message naming the limit and the cause. tower panics there only in debug builds, and at
//!   `call` with an unrelated message in release.
//! - **A limit that turns operations away** (a queue bound, a queue timeout, a fleet limit that
//!   fails closed) makes `poll_ready`
//!   ready, and `call` answers the rejection as the layer's [`protocol`] says, without calling
//!   the inner service, as tower's `LoadShed` does. A generic layer answers only once given a
//!   protocol that can ([`protocol::RejectAsError`] for a `BoxError` service); until then it
//!   refuses, when it makes its service, a limit that may reject.
//! - Otherwise the same: the permit is taken in `poll_ready`, waiters are served first come
//!   first served, a clone starts without a permit, the permit goes back when the response
//!   future completes, errors or is dropped, or when a service holding an unused permit is
//!   dropped; `call` without `poll_ready` panics, saying so. (tower's `new(0)` is never
//!   ready; here a limit of 0 is refused when it is built, naming the value: one rule for
//!   every bad value, a panic at build as tower does, or an error from `try_new` / `try_build`.) `Response`
//!   and `Error` are the inner service's, `tower::load::Load` is forwarded, and
//!   [`ResourcesOperation::new`] makes the service without the layer.
//!
//! # Compile errors, and what to do about them
//!
//! The first two come from rustc proving `Send` for a spawned async block
//! (rust-lang/rust#110338), with `BoxError` as the service's error, in
//! `tokio::spawn(async move { svc.oneshot(req).await })`.
//!
//! With [`TimeoutClassifier`](classify::TimeoutClassifier), which looks into the error through
//! `Any` and so needs it to be `'static`: "higher-ranked lifetime error", "could not prove
//! `{async block}: Send`".
//!
//! ```compile_fail
//! # use tower::{service_fn, BoxError, Layer, ServiceExt};
//! # use tower_resources_operation::{classify::TimeoutClassifier, ResourcesOperationLayer};
//! let verifier = ResourcesOperationLayer::new(2)
//!     .classifier(TimeoutClassifier::new())
//!     .layer(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
//! tokio::spawn(async move { verifier.oneshot(7).await });
//! ```
//!
//! With tower's `Timeout` in the stack, whatever the classifier (tower's own limit fails there
//! the same way): "implementation of `From` is not general enough".
//!
//! ```compile_fail
//! # use std::time::Duration;
//! # use tower::{service_fn, BoxError, ServiceBuilder, ServiceExt};
//! # use tower_resources_operation::ResourcesOperationLayer;
//! let verifier = ServiceBuilder::new()
//!     .layer(ResourcesOperationLayer::new(2))
//!     .timeout(Duration::from_secs(1))
//!     .service(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
//! tokio::spawn(async move { verifier.oneshot(7).await });
//! ```
//!
//! For either, spawn the `oneshot` future itself, or box the service before the async block
//! (`tower::util::BoxCloneService`). The default classifier puts no bound on the error, so the
//! default layer compiles wherever tower's limit does, for any response that says how its
//! operation ended (see the third error below). axum and tonic handlers, whose errors are
//! `Infallible`, meet neither error.
//!
//! ```
//! # use std::time::Duration;
//! # use tower::{service_fn, util::BoxCloneService, BoxError, ServiceBuilder, ServiceExt};
//! # use tower_resources_operation::{classify::TimeoutClassifier, ResourcesOperationLayer};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let verifier = ServiceBuilder::new()
//!     .layer(ResourcesOperationLayer::new(2).classifier(TimeoutClassifier::new()))
//!     .timeout(Duration::from_secs(1))
//!     .service(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
//! // Spawn the `oneshot` future itself...
//! let direct = tokio::spawn(verifier.clone().oneshot(7));
//! // ...or box the service first.
//! let boxed = BoxCloneService::new(verifier);
//! let in_block = tokio::spawn(async move { boxed.oneshot(8).await });
//! assert_eq!(direct.await.unwrap().unwrap() + in_block.await.unwrap().unwrap(), 15);
//! # }
//! ```
//!
//! The third comes from a response the layer cannot read. The default classifier asks each
//! response how its operation ended ([`classify::OperationOutput`]); for a response type of
//! your own rustc says "`DefaultClassifier` cannot tell how an operation that answered
//! `Verdict` ended" (E0277), or, where the service's method is called (`svc.oneshot(req)`),
//! only "the method `oneshot` exists for struct `ResourcesOperation<..>`, but its trait bounds
//! were not satisfied" (E0599). Implement [`classify::OperationOutput`] for the type (its
//! verdict), or give the layer [`classify::ResultClassifier`], which counts every answer as
//! `ok`: the [`DefaultClassifier`](classify::DefaultClassifier) shows both.
//!
//! # Cargo features
//!
//! - `tonic`: the layered services implement tonic's `NamedService`, so a layered gRPC
//!   service can go to `Server::add_service`.
//! - `axum`: [`per_request::ByMatchedPath`], which chooses each request's operation by axum's
//!   matched route.
//! - `serde`: [`Operation`], [`Executor`], [`Outcome`] and [`Rejection`] (de)serialize as their
//!   attribute strings.
//! - `load`: the service implements tower's `Load`, forwarded from the inner service (for
//!   tower's balancers; tower's `load` brings `tracing` with it).
//! - `tracing` (default): each operation in its request's trace, as a wait span and a run span
//!   at `DEBUG` (the [`trace`] module), and the warnings above, through `tracing`; without it,
//!   no spans, and the warnings go to standard error. Off, `tracing` is not in the dependency
//!   tree.
//! - `experimental-bound-instruments`: records through OpenTelemetry's bound instruments
//!   (`Histogram::bind`), several times cheaper per record. Turn on `opentelemetry_sdk`'s
//!   `experimental_metrics_bound_instruments` feature too: without it the SDK silently drops
//!   every bound measurement.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(rustdoc::broken_intra_doc_links)]

pub mod adaptive;
mod attributes;
pub mod classify;
mod diagnostics;
mod guard;
pub mod layer;
pub mod limit;
pub mod metrics;
mod names;
mod operation;
pub mod per_request;
pub mod protocol;
mod scoped;
pub mod trace;

pub use attributes::{Executor, Operation, Outcome, ParseAttributeError, Rejection};
pub use layer::{GrpcLayer, HttpLayer, ResourcesOperation, ResourcesOperationLayer};
pub use limit::{Acquire, Limit};
pub use metrics::OperationMetrics;
pub use names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTORS, EXECUTOR_ATTRIBUTE, OPERATIONS,
    OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOMES, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_INSTRUMENT,
};
pub use operation::set_outcome;
pub use protocol::Rejected;
pub use scoped::{resources_operation, resources_operation_with};
