//! A real OpenTelemetry SDK pipeline (an in-memory exporter behind a periodic reader that
//! never fires on its own, read back with `force_flush`), what it exported, and waits with a
//! safety net: shared by the tests of both crates of the workspace (the fleet crate's
//! `tests/support` includes this file).
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use tower_resources_operation::OperationMetrics;

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
        self.points(
            tower_resources_operation::names::DURATION_INSTRUMENT,
            filter,
        )
        .into_iter()
        .map(|p| {
            let outcome = &p.attributes[tower_resources_operation::names::OUTCOME_ATTRIBUTE];
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
