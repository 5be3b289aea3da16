//! The example's OTLP path (examples/axum.rs, `opentelemetry-otlp` over gRPC) against an
//! in-process OTLP/gRPC receiver on 127.0.0.1: what a collector gets is the instruments under
//! their OpenTelemetry names, units and attribute keys, with NeMo Gym's bucket boundaries.

#[path = "../examples/axum.rs"]
#[allow(dead_code)]
mod app;
mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point, AggregationTemporality};
use tokio::sync::mpsc;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use support::http::serve;
use support::within;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    LIMIT_INSTRUMENT, METER_NAME, OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};

/// Hands every export it receives to the test.
struct Receiver(mpsc::UnboundedSender<ExportMetricsServiceRequest>);

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let _ = self.0.send(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_exporter_pushes_the_instruments_to_a_collector() {
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).expect("bind receiver");
    let receiver = incoming.local_addr().expect("receiver addr");
    let (exports, mut received) = mpsc::unbounded_channel();
    tokio::spawn(
        Server::builder()
            .add_service(MetricsServiceServer::new(Receiver(exports)))
            .serve_with_incoming(incoming),
    );

    let telemetry =
        app::Telemetry::new(Some(format!("http://{receiver}"))).expect("telemetry with OTLP");
    let config = app::Config {
        verify_deadline: Duration::from_millis(50),
        ..app::Config::default()
    };
    let addr = serve(app::app(&config, &telemetry)).await;

    let paths = [
        "/verify?ms=1",
        "/verify?ms=1",
        "/verify?ms=2000",
        "/tool?ms=1",
    ];
    let statuses = within("the load", app::burst(addr, &paths)).await;
    assert_eq!(statuses, [200, 200, 200, 200]);

    // Push now rather than at the next interval; the reader blocks until the export returns.
    let provider = telemetry.provider.clone();
    within(
        "the flush",
        tokio::task::spawn_blocking(move || provider.force_flush()),
    )
    .await
    .expect("flush task")
    .expect("flush to the OTLP receiver");
    // Exports are cumulative: the last one has everything.
    let mut last = None;
    while let Ok(export) = received.try_recv() {
        last = Some(export);
    }
    let export = last.expect("the receiver got no export");

    let scopes: Vec<_> = export
        .resource_metrics
        .iter()
        .flat_map(|r| &r.scope_metrics)
        .collect();
    let [scope] = scopes.as_slice() else {
        panic!("one scope expected: {scopes:?}")
    };
    assert_eq!(
        scope.scope.as_ref().map(|s| s.name.as_str()),
        Some(METER_NAME)
    );

    let mut names = Vec::new();
    let mut runs: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    let mut queues: BTreeMap<String, u64> = BTreeMap::new();
    for metric in &scope.metrics {
        names.push(metric.name.clone());
        match metric.data.as_ref().expect("data") {
            metric::Data::Histogram(histogram) => {
                assert_eq!(metric.unit, "ms", "{}", metric.name);
                assert_eq!(
                    histogram.aggregation_temporality,
                    AggregationTemporality::Cumulative as i32
                );
                for point in &histogram.data_points {
                    assert_eq!(
                        point.explicit_bounds, OPERATION_BOUNDARIES_MS,
                        "{}",
                        metric.name
                    );
                    assert_eq!(point.bucket_counts.len(), OPERATION_BOUNDARIES_MS.len() + 1);
                    assert_eq!(point.bucket_counts.iter().sum::<u64>(), point.count);
                    let attrs = attributes(&point.attributes);
                    let op = attrs[OPERATION_ATTRIBUTE].clone();
                    if metric.name == DURATION_INSTRUMENT {
                        let key = (
                            op,
                            attrs[EXECUTOR_ATTRIBUTE].clone(),
                            attrs[OUTCOME_ATTRIBUTE].clone(),
                        );
                        runs.insert(key, point.count);
                    } else {
                        assert!(!attrs.contains_key(OUTCOME_ATTRIBUTE), "{attrs:?}");
                        queues.insert(op, point.count);
                    }
                }
            }
            metric::Data::Sum(sum) => {
                assert_eq!(metric.unit, "{operation}", "{}", metric.name);
                let counter = [REJECTED_INSTRUMENT, ABANDONED_INSTRUMENT].contains(&&*metric.name);
                assert_eq!(sum.is_monotonic, counter, "{}", metric.name);
                let mut seen = Vec::new();
                for point in &sum.data_points {
                    assert_eq!(
                        point.value,
                        Some(number_data_point::Value::AsInt(0)),
                        "{} {:?}",
                        metric.name,
                        attributes(&point.attributes)
                    );
                    seen.push(attributes(&point.attributes)[OPERATION_ATTRIBUTE].clone());
                }
                seen.sort();
                seen.dedup();
                assert_eq!(seen, ["judge", "tool", "verify"], "{}", metric.name);
                if metric.name == REJECTED_INSTRUMENT {
                    let reasons: std::collections::BTreeSet<_> = sum
                        .data_points
                        .iter()
                        .map(|p| attributes(&p.attributes)[REJECTION_ATTRIBUTE].clone())
                        .collect();
                    assert_eq!(
                        reasons,
                        ["deadline", "queue_full", "queue_timeout", "unavailable"]
                            .map(String::from)
                            .into()
                    );
                }
            }
            metric::Data::Gauge(gauge) => {
                assert_eq!(metric.name, LIMIT_INSTRUMENT);
                assert_eq!(metric.unit, "{operation}");
                let limits: BTreeMap<_, _> = gauge
                    .data_points
                    .iter()
                    .map(|p| {
                        (
                            attributes(&p.attributes)[OPERATION_ATTRIBUTE].clone(),
                            p.value,
                        )
                    })
                    .collect();
                let int = |n| Some(number_data_point::Value::AsInt(n));
                // `/verify` and `/judge` share a limit of 4, each series reports all of it.
                assert_eq!(
                    limits,
                    BTreeMap::from([
                        ("judge".to_owned(), int(4)),
                        ("tool".to_owned(), int(2)),
                        ("verify".to_owned(), int(4)),
                    ])
                );
            }
            other => panic!("{}: unexpected data {other:?}", metric.name),
        }
    }
    names.sort();
    let mut expected = [
        ACTIVE_INSTRUMENT,
        DURATION_INSTRUMENT,
        QUEUED_INSTRUMENT,
        QUEUE_DURATION_INSTRUMENT,
        LIMIT_INSTRUMENT,
        REJECTED_INSTRUMENT,
        ABANDONED_INSTRUMENT,
    ];
    expected.sort();
    assert_eq!(names, expected);

    let key =
        |op: &str, ex: &str, outcome: &str| (op.to_owned(), ex.to_owned(), outcome.to_owned());
    assert_eq!(
        runs,
        BTreeMap::from([
            (key("tool", "thread", "ok"), 1),
            (key("verify", "subprocess", "ok"), 2),
            (key("verify", "subprocess", "timeout"), 1),
        ])
    );
    assert_eq!(
        queues,
        BTreeMap::from([("tool".to_owned(), 1), ("verify".to_owned(), 3)])
    );
}
