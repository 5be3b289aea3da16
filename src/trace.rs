//! Each operation in its request's trace: the names of its spans and of their fields.
//!
//! With the `tracing` feature (on by default), every operation a layer or
//! [`resources_operation`](crate::resources_operation) runs makes, at `DEBUG` level under the
//! target `tower_resources_operation`:
//!
//! - a **wait span**, [`WAIT_SPAN`], from the moment it starts to wait for its limit until it
//!   is admitted, turned away or abandoned: only an operation that waited has one (and one
//!   turned away at once, with a length of 0, so that every rejection is in the trace);
//! - a **run span**, [`RUN_SPAN`], from its admission until its end (for
//!   [`until_body_end`](crate::ResourcesOperationLayer::until_body_end), the end of the
//!   response body), entered while its work is called and polled, so that spans made by the
//!   work (a handler's, the request span of a `TraceLayer` inside the layer) are its children.
//!
//! Both are children of the span current when the operation arrived: with the layer inside
//! tower-http's `TraceLayer` (or under axum's `Router::layer(TraceLayer)`, which wraps the
//! routes), the request span; for [`resources_operation`](crate::resources_operation),
//! whatever span calls it. With no span current (the layer outside every request span), the run
//! span is the wait span's child, so that the wait and the request stay one trace, and no span
//! is left without its request.
//!
//! # Fields
//!
//! | field | wait span | run span |
//! |---|---|---|
//! | [`OPERATION_ATTRIBUTE`](crate::OPERATION_ATTRIBUTE), [`EXECUTOR_ATTRIBUTE`](crate::EXECUTOR_ATTRIBUTE) | yes | yes |
//! | [`LIMIT_ATTRIBUTE`](crate::metrics::LIMIT_ATTRIBUTE): the limit's name, if it has one | yes | yes |
//! | [`QUEUED_AHEAD_ATTRIBUTE`]: operations waiting when it started to wait | for a limit that reports its queue | |
//! | [`QUEUE_DURATION_ATTRIBUTE`]: the queue time, in ms | yes | yes (0 if it did not wait) |
//! | [`WAIT_ATTRIBUTE`]: `admitted`, `rejected` or `abandoned` | yes | |
//! | [`REJECTION_ATTRIBUTE`](crate::metrics::REJECTION_ATTRIBUTE): why it was turned away (`deadline` for a wait the server's deadline ended) | rejected | |
//! | [`DURATION_ATTRIBUTE`]: the run time, in ms | | yes |
//! | [`OUTCOME_ATTRIBUTE`](crate::OUTCOME_ATTRIBUTE): `ok`, `error`, `timeout`, `cancelled` or `crashed` | | yes |
//!
//! The queue and run times are the values the histograms record, and every ending closes its
//! span with its result: an admission, a rejection, a wait given up (the caller dropped its
//! request, [`Rejection::Deadline`](crate::Rejection::Deadline) past the server's deadline), a
//! panic (`crashed`), a dropped response future or body (`cancelled` or `timeout`).
//!
//! # Why two spans, and why `DEBUG`
//!
//! A wait is a stretch of time, and a trace viewer draws it beside the request's own: "1.6 s of
//! its 2 s waiting" is seen at a glance, where an event on one operation span would be a field
//! to read. An operation that did not wait costs one span, not two.
//!
//! `DEBUG`, from the costs (BENCHMARKS.md, "0.5, issue 35"): recorded through
//! `tracing-opentelemetry` and the SDK, a span costs an operation about 19,000 instructions (a
//! few microseconds), some 50 times what the layer costs with metrics off and 5 times with
//! metrics on; at `INFO`, the level most services run at, every operation would pay it. At
//! `DEBUG`, the level of tower-http's `TraceLayer` request spans by default, a filter that shows
//! those shows these under them, and one that hides them (the usual `info`) hides these too, so
//! that no operation span shows without its request. Filtered out, or with no subscriber, an
//! operation reads one word, `tracing`'s max level (off until a subscriber is set): at most
//! 1.02x of 0.4's instructions per operation, metrics on or off. To leave them out whatever the
//! level, filter the target: `tower_resources_operation=info`; to build without them, turn the
//! `tracing` feature off.
//!
//! # Exemplars
//!
//! The queue-time histogram is recorded while the wait span is entered (the run span, for an
//! operation that did not wait), and the run-time histogram while the run span is. An
//! OpenTelemetry SDK that takes exemplars from the current context (opentelemetry-rust's
//! histogram exemplars are an open pull request, #3624, behind
//! `spec_unstable_metrics_exemplars`) then links a slow bucket to this trace with no change
//! here. On your side: `tracing-opentelemetry`'s layer in your subscriber, so that an entered
//! `tracing` span is the current OpenTelemetry context; an SDK with exemplars turned on; and the
//! spans enabled at `DEBUG` for the target `tower_resources_operation`.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_resources_operation::{Operation, ResourcesOperationLayer};
//! use tracing::Instrument;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A subscriber that records the target's DEBUG spans: in production, tracing-subscriber's
//! // registry with tracing-opentelemetry's layer.
//! let verifier = ServiceBuilder::new()
//!     .layer(ResourcesOperationLayer::new(2).operation(Operation::Verify))
//!     .service(service_fn(|answer: String| async move {
//!         Ok::<_, Infallible>(answer == "42")
//!     }));
//! // The operation's spans are children of the request's.
//! let request = tracing::info_span!("request");
//! let correct = verifier.oneshot("42".to_owned()).instrument(request).await;
//! assert!(correct.unwrap());
//! # }
//! ```

/// The name of the span of an operation's wait for its limit.
pub const WAIT_SPAN: &str = "gym.resources.operation.wait";
/// The name of the span of an operation's run inside its limit.
pub const RUN_SPAN: &str = "gym.resources.operation.run";
/// Wait span field: how the wait ended, `admitted`, `rejected` or `abandoned`.
pub const WAIT_ATTRIBUTE: &str = "nemo.gym.resources.operation.wait";
/// Wait span field: how many operations were waiting for the limit when this one started to
/// wait, itself not counted, for a limit that reports its queue
/// ([`Acquire::capacity`](crate::Acquire::capacity), as [`Limit`](crate::Limit) does).
pub const QUEUED_AHEAD_ATTRIBUTE: &str = "nemo.gym.resources.operation.queued_ahead";
/// Span field: the queue time in milliseconds, the value the queue-time histogram records.
pub const QUEUE_DURATION_ATTRIBUTE: &str = "nemo.gym.resources.operation.queue_duration_ms";
/// Run span field: the run time in milliseconds, the value the run-time histogram records.
pub const DURATION_ATTRIBUTE: &str = "nemo.gym.resources.operation.duration_ms";
/// The `tracing` target of the spans, which a filter names
/// (`tower_resources_operation=debug`).
pub const TARGET: &str = "tower_resources_operation";
