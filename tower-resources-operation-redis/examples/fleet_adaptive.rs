//! An adaptive fleet limit: three replicas, each a process of its own, find together how many
//! requests a backend serves at once, without being told, and follow it when it changes.
//!
//! ```text
//! cargo run -p tower-resources-operation-redis --example fleet_adaptive
//! ```
//!
//! It starts a `redis-server` of its own on a free port of 127.0.0.1 (with no persistence), a
//! simulated backend in this process, then this program three more times as replicas.
//!
//! The backend is a TCP server on 127.0.0.1 that answers each request after 50 ms. It serves K
//! requests at once; a request that arrives while K are already in it is *deferred*: answered
//! `no` after the same 50 ms, holding its place meanwhile, so overload costs throughput. K is 8
//! for 4 s, then 4 for 4 s, then 8 again; the replicas are never told.
//!
//! Each replica runs 12 clients (36 in all), each calling the backend without pause through a
//! `ResourcesOperationLayer` on a `RedisLimit` made adaptive with `Vegas`, from a capacity of 1
//! within 1..=32; a deferral is an `error` outcome. The leader among the replicas sets the
//! fleet's capacity from what all of them observe.
//!
//! Every 0.5 s this process prints K, the fleet's capacity and leases held as stored in Redis,
//! the backend's time-weighted mean in flight (deferred requests included) and its successes
//! and deferrals in that interval. At the end each replica prints, from its own exported
//! metrics only, its outcomes, the `gym.resources.limit.capacity` and `limit` gauges and the
//! fleet's `gym.resources.limit.adaptive.baseline_ms` and `.estimate_ms`, and whether it led;
//! then a summary per phase: mean in flight against K, and failures per success.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader as AsyncBufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::adaptive::{Adaptive, Vegas};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, LIMIT_BASELINE_INSTRUMENT, LIMIT_CAPACITY_INSTRUMENT,
    LIMIT_ESTIMATE_INSTRUMENT, LIMIT_INSTRUMENT, OUTCOME_ATTRIBUTE, REJECTED_INSTRUMENT,
};
use tower_resources_operation::{
    Executor, Operation, OperationMetrics, Outcome, Rejected, ResourcesOperationLayer,
};
use tower_resources_operation_redis::RedisLimit;

const NAME: &str = "backend";
const REPLICAS: usize = 3;
/// Client loops per replica.
const CLIENTS: usize = 12;
/// How long the backend takes to answer, served or deferred.
const DELAY: Duration = Duration::from_millis(50);
/// The backend's capacity K, phase by phase.
const PHASES: [usize; 3] = [8, 4, 8];
const PHASE: Duration = Duration::from_secs(4);
/// The adaptive limit's bounds; it starts at the bottom.
const BOUNDS: RangeInclusive<usize> = 1..=32;
/// How often this process samples the fleet in Redis, and how often it prints a line.
const SAMPLE: Duration = Duration::from_millis(100);
const SAMPLES_PER_LINE: u32 = 5;
/// How long a replica has for each step before this process gives up on it.
const PATIENCE: Duration = Duration::from_secs(30);

fn main() {
    let mut args = std::env::args().skip(1);
    let done = match (
        args.next().as_deref(),
        args.next(),
        args.next(),
        args.next(),
    ) {
        (Some("--replica"), Some(index), Some(redis), Some(backend)) => {
            replica(&index, &redis, &backend)
        }
        _ => fleet(),
    };
    if let Err(error) = done {
        eprintln!("fleet_adaptive: {error}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------------
// The fleet: Redis, the backend, three replicas, and the watch
// ---------------------------------------------------------------------------------------------

fn fleet() -> Result<(), String> {
    let Some(redis) = RedisServer::start() else {
        eprintln!(
            "redis-server was not found on PATH. Install it (Debian/Ubuntu: \
             `apt-get install redis-server`) and run this example again."
        );
        std::process::exit(1);
    };
    let url = format!("redis://127.0.0.1:{}/", redis.port);
    println!(
        "tower-resources-operation adaptive fleet example: {REPLICAS} replicas x {CLIENTS} \
         clients share the adaptive limit {NAME:?} (Vegas, from 1 within {}..={}) through \
         redis-server on 127.0.0.1:{}.",
        BOUNDS.start(),
        BOUNDS.end(),
        redis.port
    );
    println!(
        "The backend answers in {} ms and defers what is above its capacity K, which the \
         replicas are not told: K = {} for {} s each.\n",
        DELAY.as_millis(),
        PHASES.map(|k| k.to_string()).join(", then "),
        PHASE.as_secs()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|error| format!("a tokio runtime: {error}"))?;
    let outcome = runtime.block_on(run(&url));
    drop(redis);
    outcome
}

async fn run(url: &str) -> Result<(), String> {
    // A plain (not adaptive) handle on the same fleet limit, only to read the fleet's state.
    let watch = RedisLimit::builder(NAME, *BOUNDS.start())
        .call_timeout(Duration::from_millis(200))
        .build(url)
        .map_err(|error| format!("the watch on Redis: {error}"))?;
    watch
        .ready()
        .await
        .map_err(|error| format!("the local Redis: {error}"))?;
    let (backend, address) = Backend::start(PHASES[0]).await?;

    let me = std::env::current_exe().map_err(|error| format!("this program's path: {error}"))?;
    let mut replicas = Vec::new();
    for index in 1..=REPLICAS {
        replicas.push(Replica::start(&me, index, url, address)?);
    }
    let mut replicas = blocking(move || {
        for replica in &mut replicas {
            replica.until("READY", PATIENCE)?;
        }
        for replica in &mut replicas {
            replica.tell("go")?;
        }
        Ok(replicas)
    })
    .await?;

    // The phases, watched from here.
    let started = backend.now();
    let mut samples: Vec<(f64, usize)> = Vec::new();
    let mut line_from = started;
    let mut tick = 0u32;
    let mut next = tokio::time::Instant::now();
    for (index, &k) in PHASES.iter().enumerate() {
        backend.capacity.store(k, Relaxed);
        if index > 0 {
            println!(
                "[{:>5.1} s] the backend's capacity K is now {k}",
                backend.now() - started
            );
        }
        let until = started + PHASE.as_secs_f64() * (index + 1) as f64;
        while backend.now() < until {
            next += SAMPLE;
            tokio::time::sleep_until(next).await;
            let fleet = watch
                .fleet()
                .await
                .map_err(|error| format!("reading the fleet in Redis: {error}"))?;
            let now = backend.now();
            samples.push((now, fleet.capacity));
            tick += 1;
            if tick % SAMPLES_PER_LINE == 0 {
                let figures = backend.figures(line_from, now);
                println!(
                    "[{:>5.1} s] K {k:>2} | fleet capacity {:>2}, leases held {:>2} | backend in \
                     flight {:>5.2} | {:>3} ok, {:>3} deferred",
                    now - started,
                    fleet.capacity,
                    fleet.active,
                    figures.mean_in_flight,
                    figures.ok,
                    figures.deferred,
                );
                line_from = now;
                for replica in &mut replicas {
                    replica.still_running()?;
                }
            }
        }
    }
    let ended = backend.now();

    // Stop the clients; once the last window is decided, each replica reports.
    let reports = blocking(move || {
        for replica in &mut replicas {
            replica.tell("stop")?;
        }
        for replica in &mut replicas {
            replica.until("STOPPED", PATIENCE)?;
        }
        // A window with an end in it is decided within a second; none opens without one.
        std::thread::sleep(Duration::from_millis(1_200));
        let mut reports = Vec::new();
        for replica in &mut replicas {
            replica.tell("report")?;
            reports.push(replica.report()?);
        }
        for replica in &mut replicas {
            replica.finish()?;
        }
        Ok(reports)
    })
    .await?;

    println!("\nThe clients stopped. What each replica's own metrics say:");
    for report in &reports {
        for line in &report.lines {
            println!("{line}");
        }
    }
    let fleet = watch
        .fleet()
        .await
        .map_err(|error| format!("reading the fleet in Redis: {error}"))?;
    let first = &reports[0].values;
    let same = reports.iter().all(|report| report.values == *first);
    let decisions: Vec<&str> = reports
        .iter()
        .map(|report| report.decisions.as_str())
        .collect();
    println!(
        "The fleet's capacity in Redis is {}; capacity, baseline and estimate are {} on every \
         replica. Decisions, replica by replica: {} (the leader decides each window).",
        fleet.capacity,
        if same { "the same" } else { "NOT the same" },
        decisions.join(", "),
    );

    println!("\nAt the backend, phase by phase (in flight counts the deferred requests too):");
    let phase = PHASE.as_secs_f64();
    for (index, &k) in PHASES.iter().enumerate() {
        let (from, to) = (
            started + phase * index as f64,
            started + phase * (index + 1) as f64,
        );
        let whole = backend.figures(from, to);
        let tail = backend.figures(to - phase / 2.0, to);
        let capacities: Vec<f64> = samples
            .iter()
            .filter(|(at, _)| (to - phase / 2.0..=to).contains(at))
            .map(|&(_, capacity)| capacity as f64)
            .collect();
        let capacity = capacities.iter().sum::<f64>() / capacities.len().max(1) as f64;
        println!(
            "  phase {} (K = {k}): mean in flight {:.2} ({:.2} K), last half {:.2} ({:.2} K) at \
             a mean fleet capacity of {capacity:.1}; {} ok, {} deferred: {:.3} failures per \
             success",
            index + 1,
            whole.mean_in_flight,
            whole.mean_in_flight / k as f64,
            tail.mean_in_flight,
            tail.mean_in_flight / k as f64,
            whole.ok,
            whole.deferred,
            whole.failures_per_success(),
        );
    }
    let whole = backend.figures(started, ended);
    println!(
        "  the whole run: {} ok, {} deferred in {:.1} s ({:.0} ok/s), {:.3} failures per success",
        whole.ok,
        whole.deferred,
        whole.seconds,
        whole.ok as f64 / whole.seconds,
        whole.failures_per_success(),
    );
    if whole.ok == 0 {
        return Err("the backend served no request".to_owned());
    }
    Ok(())
}

/// Runs `work`, which blocks, off the runtime's workers.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| format!("a blocking step failed: {error}"))?
}

/// A `redis-server` of this example's own, stopped when dropped.
struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    /// One on a free port of 127.0.0.1, or `None` if there is none to start.
    fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
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
        let server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(server)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica process: its standard input, and its lines on a channel. Killed if dropped before
/// it finished.
struct Replica {
    index: usize,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

/// What a replica said when asked to report.
struct Report {
    /// Its own lines, to print.
    lines: Vec<String>,
    /// The fleet's capacity, baseline and estimate, as its metrics say.
    values: String,
    /// How many of the fleet's windows it decided.
    decisions: String,
}

impl Replica {
    fn start(
        me: &std::path::Path,
        index: usize,
        redis: &str,
        backend: SocketAddr,
    ) -> Result<Self, String> {
        let mut child = Command::new(me)
            .args(["--replica", &index.to_string(), redis, &backend.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|error| format!("starting replica {index}: {error}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(format!("replica {index} has no pipes"));
        };
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            index,
            child,
            stdin,
            lines,
        })
    }

    fn tell(&mut self, command: &str) -> Result<(), String> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .map_err(|error| format!("replica {} stopped listening: {error}", self.index))
    }

    /// The next line, within `patience`.
    fn next_line(&mut self, what: &str, patience: Duration) -> Result<String, String> {
        match self.lines.recv_timeout(patience) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "replica {} did not say {what} within {patience:?}",
                self.index
            )),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|status| status.to_string());
                Err(format!(
                    "replica {} ended before it said {what} ({})",
                    self.index,
                    status.unwrap_or_else(|error| error.to_string())
                ))
            }
        }
    }

    /// Waits for the line `word`; any other line is printed as it is.
    fn until(&mut self, word: &str, patience: Duration) -> Result<(), String> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.next_line(word, left)?;
            if line == word {
                return Ok(());
            }
            println!("{line}");
        }
    }

    /// Its report: the lines up to `DONE`.
    fn report(&mut self) -> Result<Report, String> {
        let mut report = Report {
            lines: Vec::new(),
            values: String::new(),
            decisions: String::new(),
        };
        loop {
            let line = self.next_line("DONE", PATIENCE)?;
            if line == "DONE" {
                return Ok(report);
            }
            if let Some(values) = line.strip_prefix("VALUES ") {
                report.values = values.to_owned();
            } else if let Some(decisions) = line.strip_prefix("DECISIONS ") {
                report.decisions = decisions.to_owned();
            } else {
                report.lines.push(line);
            }
        }
    }

    /// An error if it already ended.
    fn still_running(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("replica {} ended early ({status})", self.index)),
            Err(error) => Err(format!("replica {}: {error}", self.index)),
        }
    }

    /// Waits for it to exit, and says whether it succeeded.
    fn finish(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(format!("replica {} failed ({status})", self.index))
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(None) => return Err(format!("replica {} did not exit", self.index)),
                Err(error) => return Err(format!("replica {}: {error}", self.index)),
            }
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The backend
// ---------------------------------------------------------------------------------------------

/// The simulated backend: serves up to `capacity` at once, defers the rest. A client sends
/// `r`; the backend answers `ok` (served) or `no` (deferred) after `DELAY`.
struct Backend {
    capacity: AtomicUsize,
    log: Mutex<Log>,
    start: Instant,
}

#[derive(Default)]
struct Log {
    level: i64,
    /// `(seconds since the start, level after the change)`, in order.
    changes: Vec<(f64, i64)>,
    /// `(seconds since the start, served)`, in order of the answers.
    answers: Vec<(f64, bool)>,
}

impl Backend {
    /// Starts one on a free port of 127.0.0.1.
    async fn start(capacity: usize) -> Result<(Arc<Self>, SocketAddr), String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| format!("the backend's port: {error}"))?;
        let address = listener
            .local_addr()
            .map_err(|error| format!("the backend's port: {error}"))?;
        let backend = Arc::new(Self {
            capacity: AtomicUsize::new(capacity),
            log: Mutex::default(),
            start: Instant::now(),
        });
        let serving = Arc::clone(&backend);
        tokio::spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                tokio::spawn(Arc::clone(&serving).connection(connection));
            }
        });
        Ok((backend, address))
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn connection(self: Arc<Self>, connection: TcpStream) {
        let _ = connection.set_nodelay(true);
        let (read, mut write) = connection.into_split();
        let mut lines = AsyncBufReader::new(read).lines();
        while let Ok(Some(_)) = lines.next_line().await {
            let served = {
                let mut log = self.log();
                log.level += 1;
                let (now, level) = (self.now(), log.level);
                log.changes.push((now, level));
                level <= self.capacity.load(Relaxed) as i64
            };
            tokio::time::sleep(DELAY).await;
            {
                let mut log = self.log();
                log.level -= 1;
                let (now, level) = (self.now(), log.level);
                log.changes.push((now, level));
                log.answers.push((now, served));
            }
            let answer: &[u8] = if served { b"ok\n" } else { b"no\n" };
            if write.write_all(answer).await.is_err() {
                break;
            }
        }
    }

    /// The time-weighted mean in flight, the successes and the deferrals in `[from, to]`
    /// (seconds since the start).
    fn figures(&self, from: f64, to: f64) -> Figures {
        let log = self.log();
        let mut integral = 0.0;
        let mut level = 0;
        let mut at = from;
        for &(time, after) in &log.changes {
            if time > to {
                break;
            }
            if time > from {
                integral += level as f64 * (time - at);
                at = time;
            }
            level = after;
        }
        integral += level as f64 * (to - at.max(from));
        let (mut ok, mut deferred) = (0, 0);
        for (_, served) in log
            .answers
            .iter()
            .filter(|(time, _)| (from..=to).contains(time))
        {
            if *served {
                ok += 1;
            } else {
                deferred += 1;
            }
        }
        Figures {
            mean_in_flight: integral / (to - from).max(f64::EPSILON),
            ok,
            deferred,
            seconds: to - from,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Figures {
    mean_in_flight: f64,
    ok: u64,
    deferred: u64,
    seconds: f64,
}

impl Figures {
    fn failures_per_success(&self) -> f64 {
        self.deferred as f64 / self.ok.max(1) as f64
    }
}

// ---------------------------------------------------------------------------------------------
// A replica
// ---------------------------------------------------------------------------------------------

/// What the backend answered, or the layer's answer to an operation its limit turned away.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Served,
    Deferred,
    Rejected,
}

/// A deferral, or a broken connection, is an `error`.
fn classify(result: Result<&Reply, &std::io::Error>) -> Outcome {
    match result {
        Ok(Reply::Served) => Outcome::Ok,
        Ok(Reply::Deferred | Reply::Rejected) | Err(_) => Outcome::Error,
    }
}

/// Prints a line for the process that started this replica.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// What the parent tells this replica on its standard input, one word a line.
fn commands() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if sender.send(line.trim().to_owned()).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Waits for the parent to say `word`; an error if it goes away first.
async fn wait_for(
    commands: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    word: &str,
) -> Result<(), String> {
    loop {
        match commands.recv().await {
            Some(command) if command == word => return Ok(()),
            Some(_) => {}
            None => return Err(format!("the parent went away before it said {word:?}")),
        }
    }
}

fn replica(index: &str, redis: &str, backend: &str) -> Result<(), String> {
    let backend: SocketAddr = backend
        .parse()
        .map_err(|error| format!("replica {index}: the backend's address {backend:?}: {error}"))?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| format!("replica {index}: a tokio runtime: {error}"))?
        .block_on(run_replica(index, redis, backend))
        .map_err(|error| format!("replica {index}: {error}"))
}

async fn run_replica(index: &str, redis: &str, backend: SocketAddr) -> Result<(), String> {
    let t = Telemetry::new("fleet-adaptive-replica");
    let mut commands = commands();
    let limit = RedisLimit::builder(NAME, *BOUNDS.start())
        .adaptive(Adaptive::new(Vegas::default(), BOUNDS))
        .lease_ttl(Duration::from_millis(1_500))
        .call_timeout(Duration::from_millis(200))
        .fallback_poll(Duration::from_millis(200))
        .meter(&t.provider.meter("fleet-adaptive-replica"))
        .build(redis)
        .map_err(|error| format!("the fleet limit: {error}"))?;
    limit
        .ready()
        .await
        .map_err(|error| format!("Redis at the start: {error}"))?;
    let layer = ResourcesOperationLayer::new(limit.clone())
        .protocol(|_: Rejected| Ok::<_, std::io::Error>(Reply::Rejected))
        .classifier(classify)
        .operation(Operation::Judge)
        .executor(Executor::Inline)
        .metrics(t.metrics.clone());

    let mut connections = Vec::new();
    for _ in 0..CLIENTS {
        let connection = TcpStream::connect(backend)
            .await
            .map_err(|error| format!("the backend: {error}"))?;
        let _ = connection.set_nodelay(true);
        connections.push(connection);
    }
    say("READY");
    wait_for(&mut commands, "go").await?;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let clients: Vec<_> = connections
        .into_iter()
        .map(|connection| {
            let (read, write) = connection.into_split();
            let connection = Arc::new(tokio::sync::Mutex::new((AsyncBufReader::new(read), write)));
            // The backend, as a tower service on this client's own connection.
            let service = layer.layer(service_fn(move |()| call(Arc::clone(&connection))));
            tokio::spawn(client(service, stopped.clone()))
        })
        .collect();
    wait_for(&mut commands, "stop").await?;
    let _ = stop.send(true);
    for client in clients {
        client
            .await
            .map_err(|error| format!("a client task: {error}"))?
            .map_err(|error| format!("a client's connection to the backend: {error}"))?;
    }
    say("STOPPED");
    wait_for(&mut commands, "report").await?;
    report(&t, index, &limit);
    say("DONE");
    Ok(())
}

type Connection = Arc<tokio::sync::Mutex<(AsyncBufReader<OwnedReadHalf>, OwnedWriteHalf)>>;

/// One request to the backend.
async fn call(connection: Connection) -> Result<Reply, std::io::Error> {
    let mut connection = connection.lock().await;
    let (read, write) = &mut *connection;
    write.write_all(b"r\n").await?;
    let mut line = String::new();
    read.read_line(&mut line).await?;
    match line.as_str() {
        "ok\n" => Ok(Reply::Served),
        "no\n" => Ok(Reply::Deferred),
        _ => Err(std::io::Error::other(format!("the backend said {line:?}"))),
    }
}

/// One client: calls the backend through the layered service, one request after the other,
/// until stopped.
async fn client<S>(
    mut service: S,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> Result<(), std::io::Error>
where
    S: tower::Service<(), Response = Reply, Error = std::io::Error>,
{
    while !*stopped.borrow() {
        service.ready().await?.call(()).await?;
    }
    Ok(())
}

/// What this replica's own metrics say, and whether it led.
fn report(t: &Telemetry, index: &str, limit: &RedisLimit) {
    let (mut ok, mut errors, mut other, mut rejected) = (0, 0, 0, 0);
    let (mut capacity, mut gauge) = (None, None);
    let (mut baseline, mut estimate) = (None, None);
    t.read(|metric| match (metric.name(), metric.data()) {
        (DURATION_INSTRUMENT, AggregatedMetrics::F64(MetricData::Histogram(h))) => {
            for point in h.data_points() {
                let outcome = point
                    .attributes()
                    .find(|kv| kv.key.as_str() == OUTCOME_ATTRIBUTE)
                    .map(|kv| kv.value.as_str().into_owned());
                match outcome.as_deref() {
                    Some("ok") => ok += point.count(),
                    Some("error") => errors += point.count(),
                    _ => other += point.count(),
                }
            }
        }
        (REJECTED_INSTRUMENT, AggregatedMetrics::U64(MetricData::Sum(s))) => {
            rejected = s.data_points().map(|p| p.value()).sum();
        }
        (LIMIT_CAPACITY_INSTRUMENT, AggregatedMetrics::I64(MetricData::Gauge(g))) => {
            capacity = g.data_points().map(|p| p.value()).max();
        }
        (LIMIT_INSTRUMENT, AggregatedMetrics::I64(MetricData::Gauge(g))) => {
            gauge = g.data_points().map(|p| p.value()).max();
        }
        (LIMIT_BASELINE_INSTRUMENT, AggregatedMetrics::F64(MetricData::Gauge(g))) => {
            baseline = g.data_points().map(|p| p.value()).next();
        }
        (LIMIT_ESTIMATE_INSTRUMENT, AggregatedMetrics::F64(MetricData::Gauge(g))) => {
            estimate = g.data_points().map(|p| p.value()).next();
        }
        _ => {}
    });
    let number = |value: Option<i64>| value.map_or("none".to_owned(), |v| v.to_string());
    let ms = |value: Option<f64>| value.map_or("none".to_owned(), |v| format!("{v:.3} ms"));
    let other = match other {
        0 => String::new(),
        n => format!(", {n} another outcome"),
    };
    say(&format!(
        "replica {index}: {ok} ok, {errors} error (deferred){other}, {rejected} turned away; \
         `gym.resources.limit.capacity` {}, `limit` {}, baseline {}, estimate {}; leads now: \
         {}, {} decisions",
        number(capacity),
        number(gauge),
        ms(baseline),
        ms(estimate),
        limit.is_leader(),
        limit.decisions(),
    ));
    say(&format!(
        "VALUES capacity={} limit={} baseline={} estimate={}",
        number(capacity),
        number(gauge),
        ms(baseline),
        ms(estimate)
    ));
    say(&format!("DECISIONS {}", limit.decisions()));
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
        if self.provider.force_flush().is_err() {
            return;
        }
        let Ok(exported) = self.exporter.get_finished_metrics() else {
            return;
        };
        exported
            .iter()
            .flat_map(|resource| resource.scope_metrics())
            .flat_map(|scope| scope.metrics())
            .for_each(read);
    }
}
