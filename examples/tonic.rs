//! gRPC with tonic: a limit on one service (through `add_service`) and one over the whole server
//! (`Server::builder().layer(...)`, each call choosing its operation by method), with every
//! operation measured until its response stream ends and its outcome read from its
//! `grpc-status`, in the headers or in the trailers. `/metrics`, in the Prometheus text format,
//! is served next to gRPC, on a port of its own.
//!
//! ```text
//! cargo run --example tonic --features tonic                  # bursts, then serve gRPC on 127.0.0.1:50051
//!                                                             # and /metrics on 127.0.0.1:9464
//! cargo run --example tonic --features tonic -- --addr 127.0.0.1:6000 --metrics-addr 127.0.0.1:6001
//! cargo run --example tonic --features tonic -- --once        # bursts, print, scrape /metrics once, exit (CI)
//! cargo run --example tonic --features tonic -- --check 127.0.0.1:50051 db   # one call, as a client
//! ```
//!
//! The service is tonic-health's generated `grpc.health.v1.Health` (so no `protoc` is needed)
//! with a `Health` of our own: a deep health check that probes the backend it is asked about
//! (`Check`, unary), and a watch that streams five probe results 30 ms apart (`Watch`,
//! server-streaming). Probes are expensive, so a limit bounds them. Client and server talk over
//! 127.0.0.1; the metrics go to an in-memory exporter, printed after each burst, and to the
//! Prometheus exporter behind `/metrics`.
//!
//! Failures injected on purpose, so that every outcome shows:
//! - the `judge` probe takes 400 ms, longer than the handler's 150 ms deadline: the handler
//!   answers DEADLINE_EXCEEDED (trailers-only), which the metrics count as `timeout`;
//! - the `cache` backend is down: its check answers UNAVAILABLE (`error`), and its watch fails
//!   after two messages with UNAVAILABLE in the trailers, which only the body-end form sees;
//! - one watch of `verifier` is hung up by its client after its first message, with no deadline:
//!   the server sees the stream reset and drops it mid-stream, which the metrics count as
//!   `cancelled` (as any call whose client leaves while it runs, before its deadline);
//! - one watch of `db` is called with a 60 ms client deadline, sent as `grpc-timeout`, and its
//!   client gives up at that deadline. Behind the burst's checks it has usually not got its permit
//!   by then: the metrics count an abandoned wait (`gym.resources.operation.abandoned`, no
//!   outcome, no queue or run time). When it has started, the drop comes at the deadline that the
//!   layer read from `grpc-timeout`, so it ends `timeout`, not `cancelled`.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::http::header::CONTENT_TYPE;
use common::Telemetry;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{Registry, TextEncoder, TEXT_FORMAT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::codegen::tokio_stream::Stream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
    REJECTED_INSTRUMENT,
};
use tower_resources_operation::per_request::{ByRoute, Choice};
use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// How long the handler lets a probe run before it answers DEADLINE_EXCEEDED.
const PROBE_DEADLINE: Duration = Duration::from_millis(150);
/// The backends clients ask about, in turn.
const BACKENDS: [&str; 4] = ["db", "verifier", "judge", "cache"];
/// Checks and watches per burst, over [`CONNECTIONS`] connections.
const CHECKS: usize = 12;
const WATCHES: usize = 6;
const CONNECTIONS: usize = 4;
/// A watch sends this many probe results, this far apart.
const WATCH_MESSAGES: u32 = 5;
const WATCH_INTERVAL: Duration = Duration::from_millis(30);

/// The gRPC handler: probes the named backend under [`PROBE_DEADLINE`].
struct Prober;

/// How long a probe of `name` takes, and whether the backend is up.
fn backend(name: &str) -> Result<(u64, bool), Status> {
    match name {
        "db" => Ok((20, true)),
        "verifier" => Ok((60, true)),
        "judge" => Ok((400, true)), // slower than the deadline
        "cache" => Ok((10, false)),
        _ => Err(Status::not_found(format!("no backend {name:?}"))),
    }
}

fn serving() -> HealthCheckResponse {
    HealthCheckResponse {
        status: ServingStatus::Serving as i32,
    }
}

#[tonic::async_trait]
impl Health for Prober {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let name = request.into_inner().service;
        let (probe_time, up) = backend(&name)?;
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
        Ok(Response::new(serving()))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    /// Five probe results, 30 ms apart; a backend that is down fails after two, with its
    /// status in the trailers.
    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let name = request.into_inner().service;
        let (_, up) = backend(&name)?;
        // The results, 30 ms apart; tonic ends the stream at the first `Err`, with its status
        // in the trailers.
        let stream = futures_util::stream::unfold(1, move |n| {
            let name = name.clone();
            async move {
                if n > WATCH_MESSAGES {
                    return None;
                }
                tokio::time::sleep(WATCH_INTERVAL).await;
                let result = if !up && n > 2 {
                    Err(Status::unavailable(format!("{name} went down")))
                } else {
                    Ok(serving())
                };
                let next = if result.is_err() {
                    WATCH_MESSAGES + 1
                } else {
                    n + 1
                };
                Some((result, next))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// `--addr HOST:PORT`, `--metrics-addr HOST:PORT`, `--once`, `--check ADDR BACKEND`.
enum Mode {
    Serve {
        addr: SocketAddr,
        metrics_addr: SocketAddr,
        once: bool,
    },
    Check {
        addr: SocketAddr,
        backend: String,
    },
}

const USAGE: &str =
    "usage: tonic [--addr 127.0.0.1:50051] [--metrics-addr 127.0.0.1:9464] [--once] \
     | --check ADDR BACKEND (db, verifier, judge, cache)";

fn parse_args() -> Result<Mode, Error> {
    let mut args = std::env::args().skip(1);
    let mut addr: SocketAddr = "127.0.0.1:50051".parse()?;
    let mut metrics_addr: SocketAddr = "127.0.0.1:9464".parse()?;
    let mut once = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().ok_or("--addr needs HOST:PORT")?.parse()?,
            "--metrics-addr" => {
                metrics_addr = args
                    .next()
                    .ok_or("--metrics-addr needs HOST:PORT")?
                    .parse()?
            }
            "--once" => once = true,
            "--check" => {
                let addr = args.next().ok_or(USAGE)?.parse()?;
                let backend = args.next().ok_or(USAGE)?;
                return Ok(Mode::Check { addr, backend });
            }
            _ => return Err(format!("unknown argument {arg:?}; {USAGE}").into()),
        }
    }
    Ok(Mode::Serve {
        addr,
        metrics_addr,
        once,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let (addr, metrics_addr, once) = match parse_args()? {
        Mode::Serve {
            addr,
            metrics_addr,
            once,
        } => (addr, metrics_addr, once),
        Mode::Check { addr, backend } => return check_once(addr, backend).await,
    };
    println!(
        "tonic example: grpc.health.v1.Health's Check (unary) and Watch (a stream of {WATCH_MESSAGES}),"
    );
    println!(
        "injected failures: judge's probe runs past the handler's deadline (timeout), cache is \
         down (error; its watch fails mid-stream), one watch's client hangs up after its first \
         message (cancelled), one watch's client gives up at its 60 ms grpc-timeout (abandoned \
         while still queued, timeout once running).\n"
    );
    // The metrics go to an in-memory exporter, printed below, and to a Prometheus registry,
    // which `/metrics` encodes. `without_units`: the names already end in `_ms`.
    let registry = Registry::new();
    let prometheus = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_units()
        .build()?;
    let telemetry = Telemetry::with_provider(
        "tonic-example",
        SdkMeterProvider::builder().with_reader(prometheus),
    );
    let metrics_addr = if once {
        SocketAddr::from(([127, 0, 0, 1], 0))
    } else {
        metrics_addr
    };
    let (metrics_addr, metrics_server) = serve_metrics(metrics_addr, registry).await?;
    println!("metrics: http://{metrics_addr}/metrics (Prometheus text)\n");

    // 1. One limit for one service. The layered service keeps the generated server's name,
    //    "grpc.health.v1.Health" (the crate's `tonic` feature forwards `NamedService`), which
    //    `add_service` needs; other services on this server would not be limited.
    //    `until_body_end`: a watch holds its permit, and counts as active, until its stream and
    //    trailers are sent; a status in the trailers decides its outcome.
    let per_service = ResourcesOperationLayer::new_for_grpc(2)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone())
        .until_body_end();
    let limited = ServiceBuilder::new()
        .layer(per_service)
        .service(HealthServer::new(Prober));
    let (incoming, local) = listen(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let server = tokio::spawn(
        Server::builder()
            .add_service(limited)
            .serve_with_incoming(incoming),
    );
    burst(
        "per service (add_service), limit 2, verify/subprocess",
        local,
    )
    .await?;
    server.abort();
    print_metrics(&telemetry);

    // 2. One limit for the whole server, each call choosing its operation by method: checks are
    //    verify/subprocess, watches judge/inline. tonic applies a server layer once, so this is
    //    one limit across every connection.
    let whole_server = ResourcesOperationLayer::new_for_grpc(3)
        .metrics(telemetry.metrics.clone())
        .until_body_end()
        .per_request(
            ByRoute::new()
                .route(
                    "grpc.health.v1.Health/Check",
                    Choice::limited(Operation::Verify, Executor::Subprocess),
                )
                .route(
                    "grpc.health.v1.Health/Watch",
                    Choice::limited(Operation::Judge, Executor::Inline),
                ),
        );
    let (incoming, local) = listen(if once {
        SocketAddr::from(([127, 0, 0, 1], 0))
    } else {
        addr
    })?;
    let router = Server::builder()
        .layer(whole_server)
        .add_service(HealthServer::new(Prober));
    let server = tokio::spawn(router.serve_with_incoming(incoming));
    burst("whole server, limit 3, operation by method", local).await?;
    print_metrics(&telemetry);

    if once {
        scrape_once(metrics_addr).await?;
        server.abort();
        metrics_server.abort();
        return Ok(());
    }
    println!(
        "\nserving gRPC on {local}, /metrics on http://{metrics_addr}, until Ctrl-C; call it with"
    );
    println!("  cargo run --example tonic --features tonic -- --check {local} db");
    println!(
        "  grpcurl -plaintext -proto health.proto -d '{{\"service\":\"judge\"}}' {local} \
         grpc.health.v1.Health/Check"
    );
    println!(
        "    (health.proto: grpc/src/proto/grpc/health/v1/health.proto in the grpc repository)"
    );
    println!("  curl -s http://{metrics_addr}/metrics | grep '^gym_'");
    tokio::signal::ctrl_c().await?;
    server.abort();
    metrics_server.abort();
    print_metrics(&telemetry);
    Ok(())
}

/// Serves `registry` in the Prometheus text format at `http://{addr}/metrics`, next to gRPC;
/// the address it listens on, and the server's task.
async fn serve_metrics(
    addr: SocketAddr,
    registry: Registry,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), Error> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let body = TextEncoder::new()
                    .encode_to_string(&registry.gather())
                    .unwrap_or_else(|error| format!("# encoding failed: {error}\n"));
                ([(CONTENT_TYPE, TEXT_FORMAT)], body)
            }
        }),
    );
    let server = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            eprintln!("/metrics server: {error}");
        }
    });
    Ok((addr, server))
}

/// `--once`: one scrape of `/metrics`, as Prometheus would make it; prints the duration
/// histogram's counts by outcome.
async fn scrape_once(addr: SocketAddr) -> Result<(), Error> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or("no HTTP response")?;
    let status = head.lines().next().unwrap_or_default();
    let samples: Vec<&str> = body.lines().filter(|l| l.starts_with("gym_")).collect();
    println!(
        "== scraped http://{addr}/metrics: {status}, {} gym_ samples; the run time's counts:",
        samples.len()
    );
    for sample in samples
        .iter()
        .filter(|l| l.starts_with("gym_resources_operation_duration_ms_count"))
    {
        println!("   {sample}");
    }
    if !status.contains(" 200 ") || samples.is_empty() {
        return Err(format!(
            "/metrics answered {status:?} with {} gym_ samples",
            samples.len()
        )
        .into());
    }
    Ok(())
}

/// `--check`: one call to a running example, as a client.
async fn check_once(addr: SocketAddr, backend: String) -> Result<(), Error> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest { service: backend })
        .await;
    match answer {
        Ok(response) => println!("{:?}", response.into_inner()),
        Err(status) => println!("{:?}: {}", status.code(), status.message()),
    }
    Ok(())
}

/// A listener on `addr`.
fn listen(addr: SocketAddr) -> Result<(TcpIncoming, SocketAddr), Error> {
    let incoming = TcpIncoming::bind(addr)?;
    let addr = incoming.local_addr()?;
    Ok((incoming, addr))
}

/// [`CHECKS`] checks and [`WATCHES`] watches at once over [`CONNECTIONS`] connections; prints
/// what the clients saw.
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
    let mut calls = Vec::new();
    for i in 0..CHECKS {
        let mut client = HealthClient::new(channels[i % CONNECTIONS].clone());
        let service = BACKENDS[i % BACKENDS.len()].to_owned();
        calls.push(tokio::spawn(async move {
            let answer = client.check(HealthCheckRequest { service }).await;
            ("check", answer.map(|_| ()).map_err(|status| status.code()))
        }));
    }
    for i in 0..WATCHES {
        let mut client = HealthClient::new(channels[i % CONNECTIONS].clone());
        // db, verifier and cache (judge's watch is as fast as the others).
        let service = ["db", "verifier", "cache"][i % 3].to_owned();
        calls.push(tokio::spawn(async move {
            let mut request = Request::new(HealthCheckRequest { service });
            let patience = (i == 0).then_some(Duration::from_millis(60));
            if let Some(patience) = patience {
                // This client gives up before the stream ends. It says so in `grpc-timeout`,
                // which the layer reads (and tonic enforces until the response head).
                request.set_timeout(patience);
            }
            // This one leaves after its first message, with no deadline: `cancelled`.
            let hang_up = i == 1;
            let watched = async {
                let mut stream = client.watch(request).await?.into_inner();
                while stream.message().await?.is_some() {
                    if hang_up {
                        // Dropping the stream resets it: the server drops the call mid-stream.
                        return Err(Status::cancelled("hung up after the first message"));
                    }
                }
                Ok::<_, Status>(())
            };
            let answer = match patience {
                Some(patience) => tokio::time::timeout(patience, watched)
                    .await
                    .unwrap_or_else(|_| Err(Status::deadline_exceeded("gave up"))),
                None => watched.await,
            };
            ("watch", answer.map_err(|status| status.code()))
        }));
    }
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for call in calls {
        let (method, answer) = call.await?;
        let code = answer.err().unwrap_or(tonic::Code::Ok);
        *seen.entry(format!("{method} {code:?}")).or_default() += 1;
    }
    let seen: Vec<_> = seen
        .iter()
        .map(|(code, n)| format!("{code} x{n}"))
        .collect();
    println!("== {title}");
    println!(
        "   {CHECKS} checks and {WATCHES} watches in {} ms; clients saw {}",
        started.elapsed().as_millis(),
        seen.join(", ")
    );
    // Let the server notice the clients that left, so their operations have ended.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics back, from the in-memory pipeline of `common`.

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

/// Prints what the metrics say, cumulative: per series ("operation/executor") the queue
/// histogram under outcome "" and the duration histogram under each outcome, and the live counts
/// summed over all series.
fn print_metrics(telemetry: &Telemetry) {
    let mut points: BTreeMap<(String, String), Point> = BTreeMap::new();
    let mut live: BTreeMap<String, i64> = BTreeMap::new();
    telemetry.read(|metric| match metric.data() {
        AggregatedMetrics::F64(MetricData::Histogram(h)) => {
            for p in h.data_points() {
                let attr = |key: &str| {
                    p.attributes()
                        .find(|kv| kv.key.as_str() == key)
                        .map(|kv| kv.value.to_string())
                        .unwrap_or_default()
                };
                let series = format!("{}/{}", attr(OPERATION_ATTRIBUTE), attr(EXECUTOR_ATTRIBUTE));
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
        AggregatedMetrics::U64(MetricData::Sum(s)) => {
            let total: u64 = s.data_points().map(|p| p.value()).sum();
            let total = i64::try_from(total).unwrap_or(i64::MAX);
            *live.entry(metric.name().to_owned()).or_default() += total;
        }
        _ => {}
    });

    println!("   exported so far:");
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
    let get = |name: &str| live.get(name).copied().unwrap_or_default();
    println!(
        "   given up while queued (abandoned): {}; turned away (rejected): {}",
        get(ABANDONED_INSTRUMENT),
        get(REJECTED_INSTRUMENT)
    );
    println!(
        "   live now: queued {}, active {}\n",
        get(QUEUED_INSTRUMENT),
        get(ACTIVE_INSTRUMENT)
    );
}
