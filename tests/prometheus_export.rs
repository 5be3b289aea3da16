//! The example's app (examples/axum.rs) in-process, read through its `/metrics` endpoint: the
//! series as Prometheus sees them, from the real `opentelemetry-prometheus` exporter and the
//! `prometheus` crate's text encoder.

#[path = "../examples/axum.rs"]
#[allow(dead_code)]
mod app;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use support::http::serve;
use support::prometheus::label::{EXECUTOR, OPERATION, OUTCOME, REJECTION};
use support::prometheus::Exporter;
use support::within;
use tower_resources_operation::names::{
    LIMIT_SCOPE_ATTRIBUTE, METER_NAME, OPERATION_BOUNDARIES_MS, QUEUE_DURATION_INSTRUMENT,
};

/// The label the exporter adds: the name of the meter the series come from.
const SCOPE: &str = "otel_scope_name";

const QUEUE: &str = "gym_resources_operation_queue_duration_ms";
const DURATION: &str = "gym_resources_operation_duration_ms";
const QUEUED: &str = "gym_resources_operation_queued";
const ACTIVE: &str = "gym_resources_operation_active";
const LIMIT: &str = "gym_resources_operation_limit";
const REJECTED: &str = "gym_resources_operation_rejected_total";
const ABANDONED: &str = "gym_resources_operation_abandoned_total";

/// One sample line of the text format.
#[derive(Clone, Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> &str {
        self.labels.get(key).map(String::as_str).unwrap_or("")
    }

    /// The labels other than `le`: which series of a histogram this bucket belongs to.
    fn series(&self) -> BTreeMap<String, String> {
        let mut labels = self.labels.clone();
        labels.remove("le");
        labels
    }
}

/// The exposition: samples in order, and each family's `# TYPE`.
#[derive(Debug, Default)]
struct Exposition {
    samples: Vec<Sample>,
    types: BTreeMap<String, String>,
}

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut exposition = Exposition::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
                exposition.types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            exposition.samples.push(parse_sample(line));
        }
        exposition
    }

    fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The one sample named `name` whose labels include every pair of `filter`.
    fn value(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        let matching: Vec<&Sample> = self
            .named(name)
            .filter(|s| filter.iter().all(|(k, v)| s.label(k) == *v))
            .collect();
        match matching.as_slice() {
            [] => None,
            [one] => Some(one.value),
            many => panic!("{name} {filter:?}: {} samples: {many:?}", many.len()),
        }
    }
}

/// `name{k="v",...} value` (the labels are optional); label values may hold `\"`, `\\`, `\n`.
fn parse_sample(line: &str) -> Sample {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => panic!("no value on line {line:?}"),
    };
    let mut labels = BTreeMap::new();
    let mut chars = rest.chars().peekable();
    if chars.peek() == Some(&'{') {
        chars.next();
        loop {
            match chars.peek() {
                Some('}') => {
                    chars.next();
                    break;
                }
                Some(',') => {
                    chars.next();
                    continue;
                }
                None => panic!("unterminated labels on line {line:?}"),
                _ => {}
            }
            let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
            assert_eq!(
                chars.next(),
                Some('"'),
                "label value quote on line {line:?}"
            );
            let mut value = String::new();
            loop {
                match chars.next().expect("unterminated label value") {
                    '"' => break,
                    '\\' => match chars.next().expect("escape") {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    c => value.push(c),
                }
            }
            labels.insert(key, value);
        }
    }
    let value: String = chars.collect();
    let value = value.trim().split(' ').next().unwrap_or_default();
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other
            .parse()
            .unwrap_or_else(|e| panic!("value {other:?} on line {line:?}: {e}")),
    };
    Sample {
        name: name.to_owned(),
        labels,
        value,
    }
}

async fn scrape(addr: SocketAddr) -> (String, Exposition) {
    let (status, body) = within("GET /metrics", app::http_get(addr, "/metrics", "HTTP/1.1"))
        .await
        .expect("GET /metrics");
    assert_eq!(status, 200, "{body}");
    let exposition = Exposition::parse(&body);
    (body, exposition)
}

/// The `le` values Prometheus should see: NeMo Gym's boundaries, then `+Inf`.
fn expected_le() -> Vec<String> {
    OPERATION_BOUNDARIES_MS
        .iter()
        .map(|b| b.to_string())
        .chain(["+Inf".to_owned()])
        .collect()
}

/// Checks every bucket series of histogram `family`: `le` in NeMo Gym's order, cumulative
/// counts that never go down, `+Inf` equal to `_count`; returns `_count` per series.
fn check_histogram(
    exposition: &Exposition,
    family: &str,
) -> BTreeMap<BTreeMap<String, String>, f64> {
    let mut buckets: BTreeMap<BTreeMap<String, String>, Vec<(String, f64)>> = BTreeMap::new();
    for sample in exposition.named(&format!("{family}_bucket")) {
        buckets
            .entry(sample.series())
            .or_default()
            .push((sample.label("le").to_owned(), sample.value));
    }
    let mut counts = BTreeMap::new();
    for (series, buckets) in &buckets {
        let le: Vec<String> = buckets.iter().map(|(le, _)| le.clone()).collect();
        assert_eq!(le, expected_le(), "{family} {series:?}");
        for pair in buckets.windows(2) {
            assert!(pair[0].1 <= pair[1].1, "{family} {series:?}: {buckets:?}");
        }
        let filter: Vec<(&str, &str)> = series
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let count = exposition
            .value(&format!("{family}_count"), &filter)
            .unwrap_or_else(|| panic!("{family}_count {series:?}"));
        let sum = exposition
            .value(&format!("{family}_sum"), &filter)
            .unwrap_or_else(|| panic!("{family}_sum {series:?}"));
        assert_eq!(buckets.last().unwrap().1, count, "{family} {series:?}");
        assert!(sum >= 0.0, "{family} {series:?}: sum {sum}");
        counts.insert(series.clone(), count);
    }
    // Every `_count` and `_sum` belongs to a series that has buckets.
    for suffix in ["_count", "_sum"] {
        for sample in exposition.named(&format!("{family}{suffix}")) {
            assert!(
                buckets.contains_key(&sample.labels),
                "{}{suffix} without buckets: {sample:?}",
                family
            );
        }
    }
    counts
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Every limit of the app, as `(operation, executor)`.
const SERIES: [(&str, &str); 3] = [
    ("verify", "subprocess"),
    ("judge", "inline"),
    ("tool", "thread"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_shows_the_series_without_unit_suffixes_and_counts_every_outcome() {
    let telemetry = app::Telemetry::new(None).expect("telemetry");
    let config = app::Config {
        shared_limit: 2,
        tool_limit: 1,
        verify_deadline: Duration::from_millis(100),
    };
    let addr = serve(app::app(&config, &telemetry)).await;

    // Before any request: the live counts of every limit are there, at 0; no histogram yet.
    let (body, before) = scrape(addr).await;
    for (op, ex) in SERIES {
        for gauge in [QUEUED, ACTIVE] {
            assert_eq!(
                before.value(gauge, &[(OPERATION, op), (EXECUTOR, ex)]),
                Some(0.0),
                "{gauge} {op}/{ex} before any request:\n{body}"
            );
        }
    }
    assert_eq!(before.named(&format!("{DURATION}_count")).count(), 0);

    // The load: three verifies that pass, one past the handler's deadline (answered 200 with a
    // fallback, outcome `timeout` through `set_outcome`), one that fails (500, `error`); a
    // judge call that passes and one that fails; two tool runs.
    let paths = [
        "/verify?ms=5",
        "/verify?ms=5",
        "/verify?ms=5",
        "/verify?ms=5000",
        "/verify?ms=5&fail=1",
        "/judge?ms=5",
        "/judge?ms=5&fail=1",
        "/tool?ms=20",
        "/tool?ms=20",
    ];
    let statuses = within("the load", app::burst(addr, &paths)).await;
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 500, 200, 500, 200, 200],
        "{paths:?}"
    );

    let (body, after) = scrape(addr).await;

    // Names: the instruments' names with dots as underscores and no unit suffix; histograms
    // and gauges as such (observable up-down counters are gauges: no `_total`); the two
    // counters with `_total`.
    let ours: BTreeSet<&str> = after
        .samples
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| n.starts_with("gym_"))
        .collect();
    let expected: BTreeSet<String> = [QUEUE, DURATION]
        .iter()
        .flat_map(|h| ["_bucket", "_sum", "_count"].map(|s| format!("{h}{s}")))
        .chain([QUEUED, ACTIVE, LIMIT, REJECTED, ABANDONED].map(str::to_owned))
        .collect();
    assert_eq!(
        ours,
        expected.iter().map(String::as_str).collect(),
        "{body}"
    );
    assert!(!body.contains("milliseconds"), "unit suffix added:\n{body}");
    assert!(
        !body.contains("gym_resources_operation_queued_total"),
        "{body}"
    );
    for (family, kind) in [
        (QUEUE, "histogram"),
        (DURATION, "histogram"),
        (QUEUED, "gauge"),
        (ACTIVE, "gauge"),
        (LIMIT, "gauge"),
        (REJECTED, "counter"),
        (ABANDONED, "counter"),
    ] {
        assert_eq!(
            after.types.get(family).map(String::as_str),
            Some(kind),
            "{body}"
        );
    }

    // Labels: the attribute keys with dots as underscores, plus the exporter's scope label.
    let limit_scope = LIMIT_SCOPE_ATTRIBUTE.replace('.', "_");
    for sample in after.samples.iter().filter(|s| s.name.starts_with("gym_")) {
        let mut keys: BTreeSet<&str> = [OPERATION, EXECUTOR, SCOPE].into();
        if sample.name == LIMIT {
            keys.insert(&limit_scope);
        }
        if sample.name.starts_with(DURATION) {
            keys.insert(OUTCOME);
        }
        if sample.name == REJECTED {
            keys.insert(REJECTION);
        }
        if sample.name.ends_with("_bucket") {
            keys.insert("le");
        }
        let got: BTreeSet<&str> = sample.labels.keys().map(String::as_str).collect();
        assert_eq!(got, keys, "{sample:?}");
        assert_eq!(sample.label(SCOPE), METER_NAME, "{sample:?}");
    }

    // Buckets: NeMo Gym's boundaries; counts per outcome as the load produced them.
    let queue = check_histogram(&after, QUEUE);
    let run = check_histogram(&after, DURATION);
    let scope = (SCOPE, METER_NAME);
    assert_eq!(
        queue,
        BTreeMap::from([
            (
                labels(&[(OPERATION, "judge"), (EXECUTOR, "inline"), scope]),
                2.0
            ),
            (
                labels(&[(OPERATION, "tool"), (EXECUTOR, "thread"), scope]),
                2.0
            ),
            (
                labels(&[(OPERATION, "verify"), (EXECUTOR, "subprocess"), scope]),
                5.0
            ),
        ]),
        "{body}"
    );
    let run_of =
        |op, ex, outcome| labels(&[(OPERATION, op), (EXECUTOR, ex), (OUTCOME, outcome), scope]);
    assert_eq!(
        run,
        BTreeMap::from([
            (run_of("judge", "inline", "error"), 1.0),
            (run_of("judge", "inline", "ok"), 1.0),
            (run_of("tool", "thread", "ok"), 2.0),
            (run_of("verify", "subprocess", "error"), 1.0),
            (run_of("verify", "subprocess", "ok"), 3.0),
            (run_of("verify", "subprocess", "timeout"), 1.0),
        ]),
        "{body}"
    );

    // The timed-out verify ran until the handler's deadline (100 ms): nothing in the buckets
    // up to 50 ms, and a sum of at least the deadline.
    let timeout = [(OPERATION, "verify"), (OUTCOME, "timeout"), ("le", "50")];
    assert_eq!(
        after.value(&format!("{DURATION}_bucket"), &timeout),
        Some(0.0)
    );
    let timeout_sum = after
        .value(
            &format!("{DURATION}_sum"),
            &[(OPERATION, "verify"), (OUTCOME, "timeout")],
        )
        .unwrap();
    assert!(timeout_sum >= 100.0, "timeout ran {timeout_sum} ms");
    // The tool slept 20 ms on the blocking pool, twice.
    let tool_sum = after
        .value(&format!("{DURATION}_sum"), &[(OPERATION, "tool")])
        .unwrap();
    assert!(tool_sum >= 40.0, "tool ran {tool_sum} ms");

    // Nothing waits or runs once every response is in; nothing was turned away or given up.
    for (op, ex) in SERIES {
        for gauge in [QUEUED, ACTIVE, ABANDONED] {
            assert_eq!(
                after.value(gauge, &[(OPERATION, op), (EXECUTOR, ex)]),
                Some(0.0),
                "{gauge} {op}/{ex}:\n{body}"
            );
        }
        for reason in ["queue_full", "queue_timeout", "unavailable"] {
            assert_eq!(
                after.value(
                    REJECTED,
                    &[(OPERATION, op), (EXECUTOR, ex), (REJECTION, reason)]
                ),
                Some(0.0),
                "{reason} {op}/{ex}:\n{body}"
            );
        }
    }
    // Each series reports the capacity of its limit; `/verify` and `/judge` share theirs.
    for (op, limit) in [("verify", 2.0), ("judge", 2.0), ("tool", 1.0)] {
        assert_eq!(
            after.value(LIMIT, &[(OPERATION, op)]),
            Some(limit),
            "{body}"
        );
    }
}

/// What `without_units()` is for: left at its default, the exporter appends the unit to the
/// histograms' names (`ms` is `milliseconds`), so the dashboards' and alerts' series would not
/// exist. An annotation unit like `{operation}` adds nothing either way.
#[tokio::test]
async fn the_exporters_default_appends_milliseconds_to_the_histogram_names() {
    let exporter = Exporter::with_units();
    let limit = tower_resources_operation::ResourcesOperationLayer::new(1)
        .metrics(exporter.metrics.clone());
    let service = tower::ServiceBuilder::new()
        .layer(limit)
        .service(tower::service_fn(|()| async {
            Ok::<_, std::convert::Infallible>(())
        }));
    tower::ServiceExt::oneshot(service, ()).await.unwrap();

    let text = exporter.text();
    let names: BTreeSet<String> = Exposition::parse(&text)
        .samples
        .into_iter()
        .map(|s| s.name)
        .filter(|n| n.starts_with("gym_"))
        .collect();
    assert!(
        names.contains("gym_resources_operation_duration_ms_milliseconds_bucket"),
        "{names:?}"
    );
    assert!(
        names.contains("gym_resources_operation_queue_duration_ms_milliseconds_count"),
        "{names:?}"
    );
    assert!(names.contains(QUEUED), "{names:?}");
    assert!(names.contains(ACTIVE), "{names:?}");
}

/// A named adaptive limit as Prometheus sees it, through `without_units()` as the dashboards
/// expect: its capacity, active and queued, and its controller's baseline and estimate, each
/// with the limit's name as its only label of the crate's.
#[tokio::test]
async fn a_named_adaptive_limit_shows_its_controllers_series() {
    use tower_resources_operation::adaptive::{Adaptive, Vegas};
    use tower_resources_operation::names::LIMIT_ATTRIBUTE;

    let exporter = Exporter::without_units();
    let judges = tower_resources_operation::Limit::builder(1)
        .name("judges")
        .adaptive(Adaptive::new(Vegas::default(), 1..=4))
        .build();
    // Enough operations to close a window, so the controller has measured something.
    for _ in 0..32 {
        let judged = exporter
            .metrics
            .resources_operation(
                &judges,
                tower_resources_operation::Operation::Judge,
                tower_resources_operation::Executor::Inline,
                async { Ok::<_, std::convert::Infallible>(()) },
            )
            .await;
        judged.unwrap().unwrap();
    }

    let text = exporter.text();
    let exposition = Exposition::parse(&text);
    let label = LIMIT_ATTRIBUTE.replace('.', "_");
    let scope = LIMIT_SCOPE_ATTRIBUTE.replace('.', "_");
    for series in [
        "gym_resources_limit_capacity",
        "gym_resources_limit_active",
        "gym_resources_limit_queued",
        "gym_resources_limit_adaptive_baseline_ms",
        "gym_resources_limit_adaptive_estimate_ms",
    ] {
        let samples: Vec<&Sample> = exposition.named(series).collect();
        assert_eq!(samples.len(), 1, "{series} in\n{text}");
        let crates: Vec<&String> = samples[0]
            .labels
            .keys()
            .filter(|key| key.starts_with("nemo_"))
            .collect();
        assert_eq!(crates, [&label, &scope], "{series}");
        assert_eq!(samples[0].labels[&label], "judges", "{series}");
        assert_eq!(samples[0].labels[&scope], "process", "{series}");
    }
    assert_eq!(
        exposition.value("gym_resources_limit_capacity", &[]),
        Some(2.0)
    );
}

/// OpenTelemetry's base-2 exponential histogram does not reach Prometheus through the exporter
/// the README uses: opentelemetry-prometheus 0.33 drops the instrument whole (no series, no
/// error), so a View that asks for it on the queue time loses the queue time. Finer buckets
/// are an explicit-bucket View (the README's), which it exports.
#[tokio::test]
async fn an_exponential_histogram_view_loses_the_instrument_through_the_prometheus_exporter() {
    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::metrics::{Aggregation, Instrument, SdkMeterProvider, Stream};
    use tower_resources_operation::OperationMetrics;

    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_units()
        .build()
        .unwrap();
    let exponential = |instrument: &Instrument| {
        (instrument.name() == QUEUE_DURATION_INSTRUMENT).then(|| {
            let aggregation = Aggregation::Base2ExponentialHistogram {
                max_size: 160,
                max_scale: 20,
                record_min_max: true,
            };
            Stream::builder()
                .with_aggregation(aggregation)
                .build()
                .unwrap()
        })
    };
    let provider = SdkMeterProvider::builder()
        .with_reader(exporter)
        .with_view(exponential)
        .build();
    let metrics = OperationMetrics::new(&provider.meter(METER_NAME));
    let service = tower::ServiceBuilder::new()
        .layer(tower_resources_operation::ResourcesOperationLayer::new(1).metrics(metrics))
        .service(tower::service_fn(|()| async {
            Ok::<_, std::convert::Infallible>(())
        }));
    tower::ServiceExt::oneshot(service, ()).await.unwrap();

    let text = support::prometheus::text(&registry);
    assert!(
        text.contains("gym_resources_operation_duration_ms_count"),
        "the explicit-bucket run time is exported: {text}"
    );
    assert!(
        !text.contains("gym_resources_operation_queue_duration_ms"),
        "the exporter drops an exponential histogram: {text}"
    );
}
