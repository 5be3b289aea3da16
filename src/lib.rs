//! A drop-in for tower's `ConcurrencyLimitLayer` that shows when the limit is too small.
//!
//! Services that do expensive work (a verifier subprocess, a judge call, a tool run) cap it with
//! a semaphore. When the cap is too small, work waits in a queue that no request metric shows:
//! the server looks slow without looking busy. [`ResourcesOperationLayer`] is that cap, and it
//! reports, as OpenTelemetry metrics, how long each operation waited for the limit, how long it
//! ran inside it, how it ended, and how many wait and run right now.
//!
//! It is the tower form of NeMo Gym's module `nemo_gym.telemetry.resources_operations`, with
//! the same instrument names, attributes, bucket boundaries and outcome rules ([`names`]), and a
//! few instruments of its own (the limit's capacity, the operations it turned away, the waits
//! given up, named limits).
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
//! Two routes share a [named](LimitBuilder::name) limit of 2 with at most 8 waiting, under a
//! Router-wide tower-http `TimeoutLayer` the layers are told of
//! ([`server_timeout`](ResourcesOperationLayer::server_timeout)), with Prometheus on `/metrics`.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{http::StatusCode, routing::get, Router};
//! use opentelemetry::metrics::MeterProvider as _;
//! use opentelemetry_sdk::metrics::SdkMeterProvider;
//! use tower_http::timeout::TimeoutLayer;
//! use tower_resources_operation::names::METER_NAME;
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
//! | a cap that several routes share, resized while it serves, with a bounded queue | [`Limit`], [`LimitBuilder`] |
//! | a cap that finds its own capacity from the run times and outcomes it sees | [`adaptive`] |
//! | one limit for a whole fleet of replicas, kept in Redis | the companion crate `tower-resources-operation-redis` ([below](#a-limit-for-the-whole-fleet)) |
//! | a limit of your own: a pool, a weighted semaphore, a fleet limit on another store | [`Acquire`], reporting through [`limit::Capacity`] and hearing each end through [`Acquire::ended`] |
//! | how results become outcomes | [`classify`] |
//! | how a rejection is answered, and where a caller's deadline is read | [`protocol`] |
//! | one layer over a whole `Router` or tonic `Server` | [`per_request`] |
//! | operations that last until the response body ends | [`until_body_end`](ResourcesOperationLayer::until_body_end), [`OperationBody`] |
//! | work that is not a tower service | [`resources_operation`] |
//! | the outcome the classifier cannot see | [`set_outcome`] |
//! | the instruments, on your own meter | [`OperationMetrics`] |
//! | the names of the instruments, attributes and spans | [`names`] |
//!
//! # Metrics
//!
//! | instrument | kind | unit | attributes | recorded |
//! |---|---|---|---|---|
//! | `gym.resources.operation.queue_duration_ms` | histogram (f64) | `ms` | operation, executor | once per operation that runs, when it is called: the time since it first had to wait, or 0 if the permit was free at once |
//! | `gym.resources.operation.duration_ms` | histogram (f64) | `ms` | operation, executor, outcome | once per operation that runs, when it ends: from the permit to the end of the work (of its body, in the body-end form) |
//! | `gym.resources.operation.queued` | observable up-down counter (i64) | `{operation}` | operation, executor | at each collection: operations waiting for a permit now |
//! | `gym.resources.operation.active` | observable up-down counter (i64) | `{operation}` | operation, executor | at each collection: operations holding a permit now |
//! | `gym.resources.operation.limit` (this crate's) | observable gauge (i64) | `{operation}` | operation, executor, scope | at each collection: the sum of the capacities of the distinct limits the series draws from |
//! | `gym.resources.operation.rejected` (this crate's) | observable counter (u64) | `{operation}` | operation, executor, rejection | operations turned away without a permit: `queue_full`, `queue_timeout`, `deadline` (the server's deadline passed in the queue), or `unavailable` (the limit is closed, or its store out of reach) |
//! | `gym.resources.operation.abandoned` (this crate's) | observable counter (u64) | `{operation}` | operation, executor | operations whose caller went away before they ran |
//! | `gym.resources.limit.capacity` (this crate's) | observable gauge (i64) | `{operation}` | limit, scope | at each collection: how many operations a named limit admits at once |
//! | `gym.resources.limit.active` (this crate's) | observable up-down counter (i64) | `{operation}` | limit, scope | at each collection: places of a named limit held now, whatever their series |
//! | `gym.resources.limit.queued` (this crate's) | observable up-down counter (i64) | `{operation}` | limit, scope | at each collection: operations waiting for a named limit now |
//! | `gym.resources.limit.adaptive.{baseline,estimate}_ms` (this crate's) | observable gauge (f64) | `ms` | limit, scope | at each collection: the run time a named [adaptive] limit takes as normal, and its recent one |
//!
//! The names and attribute keys are constants in [`names`]; the attribute values are the enums
//! [`Operation`], [`Executor`], [`Outcome`], [`Rejection`] and [`limit::Scope`], so the series
//! are bounded whatever comes in. Names from config go through [`Operation::from_str_lossy`] /
//! [`Executor::from_str_lossy`] or `FromStr`, whose error lists the valid values. Both
//! histograms use NeMo Gym's [`OPERATION_BOUNDARIES_MS`](names::OPERATION_BOUNDARIES_MS), from
//! 1 ms to 30 minutes.
//!
//! ## What a series is, and reading the numbers
//!
//! - **A series is (operation, executor)**, from the values a layer is given, not from its
//!   route: two routes tagged alike are one series. To tell routes apart, tag them apart, or
//!   give each its own [named](LimitBuilder::name) limit.
//! - **Every operation that asks for a permit is exactly one of**: admitted (one queue sample
//!   and one duration sample with its outcome), rejected (by reason), or abandoned (its caller
//!   went away while it waited, or after it got its permit but before it was called).
//! - **`limit`**: a limit shared by two series reports its full capacity under each; a series
//!   served by limits of 2 and 3 reports 5; one limit reached through two layers counts once. A
//!   [`Limit`] knows its capacity; an `Arc<Semaphore>` does not, unless the layer is given one
//!   ([`capacity`](ResourcesOperationLayer::capacity)).
//! - **`active` is at most `limit`**, except while a lowered capacity drains. `active` and
//!   `queued` count each operation as it sees its own place: as one ends and its place passes
//!   to a waiter, a read in between (until the waiter's task is polled) sees one fewer active
//!   and the waiter still queued. A named limit's `gym.resources.limit.active` counts places,
//!   and has no such gap.
//! - **A limit shared by several series** (`/verify` and `/judge` on one [`Limit`]) shows, on
//!   each series, its whole capacity as `limit` and only that series' share as `active`:
//!   neither looks full while together they are. [Name the limit](LimitBuilder::name) and it
//!   reports `gym.resources.limit.{capacity,active,queued}` with `nemo.gym.resources.limit` =
//!   its name, whichever series use it: read saturation there. A name is written in code, so
//!   the attribute stays bounded; limits that share a name add up.
//! - **Whose capacity it is**: `limit` and the named limit's instruments carry
//!   `nemo.gym.resources.limit.scope` ([`limit::Scope`]): `process` for a limit of the
//!   process, whose capacity adds up over the processes that report it; `fleet` for one limit
//!   shared by a whole fleet, whose capacity every replica reports alike, to read once; `share`
//!   for a fleet limit running on its replica's share while its store is away, to add up.
//! - **An [adaptive] limit** sets its own capacity: `limit` and `gym.resources.limit.capacity`
//!   follow it.
//! - Live counts add up over every limit that reports through one [`OperationMetrics`] (clones
//!   share them). A series given explicit metrics reports 0 from the moment a layer makes a
//!   service for it; with the global metrics, from the first request a service of the layer
//!   serves. A [per-request](per_request) layer whose chooser knows its rules reports every
//!   series they name the same way, before any request chooses it.
//! - Mistakes that would record nothing, or the wrong thing, are reported once each as a
//!   `tracing` warning (on standard error without the `tracing` feature, or without a
//!   subscriber): no meter provider installed (then [`OperationMetrics::global`] is disabled:
//!   `global().is_enabled()` is the check to call), a second [`OperationMetrics`] alive, a
//!   per-request choice naming a limit its layer was not given, a layer of one operation over a
//!   whole Router, one limit twice on a request's path.
//! - [`OperationMetrics::disabled`] reports nothing: the layer then only enters the limit. An
//!   adaptive limit's controller hears each operation's end from the limit itself, so it learns
//!   with metrics off too.
//!
//! The histograms' buckets are far apart: a quantile interpolated between two boundaries is
//! coarse (a 205 ms verifier reads as a p50 of 300 ms), while the means (`_sum` / `_count`) are
//! exact. Where they are too coarse for your work, replace them with an OpenTelemetry View on
//! your meter provider; the crate does not change:
//!
//! ```
//! use opentelemetry_sdk::metrics::{Aggregation, Instrument, SdkMeterProvider, Stream};
//! use tower_resources_operation::names::{DURATION_INSTRUMENT, QUEUE_DURATION_INSTRUMENT};
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
//! NeMo Gym's rules, checked in this order for every form:
//!
//! 1. [`set_outcome`] called inside the work wins (NeMo Gym's `op.outcome = ...`).
//! 2. The inner service answered: the classifier decides ([`classify::DefaultClassifier`]: the
//!    response says ([`classify::OperationOutput`]: an `http::Response` by its status or its
//!    `grpc-status`, a process's `Output` by its exit status, a plain value `ok`), `Err` is
//!    `error`; [`classify::TimeoutClassifier`] also makes tower's and tokio's `Elapsed`
//!    `timeout`; [`classify::HttpClassifier`] reads the status with rules you can change). A
//!    classifier that panics costs the operation its outcome (`error`), never the response.
//! 3. The inner `poll_ready` failed: `error`, and the permit goes back.
//! 4. A panic in the inner `poll_ready`, in `call`, or while polling its future or body:
//!    `crashed`, the permit goes back, and the panic goes on.
//! 5. Dropped once called, before the end (the caller went away): `cancelled`, or `timeout` once
//!    the caller's deadline has passed (see [`protocol`]). Dropped with its permit before it
//!    was called: abandoned, not an outcome.
//! 6. In the body-end form, the end of the stream ends the operation with the head's outcome,
//!    or the trailers' when the classifier lets them decide
//!    ([`ClassifyOutcome::classify_at_end`](classify::ClassifyOutcome::classify_at_end): a gRPC
//!    stream's status); a body error is `error`.
//!
//! Recording never fails a request: a meter, a classifier, a chooser or a deadline reader that
//! panics costs a measurement, never an answer.
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
//! and its outcome ([`set_outcome`] inside sets it). The limit is known by [`Acquire::id`]
//! ([`Limit`], `Arc<Semaphore>`; a limit of your own says which it is with
//! [`limit::LimitId`]), and the place held is seen on the thread that polls the request, as
//! `set_outcome` is: work spawned on a task of its own is another request. A request that
//! passes another limit between the two layers of one is checked against the innermost only.
//!
//! ## A verifier subprocess
//!
//! Spawn it with `kill_on_drop(true)`. `active` counts places: when a caller goes away, its
//! operation ends and its place goes back at once. tokio does not kill a child when its handle
//! is dropped, so a verifier spawned without it runs on after its request is gone: work the
//! limit no longer sees, while the limit admits another in its place.
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
//! how many. With the `tracing` feature (off by default: it adds a word to every operation),
//! every operation makes, at `DEBUG` level under the target `tower_resources_operation`:
//!
//! - a **wait span**, [`WAIT_SPAN`](names::WAIT_SPAN), from the moment it starts to wait for
//!   its limit until it is admitted, turned away or abandoned. Every operation that waits, or
//!   is turned away, has a wait span (one turned away at once, a wait span of no length); one
//!   admitted at once has only its run span.
//! - a **run span**, [`RUN_SPAN`](names::RUN_SPAN), until its end (for
//!   [`until_body_end`](ResourcesOperationLayer::until_body_end), the end of the response
//!   body), entered while its work is called and polled, so that spans made by the work are its
//!   children.
//!
//! Both are children of the span current when the operation arrived: with the layer inside
//! tower-http's `TraceLayer`, the request span; for [`resources_operation`], whatever span
//! calls it. With no span current, the run span is the wait span's child, so that the wait and
//! the request stay one trace.
//!
//! | field | wait span | run span |
//! |---|---|---|
//! | `nemo.gym.resources.operation`, `nemo.gym.resources.executor` | yes | yes |
//! | `nemo.gym.resources.limit`: the limit's name, if it has one | yes | yes |
//! | [`QUEUED_AHEAD_ATTRIBUTE`](names::QUEUED_AHEAD_ATTRIBUTE): operations waiting ahead of it when it started to wait, or was turned away | for a limit that reports its queue | |
//! | [`QUEUE_DURATION_ATTRIBUTE`](names::QUEUE_DURATION_ATTRIBUTE): the queue time, in ms | yes | yes (0 if it did not wait) |
//! | [`WAIT_ATTRIBUTE`](names::WAIT_ATTRIBUTE): `admitted`, `rejected` or `abandoned` | yes | |
//! | `nemo.gym.resources.operation.rejection`: why it was turned away | rejected | |
//! | [`DURATION_ATTRIBUTE`](names::DURATION_ATTRIBUTE): the run time, in ms | | yes |
//! | `nemo.gym.resources.operation.outcome` | | yes |
//!
//! The queue and run times are the values the histograms record, and every ending closes its
//! span with its result.
//!
//! **Why `DEBUG`.** Recorded through `tracing-opentelemetry` and the SDK, a span costs an
//! operation microseconds, many times what the layer itself costs (`BENCHMARKS.md`); at `INFO`,
//! the level most services run at, every operation would pay it. At `DEBUG`, the level of
//! tower-http's `TraceLayer` request spans by default, a filter that shows those shows these
//! under them, and one that hides them hides these too. Filtered out, or with no subscriber, an
//! operation reads one word, `tracing`'s max level. To leave them out whatever the level,
//! filter the target: `tower_resources_operation=info`.
//!
//! **Exemplars.** The queue-time histogram is recorded while the wait span is entered (the run
//! span, for an operation that did not wait), and the run-time histogram while the run span
//! is: an OpenTelemetry SDK that takes exemplars from the current context then links a slow
//! bucket to its trace, given `tracing-opentelemetry`'s layer in your subscriber.
//!
//! ```
//! use std::convert::Infallible;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_resources_operation::{Operation, ResourcesOperationLayer};
//! use tracing::Instrument;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // With a subscriber that records the target's DEBUG spans (in production, tracing-subscriber's
//! // registry with tracing-opentelemetry's layer), the operation's spans are the request's
//! // children.
//! let verifier = ServiceBuilder::new()
//!     .layer(ResourcesOperationLayer::new(2).operation(Operation::Verify))
//!     .service(service_fn(|answer: String| async move {
//!         Ok::<_, Infallible>(answer == "42")
//!     }));
//! let request = tracing::info_span!("request");
//! let correct = verifier.oneshot("42".to_owned()).instrument(request).await;
//! assert!(correct.unwrap());
//! # }
//! ```
//!
//! # A limit for the whole fleet
//!
//! A [`Limit`] of N on each of 8 replicas is a fleet limit of 8N, wrong as soon as one dies or
//! one is added. The companion crate `tower-resources-operation-redis` is one limit of N for
//! every process that names it, kept in the Redis they all reach. It is an [`Acquire`], so it
//! goes wherever a [`Limit`] goes, and it reports through the same seams any limit of your own
//! can use: [`limit::Capacity`] for its name, capacity and live counts, [`Acquire::ended`] for
//! what its controller hears, [`adaptive::Window`] for an adaptive limit's windows. Each
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
//!   waiters are woken to that answer. Only a generic layer whose protocol cannot answer
//!   (none, the generic layer of [`new`](ResourcesOperationLayer::new)) still
//!   panics at `poll_ready`, in every build, with a message naming the limit and the cause.
//!   tower panics there only in debug builds, and at `call` with an unrelated message in
//!   release.
//! - **A limit that turns operations away** (a queue bound, a queue timeout, a fleet limit that
//!   fails closed) makes `poll_ready` ready, and `call` answers the rejection as the layer's
//!   [`protocol`] says, without calling the inner service, as tower's `LoadShed` does. A
//!   generic layer answers only once given a protocol that can
//!   ([`RejectAsError`](protocol::RejectAsError) for a `BoxError` service); until then it
//!   refuses, when it makes its service, a limit that may reject.
//! - Otherwise the same: the permit is taken in `poll_ready`, waiters are served first come
//!   first served, a clone starts without a permit, the permit goes back when the response
//!   future completes, errors or is dropped, or when a service holding an unused permit is
//!   dropped; `call` without `poll_ready` panics, saying so. (tower's `new(0)` is never ready;
//!   here a limit of 0 is refused when it is built, naming the value: a panic at build as tower
//!   does, or an error from [`Limit::try_new`] / [`LimitBuilder::try_build`].) `Response` and
//!   `Error` are the inner service's, `tower::load::Load` is forwarded, and
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
//! verdict), or give the layer a classifier of your own: the
//! [`DefaultClassifier`](classify::DefaultClassifier) shows both.
//!
//! # Cargo features
//!
//! - `tracing` (default): each operation in its request's trace, as a wait span and a run span
//!   at `DEBUG` ([above](#in-the-requests-trace)), and the crate's warnings through `tracing`;
//!   without it, no spans, the warnings go to standard error, and `tracing` is not in the
//!   dependency tree.
//! - `tonic`: the layered services implement tonic's `NamedService`, so a layered gRPC service
//!   can go to `Server::add_service`.
//! - `axum`: [`per_request::ByRoute`] reads the route axum matched.
//! - `serde`: [`Operation`], [`Executor`], [`Outcome`] and [`Rejection`] (de)serialize as their
//!   attribute strings.
//! - `load`: the service implements tower's `Load`, forwarded from the inner service (for
//!   tower's balancers; tower's `load` brings `tracing` with it).
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
mod admission;
mod attributes;
mod body;
pub mod classify;
mod config;
mod diagnostics;
mod error;
mod future;
mod guard;
mod layer;
pub mod limit;
mod metrics;
pub mod names;
mod operation;
pub mod per_request;
pub mod protocol;
mod rejected;
mod scoped;
mod service;

pub use attributes::{Executor, Operation, Outcome, Rejection};
pub use body::{AtBodyEnd, OperationBody};
pub use error::ConfigError;
pub use future::ResponseFuture;
pub use layer::{HttpLayer, ResourcesOperationLayer};
pub use limit::acquire::Acquire;
pub use limit::local::{IntoLimit, Limit, LimitBuilder};
pub use metrics::OperationMetrics;
pub use operation::set_outcome;
pub use rejected::Rejected;
pub use scoped::resources_operation;
pub use service::{HttpService, ResourcesOperation};
