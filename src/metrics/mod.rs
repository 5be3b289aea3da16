//! The instruments, the live counts, and where each operation's numbers are recorded.
//!
//! Everything a request touches is built once, in [`OperationMetrics::new`]: the two histograms,
//! the attribute slices for every (operation, executor[, outcome | rejection]) in one fixed key
//! order, a table of atomics for the live counts, rejections and abandoned waits (read by the
//! observable instruments' callbacks), and one series handle per (operation, executor). The
//! request path only reads the clock, adds to atomics and records with a pre-built slice.
//!
//! The names of the instruments this crate adds to NeMo Gym's are re-exported here.

mod callbacks;
mod instruments;
mod operation_metrics;
mod registry;
mod series;

#[cfg(feature = "tracing")]
pub(crate) use instruments::millis;
pub(crate) use operation_metrics::MetricsSource;
pub use operation_metrics::OperationMetrics;
pub(crate) use series::Series;

pub use crate::names::{
    ABANDONED_INSTRUMENT, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE, LIMIT_BASELINE_INSTRUMENT,
    LIMIT_CAPACITY_INSTRUMENT, LIMIT_ESTIMATE_INSTRUMENT, LIMIT_INSTRUMENT,
    LIMIT_QUEUED_INSTRUMENT, LIMIT_SCOPE_ATTRIBUTE, METER_NAME, REJECTED_INSTRUMENT, REJECTIONS,
    REJECTION_ATTRIBUTE, SCOPES,
};
