//! gRPC with tonic: the limit on one service (through `add_service`) and on the whole server
//! (`Server::builder().layer(...)`), with each call's outcome read from its `grpc-status`.
//!
//! ```text
//! cargo run --example tonic --features tonic
//! ```
//!
//! The service is tonic-health's generated `grpc.health.v1.Health` (so no `protoc` is needed)
//! with a `Health` of our own: a deep health check that probes the backend it is asked about.
//! Probes are expensive, so at most 2 run at once. The `judge` probe takes longer than the
//! handler lets it and answers DEADLINE_EXCEEDED, which the metrics show as `timeout`. Client and
//! server talk over 127.0.0.1; the metrics go to an in-memory exporter, printed at the end.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use tonic::codegen::tokio_stream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;
use tower_resources_operation::{
    Executor, Operation, OperationMetrics, ResourcesOperationLayer, ACTIVE_INSTRUMENT,
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// How long the handler lets a probe run before it answers DEADLINE_EXCEEDED.
const PROBE_DEADLINE: Duration = Duration::from_millis(150);
/// The backends clients ask about, in turn.
const BACKENDS: [&str; 4] = ["db", "verifier", "judge", "cache"];
/// Calls per burst, each backend asked about as often, over [`CONNECTIONS`] connections.
const CALLS: usize = 16;
const CONNECTIONS: usize = 4;

/// The gRPC handler: probes the named backend under [`PROBE_DEADLINE`].
struct Prober;

#[tonic::async_trait]
impl Health for Prober {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let name = request.into_inner().service;
        let (probe_time, up) = match name.as_str() {
            "db" => (20, true),
            "verifier" => (60, true),
            "judge" => (400, true), // slower than the deadline
            "cache" => (10, false),
            _ => return Err(Status::not_found(format!("no backend {name:?}"))),
        };
        let probe = tokio::time::sleep(Duration::from_millis(probe_time));
        if tokio::time::timeout(PROBE_DEADLINE, probe).await.is_err() {
            // A trailers-only answer with grpc-status 4: the metrics say `timeout`.
            return Err(Status::deadline_exceeded(format!(
                "the {name} probe ran too long"
            )));
        }
        if !up {
            return Err(Status::unavailable(format!("{name} is down")));
        }
        let status = ServingStatus::Serving as i32;
        Ok(Response::new(HealthCheckResponse { status }))
    }

    type WatchStream = tokio_stream::Empty<Result<HealthCheckResponse, Status>>;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("this demo only checks"))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let telemetry = Telemetry::new();

    // 1. One limit for one service. The layered service keeps the generated server's name,
    //    "grpc.health.v1.Health" (the crate's `tonic` feature forwards `NamedService`), which
    //    `add_service` needs; other services on this server would not be limited.
    let limited = ServiceBuilder::new()
        .layer(
            ResourcesOperationLayer::new_for_grpc(2)
                .operation(Operation::Verify)
                .executor(Executor::Subprocess)
                .metrics(telemetry.metrics.clone()),
        )
        .service(HealthServer::new(Prober));
    let (incoming, addr) = listen()?;
    let router = Server::builder().add_service(limited);
    let server = tokio::spawn(router.serve_with_incoming(incoming));
    burst(
        "per service (add_service), limit 2, reported as verify/subprocess",
        addr,
    )
    .await?;
    server.abort();

    // 2. One limit for the whole server: every call it takes, to whichever service, shares it.
    let whole_server = ResourcesOperationLayer::new_for_grpc(2)
        .operation(Operation::Other)
        .executor(Executor::Inline)
        .metrics(telemetry.metrics.clone());
    let (incoming, addr) = listen()?;
    let router = Server::builder()
        .layer(whole_server)
        .add_service(HealthServer::new(Prober));
    let server = tokio::spawn(router.serve_with_incoming(incoming));
    burst(
        "whole server (Server::builder().layer), limit 2, reported as other/inline",
        addr,
    )
    .await?;
    server.abort();

    telemetry.print();
    Ok(())
}

/// A listener on an ephemeral port of 127.0.0.1.
fn listen() -> Result<(TcpIncoming, SocketAddr), Error> {
    let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let addr = incoming.local_addr()?;
    Ok((incoming, addr))
}

/// [`CALLS`] checks at once over [`CONNECTIONS`] connections; prints what the clients saw.
async fn burst(title: &str, addr: SocketAddr) -> Result<(), Error> {
    let mut channels: Vec<Channel> = Vec::new();
    for _ in 0..CONNECTIONS {
        channels.push(
            Endpoint::from_shared(format!("http://{addr}"))?
                .connect()
                .await?,
        );
    }
    let started = Instant::now();
    let calls: Vec<_> = (0..CALLS)
        .map(|i| {
            let mut client = HealthClient::new(channels[i % CONNECTIONS].clone());
            let service = BACKENDS[i % BACKENDS.len()].to_owned();
            tokio::spawn(async move { client.check(HealthCheckRequest { service }).await })
        })
        .collect();
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for call in calls {
        let code = match call.await? {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        *seen.entry(format!("{code:?}")).or_default() += 1;
    }
    let seen: Vec<_> = seen
        .iter()
        .map(|(code, n)| format!("{code} x{n}"))
        .collect();
    println!("== {title}");
    println!(
        "   {CALLS} calls in {} ms; clients saw {}",
        started.elapsed().as_millis(),
        seen.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics back: an in-memory exporter, flushed on demand.

struct Telemetry {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
    metrics: OperationMetrics,
}

/// Count, sum and max of one histogram data point.
#[derive(Clone, Copy)]
struct Point {
    count: u64,
    sum: f64,
    max: f64,
}

impl Point {
    fn mean(self) -> f64 {
        self.sum / self.count.max(1) as f64
    }
}

impl Telemetry {
    fn new() -> Self {
        let exporter = InMemoryMetricExporterBuilder::new().build();
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
        let metrics = OperationMetrics::new(&provider.meter("tonic-example"));
        Self {
            provider,
            exporter,
            metrics,
        }
    }

    /// Per series ("operation/executor"): the queue histogram under outcome "", the duration
    /// histogram under each outcome; and the live counts summed over all series.
    fn print(&self) {
        self.exporter.reset();
        self.provider.force_flush().expect("flush metrics");
        let exported = self.exporter.get_finished_metrics().expect("read metrics");
        let mut points: BTreeMap<(String, String), Point> = BTreeMap::new();
        let mut live: BTreeMap<String, i64> = BTreeMap::new();
        for metric in exported
            .iter()
            .flat_map(|r| r.scope_metrics())
            .flat_map(|s| s.metrics())
        {
            match metric.data() {
                AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                    for p in h.data_points() {
                        let attr = |key: &str| {
                            p.attributes()
                                .find(|kv| kv.key.as_str() == key)
                                .map(|kv| kv.value.to_string())
                                .unwrap_or_default()
                        };
                        let series =
                            format!("{}/{}", attr(OPERATION_ATTRIBUTE), attr(EXECUTOR_ATTRIBUTE));
                        let outcome = match metric.name() {
                            QUEUE_DURATION_INSTRUMENT => String::new(),
                            DURATION_INSTRUMENT => attr(OUTCOME_ATTRIBUTE),
                            _ => continue,
                        };
                        let point = Point {
                            count: p.count(),
                            sum: p.sum(),
                            max: p.max().unwrap_or(0.0),
                        };
                        points.insert((series, outcome), point);
                    }
                }
                AggregatedMetrics::I64(MetricData::Sum(s)) => {
                    let total: i64 = s.data_points().map(|p| p.value()).sum();
                    *live.entry(metric.name().to_owned()).or_default() += total;
                }
                _ => {}
            }
        }

        println!("\n== exported metrics");
        println!(
            "   {:<18} {:>5} {:>10} {:>10} | {:<9} {:>5} {:>9} {:>9}",
            "series", "calls", "queue mean", "queue max", "outcome", "calls", "run mean", "run max"
        );
        for ((series, _), queue) in points.iter().filter(|((_, o), _)| o.is_empty()) {
            let mut first = true;
            for ((_, outcome), run) in points
                .iter()
                .filter(|((s, o), _)| s == series && !o.is_empty())
            {
                let left = if first {
                    format!(
                        "{series:<18} {:>5} {:>7.0} ms {:>7.0} ms",
                        queue.count,
                        queue.mean(),
                        queue.max
                    )
                } else {
                    String::new()
                };
                first = false;
                println!(
                    "   {left:<46} | {outcome:<9} {:>5} {:>6.0} ms {:>6.0} ms",
                    run.count,
                    run.mean(),
                    run.max
                );
            }
        }
        println!(
            "   live now: queued {}, active {} (both back to 0 once the bursts are over)",
            live.get(QUEUED_INSTRUMENT).copied().unwrap_or_default(),
            live.get(ACTIVE_INSTRUMENT).copied().unwrap_or_default()
        );
    }
}
