//! The vocabulary: NeMo Gym's instrument names, attribute keys, bucket boundaries and attribute
//! values, and the names this crate adds to them. Everything else is built on these.

/// Name of the meter that [`OperationMetrics::global`](crate::OperationMetrics::global) takes
/// from the global provider.
pub const METER_NAME: &str = "tower-resources-operation";

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

/// The values of [`OPERATION_ATTRIBUTE`], one per [`Operation`](crate::Operation).
pub const OPERATIONS: &[&str] = &["verify", "tool", "judge", "other"];
/// The values of [`EXECUTOR_ATTRIBUTE`], one per [`Executor`](crate::Executor).
pub const EXECUTORS: &[&str] = &["inline", "thread", "process", "subprocess", "other"];
/// The values of [`OUTCOME_ATTRIBUTE`], one per [`Outcome`](crate::Outcome).
pub const OUTCOMES: &[&str] = &["ok", "error", "timeout", "cancelled", "crashed"];

/// Observable gauge, `{operation}`: the most operations of a series that could run at once, the
/// sum of the capacities of the distinct limits it draws from. An addition of this crate to
/// NeMo Gym's instruments.
pub const LIMIT_INSTRUMENT: &str = "gym.resources.operation.limit";
/// Counter, `{operation}`: operations turned away without a permit, by [`REJECTION_ATTRIBUTE`].
/// An addition of this crate to NeMo Gym's instruments.
pub const REJECTED_INSTRUMENT: &str = "gym.resources.operation.rejected";
/// Counter, `{operation}`: operations whose caller went away while they waited for a permit.
/// An addition of this crate to NeMo Gym's instruments.
pub const ABANDONED_INSTRUMENT: &str = "gym.resources.operation.abandoned";
/// Attribute key of the [`Rejection`](crate::Rejection), on [`REJECTED_INSTRUMENT`] only.
pub const REJECTION_ATTRIBUTE: &str = "nemo.gym.resources.operation.rejection";
/// The values of [`REJECTION_ATTRIBUTE`], one per [`Rejection`](crate::Rejection).
pub const REJECTIONS: &[&str] = &["queue_full", "queue_timeout", "unavailable", "deadline"];

/// Observable gauge, `{operation}`: how many operations a [named](crate::limit::LimitBuilder::name)
/// limit admits at once, by [`LIMIT_ATTRIBUTE`]. An addition of this crate.
pub const LIMIT_CAPACITY_INSTRUMENT: &str = "gym.resources.limit.capacity";
/// Observable up-down counter, `{operation}`: operations holding a place of a named limit right
/// now, whichever series they belong to, by [`LIMIT_ATTRIBUTE`]. An addition of this crate.
pub const LIMIT_ACTIVE_INSTRUMENT: &str = "gym.resources.limit.active";
/// Observable up-down counter, `{operation}`: operations waiting for a named limit right now, by
/// [`LIMIT_ATTRIBUTE`]. An addition of this crate.
pub const LIMIT_QUEUED_INSTRUMENT: &str = "gym.resources.limit.queued";
/// Observable gauge, `ms`: the run time a named [adaptive](crate::adaptive) limit's algorithm
/// takes as normal, at low load, by [`LIMIT_ATTRIBUTE`]. An addition of this crate.
pub const LIMIT_BASELINE_INSTRUMENT: &str = "gym.resources.limit.adaptive.baseline_ms";
/// Observable gauge, `ms`: the recent run time a named [adaptive](crate::adaptive) limit's
/// algorithm compares with its baseline, by [`LIMIT_ATTRIBUTE`]. An addition of this crate.
pub const LIMIT_ESTIMATE_INSTRUMENT: &str = "gym.resources.limit.adaptive.estimate_ms";
/// Attribute key of a limit's name, on the `gym.resources.limit.*` instruments only.
pub const LIMIT_ATTRIBUTE: &str = "nemo.gym.resources.limit";
/// Attribute key of whose capacity a limit's is ([`Scope`](crate::limit::Scope): one of
/// [`SCOPES`]), on the `gym.resources.limit.*` instruments and on
/// `gym.resources.operation.limit`. An addition of this crate.
pub const LIMIT_SCOPE_ATTRIBUTE: &str = "nemo.gym.resources.limit.scope";
/// The values of [`LIMIT_SCOPE_ATTRIBUTE`]: `process` (added up over processes), `fleet` (the
/// same on every process: read once), `share` (a fleet limit on its share: added up).
pub const SCOPES: &[&str] = &["process", "fleet", "share"];
