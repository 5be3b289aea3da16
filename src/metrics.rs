//! The instruments, the live counts, and the guards that record one operation.
//!
//! Everything a request touches is built once, in [`OperationMetrics::new`]: the two histograms,
//! the attribute slices for every (operation, executor[, outcome]) in one fixed key order, and a
//! fixed table of atomics for the live counts, read by one callback per observable instrument.
//! The request path then only reads the clock, adds to atomics and records with a pre-built slice.

use std::panic::{catch_unwind, AssertUnwindSafe};
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
        Some(Series(Arc::new(SeriesShared {
            shared: Arc::clone(shared),
            index,
        })))
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
    clock: Clock,
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
            clock: Clock::new(),
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
///
/// One pointer, so that a [`Running`] fits in two registers and costs the disabled path, which
/// carries an empty one, next to nothing to move.
#[derive(Clone, Debug)]
pub(crate) struct Series(Arc<SeriesShared>);

/// Aligned to a cache line: its reference count changes on every operation, from every core,
/// and must not share a line with whatever was allocated next to it.
#[derive(Debug)]
#[repr(align(64))]
struct SeriesShared {
    shared: Arc<Shared>,
    /// Position of (operation, executor) in the tables.
    index: usize,
}

impl Series {
    fn cell(&self) -> &Cell {
        &self.0.shared.cells[self.0.index]
    }

    /// The operation starts to wait for a permit: it counts as queued until the guard drops.
    pub(crate) fn wait(&self) -> Waiting<'_> {
        Waiting::new(self, self.start_waiting())
    }

    /// Counts one more operation as queued, and returns when it started to wait, in
    /// nanoseconds on this series' clock. The caller takes it back with a [`Waiting`] made from
    /// that time (see [`Waiting::new`]).
    pub(crate) fn start_waiting(&self) -> u64 {
        self.cell().queued.fetch_add(1, Ordering::Relaxed);
        self.now()
    }

    fn now(&self) -> u64 {
        self.0.shared.clock.nanos(Instant::now())
    }

    /// The operation has its permit: records the queue time (0 when it never waited) and counts
    /// it as active until the returned guard finishes or drops.
    pub(crate) fn admit(&self, waited: Option<Waiting<'_>>) -> Running {
        let start = self.now();
        let queued_ms = match waited {
            Some(waiting) => millis(start.saturating_sub(waiting.since)),
            None => 0.0,
        };
        guarded(|| self.0.shared.record_queue(self.0.index, queued_ms));
        self.cell().active.fetch_add(1, Ordering::Relaxed);
        Running {
            stamp: Stamp::new(start),
            series: Some(self.clone()),
        }
    }
}

/// Counts one operation as queued while it lives. It borrows its series, so a wait costs no
/// reference count.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    series: &'a Series,
    /// Nanoseconds on the series' clock.
    since: u64,
}

impl<'a> Waiting<'a> {
    /// Takes over a wait that [`Series::start_waiting`] counted at `since`.
    pub(crate) fn new(series: &'a Series, since: u64) -> Self {
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
///
/// Once recorded it is empty, and [`Running::EMPTY`] is the one a service with disabled metrics
/// carries: two words, the first of them null, so that path only moves and tests a pointer.
#[derive(Debug)]
pub(crate) struct Running {
    /// `None` once recorded, or when there is nothing to record.
    series: Option<Series>,
    stamp: Stamp,
}

impl Running {
    /// Nothing to record.
    pub(crate) const EMPTY: Self = Self {
        series: None,
        stamp: Stamp(0),
    };

    /// Whether the duration is still to be recorded.
    #[inline]
    pub(crate) fn is_recording(&self) -> bool {
        self.series.is_some()
    }

    /// Records the duration with `outcome` (unless [`set_outcome`](crate::set_outcome) chose one)
    /// and stops counting the operation as active. Only the first call records.
    #[inline]
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if let Some(series) = self.series.take() {
            record_end(series, self.stamp, outcome);
        }
    }

    /// The outcome [`set_outcome`](crate::set_outcome) chose, if it did.
    pub(crate) fn chosen_outcome(&self) -> Option<Outcome> {
        self.stamp.outcome()
    }

    /// Keeps the outcome [`set_outcome`](crate::set_outcome) chose, to win over a classifier.
    pub(crate) fn choose_outcome(&mut self, outcome: Option<Outcome>) {
        self.stamp = self.stamp.with_outcome(outcome);
    }
}

/// Records the end of an operation admitted at `stamp`. Out of line, so that what inlines into
/// the request path is only the test for an empty [`Running`].
///
/// `extern "C"` because such a function cannot unwind, and the compiler knows it: a drop that
/// may call this one then needs no unwinding path of its own, stays as small as tower's, and
/// inlines like it (the response future's drop, on every request, metrics on or off). A panic
/// in the meter is caught inside, as it must be anyway: metrics never panic into a request.
#[inline(never)]
#[allow(improper_ctypes_definitions)] // only Rust calls it: the ABI is here for "cannot unwind"
extern "C" fn record_end(series: Series, stamp: Stamp, outcome: Outcome) {
    series.cell().active.fetch_sub(1, Ordering::Relaxed);
    let outcome = stamp.outcome().unwrap_or(outcome);
    let elapsed = series.now().saturating_sub(stamp.nanos());
    // `series` moves in, so that its drop runs inside the guard too.
    guarded(move || {
        series
            .0
            .shared
            .record_duration(series.0.index, outcome, millis(elapsed))
    });
}

/// Runs `record`, a call into the meter: a meter that panics costs its measurement, not the
/// request that made it.
fn guarded(record: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(record));
}

impl Drop for Running {
    #[inline]
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}

/// When an operation started, as nanoseconds on its metrics' [`Clock`], and the outcome chosen
/// for it so far, in one word.
#[derive(Clone, Copy, Debug)]
struct Stamp(u64);

impl Stamp {
    /// Low bits: 0 for no outcome chosen, else 1 + the outcome's index.
    const OUTCOME_BITS: u32 = 3;
    const OUTCOME_MASK: u64 = (1 << Self::OUTCOME_BITS) - 1;

    fn new(nanos: u64) -> Self {
        Self(nanos << Self::OUTCOME_BITS)
    }

    fn nanos(self) -> u64 {
        self.0 >> Self::OUTCOME_BITS
    }

    fn outcome(self) -> Option<Outcome> {
        let code = (self.0 & Self::OUTCOME_MASK) as usize;
        code.checked_sub(1)
            .and_then(|index| Outcome::ALL.get(index).copied())
    }

    fn with_outcome(self, outcome: Option<Outcome>) -> Self {
        let code = outcome.map_or(0, |outcome| outcome.index() as u64 + 1);
        Self((self.0 & !Self::OUTCOME_MASK) | code)
    }
}

const _: () = assert!(
    OUTCOMES < (1 << Stamp::OUTCOME_BITS),
    "every outcome code must fit in a stamp"
);

/// Turns instants into nanoseconds from an origin set well before the metrics were made.
///
/// The origin is a year ([`Clock::LEAD`]) before the clock is made, where the platform's
/// instants reach that far back, so that an instant read on a paused tokio clock that runs
/// behind the one the metrics were made under (tests) still counts from the origin. Sixty-one
/// bits of nanoseconds leave some seventy years after it.
#[derive(Debug)]
struct Clock {
    origin: Instant,
}

impl Clock {
    /// How far before its making the clock's origin is set.
    const LEAD: std::time::Duration = std::time::Duration::from_secs(366 * 24 * 60 * 60);

    fn new() -> Self {
        let now = Instant::now();
        Self {
            origin: now.checked_sub(Self::LEAD).unwrap_or(now),
        }
    }

    fn nanos(&self, instant: Instant) -> u64 {
        let since = instant.saturating_duration_since(self.origin);
        // 2^61 ns is 73 years: saturate rather than wrap past it.
        u64::try_from(since.as_nanos())
            .unwrap_or(u64::MAX)
            .min(u64::MAX >> Stamp::OUTCOME_BITS)
    }
}

/// Nanoseconds as the milliseconds the histograms take.
fn millis(nanos: u64) -> f64 {
    nanos as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_keeps_its_time_and_outcome_apart() {
        let stamp = Stamp::new(u64::MAX >> Stamp::OUTCOME_BITS);
        assert_eq!(stamp.outcome(), None);
        for outcome in Outcome::ALL {
            let chosen = stamp.with_outcome(Some(*outcome));
            assert_eq!(chosen.outcome(), Some(*outcome));
            assert_eq!(chosen.nanos(), stamp.nanos());
            assert_eq!(chosen.with_outcome(None).outcome(), None);
        }
    }

    #[test]
    fn the_clock_counts_from_before_it_was_made() {
        let before = Instant::now();
        let clock = Clock::new();
        assert!(clock.nanos(before) > 0);
        let later = before + std::time::Duration::from_millis(5);
        assert_eq!(clock.nanos(later) - clock.nanos(before), 5_000_000);
    }
}
