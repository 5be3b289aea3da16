//! What a queued operation costs: heap bytes per waiter, and the time to drain the queue, with
//! tower's `ConcurrencyLimit` beside this layer (metrics off and on) and the floor (tower's
//! limit plus the SDK records any metrics layer makes).
//!
//! ```text
//! cargo bench --bench queue
//! ```
//!
//! Each case holds the only permit of a limit of 1 with one clone of the service (its
//! `poll_ready` took it), then spawns N tasks on a current-thread runtime, each
//! `tokio::spawn(service.clone().oneshot(()))`: what hyper and axum do per request. The inner
//! service captures one `Arc`; its future either awaits a tokio `Semaphore` (as a handler that
//! takes a resource does) or is ready at once. The memory per queued
//! operation is measured two ways, each case in a fresh child process: the heap in use once
//! all of them wait, less the heap before (a counting global allocator), and the growth of the
//! resident set size over the same span, each divided by N. The time for the queue to drain
//! once the holder lets go, divided by N, is the drain time. Every case runs once per round in
//! a child of its own, fifteen rounds; each figure is the median over them, and each ratio the
//! median of its per-round values.

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower::{service_fn, Layer, Service, ServiceExt};
use tower_resources_operation::{OperationMetrics, ResourcesOperationLayer};

mod common;

/// Counts the bytes in use on the heap.
struct Counting;

static IN_USE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Who holds the only permit while the operations queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// A clone of the service whose `poll_ready` took it (`ServiceExt::ready`).
    Ready,
    /// A call in progress, as in a server: one `clone().oneshot()` whose inner future waits
    /// until the holder lets go.
    Running,
}

/// Bytes per queued operation and drain time per operation, for `waiters` operations queued
/// behind `holder`: each waiter is `tokio::spawn(service.clone().oneshot(()))`, as hyper and
/// axum drive a service, and nothing else is allocated per waiter. The heap in use once all of
/// them wait, less the heap before, divided by `waiters`, is the memory per queued operation
/// (its task, its future, the service's clone, the limit's wait). Then the holder lets go
/// (`gate` opens, for a running holder) and the queue drains, one operation at a time: that
/// time, divided by `waiters`, is the drain time per operation.
fn measure<S>(
    service: S,
    waiters: usize,
    holder: Holder,
    gate: &Gate,
    rt: &tokio::runtime::Runtime,
) -> (f64, f64, Duration)
where
    S: Service<(), Response = ()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
{
    rt.block_on(async move {
        let mut ready = service.clone();
        let running = match holder {
            Holder::Ready => {
                ready.ready().await.unwrap();
                None
            }
            Holder::Running => {
                let running = tokio::spawn(service.clone().oneshot(()));
                while gate.entered.load(Ordering::Relaxed) == 0 {
                    tokio::task::yield_now().await;
                }
                Some(running)
            }
        };
        // Room for every handle first, so the vector's growth is not counted.
        let mut tasks = Vec::with_capacity(waiters);
        let before = IN_USE.load(Ordering::Relaxed);
        let resident_before = rss();
        for _ in 0..waiters {
            tasks.push(tokio::spawn(service.clone().oneshot(())));
        }
        // Every task runs until it waits for the permit (the scheduler polls a batch per tick;
        // on a multi-thread runtime another worker may still be polling them): until the heap
        // stops growing, for a task's first poll allocates its wait.
        for _ in 0..waiters.div_ceil(32) + 64 {
            tokio::task::yield_now().await;
        }
        loop {
            let in_use = IN_USE.load(Ordering::Relaxed);
            for _ in 0..64 {
                tokio::task::yield_now().await;
            }
            if IN_USE.load(Ordering::Relaxed) == in_use {
                break;
            }
        }
        let queued = IN_USE.load(Ordering::Relaxed) - before;
        let resident = rss() - resident_before;
        let started = Instant::now();
        drop(ready);
        if let Some(running) = running {
            gate.places.add_permits(OPEN);
            running.await.unwrap().unwrap();
        }
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let drained = started.elapsed();
        (
            queued as f64 / waiters as f64,
            resident as f64 / waiters as f64,
            drained / waiters as u32,
        )
    })
}

/// The inner services a queued operation waits in front of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Inner {
    /// Answers at once: `std::future::ready`.
    Ready,
    /// Its future awaits a tokio `Semaphore` (with places to spare), as a handler that takes a
    /// resource does: the future that a real operation's task is sized for.
    Semaphore,
}

/// The resident set size of this process now, in bytes (Linux: `/proc/self/statm`).
fn rss() -> isize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: isize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// What the inner service's future awaits: `places` (a handler that takes a resource), with
/// none to give until the holder lets go when a running call holds the permit; `entered`
/// counts the calls that began.
#[derive(Clone)]
struct Gate {
    places: Arc<tokio::sync::Semaphore>,
    entered: Arc<AtomicIsize>,
}

/// Places enough for every operation of a case.
const OPEN: usize = 1 << 24;

/// One case of one child process: bytes per queued operation counted by the allocator, the
/// same by the resident set size, and the drain time per operation.
fn child(case: &str, setup: Setup, waiters: usize) -> (f64, f64, Duration) {
    let shared = Arc::new(0_u64);
    let rt = match setup.multi_thread {
        false => tokio::runtime::Builder::new_current_thread().build(),
        true => tokio::runtime::Builder::new_multi_thread().build(),
    }
    .unwrap();
    let gate = Gate {
        places: Arc::new(tokio::sync::Semaphore::new(0)),
        entered: Arc::default(),
    };
    if setup.holder == Holder::Ready {
        gate.places.add_permits(OPEN);
    }
    match setup.inner {
        Inner::Ready => run_case(
            case,
            service_fn(move |()| {
                let _ = &shared;
                std::future::ready(Ok::<_, Infallible>(()))
            }),
            waiters,
            setup.holder,
            &gate,
            &rt,
        ),
        Inner::Semaphore => {
            let inner_gate = gate.clone();
            run_case(
                case,
                service_fn(move |()| {
                    let _ = &shared;
                    let gate = inner_gate.clone();
                    async move {
                        gate.entered.fetch_add(1, Ordering::Relaxed);
                        let _place = gate.places.acquire().await;
                        Ok::<_, Infallible>(())
                    }
                }),
                waiters,
                setup.holder,
                &gate,
                &rt,
            )
        }
    }
}

/// `case` over `inner`: tower's limit, the layer with metrics off or on, or the floor.
fn run_case<S>(
    case: &str,
    inner: S,
    waiters: usize,
    holder: Holder,
    gate: &Gate,
    rt: &tokio::runtime::Runtime,
) -> (f64, f64, Duration)
where
    S: Service<(), Response = (), Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let (_provider, meter) = common::sdk_meter();
    match case {
        "tower_limit" => measure(
            tower::limit::ConcurrencyLimit::new(inner, 1),
            waiters,
            holder,
            gate,
            rt,
        ),
        "layer_disabled" => {
            let layer = ResourcesOperationLayer::new(1).metrics(OperationMetrics::disabled());
            measure(layer.layer(inner), waiters, holder, gate, rt)
        }
        "layer_metrics" => {
            let layer = ResourcesOperationLayer::new(1).metrics(OperationMetrics::new(&meter));
            measure(layer.layer(inner), waiters, holder, gate, rt)
        }
        "floor" => {
            let records = common::floor::Shared::new(&meter);
            measure(
                common::floor::Floor::new(Boxed(inner), 1, records),
                waiters,
                holder,
                gate,
                rt,
            )
        }
        other => panic!("no case {other}"),
    }
}

/// An inner service whose future is boxed (so that it is `Unpin`, as the floor needs).
#[derive(Clone)]
struct Boxed<S>(S);

impl<S> Service<()> for Boxed<S>
where
    S: Service<(), Response = (), Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = ();
    type Error = Infallible;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Infallible>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: ()) -> Self::Future {
        Box::pin(self.0.call(request))
    }
}

const CASES: [&str; 4] = ["tower_limit", "layer_disabled", "layer_metrics", "floor"];

/// Child processes per case: the drain of one process moves by up to 2x from the next.
const ROUNDS: usize = 15;

/// One case in a child process of its own: bytes per queued operation counted, the same by
/// the resident set, and the drain in nanoseconds per operation.
fn run_child(exe: &std::path::Path, case: &str, setup: Setup, waiters: usize) -> (f64, f64, f64) {
    let output = std::process::Command::new(exe)
        .env("QUEUE_CASE", case)
        .env("QUEUE_SETUP", setup.to_env())
        .env("QUEUE_WAITERS", waiters.to_string())
        .output()
        .unwrap();
    assert!(output.status.success(), "{case}: {output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    let fields: Vec<f64> = text
        .split_whitespace()
        .map(|field| field.parse().unwrap())
        .collect();
    (fields[0], fields[1], fields[2])
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// How a case is set up: who holds the permit, what the inner future does, which runtime.
#[derive(Clone, Copy, Debug)]
struct Setup {
    holder: Holder,
    inner: Inner,
    multi_thread: bool,
}

impl Setup {
    /// The setups, the server's first: a running call holds the permit, on both runtimes.
    const ALL: [Setup; 4] = [
        Setup::new(Holder::Running, Inner::Semaphore, true),
        Setup::new(Holder::Running, Inner::Semaphore, false),
        Setup::new(Holder::Ready, Inner::Semaphore, false),
        Setup::new(Holder::Ready, Inner::Ready, false),
    ];

    const fn new(holder: Holder, inner: Inner, multi_thread: bool) -> Self {
        Self {
            holder,
            inner,
            multi_thread,
        }
    }

    fn describe(self) -> String {
        format!(
            "held by {}, inner future {}, {} runtime",
            match self.holder {
                Holder::Ready => "a ready() clone",
                Holder::Running => "a running call",
            },
            match self.inner {
                Inner::Semaphore => "awaits a semaphore",
                Inner::Ready => "ready at once",
            },
            match self.multi_thread {
                true => "multi-thread",
                false => "current-thread",
            },
        )
    }

    fn to_env(self) -> String {
        format!("{:?} {:?} {}", self.holder, self.inner, self.multi_thread)
    }

    fn from_env(text: &str) -> Self {
        let fields: Vec<&str> = text.split(' ').collect();
        Self::new(
            match fields[0] {
                "Running" => Holder::Running,
                _ => Holder::Ready,
            },
            match fields[1] {
                "Semaphore" => Inner::Semaphore,
                _ => Inner::Ready,
            },
            fields[2] == "true",
        )
    }
}

fn main() {
    // A child: one case, measured in a fresh process, so the resident set grows from nothing.
    if let Ok(case) = std::env::var("QUEUE_CASE") {
        let setup = Setup::from_env(&std::env::var("QUEUE_SETUP").unwrap());
        let waiters = std::env::var("QUEUE_WAITERS").unwrap().parse().unwrap();
        let (counted, resident, drain) = child(&case, setup, waiters);
        println!("{counted} {resident} {}", drain.as_nanos());
        return;
    }
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for setup in Setup::ALL {
        for waiters in [10_000_usize, 100_000] {
            println!(
                "\n{waiters} operations queued behind a limit of 1, {}; medians of {ROUNDS} \
                 rounds, each case in a child of its own per round",
                setup.describe()
            );
            println!(
                "  {:<16} {:>9} {:>7} {:>9} {:>7} {:>12} {:>7} {:>8}",
                "case",
                "counted",
                "/tower",
                "resident",
                "/tower",
                "drain ns/op",
                "/tower",
                "/floor"
            );
            // rounds[case][round] = (counted, resident, drain); every round runs each case in
            // turn, so that a slow spell of the machine lands on every case alike.
            let mut rounds = vec![Vec::new(); CASES.len()];
            for _ in 0..ROUNDS {
                for (case, results) in CASES.iter().zip(&mut rounds) {
                    results.push(run_child(&exe, case, setup, waiters));
                }
            }
            let ratio = |case: usize, of: usize, field: fn(&(f64, f64, f64)) -> f64| {
                let per_round = rounds[case].iter().zip(&rounds[of]);
                median(per_round.map(|(a, b)| field(a) / field(b)).collect())
            };
            for (case, name) in CASES.iter().enumerate() {
                let of = |field: fn(&(f64, f64, f64)) -> f64| {
                    median(rounds[case].iter().map(field).collect())
                };
                println!(
                    "  {name:<16} {:>7.0} B {:>6.2}x {:>7.0} B {:>6.2}x {:>12.1} {:>6.2}x {:>7.2}x",
                    of(|r| r.0),
                    ratio(case, 0, |r| r.0),
                    of(|r| r.1),
                    ratio(case, 0, |r| r.1),
                    of(|r| r.2),
                    ratio(case, 0, |r| r.2),
                    ratio(case, 3, |r| r.2),
                );
            }
        }
    }
}
