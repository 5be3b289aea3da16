//! The adaptive controllers against Vector's adaptive-request-concurrency (ARC) scenarios, beside a
//! re-implementation of ARC's own controller on the same simulated links.
//!
//! Vector publishes its ARC controller with a simulation (`src/sinks/util/adaptive_concurrency/
//! tests.rs` in vectordotdev/vector) and a set of scenarios, each with the ranges its statistics
//! fall in (`tests/data/adaptive-concurrency/*.yaml`). This file runs the same server model on
//! paused tokio time, through the crate's real [`Limit`] and controller
//! ([`OperationMetrics::disabled`]`.resources_operation`), and runs ARC's controller (EWMA RTT,
//! alpha 0.4, deviation scale 2.5, decrease ratio 0.9, at most one adjustment per observed round
//! trip, start at 1, at most 200) on a plain `Limit` on the same model, so that every figure can
//! be read beside ARC's from the same simulation, and beside Vector's published range.
//!
//! # The model (Vector's)
//!
//! A request that arrives at the server while `L` requests are in flight there (itself included)
//! takes `delay × (1 + jitter × X + scale × (L − 1) + knee(L))`, `X ~ Exp(1)`,
//! `knee(L) = knee_exp^max(0, L − knee_start) − 1`. Above a level `limit`, the server *defers*
//! (answers an error after `delay × (1 + jitter × X)`) or *drops* (never answers; the client
//! gives up after 1 s). The `rate` parameters do the same by the number of requests that arrived
//! in the last second. The statistics are Vector's: time-weighted, at the server, from the start
//! to the last request's success.
//!
//! # Where it departs from Vector's harness
//!
//! - The limit is held for one attempt, as this crate's operation is: a deferred or timed-out
//!   attempt ends its operation (`error`, `timeout`), and the request is tried again after 1 s
//!   (Vector's first retry backoff) without holding a place. In Vector, the limit is held across
//!   the retries, so ARC there sees a retried request as one long round trip; here ARC, like the
//!   crate's controllers, sees each attempt and counts a deferral or a timeout as back pressure
//!   (as ARC's controller does for a retriable error or an `Elapsed`). ARC's figures here are
//!   therefore not Vector's; both are printed.
//! - A request its client gave up on leaves the server (Vector's harness never takes it out of
//!   its level).
//! - Scenarios not in Vector's set: a capacity that falls from 24 to 8 and comes back; a steep
//!   knee (the delay doubles with each request past 8); and mixed work (a
//!   verify of 100 ms, a tool call of 300 ms and a judge of 1 s, each given up after three times
//!   its run time, sharing one limit in front of a backend whose delay doubles with each request
//!   past K = 12), either kind first, three kinds, a mix that changes; callers
//!   whose patience is the slow kind's run time (a verify of 100 ms and a judge of 1 s, each
//!   client giving up after 1 s with tower's `Timeout` around the layer, so that the limit hears
//!   `cancelled`, not `timeout`; a fixed limit of K runs beside the controllers); and a backend
//!   whose delay rises 1% per request in flight without jitter, for one process and for a fleet
//!   of three replicas on one limit, decided as the fleet limit does from the core's public
//!   pieces (`arc_scenarios/fleet.rs`). Vector's two fixed-concurrency scenarios have no
//!   controller to compare, and are left out.
//!
//! As in Vector's harness, a link without jitter answers many requests at the same instant, and
//! the requests that arrive at one instant are taken in turn (the first at a lower load than the
//! last): the controllers must not be fooled by the first of them.
//!
//! Each test prints a table (`cargo test --test arc_scenarios -- --nocapture`): for each
//! controller, the time to the last success, the server's mean, max and mode in flight, the
//! server's rate (requests arrived in the last second, time-weighted, as Vector reports it), the
//! successes per second, the attempts deferred and timed out and the failures per success, the
//! limit's mean, min and max, and the algorithm's baseline; then Vector's published ranges. The
//! targets are asserted, each with its reason, for every algorithm the crate ships
//! ([`SHIPPED`]: `Vegas`). `ARC_TRACE=vegas` (or `fleet/vegas`) prints every window
//! the algorithm saw; `ARC_TIMEOUTS=1` when each attempt timed out in the mixed scenarios.
//! Each scenario runs on the server's random numbers from seeds 0 to 7, and every target holds
//! on each; `ARC_SEED=<n>` runs on one; `ARC_SOFT=1` prints each missed target (`MISS ...`)
//! rather than failing on the first.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower::timeout::error::Elapsed;
use tower::timeout::Timeout;
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample, Vegas};
use tower_resources_operation::classify::OperationOutput;
use tower_resources_operation::limit::Ended;
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, Outcome, ResourcesOperationLayer,
};

#[path = "arc_scenarios/fleet.rs"]
mod fleet;

use fleet::Fleet;

/// ARC's and the crate's controllers stay within `1..=MAX` (ARC's default maximum).
const MAX: usize = 200;
/// How long a client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a client waits before it tries a failed request again (Vector's first backoff).
const RETRY_BACKOFF: Duration = Duration::from_secs(1);

// -------------------------------------------------------------------------------------------------
// A seeded random number generator.

/// splitmix64: the same seed, the same run.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean 1.
    fn exp1(&mut self) -> f64 {
        -(1.0 - self.uniform()).ln()
    }
}

// -------------------------------------------------------------------------------------------------
// The server model.

/// What the server does to a request above its `limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// Answers an error after the base delay: the client tries again later.
    Defer,
    /// Never answers: the client gives up after [`CLIENT_TIMEOUT`].
    Drop,
}

/// How the delay grows with a level (in flight, or requests in the last second), and the level
/// above which requests are deferred or dropped: Vector's `LimitParams`.
#[derive(Clone, Copy, Debug)]
struct Params {
    scale: f64,
    knee_start: Option<usize>,
    knee_exp: Option<f64>,
    limit: Option<usize>,
    action: Action,
}

impl Params {
    const NONE: Self = Self {
        scale: 0.0,
        knee_start: None,
        knee_exp: None,
        limit: None,
        action: Action::Defer,
    };

    fn action_at(&self, level: usize) -> Option<Action> {
        self.limit
            .and_then(|limit| (level > limit).then_some(self.action))
    }

    /// The extra delay at `level`, as a share of the base delay.
    fn scale(&self, level: usize) -> f64 {
        let knee = self.knee_start.map_or(0.0, |knee| {
            self.knee_exp
                .unwrap_or(self.scale + 1.0)
                .powf(level.saturating_sub(knee) as f64)
                - 1.0
        });
        (level - 1) as f64 * self.scale + knee
    }
}

/// A time-weighted histogram of a level: Vector's `LevelTimeHistogram` and `TimeHistogram`.
#[derive(Debug)]
struct Level {
    value: usize,
    since: Instant,
    start: Instant,
    /// Time spent at each value, in seconds.
    time: BTreeMap<usize, f64>,
    max: usize,
    min: usize,
    /// Every value it took, from when (seconds from the start): for the mean of a phase.
    trace: Vec<(f64, usize)>,
}

impl Level {
    fn new(now: Instant, value: usize) -> Self {
        Self {
            value,
            since: now,
            start: now,
            time: BTreeMap::new(),
            max: value,
            min: value,
            trace: vec![(0.0, value)],
        }
    }

    fn set(&mut self, now: Instant, value: usize) {
        let spent = now.saturating_duration_since(self.since).as_secs_f64();
        *self.time.entry(self.value).or_default() += spent;
        if value != self.value {
            let at = now.saturating_duration_since(self.start).as_secs_f64();
            self.trace.push((at, value));
        }
        self.value = value;
        self.since = now;
        self.max = self.max.max(value);
        self.min = self.min.min(value);
    }

    fn adjust(&mut self, now: Instant, by: isize) {
        let value = self.value.checked_add_signed(by).expect("a level below 0");
        self.set(now, value);
    }

    /// Mean, mode and max up to `now`.
    fn stats(&mut self, now: Instant) -> (f64, usize, usize) {
        self.set(now, self.value);
        let total = now.saturating_duration_since(self.start).as_secs_f64();
        let mean = self
            .time
            .iter()
            .map(|(value, time)| *value as f64 * time)
            .sum::<f64>()
            / total.max(f64::MIN_POSITIVE);
        let mode = self
            .time
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(b.0)))
            .map_or(0, |(value, _)| *value);
        (mean, mode, self.max)
    }
}

/// The time-weighted mean of a level that took the values of `trace` (from when, in seconds),
/// over `[from, to)` seconds.
fn mean_between(trace: &[(f64, usize)], from: f64, to: f64) -> f64 {
    let mut sum = 0.0;
    for (i, &(at, value)) in trace.iter().enumerate() {
        let until = trace.get(i + 1).map_or(f64::INFINITY, |next| next.0);
        let (a, b) = (at.max(from), until.min(to));
        if b > a {
            sum += value as f64 * (b - a);
        }
    }
    sum / (to - from)
}

/// What can change during a run: the server's parameters.
#[derive(Clone, Copy, Debug)]
struct Model {
    delay: f64,
    jitter: f64,
    concurrency: Params,
    rate: Params,
}

/// The server: Vector's `TestSink`, with its statistics.
#[derive(Debug)]
struct Server {
    model: Model,
    rng: Rng,
    in_flight: Level,
    rate: Level,
    arrived: VecDeque<Instant>,
}

impl Server {
    fn new(model: Model, seed: u64, now: Instant) -> Self {
        Self {
            model,
            rng: Rng(seed),
            in_flight: Level::new(now, 0),
            rate: Level::new(now, 0),
            arrived: VecDeque::new(),
        }
    }

    /// Forgets the arrivals more than a second old.
    fn prune(&mut self, now: Instant) {
        let then = now.checked_sub(Duration::from_secs(1));
        while let (Some(first), Some(then)) = (self.arrived.front(), then) {
            if *first > then {
                break;
            }
            self.arrived.pop_front();
        }
    }

    fn delay_at(&mut self, level: usize, rate: usize) -> Duration {
        let model = self.model;
        let extra = model.concurrency.scale(level) + model.rate.scale(rate);
        let factor = model.jitter * self.rng.exp1() + 1.0 + extra;
        Duration::from_secs_f64(model.delay * factor)
    }

    /// A request that takes `factor` times the model's delay arrives: what the server will do
    /// with it.
    fn start(&mut self, now: Instant, factor: f64) -> Reply {
        self.prune(now);
        self.arrived.push_back(now);
        self.rate.set(now, self.arrived.len());
        self.in_flight.adjust(now, 1);
        let level = self.in_flight.value;
        let rate = self.arrived.len();
        let model = self.model;
        match model
            .concurrency
            .action_at(level)
            .or_else(|| model.rate.action_at(rate))
        {
            None => Reply::Ok(self.delay_at(level, rate).mul_f64(factor)),
            Some(Action::Defer) => Reply::Deferred(self.delay_at(1, 1).mul_f64(factor)),
            Some(Action::Drop) => {
                self.end(now);
                Reply::Dropped
            }
        }
    }

    fn end(&mut self, now: Instant) {
        self.prune(now);
        self.rate.set(now, self.arrived.len());
        self.in_flight.adjust(now, -1);
    }
}

/// What the server does with a request, decided when it arrives.
enum Reply {
    Ok(Duration),
    Deferred(Duration),
    Dropped,
}

/// How an attempt ended, as the client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Ok,
    Deferred,
    TimedOut,
}

impl OperationOutput for Answer {
    fn outcome(&self) -> Outcome {
        match self {
            Self::Ok => Outcome::Ok,
            Self::Deferred => Outcome::Error,
            Self::TimedOut => Outcome::Timeout,
        }
    }
}

type Shared = Arc<Mutex<Server>>;

/// Takes a request out of the server's level if its client gives up on it.
struct Leaves {
    server: Option<Shared>,
}

impl Drop for Leaves {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.lock().unwrap().end(Instant::now());
        }
    }
}

/// A kind of work the clients send: what it is to the limit, how long it takes at low load,
/// and how long its caller waits for it, and where.
#[derive(Clone, Copy, Debug)]
struct Kind {
    operation: Operation,
    executor: Executor,
    /// Its run time at low load, in the model's delays.
    factor: f64,
    /// How long its caller waits for an answer, from when the limit admitted it.
    timeout: Duration,
    /// Where the caller gives up.
    gives_up: GivesUp,
}

/// Where a caller gives up on an attempt that takes longer than its kind's timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GivesUp {
    /// Inside the operation (a deadline the work enforces, as Vector's sinks do): the limit
    /// hears its operation end `timeout`.
    Inside,
    /// In the client, around the layer: tower's `Timeout` over the service that
    /// `ResourcesOperationLayer` makes, driven with `oneshot`. The wait for a place is in
    /// `poll_ready` and the timer starts at `call`, so it counts from admission, as `Inside`
    /// does; but the limit hears only its operation dropped, `cancelled`.
    AroundTheLayer,
}

/// What every scenario of Vector's set sends: one kind, at the model's delay.
const ONE_KIND: Kind = Kind {
    operation: Operation::Judge,
    executor: Executor::Inline,
    factor: 1.0,
    timeout: CLIENT_TIMEOUT,
    gives_up: GivesUp::Inside,
};

/// One attempt of `kind` at the server, as its client sees it: within the kind's timeout if its
/// caller gives up inside the operation; as long as the server takes otherwise.
async fn attempt(server: &Shared, kind: Kind) -> Answer {
    let reply = server.lock().unwrap().start(Instant::now(), kind.factor);
    let served = async {
        match reply {
            Reply::Ok(delay) | Reply::Deferred(delay) => {
                let mut leaves = Leaves {
                    server: Some(Arc::clone(server)),
                };
                tokio::time::sleep(delay).await;
                leaves.server = None;
                server.lock().unwrap().end(Instant::now());
                match reply {
                    Reply::Ok(_) => Answer::Ok,
                    _ => Answer::Deferred,
                }
            }
            Reply::Dropped => std::future::pending().await,
        }
    };
    match kind.gives_up {
        GivesUp::Inside => tokio::time::timeout(kind.timeout, served)
            .await
            .unwrap_or(Answer::TimedOut),
        GivesUp::AroundTheLayer => served.await,
    }
}

// -------------------------------------------------------------------------------------------------
// ARC's controller, as Vector's `controller.rs` has it.

/// Vector's `EwmaVar`: an exponentially weighted mean and variance.
#[derive(Clone, Copy, Debug, Default)]
struct EwmaVar {
    state: Option<(f64, f64)>,
}

impl EwmaVar {
    const ALPHA: f64 = 0.4;

    fn update(&mut self, point: f64) -> (f64, f64) {
        let next = match self.state {
            None => (point, 0.0),
            Some((mean, variance)) => {
                let difference = point - mean;
                let increment = Self::ALPHA * difference;
                (
                    mean + increment,
                    (1.0 - Self::ALPHA) * difference.mul_add(increment, variance),
                )
            }
        };
        self.state = Some(next);
        next
    }
}

#[derive(Debug)]
struct ArcState {
    current_limit: usize,
    in_flight: usize,
    past_rtt: EwmaVar,
    next_update: Instant,
    /// The mean RTT of the current interval: sum and count.
    current_rtt: (f64, usize),
    had_back_pressure: bool,
    reached_limit: bool,
}

/// ARC's controller, on a plain [`Limit`] that it resizes.
#[derive(Debug)]
struct ArcController {
    limit: Limit,
    state: Mutex<ArcState>,
}

impl ArcController {
    const DECREASE_RATIO: f64 = 0.9;
    const RTT_DEVIATION_SCALE: f64 = 2.5;

    fn new(limit: Limit) -> Self {
        Self {
            state: Mutex::new(ArcState {
                current_limit: limit.capacity(),
                in_flight: 0,
                past_rtt: EwmaVar::default(),
                next_update: Instant::now(),
                current_rtt: (0.0, 0),
                had_back_pressure: false,
                reached_limit: false,
            }),
            limit,
        }
    }

    fn start(&self) {
        let mut state = self.state.lock().unwrap();
        state.in_flight += 1;
        if state.in_flight >= state.current_limit {
            state.reached_limit = true;
        }
    }

    /// A response to a request started at `start`: `adjust_to_response_inner`.
    fn end(&self, start: Instant, answer: Answer) {
        let now = Instant::now();
        let is_back_pressure = answer != Answer::Ok;
        let use_rtt = answer == Answer::Ok;
        let mut state = self.state.lock().unwrap();
        let rtt = now.saturating_duration_since(start).as_secs_f64();
        if is_back_pressure {
            state.had_back_pressure = true;
        }
        state.in_flight -= 1;
        if use_rtt {
            state.current_rtt.0 += rtt;
            state.current_rtt.1 += 1;
        }
        let (sum, count) = state.current_rtt;
        // As Vector's tests do: a constant link's RTTs are all equal, not off by an epsilon.
        let current_rtt = (count > 0).then(|| (sum / count as f64 * 1e6).round() / 1e6);
        match state.past_rtt.state {
            None => {
                if let Some(current_rtt) = current_rtt {
                    state.past_rtt.update(current_rtt);
                    state.next_update = now + Duration::from_secs_f64(current_rtt);
                }
            }
            Some(mut past_rtt) => {
                if now >= state.next_update {
                    self.manage_limit(&mut state, past_rtt, current_rtt);
                    if let Some(current_rtt) = current_rtt {
                        past_rtt = state.past_rtt.update(current_rtt);
                    }
                    state.next_update = now + Duration::from_secs_f64(past_rtt.0);
                    state.current_rtt = (0.0, 0);
                    state.had_back_pressure = false;
                    state.reached_limit = false;
                }
            }
        }
    }

    fn manage_limit(&self, state: &mut ArcState, past: (f64, f64), current_rtt: Option<f64>) {
        let (past_mean, past_variance) = past;
        let threshold = past_variance.sqrt() * Self::RTT_DEVIATION_SCALE;
        if state.current_limit < MAX
            && state.reached_limit
            && !state.had_back_pressure
            && current_rtt.is_some_and(|rtt| rtt <= past_mean)
        {
            state.current_limit += 1;
        } else if state.current_limit > 1
            && (state.had_back_pressure || current_rtt.unwrap_or(0.0) >= past_mean + threshold)
        {
            let lower = (state.current_limit as f64 * Self::DECREASE_RATIO) as usize;
            state.current_limit = lower.max(1);
        }
        self.limit.set_capacity(state.current_limit).unwrap();
    }
}

// -------------------------------------------------------------------------------------------------
// The controllers compared.

/// Forwards to an algorithm and keeps what it last measured, for the report.
/// With `ARC_TRACE=<controller>` in the environment, it prints every window too.
#[derive(Clone)]
struct Watched<A> {
    algorithm: A,
    baseline: Arc<Mutex<Option<Duration>>>,
    /// When the run started, if its windows are printed.
    trace: Option<Instant>,
}

impl<A: Algorithm + Clone + Sync> Algorithm for Watched<A> {
    fn update(&mut self, sample: &Sample) -> usize {
        let next = self.algorithm.update(sample);
        *self.baseline.lock().unwrap() = self.algorithm.baseline();
        if let Some(start) = self.trace {
            println!(
                "  {:>7.3} cap {:>3} -> {:>3} | ended {:>3} congested {} stale {} | in flight \
                 {:>5.1} peak {:>3} | run time {:>5.1?} overdue {} | {:>6.1?} round trip {}",
                start.elapsed().as_secs_f64(),
                sample.capacity,
                next,
                sample.ended,
                sample.congested,
                sample.stale_congested,
                sample.in_flight,
                sample.peak_in_flight,
                sample.mean_run_time.map(|d| d.as_secs_f64() * 1e3),
                sample.overdue,
                sample.elapsed,
                sample.round_trip,
            );
        }
        next
    }

    fn baseline(&self) -> Option<Duration> {
        self.algorithm.baseline()
    }

    fn estimate(&self) -> Option<Duration> {
        self.algorithm.estimate()
    }
}

/// One of the controllers a scenario runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Controller {
    /// The crate's default: what its docs recommend.
    Vegas,
    /// Vector's ARC, re-implemented here.
    Arc,
    /// No controller: a fixed limit at the knee of the mixed scenarios' backend, `K`.
    Fixed,
    /// Each algorithm deciding for a fleet of replicas on one limit ([`fleet`]).
    FleetVegas,
}

impl Controller {
    const ALL: [Self; 2] = [Self::Vegas, Self::Arc];
    const FLEET: [Self; 1] = [Self::FleetVegas];

    fn name(self) -> &'static str {
        match self {
            Self::Vegas => "vegas",
            Self::Arc => "arc",
            Self::Fixed => "fixed K",
            Self::FleetVegas => "fleet/vegas",
        }
    }
}

/// What reads an algorithm's baseline after each window.
type Baseline = Arc<Mutex<Option<Duration>>>;

/// A limit that starts at 1, adapted by `algorithm` within `1..=MAX`.
fn adaptive<A: Algorithm + Clone + Sync>(
    algorithm: A,
    baseline: &Baseline,
    trace: Option<Instant>,
) -> Limit {
    let watched = Watched {
        algorithm,
        baseline: Arc::clone(baseline),
        trace,
    };
    Limit::builder(1)
        .adaptive(Adaptive::new(watched, 1..=MAX))
        .build()
}

/// How a run's limit is decided.
struct Decided {
    limit: Limit,
    /// ARC's controller, beside a plain limit.
    arc: Option<Arc<ArcController>>,
    /// A fleet's controller, beside a plain limit.
    fleet: Option<Arc<Fleet>>,
    baseline: Baseline,
}

/// A limit run by `controller`, starting at 1, and what reads its algorithm's baseline.
fn limit_for(controller: Controller) -> Decided {
    let baseline = Baseline::default();
    let trace = std::env::var("ARC_TRACE")
        .is_ok_and(|name| name == controller.name())
        .then(Instant::now);
    let watched = |algorithm: Box<dyn Algorithm>| -> Box<dyn Algorithm> {
        Box::new(Watched {
            algorithm: Boxed(Arc::new(Mutex::new(algorithm))),
            baseline: Arc::clone(&baseline),
            trace,
        })
    };
    let fleet = |algorithm: Box<dyn Algorithm>| {
        let limit = Limit::new(1);
        let algorithm = Boxed(Arc::new(Mutex::new(watched(algorithm))));
        let fleet = Fleet::new(limit.clone(), Adaptive::new(algorithm, 1..=MAX));
        (limit, Some(fleet))
    };
    let (limit, arc, fleet) = match controller {
        Controller::Vegas => (adaptive(Vegas::default(), &baseline, trace), None, None),
        Controller::Fixed => (Limit::new(K), None, None),
        Controller::Arc => {
            let limit = Limit::new(1);
            let arc = Arc::new(ArcController::new(limit.clone()));
            (limit, Some(arc), None)
        }
        Controller::FleetVegas => {
            let (limit, fleet) = fleet(Box::<Vegas>::default());
            (limit, None, fleet)
        }
    };
    Decided {
        limit,
        arc,
        fleet,
        baseline,
    }
}

/// A boxed algorithm, shared, so that [`Watched`] can wrap one (a fleet's leader holds it).
#[derive(Clone)]
struct Boxed(Arc<Mutex<Box<dyn Algorithm>>>);

impl Algorithm for Boxed {
    fn update(&mut self, sample: &Sample) -> usize {
        self.0.lock().unwrap().update(sample)
    }

    fn baseline(&self) -> Option<Duration> {
        self.0.lock().unwrap().baseline()
    }

    fn estimate(&self) -> Option<Duration> {
        self.0.lock().unwrap().estimate()
    }
}

// -------------------------------------------------------------------------------------------------
// A run.

/// How the clients load the server.
#[derive(Clone, Copy, Debug)]
enum Demand {
    /// `requests` requests, all waiting from the start (Vector's `interval: 0`), or sent one
    /// every `interval`; the run ends when the last one succeeds.
    Requests { requests: usize, interval: f64 },
    /// `clients` closed-loop clients for `seconds`: each sends its next request as soon as the
    /// last one is answered.
    Closed { clients: usize, seconds: f64 },
    /// Closed-loop clients of several kinds of work, each group from and until a moment of the
    /// run, for `seconds`.
    Mixed {
        loads: &'static [Load],
        seconds: f64,
    },
}

/// A group of closed-loop clients of one kind of work, from `from` until `until` seconds.
#[derive(Clone, Copy, Debug)]
struct Load {
    kind: Kind,
    clients: usize,
    from: f64,
    until: f64,
}

/// A scenario: a model, a demand, and changes of the model during the run.
struct Scenario {
    name: &'static str,
    model: Model,
    demand: Demand,
    /// At `.0` seconds, the concurrency limit becomes `.1`.
    changes: Vec<(f64, usize)>,
}

/// What a run measured.
#[derive(Clone, Debug)]
struct Figures {
    controller: Controller,
    /// Seconds until the last success (or the run's length).
    seconds: f64,
    in_flight_mean: f64,
    in_flight_mode: usize,
    in_flight_max: usize,
    rate_mean: f64,
    rate_max: usize,
    /// Successes per second.
    throughput: f64,
    successes: u64,
    deferred: u64,
    timed_out: u64,
    limit_mean: f64,
    limit_min: usize,
    limit_max: usize,
    /// The capacity whenever it changed, as seen by the attempts: `(seconds, capacity)`.
    limits: Vec<(f64, usize)>,
    /// When each attempt timed out, in seconds.
    timeouts: Vec<f64>,
    /// When each attempt ended, whatever its answer, in seconds.
    attempts: Vec<f64>,
    /// The server's in flight whenever it changed: `(seconds, in flight)`.
    in_flight: Vec<(f64, usize)>,
    baseline: Option<Duration>,
}

impl Figures {
    fn failures_per_success(&self) -> f64 {
        (self.deferred + self.timed_out) as f64 / self.successes.max(1) as f64
    }

    /// The share of the attempts that timed out.
    fn timed_out_share(&self) -> f64 {
        let attempts = self.successes + self.deferred + self.timed_out;
        self.timed_out as f64 / attempts.max(1) as f64
    }

    /// The share of the attempts that ended in `phases` (`[from, to)` seconds each) that timed
    /// out.
    fn timed_out_share_in(&self, phases: &[(f64, f64)]) -> f64 {
        let within = |at: &&f64| phases.iter().any(|&(from, to)| (from..to).contains(*at));
        let attempts = self.attempts.iter().filter(within).count();
        self.timeouts.iter().filter(within).count() as f64 / attempts.max(1) as f64
    }

    /// The server's mean in flight over `[from, to)` seconds, time-weighted.
    fn in_flight_between(&self, from: f64, to: f64) -> f64 {
        mean_between(&self.in_flight, from, to)
    }

    /// The first moment at or after `from` seconds that the capacity is at most `capacity`.
    fn falls_to(&self, from: f64, capacity: usize) -> Option<f64> {
        let mut current = 1;
        for &(at, value) in &self.limits {
            if at >= from && value <= capacity {
                return Some(at.max(from));
            }
            if at < from {
                current = value;
            }
        }
        (current <= capacity).then_some(from)
    }

    /// Whether the capacity came back to 1 after it first left it.
    fn back_to_one(&self) -> bool {
        let left = self.limits.iter().position(|&(_, capacity)| capacity > 1);
        left.is_some_and(|left| self.limits[left..].iter().any(|&(_, c)| c == 1))
    }

    /// The lowest capacity in `[from, to)` seconds.
    fn lowest_limit(&self, from: f64, to: f64) -> usize {
        let mut lowest = usize::MAX;
        let mut current = 1;
        for &(at, capacity) in &self.limits {
            if at >= to {
                break;
            }
            if at >= from {
                lowest = lowest.min(capacity);
            } else {
                current = capacity;
            }
        }
        lowest.min(current)
    }

    /// The first moment at or after `from` seconds that the capacity is at least `capacity`.
    fn reaches(&self, from: f64, capacity: usize) -> Option<f64> {
        let mut current = 1;
        for &(at, value) in &self.limits {
            if at >= from && value >= capacity {
                return Some(at);
            }
            if at < from {
                current = value;
            }
        }
        (current >= capacity).then_some(from)
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<15}{:>7.2}{:>7.1}{:>5}{:>5}{:>7.1}{:>5}{:>7.1}{:>6}{:>6}{:>8.3}{:>7.1}{:>5}{:>5}  {}",
            self.controller.name(),
            self.seconds,
            self.in_flight_mean,
            self.in_flight_max,
            self.in_flight_mode,
            self.rate_mean,
            self.rate_max,
            self.throughput,
            self.deferred,
            self.timed_out,
            self.failures_per_success(),
            self.limit_mean,
            self.limit_min,
            self.limit_max,
            self.baseline
                .map_or("-".to_owned(), |b| format!("{:.1} ms", b.as_secs_f64() * 1e3)),
        )
    }
}

const HEADER: &str =
    "               seconds  in flight       rate       ok/s  defer  t/o fail/ok  \
                      limit         baseline\n                         mean  max mode   mean  \
                      max                          mean  min  max";

/// The capacity, time-weighted, as the attempts see it.
struct Capacity {
    level: Level,
    changes: Vec<(f64, usize)>,
    start: Instant,
}

impl Capacity {
    fn see(&mut self, now: Instant, capacity: usize) {
        if capacity != self.level.value {
            self.level.set(now, capacity);
            let at = now.saturating_duration_since(self.start).as_secs_f64();
            self.changes.push((at, capacity));
        }
    }
}

/// The state a run's tasks share.
struct Run {
    server: Shared,
    limit: Limit,
    arc: Option<Arc<ArcController>>,
    fleet: Option<Arc<Fleet>>,
    capacity: Mutex<Capacity>,
    successes: AtomicU64,
    deferred: AtomicU64,
    timed_out: AtomicU64,
    timeouts: Mutex<Vec<f64>>,
    attempts: Mutex<Vec<f64>>,
    /// When the last success was, in nanoseconds from the start.
    last_success: AtomicU64,
    start: Instant,
    metrics: OperationMetrics,
}

impl Run {
    fn see_capacity(&self) {
        let now = Instant::now();
        self.capacity
            .lock()
            .unwrap()
            .see(now, self.limit.capacity());
    }

    /// One attempt of `kind` through the limit, by client number `client`: `true` if it
    /// succeeded.
    async fn attempt(self: &Arc<Self>, kind: Kind, client: usize) -> bool {
        let answer = match kind.gives_up {
            GivesUp::Inside => self
                .metrics
                .resources_operation(&self.limit, kind.operation, kind.executor, async {
                    self.operation(kind, client).await
                })
                .await
                .expect("the limit never turns anyone away"),
            GivesUp::AroundTheLayer => {
                let run = Arc::clone(self);
                let layered = ResourcesOperationLayer::new(self.limit.clone())
                    .operation(kind.operation)
                    .executor(kind.executor)
                    .metrics(self.metrics.clone())
                    .layer(service_fn(move |()| {
                        let run = Arc::clone(&run);
                        async move { Ok::<_, Infallible>(run.operation(kind, client).await) }
                    }));
                match Timeout::new(layered, kind.timeout).oneshot(()).await {
                    Ok(answer) => answer,
                    Err(elapsed) if elapsed.is::<Elapsed>() => Answer::TimedOut,
                    Err(other) => panic!("the limit never turns anyone away: {other}"),
                }
            }
        };
        self.see_capacity();
        let now = Instant::now().saturating_duration_since(self.start);
        self.attempts.lock().unwrap().push(now.as_secs_f64());
        match answer {
            Answer::Ok => {
                self.successes.fetch_add(1, Relaxed);
                let nanos = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
                self.last_success.fetch_max(nanos, Relaxed);
            }
            Answer::Deferred => {
                self.deferred.fetch_add(1, Relaxed);
            }
            Answer::TimedOut => {
                self.timed_out.fetch_add(1, Relaxed);
                self.timeouts.lock().unwrap().push(now.as_secs_f64());
            }
        }
        answer == Answer::Ok
    }

    /// An admitted attempt of `kind`, by client number `client`, as ARC's controller and a
    /// fleet's replicas hear it too.
    async fn operation(&self, kind: Kind, client: usize) -> Answer {
        self.see_capacity();
        let mut heard = Heard {
            run: self,
            started: Instant::now(),
            // A fleet's clients are spread over its replicas.
            admitted: self
                .fleet
                .as_ref()
                .map(|fleet| fleet.admitted(client % fleet::REPLICAS)),
            answer: None,
        };
        if let Some(arc) = &self.arc {
            arc.start();
        }
        let answer = attempt(&self.server, kind).await;
        heard.answer = Some(answer);
        answer
    }

    /// A request, tried until it succeeds, by client number `client`.
    async fn request(self: Arc<Self>, client: usize) {
        while !self.attempt(ONE_KIND, client).await {
            tokio::time::sleep(RETRY_BACKOFF).await;
        }
    }
}

/// How an admitted attempt's end reaches ARC's controller and a fleet's replicas, which hear
/// it as the limit does: when it answers, or when its caller drops it (ARC hears a timeout, as
/// Vector's ARC hears its request's `Elapsed`; a fleet's replica hears `cancelled`, as the
/// limit does).
struct Heard<'a> {
    run: &'a Run,
    started: Instant,
    admitted: Option<fleet::Admitted>,
    answer: Option<Answer>,
}

impl Drop for Heard<'_> {
    fn drop(&mut self) {
        let answer = self.answer.unwrap_or(Answer::TimedOut);
        if let Some(arc) = &self.run.arc {
            arc.end(self.started, answer);
        }
        if let (Some(fleet), Some(admitted)) = (&self.run.fleet, self.admitted) {
            let outcome = match self.answer {
                Some(answer) => answer.outcome(),
                None => Outcome::Cancelled,
            };
            let now = Instant::now();
            fleet.ended(
                admitted,
                &Ended::new(outcome, now - self.started, Some(now)),
            );
        }
    }
}

/// Runs the closed-loop clients of `loads` for `seconds`; returns when the run ended.
async fn closed_loop(run: &Arc<Run>, loads: &[Load], seconds: f64) -> Instant {
    let start = run.start;
    let tasks: Vec<_> = loads
        .iter()
        .flat_map(|load| (0..load.clients).map(move |_| *load))
        .enumerate()
        .map(|(client, load)| {
            let run = Arc::clone(run);
            tokio::spawn(async move {
                tokio::time::sleep_until(start + Duration::from_secs_f64(load.from)).await;
                let until = start + Duration::from_secs_f64(load.until.min(seconds));
                while Instant::now() < until {
                    if !run.attempt(load.kind, client).await {
                        tokio::time::sleep(RETRY_BACKOFF).await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep_until(start + Duration::from_secs_f64(seconds)).await;
    let end = Instant::now();
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    end
}

/// Runs `scenario` against `controller`, with the server's random numbers seeded by `seed`.
async fn run(scenario: &Scenario, controller: Controller, seed: u64) -> Figures {
    let start = Instant::now();
    let Decided {
        limit,
        arc,
        fleet,
        baseline,
    } = limit_for(controller);
    let ticks = fleet.as_ref().map(Fleet::start).unwrap_or_default();
    let run = Arc::new(Run {
        server: Arc::new(Mutex::new(Server::new(scenario.model, seed, start))),
        capacity: Mutex::new(Capacity {
            level: Level::new(start, limit.capacity()),
            changes: vec![(0.0, limit.capacity())],
            start,
        }),
        limit,
        arc,
        fleet,
        successes: AtomicU64::new(0),
        deferred: AtomicU64::new(0),
        timed_out: AtomicU64::new(0),
        timeouts: Mutex::new(Vec::new()),
        attempts: Mutex::new(Vec::new()),
        last_success: AtomicU64::new(0),
        start,
        metrics: OperationMetrics::disabled(),
    });
    let changes: Vec<_> = scenario
        .changes
        .iter()
        .map(|&(at, limit)| {
            let server = Arc::clone(&run.server);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs_f64(at)).await;
                server.lock().unwrap().model.concurrency.limit = Some(limit);
            })
        })
        .collect();
    let end = match scenario.demand {
        Demand::Requests { requests, interval } => {
            let mut tasks = Vec::with_capacity(requests);
            for i in 0..requests {
                if interval > 0.0 {
                    tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 * interval))
                        .await;
                }
                tasks.push(tokio::spawn(Arc::clone(&run).request(i)));
            }
            for task in tasks {
                task.await.unwrap();
            }
            start + Duration::from_nanos(run.last_success.load(Relaxed))
        }
        Demand::Closed { clients, seconds } => {
            let load = Load {
                kind: ONE_KIND,
                clients,
                from: 0.0,
                until: seconds,
            };
            closed_loop(&run, &[load], seconds).await
        }
        Demand::Mixed { loads, seconds } => closed_loop(&run, loads, seconds).await,
    };
    for task in changes.into_iter().chain(ticks) {
        task.abort();
    }
    let seconds = end.saturating_duration_since(start).as_secs_f64();
    let mut server = run.server.lock().unwrap();
    let (in_flight_mean, in_flight_mode, in_flight_max) = server.in_flight.stats(end);
    let in_flight = server.in_flight.trace.clone();
    let (rate_mean, _, rate_max) = server.rate.stats(end);
    let mut capacity = run.capacity.lock().unwrap();
    let (limit_mean, _, limit_max) = capacity.level.stats(end);
    let successes = run.successes.load(Relaxed);
    let timeouts = run.timeouts.lock().unwrap().clone();
    let attempts = run.attempts.lock().unwrap().clone();
    let baseline = *baseline.lock().unwrap();
    Figures {
        controller,
        seconds,
        in_flight_mean,
        in_flight_mode,
        in_flight_max,
        rate_mean,
        rate_max,
        throughput: successes as f64 / seconds,
        successes,
        deferred: run.deferred.load(Relaxed),
        timed_out: run.timed_out.load(Relaxed),
        limit_mean,
        limit_min: capacity.level.min,
        limit_max,
        limits: capacity.changes.clone(),
        timeouts,
        attempts,
        in_flight,
        baseline,
    }
}

/// Runs `scenario` against every controller and prints the table, with Vector's published
/// ranges (`published`) under it.
async fn compare(scenario: &Scenario, published: &str) -> BTreeMap<&'static str, Figures> {
    compare_these(scenario, published, &Controller::ALL).await
}

/// [`compare`], for `controllers`.
async fn compare_these(
    scenario: &Scenario,
    published: &str,
    controllers: &[Controller],
) -> BTreeMap<&'static str, Figures> {
    let mut figures = BTreeMap::new();
    let mut table = format!("\n== {} (seed {})\n{HEADER}\n", scenario.name, SEED.get());
    let seed = SEED.get();
    for &controller in controllers {
        let run = run(scenario, controller, seed).await;
        table.push_str(&format!("{run}\n"));
        figures.insert(controller.name(), run);
    }
    table.push_str(&format!(
        "vector's published ranges (ARC, its own harness): {published}\n"
    ));
    println!("{table}");
    figures
}

thread_local! {
    /// The seed of the server's random numbers in the run under way (see [`over_seeds`]).
    static SEED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs a scenario once for each seed of the server's random numbers, 0 to 7, or for the one
/// `ARC_SEED=<n>` gives: every target holds on each.
async fn over_seeds<F: std::future::Future<Output = ()>>(scenario: impl Fn() -> F) {
    let seeds = match std::env::var("ARC_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
    {
        Some(seed) => seed..seed + 1,
        None => 0..8,
    };
    for seed in seeds {
        SEED.set(seed);
        scenario().await;
    }
}

/// `value` passes `check`, or the test fails with `what` and why. With `ARC_SOFT=1` in the
/// environment a miss is printed (`MISS ...`) and the test goes on: every target of a run, on
/// other random numbers (`ARC_SEED`), in one pass.
#[track_caller]
fn target(what: &str, value: f64, check: impl FnOnce(f64) -> bool, reason: &str) {
    if std::env::var_os("ARC_SOFT").is_some() {
        if !check(value) {
            println!("MISS {what} = {value:.3} (seed {}): {reason}", SEED.get());
        }
        return;
    }
    assert!(
        check(value),
        "{what} = {value:.3} (seed {}): {reason}",
        SEED.get()
    );
}

/// A model of `delay` seconds, nothing else.
fn link(delay: f64) -> Model {
    Model {
        delay,
        jitter: 0.0,
        concurrency: Params::NONE,
        rate: Params::NONE,
    }
}

fn requests(requests: usize) -> Demand {
    Demand::Requests {
        requests,
        interval: 0.0,
    }
}

/// The algorithms the crate ships, as run here: each is held to every target of every
/// scenario.
const SHIPPED: [&str; 1] = ["vegas"];

/// Every built-in algorithm's baseline reads the run time at low load (`low`, in seconds)
/// within 10%: what its gauge tells an operator is normal. (It follows what it measures, and
/// does not drift up with the load.)
#[track_caller]
fn baselines_read(runs: &BTreeMap<&str, Figures>, low: f64) {
    for name in SHIPPED {
        let baseline = runs[name].baseline.expect("a baseline").as_secs_f64();
        target(
            &format!("{name} baseline (s)"),
            baseline,
            |b| (b - low).abs() <= 0.1 * low,
            "the baseline gauge reads the low-load run time within 10%",
        );
    }
}

// -------------------------------------------------------------------------------------------------
// Vector's scenarios.

/// `constant-link.yaml`: 100 ms whatever the load. Nothing says stop, so the limit should climb
/// fast.
#[tokio::test(start_paused = true)]
async fn constant_link() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "constant-link (500 requests, 100 ms)",
            model: link(0.1),
            demand: requests(500),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 15-16, max 30-31; limit mean 16-18, max 22-32",
        )
        .await;
        let arc = &runs["arc"];
        for name in SHIPPED {
            target(
                &format!("{name} mean in flight"),
                runs[name].in_flight_mean,
                |v| v >= 16.0,
                "a link that never slows should be filled at least as well as ARC fills it (15-16)",
            );
            target(
                &format!("{name} seconds for 500"),
                runs[name].seconds,
                |s| s <= arc.seconds,
                "500 requests at least as fast as ARC: a slow start, not +1 per RTT",
            );
        }
        baselines_read(&runs, 0.1);
    })
    .await;
}

/// `defers-at-high-concurrency.yaml`: above 5 in flight the server answers an error.
#[tokio::test(start_paused = true)]
async fn defers_at_high_concurrency() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "defers-at-high-concurrency (500 requests, defers above 5)",
            model: Model {
                concurrency: Params {
                    limit: Some(5),
                    action: Action::Defer,
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: requests(500),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 2.2-5.0, max 5-18, mode 0-6; rate mean 20-44",
        )
        .await;
        above_n(&runs, 5.0);
    })
    .await;
}

/// `drops-at-high-concurrency.yaml`: above 5 in flight the server never answers.
#[tokio::test(start_paused = true)]
async fn drops_at_high_concurrency() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "drops-at-high-concurrency (500 requests, drops above 5)",
            model: Model {
                concurrency: Params {
                    limit: Some(5),
                    action: Action::Drop,
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: requests(500),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 3.0-4.0, max 4-5, mode 3-5; rate mean 31-54",
        )
        .await;
        above_n(&runs, 5.0);
    })
    .await;
}

/// The targets of a server that turns away what is above `n`.
#[track_caller]
fn above_n(runs: &BTreeMap<&str, Figures>, n: f64) {
    let arc = &runs["arc"];
    for name in SHIPPED {
        target(
            &format!("{name} mean in flight"),
            runs[name].in_flight_mean,
            |v| (v - n).abs() <= 1.0,
            "the server serves N at once: the limit should hold N, give or take one",
        );
        target(
            &format!("{name} failures per success"),
            runs[name].failures_per_success(),
            |f| f <= arc.failures_per_success(),
            "each probe above N costs a failure: no more of them than ARC's",
        );
    }
    baselines_read(runs, 0.1);
}

/// `defers-at-high-rate.yaml`: above 100 requests a second the server answers an error.
#[tokio::test(start_paused = true)]
async fn defers_at_high_rate() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "defers-at-high-rate (1000 requests, defers above 100/s)",
            model: Model {
                rate: Params {
                    limit: Some(100),
                    action: Action::Defer,
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: requests(1000),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 6.0-9.0, max 16-24; rate mean 31-75, max 90-123",
        )
        .await;
        baselines_read(&runs, 0.1);
    })
    .await;
}

/// `jittery-link-small.yaml`: 100 ms plus an exponential 10 ms on average, at any load.
#[tokio::test(start_paused = true)]
async fn jittery_link_small() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "jittery-link-small (1000 requests, 100 ms + 10% exponential jitter)",
            model: Model {
                jitter: 0.1,
                ..link(0.1)
            },
            demand: requests(1000),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 8-20, max 20-40; limit mean 9-20, max 20-40; rate mean 70-150",
        )
        .await;
        for name in SHIPPED {
            let figures = &runs[name];
            target(
                &format!("{name} mean in flight"),
                figures.in_flight_mean,
                |v| v >= 8.0,
                "jitter is not load: the limit should climb as on a constant link (ARC: 8-20)",
            );
            let peaked = figures.reaches(0.0, figures.limit_max).unwrap_or(0.0);
            target(
                &format!("{name} lowest limit after its peak"),
                figures.lowest_limit(peaked, f64::INFINITY) as f64,
                |l| l >= 0.5 * figures.limit_max as f64,
                "no collapse: once up, the limit should not fall below half its peak chasing noise",
            );
        }
        baselines_read(&runs, 0.11);
    })
    .await;
}

/// `medium-send.yaml`: a request every 25 ms on a 100 ms link: about 4 in flight.
#[tokio::test(start_paused = true)]
async fn medium_send() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "medium-send (500 requests, one per 25 ms, 100 ms)",
            model: link(0.1),
            demand: Demand::Requests {
                requests: 500,
                interval: 0.025,
            },
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 4.0-4.5, max 8, mode 4-5; limit max 9",
        )
        .await;
        baselines_read(&runs, 0.1);
    })
    .await;
}

/// `slow-send-1.yaml` and `slow-send-2.yaml`: a request every 100 ms or 50 ms on a 50 ms link.
#[tokio::test(start_paused = true)]
async fn slow_send() {
    over_seeds(|| async {
        for (interval, published) in [
            (0.1, "in flight mean 0.5-0.55, max 1; limit mean 1.0-2.0"),
            (0.05, "in flight mean 1.0-1.2, max 1-2; limit mean 2.0-2.5"),
        ] {
            let scenario = Scenario {
                name: if interval > 0.07 {
                    "slow-send-1 (100 requests, one per 100 ms, 50 ms)"
                } else {
                    "slow-send-2 (100 requests, one per 50 ms, 50 ms)"
                },
                model: link(0.05),
                demand: Demand::Requests {
                    requests: 100,
                    interval,
                },
                changes: Vec::new(),
            };
            let runs = compare(&scenario, published).await;
            baselines_read(&runs, 0.05);
        }
    })
    .await;
}

/// `shallow-knee.yaml`: past 10 in flight each more multiplies the delay by 1.1. Throughput
/// peaks at 10-11 in flight (100/s) and falls slowly past it.
#[tokio::test(start_paused = true)]
async fn shallow_knee() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "shallow-knee (1000 requests, ×1.1 per request past 10)",
            model: Model {
                concurrency: Params {
                    knee_start: Some(10),
                    knee_exp: Some(1.1),
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: requests(1000),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 9-11, max 12, mode 9-12; rate mean 87-89, max 103-108; limit mean 10-12, \
             max 12",
        )
        .await;
        let vegas = &runs["vegas"];
        target(
            "vegas max in flight",
            vegas.in_flight_max as f64,
            |m| m <= 12.0,
            "hold at the knee: past 12 every request costs more run time than it adds throughput",
        );
        for name in SHIPPED {
            target(
                &format!("{name} mean in flight"),
                runs[name].in_flight_mean,
                |m| (9.0..=11.0).contains(&m),
                "hold at the knee (10-11), within ARC's published range (9-11)",
            );
            target(
                &format!("{name} ok/s"),
                runs[name].throughput,
                |t| t >= 87.0,
                "at ARC's published rate or better (87/s)",
            );
        }
        baselines_read(&runs, 0.1);
    })
    .await;
}

/// `slow-link.yaml`: each request in flight adds 100 ms to every new one: throughput is 10/s
/// whatever the load, so more in flight only adds latency.
#[tokio::test(start_paused = true)]
async fn slow_link() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "slow-link (200 requests, +100 ms per request in flight)",
            model: Model {
                concurrency: Params {
                    scale: 1.0,
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: requests(200),
            changes: Vec::new(),
        };
        let runs = compare(
            &scenario,
            "in flight mean 1.5-5.0, max 2-7, mode 2-5; limit mean 1.7-5.0, mode 2-5",
        )
        .await;
        for name in SHIPPED {
            target(
                &format!("{name} mean in flight"),
                runs[name].in_flight_mean,
                |m| m <= 5.0,
                "more in flight buys nothing here: keep it low, as ARC does (1.5-5)",
            );
        }
        baselines_read(&runs, 0.1);
    })
    .await;
}

// -------------------------------------------------------------------------------------------------
// Not in Vector's set.

/// A server that defers above 24, then above 8 from 5 s, then above 24 again from 10 s.
#[tokio::test(start_paused = true)]
async fn capacity_24_to_8_to_24() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "capacity 24 -> 8 (5 s) -> 24 (10 s), defers above it, 300 clients for 15 s",
            model: Model {
                concurrency: Params {
                    limit: Some(24),
                    action: Action::Defer,
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: Demand::Closed {
                clients: 300,
                seconds: 15.0,
            },
            changes: vec![(5.0, 8), (10.0, 24)],
        };
        let runs = compare(&scenario, "not in Vector's set").await;
        // In round trips of 100 ms (a deferral is answered in one too).
        let round_trips = |at: Option<f64>, from: f64| at.map_or(f64::INFINITY, |at| (at - from) / 0.1);
        for figures in runs.values() {
            println!(
                "{:<9} at or below 10 after 5 s: {:4.1} round trips, lowest 5-10 s: {:2}; 18 or more \
                 after 10 s: {:4.1} round trips, 24: {:4.1}",
                figures.controller.name(),
                round_trips(figures.falls_to(5.0, 10), 5.0),
                figures.lowest_limit(5.0, 10.0),
                round_trips(figures.reaches(10.0, 18), 10.0),
                round_trips(figures.reaches(10.0, 24), 10.0),
            );
        }
        for name in SHIPPED {
            let figures = &runs[name];
            target(
                &format!("{name} round trips to 10 or less at capacity 8"),
                round_trips(figures.falls_to(5.0, 10), 5.0),
                |r| r <= 5.0,
                "a decrease goes toward what the backend served (8 per round trip), not one ×0.9 \
                 step per round trip: at or below 10 within 5 round trips",
            );
            target(
                &format!("{name} lowest limit at capacity 8"),
                figures.lowest_limit(5.0, 10.0) as f64,
                |l| l >= 4.0,
                "cuts that never compound, by half at most: never below half the new capacity",
            );
            target(
                &format!("{name} round trips back to 18"),
                round_trips(figures.reaches(10.0, 18), 10.0),
                |r| r <= 10.0,
                "the capacity came back: slow start again, not +1 per round trip",
            );
        }
        target(
            "vegas round trips back to 24",
            round_trips(runs["vegas"].reaches(10.0, 24), 10.0),
            |r| r <= 10.0,
            "the capacity came back: find it within 10 round trips",
        );
        baselines_read(&runs, 0.1);
    })
    .await;
}

/// A steep knee: past 8 in flight each more doubles the delay (at 12, 1.6 s: past the client's
/// timeout). Once found, the limit must not cycle back into timeouts.
#[tokio::test(start_paused = true)]
async fn steep_knee() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "steep knee (×2 per request past 8), 300 clients for 10 s",
            model: Model {
                concurrency: Params {
                    knee_start: Some(8),
                    knee_exp: Some(2.0),
                    ..Params::NONE
                },
                ..link(0.1)
            },
            demand: Demand::Closed {
                clients: 300,
                seconds: 10.0,
            },
            changes: Vec::new(),
        };
        let runs = compare(&scenario, "not in Vector's set").await;
        for figures in runs.values() {
            println!(
                "{:<9} timeouts at: {:?}",
                figures.controller.name(),
                figures
                    .timeouts
                    .iter()
                    .map(|t| format!("{t:.2}"))
                    .collect::<Vec<_>>()
            );
        }
        let arc = &runs["arc"];
        for name in SHIPPED {
            let figures = &runs[name];
            let late = figures.timeouts.iter().filter(|&&t| t >= 3.0).count();
            target(
                &format!("{name} timeouts after 3 s"),
                late as f64,
                |n| n == 0.0,
                "no cycling into timeouts: once the knee is found the limit stays out of them",
            );
            target(
                &format!("{name} ok/s"),
                figures.throughput,
                |t| t >= 0.9 * arc.throughput,
                "at least 90% of ARC's throughput",
            );
        }
        baselines_read(&runs, 0.1);
    })
    .await;
}

// -------------------------------------------------------------------------------------------------
// Mixed work: one limit shared by operations whose run times differ tenfold.

/// What the mixed scenarios send: a verify of 100 ms (on a model of 100 ms), a tool call of
/// 300 ms and a judge of 1 s, each given up by its caller after three times its run time.
const VERIFY: Kind = Kind {
    operation: Operation::Verify,
    executor: Executor::Subprocess,
    factor: 1.0,
    timeout: Duration::from_millis(300),
    gives_up: GivesUp::Inside,
};
const TOOL: Kind = Kind {
    operation: Operation::Tool,
    executor: Executor::Thread,
    factor: 3.0,
    timeout: Duration::from_millis(900),
    gives_up: GivesUp::Inside,
};
const JUDGE: Kind = Kind {
    operation: Operation::Judge,
    executor: Executor::Inline,
    factor: 10.0,
    timeout: Duration::from_secs(3),
    gives_up: GivesUp::Inside,
};

/// The backend of the mixed scenarios: it serves `K` at once at its kinds' run times (give or
/// take an exponential 10%); past `K`, each more in flight doubles every run time, so that at
/// `K + 2` every caller gives up.
const K: usize = 12;

fn knee_at_k() -> Model {
    Model {
        jitter: 0.1,
        concurrency: Params {
            knee_start: Some(K),
            knee_exp: Some(2.0),
            ..Params::NONE
        },
        ..link(0.1)
    }
}

/// A group of `clients` closed-loop clients of `kind` from `from` until `until` seconds.
const fn load(kind: Kind, clients: usize, from: f64, until: f64) -> Load {
    Load {
        kind,
        clients,
        from,
        until,
    }
}

/// Runs a mixed scenario of `loads` for 90 s on [`knee_at_k`]: see [`mixed_on`].
async fn mixed(
    name: &'static str,
    loads: &'static [Load],
    phases: &[(f64, f64)],
) -> BTreeMap<&'static str, Figures> {
    mixed_on(name, knee_at_k(), loads, 90.0, phases, &Controller::ALL).await
}

/// Runs a mixed scenario of `loads` for `seconds` on `model` against `controllers`, prints each
/// controller's mean in flight (against `K`) over each of `phases` (seconds), its share of
/// timeouts, whether it went back to 1, and its limit every second; asserts the targets of
/// mixed work; returns the runs.
async fn mixed_on(
    name: &'static str,
    model: Model,
    loads: &'static [Load],
    seconds: f64,
    phases: &[(f64, f64)],
    controllers: &[Controller],
) -> BTreeMap<&'static str, Figures> {
    let scenario = Scenario {
        name,
        model,
        demand: Demand::Mixed { loads, seconds },
        changes: Vec::new(),
    };
    let runs = compare_these(&scenario, "not in Vector's set", controllers).await;
    for figures in runs.values() {
        let shown: Vec<String> = phases
            .iter()
            .map(|&(from, to)| {
                let k = figures.in_flight_between(from, to) / K as f64;
                format!("{from:.0}-{to:.0} s {k:.2} K")
            })
            .collect();
        println!(
            "{:<15} in flight {} | timed out {:4.1}% ({:.1}% in the measured phases) | back to 1: \
             {:<5} | limit every 1 s: {}",
            figures.controller.name(),
            shown.join(", "),
            100.0 * figures.timed_out_share(),
            100.0 * figures.timed_out_share_in(phases),
            figures.back_to_one(),
            figures.trace(1.0),
        );
        if std::env::var("ARC_TIMEOUTS").is_ok() {
            let at: Vec<String> = figures.timeouts.iter().map(|t| format!("{t:.1}")).collect();
            println!(
                "{:<15} timeouts at {}",
                figures.controller.name(),
                at.join(" ")
            );
        }
    }
    for name in SHIPPED {
        let figures = &runs[name];
        for &(from, to) in phases {
            target(
                &format!("{name} in flight {from:.0}-{to:.0} s, in K"),
                figures.in_flight_between(from, to) / K as f64,
                |k| (0.75..=1.15).contains(&k),
                "each kind read against what is normal for it: the backend's K filled, not \
                 collapsed by a slow kind read as a queue, whichever came first",
            );
        }
        target(
            &format!("{name} back to a capacity of 1"),
            f64::from(u8::from(figures.back_to_one())),
            |back| back == 0.0,
            "once work flows, a slow kind's first run times are no queue",
        );
    }
    for name in SHIPPED {
        let figures = &runs[name];
        target(
            &format!("{name} share of operations timed out"),
            figures.timed_out_share(),
            |share| share < 0.02,
            "fewer than 2%; a slow start that steps past the cliff costs one \
             capacity of them, once",
        );
    }
    runs
}

impl Figures {
    /// The capacity every `every` seconds.
    fn trace(&self, every: f64) -> String {
        let mut values = Vec::new();
        let (mut at, mut current, mut changes) = (0.0, 1, self.limits.iter().peekable());
        while at < self.seconds {
            while let Some(&&(when, capacity)) = changes.peek() {
                if when > at {
                    break;
                }
                current = capacity;
                changes.next();
            }
            values.push(current.to_string());
            at += every;
        }
        values.join(" ")
    }
}

/// Verifies and judges from the start.
#[tokio::test(start_paused = true)]
async fn mixed_work_two_kinds() {
    over_seeds(|| async {
        const LOADS: &[Load] = &[load(VERIFY, 24, 0.0, 90.0), load(JUDGE, 24, 0.0, 90.0)];
        mixed(
            "mixed: verify 100 ms + judge 1 s from the start, knee at 12",
            LOADS,
            &[(10.0, 90.0)],
        )
        .await;
    })
    .await;
}

/// Verifies alone for 20 s, then judges too: the judges' first run times are not a queue.
#[tokio::test(start_paused = true)]
async fn mixed_work_fast_kind_first() {
    over_seeds(|| async {
        const LOADS: &[Load] = &[load(VERIFY, 24, 0.0, 90.0), load(JUDGE, 24, 20.0, 90.0)];
        mixed(
            "mixed: verify 100 ms from 0 s, judge 1 s from 20 s, knee at 12",
            LOADS,
            &[(10.0, 20.0), (30.0, 90.0)],
        )
        .await;
    })
    .await;
}

/// Judges alone for 20 s, then verifies too (a slow start of judges takes a few seconds).
#[tokio::test(start_paused = true)]
async fn mixed_work_slow_kind_first() {
    over_seeds(|| async {
        const LOADS: &[Load] = &[load(JUDGE, 24, 0.0, 90.0), load(VERIFY, 24, 20.0, 90.0)];
        mixed(
            "mixed: judge 1 s from 0 s, verify 100 ms from 20 s, knee at 12",
            LOADS,
            &[(10.0, 20.0), (30.0, 90.0)],
        )
        .await;
    })
    .await;
}

/// Three kinds from the start.
#[tokio::test(start_paused = true)]
async fn mixed_work_three_kinds() {
    over_seeds(|| async {
        const LOADS: &[Load] = &[
            load(VERIFY, 16, 0.0, 90.0),
            load(TOOL, 16, 0.0, 90.0),
            load(JUDGE, 16, 0.0, 90.0),
        ];
        mixed(
            "mixed: verify 100 ms + tool 300 ms + judge 1 s, knee at 12",
            LOADS,
            &[(10.0, 90.0)],
        )
        .await;
    })
    .await;
}

/// The mix changes while the limit serves: mostly verifies, then mostly judges, then mostly
/// verifies with tool calls too.
#[tokio::test(start_paused = true)]
async fn mixed_work_whose_mix_changes() {
    over_seeds(|| async {
        const LOADS: &[Load] = &[
            load(VERIFY, 8, 0.0, 90.0),
            load(VERIFY, 24, 0.0, 30.0),
            load(VERIFY, 24, 60.0, 90.0),
            load(JUDGE, 8, 0.0, 90.0),
            load(JUDGE, 24, 30.0, 60.0),
            load(TOOL, 16, 60.0, 90.0),
        ];
        mixed(
            "mixed: 32 verify + 8 judge, then 8 + 32 (30 s), then 32 + 8 + 16 tool (60 s)",
            LOADS,
            &[(10.0, 30.0), (40.0, 60.0), (70.0, 90.0)],
        )
        .await;
    })
    .await;
}

// -------------------------------------------------------------------------------------------------
// Callers whose patience is the slow kind's run time.

/// A verify of 100 ms whose client gives up after 1 s, around the layer.
const VERIFY_PATIENT: Kind = Kind {
    timeout: Duration::from_secs(1),
    gives_up: GivesUp::AroundTheLayer,
    ..VERIFY
};
/// A judge of 1 s whose client gives up after 1 s, around the layer: at the knee or below it
/// just makes it; admitted above the knee it runs 2 s or more, and its client gives up.
const JUDGE_PATIENT: Kind = Kind {
    timeout: Duration::from_secs(1),
    gives_up: GivesUp::AroundTheLayer,
    ..JUDGE
};

/// The backend of [`knee_at_k`] without jitter: a judge at the knee or below takes 1 s, no
/// more, so that a fixed limit of `K` loses none to its clients' timeout.
fn steady_knee_at_k() -> Model {
    Model {
        jitter: 0.0,
        ..knee_at_k()
    }
}

/// One limit shared by verifies and judges, 16 closed-loop clients each, every client giving up
/// after 1 s with tower's `Timeout` around the layer (so the limit hears `cancelled`, not
/// `timeout`), in front of a backend that serves `K` at once and doubles every run time per
/// call more: 60 s of demand, means over 20-60 s, verifies first in line, then judges.
#[tokio::test(start_paused = true)]
async fn callers_whose_patience_is_the_slow_kinds_run_time() {
    over_seeds(|| async {
        const VERIFY_FIRST: &[Load] = &[
            load(VERIFY_PATIENT, 16, 0.0, 60.0),
            load(JUDGE_PATIENT, 16, 0.0, 60.0),
        ];
        const JUDGE_FIRST: &[Load] = &[
            load(JUDGE_PATIENT, 16, 0.0, 60.0),
            load(VERIFY_PATIENT, 16, 0.0, 60.0),
        ];
        let controllers = [&Controller::ALL[..], &[Controller::Fixed]].concat();
        for (name, loads) in [
            (
                "patience: verify 100 ms + judge 1 s, 1 s timeout around the layer, verify first",
                VERIFY_FIRST,
            ),
            (
                "patience: judge 1 s + verify 100 ms, 1 s timeout around the layer, judge first",
                JUDGE_FIRST,
            ),
        ] {
            let runs = mixed_on(
                name,
                steady_knee_at_k(),
                loads,
                60.0,
                &[(20.0, 60.0)],
                &controllers,
            )
            .await;
            target(
                "fixed K share of operations timed out",
                runs["fixed K"].timed_out_share(),
                |share| share == 0.0,
                "the scenario as written: at the knee or below every judge makes it",
            );
        }
    })
    .await;
}

// -------------------------------------------------------------------------------------------------
// A slow, steady rise is not a queue.

/// A backend whose run time rises 1% for each other call in flight (50 ms, plus 0.5 ms a call),
/// without jitter, and that answers an error above K: 12, then 6 from 10 s, then 12 from 20 s.
#[tokio::test(start_paused = true)]
async fn a_slow_steady_rise_is_not_a_queue() {
    over_seeds(|| async {
        let scenario = Scenario {
            name: "slow rise: 50 ms + 1% per call in flight, defers above K = 12, 6 (10 s), 12 (20 s)",
            model: Model {
                concurrency: Params {
                    scale: 0.01,
                    limit: Some(12),
                    action: Action::Defer,
                    ..Params::NONE
                },
                ..link(0.05)
            },
            demand: Demand::Closed {
                clients: 40,
                seconds: 30.0,
            },
            changes: vec![(10.0, 6), (20.0, 12)],
        };
        let controllers = [&Controller::ALL[..], &Controller::FLEET[..]].concat();
        let runs = compare_these(&scenario, "not in Vector's set", &controllers).await;
        for figures in runs.values() {
            let phases: Vec<String> = [(5.0, 10.0, 12.0), (15.0, 20.0, 6.0), (25.0, 30.0, 12.0)]
                .iter()
                .map(|&(from, to, k)| {
                    let share = figures.in_flight_between(from, to) / k;
                    format!("{from:.0}-{to:.0} s {share:.2} K")
                })
                .collect();
            println!(
                "{:<15} in flight {} | limit every 1 s: {}",
                figures.controller.name(),
                phases.join(", "),
                figures.trace(1.0)
            );
        }
        let shipped = controllers.iter().map(|c| c.name()).filter(|n| *n != "arc");
        for name in shipped {
            for (from, to, k) in [(5.0, 10.0, 12.0), (15.0, 20.0, 6.0), (25.0, 30.0, 12.0)] {
                target(
                    &format!("{name} in flight {from:.0}-{to:.0} s, in K"),
                    runs[name].in_flight_between(from, to) / k,
                    |share| share >= 0.8,
                    "a rise of 1% per call in flight is no queue: fill at least 0.8 K, in one \
                     process and in a fleet",
                );
            }
        }
    })
    .await;
}
