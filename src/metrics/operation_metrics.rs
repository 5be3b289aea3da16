//! [`OperationMetrics`]: one set of instruments and live counts per meter, and where a layer
//! takes its metrics from.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, Weak};

use opentelemetry::metrics::{Meter, MeterProvider};

use super::callbacks::register_callbacks;
use super::instruments::{Shared, SERIES};
use super::series::Series;
use crate::attributes::{Executor, Operation};
use crate::diagnostics::{self, Mistake};
use crate::limit::Capacity;
use crate::names::METER_NAME;

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
    /// Whether the meter kept the observable instruments' callbacks: `false` for a meter that
    /// can never report (OpenTelemetry's no-op one, or a provider without a reader).
    reports: bool,
    /// Whether it counts in [`LIVE`].
    counted: AtomicBool,
}

impl Metrics {
    /// Counts it among the live metrics; a second one alive is worth a word.
    fn count(&self) {
        self.counted.store(true, Ordering::Relaxed);
        if LIVE.fetch_add(1, Ordering::Relaxed) > 0 {
            diagnostics::report(Mistake::SeveralMetrics, String::new);
        }
    }
}

/// `Metrics` alive now: more than one is worth a word (see [`Mistake::SeveralMetrics`]).
static LIVE: AtomicUsize = AtomicUsize::new(0);

impl Drop for Metrics {
    fn drop(&mut self) {
        if *self.counted.get_mut() {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl OperationMetrics {
    /// Creates the instruments on `meter` and registers the callbacks of the observable ones.
    ///
    /// Call it once per meter and clone the result; see the type's docs. A second one made while
    /// another is alive is reported once, as a `tracing` warning: if both came from one meter,
    /// their live counts hide each other.
    pub fn new(meter: &Meter) -> Self {
        let metrics = Self::build(meter);
        if let Some(inner) = &metrics.inner {
            inner.count();
        }
        metrics
    }

    /// The instruments on `meter`, not yet counted among the live ones.
    fn build(meter: &Meter) -> Self {
        let shared = Arc::new(Shared::new(meter));
        register_callbacks(meter, &shared);
        // Whether the meter can ever report. OpenTelemetry has no way to ask (a `Meter` does not
        // say whether it is a no-op), so this asks what the meter did with the callbacks just
        // registered, each of which holds a clone of `shared`: a meter that can report keeps
        // them, and OpenTelemetry's no-op meter drops them at once. Read once, here, never on
        // a request's path.
        let reports = Arc::strong_count(&shared) > 1;
        let series = (0..SERIES)
            .map(|index| Series::new(&shared, index))
            .collect();
        Self {
            inner: Some(Arc::new(Metrics {
                shared,
                series,
                reports,
                counted: AtomicBool::new(false),
            })),
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
        // The metrics of each provider installed globally, while it lives: held weakly, so a
        // provider that another replaced is let go, and its entry with it.
        type Provider = Weak<dyn MeterProvider + Send + Sync>;
        static BY_PROVIDER: RwLock<Vec<(Provider, OperationMetrics)>> = RwLock::new(Vec::new());
        let provider = opentelemetry::global::meter_provider();
        let is_it = |known: &Provider| {
            known.strong_count() > 0 && std::ptr::addr_eq(known.as_ptr(), Arc::as_ptr(&provider))
        };
        let find = |known: &[(Provider, OperationMetrics)]| {
            known
                .iter()
                .find(|(p, _)| is_it(p))
                .map(|(_, metrics)| metrics.clone())
        };
        if let Some(metrics) = find(&BY_PROVIDER.read().unwrap_or_else(|p| p.into_inner())) {
            return metrics;
        }
        let mut known = BY_PROVIDER.write().unwrap_or_else(|p| p.into_inner());
        if let Some(metrics) = find(&known) {
            return metrics;
        }
        let metrics = Self::build(&provider.meter(METER_NAME));
        // OpenTelemetry's no-op provider, in place until one is installed, keeps no callback.
        let metrics = match &metrics.inner {
            Some(inner) if inner.reports => {
                inner.count();
                metrics
            }
            _ => {
                diagnostics::report(Mistake::NoGlobalProvider, String::new);
                Self::disabled()
            }
        };
        known.retain(|(p, _)| p.strong_count() > 0);
        known.push((Arc::downgrade(&provider), metrics.clone()));
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
    /// in its limit; `None` when disabled.
    #[inline]
    pub(crate) fn series(
        &self,
        operation: Operation,
        executor: Executor,
        capacity: Option<&Capacity>,
    ) -> Option<&Series> {
        let index = operation.index() * Executor::ALL.len() + executor.index();
        let metrics = self.inner.as_deref()?;
        metrics.shared.report(index, capacity);
        Some(&metrics.series[index])
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
