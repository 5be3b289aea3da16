//! A real OpenTelemetry SDK pipeline for tests: an in-memory exporter behind a periodic reader
//! that never fires on its own, read back with `force_flush`.
#![allow(dead_code, unreachable_pub)]

pub mod prometheus;
pub mod reliability;

use std::collections::BTreeMap;
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
        let exporter = InMemoryMetricExporterBuilder::new().build();
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
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
                            .map(|p| SumPoint {
                                attributes: attributes(p.attributes()),
                                value: p.value(),
                            })
                            .collect(),
                    },
                    AggregatedMetrics::U64(MetricData::Sum(s)) => Data::Sum {
                        monotonic: s.is_monotonic(),
                        points: s
                            .data_points()
                            .map(|p| SumPoint {
                                attributes: attributes(p.attributes()),
                                value: i64::try_from(p.value()).expect("a count that fits"),
                            })
                            .collect(),
                    },
                    AggregatedMetrics::I64(MetricData::Gauge(g)) => Data::Gauge(
                        g.data_points()
                            .map(|p| SumPoint {
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

    /// The data points of histogram `name` (empty if it exported nothing).
    pub fn histogram(&self, name: &str) -> Vec<HistogramPoint> {
        self.collect()
            .into_iter()
            .filter(|m| m.name == name)
            .flat_map(|m| match m.data {
                Data::Histogram(points) => points,
                other => panic!("{name} is not an f64 histogram: {other:?}"),
            })
            .collect()
    }

    /// The data points of the observable instrument `name`: a live count, a counter or the
    /// limit gauge.
    pub fn live(&self, name: &str) -> Vec<SumPoint> {
        self.collect()
            .into_iter()
            .filter(|m| m.name == name)
            .flat_map(|m| match m.data {
                Data::Sum { points, .. } | Data::Gauge(points) => points,
                other => panic!("{name} is not a sum or a gauge: {other:?}"),
            })
            .collect()
    }

    /// Sum of the histogram's counts over points whose attributes include every pair in `filter`.
    pub fn count(&self, name: &str, filter: &[(&str, &str)]) -> u64 {
        self.histogram(name)
            .iter()
            .filter(|p| matches(&p.attributes, filter))
            .map(|p| p.count)
            .sum()
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

/// Lets every task of a current-thread runtime run until it waits on something; under paused
/// time no timer fires meanwhile, so the clock does not move.
pub async fn settle() {
    for _ in 0..32 {
        tokio::task::yield_now().await;
    }
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
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.running.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
        tokio::time::sleep(how_long).await;
        self.running.fetch_sub(1, SeqCst);
    }

    /// The most that ever ran at once.
    pub fn max(&self) -> usize {
        self.max.load(std::sync::atomic::Ordering::SeqCst)
    }
}
