//! The instruments, the live counts, and where each operation's numbers are recorded.
//!
//! Everything a request touches is built once, in [`OperationMetrics::new`]: the two histograms,
//! the attribute slices for every (operation, executor[, outcome | rejection]) in one fixed key
//! order, a table of atomics for the live counts, rejections and abandoned waits (read by the
//! observable instruments' callbacks), and one series handle per (operation, executor). The
//! request path only reads the clock, adds to atomics and records with a pre-built slice.
//!
//! This module also holds the names of the three instruments this crate adds to NeMo Gym's.

mod capacity;

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

#[cfg(feature = "experimental-bound-instruments")]
use opentelemetry::metrics::BoundHistogram;
use opentelemetry::metrics::{Histogram, Meter, MeterProvider};
use opentelemetry::KeyValue;
use tokio::time::Instant;

pub use capacity::Capacity;
pub(crate) use capacity::Reading;

use crate::adaptive::Controller;
use crate::diagnostics::{self, Mistake};
use crate::guard::guarded;
use crate::{
    Executor, Operation, Outcome, Rejection, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT,
    EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

/// Name of the meter that [`OperationMetrics::global`] takes from the global provider.
pub const METER_NAME: &str = "tower-resources-operation";

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
/// Attribute key of the [`Rejection`], on [`REJECTED_INSTRUMENT`] only.
pub const REJECTION_ATTRIBUTE: &str = "nemo.gym.resources.operation.rejection";
/// The values of [`REJECTION_ATTRIBUTE`], one per [`Rejection`].
pub const REJECTIONS: &[&str] = &["queue_full", "queue_timeout", "unavailable"];

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
/// Observable counter, `{operation}`: operations a named limit admitted without itself because
/// it could not reach its store and was told to fail open, by [`LIMIT_ATTRIBUTE`]. Reported by
/// limits that can fail open (the [fleet limit](crate::limit::redis)). An addition of this
/// crate.
pub const LIMIT_FAILED_OPEN_INSTRUMENT: &str = "gym.resources.limit.failed_open";
/// Observable counter, `{operation}`: leases of a named limit found lost while their operations
/// ran (the store restarted, or the process paused past the lease's time to live), by
/// [`LIMIT_ATTRIBUTE`]. Reported by limits of leases (the [fleet limit](crate::limit::redis)).
/// An addition of this crate.
pub const LIMIT_LEASES_LOST_INSTRUMENT: &str = "gym.resources.limit.leases_lost";
/// Attribute key of a limit's name, on the `gym.resources.limit.*` instruments only.
pub const LIMIT_ATTRIBUTE: &str = "nemo.gym.resources.limit";

const SERIES: usize = Operation::ALL.len() * Executor::ALL.len();
const OUTCOMES: usize = Outcome::ALL.len();
const REJECTION_COUNT: usize = Rejection::ALL.len();

/// The instruments and live counts behind the layer and [`resources_operation`](crate::resources_operation):
/// NeMo Gym's `_OperationMetrics`, one set per meter.
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
    inner: Option<Arc<Metrics>>,
}

#[derive(Debug)]
struct Metrics {
    shared: Arc<Shared>,
    /// One handle per (operation, executor).
    series: Box<[Series]>,
}

/// `Metrics` alive now: more than one is worth a word (see [`Mistake::SeveralMetrics`]).
static LIVE: AtomicUsize = AtomicUsize::new(0);

impl Drop for Metrics {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

impl OperationMetrics {
    /// Creates the instruments on `meter` and registers the callbacks of the observable ones.
    ///
    /// Call it once per meter and clone the result; see the type's docs. A second one made while
    /// another is alive is reported once, as a `tracing` warning: if both came from one meter,
    /// their live counts hide each other.
    pub fn new(meter: &Meter) -> Self {
        if LIVE.fetch_add(1, Ordering::Relaxed) > 0 {
            diagnostics::report(Mistake::SeveralMetrics, "");
        }
        let shared = Arc::new(Shared::new(meter));
        register_callbacks(meter, &shared);
        let series = (0..SERIES)
            .map(|index| {
                Series(Arc::new(SeriesCell {
                    shared: Arc::clone(&shared),
                    index,
                    controller: None,
                }))
            })
            .collect();
        Self {
            inner: Some(Arc::new(Metrics { shared, series })),
        }
    }

    /// The metrics of the global meter provider installed now: the meter
    /// [`METER_NAME`] of `opentelemetry::global::meter_provider()`.
    ///
    /// OpenTelemetry's global meter is a snapshot: instruments made from it report to the provider
    /// that was installed when they were made, for good. So this is decided when it is called, and
    /// every call made under one provider returns the same metrics. The layer's default and the
    /// free [`resources_operation`](crate::resources_operation) call it as late as they can: a
    /// layer when one of its services first serves a request, the free function on every call.
    /// When the standard `OTEL_SDK_DISABLED` variable is `true` this is
    /// [`OperationMetrics::disabled`].
    ///
    /// Until a provider is installed, the global one is OpenTelemetry's no-op provider: then this
    /// is [`OperationMetrics::disabled`] too, and says so once, as a `tracing` warning, so that a
    /// server without metrics is not mistaken for an idle one. `global().is_enabled()` is the
    /// check to call at startup:
    ///
    /// ```
    /// use tower_resources_operation::OperationMetrics;
    ///
    /// // No provider installed yet: nothing would be recorded.
    /// assert!(!OperationMetrics::global().is_enabled());
    /// ```
    pub fn global() -> Self {
        static SDK_DISABLED: OnceLock<bool> = OnceLock::new();
        let disabled = *SDK_DISABLED.get_or_init(|| {
            std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"))
        });
        if disabled {
            return Self::disabled();
        }
        type Provider = Arc<dyn MeterProvider + Send + Sync>;
        static BY_PROVIDER: RwLock<Vec<(Provider, OperationMetrics)>> = RwLock::new(Vec::new());
        let provider = opentelemetry::global::meter_provider();
        // OpenTelemetry's no-op provider, in place until one is installed, is the only provider
        // of size zero: one that records keeps its pipeline somewhere.
        if std::mem::size_of_val(&*provider) == 0 {
            diagnostics::report(Mistake::NoGlobalProvider, "");
            return Self::disabled();
        }
        let find = |known: &[(Provider, OperationMetrics)]| {
            known
                .iter()
                .find(|(p, _)| Arc::ptr_eq(p, &provider))
                .map(|(_, metrics)| metrics.clone())
        };
        if let Some(metrics) = find(&BY_PROVIDER.read().unwrap_or_else(|p| p.into_inner())) {
            return metrics;
        }
        let mut known = BY_PROVIDER.write().unwrap_or_else(|p| p.into_inner());
        if let Some(metrics) = find(&known) {
            return metrics;
        }
        let metrics = Self::new(&provider.meter(METER_NAME));
        known.push((provider, metrics.clone()));
        metrics
    }

    /// Reports nothing. The layer then does what tower's `ConcurrencyLimit` does: no clock read,
    /// no attribute, no atomic of its own.
    pub const fn disabled() -> Self {
        Self { inner: None }
    }

    /// Whether this records anything (false only for [`OperationMetrics::disabled`]).
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The series of (`operation`, `executor`), reported from now on, with `capacity` counted
    /// in its limit; `None` when disabled. An adaptive limit's operations record through a
    /// series of their own that feeds its controller, also when disabled: with nothing else to
    /// record, they record into the controller alone.
    #[inline]
    pub(crate) fn series(
        &self,
        operation: Operation,
        executor: Executor,
        capacity: Option<&Capacity>,
    ) -> Option<Cow<'_, Series>> {
        let index = operation.index() * Executor::ALL.len() + executor.index();
        let controlled = capacity.and_then(Capacity::controlled);
        let Some(metrics) = self.inner.as_deref() else {
            return controlled.map(|controlled| Cow::Owned(controlled.series(silent(), index)));
        };
        metrics.shared.report(index, capacity);
        Some(match controlled {
            None => Cow::Borrowed(&metrics.series[index]),
            Some(controlled) => Cow::Owned(controlled.series(&metrics.shared, index)),
        })
    }
}

/// Instruments that record nothing: the metrics of an adaptive limit's operations when metrics
/// are disabled, whose only reader is the controller.
fn silent() -> &'static Arc<Shared> {
    static SILENT: OnceLock<Arc<Shared>> = OnceLock::new();
    SILENT.get_or_init(|| {
        let meter = opentelemetry::metrics::NoopMeterProvider::new().meter(METER_NAME);
        Arc::new(Shared::new(&meter))
    })
}

/// An adaptive limit's controller, and the series its operations record through: one per
/// (operation, executor), made once for the first metrics that report them (other metrics get
/// a series made for the operation).
pub(crate) struct Controlled {
    controller: Arc<Controller>,
    metrics: OnceLock<Arc<Shared>>,
    series: [OnceLock<Series>; SERIES],
}

impl Controlled {
    fn new(controller: Arc<Controller>) -> Self {
        Self {
            controller,
            metrics: OnceLock::new(),
            series: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    pub(crate) fn controller(&self) -> &Controller {
        &self.controller
    }

    /// The series `index` of `shared`, feeding this controller.
    fn series(&self, shared: &Arc<Shared>, index: usize) -> Series {
        let make = || {
            Series(Arc::new(SeriesCell {
                shared: Arc::clone(shared),
                index,
                controller: Some(Arc::clone(&self.controller)),
            }))
        };
        let first = self.metrics.get_or_init(|| Arc::clone(shared));
        if Arc::ptr_eq(first, shared) {
            self.series[index].get_or_init(make).clone()
        } else {
            make()
        }
    }
}

impl std::fmt::Debug for Controlled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controlled")
            .field("controller", &self.controller)
            .finish_non_exhaustive()
    }
}

/// Where a layer takes its metrics from.
#[derive(Clone, Debug)]
pub(crate) enum MetricsSource {
    /// [`OperationMetrics::global`], resolved when a service of the layer first serves.
    Global,
    /// Metrics given to the layer.
    Given(OperationMetrics),
}

impl MetricsSource {
    /// The metrics themselves, resolving the global ones now.
    pub(crate) fn resolve(&self) -> OperationMetrics {
        match self {
            MetricsSource::Given(metrics) => metrics.clone(),
            MetricsSource::Global => OperationMetrics::global(),
        }
    }
}

/// One (operation, executor) of one [`OperationMetrics`]: what an operation records through.
///
/// One pointer. Its cell is aligned to a cache line: its reference count changes on every
/// operation of a layer, from every core.
#[derive(Clone, Debug)]
pub(crate) struct Series(Arc<SeriesCell>);

#[derive(Debug)]
#[repr(align(64))]
struct SeriesCell {
    shared: Arc<Shared>,
    index: usize,
    /// An adaptive limit's controller, which this series' operations feed.
    controller: Option<Arc<Controller>>,
}

impl Series {
    #[inline]
    fn parts(&self) -> (&Shared, &Cell, usize) {
        let cell = &*self.0;
        (&cell.shared, &cell.shared.cells[cell.index], cell.index)
    }

    /// Now, on tokio's clock (so that a paused clock is followed); `None` if it cannot be read
    /// (tokio's paused clock panics once its runtime's thread-locals are gone).
    #[inline]
    pub(crate) fn now(&self) -> Option<Instant> {
        guarded(Instant::now)
    }

    /// One more operation of the series waits.
    pub(crate) fn start_waiting(&self) {
        self.parts().1.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// An operation got its permit, after waiting `queued` if it `waited` (counted in
    /// `queued` until now).
    #[inline]
    pub(crate) fn admit(&self, waited: bool, queued: Duration) {
        let (shared, cell, index) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.active.fetch_add(1, Ordering::Relaxed);
        if let Some(controller) = &self.0.controller {
            controller.admitted();
        }
        guarded(|| shared.record_queue(index, millis(queued)));
    }

    /// An operation was turned away, after waiting or not.
    pub(crate) fn reject(&self, rejection: Rejection, waited: bool) {
        let (_, cell, _) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.rejected[rejection.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(controller) = &self.0.controller {
            controller.rejected();
        }
    }

    /// A caller went away while it waited.
    pub(crate) fn abandon(&self, waited: bool) {
        let (_, cell, _) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted operation that ran for `ran` ended with `outcome`, at `now`: recorded, and
    /// fed to its limit's controller if the limit is adaptive.
    #[inline]
    pub(crate) fn end(&self, outcome: Outcome, ran: Duration, now: Option<Instant>) {
        let (shared, cell, index) = self.parts();
        cell.active.fetch_sub(1, Ordering::Relaxed);
        guarded(|| shared.record_duration(index, outcome, millis(ran)));
        if let Some(controller) = &self.0.controller {
            controller.ended(outcome, ran, now);
        }
    }
}

/// The live counts and tallies of one (operation, executor), on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Cell {
    queued: AtomicI64,
    active: AtomicI64,
    abandoned: AtomicU64,
    rejected: [AtomicU64; REJECTION_COUNT],
    /// Whether the series is reported (from the first limit that uses it on).
    reported: AtomicBool,
}

struct Shared {
    queue_duration: Histogram<f64>,
    duration: Histogram<f64>,
    cells: [Cell; SERIES],
    /// `[operation, executor]` for each series, in that order.
    series_attributes: Box<[[KeyValue; 2]]>,
    /// `[operation, executor, outcome]` for each series and outcome, in that order.
    outcome_attributes: Box<[[KeyValue; 3]]>,
    /// `[operation, executor, rejection]` for each series and rejection, in that order.
    rejection_attributes: Box<[[KeyValue; 3]]>,
    limits: capacity::Registry<SERIES>,
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
            limits: capacity::Registry::new(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_queue: (0..SERIES).map(|_| OnceLock::new()).collect(),
            #[cfg(feature = "experimental-bound-instruments")]
            bound_duration: (0..SERIES * OUTCOMES).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Reports series `index` from now on (0 included, so an idle limit shows as 0 rather than
    /// as no data), with `capacity` counted in its limit.
    fn report(&self, index: usize, capacity: Option<&Capacity>) {
        let cell = &self.cells[index];
        if !cell.reported.load(Ordering::Relaxed) {
            cell.reported.store(true, Ordering::Relaxed);
        }
        if let Some(capacity) = capacity {
            self.limits.register(index, capacity);
        }
    }

    fn record_queue(&self, index: usize, ms: f64) {
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_queue[index]
            .get_or_init(|| self.queue_duration.bind(&self.series_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.queue_duration
            .record(ms, &self.series_attributes[index]);
    }

    fn record_duration(&self, index: usize, outcome: Outcome, ms: f64) {
        let index = index * OUTCOMES + outcome.index();
        #[cfg(feature = "experimental-bound-instruments")]
        self.bound_duration[index]
            .get_or_init(|| self.duration.bind(&self.outcome_attributes[index]))
            .record(ms);
        #[cfg(not(feature = "experimental-bound-instruments"))]
        self.duration.record(ms, &self.outcome_attributes[index]);
    }

    /// Observes `value` of every reported series. Runs in the SDK's collection; cannot panic.
    fn observe_series<T>(
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
    fn observe_rejections(&self, mut observe: impl FnMut(u64, &[KeyValue])) {
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
    /// distinct limits.
    fn observe_limits(&self, mut observe: impl FnMut(i64, &[KeyValue])) {
        for (index, total) in self.limits.totals().iter().enumerate() {
            if let Some(total) = total {
                let value = i64::try_from(*total).unwrap_or(i64::MAX);
                observe(value, &self.series_attributes[index]);
            }
        }
    }
}

/// Registers the observable instruments, each read by one callback over every reported series.
fn register_callbacks(meter: &Meter, shared: &Arc<Shared>) {
    let live = |name: &'static str, description: &'static str, count: fn(&Cell) -> &AtomicI64| {
        let shared = Arc::clone(shared);
        meter
            .i64_observable_up_down_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(move |observer| {
                shared.observe_series(
                    |cell| count(cell).load(Ordering::Relaxed),
                    |value, attributes| observer.observe(value, attributes),
                )
            })
            .build();
    };
    live(
        QUEUED_INSTRUMENT,
        "Operations waiting for the concurrency limit right now.",
        |cell| &cell.queued,
    );
    live(
        ACTIVE_INSTRUMENT,
        "Operations holding a permit of the concurrency limit right now.",
        |cell| &cell.active,
    );

    let limits = Arc::clone(shared);
    meter
        .i64_observable_gauge(LIMIT_INSTRUMENT)
        .with_unit("{operation}")
        .with_description(
            "Operations that could hold a permit at once: the capacities of the limits the series draws from.",
        )
        .with_callback(move |observer| {
            limits.observe_limits(|value, attributes| observer.observe(value, attributes))
        })
        .build();

    let named = |name: &'static str, description: &'static str, value: fn(&Reading) -> usize| {
        let shared = Arc::clone(shared);
        let callback = move |observer: &dyn opentelemetry::metrics::AsyncInstrument<i64>| {
            for (limit, reading) in shared.limits.named() {
                let value = i64::try_from(value(&reading)).unwrap_or(i64::MAX);
                observer.observe(value, &[KeyValue::new(LIMIT_ATTRIBUTE, limit)]);
            }
        };
        (name, description, callback)
    };
    let (name, description, callback) = named(
        LIMIT_CAPACITY_INSTRUMENT,
        "Operations a named limit admits at once.",
        |reading| reading.capacity,
    );
    meter
        .i64_observable_gauge(name)
        .with_unit("{operation}")
        .with_description(description)
        .with_callback(callback)
        .build();
    for (name, description, value) in [
        (
            LIMIT_ACTIVE_INSTRUMENT,
            "Operations holding a place of a named limit right now.",
            (|reading| reading.active) as fn(&Reading) -> usize,
        ),
        (
            LIMIT_QUEUED_INSTRUMENT,
            "Operations waiting for a named limit right now.",
            |reading| reading.queued,
        ),
    ] {
        let (name, description, callback) = named(name, description, value);
        meter
            .i64_observable_up_down_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(callback)
            .build();
    }

    for (name, description, value) in [
        (
            LIMIT_BASELINE_INSTRUMENT,
            "The run time a named adaptive limit takes as normal, at low load.",
            (|reading| reading.baseline) as fn(&Reading) -> Option<Duration>,
        ),
        (
            LIMIT_ESTIMATE_INSTRUMENT,
            "The recent run time a named adaptive limit compares with its baseline.",
            |reading| reading.estimate,
        ),
    ] {
        let shared = Arc::clone(shared);
        meter
            .f64_observable_gauge(name)
            .with_unit("ms")
            .with_description(description)
            .with_callback(move |observer| {
                for (limit, reading) in shared.limits.named() {
                    if let Some(run_time) = value(&reading) {
                        observer
                            .observe(millis(run_time), &[KeyValue::new(LIMIT_ATTRIBUTE, limit)]);
                    }
                }
            })
            .build();
    }

    for (name, description, count) in [
        (
            LIMIT_FAILED_OPEN_INSTRUMENT,
            "Operations a named limit admitted without itself, failing open, because it could not reach its store.",
            (|reading| reading.failed_open) as fn(&Reading) -> Option<u64>,
        ),
        (
            LIMIT_LEASES_LOST_INSTRUMENT,
            "Leases of a named limit found lost while their operations ran.",
            |reading| reading.leases_lost,
        ),
    ] {
        let shared = Arc::clone(shared);
        meter
            .u64_observable_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(move |observer| {
                for (limit, reading) in shared.limits.named() {
                    if let Some(count) = count(&reading) {
                        observer.observe(count, &[KeyValue::new(LIMIT_ATTRIBUTE, limit)]);
                    }
                }
            })
            .build();
    }

    let rejected = Arc::clone(shared);
    meter
        .u64_observable_counter(REJECTED_INSTRUMENT)
        .with_unit("{operation}")
        .with_description("Operations turned away without a permit, by reason.")
        .with_callback(move |observer| {
            rejected.observe_rejections(|value, attributes| observer.observe(value, attributes))
        })
        .build();

    let abandoned = Arc::clone(shared);
    meter
        .u64_observable_counter(ABANDONED_INSTRUMENT)
        .with_unit("{operation}")
        .with_description("Operations whose caller went away while they waited for a permit.")
        .with_callback(move |observer| {
            abandoned.observe_series(
                |cell| cell.abandoned.load(Ordering::Relaxed),
                |value, attributes| observer.observe(value, attributes),
            )
        })
        .build();
}

/// A duration in the milliseconds the histograms take.
fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}
