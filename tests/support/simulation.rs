//! Simulated servers and the load that drives an adaptive limit against them, on paused time.
//!
//! A [`Server`] has a run time that depends on how many operations it serves at once: flat, a
//! queue of its own above N (it *defers*), a quick failure above N, a knee past which the run
//! time climbs slowly, jitter on top of any of these. Closed-loop clients (each sends its next
//! request once the last one is answered) drive it through the real layer or the scoped API,
//! and a sampler reads the crate's metrics back from a real SDK every 73 ms (a period that no
//! server's rhythm shares, so that none is sampled always in the same phase): the in-flight
//! operations (`active`) and the `limit` gauge, the outcomes, the controller's gauges. A
//! [`Run`] then reports, for a phase of the run, the mean and the mode of in-flight and of the
//! limit, the throughput and the share of failures.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::ops::RangeInclusive;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE, LIMIT_BASELINE_INSTRUMENT, LIMIT_ESTIMATE_INSTRUMENT,
    LIMIT_INSTRUMENT, OPERATION_ATTRIBUTE,
};
use tower_resources_operation::{
    Acquire, Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

use super::Telemetry;

/// The server turned the request away: it had no room.
#[derive(Debug)]
pub struct Busy;

impl fmt::Display for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("busy")
    }
}

impl std::error::Error for Busy {}

/// What the server does above its capacity.
#[derive(Clone, Copy, Debug)]
pub enum Above {
    /// Queues the request until a slot is free (a server with a worker pool of its own).
    Defers,
    /// Answers an error at once, after `Server::fail_after` (a `503`).
    Fails,
    /// Serves it, more slowly: the run time grows by `slope` times the share of the
    /// capacity it is over (a shallow knee).
    Slows { slope: f64 },
    /// Serves it as fast as any other: there is no capacity to speak of.
    Ignores,
}

/// A simulated server.
pub struct Server {
    /// Its slots: their capacity can change during a run.
    slots: Limit,
    above: Above,
    /// The run time of one request with a free slot.
    service: Duration,
    /// Each run time is multiplied by `1 + jitter × u` for `u` uniform in `[-1, 1)`, and one
    /// request in `spike_every` by `spike` on top of that.
    jitter: f64,
    spike: (u64, f64),
    fail_after: Duration,
    /// Requests it holds now (served or queued inside).
    held: AtomicUsize,
    rng: AtomicU64,
}

impl Server {
    /// A server of `capacity` slots, each serving a request in `service`, give or take 10%
    /// (no real server keeps its clients in step).
    pub fn new(capacity: usize, service: Duration, above: Above) -> Self {
        Self {
            slots: Limit::new(capacity),
            above,
            service,
            jitter: 0.1,
            spike: (0, 1.0),
            fail_after: Duration::from_millis(5),
            held: AtomicUsize::new(0),
            rng: AtomicU64::new(0x5eed),
        }
    }

    /// Run times vary by up to `jitter` either way, and one request in `every` takes `factor`
    /// times as long (0 for none).
    pub fn jitter(mut self, jitter: f64, every: u64, factor: f64) -> Self {
        self.jitter = jitter;
        self.spike = (every, factor);
        self
    }

    /// Its capacity changes (lowering it revokes no request it serves).
    pub fn set_capacity(&self, capacity: usize) {
        self.slots.set_capacity(capacity).unwrap();
    }

    /// A number in `[0, 1)`, from a splitmix64 sequence: the same run, the same numbers.
    fn uniform(&self) -> f64 {
        let mut z = self
            .rng
            .fetch_add(0x9E37_79B9_7F4A_7C15, Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The run time of one request, given how far over capacity the server is.
    fn run_time(&self, over: f64) -> Duration {
        let mut factor = 1.0 + self.jitter * (2.0 * self.uniform() - 1.0);
        let (every, spike) = self.spike;
        if every > 0 && self.uniform() < 1.0 / every as f64 {
            factor *= spike;
        }
        if let Above::Slows { slope } = self.above {
            factor *= 1.0 + slope * over;
        }
        self.service.mul_f64(factor.max(0.01))
    }

    /// Serves one request.
    pub async fn serve(&self) -> Result<(), Busy> {
        let held = self.held.fetch_add(1, Relaxed) + 1;
        let _left = Left(&self.held);
        let capacity = self.slots.capacity().max(1) as f64;
        match self.above {
            Above::Defers => {
                let _slot = self.slots.acquire().await.expect("open");
                tokio::time::sleep(self.run_time(0.0)).await;
            }
            Above::Fails => {
                let Some(slot) = self.slots.try_acquire() else {
                    tokio::time::sleep(self.fail_after).await;
                    return Err(Busy);
                };
                let _slot = slot.expect("open");
                tokio::time::sleep(self.run_time(0.0)).await;
            }
            Above::Slows { .. } => {
                let over = (held as f64 - capacity).max(0.0) / capacity;
                tokio::time::sleep(self.run_time(over)).await;
            }
            Above::Ignores => tokio::time::sleep(self.run_time(0.0)).await,
        }
        Ok(())
    }
}

struct Left<'a>(&'a AtomicUsize);

impl Drop for Left<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// How the clients reach the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Through `ResourcesOperationLayer` on a tower service.
    Layer,
    /// Through `OperationMetrics::resources_operation`.
    Scoped,
}

/// A change to the server at a moment of the run.
pub type Event = (Duration, Box<dyn Fn(&Server)>);

/// One run: `clients` closed-loop clients for `length` of paused time.
pub struct Scenario {
    pub name: &'static str,
    pub server: Server,
    pub clients: usize,
    pub length: Duration,
    pub form: Form,
    pub events: Vec<Event>,
}

/// One reading of the metrics.
#[derive(Clone, Debug)]
pub struct Reading {
    pub at: Duration,
    pub in_flight: i64,
    pub limit: i64,
    pub ended: u64,
    pub failed: u64,
}

/// What a run read from the metrics.
pub struct Run {
    pub name: String,
    pub readings: Vec<Reading>,
    pub baseline_ms: Option<f64>,
    pub estimate_ms: Option<f64>,
}

/// The figures of one phase of a run.
#[derive(Clone, Debug)]
pub struct Figures {
    pub in_flight_mean: f64,
    pub in_flight_mode: i64,
    pub limit_mean: f64,
    pub limit_mode: i64,
    pub limit_min: i64,
    pub limit_max: i64,
    /// Operations ended per second.
    pub throughput: f64,
    /// Share of the ended operations that failed (`error`, `timeout`, `crashed`).
    pub failures: f64,
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "limit mean {:5.1} mode {:3} (min {:3}, max {:3}) | in flight mean {:5.1} mode {:3} \
             | {:6.1} op/s | failures {:4.1}%",
            self.limit_mean,
            self.limit_mode,
            self.limit_min,
            self.limit_max,
            self.in_flight_mean,
            self.in_flight_mode,
            self.throughput,
            100.0 * self.failures
        )
    }
}

/// One of the [`Figures`] a test bounds, by the name its failure message gives it.
#[derive(Clone, Copy, Debug)]
pub enum Figure {
    LimitMean,
    LimitMode,
    LowestLimit,
    InFlight,
    Throughput,
    Failures,
}

impl Figure {
    /// What a failure message calls it.
    fn name(self) -> &'static str {
        match self {
            Self::LimitMean => "limit mean",
            Self::LimitMode => "limit mode",
            Self::LowestLimit => "lowest limit",
            Self::InFlight => "in flight",
            Self::Throughput => "op/s",
            Self::Failures => "failures",
        }
    }
}

impl Figures {
    /// The value of `figure`, as an `f64` (the whole numbers are exact).
    pub fn get(&self, figure: Figure) -> f64 {
        match figure {
            Figure::LimitMean => self.limit_mean,
            Figure::LimitMode => self.limit_mode as f64,
            Figure::LowestLimit => self.limit_min as f64,
            Figure::InFlight => self.in_flight_mean,
            Figure::Throughput => self.throughput,
            Figure::Failures => self.failures,
        }
    }

    /// Each figure of `bounds` lies in the range given with it, or the test fails naming `what`
    /// (a scenario, or a phase of one) and the figure: so that a scenario states each range
    /// once, next to the reason for it, however many figures it bounds.
    #[track_caller]
    pub fn assert_within(&self, what: &str, bounds: &[(&[Figure], RangeInclusive<f64>)]) {
        for (figures, range) in bounds {
            for figure in *figures {
                within(
                    &format!("{what} {}", figure.name()),
                    self.get(*figure),
                    range.clone(),
                );
            }
        }
    }
}

/// `value` lies in `range`, or the test fails saying what it was (in full: a share of failures
/// that rounds to nothing is still not none).
#[track_caller]
pub fn within(what: &str, value: f64, range: RangeInclusive<f64>) {
    assert!(
        range.contains(&value),
        "{what} = {value}, outside {range:?}"
    );
}

fn mode(values: impl Iterator<Item = i64>) -> i64 {
    let mut counts = BTreeMap::new();
    for value in values {
        *counts.entry(value).or_insert(0usize) += 1;
    }
    // The most frequent, the highest of equals.
    counts
        .into_iter()
        .max_by_key(|(value, count)| (*count, *value))
        .map_or(0, |(value, _)| value)
}

impl Run {
    /// The figures of the readings in `[from, to)`.
    pub fn figures(&self, from: Duration, to: Duration) -> Figures {
        let phase: Vec<&Reading> = self
            .readings
            .iter()
            .filter(|r| r.at >= from && r.at < to)
            .collect();
        assert!(
            phase.len() >= 2,
            "{}: no readings in {from:?}..{to:?}",
            self.name
        );
        let (first, last) = (phase[0], phase[phase.len() - 1]);
        let n = phase.len() as f64;
        let ended = last.ended - first.ended;
        let seconds = (last.at - first.at).as_secs_f64();
        Figures {
            in_flight_mean: phase.iter().map(|r| r.in_flight as f64).sum::<f64>() / n,
            in_flight_mode: mode(phase.iter().map(|r| r.in_flight)),
            limit_mean: phase.iter().map(|r| r.limit as f64).sum::<f64>() / n,
            limit_mode: mode(phase.iter().map(|r| r.limit)),
            limit_min: phase.iter().map(|r| r.limit).min().unwrap_or(0),
            limit_max: phase.iter().map(|r| r.limit).max().unwrap_or(0),
            throughput: ended as f64 / seconds,
            failures: if ended == 0 {
                0.0
            } else {
                (last.failed - first.failed) as f64 / ended as f64
            },
        }
    }

    /// Prints the figures of `[from, to)` under `label`, and returns them.
    pub fn report(&self, label: &str, from: Duration, to: Duration) -> Figures {
        let figures = self.figures(from, to);
        println!(
            "{:<34} {:>3}-{:<3}s {figures}",
            format!("{} {label}", self.name),
            from.as_secs(),
            to.as_secs()
        );
        figures
    }

    /// The limit read every `every`, for a trace of how it moved.
    pub fn trace(&self, every: Duration) -> String {
        let mut next = Duration::ZERO;
        let mut trace = Vec::new();
        for reading in &self.readings {
            if reading.at >= next {
                trace.push(reading.limit.to_string());
                next += every;
            }
        }
        trace.join(" ")
    }
}

/// Runs `scenario` against `limit` (named `limit_name`, for the controller's gauges), reading
/// the metrics of `telemetry` every 100 ms.
pub async fn run(scenario: Scenario, limit: Limit, telemetry: &Telemetry) -> Run {
    let Scenario {
        name,
        server,
        clients,
        length,
        form,
        events,
    } = scenario;
    let server = Arc::new(server);
    let metrics = telemetry.metrics.clone();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        tasks.push(tokio::spawn(client(
            form,
            Arc::clone(&server),
            limit.clone(),
            metrics.clone(),
        )));
    }

    let filter = [(OPERATION_ATTRIBUTE, "judge")];
    let mut events = events.into_iter().peekable();
    let mut readings = Vec::new();
    let period = Duration::from_millis(73);
    let mut tick = tokio::time::interval_at(start + period, period);
    loop {
        tick.tick().await;
        let at = start.elapsed();
        while let Some((when, _)) = events.peek() {
            if *when > at {
                break;
            }
            let (_, event) = events.next().unwrap();
            event(&server);
        }
        let capacity = limit.capacity();
        let outcomes = telemetry.outcomes(&filter);
        let reading = Reading {
            at,
            in_flight: telemetry.live_value(ACTIVE_INSTRUMENT, &filter),
            limit: telemetry.live_value(LIMIT_INSTRUMENT, &filter),
            ended: outcomes.values().sum(),
            failed: ["error", "timeout", "crashed"]
                .iter()
                .filter_map(|outcome| outcomes.get(*outcome))
                .sum(),
        };
        // The gauge is the controller's last word, read at the same instant.
        assert_eq!(
            reading.limit as usize, capacity,
            "{name}: the limit gauge at {at:?}"
        );
        readings.push(reading);
        if at >= length {
            break;
        }
    }
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    let by_name = [(LIMIT_ATTRIBUTE, limit.name().unwrap_or_default())];
    let gauge = |instrument: &str| telemetry.gauge_f64(instrument, &by_name);
    Run {
        name: name.to_owned(),
        readings,
        baseline_ms: gauge(LIMIT_BASELINE_INSTRUMENT),
        estimate_ms: gauge(LIMIT_ESTIMATE_INSTRUMENT),
    }
}

/// One closed-loop client: sends a request, waits for the answer, and sends the next.
fn client(
    form: Form,
    server: Arc<Server>,
    limit: Limit,
    metrics: OperationMetrics,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    match form {
        Form::Layer => {
            let service = ResourcesOperationLayer::new(limit)
                .operation(Operation::Judge)
                .executor(Executor::Inline)
                .metrics(metrics)
                .layer(service_fn(move |()| {
                    let server = Arc::clone(&server);
                    async move { server.serve().await }
                }));
            Box::pin(async move {
                loop {
                    let _ = service.clone().oneshot(()).await;
                }
            })
        }
        Form::Scoped => Box::pin(async move {
            loop {
                let _ = metrics
                    .resources_operation(&limit, Operation::Judge, Executor::Inline, server.serve())
                    .await;
            }
        }),
    }
}
