//! Limits of your own: two implementations of [`Acquire`] beyond a semaphore, with what the
//! metrics say about them: a weighted limit, through the layer and through
//! `resources_operation`, and a pool whose permit hands a sandbox to the work, through
//! `resources_operation_with`.
//!
//! ```text
//! cargo run --example limits
//! ```
//!
//! A limit is anything that hands out a permit and takes its place back when the permit drops.
//! An implementation keeps this contract:
//!
//! - **Cancellation-safe.** The future of `acquire` may be dropped at any `.await` (its caller
//!   went away, or a queue timeout fired): dropping it must leave the limit as if it had never
//!   asked, no place taken and none leaked.
//! - **The permit drops exactly once**, when the operation ends (the layer holds it until the
//!   response is done, `resources_operation` until the work returns). Its drop gives the place
//!   back, and must not panic.
//! - **Fairness is the implementation's.** Callers ask in the order they are polled; who gets
//!   the next place is up to the limit. Both limits below wait on a tokio `Semaphore`, first come
//!   first served: a big job waiting for its whole weight holds the line behind it.
//! - **Never hang on a failure**: return `Rejected::closed()` or `Rejected::failed(..)`
//!   (the caller then panics with a message naming the limit), or `Rejected::new(..)`
//!   to turn an operation away (then say so with `may_reject`).
//! - Optionally, `try_acquire` (a free place without a future) and `capacity` (what
//!   `gym.resources.operation.limit` reports: one `Capacity` per limit, cloned to every handle).
//!
//! The two limits:
//!
//! 1. [`Weighted`]: 4 units; a small job takes 1, a big job takes 3.
//! 2. [`Sandboxes`]: a pool of 2 reusable sandboxes. The permit is the checkout of one sandbox:
//!    `resources_operation_with` hands it to the work, and it puts the sandbox back in the pool
//!    when it drops, once the work is done.
//!
//! The run takes well under a second, prints a summary, and checks (panicking otherwise) that
//! never more than 4 units were in use, that no sandbox served two jobs at once, that both
//! sandboxes served, and that every place came back.
//!
//! The limits are `pub` because the test `acquire` includes this file as a module and holds them
//! to the crate's rules.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Telemetry;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tower::{service_fn, BoxError, Layer as _, ServiceExt as _};
use tower_resources_operation::limit::Capacity;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    LIMIT_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
    REJECTED_INSTRUMENT,
};
use tower_resources_operation::{Acquire, Executor, Operation, Rejected, ResourcesOperationLayer};

// ---------------------------------------------------------------------------------------------
// A weighted limit

/// A limit of `units` shared by every handle; each operation of a handle takes `weight` of them.
#[derive(Clone)]
pub struct Weighted {
    units: Arc<Semaphore>,
    weight: u32,
    /// One `Capacity` for the limit, cloned to every handle, so it counts once per series.
    capacity: Capacity,
}

impl Weighted {
    pub fn new(units: usize) -> Self {
        Self {
            units: Arc::new(Semaphore::new(units)),
            weight: 1,
            capacity: Capacity::fixed(units),
        }
    }

    /// A handle on the same units whose operations take `weight` each.
    pub fn weighing(&self, weight: u32) -> Self {
        let total = self.capacity.get().unwrap_or(0);
        assert!(
            weight as usize <= total,
            "a job of weight {weight} would wait for ever on {total} units"
        );
        Self {
            weight,
            ..self.clone()
        }
    }

    /// Units held now.
    pub fn in_use(&self) -> usize {
        self.capacity.get().unwrap_or(0) - self.units.available_permits()
    }
}

impl Acquire for Weighted {
    type Permit = OwnedSemaphorePermit;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        let units = Arc::clone(&self.units);
        let weight = self.weight;
        // tokio's `acquire_many_owned` is cancellation-safe: a dropped wait takes no unit.
        async move {
            units
                .acquire_many_owned(weight)
                .await
                .map_err(|_| Rejected::closed())
        }
    }

    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        match Arc::clone(&self.units).try_acquire_many_owned(self.weight) {
            Ok(permit) => Some(Ok(permit)),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(Rejected::closed())),
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.capacity.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// A pool of reusable resources

/// A pool of sandboxes; the permit is one sandbox, checked out.
#[derive(Clone)]
pub struct Sandboxes {
    pool: Arc<Pool>,
}

struct Pool {
    names: Vec<&'static str>,
    free: Mutex<Vec<usize>>,
    places: Arc<Semaphore>,
    capacity: Capacity,
}

/// A checked-out sandbox. Dropped, it goes back to the pool before its place frees, so whoever
/// gets the place finds a sandbox.
pub struct Checkout {
    sandbox: usize,
    pool: Arc<Pool>,
    _place: OwnedSemaphorePermit,
}

impl Checkout {
    /// The sandbox checked out.
    pub fn sandbox(&self) -> &'static str {
        self.pool.names[self.sandbox]
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push(self.sandbox);
    }
}

impl Sandboxes {
    pub fn new(names: &[&'static str]) -> Self {
        Self {
            pool: Arc::new(Pool {
                names: names.to_vec(),
                free: Mutex::new((0..names.len()).rev().collect()),
                places: Arc::new(Semaphore::new(names.len())),
                capacity: Capacity::fixed(names.len()),
            }),
        }
    }

    fn check_out(&self, place: OwnedSemaphorePermit) -> Checkout {
        let sandbox = self
            .pool
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .expect("a place means a free sandbox");
        Checkout {
            sandbox,
            pool: Arc::clone(&self.pool),
            _place: place,
        }
    }

    /// The sandboxes in the pool, not checked out.
    pub fn free(&self) -> BTreeSet<&'static str> {
        let free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        free.iter()
            .map(|&sandbox| self.pool.names[sandbox])
            .collect()
    }

    /// Places free: one per sandbox, once every checkout is back.
    pub fn places(&self) -> usize {
        self.pool.places.available_permits()
    }
}

impl Acquire for Sandboxes {
    type Permit = Checkout;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        let this = self.clone();
        async move {
            // Nothing is taken before this await completes: dropping the wait leaks nothing.
            let place = Arc::clone(&this.pool.places)
                .acquire_owned()
                .await
                .map_err(|_| Rejected::closed())?;
            Ok(this.check_out(place))
        }
    }

    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        match Arc::clone(&self.pool.places).try_acquire_owned() {
            Ok(place) => Some(Ok(self.check_out(place))),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(Rejected::closed())),
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.pool.capacity.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// The run

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let telemetry = Telemetry::new("limits-example");
    println!("tower-resources-operation: limits of your own (the Acquire trait)\n");
    weighted(&telemetry).await;
    sandboxes(&telemetry).await;
    let snapshot = Snapshot::of(&telemetry);
    for name in [
        QUEUED_INSTRUMENT,
        ACTIVE_INSTRUMENT,
        REJECTED_INSTRUMENT,
        ABANDONED_INSTRUMENT,
    ] {
        assert_eq!(snapshot.total(name), 0, "{name} is back to 0");
    }
    println!("all checks passed: every place came back; nothing waits, runs, was turned away or abandoned.");
    telemetry
        .provider
        .shutdown()
        .expect("shut the provider down");
}

/// Small jobs (1 unit) and big jobs (3 units) on 4 units, through the layer and the scoped API.
async fn weighted(telemetry: &Telemetry) {
    println!("1. Weighted: 4 units; small jobs take 1, big jobs take 3.");
    let units = Weighted::new(4);
    let peak = Arc::new(AtomicUsize::new(0));
    let series = [
        ("tool", "inline", "small jobs, through the layer"),
        ("verify", "subprocess", "big jobs, through the layer"),
        ("judge", "thread", "small jobs, resources_operation"),
    ];

    let job = {
        let (units, peak) = (units.clone(), Arc::clone(&peak));
        move |ms: u64| {
            let (units, peak) = (units.clone(), Arc::clone(&peak));
            async move {
                peak.fetch_max(units.in_use(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, BoxError>(ms)
            }
        }
    };
    let small = ResourcesOperationLayer::new(units.weighing(1))
        .operation(Operation::Tool)
        .executor(Executor::Inline)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(job.clone()));
    let big = ResourcesOperationLayer::new(units.weighing(3))
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(job.clone()));

    let mut tasks = Vec::new();
    for i in 0..12u64 {
        tasks.push(tokio::spawn(small.clone().oneshot(10 + i % 3 * 5)));
    }
    for _ in 0..4 {
        tasks.push(tokio::spawn(big.clone().oneshot(30)));
    }
    for i in 0..6u64 {
        let (metrics, limit, job) = (telemetry.metrics.clone(), units.weighing(1), job.clone());
        tasks.push(tokio::spawn(async move {
            metrics
                .resources_operation(limit, Operation::Judge, Executor::Thread, job(15 + i))
                .await
                .expect("this limit never turns an operation away")
        }));
    }
    let snapshot = finish(telemetry, tasks, &series).await;
    let peak = peak.load(Ordering::SeqCst);
    println!("   most units in use at once: {peak} of 4\n");
    assert!(peak <= 4, "{peak} units in use at once, above 4");
    assert!(
        peak >= 3,
        "a big job ran, so at least 3 units were in use once"
    );
    assert_eq!(units.units.available_permits(), 4, "every unit came back");
    for (operation, executor, _) in series {
        assert_eq!(snapshot.limit(operation, executor), Some(4));
    }
    assert_eq!(snapshot.admitted("tool", "inline"), 12);
    assert_eq!(snapshot.admitted("verify", "subprocess"), 4);
    assert_eq!(snapshot.admitted("judge", "thread"), 6);
}

/// Jobs that each need a sandbox of their own, from a pool of 2: each gets the one its permit
/// checked out.
async fn sandboxes(telemetry: &Telemetry) {
    println!("2. Sandboxes: a pool of 2; each job runs in the sandbox its permit checked out.");
    let pool = Sandboxes::new(&["sandbox-a", "sandbox-b"]);
    let busy = Arc::new(Mutex::new(BTreeSet::new()));
    let served = Arc::new(Mutex::new(BTreeMap::<&'static str, usize>::new()));
    let series = [
        ("tool", "process", "resources_operation_with"),
        ("verify", "process", "resources_operation_with"),
    ];

    let mut tasks = Vec::new();
    for i in 0..12u64 {
        let (metrics, pool) = (telemetry.metrics.clone(), pool.clone());
        let (busy, served) = (Arc::clone(&busy), Arc::clone(&served));
        let operation = if i % 2 == 0 {
            Operation::Tool
        } else {
            Operation::Verify
        };
        tasks.push(tokio::spawn(async move {
            metrics
                .resources_operation_with(&pool, operation, Executor::Process, async |checkout| {
                    let sandbox = checkout.sandbox();
                    assert!(
                        busy.lock().unwrap().insert(sandbox),
                        "{sandbox} was handed to two jobs at once"
                    );
                    *served.lock().unwrap().entry(sandbox).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(10 + i * 3)).await;
                    busy.lock().unwrap().remove(sandbox);
                    Ok::<_, BoxError>(sandbox)
                })
                .await
                .expect("this limit never turns an operation away")
        }));
    }
    let snapshot = finish(telemetry, tasks, &series).await;
    let served = served.lock().unwrap().clone();
    let summary: Vec<_> = served
        .iter()
        .map(|(sandbox, jobs)| format!("{sandbox} ran {jobs} jobs"))
        .collect();
    println!("   {}\n", summary.join(", "));
    assert_eq!(served.len(), 2, "both sandboxes served: {served:?}");
    assert_eq!(served.values().sum::<usize>(), 12);
    assert_eq!(
        pool.free(),
        BTreeSet::from(["sandbox-a", "sandbox-b"]),
        "both sandboxes are back in the pool"
    );
    assert_eq!(pool.places(), 2);
    assert_eq!(snapshot.limit("tool", "process"), Some(2));
    assert_eq!(snapshot.limit("verify", "process"), Some(2));
}

/// Waits for every job (each must succeed), then prints what the metrics say of each
/// `(operation, executor, what)` series in `rows`.
async fn finish<T>(
    telemetry: &Telemetry,
    tasks: Vec<tokio::task::JoinHandle<Result<T, BoxError>>>,
    rows: &[(&str, &str, &str)],
) -> Snapshot {
    for task in tasks {
        task.await.expect("a job panicked").expect("a job failed");
    }
    let snapshot = Snapshot::of(telemetry);
    snapshot.print(rows);
    snapshot
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics back, from the in-memory pipeline of `common`.

/// `(operation, executor)` of a data point.
type Series = (String, String);

fn series<'a>(attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> Series {
    let mut series = Series::default();
    for kv in attributes {
        match kv.key.as_str() {
            OPERATION_ATTRIBUTE => series.0 = kv.value.to_string(),
            EXECUTOR_ATTRIBUTE => series.1 = kv.value.to_string(),
            _ => {}
        }
    }
    series
}

#[derive(Default)]
struct Snapshot {
    /// `(count, sum)` per histogram and series, over outcomes.
    histograms: BTreeMap<(String, Series), (u64, f64)>,
    /// Value per observable instrument and series, summed over other attributes.
    values: BTreeMap<(String, Series), i64>,
}

impl Snapshot {
    /// What the metrics say now.
    fn of(telemetry: &Telemetry) -> Self {
        let mut snapshot = Snapshot::default();
        telemetry.read(|metric| {
            let name = metric.name().to_owned();
            match metric.data() {
                AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                    for point in h.data_points() {
                        let entry = snapshot
                            .histograms
                            .entry((name.clone(), series(point.attributes())))
                            .or_default();
                        entry.0 += point.count();
                        entry.1 += point.sum();
                    }
                }
                AggregatedMetrics::I64(MetricData::Sum(s)) => {
                    for point in s.data_points() {
                        *snapshot
                            .values
                            .entry((name.clone(), series(point.attributes())))
                            .or_default() += point.value();
                    }
                }
                AggregatedMetrics::U64(MetricData::Sum(s)) => {
                    for point in s.data_points() {
                        *snapshot
                            .values
                            .entry((name.clone(), series(point.attributes())))
                            .or_default() += i64::try_from(point.value()).unwrap_or(i64::MAX);
                    }
                }
                AggregatedMetrics::I64(MetricData::Gauge(g)) => {
                    for point in g.data_points() {
                        snapshot
                            .values
                            .insert((name.clone(), series(point.attributes())), point.value());
                    }
                }
                _ => {}
            }
        });
        snapshot
    }

    fn key(name: &str, operation: &str, executor: &str) -> (String, Series) {
        (name.to_owned(), (operation.to_owned(), executor.to_owned()))
    }

    fn histogram(&self, name: &str, operation: &str, executor: &str) -> (u64, f64) {
        self.histograms
            .get(&Self::key(name, operation, executor))
            .copied()
            .unwrap_or_default()
    }

    fn admitted(&self, operation: &str, executor: &str) -> u64 {
        self.histogram(QUEUE_DURATION_INSTRUMENT, operation, executor)
            .0
    }

    fn limit(&self, operation: &str, executor: &str) -> Option<i64> {
        self.values
            .get(&Self::key(LIMIT_INSTRUMENT, operation, executor))
            .copied()
    }

    fn total(&self, name: &str) -> i64 {
        self.values
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|(_, v)| v)
            .sum()
    }

    fn print(&self, rows: &[(&str, &str, &str)]) {
        println!(
            "   {:<22} {:>5} {:>12} {:>10} {:>6}   what",
            "series", "ran", "mean queue", "mean run", "limit"
        );
        for &(operation, executor, what) in rows {
            let (queued, queue_ms) = self.histogram(QUEUE_DURATION_INSTRUMENT, operation, executor);
            let (ran, run_ms) = self.histogram(DURATION_INSTRUMENT, operation, executor);
            assert_eq!(queued, ran, "one queue and one run sample per operation");
            let mean = |sum: f64, n: u64| if n == 0 { 0.0 } else { sum / n as f64 };
            let limit = self
                .limit(operation, executor)
                .map_or_else(|| "-".to_owned(), |l| l.to_string());
            println!(
                "   {:<22} {:>5} {:>9.1} ms {:>7.1} ms {:>6}   {what}",
                format!("{operation}/{executor}"),
                ran,
                mean(queue_ms, queued),
                mean(run_ms, ran),
                limit
            );
        }
    }
}
