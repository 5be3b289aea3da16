//! Thousands of operations of every kind through shared limits on a multi-threaded runtime: every
//! operation that asks for a permit ends up exactly one of admitted (and ended with the outcome
//! the test expects), rejected (by reason) or abandoned, the books the test keeps of that match
//! the metrics exactly, per series, every permit comes back, the inner work never runs above its
//! limit, and the live counts return to 0.
//!
//! Each rule is checked with each kind of limit (the crate's `Limit`, a tokio `Semaphore`, and a
//! pool of reusable resources implemented in the shared reliability module as an `Acquire`), through layers and through
//! `resources_operation`; then under bounded waiting (a queue bound shared by layers and scoped
//! calls, queue timeouts, callers giving up while they wait), with `Limit::set_capacity` raising
//! and lowering the limit while it serves, with a limit closed under its waiters, and in the
//! body-end form, where a streamed body ends its operation in every way a body can end.

mod reliability;
mod support;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tower::util::BoxService;
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt as _};

use reliability::{
    assert_books, assert_live_counts_zero, quiet_closed_limit_panics, quiet_expected_panics, Books,
    Fate, Load, Pool, Rng, Series, EXPECTED_PANIC, LIMIT_CLOSED_PANIC,
};
use support::{panic_message, Telemetry};
use tower_resources_operation::{
    set_outcome, Acquire, Executor, Limit, Operation, OperationMetrics, Outcome, Rejected,
    Rejection, ResourcesOperationLayer, TimeoutClassifier, EXECUTOR_ATTRIBUTE, LIMIT_INSTRUMENT,
    OPERATION_ATTRIBUTE,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inner service every operation runs, whatever its kind; also what a layer makes of it.
type Inner = BoxService<Work, String, BoxError>;

/// A layer of some limit over an [`Inner`], boxed: layers of different limits have different
/// types.
type MakeService = Arc<dyn Fn(Inner) -> Inner + Send + Sync>;

/// What the caller of one operation awaits, whichever way it reaches its limit.
type Answer = Pin<Box<dyn Future<Output = Result<String, BoxError>> + Send>>;

/// `resources_operation` on some limit, for some series, around a piece of work.
type Scoped = Arc<
    dyn Fn(
            Answer,
        )
            -> Pin<Box<dyn Future<Output = Result<Result<String, BoxError>, Rejected>> + Send>>
        + Send
        + Sync,
>;

/// A safety net so a lost permit fails the test instead of hanging it; not a performance bound.
const DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The work
// ---------------------------------------------------------------------------------------------

/// What the inner service does with one request.
enum Work {
    /// Yields once, then answers `Ok`.
    Ok,
    /// Yields once, then answers `Err("boom")`.
    Err,
    /// Panics in `call`, before any future exists.
    PanicInCall,
    /// Panics while its future is polled.
    PanicInPoll,
    /// Chooses `timeout` with `set_outcome`, then answers `Ok`.
    SetTimeoutThenOk,
    /// Chooses `ok` with `set_outcome`, then answers `Err`.
    SetOkThenErr,
    /// Says it started (if asked), then never finishes: only a drop or a timeout ends it.
    Hang(Option<oneshot::Sender<()>>),
    /// Says it started, then waits for the gate to open and answers `Ok`.
    Gate {
        started: mpsc::UnboundedSender<()>,
        open: watch::Receiver<bool>,
    },
    /// Sleeps, then answers `Ok`.
    Sleep(Duration),
}

/// The inner service; counts itself on `load` while it runs, when given one.
fn inner(load: Option<Arc<Load>>) -> Inner {
    BoxService::new(service_fn(move |work: Work| {
        let guard = load.as_ref().map(Load::enter);
        if let Work::PanicInCall = &work {
            panic!("{EXPECTED_PANIC}: in call");
        }
        async move {
            let _guard = guard;
            match work {
                Work::Ok => {
                    tokio::task::yield_now().await;
                    Ok("ok".to_owned())
                }
                Work::Err => {
                    tokio::task::yield_now().await;
                    Err::<_, BoxError>("boom".into())
                }
                Work::PanicInPoll => {
                    tokio::task::yield_now().await;
                    panic!("{EXPECTED_PANIC}: in poll")
                }
                Work::SetTimeoutThenOk => {
                    tokio::task::yield_now().await;
                    assert!(
                        set_outcome(Outcome::Timeout),
                        "set_outcome outside the work"
                    );
                    Ok("set".to_owned())
                }
                Work::SetOkThenErr => {
                    assert!(set_outcome(Outcome::Ok), "set_outcome outside the work");
                    tokio::task::yield_now().await;
                    Err("boom".into())
                }
                Work::Hang(started) => {
                    if let Some(started) = started {
                        let _ = started.send(());
                    }
                    std::future::pending().await
                }
                Work::Gate { started, mut open } => {
                    started.send(()).expect("the test stopped listening");
                    open.wait_for(|open| *open).await.expect("gate dropped");
                    Ok("gate".to_owned())
                }
                Work::Sleep(run) => {
                    tokio::time::sleep(run).await;
                    Ok("ok".to_owned())
                }
                Work::PanicInCall => unreachable!(),
            }
        }
    }))
}

/// The inner service under tower's `TimeoutLayer` of `deadline`, not counted on any load: the
/// timeout drops the inner future only after the layer outside it has given the permit back.
///
/// Boxed so the future the layer wraps is a plain `Send` future (tower's `Timeout` future trips
/// rustc's higher-ranked `Send` check inside spawned async blocks).
fn timed(deadline: Duration) -> Inner {
    BoxService::new(ServiceBuilder::new().timeout(deadline).service(inner(None)))
}

/// Marks `admitted` when the layer first polls it ready: a layer polls its inner service only
/// once it holds the permit, and never for an operation it turned away.
struct Probe {
    inner: Inner,
    admitted: Arc<AtomicBool>,
}

impl Service<Work> for Probe {
    type Response = String;
    type Error = BoxError;
    type Future = <Inner as Service<Work>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.admitted.store(true, Ordering::SeqCst);
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, work: Work) -> Self::Future {
        self.inner.call(work)
    }
}

// ---------------------------------------------------------------------------------------------
// The ways to a limit, and the limits
// ---------------------------------------------------------------------------------------------

/// How the test reaches a limit: through a layer, or with `resources_operation`.
#[derive(Clone)]
enum Route {
    Layer(MakeService),
    Scoped(Scoped),
}

impl Route {
    /// One operation: `work` run by `inner`, through this route. `admitted` is set when the
    /// operation gets its permit. A rejection comes back as a `BoxError` holding [`Rejected`],
    /// whichever the route.
    fn serve(&self, inner: Inner, work: Work, admitted: &Arc<AtomicBool>) -> Answer {
        let admitted = Arc::clone(admitted);
        match self {
            Route::Layer(make) => {
                Box::pin(make(BoxService::new(Probe { inner, admitted })).oneshot(work))
            }
            Route::Scoped(scoped) => {
                let work: Answer = Box::pin(async move {
                    admitted.store(true, Ordering::SeqCst);
                    inner.oneshot(work).await
                });
                let operation = scoped(work);
                Box::pin(async move {
                    operation
                        .await
                        .map_err(BoxError::from)
                        .and_then(|output| output)
                })
            }
        }
    }
}

/// `layer` as a [`Route`].
fn layered<L>(layer: L) -> Route
where
    L: Layer<Inner> + Send + Sync + 'static,
    L::Service: Service<Work, Response = String, Error = BoxError> + Send + 'static,
    <L::Service as Service<Work>>::Future: Send + 'static,
{
    Route::Layer(Arc::new(move |inner| BoxService::new(layer.layer(inner))))
}

/// `resources_operation` on `limit`, for `series`, as a [`Route`].
fn scoped<A>(limit: A, series: Series, metrics: &OperationMetrics) -> Route
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send,
{
    let metrics = metrics.clone();
    Route::Scoped(Arc::new(move |work| {
        let (limit, metrics) = (limit.clone(), metrics.clone());
        Box::pin(async move {
            metrics
                .resources_operation(limit, series.0, series.1, work)
                .await
        })
    }))
}

/// A layer on `limit` for `series`, with tower's and tokio's `Elapsed` as `timeout`.
fn layer_on<L: Acquire>(
    limit: L,
    series: Series,
    metrics: &OperationMetrics,
) -> ResourcesOperationLayer<tower_resources_operation::SharedClassifier<TimeoutClassifier>, L> {
    ResourcesOperationLayer::with_limit(limit)
        .classifier(TimeoutClassifier::new())
        .operation(series.0)
        .executor(series.1)
        .metrics(metrics.clone())
}

/// One limit, the routes to it (one per series), and the load of its inner work.
struct Shared {
    name: &'static str,
    max: usize,
    available: Box<dyn Fn() -> usize + Send + Sync>,
    /// Checks what the limit itself keeps, once every operation is over.
    check: Box<dyn Fn() + Send + Sync>,
    routes: Vec<(Series, Route)>,
    load: Arc<Load>,
}

impl Shared {
    /// A route of this limit, picked by `rng`, with its series.
    fn pick(&self, rng: &mut Rng) -> (Series, Route) {
        self.routes[rng.below(self.routes.len() as u64) as usize].clone()
    }
}

/// Three limits, one of each kind, ten series, one `OperationMetrics`: the crate's `Limit` (made
/// by `ResourcesOperationLayer::new`), an `Arc<Semaphore>` and a [`Pool`], each reached through
/// layers and through `resources_operation`.
fn limits(metrics: &OperationMetrics) -> Vec<Shared> {
    let verify = (Operation::Verify, Executor::Subprocess);
    let first = ResourcesOperationLayer::new(3)
        .classifier(TimeoutClassifier::new())
        .operation(verify.0)
        .executor(verify.1)
        .metrics(metrics.clone());
    let limit = first.limit().clone();
    let judge = (Operation::Judge, Executor::Inline);
    let other = (Operation::Other, Executor::Inline);

    let semaphore = Arc::new(Semaphore::new(2));
    let on_semaphore = |series: Series| {
        let layer = ResourcesOperationLayer::with_semaphore(Arc::clone(&semaphore))
            .classifier(TimeoutClassifier::new())
            .operation(series.0)
            .executor(series.1)
            .metrics(metrics.clone());
        (series, layered(layer))
    };
    let tool = (Operation::Tool, Executor::Other);

    let pool = Pool::new(2);
    let on_pool = |series: Series| (series, layered(layer_on(pool.clone(), series, metrics)));
    let pooled = (Operation::Verify, Executor::Other);

    vec![
        Shared {
            name: "Limit",
            max: 3,
            available: Box::new({
                let limit = limit.clone();
                move || limit.available()
            }),
            check: Box::new(|| {}),
            routes: vec![
                (verify, layered(first)),
                (judge, layered(layer_on(limit.clone(), judge, metrics))),
                (other, scoped(limit, other, metrics)),
            ],
            load: Arc::default(),
        },
        Shared {
            name: "Arc<Semaphore>",
            max: 2,
            available: Box::new({
                let semaphore = Arc::clone(&semaphore);
                move || semaphore.available_permits()
            }),
            check: Box::new(|| {}),
            routes: vec![
                on_semaphore((Operation::Tool, Executor::Thread)),
                on_semaphore((Operation::Other, Executor::Process)),
                on_semaphore((Operation::Verify, Executor::Thread)),
                (tool, scoped(Arc::clone(&semaphore), tool, metrics)),
            ],
            load: Arc::default(),
        },
        Shared {
            name: "Pool",
            max: 2,
            available: Box::new({
                let pool = pool.clone();
                move || pool.available()
            }),
            check: Box::new({
                let pool = pool.clone();
                move || pool.assert_all_back()
            }),
            routes: vec![
                on_pool((Operation::Judge, Executor::Process)),
                on_pool((Operation::Tool, Executor::Subprocess)),
                (pooled, scoped(pool, pooled, metrics)),
            ],
            load: Arc::default(),
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// One operation
// ---------------------------------------------------------------------------------------------

/// How an operation is made to end; each kind has exactly one possible ending once admitted.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Ok,
    Err,
    PanicInCall,
    PanicInPoll,
    SetTimeoutThenOk,
    SetOkThenErr,
    TowerTimeout,
    DropInFlight,
    /// `poll_ready` takes the permit; the service is dropped without a call. (Through
    /// `resources_operation`, which has no such step, it is [`Kind::Ok`].)
    ReadyUnused,
    /// The caller gives up after this long: while it waits (abandoned), in flight (cancelled),
    /// or never (ok).
    GiveUp(Duration),
}

const KINDS: [Kind; 9] = [
    Kind::Ok,
    Kind::Err,
    Kind::PanicInCall,
    Kind::PanicInPoll,
    Kind::SetTimeoutThenOk,
    Kind::SetOkThenErr,
    Kind::TowerTimeout,
    Kind::DropInFlight,
    Kind::ReadyUnused,
];

/// A kind of [`KINDS`], or (one time in ten, if `give_ups`) a [`Kind::GiveUp`] of 0 to 3 ms.
fn pick_kind(rng: &mut Rng, give_ups: bool) -> Kind {
    if give_ups && rng.below(10) == 0 {
        Kind::GiveUp(Duration::from_micros(rng.below(3_000)))
    } else {
        KINDS[rng.below(KINDS.len() as u64) as usize]
    }
}

/// The rejection a caller got, as its fate; panics if `error` is not a rejection.
fn rejected(error: &BoxError) -> Fate {
    match error.downcast_ref::<Rejected>() {
        Some(rejected) => Fate::Rejected(rejected.rejection()),
        None => panic!("expected a rejection, got {error}"),
    }
}

/// A panic of the work itself is `crashed`; any other (a closed limit's) goes on.
fn crashed(joined: tokio::task::JoinError) -> Fate {
    let payload = joined.into_panic();
    if panic_message(&*payload).contains(EXPECTED_PANIC) {
        Fate::Ended(Outcome::Crashed)
    } else {
        std::panic::resume_unwind(payload)
    }
}

/// Runs one operation of `kind` through `route`, checks what the caller got, and returns what
/// must have become of it. A limit that fails under it panics through.
async fn run(kind: Kind, route: Route, load: Arc<Load>) -> Fate {
    let kind = match (kind, &route) {
        (Kind::ReadyUnused, Route::Scoped(_)) => Kind::Ok,
        _ => kind,
    };
    let admitted = Arc::new(AtomicBool::new(false));
    let operation = |work: Work| route.serve(inner(Some(Arc::clone(&load))), work, &admitted);
    match kind {
        Kind::Ok => match operation(Work::Ok).await {
            Ok(answer) => {
                assert_eq!(answer, "ok");
                Fate::Ended(Outcome::Ok)
            }
            Err(error) => rejected(&error),
        },
        Kind::Err => {
            let error = operation(Work::Err).await.unwrap_err();
            if error.is::<Rejected>() {
                return rejected(&error);
            }
            assert_eq!(error.to_string(), "boom");
            Fate::Ended(Outcome::Error)
        }
        Kind::PanicInCall | Kind::PanicInPoll => {
            let work = match kind {
                Kind::PanicInCall => Work::PanicInCall,
                _ => Work::PanicInPoll,
            };
            match tokio::spawn(operation(work)).await {
                Ok(Ok(answer)) => panic!("a panicking operation answered {answer:?}"),
                Ok(Err(error)) => rejected(&error),
                Err(joined) => crashed(joined),
            }
        }
        Kind::SetTimeoutThenOk => match operation(Work::SetTimeoutThenOk).await {
            Ok(answer) => {
                assert_eq!(answer, "set");
                Fate::Ended(Outcome::Timeout)
            }
            Err(error) => rejected(&error),
        },
        Kind::SetOkThenErr => {
            let error = operation(Work::SetOkThenErr).await.unwrap_err();
            if error.is::<Rejected>() {
                return rejected(&error);
            }
            assert_eq!(error.to_string(), "boom");
            Fate::Ended(Outcome::Ok)
        }
        Kind::TowerTimeout => {
            // The inner work never ends, so once admitted tower's timeout is its only end.
            let answer = route.serve(timed(Duration::from_millis(1)), Work::Hang(None), &admitted);
            let error = answer.await.unwrap_err();
            if error.is::<Rejected>() {
                return rejected(&error);
            }
            assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
            Fate::Ended(Outcome::Timeout)
        }
        Kind::DropInFlight => {
            // Dropped only once the inner work has started, and the work never ends by itself.
            let (started_tx, started_rx) = oneshot::channel();
            let answer = operation(Work::Hang(Some(started_tx)));
            tokio::select! {
                biased;
                answer = answer => match answer {
                    Ok(answer) => panic!("a hanging operation answered {answer:?}"),
                    Err(error) => rejected(&error),
                },
                started = started_rx => {
                    started.expect("the work was dropped before it started");
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
        Kind::ReadyUnused => {
            let Route::Layer(make) = &route else {
                unreachable!("a scoped operation has no poll_ready")
            };
            // poll_ready takes the permit; the service is dropped without a call.
            let probe = Probe {
                inner: inner(Some(Arc::clone(&load))),
                admitted: Arc::clone(&admitted),
            };
            let mut service = make(BoxService::new(probe));
            service.ready().await.unwrap();
            tokio::task::yield_now().await;
            if admitted.load(Ordering::SeqCst) {
                drop(service);
                Fate::Ended(Outcome::Cancelled)
            } else {
                // Turned away: `call` answers the rejection without the inner service.
                rejected(&service.call(Work::Ok).await.unwrap_err())
            }
        }
        Kind::GiveUp(after) => match tokio::time::timeout(after, operation(Work::Ok)).await {
            Ok(Ok(answer)) => {
                assert_eq!(answer, "ok");
                Fate::Ended(Outcome::Ok)
            }
            Ok(Err(error)) => rejected(&error),
            Err(_) if admitted.load(Ordering::SeqCst) => Fate::Ended(Outcome::Cancelled),
            Err(_) => Fate::Abandoned,
        },
    }
}

/// Awaits `future`, failing the test if it takes longer than [`DEADLINE`].
async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Waits until `condition` holds, failing the test after [`DEADLINE`].
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    within(what, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// Every permit is back, the inner work never ran above the limit, nothing is left running, and
/// each limit's own books are straight.
fn assert_limits_idle(limits: &[Shared]) {
    for limit in limits {
        assert_eq!(
            (limit.available)(),
            limit.max,
            "{}: permits back",
            limit.name
        );
        assert!(
            limit.load.max() <= limit.max,
            "{}: {} ran at once under a limit of {}",
            limit.name,
            limit.load.max(),
            limit.max
        );
        assert_eq!(limit.load.running(), 0, "{}", limit.name);
        (limit.check)();
    }
}

/// Operations that wait on a gate, started through routes of `limit` picked by `rng` until
/// `count` hold a permit.
struct Gates {
    open: watch::Sender<bool>,
    held: Vec<(Series, tokio::task::JoinHandle<Result<String, BoxError>>)>,
}

impl Gates {
    async fn fill(limits: &[(&Shared, usize)], rng: &mut Rng) -> Self {
        let (open, open_rx) = watch::channel(false);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();
        let mut held = Vec::new();
        for (limit, count) in limits {
            for _ in 0..*count {
                let (series, route) = limit.pick(rng);
                let work = Work::Gate {
                    started: started_tx.clone(),
                    open: open_rx.clone(),
                };
                let admitted = Arc::new(AtomicBool::new(false));
                let answer = route.serve(inner(Some(Arc::clone(&limit.load))), work, &admitted);
                held.push((series, tokio::spawn(answer)));
            }
        }
        for _ in 0..held.len() {
            within("a gate operation", started_rx.recv()).await;
        }
        Self { open, held }
    }

    /// Opens the gates; each gate operation ends `ok`.
    async fn open(self, books: &mut Books) {
        self.open.send(true).unwrap();
        for (series, gate) in self.held {
            let answer = within("a gate operation", gate).await.unwrap().unwrap();
            assert_eq!(answer, "gate");
            books.ended(series, Outcome::Ok);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Unbounded waiting, every kind of limit
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_mixed_operations_on_shared_limits_are_each_recorded_exactly_once() {
    const WAVES: usize = 20;
    const OPS_PER_WAVE: usize = 190;
    const QUEUE_DROPS_PER_WAVE: usize = 10;

    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let limits = limits(&telemetry.metrics);
    let mut rng = Rng::new(0x5eed_0001);
    let mut books = Books::default();
    let mut dropped_in_queue = 0;

    for _ in 0..WAVES {
        // Fill every limit with operations that wait on a gate, so that the waits given up below
        // are certain to be given up in the queue.
        let full: Vec<_> = limits.iter().map(|limit| (limit, limit.max)).collect();
        let gates = Gates::fill(&full, &mut rng).await;
        for limit in &limits {
            assert_eq!((limit.available)(), 0, "{} is full", limit.name);
        }

        let mut drops = Vec::new();
        for _ in 0..QUEUE_DROPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (series, route) = limit.pick(&mut rng);
            let admitted = Arc::new(AtomicBool::new(false));
            let answer = route.serve(inner(Some(Arc::clone(&limit.load))), Work::Ok, &admitted);
            drops.push((
                series,
                tokio::spawn(async move {
                    let waited = tokio::time::timeout(Duration::from_millis(1), answer).await;
                    assert!(waited.is_err(), "got a permit of a full limit: {waited:?}");
                    assert!(!admitted.load(Ordering::SeqCst));
                }),
            ));
        }

        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (series, route) = limit.pick(&mut rng);
            let kind = pick_kind(&mut rng, false);
            let load = Arc::clone(&limit.load);
            operations.push((series, tokio::spawn(run(kind, route, load))));
        }

        for (series, dropped) in drops {
            within("a wait given up", dropped).await.unwrap();
            books.abandoned(series);
            dropped_in_queue += 1;
        }
        gates.open(&mut books).await;
        for (series, operation) in operations {
            let fate = within("an operation", operation).await.unwrap();
            assert!(
                !matches!(fate, Fate::Rejected(_)),
                "an unbounded limit turned {series:?} away"
            );
            books.record(series, fate);
        }
    }

    assert_limits_idle(&limits);
    for limit in &limits {
        // The gates filled each limit, so the work did run at the limit.
        assert_eq!(limit.load.max(), limit.max, "{}", limit.name);
    }
    assert_eq!(dropped_in_queue, WAVES * QUEUE_DROPS_PER_WAVE);
    assert_eq!(books.abandoned_total(), dropped_in_queue as u64);
    let operations = (WAVES * OPS_PER_WAVE) as u64;
    let gates = (WAVES * limits.iter().map(|l| l.max).sum::<usize>()) as u64;
    assert_eq!(books.admitted_total(), operations + gates);
    assert_eq!(
        books.asked_total(),
        operations + gates + dropped_in_queue as u64
    );
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    for limit in &limits {
        for (series, _) in &limit.routes {
            assert!(
                books.asked(*series) > 0,
                "{}: {series:?} was never asked",
                limit.name
            );
        }
    }
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_and_timeouts_racing_admission_are_recorded_as_what_happened() {
    const OPS: usize = 2000;

    let telemetry = Telemetry::new();
    let limits = limits(&telemetry.metrics);
    let mut rng = Rng::new(0x5eed_0002);

    let mut operations = Vec::new();
    for i in 0..OPS {
        let limit = &limits[rng.below(limits.len() as u64) as usize];
        let (series, route) = limit.pick(&mut rng);
        let load = Arc::clone(&limit.load);
        let run = Duration::from_micros(rng.below(2_000));
        let deadline = Duration::from_micros(rng.below(2_000));
        // Arrivals spread over half a second keep the queue short enough that deadlines land
        // before admission, in flight and after the end alike (a few hundred of each).
        let arrival = Duration::from_micros(rng.below(500_000));
        operations.push((
            series,
            tokio::spawn(async move {
                tokio::time::sleep(arrival).await;
                let admitted = Arc::new(AtomicBool::new(false));
                if i % 2 == 0 {
                    // The caller gives up after `deadline`: before the permit (abandoned), in
                    // flight (cancelled), or not at all.
                    let answer = route.serve(inner(Some(load)), Work::Sleep(run), &admitted);
                    match tokio::time::timeout(deadline, answer).await {
                        Ok(answer) => {
                            assert_eq!(answer.unwrap(), "ok");
                            Fate::Ended(Outcome::Ok)
                        }
                        Err(_) if admitted.load(Ordering::SeqCst) => {
                            Fate::Ended(Outcome::Cancelled)
                        }
                        Err(_) => Fate::Abandoned,
                    }
                } else {
                    // tower's timeout races the work; the answer tells which won.
                    match route
                        .serve(timed(deadline), Work::Sleep(run), &admitted)
                        .await
                    {
                        Ok(answer) => {
                            assert_eq!(answer, "ok");
                            Fate::Ended(Outcome::Ok)
                        }
                        Err(error) => {
                            assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
                            Fate::Ended(Outcome::Timeout)
                        }
                    }
                }
            }),
        ));
    }

    let mut books = Books::default();
    for (series, operation) in operations {
        books.record(series, within("an operation", operation).await.unwrap());
    }

    assert_limits_idle(&limits);
    assert_eq!(books.asked_total(), OPS as u64);
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

// ---------------------------------------------------------------------------------------------
// Bounded waiting, a resized limit, a closed limit
// ---------------------------------------------------------------------------------------------

/// Raises and lowers `limit` at random moments until `stop`; returns how many times it raised
/// and lowered it.
async fn resize(
    limit: Limit,
    smallest: usize,
    largest: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (usize, usize) {
    let mut rng = Rng::new(seed);
    let (mut raised, mut lowered) = (0, 0);
    while !stop.load(Ordering::SeqCst) {
        let before = limit.capacity();
        let capacity = smallest + rng.below((largest - smallest + 1) as u64) as usize;
        limit.set_capacity(capacity).unwrap();
        if capacity > before {
            raised += 1;
        } else if capacity < before {
            lowered += 1;
        }
        if rng.below(2) == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(rng.below(1_500))).await;
        }
    }
    (raised, lowered)
}

/// What became of an operation of the closing limit whose task panicked: its limit was closed
/// under it, and the panic says so and names the limit.
fn closed_under(joined: tokio::task::JoinError) -> Fate {
    let message = panic_message(&*joined.into_panic());
    assert!(message.contains(LIMIT_CLOSED_PANIC), "{message}");
    assert!(
        message.contains(std::any::type_name::<Limit>()),
        "the panic names the limit: {message}"
    );
    Fate::Abandoned
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_waits_resized_and_closed_limits_under_load_end_each_operation_admitted_rejected_or_abandoned(
) {
    const WAVES: usize = 20;
    const OPS_PER_WAVE: usize = 150;
    const BASE: usize = 3;
    const LARGEST: usize = 6;
    const MAX_QUEUED: usize = 8;
    const OVERFLOW: usize = 3;
    const TIMED_OUT: usize = 2;
    const CLOSE_WAVE: usize = WAVES / 2;
    const CLOSING: usize = 2;
    const CLOSE_WAITERS: usize = 5;

    quiet_closed_limit_panics();
    let telemetry = Telemetry::new();
    let metrics = &telemetry.metrics;

    // One bounded queue for every layer and scoped call on `bounded`; two layers also bound
    // their own waits.
    let bounded = Limit::new(BASE).max_queued(MAX_QUEUED);
    let patient = (Operation::Verify, Executor::Subprocess);
    let impatient = (Operation::Judge, Executor::Inline);
    let hasty = (Operation::Tool, Executor::Thread);
    let by_hand = (Operation::Other, Executor::Process);
    let waits = |series| layer_on(bounded.clone(), series, metrics);
    let shared = Shared {
        name: "bounded Limit",
        max: LARGEST,
        available: Box::new({
            let bounded = bounded.clone();
            move || bounded.available()
        }),
        check: Box::new(|| {}),
        routes: vec![
            (patient, layered(waits(patient).bounded())),
            (
                impatient,
                layered(waits(impatient).queue_timeout(Duration::from_millis(2))),
            ),
            (
                hasty,
                layered(
                    waits(hasty)
                        .bounded()
                        .queue_timeout(Duration::from_millis(1)),
                ),
            ),
            (by_hand, scoped(bounded.clone(), by_hand, metrics)),
        ],
        load: Arc::default(),
    };
    // The routes that never stop waiting by themselves, and those that do.
    let waiting_for_ever = [shared.routes[0].clone(), shared.routes[3].clone()];
    let timing_out = [shared.routes[1].clone(), shared.routes[2].clone()];

    // A limit that is closed halfway, under its waiters.
    let closing = Limit::new(CLOSING);
    let closing_layer = (Operation::Verify, Executor::Thread);
    let closing_scoped = (Operation::Tool, Executor::Process);
    let doomed = Shared {
        name: "closing Limit",
        max: CLOSING,
        available: Box::new({
            let closing = closing.clone();
            move || closing.available()
        }),
        check: Box::new(|| {}),
        routes: vec![
            (
                closing_layer,
                layered(layer_on(closing.clone(), closing_layer, metrics)),
            ),
            (
                closing_scoped,
                scoped(closing.clone(), closing_scoped, metrics),
            ),
        ],
        load: Arc::default(),
    };
    let is_closing = |series: Series| series == closing_layer || series == closing_scoped;

    let mut rng = Rng::new(0x5eed_0003);
    let mut books = Books::default();
    let (mut raised, mut lowered) = (0, 0);

    for wave in 0..WAVES {
        // Phase A, with the capacity fixed: certain queue_full, abandoned and queue_timeout.
        assert_eq!((bounded.capacity(), bounded.available()), (BASE, BASE));
        let gates = Gates::fill(&[(&shared, BASE)], &mut rng).await;
        assert_eq!(bounded.available(), 0);

        // Waiters that hold every place of the queue until told to give up.
        let mut give_ups = Vec::new();
        let mut held = Vec::new();
        for i in 0..MAX_QUEUED {
            let (series, route) = waiting_for_ever[i % 2].clone();
            let (give_up_tx, give_up_rx) = oneshot::channel::<()>();
            let admitted = Arc::new(AtomicBool::new(false));
            let answer = route.serve(inner(Some(Arc::clone(&shared.load))), Work::Ok, &admitted);
            give_ups.push(give_up_tx);
            held.push((
                series,
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        answer = answer => panic!("a full limit answered {answer:?}"),
                        _ = give_up_rx => {}
                    }
                    assert!(!admitted.load(Ordering::SeqCst));
                    Fate::Abandoned
                }),
            ));
        }
        eventually("the queue full", || bounded.queued() == MAX_QUEUED).await;

        // The queue is full: any more are turned away at once, whatever their route and kind.
        let mut overflow = Vec::new();
        for _ in 0..OVERFLOW {
            let (series, route) = shared.pick(&mut rng);
            let kind = pick_kind(&mut rng, false);
            overflow.push((
                series,
                tokio::spawn(run(kind, route, Arc::clone(&shared.load))),
            ));
        }
        for (series, operation) in overflow {
            let fate = within("an overflowing operation", operation).await.unwrap();
            assert_eq!(fate, Fate::Rejected(Rejection::QueueFull), "{series:?}");
            books.record(series, fate);
        }

        drop(give_ups);
        for (series, waiter) in held {
            let fate = within("a waiter giving up", waiter).await.unwrap();
            books.record(series, fate);
        }
        assert_eq!(bounded.queued(), 0, "the abandoned waits left the queue");

        // Room in the queue, none at the limit: the layers with a queue timeout time out.
        let mut timeouts = Vec::new();
        for i in 0..TIMED_OUT {
            let (series, route) = timing_out[i % 2].clone();
            timeouts.push((
                series,
                tokio::spawn(run(Kind::Ok, route, Arc::clone(&shared.load))),
            ));
        }
        for (series, operation) in timeouts {
            let fate = within("a timed-out wait", operation).await.unwrap();
            assert_eq!(fate, Fate::Rejected(Rejection::QueueTimeout), "{series:?}");
            books.record(series, fate);
        }

        if wave == CLOSE_WAVE {
            // The closing limit, full, with waiters: closed under them.
            let closing_gates = Gates::fill(&[(&doomed, CLOSING)], &mut rng).await;
            let mut waiters = Vec::new();
            for _ in 0..CLOSE_WAITERS {
                let (series, route) = doomed.pick(&mut rng);
                let kind = pick_kind(&mut rng, false);
                waiters.push((
                    series,
                    tokio::spawn(run(kind, route, Arc::clone(&doomed.load))),
                ));
            }
            eventually("the closing limit's waiters queued", || {
                closing.queued() == CLOSE_WAITERS
            })
            .await;
            closing.close();
            for (series, waiter) in waiters {
                let joined = within("a waiter of the closed limit", waiter).await;
                books.record(
                    series,
                    closed_under(joined.expect_err("a waiter was admitted")),
                );
            }
            // Operations that hold a permit finish normally.
            closing_gates.open(&mut books).await;
        }
        gates.open(&mut books).await;

        // Phase B: a mix over both limits while the bounded one is resized at random moments.
        let stop = Arc::new(AtomicBool::new(false));
        let resizer = tokio::spawn(resize(
            bounded.clone(),
            1,
            LARGEST,
            0x5eed_0300 + wave as u64,
            Arc::clone(&stop),
        ));
        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let limit = if rng.below(4) == 0 { &doomed } else { &shared };
            let (series, route) = limit.pick(&mut rng);
            let kind = pick_kind(&mut rng, true);
            let load = Arc::clone(&limit.load);
            let arrival = Duration::from_micros(rng.below(4_000));
            operations.push((
                series,
                tokio::spawn(async move {
                    tokio::time::sleep(arrival).await;
                    run(kind, route, load).await
                }),
            ));
        }
        for (series, operation) in operations {
            let fate = match within("an operation", operation).await {
                Ok(fate) => fate,
                Err(joined) => {
                    assert!(
                        is_closing(series) && wave >= CLOSE_WAVE,
                        "{series:?} panicked: {}",
                        panic_message(&*joined.into_panic())
                    );
                    closed_under(joined)
                }
            };
            books.record(series, fate);
        }
        stop.store(true, Ordering::SeqCst);
        let (up, down) = within("the resizer", resizer).await.unwrap();
        raised += up;
        lowered += down;

        // Every operation is over: restored, the limit has every place free again.
        bounded.set_capacity(BASE).unwrap();
        assert_eq!(bounded.available(), bounded.capacity(), "wave {wave}");
        assert_eq!(bounded.queued(), 0);
    }

    assert!(
        raised > 0 && lowered > 0,
        "raised {raised}, lowered {lowered}"
    );
    assert_eq!((bounded.capacity(), bounded.available()), (BASE, BASE));
    assert_eq!((closing.available(), closing.queued()), (CLOSING, 0));
    assert!(
        shared.load.max() >= BASE,
        "the gates filled the bounded limit"
    );
    assert!(
        shared.load.max() <= LARGEST,
        "{} ran at once; the capacity never went above {LARGEST}",
        shared.load.max()
    );
    assert!(doomed.load.max() <= CLOSING);
    assert_eq!(shared.load.running() + doomed.load.running(), 0);
    let gauge = telemetry.live_value(
        LIMIT_INSTRUMENT,
        &[
            (OPERATION_ATTRIBUTE, patient.0.as_str()),
            (EXECUTOR_ATTRIBUTE, patient.1.as_str()),
        ],
    );
    assert_eq!(gauge, BASE as i64, "the limit gauge follows set_capacity");

    println!("books: {books:?}");
    assert!(books.rejected_total(Rejection::QueueFull) >= (WAVES * OVERFLOW) as u64);
    assert!(books.rejected_total(Rejection::QueueTimeout) >= (WAVES * TIMED_OUT) as u64);
    assert!(books.abandoned_total() >= (WAVES * MAX_QUEUED + CLOSE_WAITERS) as u64);
    for series in [closing_layer, closing_scoped] {
        assert!(
            books.abandoned.get(&series).copied().unwrap_or(0) > 0,
            "{series:?}"
        );
        for rejection in Rejection::ALL {
            assert!(
                !books.rejected.contains_key(&(series, *rejection)),
                "the closing limit has no bound, yet {series:?} was turned away"
            );
        }
    }
    for series in [patient, by_hand] {
        assert!(
            !books
                .rejected
                .contains_key(&(series, Rejection::QueueTimeout)),
            "{series:?} has no queue timeout"
        );
    }
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

// ---------------------------------------------------------------------------------------------
// The body-end form
// ---------------------------------------------------------------------------------------------

/// The response body of the streaming service, and of what a body-end layer makes of it.
type Body = UnsyncBoxBody<Bytes, io::Error>;

/// The streaming service, and what a body-end layer makes of it.
type Streamer = BoxService<Request<Script>, Response<Body>, io::Error>;

/// A body-end layer over a [`Streamer`], boxed.
type MakeStreamer = Arc<dyn Fn(Streamer) -> Streamer + Send + Sync>;

/// How the streaming service answers one request.
#[derive(Debug)]
enum Plan {
    /// A head, then `frames` data frames, then the end.
    Stream {
        head: Head,
        frames: usize,
        end: BodyEnd,
    },
    /// The service fails before any head.
    ServiceError,
    /// The service says it started, and never answers.
    Hang(oneshot::Sender<()>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Head {
    Ok,
    /// `500` (over HTTP), or a trailers-only `grpc-status` 13 with no body (over gRPC).
    Error,
}

/// How a body ends after its data frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyEnd {
    End,
    Fail,
    /// Trailers with this `grpc-status`.
    Trailers(&'static str),
    Panic,
    /// `set_outcome(Timeout)` while polled, then the end.
    SetTimeout,
}

/// The request: the plan, and what the test learns back.
#[derive(Debug)]
struct Script {
    plan: Plan,
    /// Set when the service is called: the operation was admitted.
    called: Arc<AtomicBool>,
    /// Said once called, then the body waits for the gate before its first frame.
    gate: Option<(mpsc::UnboundedSender<()>, watch::Receiver<bool>)>,
}

/// What a body has left to stream.
struct Streaming {
    frames: usize,
    end: BodyEnd,
    gate: Option<watch::Receiver<bool>>,
    /// Counts the body as streaming; dropped before the body shows its end, so that the count
    /// never includes a body whose operation may have ended.
    streaming: Option<reliability::LoadGuard>,
}

fn stream_body(streaming: Streaming) -> Body {
    let frames = futures_util::stream::unfold(Some(streaming), |state| async move {
        let mut state = state?;
        if let Some(mut gate) = state.gate.take() {
            gate.wait_for(|open| *open).await.expect("gate dropped");
        }
        tokio::task::yield_now().await;
        if state.frames > 0 {
            state.frames -= 1;
            return Some((Ok(Frame::data(Bytes::from_static(b"chunk"))), Some(state)));
        }
        drop(state.streaming.take());
        let last = match state.end {
            BodyEnd::End => return None,
            BodyEnd::SetTimeout => {
                assert!(
                    set_outcome(Outcome::Timeout),
                    "set_outcome outside the body"
                );
                return None;
            }
            BodyEnd::Fail => Err(io::Error::other("the body broke")),
            BodyEnd::Trailers(code) => {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static(code));
                Ok(Frame::trailers(trailers))
            }
            BodyEnd::Panic => panic!("{EXPECTED_PANIC}: the body broke"),
        };
        Some((last, None))
    });
    StreamBody::new(frames).boxed_unsync()
}

/// The streaming service: counts each answer on `streams` from its call until its body ends.
fn streamer(streams: Arc<Load>, grpc: bool) -> Streamer {
    BoxService::new(service_fn(move |request: Request<Script>| {
        let guard = streams.enter();
        let script = request.into_body();
        script.called.store(true, Ordering::SeqCst);
        async move {
            let gate = script.gate.map(|(started, open)| {
                started.send(()).expect("the test stopped listening");
                open
            });
            match script.plan {
                Plan::ServiceError => Err(io::Error::other("the service failed")),
                Plan::Hang(started) => {
                    let _guard = guard;
                    let _ = started.send(());
                    std::future::pending().await
                }
                Plan::Stream { head, frames, end } => {
                    let mut response = Response::new(Body::default());
                    if grpc {
                        response
                            .headers_mut()
                            .insert("content-type", HeaderValue::from_static("application/grpc"));
                        if head == Head::Error {
                            // Trailers-only: the head decides, and the empty body ends it.
                            response
                                .headers_mut()
                                .insert("grpc-status", HeaderValue::from_static("13"));
                            drop(guard);
                            return Ok(response);
                        }
                    } else if head == Head::Error {
                        *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    }
                    *response.body_mut() = stream_body(Streaming {
                        frames,
                        end,
                        gate,
                        streaming: Some(guard),
                    });
                    Ok(response)
                }
            }
        }
    }))
}

/// A body-end layer as a [`MakeStreamer`].
fn body_end<L, B>(layer: L) -> MakeStreamer
where
    L: Layer<Streamer> + Send + Sync + 'static,
    L::Service:
        Service<Request<Script>, Response = Response<B>, Error = io::Error> + Send + 'static,
    <L::Service as Service<Request<Script>>>::Future: Send + 'static,
    B: http_body::Body<Data = Bytes, Error = io::Error> + Send + 'static,
{
    Arc::new(move |inner| {
        BoxService::new(
            layer
                .layer(inner)
                .map_response(|response: Response<B>| response.map(BodyExt::boxed_unsync)),
        )
    })
}

/// One body-end route: its layer, whether it speaks gRPC, and whether it bounds its waits.
#[derive(Clone)]
struct BodyRoute {
    series: Series,
    make: MakeStreamer,
    grpc: bool,
    impatient: bool,
}

/// How the caller of a streamed operation makes it end.
#[derive(Clone, Copy, Debug)]
enum Streamed {
    /// Reads the body to its end: `ok`.
    ReadToEnd,
    /// The body fails mid-stream: `error`.
    Fail,
    /// The body ends with trailers: over gRPC their status decides; over HTTP the head did.
    Trailers(&'static str),
    /// The body panics while polled: `crashed`.
    Panic,
    /// The body chooses `timeout` while polled.
    SetTimeout,
    /// An error head (500, or a trailers-only gRPC error): `error`.
    HeadError,
    /// The service fails before any head: `error`.
    ServiceError,
    /// The caller drops the body mid-stream: `cancelled`.
    DropMidStream,
    /// The caller drops the response future before the head: `cancelled`.
    DropBeforeHead,
    /// The caller gives up after this long: waiting (abandoned), before the head or mid-stream
    /// (cancelled), or never (ok).
    GiveUp(Duration),
}

fn pick_streamed(rng: &mut Rng) -> Streamed {
    match rng.below(11) {
        0 => Streamed::ReadToEnd,
        1 => Streamed::Fail,
        2 => Streamed::Trailers(["0", "1", "4", "13"][rng.below(4) as usize]),
        3 => Streamed::Panic,
        4 => Streamed::SetTimeout,
        5 => Streamed::HeadError,
        6 => Streamed::ServiceError,
        7 => Streamed::DropMidStream,
        8 => Streamed::DropBeforeHead,
        9 => Streamed::GiveUp(Duration::from_micros(rng.below(6_000))),
        _ => Streamed::ReadToEnd,
    }
}

/// The outcome of a `grpc-status`, as the gRPC classifier reads it.
fn grpc_outcome(code: &str) -> Outcome {
    match code {
        "0" => Outcome::Ok,
        "1" => Outcome::Cancelled,
        "4" => Outcome::Timeout,
        _ => Outcome::Error,
    }
}

/// How a body the caller read to its end ended.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    End,
    Trailers(String),
    Error,
}

async fn drain(body: &mut Body) -> Drained {
    loop {
        match body.frame().await {
            None => return Drained::End,
            Some(Err(_)) => return Drained::Error,
            Some(Ok(frame)) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let code = trailers["grpc-status"].to_str().unwrap().to_owned();
                    assert!(body.frame().await.is_none(), "a frame after the trailers");
                    return Drained::Trailers(code);
                }
            }
        }
    }
}

/// The fate of an answer turned away (`503`), if it was.
fn turned_away(route: &BodyRoute, response: &Response<Body>, called: &AtomicBool) -> Option<Fate> {
    if response.status() != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    assert!(
        route.impatient,
        "{:?} is not bounded, yet answered 503",
        route.series
    );
    assert!(
        !called.load(Ordering::SeqCst),
        "a rejected request reached the service"
    );
    Some(Fate::Rejected(Rejection::QueueTimeout))
}

/// Reads an answer to its end (unless it was turned away), and returns what must have become of
/// its operation.
async fn read_answer(
    route: &BodyRoute,
    answer: Result<Response<Body>, io::Error>,
    streamed: Streamed,
    called: &AtomicBool,
) -> Fate {
    let response = match answer {
        Ok(response) => response,
        Err(error) => {
            assert!(
                matches!(streamed, Streamed::ServiceError),
                "{streamed:?}: {error}"
            );
            return Fate::Ended(Outcome::Error);
        }
    };
    if let Some(fate) = turned_away(route, &response, called) {
        return fate;
    }
    assert!(
        !matches!(streamed, Streamed::ServiceError),
        "the service answered"
    );
    let mut body = response.into_body();
    let drained = drain(&mut body).await;
    let outcome = match (streamed, drained) {
        (Streamed::ReadToEnd | Streamed::GiveUp(_), Drained::End) => Outcome::Ok,
        (Streamed::Fail, Drained::Error) => Outcome::Error,
        (Streamed::Trailers(code), Drained::Trailers(got)) => {
            assert_eq!(got, code);
            if route.grpc {
                grpc_outcome(code)
            } else {
                Outcome::Ok
            }
        }
        (Streamed::SetTimeout, Drained::End) => Outcome::Timeout,
        (Streamed::HeadError, Drained::End) => Outcome::Error,
        (streamed, drained) => panic!("{streamed:?} ended as {drained:?}"),
    };
    Fate::Ended(outcome)
}

/// Runs one streamed operation through `route`; returns what must have become of it.
async fn stream_one(
    route: BodyRoute,
    streamed: Streamed,
    frames: usize,
    streams: Arc<Load>,
) -> Fate {
    let called = Arc::new(AtomicBool::new(false));
    let service = (route.make)(streamer(streams, route.grpc));
    let script = |plan| {
        Request::new(Script {
            plan,
            called: Arc::clone(&called),
            gate: None,
        })
    };
    let stream = |end| Plan::Stream {
        head: Head::Ok,
        frames,
        end,
    };
    match streamed {
        Streamed::ReadToEnd | Streamed::GiveUp(_) => {
            let request = script(stream(BodyEnd::End));
            let whole = async {
                read_answer(&route, service.oneshot(request).await, streamed, &called).await
            };
            match streamed {
                Streamed::GiveUp(after) => match tokio::time::timeout(after, whole).await {
                    Ok(fate) => fate,
                    Err(_) if called.load(Ordering::SeqCst) => Fate::Ended(Outcome::Cancelled),
                    Err(_) => Fate::Abandoned,
                },
                _ => whole.await,
            }
        }
        Streamed::Fail | Streamed::Trailers(_) | Streamed::SetTimeout => {
            let end = match streamed {
                Streamed::Fail => BodyEnd::Fail,
                Streamed::Trailers(code) => BodyEnd::Trailers(code),
                _ => BodyEnd::SetTimeout,
            };
            read_answer(
                &route,
                service.oneshot(script(stream(end))).await,
                streamed,
                &called,
            )
            .await
        }
        Streamed::HeadError => {
            let plan = Plan::Stream {
                head: Head::Error,
                frames,
                end: BodyEnd::End,
            };
            read_answer(
                &route,
                service.oneshot(script(plan)).await,
                streamed,
                &called,
            )
            .await
        }
        Streamed::ServiceError => {
            read_answer(
                &route,
                service.oneshot(script(Plan::ServiceError)).await,
                streamed,
                &called,
            )
            .await
        }
        Streamed::Panic => {
            // The body is polled in a task of its own, which the panic ends.
            let request = script(stream(BodyEnd::Panic));
            let route = route.clone();
            let called = Arc::clone(&called);
            let polled = tokio::spawn(async move {
                let response = service.oneshot(request).await.unwrap();
                if let Some(fate) = turned_away(&route, &response, &called) {
                    return fate;
                }
                let drained = drain(&mut response.into_body()).await;
                panic!("a panicking body ended as {drained:?}")
            });
            match polled.await {
                Ok(fate) => fate,
                Err(joined) => crashed(joined),
            }
        }
        Streamed::DropMidStream => {
            let request = script(Plan::Stream {
                head: Head::Ok,
                frames: frames + 1,
                end: BodyEnd::End,
            });
            let response = service.oneshot(request).await.unwrap();
            if let Some(fate) = turned_away(&route, &response, &called) {
                return fate;
            }
            let mut body = response.into_body();
            for _ in 0..frames {
                let frame = body.frame().await.expect("a data frame").unwrap();
                assert!(frame.is_data());
            }
            drop(body);
            Fate::Ended(Outcome::Cancelled)
        }
        Streamed::DropBeforeHead => {
            let (started_tx, started_rx) = oneshot::channel();
            let answer = service.oneshot(script(Plan::Hang(started_tx)));
            tokio::select! {
                biased;
                answer = answer => {
                    let response = answer.expect("a hanging service answered");
                    turned_away(&route, &response, &called).expect("a hanging service answered")
                }
                started = started_rx => {
                    started.expect("the service was dropped before it started");
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bodies_under_load_hold_their_permits_to_the_end_and_end_every_way_a_body_can() {
    const WAVES: usize = 16;
    const OPS_PER_WAVE: usize = 150;
    const CAPACITY: usize = 3;
    const HELD_GIVE_UPS: usize = 4;
    const TIMED_OUT: usize = 2;

    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let metrics = &telemetry.metrics;
    let limit = Limit::new(CAPACITY);
    let streams = Arc::new(Load::default());
    let http = BodyRoute {
        series: (Operation::Verify, Executor::Subprocess),
        make: body_end(
            ResourcesOperationLayer::with_limit_for_http(limit.clone())
                .operation(Operation::Verify)
                .executor(Executor::Subprocess)
                .metrics(metrics.clone())
                .until_body_end(),
        ),
        grpc: false,
        impatient: false,
    };
    let grpc = BodyRoute {
        series: (Operation::Judge, Executor::Thread),
        make: body_end(
            ResourcesOperationLayer::with_limit_for_grpc(limit.clone())
                .operation(Operation::Judge)
                .executor(Executor::Thread)
                .metrics(metrics.clone())
                .until_body_end(),
        ),
        grpc: true,
        impatient: false,
    };
    let impatient = BodyRoute {
        series: (Operation::Tool, Executor::Inline),
        make: body_end(
            ResourcesOperationLayer::with_limit_for_http(limit.clone())
                .operation(Operation::Tool)
                .executor(Executor::Inline)
                .metrics(metrics.clone())
                .until_body_end()
                .queue_timeout(Duration::from_millis(3)),
        ),
        grpc: false,
        impatient: true,
    };
    let routes = [http.clone(), grpc.clone(), impatient.clone()];
    let mut rng = Rng::new(0x5eed_0004);
    let mut books = Books::default();

    for _ in 0..WAVES {
        // Streams that hold every permit until the gate opens, their heads already answered.
        let (open_tx, open_rx) = watch::channel(false);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();
        let mut gates = Vec::new();
        for i in 0..CAPACITY {
            let route = if i % 2 == 0 {
                http.clone()
            } else {
                grpc.clone()
            };
            let service = (route.make)(streamer(Arc::clone(&streams), route.grpc));
            let request = Request::new(Script {
                plan: Plan::Stream {
                    head: Head::Ok,
                    frames: 2,
                    end: BodyEnd::End,
                },
                called: Arc::default(),
                gate: Some((started_tx.clone(), open_rx.clone())),
            });
            gates.push((
                route.series,
                tokio::spawn(async move {
                    let response = service.oneshot(request).await.unwrap();
                    drain(&mut response.into_body()).await
                }),
            ));
        }
        for _ in 0..CAPACITY {
            within("a gate stream", started_rx.recv()).await;
        }
        assert_eq!(limit.available(), 0, "the streams hold every permit");

        // Waiters given up while they wait.
        let mut give_ups = Vec::new();
        let mut held = Vec::new();
        for i in 0..HELD_GIVE_UPS {
            let route = if i % 2 == 0 {
                http.clone()
            } else {
                grpc.clone()
            };
            let (give_up_tx, give_up_rx) = oneshot::channel::<()>();
            let called = Arc::new(AtomicBool::new(false));
            let service = (route.make)(streamer(Arc::clone(&streams), route.grpc));
            let request = Request::new(Script {
                plan: Plan::Stream {
                    head: Head::Ok,
                    frames: 1,
                    end: BodyEnd::End,
                },
                called: Arc::clone(&called),
                gate: None,
            });
            give_ups.push(give_up_tx);
            held.push((
                route.series,
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        _ = service.oneshot(request) => panic!("a full limit answered"),
                        _ = give_up_rx => {}
                    }
                    assert!(!called.load(Ordering::SeqCst));
                    Fate::Abandoned
                }),
            ));
        }
        eventually("the give-ups queued", || limit.queued() == HELD_GIVE_UPS).await;
        drop(give_ups);
        for (series, waiter) in held {
            books.record(series, within("a give-up", waiter).await.unwrap());
        }

        // The limit stays full: the bounded layer's waits time out.
        let mut timeouts = Vec::new();
        for _ in 0..TIMED_OUT {
            let route = impatient.clone();
            timeouts.push(tokio::spawn(stream_one(
                route,
                Streamed::ReadToEnd,
                1,
                Arc::clone(&streams),
            )));
        }
        for timeout in timeouts {
            let fate = within("a timed-out wait", timeout).await.unwrap();
            assert_eq!(fate, Fate::Rejected(Rejection::QueueTimeout));
            books.record(impatient.series, fate);
        }

        // The mix, queued behind the gates.
        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let route = routes[rng.below(routes.len() as u64) as usize].clone();
            let streamed = pick_streamed(&mut rng);
            let frames = rng.below(5) as usize;
            operations.push((
                route.series,
                tokio::spawn(stream_one(route, streamed, frames, Arc::clone(&streams))),
            ));
        }

        open_tx.send(true).unwrap();
        for (series, gate) in gates {
            assert_eq!(within("a gate stream", gate).await.unwrap(), Drained::End);
            books.ended(series, Outcome::Ok);
        }
        for (series, operation) in operations {
            books.record(
                series,
                within("a streamed operation", operation).await.unwrap(),
            );
        }
        assert_eq!(
            limit.available(),
            CAPACITY,
            "every permit back after the wave"
        );
    }

    assert_eq!((limit.available(), limit.queued()), (CAPACITY, 0));
    assert_eq!(streams.running(), 0);
    assert_eq!(
        streams.max(),
        CAPACITY,
        "the gates streamed at the limit, never above"
    );
    println!("books: {books:?}");
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    assert!(books.rejected_total(Rejection::QueueTimeout) >= (WAVES * TIMED_OUT) as u64);
    assert!(books.abandoned_total() >= (WAVES * HELD_GIVE_UPS) as u64);
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}
