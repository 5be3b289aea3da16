//! One limit for a whole fleet: three replicas, each a process of its own, share a limit of 4
//! judge calls at once through a local Redis, and each prints what its metrics say.
//!
//! ```text
//! cargo run -p tower-resources-operation-redis --example fleet
//! ```
//!
//! It starts a `redis-server` of its own on a free port of 127.0.0.1 (with no persistence), then
//! this program three more times as replicas. Each replica sends a burst of 40 operations, 12 at
//! once, through an HTTP layer on the fleet limit, and prints, from its own exported metrics
//! only, its queue time, run time, outcomes, rejections and the `limit` gauge. Meanwhile this
//! process watches the fleet in Redis (the sum of `active` over the replicas against the fleet's
//! capacity), and halfway raises the capacity to 6 for the whole fleet.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, LIMIT_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
};
use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};
use tower_resources_operation_redis::metrics::FAILED_OPEN_INSTRUMENT;
use tower_resources_operation_redis::RedisLimit;

const NAME: &str = "judges";
const CAPACITY: usize = 4;
const RAISED: usize = 6;
const REPLICAS: usize = 3;
const OPERATIONS: usize = 40;
const AT_ONCE: usize = 12;
const WORK: Duration = Duration::from_millis(50);

fn main() {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next(), args.next()) {
        (Some("--replica"), Some(index), Some(url)) => replica(&index, &url),
        _ => fleet(),
    }
}

/// The fleet: Redis, three replicas, and the watch on Redis.
fn fleet() {
    let Some(mut redis) = start_redis() else {
        eprintln!(
            "redis-server was not found on PATH. Install it (Debian/Ubuntu: \
             `apt-get install redis-server`) and run this example again."
        );
        std::process::exit(1);
    };
    let url = format!("redis://127.0.0.1:{}/", redis.1);
    println!(
        "tower-resources-operation fleet example: {REPLICAS} replicas share the limit {NAME:?} of \
         {CAPACITY} through redis-server on 127.0.0.1:{}.",
        redis.1
    );
    println!(
        "Each sends {OPERATIONS} judge calls, {AT_ONCE} at once, {} ms each; halfway the \
         capacity is raised to {RAISED} for the whole fleet.\n",
        WORK.as_millis()
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Built within the runtime: its background task is spawned there.
    let watch = {
        let _runtime = runtime.enter();
        RedisLimit::builder(NAME, CAPACITY).build(&url).unwrap()
    };
    runtime.block_on(watch.ready()).expect("the local Redis");

    let me = std::env::current_exe().unwrap();
    let replicas: Vec<Child> = (1..=REPLICAS)
        .map(|index| {
            Command::new(&me)
                .args(["--replica", &index.to_string(), &url])
                .stdout(Stdio::piped())
                .spawn()
                .expect("start a replica")
        })
        .collect();

    // Watch the fleet in Redis while the replicas run.
    let started = Instant::now();
    let (mut most_active, mut most_queued, mut raised) = (0, 0, false);
    let mut running = replicas;
    let mut outputs = Vec::new();
    while !running.is_empty() {
        let fleet = runtime.block_on(watch.fleet()).expect("the fleet");
        most_active = most_active.max(fleet.active);
        most_queued = most_queued.max(fleet.queued);
        if !raised && fleet.queued > 0 && started.elapsed() > Duration::from_millis(600) {
            runtime.block_on(watch.set_capacity(RAISED)).unwrap();
            raised = true;
            println!(
                "[{:>5} ms] the operator raises the fleet's capacity to {RAISED}: {} wait, {} run",
                started.elapsed().as_millis(),
                fleet.queued,
                fleet.active
            );
        }
        let mut still = Vec::new();
        for mut child in running {
            match child.try_wait().unwrap() {
                Some(_) => outputs.push(child),
                None => still.push(child),
            }
        }
        running = still;
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "[{:>5} ms] every replica is done. Seen in Redis meanwhile: at most {most_active} \
         operations held the fleet's places at once (capacity {CAPACITY}, then {RAISED}), at \
         most {most_queued} waited in its queue.\n",
        started.elapsed().as_millis()
    );
    for child in outputs {
        for line in BufReader::new(child.stdout.expect("piped")).lines() {
            println!("{}", line.unwrap());
        }
    }
    let fleet = runtime.block_on(watch.fleet()).unwrap();
    println!(
        "\nThe fleet now: capacity {}, {} held, {} waiting. Each replica's `limit` gauge is the \
         fleet's capacity; its `active` is its own share, so a dashboard sums `active` over \
         instances against `limit` (the fleet row of dashboards/grafana).",
        fleet.capacity, fleet.active, fleet.queued
    );
    redis.0.kill().ok();
    redis.0.wait().ok();
}

/// A `redis-server` on a free port, or `None` if there is none to start.
fn start_redis() -> Option<(Child, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
        .stdout(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Some((child, port))
}

/// One replica: a burst through an HTTP layer on the fleet limit, then what its metrics say.
fn replica(index: &str, url: &str) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let t = Telemetry::new("fleet-replica");
        let limit = RedisLimit::builder(NAME, CAPACITY)
            .lease_ttl(Duration::from_secs(5))
            .meter(&t.provider.meter("fleet-replica"))
            .build(url)
            .unwrap();
        let service = ResourcesOperationLayer::new_for_http(limit.clone())
            .operation(Operation::Judge)
            .executor(Executor::Inline)
            .metrics(t.metrics.clone())
            .layer(service_fn(|_: Request<()>| async {
                tokio::time::sleep(WORK).await;
                Ok::<_, std::convert::Infallible>(Response::new(String::new()))
            }));
        let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
        let mut calls = Vec::new();
        for _ in 0..OPERATIONS {
            let slot = std::sync::Arc::clone(&slots).acquire_owned().await.unwrap();
            let service = service.clone();
            calls.push(tokio::spawn(async move {
                let response = service.oneshot(Request::new(())).await.unwrap();
                drop(slot);
                response.status()
            }));
        }
        let mut answered_503 = 0;
        for call in calls {
            if call.await.unwrap() == StatusCode::SERVICE_UNAVAILABLE {
                answered_503 += 1;
            }
        }
        print_metrics(&t, index, answered_503);
    });
}

/// What one replica's metrics say.
fn print_metrics(t: &Telemetry, index: &str, answered_503: usize) {
    let (mut queue, mut run) = ((0, 0.0, 0.0_f64), (0, 0.0, 0.0_f64));
    let (mut limit, mut rejected, mut failed_open) = (0, 0, 0);
    t.read(|metric| match (metric.name(), metric.data()) {
        (QUEUE_DURATION_INSTRUMENT, AggregatedMetrics::F64(MetricData::Histogram(h)))
        | (DURATION_INSTRUMENT, AggregatedMetrics::F64(MetricData::Histogram(h))) => {
            let into = if metric.name() == QUEUE_DURATION_INSTRUMENT {
                &mut queue
            } else {
                &mut run
            };
            for point in h.data_points() {
                into.0 += point.count();
                into.1 += point.sum();
                into.2 = into.2.max(point.max().unwrap_or(0.0));
            }
        }
        (LIMIT_INSTRUMENT, AggregatedMetrics::I64(MetricData::Gauge(g))) => {
            limit = g.data_points().map(|p| p.value()).sum();
        }
        (REJECTED_INSTRUMENT, AggregatedMetrics::U64(MetricData::Sum(s))) => {
            rejected = s.data_points().map(|p| p.value()).sum();
        }
        (FAILED_OPEN_INSTRUMENT, AggregatedMetrics::U64(MetricData::Sum(s))) => {
            failed_open = s.data_points().map(|p| p.value()).sum();
        }
        _ => {}
    });
    let mean = |(count, sum, _): (u64, f64, f64)| if count == 0 { 0.0 } else { sum / count as f64 };
    println!(
        "replica {index}: {} admitted, queue time mean {:>5.1} ms (max {:>5.1}), run time mean \
         {:>4.1} ms; {rejected} turned away ({answered_503} answered 503), {failed_open} admitted \
         failing open; `limit` gauge {limit} (the fleet's)",
        queue.0,
        mean(queue),
        queue.2,
        mean(run),
    );
}

/// The crate's metrics on a provider with an in-memory exporter, read back on demand.
struct Telemetry {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
    metrics: OperationMetrics,
}

impl Telemetry {
    /// The crate's metrics on the meter `meter` of a provider of their own.
    fn new(meter: &'static str) -> Self {
        let exporter = InMemoryMetricExporterBuilder::new().build();
        // An hour apart: in practice the reader exports only when `read` flushes it.
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        let provider = SdkMeterProvider::builder().with_reader(reader).build();
        let metrics = OperationMetrics::new(&provider.meter(meter));
        Self {
            provider,
            exporter,
            metrics,
        }
    }

    /// Flushes the instruments and hands each one's data as of now (cumulative) to `read`.
    fn read(&self, read: impl FnMut(&Metric)) {
        self.exporter.reset();
        self.provider.force_flush().expect("flush metrics");
        let exported = self.exporter.get_finished_metrics().expect("read metrics");
        exported
            .iter()
            .flat_map(|resource| resource.scope_metrics())
            .flat_map(|scope| scope.metrics())
            .for_each(read);
    }
}
