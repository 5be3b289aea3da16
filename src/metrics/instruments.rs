//! [`Shared`]: the histograms, the pre-built attribute slices of every series, and the table of
//! atomics behind the live counts, built once per meter.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
#[cfg(feature = "experimental-bound-instruments")]
use std::sync::OnceLock;
use std::time::Duration;

#[cfg(feature = "experimental-bound-instruments")]
use opentelemetry::metrics::BoundHistogram;
use opentelemetry::metrics::{Histogram, Meter};
use opentelemetry::KeyValue;

use super::registry::Registry;
use crate::attributes::{Executor, Operation, Outcome, Rejection};
use crate::limit::{Capacity, Scope};
use crate::names::{
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, LIMIT_SCOPE_ATTRIBUTE, OPERATION_ATTRIBUTE,
    OPERATION_BOUNDARIES_MS, OUTCOME_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT, REJECTION_ATTRIBUTE,
};

/// Series per meter: one per (operation, executor).
pub(super) const SERIES: usize = Operation::ALL.len() * Executor::ALL.len();
const OUTCOMES: usize = Outcome::ALL.len();
pub(super) const REJECTION_COUNT: usize = Rejection::ALL.len();

/// The live counts and tallies of one (operation, executor), on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(super) struct Cell {
    pub(super) queued: AtomicI64,
    pub(super) active: AtomicI64,
    pub(super) abandoned: AtomicU64,
    pub(super) rejected: [AtomicU64; REJECTION_COUNT],
    /// Whether the series is reported (from the first limit that uses it on).
    pub(super) reported: AtomicBool,
}

pub(super) struct Shared {
    queue_duration: Histogram<f64>,
    duration: Histogram<f64>,
    pub(super) cells: [Cell; SERIES],
    /// `[operation, executor]` for each series, in that order.
    series_attributes: Box<[[KeyValue; 2]]>,
    /// `[operation, executor, outcome]` for each series and outcome, in that order.
    outcome_attributes: Box<[[KeyValue; 3]]>,
    /// `[operation, executor, rejection]` for each series and rejection, in that order.
    rejection_attributes: Box<[[KeyValue; 3]]>,
    pub(super) limits: Registry<SERIES>,
    /// The queue histogram bound to each series, bound on first use.
    #[cfg(feature = "experimental-bound-instruments")]
    bound_queue: Box<[OnceLock<BoundHistogram<f64>>]>,
    /// The duration histogram bound to each series and outcome, bound on first use.
    #[cfg(feature = "experimental-bound-instruments")]
    bound_duration: Box<[OnceLock<BoundHistogram<f64>>]>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn new(meter: &Meter) -> Self {
        let boundaries = OPERATION_BOUNDARIES_MS.to_vec();
        let queue_duration = meter
            .f64_histogram(QUEUE_DURATION_INSTRUMENT)
            .with_unit("ms")
            .with_description("Time an operation waited for the concurrency limit.")
            .with_boundaries(boundaries.clone())
            .build();
        let duration = meter
            .f64_histogram(DURATION_INSTRUMENT)
            .with_unit("ms")
            .with_description("Time an operation ran inside the concurrency limit, by outcome.")
            .with_boundaries(boundaries)
            .build();

        let mut series_attributes = Vec::with_capacity(SERIES);
        let mut outcome_attributes = Vec::with_capacity(SERIES * OUTCOMES);
        let mut rejection_attributes = Vec::with_capacity(SERIES * REJECTION_COUNT);
        for operation in Operation::ALL {
            for executor in Executor::ALL {
                let operation = KeyValue::new(OPERATION_ATTRIBUTE, operation.as_str());
                let executor = KeyValue::new(EXECUTOR_ATTRIBUTE, executor.as_str());
                for outcome in Outcome::ALL {
                    outcome_attributes.push([
                        operation.clone(),
                        executor.clone(),
                        KeyValue::new(OUTCOME_ATTRIBUTE, outcome.as_str()),
                    ]);
                }
                for rejection in Rejection::ALL {
                    rejection_attributes.push([
                        operation.clone(),
                        executor.clone(),
                        KeyValue::new(REJECTION_ATTRIBUTE, rejection.as_str()),
                    ]);
                }
                series_attributes.push([operation, executor]);
            }
        }

        Self {
            queue_duration,
            duration,
            cells: Default::default(),
            series_attributes: series_attributes.into_boxed_slice(),
            outcome_attributes: outcome_attributes.into_boxed_slice(),
            rejection_attributes: rejection_attributes.into_boxed_slice(),
            limits: Registry::new(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_queue: (0..SERIES).map(|_| OnceLock::new()).collect(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_duration: (0..SERIES * OUTCOMES).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Reports series `index` from now on (0 included, so an idle limit shows as 0 rather than
    /// as no data), with `capacity` counted in its limit.
    pub(super) fn report(&self, index: usize, capacity: Option<&Capacity>) {
        let cell = &self.cells[index];
        if !cell.reported.load(Ordering::Relaxed) {
            cell.reported.store(true, Ordering::Relaxed);
        }
        if let Some(capacity) = capacity {
            self.limits.register(index, capacity);
        }
    }

    pub(super) fn record_queue(&self, index: usize, ms: f64) {
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_queue[index]
            .get_or_init(|| self.queue_duration.bind(&self.series_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.queue_duration
            .record(ms, &self.series_attributes[index]);
    }

    pub(super) fn record_duration(&self, index: usize, outcome: Outcome, ms: f64) {
        let index = index * OUTCOMES + outcome.index();
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_duration[index]
            .get_or_init(|| self.duration.bind(&self.outcome_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.duration.record(ms, &self.outcome_attributes[index]);
    }

    /// Observes `value` of every reported series. Runs in the SDK's collection; cannot panic.
    pub(super) fn observe_series<T>(
        &self,
        value: impl Fn(&Cell) -> T,
        mut observe: impl FnMut(T, &[KeyValue]),
    ) {
        for (cell, attributes) in self.cells.iter().zip(self.series_attributes.iter()) {
            if cell.reported.load(Ordering::Relaxed) {
                observe(value(cell), attributes);
            }
        }
    }

    /// Observes the rejections of every reported series, by reason.
    pub(super) fn observe_rejections(&self, mut observe: impl FnMut(u64, &[KeyValue])) {
        for (index, cell) in self.cells.iter().enumerate() {
            if cell.reported.load(Ordering::Relaxed) {
                for (rejection, count) in cell.rejected.iter().enumerate() {
                    let attributes =
                        &self.rejection_attributes[index * REJECTION_COUNT + rejection];
                    observe(count.load(Ordering::Relaxed), attributes);
                }
            }
        }
    }

    /// Observes, for each series with at least one known limit, the sum of the capacities of its
    /// distinct limits, by their scope.
    pub(super) fn observe_limits(&self, mut observe: impl FnMut(i64, &[KeyValue])) {
        for (index, totals) in self.limits.totals().iter().enumerate() {
            for (scope, total) in Scope::ALL.iter().zip(totals) {
                if let Some(total) = total {
                    let value = i64::try_from(*total).unwrap_or(i64::MAX);
                    let [operation, executor] = self.series_attributes[index].clone();
                    let scope = KeyValue::new(LIMIT_SCOPE_ATTRIBUTE, scope.as_str());
                    observe(value, &[operation, executor, scope]);
                }
            }
        }
    }
}

/// A duration in the milliseconds the histograms take (a multiplication where `as_secs_f64`
/// divides: a division's latency is on every operation's path).
#[inline]
pub(crate) fn millis(duration: Duration) -> f64 {
    duration.as_secs() as f64 * 1e3 + f64::from(duration.subsec_nanos()) * 1e-6
}
