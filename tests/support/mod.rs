//! What the tests share. Here: a real OpenTelemetry SDK pipeline (an in-memory exporter behind a
//! periodic reader that never fires on its own, read back with `force_flush`), waits with a
//! safety net, and the small services and checks many tests use. In the modules: axum servers
//! and hyper clients (`http`), a tonic server and clients (`grpc`), a real Prometheus
//! (`prometheus`), a real Redis (`redis_server`), and the drivers of the reliability tests
//! (`reliability`).
#![allow(dead_code, unreachable_pub)]

#[cfg(feature = "tonic")]
pub mod grpc;
pub mod http;
pub mod prometheus;
pub mod reliability;
pub mod simulation;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{service_fn, BoxError, Service, ServiceExt as _};
use tower_resources_operation::metrics::ABANDONED_INSTRUMENT;
use tower_resources_operation::{
    set_outcome, Limit, OperationMetrics, Outcome, ACTIVE_INSTRUMENT, OPERATION_ATTRIBUTE,
    QUEUED_INSTRUMENT,
};

/// Attributes of one data point, as `key -> value` strings.
pub type Attributes = BTreeMap<String, String>;

/// One exported histogram data point.
#[derive(Clone, Debug)]
pub struct HistogramPoint {
    pub attributes: Attributes,
    pub count: u64,
    pub sum: f64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub bounds: Vec<f64>,
    pub bucket_counts: Vec<u64>,
}

/// One exported sum (up-down counter) data point.
#[derive(Clone, Debug)]
pub struct SumPoint {
    pub attributes: Attributes,
    pub value: i64,
}

impl SumPoint {
    fn new<'a>(attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>, value: i64) -> Self {
        Self {
            attributes: self::attributes(attributes),
            value,
        }
    }
}

/// One exported f64 gauge data point.
#[derive(Clone, Debug)]
pub struct F64Point {
    pub attributes: Attributes,
    pub value: f64,
}

/// What an instrument exported, owned.
#[derive(Clone, Debug)]
pub enum Data {
    Histogram(Vec<HistogramPoint>),
    /// An i64 sum (the live counts) or a u64 one (the counters), as i64.
    Sum {
        monotonic: bool,
        points: Vec<SumPoint>,
    },
    /// An i64 gauge (the limit).
    Gauge(Vec<SumPoint>),
    /// An f64 gauge (an adaptive limit's run times).
    GaugeF64(Vec<F64Point>),
    Other(String),
}

/// One exported instrument.
#[derive(Clone, Debug)]
pub struct Exported {
    pub name: String,
    pub unit: String,
    pub description: String,
    pub data: Data,
}

/// A meter provider with an in-memory exporter, and the crate's metrics on one of its meters.
pub struct Telemetry {
    pub provider: SdkMeterProvider,
    pub exporter: InMemoryMetricExporter,
    pub metrics: OperationMetrics,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let (provider, exporter) = pipeline();
        let metrics = OperationMetrics::new(&provider.meter("tests"));
        Self {
            provider,
            exporter,
            metrics,
        }
    }

    /// Every instrument as of now (cumulative).
    pub fn collect(&self) -> Vec<Exported> {
        self.exporter.reset();
        self.provider.force_flush().expect("force_flush");
        let exported = self
            .exporter
            .get_finished_metrics()
            .expect("finished metrics");
        let Some(last) = exported.last() else {
            return Vec::new();
        };
        last.scope_metrics()
            .flat_map(|scope| scope.metrics())
            .map(|m| Exported {
                name: m.name().to_owned(),
                unit: m.unit().to_owned(),
                description: m.description().to_owned(),
                data: match m.data() {
                    AggregatedMetrics::F64(MetricData::Histogram(h)) => Data::Histogram(
                        h.data_points()
                            .map(|p| HistogramPoint {
                                attributes: attributes(p.attributes()),
                                count: p.count(),
                                sum: p.sum(),
                                min: p.min(),
                                max: p.max(),
                                bounds: p.bounds().collect(),
                                bucket_counts: p.bucket_counts().collect(),
                            })
                            .collect(),
                    ),
                    AggregatedMetrics::I64(MetricData::Sum(s)) => Data::Sum {
                        monotonic: s.is_monotonic(),
                        points: s
                            .data_points()
                            .map(|p| SumPoint::new(p.attributes(), p.value()))
                            .collect(),
                    },
                    AggregatedMetrics::U64(MetricData::Sum(s)) => Data::Sum {
                        monotonic: s.is_monotonic(),
                        points: s
                            .data_points()
                            .map(|p| {
                                let value = i64::try_from(p.value()).expect("a count that fits");
                                SumPoint::new(p.attributes(), value)
                            })
                            .collect(),
                    },
                    AggregatedMetrics::I64(MetricData::Gauge(g)) => Data::Gauge(
                        g.data_points()
                            .map(|p| SumPoint::new(p.attributes(), p.value()))
                            .collect(),
                    ),
                    AggregatedMetrics::F64(MetricData::Gauge(g)) => Data::GaugeF64(
                        g.data_points()
                            .map(|p| F64Point {
                                attributes: attributes(p.attributes()),
                                value: p.value(),
                            })
                            .collect(),
                    ),
                    other => Data::Other(format!("{other:?}")),
                },
            })
            .collect()
    }

    /// What the instrument `name` exported (nothing, if it exported nothing).
    fn data_of(&self, name: &str) -> Vec<Data> {
        self.collect()
            .into_iter()
            .filter(|m| m.name == name)
            .map(|m| m.data)
            .collect()
    }

    /// The data points of histogram `name` (empty if it exported nothing).
    pub fn histogram(&self, name: &str) -> Vec<HistogramPoint> {
        self.data_of(name)
            .into_iter()
            .flat_map(|data| match data {
                Data::Histogram(points) => points,
                other => panic!("{name} is not an f64 histogram: {other:?}"),
            })
            .collect()
    }

    /// The data points of the observable instrument `name`: a live count, a counter or the
    /// limit gauge.
    pub fn live(&self, name: &str) -> Vec<SumPoint> {
        self.data_of(name)
            .into_iter()
            .flat_map(|data| match data {
                Data::Sum { points, .. } | Data::Gauge(points) => points,
                other => panic!("{name} is not a sum or a gauge: {other:?}"),
            })
            .collect()
    }

    /// The value of the f64 gauge `name` at the point whose attributes include every pair in
    /// `filter`, if it has one.
    pub fn gauge_f64(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.data_of(name).into_iter().find_map(|data| match data {
            Data::GaugeF64(points) => points
                .into_iter()
                .find(|p| matches(&p.attributes, filter))
                .map(|p| p.value),
            other => panic!("{name} is not an f64 gauge: {other:?}"),
        })
    }

    /// Sum of the histogram's counts over points whose attributes include every pair in `filter`.
    pub fn count(&self, name: &str, filter: &[(&str, &str)]) -> u64 {
        self.points(name, filter).iter().map(|p| p.count).sum()
    }

    /// Sum of the observable instrument `name` over points whose attributes include every pair
    /// in `filter` (0 if none does).
    pub fn live_value(&self, name: &str, filter: &[(&str, &str)]) -> i64 {
        self.live(name)
            .iter()
            .filter(|p| matches(&p.attributes, filter))
            .map(|p| p.value)
            .sum()
    }
}

/// Whether `attributes` include every `(key, value)` of `filter`.
pub fn matches(attributes: &Attributes, filter: &[(&str, &str)]) -> bool {
    filter
        .iter()
        .all(|(k, v)| attributes.get(*k).map(String::as_str) == Some(*v))
}

fn attributes<'a>(kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> Attributes {
    kvs.map(|kv| (kv.key.to_string(), kv.value.to_string()))
        .collect()
}

/// A provider with an in-memory exporter, as in [`Telemetry::new`], without the crate's metrics
/// on it: for tests that make their own `OperationMetrics` (e.g. through the global provider).
pub fn pipeline() -> (SdkMeterProvider, InMemoryMetricExporter) {
    let exporter = InMemoryMetricExporterBuilder::new().build();
    let reader = PeriodicReader::builder(exporter.clone())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    (provider, exporter)
}

impl Telemetry {
    /// The points of histogram `name` whose attributes include every pair in `filter`.
    pub fn points(&self, name: &str, filter: &[(&str, &str)]) -> Vec<HistogramPoint> {
        self.histogram(name)
            .into_iter()
            .filter(|p| matches(&p.attributes, filter))
            .collect()
    }

    /// Count of operations per outcome, over the duration points matching `filter`.
    pub fn outcomes(&self, filter: &[(&str, &str)]) -> BTreeMap<String, u64> {
        self.points(tower_resources_operation::DURATION_INSTRUMENT, filter)
            .into_iter()
            .map(|p| {
                let outcome = &p.attributes[tower_resources_operation::OUTCOME_ATTRIBUTE];
                (outcome.clone(), p.count)
            })
            .collect()
    }

    /// How many operations of the series matching `filter` ended with `outcome`.
    pub fn ended(&self, filter: &[(&str, &str)], outcome: &str) -> u64 {
        self.outcomes(filter).get(outcome).copied().unwrap_or(0)
    }

    /// Sum of the recorded values of histogram `name` over points matching `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.points(name, filter).iter().map(|p| p.sum).sum()
    }

    /// Largest recorded value of histogram `name` over points matching `filter`.
    pub fn max(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.points(name, filter)
            .iter()
            .filter_map(|p| p.max)
            .reduce(f64::max)
    }
}

/// A safety net so a lost permit fails a test instead of hanging it; not a performance bound.
/// On paused time, where the clock jumps to the next timer once every task waits, it comes at
/// once when nothing else can happen.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Awaits `future`, failing the test if it takes longer than [`DEADLINE`].
pub async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Waits until `condition` holds, failing the test after [`DEADLINE`]: polls it after 1 ms,
/// then less and less often, up to every 10 ms (a condition may read the metrics).
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    within(what, async {
        let mut interval = Duration::from_millis(1);
        while !condition() {
            tokio::time::sleep(interval).await;
            interval = (interval * 2).min(Duration::from_millis(10));
        }
    })
    .await;
}

/// What [`Telemetry::outcomes`] reads after one operation that ended `outcome`.
pub fn only(outcome: &str) -> BTreeMap<String, u64> {
    BTreeMap::from([(outcome.to_owned(), 1)])
}

/// `(queued, active)` over every series.
pub fn live(t: &Telemetry) -> (i64, i64) {
    (
        t.live_value(QUEUED_INSTRUMENT, &[]),
        t.live_value(ACTIVE_INSTRUMENT, &[]),
    )
}

/// How many waits of `operation` were given up.
pub fn abandoned(t: &Telemetry, operation: &str) -> i64 {
    t.live_value(ABANDONED_INSTRUMENT, &[(OPERATION_ATTRIBUTE, operation)])
}

/// Nothing waits or runs, in any series, and every permit of `limit` is back.
pub fn assert_idle(t: &Telemetry, limit: &Limit) {
    assert_eq!(live(t), (0, 0), "(queued, active)");
    assert_eq!(limit.available(), limit.capacity(), "permits back");
    assert_eq!(limit.queued(), 0, "waiters on the limit");
}

/// An inner service that answers once the request's sender fires (or is dropped).
pub fn held(
) -> impl Service<oneshot::Receiver<()>, Response = (), Error = BoxError, Future: Send> + Clone + Send
{
    service_fn(|release: oneshot::Receiver<()>| async move {
        let _ = release.await;
        Ok::<_, BoxError>(())
    })
}

/// The task of an operation started by [`spawn_held`]: what the service answered.
pub type HeldTask<S> = JoinHandle<
    Result<
        <S as Service<oneshot::Receiver<()>>>::Response,
        <S as Service<oneshot::Receiver<()>>>::Error,
    >,
>;

/// Starts an operation of `service`, on a task of its own, that runs until the sender returned
/// fires (or is dropped).
pub fn spawn_held<S>(service: &S) -> (oneshot::Sender<()>, HeldTask<S>)
where
    S: Service<oneshot::Receiver<()>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    let (release, rx) = oneshot::channel();
    (release, tokio::spawn(service.clone().oneshot(rx)))
}

/// An inner service whose `call` itself (not the future it returns) panics, with
/// `call panicked: <request>`, after setting `outcome` if it has one.
pub fn panics_in_call<R: std::fmt::Debug>(
    outcome: Option<Outcome>,
) -> impl Service<R, Response = (), Error = Infallible> + Clone {
    service_fn(
        move |request: R| -> std::future::Ready<Result<(), Infallible>> {
            if let Some(outcome) = outcome {
                assert!(set_outcome(outcome), "inside the operation");
            }
            panic!("call panicked: {request:?}")
        },
    )
}

/// Lets every task of a current-thread runtime run until it waits on something; under paused
/// time no timer fires meanwhile, so the clock does not move.
pub async fn settle() {
    for _ in 0..32 {
        tokio::task::yield_now().await;
    }
}

/// The message of the panic that ends `task`, which must panic, not end otherwise or hang (up to
/// [`DEADLINE`]).
pub async fn panic_of<T>(what: &str, task: JoinHandle<T>) -> String {
    let Err(error) = within(what, task).await else {
        panic!("{what} ended without a panic")
    };
    assert!(error.is_panic(), "{what}: {error}");
    panic_message(&*error.into_panic())
}

/// The message of a panic payload (`&str` or `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_owned()
    }
}

/// How many handlers run now, and the most that ever ran at once.
#[derive(Debug, Default)]
pub struct Load {
    running: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

impl Load {
    /// Counts as running for `how_long`.
    pub async fn work(&self, how_long: Duration) {
        self.enter();
        tokio::time::sleep(how_long).await;
        self.leave();
    }

    /// Counts as running, until [`leave`](Self::leave).
    pub fn enter(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.running.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
    }

    /// Stops counting as running.
    pub fn leave(&self) {
        self.running
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many run now.
    pub fn now(&self) -> usize {
        self.running.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The most that ever ran at once.
    pub fn max(&self) -> usize {
        self.max.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Takes one place of `limit` outside any layer, as other work sharing it would.
pub fn take(limit: &Limit) -> tower_resources_operation::limit::LimitPermit {
    use tower_resources_operation::Acquire as _;
    limit
        .try_acquire()
        .expect("a free place")
        .expect("an open limit")
}

/// The rejection inside a generic layer's `BoxError`.
pub fn rejection_of(error: &tower::BoxError) -> tower_resources_operation::Rejection {
    error
        .downcast_ref::<tower_resources_operation::protocol::Rejected>()
        .unwrap_or_else(|| panic!("not a rejection: {error}"))
        .rejection()
}
