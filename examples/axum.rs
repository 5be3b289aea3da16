//! An axum server with a limit per route, a Prometheus `/metrics` endpoint and, when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OTLP (gRPC) exporter as well.
//!
//! ```text
//! cargo run --example axum -- --addr 127.0.0.1:3000 --load
//! curl -s http://127.0.0.1:3000/metrics | grep '^gym_'
//! OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 cargo run --example axum -- --load
//! ```
//!
//! - `/verify` (verify, subprocess) and `/judge` (judge, inline) share one limit: two layers made
//!   `new_for_http` from clones of one `Limit`. `/verify` enforces its own deadline with
//!   `tokio::time::timeout` and, when it hits it, answers a fallback and calls
//!   `set_outcome(Outcome::Timeout)`.
//! - `/tool` (tool, thread) runs its work in `spawn_blocking` under a limit of its own
//!   (`new_for_http` with a number).
//! - Every route takes `?ms=N` (how long the work takes) and `?fail=1` (the work fails: 500,
//!   recorded as `error`).
//! - `/metrics` is the Prometheus text format, from `opentelemetry-prometheus` built
//!   `without_units()`, so the series are `gym_resources_operation_duration_ms_bucket`, not
//!   `..._duration_ms_milliseconds_bucket`. Dots become underscores (`nemo.gym.resources.operation`
//!   is the label `nemo_gym_resources_operation`); the histograms are `_bucket`/`_sum`/`_count`,
//!   the live counts and the limit gauges, and the two counters (rejected, abandoned) end in
//!   `_total`. The exporter adds an `otel_scope_name="tower-resources-operation"` label to every
//!   series (`scope_info_enabled(false)` drops it) and a `target_info` gauge with the resource
//!   (`without_target_info()` drops it).
//!
//! `--load` sends a burst of requests to the server itself, so the metrics have data, then keeps
//! serving. The tests `prometheus_export`, `prometheus_server` and `otlp_export` include this file
//! as a module and run [`app`] in-process.

use std::collections::BTreeMap;
use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::Resource;
use prometheus::{Registry, TextEncoder, TEXT_FORMAT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_resources_operation::names::METER_NAME;
use tower_resources_operation::{
    set_outcome, Executor, Limit, Operation, OperationMetrics, Outcome, ResourcesOperationLayer,
};

/// An error from setting up or running the example.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// The standard variable that turns on the OTLP exporter (read by `opentelemetry-otlp` too).
pub const OTLP_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The limits and the verifier's deadline.
#[derive(Clone, Debug)]
pub struct Config {
    /// Slots shared by `/verify` and `/judge`.
    pub shared_limit: usize,
    /// Slots of `/tool`.
    pub tool_limit: usize,
    /// How long `/verify` lets its verifier run before it answers "unverified" (outcome
    /// `timeout`).
    pub verify_deadline: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            shared_limit: 4,
            tool_limit: 2,
            verify_deadline: Duration::from_millis(250),
        }
    }
}

/// The OpenTelemetry pipeline: a Prometheus registry read by `/metrics`, optionally an OTLP
/// exporter, and the crate's metrics on one meter of that provider.
pub struct Telemetry {
    /// Keep it alive as long as the app: dropping it shuts the readers down.
    pub provider: SdkMeterProvider,
    /// What `/metrics` encodes.
    pub registry: Registry,
    /// Shared by every limit of the app.
    pub metrics: OperationMetrics,
    /// Where an OTLP exporter pushes the same metrics too, if anywhere.
    pub otlp_endpoint: Option<String>,
}

impl Telemetry {
    /// Prometheus, plus OTLP over gRPC to `otlp_endpoint` (e.g. `http://127.0.0.1:4317`) if
    /// given. The OTLP exporter reads the rest of its settings (headers, timeout, ...) from the
    /// standard `OTEL_EXPORTER_OTLP_*` variables; it pushes every `OTEL_METRIC_EXPORT_INTERVAL`
    /// (default 60 s) and on `provider.force_flush()`. Call it inside a tokio runtime: the gRPC
    /// channel lives on it.
    pub fn new(otlp_endpoint: Option<String>) -> Result<Self, BoxError> {
        let registry = Registry::new();
        // `without_units`: the instruments already say their unit in their names (`..._ms`);
        // by default the exporter appends `_milliseconds`.
        let prometheus = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_units()
            .build()?;
        let resource = match std::env::var("OTEL_SERVICE_NAME") {
            Ok(_) => Resource::builder().build(),
            Err(_) => Resource::builder()
                .with_service_name("tower-resources-operation-example")
                .build(),
        };
        let mut provider = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(prometheus);
        if let Some(endpoint) = &otlp_endpoint {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()?;
            provider = provider.with_periodic_exporter(exporter);
        }
        let provider = provider.build();
        let metrics = OperationMetrics::new(&provider.meter(METER_NAME));
        Ok(Self {
            provider,
            registry,
            metrics,
            otlp_endpoint,
        })
    }

    /// [`Telemetry::new`] with OTLP on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and not empty.
    pub fn from_env() -> Result<Self, BoxError> {
        let endpoint = std::env::var(OTLP_ENDPOINT_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty());
        Self::new(endpoint)
    }
}

/// The app: three limited routes and `/metrics`.
pub fn app(config: &Config, telemetry: &Telemetry) -> Router {
    let shared = Limit::new(config.shared_limit);
    let shared_limit = |operation, executor| {
        ResourcesOperationLayer::new_for_http(shared.clone())
            .operation(operation)
            .executor(executor)
            .metrics(telemetry.metrics.clone())
    };
    let tool_limit = ResourcesOperationLayer::new_for_http(config.tool_limit)
        .operation(Operation::Tool)
        .executor(Executor::Thread)
        .metrics(telemetry.metrics.clone());
    let deadline = config.verify_deadline;
    let registry = telemetry.registry.clone();

    Router::new()
        .route(
            "/verify",
            get(move |uri: Uri| verify(deadline, uri))
                .layer(shared_limit(Operation::Verify, Executor::Subprocess)),
        )
        .route(
            "/judge",
            get(judge).layer(shared_limit(Operation::Judge, Executor::Inline)),
        )
        .route("/tool", get(tool).layer(tool_limit))
        .route("/metrics", get(move || metrics(registry.clone())))
}

/// What a request asks of its work: `?ms=N` and `?fail=1`.
#[derive(Clone, Copy, Debug)]
struct Work {
    duration: Duration,
    fail: bool,
}

impl Work {
    fn from_uri(uri: &Uri) -> Self {
        let mut work = Work {
            duration: Duration::from_millis(50),
            fail: false,
        };
        for pair in uri.query().unwrap_or_default().split('&') {
            match pair.split_once('=') {
                Some(("ms", ms)) => {
                    if let Ok(ms) = ms.parse() {
                        work.duration = Duration::from_millis(ms);
                    }
                }
                Some(("fail", flag)) => work.fail = flag == "1" || flag == "true",
                _ => {}
            }
        }
        work
    }
}

/// Stands in for a verifier subprocess. When it runs past the deadline, the handler answers a
/// fallback (200: the caller gets "unverified") and says it timed out, which the status alone
/// would not show.
async fn verify(deadline: Duration, uri: Uri) -> (StatusCode, &'static str) {
    let work = Work::from_uri(&uri);
    match tokio::time::timeout(deadline, tokio::time::sleep(work.duration)).await {
        Err(_) => {
            set_outcome(Outcome::Timeout);
            (
                StatusCode::OK,
                "unverified: the verifier ran past its deadline\n",
            )
        }
        Ok(()) if work.fail => (StatusCode::INTERNAL_SERVER_ERROR, "verifier failed\n"),
        Ok(()) => (StatusCode::OK, "verified\n"),
    }
}

/// Stands in for a judge call made on the request's task.
async fn judge(uri: Uri) -> (StatusCode, &'static str) {
    let work = Work::from_uri(&uri);
    tokio::time::sleep(work.duration).await;
    if work.fail {
        (StatusCode::INTERNAL_SERVER_ERROR, "judge failed\n")
    } else {
        (StatusCode::OK, "judged\n")
    }
}

/// Stands in for a blocking tool, run on tokio's blocking pool.
async fn tool(uri: Uri) -> (StatusCode, &'static str) {
    let work = Work::from_uri(&uri);
    let ran = tokio::task::spawn_blocking(move || {
        std::thread::sleep(work.duration);
        !work.fail
    })
    .await;
    match ran {
        Ok(true) => (StatusCode::OK, "tool ran\n"),
        Ok(false) => (StatusCode::INTERNAL_SERVER_ERROR, "tool failed\n"),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "tool panicked\n"),
    }
}

/// The registry in the Prometheus text format (version 0.0.4).
async fn metrics(registry: Registry) -> Response {
    match TextEncoder::new().encode_to_string(&registry.gather()) {
        Ok(body) => ([(header::CONTENT_TYPE, TEXT_FORMAT)], body).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// One `GET` on its own connection (`Connection: close`, read to the end); the status and the
/// body. Send `HTTP/1.0` to servers that would answer HTTP/1.1 chunked (Go's, e.g. Prometheus).
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    version: &str,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let head = format!("GET {path} {version}\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("no HTTP status line in {head:?}"),
            )
        })?;
    Ok((status, body.to_owned()))
}

/// Sends every path at once, each on its own connection; the status of each, in order (0 for a
/// request that failed at the socket).
pub async fn burst(addr: SocketAddr, paths: &[impl AsRef<str>]) -> Vec<u16> {
    let clients: Vec<_> = paths
        .iter()
        .map(|path| path.as_ref().to_owned())
        .map(|path| tokio::spawn(async move { http_get(addr, &path, "HTTP/1.1").await }))
        .collect();
    let mut statuses = Vec::with_capacity(clients.len());
    for client in clients {
        statuses.push(match client.await {
            Ok(Ok((status, _))) => status,
            _ => 0,
        });
    }
    statuses
}

/// The `--load` burst: 48 verifies (every 10th past the deadline, every 11th failing), 24 judge
/// calls and 12 tool runs, all at once, so the shared limit of 4 binds.
pub fn demo_load() -> Vec<String> {
    let mut paths = Vec::new();
    for id in 1..=48u64 {
        let ms = if id % 10 == 0 {
            400
        } else {
            40 + id * 37 % 120
        };
        let fail = u8::from(id % 11 == 0);
        paths.push(format!("/verify?ms={ms}&fail={fail}"));
    }
    for id in 1..=24u64 {
        paths.push(format!("/judge?ms={}", 20 + id * 13 % 40));
    }
    for id in 1..=12u64 {
        paths.push(format!("/tool?ms={}", 50 + id * 17 % 50));
    }
    paths
}

/// `--addr HOST:PORT` and `--load`.
struct Args {
    addr: SocketAddr,
    load: bool,
}

const USAGE: &str = "usage: axum [--addr 127.0.0.1:3000] [--load]";

fn parse_args() -> Result<Option<Args>, BoxError> {
    let mut addr = "127.0.0.1:3000".to_owned();
    let mut load = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().ok_or("--addr needs HOST:PORT")?,
            "--load" => load = true,
            "-h" | "--help" => return Ok(None),
            other => match other.strip_prefix("--addr=") {
                Some(value) => addr = value.to_owned(),
                None => return Err(format!("unknown argument {other:?}; {USAGE}").into()),
            },
        }
    }
    let addr = addr.parse().map_err(|e| format!("--addr {addr:?}: {e}"))?;
    Ok(Some(Args { addr, load }))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let Some(args) = parse_args()? else {
        println!("{USAGE}");
        return Ok(());
    };
    let config = Config::default();
    let telemetry = Telemetry::from_env()?;
    let listener = TcpListener::bind(args.addr).await?;
    let addr = listener.local_addr()?;
    let router = app(&config, &telemetry);
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    println!(
        "listening on http://{addr}: /verify, /judge (share {} slots), /tool ({} slots), /metrics",
        config.shared_limit, config.tool_limit
    );
    if let Some(endpoint) = &telemetry.otlp_endpoint {
        println!("exporting OTLP/gRPC to {endpoint} as well");
    }

    if args.load {
        let paths = demo_load();
        let statuses = burst(addr, &paths).await;
        let mut seen: BTreeMap<u16, usize> = BTreeMap::new();
        for status in statuses {
            *seen.entry(status).or_default() += 1;
        }
        println!("--load: sent {} requests; statuses: {seen:?}", paths.len());
        let (_, body) = http_get(addr, "/metrics", "HTTP/1.1").await?;
        for line in body.lines().filter(|l| {
            l.starts_with("gym_resources_operation_duration_ms_count")
                || l.starts_with("gym_resources_operation_queued")
                || l.starts_with("gym_resources_operation_active")
        }) {
            println!("  {line}");
        }
    }
    println!("curl -s http://{addr}/metrics   (Ctrl-C to stop)");

    server.await??;
    Ok(())
}
