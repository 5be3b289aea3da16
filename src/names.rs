//! The vocabulary: every name this crate exports, in one place.
//!
//! NeMo Gym's module (`nemo_gym.telemetry.resources_operations`) defines the first group: its
//! instrument names, attribute keys, attribute values and bucket boundaries, spelled exactly as
//! it spells them. The rest are this crate's additions (the limit's capacity, rejections,
//! abandoned waits, named limits, and the spans of an operation's wait and run), named in the
//! same style. A dashboard, an alert or a test that names one of these reads it from here.
//!
//! ```
//! use tower_resources_operation::names::{OPERATIONS, QUEUE_DURATION_INSTRUMENT};
//! use tower_resources_operation::Operation;
//!
//! assert_eq!(QUEUE_DURATION_INSTRUMENT, "gym.resources.operation.queue_duration_ms");
//! assert_eq!(OPERATIONS.len(), Operation::ALL.len());
//! ```

// NeMo Gym's.

/// Observable up-down counter: operations holding a permit now.
pub const ACTIVE_INSTRUMENT: &str = "gym.resources.operation.active";
/// Histogram, milliseconds: time an operation ran inside the limit, by outcome.
pub const DURATION_INSTRUMENT: &str = "gym.resources.operation.duration_ms";
/// Observable up-down counter: operations waiting for a permit now.
pub const QUEUED_INSTRUMENT: &str = "gym.resources.operation.queued";
/// Histogram, milliseconds: time an operation waited for the limit.
pub const QUEUE_DURATION_INSTRUMENT: &str = "gym.resources.operation.queue_duration_ms";

/// Attribute key of the [`Operation`](crate::Operation).
pub const OPERATION_ATTRIBUTE: &str = "nemo.gym.resources.operation";
/// Attribute key of the [`Executor`](crate::Executor).
pub const EXECUTOR_ATTRIBUTE: &str = "nemo.gym.resources.executor";
/// Attribute key of the [`Outcome`](crate::Outcome), on the duration histogram only.
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

/// The values of [`OPERATION_ATTRIBUTE`], in the order of [`Operation::ALL`](crate::Operation::ALL).
pub const OPERATIONS: &[&str] = &["verify", "tool", "judge", "other"];
/// The values of [`EXECUTOR_ATTRIBUTE`], in the order of [`Executor::ALL`](crate::Executor::ALL).
pub const EXECUTORS: &[&str] = &["inline", "thread", "process", "subprocess", "other"];
/// The values of [`OUTCOME_ATTRIBUTE`], in the order of [`Outcome::ALL`](crate::Outcome::ALL).
pub const OUTCOMES: &[&str] = &["ok", "error", "timeout", "cancelled", "crashed"];

// This crate's: the instruments of every series.

/// Observable gauge, `{operation}`: the most operations of a series that could run at once, the
/// sum of the capacities of the distinct limits it draws from.
pub const LIMIT_INSTRUMENT: &str = "gym.resources.operation.limit";
/// Counter, `{operation}`: operations turned away without a permit, by [`REJECTION_ATTRIBUTE`].
pub const REJECTED_INSTRUMENT: &str = "gym.resources.operation.rejected";
/// Counter, `{operation}`: operations whose caller went away while they waited for a permit.
pub const ABANDONED_INSTRUMENT: &str = "gym.resources.operation.abandoned";
/// Attribute key of the [`Rejection`](crate::Rejection), on [`REJECTED_INSTRUMENT`] and on a
/// rejected operation's wait span.
pub const REJECTION_ATTRIBUTE: &str = "nemo.gym.resources.operation.rejection";

// This crate's: the instruments of a named limit.

/// Observable gauge, `{operation}`: how many operations a
/// [named](crate::LimitBuilder::name) limit admits at once, by [`LIMIT_ATTRIBUTE`].
pub const LIMIT_CAPACITY_INSTRUMENT: &str = "gym.resources.limit.capacity";
/// Observable up-down counter, `{operation}`: places of a named limit held right now, whichever
/// series holds them, by [`LIMIT_ATTRIBUTE`].
pub const LIMIT_ACTIVE_INSTRUMENT: &str = "gym.resources.limit.active";
/// Observable up-down counter, `{operation}`: operations waiting for a named limit right now,
/// by [`LIMIT_ATTRIBUTE`].
pub const LIMIT_QUEUED_INSTRUMENT: &str = "gym.resources.limit.queued";
/// Observable gauge, `ms`: the run time a named [adaptive](crate::adaptive) limit's algorithm
/// takes as normal, at low load, by [`LIMIT_ATTRIBUTE`].
pub const LIMIT_BASELINE_INSTRUMENT: &str = "gym.resources.limit.adaptive.baseline_ms";
/// Observable gauge, `ms`: the recent run time a named adaptive limit's algorithm compares with
/// its baseline, by [`LIMIT_ATTRIBUTE`].
pub const LIMIT_ESTIMATE_INSTRUMENT: &str = "gym.resources.limit.adaptive.estimate_ms";
/// Attribute key of a limit's name, on the `gym.resources.limit.*` instruments and on an
/// operation's spans.
pub const LIMIT_ATTRIBUTE: &str = "nemo.gym.resources.limit";
/// Attribute key of whose capacity a limit's is (a [`Scope`](crate::limit::Scope): `process`,
/// `fleet` or `share`), on the `gym.resources.limit.*` instruments and on
/// [`LIMIT_INSTRUMENT`].
pub const LIMIT_SCOPE_ATTRIBUTE: &str = "nemo.gym.resources.limit.scope";

/// Name of the meter that [`OperationMetrics::global`](crate::OperationMetrics::global) takes
/// from the global provider.
pub const METER_NAME: &str = "tower-resources-operation";

// This crate's: an operation in its request's trace (the `tracing` feature).

/// The `tracing` target of the spans and of the crate's warnings, which a filter names
/// (`tower_resources_operation=debug`).
pub const TARGET: &str = "tower_resources_operation";
/// The name of the span of an operation's wait for its limit.
pub const WAIT_SPAN: &str = "gym.resources.operation.wait";
/// The name of the span of an operation's run inside its limit.
pub const RUN_SPAN: &str = "gym.resources.operation.run";
/// Wait span field: how the wait ended, `admitted`, `rejected` or `abandoned`.
pub const WAIT_ATTRIBUTE: &str = "nemo.gym.resources.operation.wait";
/// Wait span field: how many operations were waiting for the limit when this one started to
/// wait, or was turned away, itself not counted, for a limit that reports its queue
/// ([`Acquire::capacity`](crate::Acquire::capacity), as [`Limit`](crate::Limit) does).
pub const QUEUED_AHEAD_ATTRIBUTE: &str = "nemo.gym.resources.operation.queued_ahead";
/// Span field: the queue time in milliseconds, the value the queue-time histogram records.
pub const QUEUE_DURATION_ATTRIBUTE: &str = "nemo.gym.resources.operation.queue_duration_ms";
/// Run span field: the run time in milliseconds, the value the run-time histogram records.
pub const DURATION_ATTRIBUTE: &str = "nemo.gym.resources.operation.duration_ms";
