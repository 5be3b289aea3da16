//! The instruments, the live counts, and the guards that record one operation.
//!
//! Everything a request touches is built once, in [`OperationMetrics::new`]: the two histograms,
//! the attribute slices for every (operation, executor[, outcome]) in one fixed key order, and a
//! fixed table of atomics for the live counts, read by one callback per observable instrument.
//! The request path then only reads the clock, adds to atomics and records with a pre-built slice.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

#[cfg(feature = "experimental-bound-instruments")]
use opentelemetry::metrics::BoundHistogram;
use opentelemetry::metrics::{Histogram, Meter};
use opentelemetry::KeyValue;
use tokio::time::Instant;

use crate::{
    Executor, Operation, Outcome, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_INSTRUMENT,
};

const SERIES: usize = Operation::ALL.len() * Executor::ALL.len();
const _: () = assert!(
    SERIES <= u8::MAX as usize,
    "a series index must fit in a u8"
);
const OUTCOMES: usize = Outcome::ALL.len();

/// Name of the meter that [`OperationMetrics::global`] takes from the global provider.
pub const METER_NAME: &str = "tower-resources-operation";

/// The instruments and live counts behind the layer and [`resources_operation`](crate::resources_operation).
///
/// Make one per [`Meter`] and clone it: clones share the instruments and the live counts, so
/// every limit that reports through one `OperationMetrics` adds up in `queued` and `active`.
/// Two `OperationMetrics` made from the same meter would each register a callback for the same
/// series, and OpenTelemetry keeps only the last observation of a series, so one would hide the
/// other.
///
/// [`OperationMetrics::disabled`] reports nothing: the layer then only enters the limit.
#[derive(Clone, Debug)]
pub struct OperationMetrics {
    shared: Option<Arc<Shared>>,
}

impl OperationMetrics {
    /// Creates the four instruments on `meter` and registers the live-count callbacks.
    ///
    /// Call it once per meter and clone the result; see the type's docs.
    pub fn new(meter: &Meter) -> Self {
        let shared = Arc::new(Shared::new(meter));
        register_live_count(
            meter,
            &shared,
            QUEUED_INSTRUMENT,
            "Operations waiting for the concurrency limit right now.",
            |cell| &cell.queued,
        );
        register_live_count(
            meter,
            &shared,
            ACTIVE_INSTRUMENT,
            "Operations holding a permit of the concurrency limit right now.",
            |cell| &cell.active,
        );
        Self {
            shared: Some(shared),
        }
    }

    /// The metrics of the global meter provider, built once, on first use, from
    /// `opentelemetry::global::meter("tower-resources-operation")`.
    ///
    /// Install the global provider before the first call (in practice: before building the
    /// layers); instruments taken from the global meter before a provider is installed stay
    /// no-ops for good. When the standard `OTEL_SDK_DISABLED` variable is `true` this is
    /// [`OperationMetrics::disabled`].
    pub fn global() -> Self {
        static GLOBAL: OnceLock<OperationMetrics> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let sdk_disabled = std::env::var("OTEL_SDK_DISABLED")
                    .is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
                if sdk_disabled {
                    Self::disabled()
                } else {
                    Self::new(&opentelemetry::global::meter(METER_NAME))
                }
            })
            .clone()
    }

    /// Reports nothing. The layer then does exactly what tower's `ConcurrencyLimit` does: no
    /// clock read, no attribute, no atomic of its own.
    pub const fn disabled() -> Self {
        Self { shared: None }
    }

    /// Whether this records anything (false only for [`OperationMetrics::disabled`]).
    pub fn is_enabled(&self) -> bool {
        self.shared.is_some()
    }

    /// The handle one limit records through, or `None` when disabled.
    pub(crate) fn series(&self, operation: Operation, executor: Executor) -> Option<Series> {
        let shared = self.shared.as_ref()?;
        let index = operation.index() * Executor::ALL.len() + executor.index();
        let cell = &shared.cells[index];
        // Report the live counts of this series from now on, 0 included, so a dashboard shows
        // an idle limit as 0 rather than as no data.
        if !cell.reported.load(Ordering::Relaxed) {
            cell.reported.store(true, Ordering::Relaxed);
        }
        Some(Series {
            shared: Arc::clone(shared),
            index: index as u8,
        })
    }
}

/// Registers the observable up-down counter `name`, whose one callback reports `count` of every
/// reported series of `shared`.
fn register_live_count(
    meter: &Meter,
    shared: &Arc<Shared>,
    name: &'static str,
    description: &'static str,
    count: fn(&Cell) -> &AtomicI64,
) {
    let shared = Arc::clone(shared);
    meter
        .i64_observable_up_down_counter(name)
        .with_unit("{operation}")
        .with_description(description)
        .with_callback(move |observer| {
            shared.observe(count, |value, attributes| {
                observer.observe(value, attributes)
            })
        })
        .build();
}

/// Live counts of one (operation, executor), on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Cell {
    queued: AtomicI64,
    active: AtomicI64,
    reported: AtomicBool,
}

#[derive(Debug)]
struct Shared {
    queue_duration: Histogram<f64>,
    duration: Histogram<f64>,
    cells: [Cell; SERIES],
    /// `[operation, executor]` for each series, in that order.
    series_attributes: Box<[[KeyValue; 2]]>,
    /// `[operation, executor, outcome]` for each series and outcome, in that order.
    outcome_attributes: Box<[[KeyValue; 3]]>,
    /// The queue histogram bound to each series, bound on first use.
    #[cfg(feature = "experimental-bound-instruments")]
    bound_queue: Box<[OnceLock<BoundHistogram<f64>>]>,
    /// The duration histogram bound to each series and outcome, bound on first use.
    #[cfg(feature = "experimental-bound-instruments")]
    bound_duration: Box<[OnceLock<BoundHistogram<f64>>]>,
}

impl Shared {
    fn new(meter: &Meter) -> Self {
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
                series_attributes.push([operation, executor]);
            }
        }

        Self {
            queue_duration,
            duration,
            cells: Default::default(),
            series_attributes: series_attributes.into_boxed_slice(),
            outcome_attributes: outcome_attributes.into_boxed_slice(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_queue: (0..SERIES).map(|_| OnceLock::new()).collect(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_duration: (0..SERIES * OUTCOMES).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Records a queue time for series `index`.
    fn record_queue(&self, index: usize, ms: f64) {
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_queue[index]
            .get_or_init(|| self.queue_duration.bind(&self.series_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.queue_duration
            .record(ms, &self.series_attributes[index]);
    }

    /// Records a run time for series `index` that ended with `outcome`.
    fn record_duration(&self, index: usize, outcome: Outcome, ms: f64) {
        let index = index * OUTCOMES + outcome.index();
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_duration[index]
            .get_or_init(|| self.duration.bind(&self.outcome_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.duration.record(ms, &self.outcome_attributes[index]);
    }

    /// Observes one live count per reported series. Runs in the SDK's collection; cannot panic.
    fn observe(
        &self,
        count: impl Fn(&Cell) -> &AtomicI64,
        mut observe: impl FnMut(i64, &[KeyValue]),
    ) {
        for (cell, attributes) in self.cells.iter().zip(self.series_attributes.iter()) {
            if cell.reported.load(Ordering::Relaxed) {
                observe(count(cell).load(Ordering::Relaxed), attributes);
            }
        }
    }
}

/// One (operation, executor) of one [`OperationMetrics`]: what a service records through.
#[derive(Clone, Debug)]
pub(crate) struct Series {
    shared: Arc<Shared>,
    /// Position of (operation, executor) in the tables; fewer than 256 series by construction.
    index: u8,
}

impl Series {
    fn cell(&self) -> &Cell {
        &self.shared.cells[usize::from(self.index)]
    }

    /// The operation starts to wait for a permit: it counts as queued until the guard drops.
    pub(crate) fn wait(&self) -> Waiting<'_> {
        Waiting::new(self, self.start_waiting())
    }

    /// Counts one more operation as queued, and returns when it started to wait. The caller
    /// takes it back with a [`Waiting`] made from that instant (see [`Waiting::new`]).
    pub(crate) fn start_waiting(&self) -> Instant {
        self.cell().queued.fetch_add(1, Ordering::Relaxed);
        Instant::now()
    }

    /// The operation has its permit: records the queue time (0 when it never waited) and counts
    /// it as active until the returned guard finishes or drops.
    pub(crate) fn admit(&self, waited: Option<Waiting<'_>>) -> Running {
        let start = Instant::now();
        let queued_ms = match waited {
            Some(waiting) => millis(start.saturating_duration_since(waiting.since)),
            None => 0.0,
        };
        self.shared.record_queue(usize::from(self.index), queued_ms);
        self.cell().active.fetch_add(1, Ordering::Relaxed);
        Running {
            series: self.clone(),
            start,
            outcome: None,
            finished: false,
        }
    }
}

/// Counts one operation as queued while it lives. It borrows its series, so a wait costs no
/// reference count.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    series: &'a Series,
    since: Instant,
}

impl<'a> Waiting<'a> {
    /// Takes over a wait that [`Series::start_waiting`] counted at `since`.
    pub(crate) fn new(series: &'a Series, since: Instant) -> Self {
        Self { series, since }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.series.cell().queued.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One admitted operation: counts as active, and records its duration exactly once, with the
/// outcome given to [`Running::finish`], or `cancelled` if it is dropped first.
#[derive(Debug)]
pub(crate) struct Running {
    series: Series,
    start: Instant,
    /// Set by [`set_outcome`](crate::set_outcome) from inside the work; wins over a classifier.
    pub(crate) outcome: Option<Outcome>,
    finished: bool,
}

impl Running {
    /// Records the duration with `outcome` (unless [`set_outcome`](crate::set_outcome) chose one)
    /// and stops counting the operation as active. Only the first call records.
    #[inline(never)]
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let outcome = self.outcome.unwrap_or(outcome);
        let elapsed = millis(self.start.elapsed());
        self.series
            .shared
            .record_duration(usize::from(self.series.index), outcome, elapsed);
        self.series.cell().active.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether the outcome is already known, so no classifier needs to run.
    pub(crate) fn outcome_chosen(&self) -> bool {
        self.outcome.is_some()
    }
}

impl Drop for Running {
    #[inline]
    fn drop(&mut self) {
        if !self.finished {
            self.finish(Outcome::Cancelled);
        }
    }
}

fn millis(duration: std::time::Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}
