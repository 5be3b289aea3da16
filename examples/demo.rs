//! The main job: an axum server whose two routes share a limit, a burst of requests, and what
//! the metrics say about the limit.
//!
//! ```text
//! cargo run --example demo
//! ```
//!
//! It runs the same burst against a limit of 2, 8 and 48, then against a limit of 2 that bounds
//! its waiting (at most 8 queued, none for more than 250 ms: the rest are answered `503` with
//! `Retry-After`), on 127.0.0.1 with an in-memory OpenTelemetry exporter (no collector needed).
//! For each run it prints, from the exported metrics only, per operation the queue time next to
//! the run time, per outcome the count and run time, the limit's capacity, the operations turned
//! away and the waits given up, and what that says about the limit.
//!
//! Failures injected on purpose, so that every outcome shows: every 9th verify runs past the
//! handler's 150 ms deadline (the handler answers a fallback and calls `set_outcome(Timeout)`),
//! every 11th fails (`500`, `error`), and every 8th client hangs up after 400 ms, in the queue or
//! while its request runs.
//!
//! Last, an adaptive limit: `/verify` in front of a backend of 6 sandboxes, through a limit that
//! starts at 1 and finds how many the backend takes, printed every half second from the limit's own
//! instruments (its capacity, what it holds and keeps waiting, and the controller's baseline and
//! estimate of the run time).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::{StatusCode, Uri};
use axum::routing::get;
use axum::Router;
use common::Telemetry;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_resources_operation::adaptive::{Adaptive, Vegas};
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE, LIMIT_BASELINE_INSTRUMENT, LIMIT_CAPACITY_INSTRUMENT,
    LIMIT_ESTIMATE_INSTRUMENT, LIMIT_INSTRUMENT, LIMIT_QUEUED_INSTRUMENT, OPERATION_ATTRIBUTE,
    OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
    REJECTION_ATTRIBUTE,
};
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{
    set_outcome, Acquire, Executor, Limit, Operation, OperationMetrics, Outcome,
    ResourcesOperationLayer,
};

const VERIFY_REQUESTS: u32 = 32;
const JUDGE_REQUESTS: u32 = 16;
/// How long an impatient client waits before it hangs up.
const CLIENT_PATIENCE: Duration = Duration::from_millis(400);
/// How long the verifier may run before the handler gives up on it.
const VERIFY_DEADLINE: Duration = Duration::from_millis(150);
/// The bounded run: at most this many wait for the limit...
const MAX_QUEUED: usize = 8;
/// ...and none for longer than this.
const QUEUE_TIMEOUT: Duration = Duration::from_millis(250);

/// One run: the limit's capacity, and whether it bounds its waiting.
#[derive(Clone, Copy)]
struct Run {
    capacity: usize,
    bounded: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "tower-resources-operation demo: /verify (verify, subprocess) and /judge (judge, inline)"
    );
    println!(
        "share one limit; {} + {} requests arrive at once; every 8th client hangs up after {} ms.\n",
        VERIFY_REQUESTS,
        JUDGE_REQUESTS,
        CLIENT_PATIENCE.as_millis()
    );
    for capacity in [2, 8, 48] {
        let bounded = false;
        run_burst(Run { capacity, bounded }).await.print();
    }
    println!(
        "and once more with a limit of 2 that bounds its waiting: at most {MAX_QUEUED} queued, \
         none for more than {} ms (the rest get 503 + Retry-After).\n",
        QUEUE_TIMEOUT.as_millis()
    );
    run_burst(Run {
        capacity: 2,
        bounded: true,
    })
    .await
    .print();
    adaptive_run().await;
}

/// The server: two routes, one limit, one layer per route with its own tags. `limit` is a
/// [`Limit`], or one that bounds its waiting; either way a rejection is answered `503` with
/// `Retry-After`.
fn app(limit: &Limit, queue_timeout: Option<Duration>, metrics: &OperationMetrics) -> Router {
    let tagged = |operation, executor| {
        ResourcesOperationLayer::new_for_http(limit.clone())
            .operation(operation)
            .executor(executor)
            .metrics(metrics.clone())
            .protocol(Http::new().retry_after(Duration::from_secs(1)))
            .queue_timeout(queue_timeout)
    };
    Router::new()
        .route(
            "/verify",
            get(verify).layer(tagged(Operation::Verify, Executor::Subprocess)),
        )
        .route(
            "/judge",
            get(judge).layer(tagged(Operation::Judge, Executor::Inline)),
        )
}

/// The request's `id` query parameter, which makes each request's work reproducible.
fn request_id(uri: &Uri) -> u32 {
    uri.query()
        .and_then(|q| q.strip_prefix("id="))
        .and_then(|id| id.parse().ok())
        .unwrap_or(0)
}

/// A verifier that usually takes 40 to 120 ms, sometimes fails, and sometimes runs past the
/// handler's deadline, which the handler reports with `set_outcome`.
async fn verify(uri: Uri) -> (StatusCode, &'static str) {
    let id = request_id(&uri);
    let work =
        Duration::from_millis(40 + u64::from(id * 37 % 80) + if id % 9 == 0 { 200 } else { 0 });
    match tokio::time::timeout(VERIFY_DEADLINE, tokio::time::sleep(work)).await {
        Err(_) => {
            set_outcome(Outcome::Timeout);
            (
                StatusCode::OK,
                "verifier timed out; answer marked unverified\n",
            )
        }
        Ok(()) if id % 11 == 0 => (StatusCode::INTERNAL_SERVER_ERROR, "verifier crashed\n"),
        Ok(()) => (StatusCode::OK, "verified\n"),
    }
}

/// A judge call of 20 to 60 ms.
async fn judge(uri: Uri) -> &'static str {
    let id = request_id(&uri);
    tokio::time::sleep(Duration::from_millis(20 + u64::from(id * 13 % 40))).await;
    "judged\n"
}

async fn run_burst(run: Run) -> Report {
    let telemetry = Telemetry::new("demo");
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1");
    let addr = listener.local_addr().expect("local addr");
    let app = if run.bounded {
        // The bound is the limit's, the timeout the layers': past either, a request is turned
        // away.
        let limit = Limit::with_max_queued(run.capacity, MAX_QUEUED);
        app(&limit, Some(QUEUE_TIMEOUT), &telemetry.metrics)
    } else {
        app(&Limit::new(run.capacity), None, &telemetry.metrics)
    };
    let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("server") });

    let started = Instant::now();
    let mut clients = Vec::new();
    for id in 1..=VERIFY_REQUESTS {
        clients.push(tokio::spawn(request(addr, "verify", id)));
    }
    for id in 1..=JUDGE_REQUESTS {
        clients.push(tokio::spawn(request(addr, "judge", id)));
    }

    // Sample the live counts while the burst drains, as a scrape every 20 ms would.
    let mut peak_queued = 0;
    let mut peak_active = 0;
    while clients.iter().any(|c| !c.is_finished()) {
        let snapshot = Snapshot::of(&telemetry);
        peak_queued = peak_queued.max(snapshot.live(QUEUED_INSTRUMENT));
        peak_active = peak_active.max(snapshot.live(ACTIVE_INSTRUMENT));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut statuses: BTreeMap<String, u32> = BTreeMap::new();
    for client in clients {
        *statuses
            .entry(client.await.expect("client task"))
            .or_default() += 1;
    }
    let wall = started.elapsed();
    // Let the server notice the clients that hung up, so their operations have ended.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let snapshot = Snapshot::of(&telemetry);
    server.abort();

    Report {
        run,
        wall,
        statuses,
        peak_queued,
        peak_active,
        snapshot,
    }
}

/// One client on its own connection; every 8th gives up after [`CLIENT_PATIENCE`].
async fn request(addr: SocketAddr, route: &str, id: u32) -> String {
    let send = async {
        let mut stream = TcpStream::connect(addr).await?;
        let head =
            format!("GET /{route}?id={id} HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let status = String::from_utf8_lossy(&response)
            .split_whitespace()
            .nth(1)
            .unwrap_or("?")
            .to_owned();
        Ok::<_, std::io::Error>(status)
    };
    if id % 8 == 0 {
        match tokio::time::timeout(CLIENT_PATIENCE, send).await {
            Ok(Ok(status)) => status,
            Ok(Err(e)) => format!("io error: {e}"),
            Err(_) => "hung up".to_owned(),
        }
    } else {
        send.await.unwrap_or_else(|e| format!("io error: {e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// An adaptive limit finds its capacity.

/// Sandboxes the verification backend runs at once; more wait inside it.
const SANDBOXES: usize = 6;
/// How long one verification takes in a sandbox.
const SANDBOX_WORK: Duration = Duration::from_millis(40);
/// Clients, each sending its next request as soon as the last is answered.
const BUSY_CLIENTS: u32 = 24;
/// How long they keep at it.
const ADAPTIVE_RUN: Duration = Duration::from_secs(6);

async fn adaptive_run() {
    println!(
        "and last, an adaptive limit: /verify in front of a backend of {SANDBOXES} sandboxes \
         ({} ms per verification; more at once wait inside the backend), {BUSY_CLIENTS} clients \
         that keep it busy for {} s. The limit starts at 1.\n",
        SANDBOX_WORK.as_millis(),
        ADAPTIVE_RUN.as_secs()
    );
    let telemetry = Telemetry::new("demo");
    let verifiers = Limit::builder(1)
        .name("verifiers")
        .adaptive(Adaptive::new(Vegas::default(), 1..=32))
        .build();
    let sandboxes = std::sync::Arc::new(tokio::sync::Semaphore::new(SANDBOXES));
    let app = Router::new().route(
        "/verify",
        get(move || async move {
            let _sandbox = sandboxes.acquire().await.expect("open");
            tokio::time::sleep(SANDBOX_WORK).await;
            "verified\n"
        })
        .layer(
            ResourcesOperationLayer::new_for_http(verifiers.clone())
                .operation(Operation::Verify)
                .executor(Executor::Subprocess)
                .metrics(telemetry.metrics.clone()),
        ),
    );
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1");
    let addr = listener.local_addr().expect("local addr");
    let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("server") });

    let started = Instant::now();
    let clients: Vec<_> = (0..BUSY_CLIENTS)
        .map(|client| {
            tokio::spawn(async move {
                let mut id = client * 10_000;
                while started.elapsed() < ADAPTIVE_RUN {
                    // Ids that are never a multiple of 8: these clients do not hang up.
                    id += 1;
                    request(addr, "verify", id * 8 + 1).await;
                }
            })
        })
        .collect();

    println!("   from gym.resources.limit.* with nemo.gym.resources.limit = verifiers:");
    println!(
        "   {:>6} {:>8} {:>6} {:>6} {:>9} {:>9}",
        "t", "capacity", "active", "queued", "baseline", "estimate"
    );
    let mut settled = Vec::new();
    while started.elapsed() < ADAPTIVE_RUN {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let limit = LimitReading::of(&telemetry, "verifiers");
        println!(
            "   {:>4.2} s {:>8} {:>6} {:>6} {:>9} {:>9}",
            started.elapsed().as_secs_f64(),
            limit.capacity,
            limit.active,
            limit.queued,
            limit.baseline_ms.map_or("-".to_owned(), ms),
            limit.estimate_ms.map_or("-".to_owned(), ms),
        );
        if started.elapsed() >= ADAPTIVE_RUN / 2 {
            settled.push(limit.capacity);
        }
    }
    for client in clients {
        client.await.expect("client task");
    }
    server.abort();

    let mean = settled.iter().sum::<i64>() as f64 / settled.len().max(1) as f64;
    let (low, high) = (
        settled.iter().min().copied().unwrap_or(0),
        settled.iter().max().copied().unwrap_or(0),
    );
    println!(
        "   what it says: the limit found its capacity: {low} to {high} in the last {} s \
         (mean {mean:.1}), for a backend that serves {SANDBOXES} at once. Past that, the run time \
         climbs above its baseline (the run time at low load) and the controller backs off; it \
         stays a little above, keeping 1 to 3 waiting at the backend so that it never idles.\n",
        (ADAPTIVE_RUN / 2).as_secs()
    );
}

/// Whether a point's `attributes` are those of the limit `name`.
fn of_limit<'a>(
    mut attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>,
    name: &str,
) -> bool {
    attributes.any(|kv| kv.key.as_str() == LIMIT_ATTRIBUTE && kv.value.as_str() == name)
}

/// What a named limit reports now.
#[derive(Debug, Default)]
struct LimitReading {
    capacity: i64,
    active: i64,
    queued: i64,
    baseline_ms: Option<f64>,
    estimate_ms: Option<f64>,
}

impl LimitReading {
    fn of(telemetry: &Telemetry, name: &str) -> Self {
        let mut reading = LimitReading::default();
        telemetry.read(|metric| match metric.data() {
            AggregatedMetrics::I64(MetricData::Gauge(gauge)) => {
                for point in gauge.data_points() {
                    if of_limit(point.attributes(), name)
                        && metric.name() == LIMIT_CAPACITY_INSTRUMENT
                    {
                        reading.capacity = point.value();
                    }
                }
            }
            AggregatedMetrics::I64(MetricData::Sum(sum)) => {
                for point in sum.data_points() {
                    if of_limit(point.attributes(), name) {
                        match metric.name() {
                            LIMIT_ACTIVE_INSTRUMENT => reading.active = point.value(),
                            LIMIT_QUEUED_INSTRUMENT => reading.queued = point.value(),
                            _ => {}
                        }
                    }
                }
            }
            AggregatedMetrics::F64(MetricData::Gauge(gauge)) => {
                for point in gauge.data_points() {
                    if of_limit(point.attributes(), name) {
                        match metric.name() {
                            LIMIT_BASELINE_INSTRUMENT => reading.baseline_ms = Some(point.value()),
                            LIMIT_ESTIMATE_INSTRUMENT => reading.estimate_ms = Some(point.value()),
                            _ => {}
                        }
                    }
                }
            }
            _ => {}
        });
        reading
    }
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics back, from the in-memory pipeline of `common`.

/// `(operation, executor, outcome)`; outcome is empty for the queue histogram.
type SeriesKey = (String, String, String);

fn key<'a>(attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> SeriesKey {
    let mut key = SeriesKey::default();
    for kv in attributes {
        let value = kv.value.to_string();
        match kv.key.as_str() {
            OPERATION_ATTRIBUTE => key.0 = value,
            EXECUTOR_ATTRIBUTE => key.1 = value,
            OUTCOME_ATTRIBUTE => key.2 = value,
            _ => {}
        }
    }
    key
}

#[derive(Default)]
struct Snapshot {
    histograms: BTreeMap<(String, SeriesKey), Buckets>,
    live: BTreeMap<String, i64>,
    /// `gym.resources.operation.limit` by operation.
    limits: BTreeMap<String, u64>,
    /// The two counters, by (instrument, rejection reason or "").
    counters: BTreeMap<(String, String), u64>,
}

impl Snapshot {
    /// What the metrics say now.
    fn of(telemetry: &Telemetry) -> Self {
        let mut snapshot = Snapshot::default();
        telemetry.read(|metric| match metric.data() {
            AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                for point in h.data_points() {
                    let key = key(point.attributes());
                    snapshot.histograms.insert(
                        (metric.name().to_owned(), key),
                        Buckets {
                            bounds: point.bounds().collect(),
                            counts: point.bucket_counts().collect(),
                            count: point.count(),
                            sum: point.sum(),
                            min: point.min().unwrap_or(0.0),
                            max: point.max().unwrap_or(0.0),
                        },
                    );
                }
            }
            AggregatedMetrics::I64(MetricData::Sum(s)) => {
                let total = s.data_points().map(|p| p.value()).sum();
                snapshot.live.insert(metric.name().to_owned(), total);
            }
            AggregatedMetrics::I64(MetricData::Gauge(g)) if metric.name() == LIMIT_INSTRUMENT => {
                for point in g.data_points() {
                    let (operation, ..) = key(point.attributes());
                    snapshot
                        .limits
                        .insert(operation, u64::try_from(point.value()).unwrap_or(0));
                }
            }
            AggregatedMetrics::U64(MetricData::Sum(s)) => {
                for point in s.data_points() {
                    let reason = point
                        .attributes()
                        .find(|kv| kv.key.as_str() == REJECTION_ATTRIBUTE)
                        .map(|kv| kv.value.to_string())
                        .unwrap_or_default();
                    *snapshot
                        .counters
                        .entry((metric.name().to_owned(), reason))
                        .or_default() += point.value();
                }
            }
            _ => {}
        });
        snapshot
    }

    fn live(&self, name: &str) -> i64 {
        self.live.get(name).copied().unwrap_or(0)
    }

    /// A counter's total over every series, for `reason` (or all reasons, with `None`).
    fn counter(&self, name: &str, reason: Option<&str>) -> u64 {
        self.counters
            .iter()
            .filter(|((n, r), _)| n == name && reason.is_none_or(|reason| r == reason))
            .map(|(_, count)| count)
            .sum()
    }
}

struct Buckets {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Buckets {
    /// The `q` quantile, interpolated inside its bucket as Prometheus's `histogram_quantile`
    /// does, then kept within the exported min and max (NeMo Gym's buckets are wide).
    fn quantile(&self, q: f64) -> f64 {
        self.interpolated(q).clamp(self.min, self.max)
    }

    fn interpolated(&self, q: f64) -> f64 {
        let rank = q * self.count as f64;
        let mut seen = 0u64;
        for (i, &n) in self.counts.iter().enumerate() {
            if n > 0 && (seen + n) as f64 >= rank {
                let lower = if i == 0 { 0.0 } else { self.bounds[i - 1] };
                let Some(&upper) = self.bounds.get(i) else {
                    return lower; // the open top bucket: report its lower bound
                };
                return lower + (upper - lower) * ((rank - seen as f64) / n as f64);
            }
            seen += n;
        }
        0.0
    }
}

struct Report {
    run: Run,
    wall: Duration,
    statuses: BTreeMap<String, u32>,
    peak_queued: i64,
    peak_active: i64,
    snapshot: Snapshot,
}

impl Report {
    fn print(&self) {
        let s = &self.snapshot;
        // The capacity as the metrics report it: verify and judge draw from one limit, so each
        // of their series reports all of it.
        let capacity = s.limits.get("verify").copied().unwrap_or(0);
        let bounded = if self.run.bounded {
            format!(
                ", at most {MAX_QUEUED} queued for {} ms",
                QUEUE_TIMEOUT.as_millis()
            )
        } else {
            String::new()
        };
        println!(
            "== limit {capacity}{bounded}: burst drained in {} ms; peak active {} of {capacity}, \
             peak queued {}",
            self.wall.as_millis(),
            self.peak_active,
            self.peak_queued
        );
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .map(|(k, v)| format!("{k} x{v}"))
            .collect();
        println!("   clients saw: {}", statuses.join(", "));
        println!(
            "   {:<7} {:<11} {:>8} {:>9} {:>9} | {:<9} {:>5} {:>8} {:>8}",
            "op",
            "executor",
            "admitted",
            "queue p50",
            "queue p95",
            "outcome",
            "count",
            "run p50",
            "run p95"
        );

        let (mut queue_ms, mut run_ms, mut admitted, mut cancelled) = (0.0, 0.0, 0, 0);
        for ((_, (op, ex, _)), queue) in s
            .histograms
            .iter()
            .filter(|((n, _), _)| n == QUEUE_DURATION_INSTRUMENT)
        {
            queue_ms += queue.sum;
            admitted += queue.count;
            let runs = s
                .histograms
                .iter()
                .filter(|((n, (o, e, _)), _)| n == DURATION_INSTRUMENT && o == op && e == ex);
            for (i, ((_, (_, _, outcome)), run)) in runs.enumerate() {
                run_ms += run.sum;
                if outcome == Outcome::Cancelled.as_str() {
                    cancelled += run.count;
                }
                let left = if i == 0 {
                    let (p50, p95) = (ms(queue.quantile(0.5)), ms(queue.quantile(0.95)));
                    format!("{op:<7} {ex:<11} {:>8} {p50:>9} {p95:>9}", queue.count)
                } else {
                    format!("{:48}", "")
                };
                let (p50, p95) = (ms(run.quantile(0.5)), ms(run.quantile(0.95)));
                println!(
                    "   {left} | {outcome:<9} {:>5} {p50:>8} {p95:>8}",
                    run.count
                );
            }
        }

        let timed_out: u64 = s
            .histograms
            .iter()
            .filter(|((n, (o, _, outcome)), _)| {
                n == DURATION_INSTRUMENT && o == "verify" && outcome == Outcome::Timeout.as_str()
            })
            .map(|(_, run)| run.count)
            .sum();
        if timed_out > 0 {
            println!(
                "   why a 200 can be timeout: {timed_out} verifiers ran past the handler's {} ms \
                 deadline; the handler answered 200 \"unverified\" and said so with \
                 set_outcome(Outcome::Timeout), which wins over the status",
                VERIFY_DEADLINE.as_millis()
            );
        }
        let abandoned = s.counter(ABANDONED_INSTRUMENT, None);
        if cancelled + abandoned > 0 {
            println!(
                "   callers who went away: {cancelled} while running (outcome cancelled), \
                 {abandoned} while still queued (gym.resources.operation.abandoned)"
            );
        }
        let rejected = s.counter(REJECTED_INSTRUMENT, None);
        if rejected > 0 {
            println!(
                "   turned away without a permit: {rejected} (queue_full {}, queue_timeout {}), \
                 answered 503 with Retry-After (gym.resources.operation.rejected)",
                s.counter(REJECTED_INSTRUMENT, Some("queue_full")),
                s.counter(REJECTED_INSTRUMENT, Some("queue_timeout")),
            );
        }
        // Little's law: the average number of busy slots is the total run time over the wall time.
        let busy = run_ms / self.wall.as_secs_f64() / 1_000.0;
        let utilisation = busy / capacity.max(1) as f64;
        let queue_per_run = queue_ms / run_ms.max(1e-9);
        println!(
            "   busy slots on average: {busy:.1} of {capacity} ({:.0}%); mean queue time {} vs mean run time {}",
            utilisation * 100.0,
            ms(queue_ms / admitted.max(1) as f64),
            ms(run_ms / admitted.max(1) as f64),
        );
        let verdict = if rejected > 0 && utilisation > 0.75 {
            format!(
                "the limit binds, and its bound sheds what it cannot take in time: {rejected} \
                 callers were turned away at once rather than wait. Every slot was busy; queue time \
                 stayed at {queue_per_run:.1}x the run time for those admitted."
            )
        } else if utilisation > 0.75 && queue_per_run > 1.0 {
            format!(
                "the limit binds. Every slot was busy and work queued {queue_per_run:.1}x as long as it ran. \
                 If what it protects can take more, raise the limit; otherwise shed load."
            )
        } else if queue_per_run > 0.25 {
            format!(
                "the limit is close: work queued {:.0}% as long as it ran.",
                queue_per_run * 100.0
            )
        } else {
            format!(
                "the limit does not bind: work queued {:.0}% as long as it ran; the run time is the whole story.",
                queue_per_run * 100.0
            )
        };
        println!("   what it says: {verdict}\n");
    }
}

fn ms(value: f64) -> String {
    if value >= 1_000.0 {
        format!("{:.2} s", value / 1_000.0)
    } else {
        format!("{value:.0} ms")
    }
}
