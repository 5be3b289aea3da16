//! The instruments, the live counts, and where each operation's numbers are recorded.
//!
//! Everything a request touches is built once, in [`OperationMetrics::new`]: the two histograms,
//! the attribute slices for every (operation, executor[, outcome | rejection]) in one fixed key
//! order, a table of atomics for the live counts, rejections and abandoned waits (read by the
//! observable instruments' callbacks), and one series handle per (operation, executor). The
//! request path only reads the clock, adds to atomics and records with a pre-built slice.

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
