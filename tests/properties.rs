//! The books balance on any schedule: random arrivals, run times and endings through one limit
//! shared by two layers (and by `resources_operation`), with a queue bound and queue timeouts
//! drawn too, and the limit of any kind (the crate's `Limit`, a tokio `Semaphore`, or a pool of
//! the tests' own that implements only `Acquire::acquire`), on paused tokio time, so every case is deterministic and replays from its seed
//! (proptest saves failing seeds next to this file). And the same for the body-end form: random
//! arrivals, stream lengths, gaps between frames and endings of streamed bodies.
//!
//! On paused time the clock moves only when every task waits on a timer, so the test side can
//! read the very instants the layer reads: from what each caller got, it knows what became of
//! each operation (admitted, after which wait, for how long, and how it ended; rejected, for
//! which reason and when; or abandoned), and besides the counts, the sums of both histograms
//! must equal the waits and run times the test itself measured.

mod reliability;
mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use proptest::prelude::*;
use tokio::sync::{oneshot, Semaphore};
use tokio::time::Instant;
use tower::util::BoxService;
use tower::{service_fn, Layer, Service, ServiceExt as _};

use reliability::{
    quiet_expected_panics, Books, Fate, Load, LoadGuard, Pool, Series, EXPECTED_PANIC,
};
use support::Telemetry;
use tower_resources_operation::{
    set_outcome, Acquire, Executor, Limit, Operation, OperationMetrics, Outcome, Rejected,
    Rejection, ResourcesOperationLayer, SharedClassifier, TimeoutClassifier, ACTIVE_INSTRUMENT,
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inner service of the schedules, and what a layer makes of it.
type Inner = BoxService<Behavior, (), BoxError>;

/// A layer over an [`Inner`], boxed: a bounded layer and one that is not have different types.
type MakeService = Arc<dyn Fn(Inner) -> Inner + Send + Sync>;

/// The layer of these tests, on a limit of kind `L`, with tower's and tokio's `Elapsed` as
/// `timeout`.
type TimeoutLayer<L> = ResourcesOperationLayer<SharedClassifier<TimeoutClassifier>, L>;

/// The two series that share the limit.
const VERIFY: Series = (Operation::Verify, Executor::Inline);
const JUDGE: Series = (Operation::Judge, Executor::Thread);

/// A lost permit would leave tasks waiting on nothing: on paused time this deadline then comes
/// at once and fails the case instead of hanging it.
const NEVER: Duration = Duration::from_secs(24 * 3600);

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

/// A new current-thread runtime on paused time.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

/// The instant a layer first polls the inner service ready: its operation's admission (a layer
/// polls its inner service only once it holds the permit, never for an operation it turned
/// away, and `oneshot` calls in that very poll).
type Admission = Arc<Mutex<Option<Instant>>>;

/// Notes the [`Admission`] of the service it wraps.
struct Probe<S> {
    inner: S,
    admitted: Admission,
}

impl<S: Service<R>, R> Service<R> for Probe<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.admitted
            .lock()
            .unwrap()
            .get_or_insert_with(Instant::now);
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.inner.call(request)
    }
}

/// What became of an operation whose caller got `error`: turned away, if it holds a
/// [`Rejected`].
fn rejection(error: &BoxError) -> Option<Fate> {
    error
        .downcast_ref::<Rejected>()
        .map(|rejected| Fate::Rejected(rejected.rejection()))
}

/// What the test saw of one operation.
#[derive(Debug)]
struct Record {
    series: Series,
    arrived: Instant,
    /// When it got its permit, if it did.
    admitted: Option<Instant>,
    fate: Fate,
    /// When it ended, was turned away or was given up.
    at: Instant,
}

/// What the test measured of a schedule: its books, and the total wait and run time of the
/// admitted operations, per series (and outcome), in ms.
struct Measured {
    books: Books,
    queue_ms: BTreeMap<Series, f64>,
    run_ms: BTreeMap<(Series, Outcome), f64>,
}

/// Checks every record against what it says happened, and returns what the test measured.
fn books_of(
    records: &[Record],
    queue_timeouts: &BTreeMap<Series, Duration>,
) -> Result<Measured, TestCaseError> {
    let mut books = Books::default();
    let mut queue_ms: BTreeMap<Series, f64> = BTreeMap::new();
    let mut run_ms: BTreeMap<(Series, Outcome), f64> = BTreeMap::new();
    for record in records {
        match (record.fate, record.admitted) {
            (Fate::Ended(outcome), Some(admitted)) => {
                *queue_ms.entry(record.series).or_default() += millis(admitted - record.arrived);
                *run_ms.entry((record.series, outcome)).or_default() +=
                    millis(record.at - admitted);
            }
            (Fate::Ended(_), None) => {
                return Err(TestCaseError::fail(format!("ended unadmitted: {record:?}")));
            }
            (_, Some(_)) => {
                return Err(TestCaseError::fail(format!(
                    "admitted, not ended: {record:?}"
                )));
            }
            (Fate::Rejected(Rejection::QueueFull), None) => {
                // A full queue turns an operation away the moment it asks.
                prop_assert_eq!(record.at, record.arrived, "{:?}", record);
            }
            (Fate::Rejected(Rejection::QueueTimeout), None) => {
                // Exactly its layer's queue timeout after it started to wait.
                prop_assert_eq!(
                    Some(&(record.at - record.arrived)),
                    queue_timeouts.get(&record.series),
                    "{:?}",
                    record
                );
            }
            (Fate::Abandoned, None) => {}
        }
        books.record(record.series, record.fate);
    }
    Ok(Measured {
        books,
        queue_ms,
        run_ms,
    })
}

/// The books the metrics exported are the test's, and the histograms' sums are the waits and
/// run times the test measured.
fn check_metrics(telemetry: &Telemetry, measured: &Measured) -> Result<(), TestCaseError> {
    let Measured {
        books,
        queue_ms,
        run_ms,
    } = measured;
    let exported = Books::exported(telemetry);
    prop_assert_eq!(&exported.ended, &books.ended, "duration samples");
    prop_assert_eq!(&exported.admitted, &books.admitted, "queue samples");
    prop_assert_eq!(&exported.rejected, &books.rejected, "rejections");
    prop_assert_eq!(&exported.abandoned, &books.abandoned, "abandoned waits");

    for ((operation, executor), expected) in queue_ms {
        let series = [
            (OPERATION_ATTRIBUTE, operation.as_str()),
            (EXECUTOR_ATTRIBUTE, executor.as_str()),
        ];
        let sum = telemetry.sum(QUEUE_DURATION_INSTRUMENT, &series);
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "queue time of {:?}: recorded {} ms, waited {} ms",
            series,
            sum,
            expected
        );
    }
    for (((operation, executor), outcome), expected) in run_ms {
        let series = [
            (OPERATION_ATTRIBUTE, operation.as_str()),
            (EXECUTOR_ATTRIBUTE, executor.as_str()),
            (OUTCOME_ATTRIBUTE, outcome.as_str()),
        ];
        let sum = telemetry.sum(DURATION_INSTRUMENT, &series);
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "run time of {:?}: recorded {} ms, ran {} ms",
            series,
            sum,
            expected
        );
    }

    for instrument in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
        for (operation, executor) in [VERIFY, JUDGE] {
            let series = [
                (OPERATION_ATTRIBUTE, operation.as_str()),
                (EXECUTOR_ATTRIBUTE, executor.as_str()),
            ];
            prop_assert_eq!(
                telemetry.live_value(instrument, &series),
                0,
                "{}",
                instrument
            );
        }
    }
    Ok(())
}

/// Every permit of `limit` (of `capacity`) is back, and the work under it never ran above it.
fn check_limit(limit: &Shared, capacity: usize, load: &Load) -> Result<(), TestCaseError> {
    match limit {
        Shared::Limit(limit) => {
            prop_assert_eq!(limit.available(), capacity);
            prop_assert_eq!(limit.queued(), 0);
        }
        Shared::Semaphore(semaphore) => {
            prop_assert_eq!(semaphore.available_permits(), capacity);
        }
        Shared::Pool(pool) => {
            prop_assert_eq!(pool.available(), capacity);
            pool.assert_all_back();
        }
    }
    prop_assert!(
        load.max() <= capacity,
        "{} ran under a limit of {}",
        load.max(),
        capacity
    );
    prop_assert_eq!(load.running(), 0);
    Ok(())
}

/// The limit a schedule runs through, of one kind or another.
#[derive(Clone)]
enum Shared {
    /// The crate's `Limit`: the one kind whose queue can be bounded.
    Limit(Limit),
    /// A tokio `Semaphore`, shared as an `Arc`.
    Semaphore(Arc<Semaphore>),
    /// A pool of the tests' own, which implements only `Acquire::acquire`: every operation on
    /// it takes the trait's slow path.
    Pool(Pool),
}

/// The kinds of [`Shared`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Limit,
    Semaphore,
    Pool,
}

impl Shared {
    fn new(kind: Kind, capacity: usize, max_queued: Option<usize>) -> Self {
        match kind {
            Kind::Limit => {
                let limit = Limit::new(capacity);
                Self::Limit(match max_queued {
                    Some(max_queued) => limit.max_queued(max_queued),
                    None => limit,
                })
            }
            Kind::Semaphore => Self::Semaphore(Arc::new(Semaphore::new(capacity))),
            Kind::Pool => Self::Pool(Pool::new(capacity)),
        }
    }

    /// `work` through `resources_operation` on this limit.
    async fn scoped<F>(
        &self,
        metrics: &OperationMetrics,
        series: Series,
        work: F,
    ) -> Result<F::Output, Rejected>
    where
        F: Future,
        F::Output: tower_resources_operation::OperationOutput,
    {
        let (operation, executor) = series;
        match self {
            Self::Limit(limit) => {
                metrics
                    .resources_operation(limit, operation, executor, work)
                    .await
            }
            Self::Semaphore(semaphore) => {
                metrics
                    .resources_operation(&**semaphore, operation, executor, work)
                    .await
            }
            Self::Pool(pool) => {
                metrics
                    .resources_operation(pool, operation, executor, work)
                    .await
            }
        }
    }
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Limit), Just(Kind::Semaphore), Just(Kind::Pool)]
}

// ---------------------------------------------------------------------------------------------
// Schedules, with bounded waiting
// ---------------------------------------------------------------------------------------------

/// How an operation ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The work runs, then answers `Ok`.
    Ok,
    /// The work runs, then answers `Err`.
    Err,
    /// The work runs, then panics (in a task of its own).
    Panic,
    /// The work runs, chooses `timeout` with `set_outcome`, and answers `Ok`.
    SetTimeout,
    /// The work never ends; the caller drops it this many ms after it started.
    DropInFlight(u64),
    /// The caller gives up this many ms after it arrived (`tokio::time::timeout`): in the queue
    /// (abandoned), in flight, or never, if the work ended first.
    GiveUpAfter(u64),
    /// tower's `TimeoutLayer` of this many ms, inside the limit, races the work.
    TowerTimeout(u64),
    /// `poll_ready` takes the permit; the service is dropped unused this many ms later.
    ReadyUnused(u64),
    /// The work runs through `resources_operation` on the same limit, then answers `Ok`, or
    /// `Err` if `true`.
    Scoped(bool),
}

#[derive(Clone, Copy, Debug)]
struct Op {
    arrival_ms: u64,
    run_ms: u64,
    ending: Ending,
    judge: bool,
}

/// How waits on the limit are bounded: its queue, and each layer's queue timeout, in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bounds {
    max_queued: Option<usize>,
    verify_timeout_ms: Option<u64>,
    judge_timeout_ms: Option<u64>,
}

impl Bounds {
    /// These bounds as a limit of `kind` takes them: only the crate's `Limit` bounds its queue.
    fn for_kind(self, kind: Kind) -> Self {
        match kind {
            Kind::Limit => self,
            Kind::Semaphore | Kind::Pool => Self {
                max_queued: None,
                ..self
            },
        }
    }
}

fn ending() -> impl Strategy<Value = Ending> {
    prop_oneof![
        Just(Ending::Ok),
        Just(Ending::Err),
        Just(Ending::Panic),
        Just(Ending::SetTimeout),
        (0..20u64).prop_map(Ending::DropInFlight),
        (0..40u64).prop_map(Ending::GiveUpAfter),
        (0..20u64).prop_map(Ending::TowerTimeout),
        (0..20u64).prop_map(Ending::ReadyUnused),
        any::<bool>().prop_map(Ending::Scoped),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    (0..50u64, 0..20u64, ending(), any::<bool>()).prop_map(|(arrival_ms, run_ms, ending, judge)| {
        Op {
            arrival_ms,
            run_ms,
            ending,
            judge,
        }
    })
}

fn bounds() -> impl Strategy<Value = Bounds> {
    use proptest::option::weighted;
    (
        weighted(0.5, 0..6usize),
        weighted(0.4, 0..25u64),
        weighted(0.4, 0..25u64),
    )
        .prop_map(|(max_queued, verify_timeout_ms, judge_timeout_ms)| Bounds {
            max_queued,
            verify_timeout_ms,
            judge_timeout_ms,
        })
}

/// What the inner service does.
enum Behavior {
    /// Sleeps, then ends as `then` says.
    Run { run: Duration, then: Ending },
    /// Says it started, then never ends.
    Hang(oneshot::Sender<()>),
}

/// The inner service of one operation, counted on `load` from its call.
fn inner(load: Arc<Load>) -> Inner {
    BoxService::new(service_fn(move |behavior: Behavior| {
        let guard = load.enter();
        async move {
            let _guard = guard;
            match behavior {
                Behavior::Hang(started) => {
                    let _ = started.send(());
                    std::future::pending().await
                }
                Behavior::Run { run, then } => {
                    tokio::time::sleep(run).await;
                    match then {
                        Ending::Err => Err("boom".into()),
                        Ending::Panic => panic!("{EXPECTED_PANIC}"),
                        Ending::SetTimeout => {
                            assert!(set_outcome(Outcome::Timeout));
                            Ok(())
                        }
                        _ => Ok(()),
                    }
                }
            }
        }
    }))
}

/// `inner` under `make`, with its admission noted.
fn admitted_through(make: &MakeService, inner: Inner, admitted: &Admission) -> Inner {
    make(BoxService::new(Probe {
        inner,
        admitted: Arc::clone(admitted),
    }))
}

/// The layer of one series, bounded as `bounds` say, boxed.
fn make_layer<A>(layer: TimeoutLayer<A>, bounds: &Bounds, timeout_ms: Option<u64>) -> MakeService
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send + 'static,
{
    fn boxed<L>(layer: L) -> MakeService
    where
        L: Layer<Inner> + Send + Sync + 'static,
        L::Service: Service<Behavior, Response = (), Error = BoxError> + Send + 'static,
        <L::Service as Service<Behavior>>::Future: Send + 'static,
    {
        Arc::new(move |inner| BoxService::new(layer.layer(inner)))
    }
    match (timeout_ms, bounds.max_queued) {
        (Some(timeout), _) => boxed(layer.queue_timeout(ms(timeout))),
        // A limit with a queue bound needs layers that answer rejections.
        (None, Some(_)) => boxed(layer.bounded()),
        (None, None) => boxed(layer),
    }
}

/// The ways to the shared limit.
#[derive(Clone)]
struct Routes {
    limit: Shared,
    metrics: OperationMetrics,
    verify: MakeService,
    judge: MakeService,
}

/// Runs `op` and says what became of it.
async fn run(op: Op, routes: Routes, load: Arc<Load>) -> Record {
    tokio::time::sleep(ms(op.arrival_ms)).await;
    let arrived = Instant::now();
    let series = if op.judge { JUDGE } else { VERIFY };
    let make = if op.judge {
        &routes.judge
    } else {
        &routes.verify
    };
    let admitted: Admission = Arc::default();
    let service = || admitted_through(make, inner(Arc::clone(&load)), &admitted);
    let run = ms(op.run_ms);
    let behavior = |then| Behavior::Run { run, then };
    let fate = match op.ending {
        Ending::Panic => {
            let joined = tokio::task::spawn_local(service().oneshot(behavior(op.ending))).await;
            match joined {
                Ok(Ok(())) => panic!("the work panicked, yet answered"),
                Ok(Err(error)) => rejection(&error).expect("a rejection"),
                Err(joined) => {
                    assert!(joined.is_panic());
                    Fate::Ended(Outcome::Crashed)
                }
            }
        }
        Ending::Ok | Ending::Err | Ending::SetTimeout => {
            match (service().oneshot(behavior(op.ending)).await, op.ending) {
                (Ok(()), Ending::Ok) => Fate::Ended(Outcome::Ok),
                (Ok(()), Ending::SetTimeout) => Fate::Ended(Outcome::Timeout),
                (Err(error), ending) => match rejection(&error) {
                    Some(fate) => fate,
                    None => {
                        assert!(matches!(ending, Ending::Err), "{error}");
                        Fate::Ended(Outcome::Error)
                    }
                },
                (Ok(()), ending) => panic!("{ending:?} answered Ok"),
            }
        }
        Ending::DropInFlight(after) => {
            let (started_tx, started_rx) = oneshot::channel();
            let mut operation = Box::pin(service().oneshot(Behavior::Hang(started_tx)));
            let fate = tokio::select! {
                biased;
                answer = &mut operation => match answer {
                    Ok(()) => panic!("hanging work answered"),
                    Err(error) => Some(rejection(&error).expect("a rejection")),
                },
                started = started_rx => {
                    started.unwrap();
                    None
                }
            };
            match fate {
                Some(fate) => fate,
                None => {
                    tokio::time::sleep(ms(after)).await;
                    drop(operation);
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
        Ending::GiveUpAfter(after) => {
            let operation = service().oneshot(behavior(Ending::Ok));
            match tokio::time::timeout(ms(after), operation).await {
                Ok(Ok(())) => Fate::Ended(Outcome::Ok),
                Ok(Err(error)) => rejection(&error).expect("a rejection"),
                Err(_) if admitted.lock().unwrap().is_some() => Fate::Ended(Outcome::Cancelled),
                Err(_) => Fate::Abandoned,
            }
        }
        Ending::TowerTimeout(deadline) => {
            let timed = BoxService::new(tower::timeout::Timeout::new(
                inner(Arc::clone(&load)),
                ms(deadline),
            ));
            let service = admitted_through(make, timed, &admitted);
            match service.oneshot(behavior(Ending::Ok)).await {
                Ok(()) => Fate::Ended(Outcome::Ok),
                Err(error) => match rejection(&error) {
                    Some(fate) => fate,
                    None => {
                        assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
                        Fate::Ended(Outcome::Timeout)
                    }
                },
            }
        }
        Ending::ReadyUnused(after) => {
            let mut service = service();
            service.ready().await.unwrap();
            if admitted.lock().unwrap().is_some() {
                tokio::time::sleep(ms(after)).await;
                drop(service);
                Fate::Ended(Outcome::Cancelled)
            } else {
                // Turned away: `call` answers the rejection without the inner service.
                let error = service.call(behavior(Ending::Ok)).await.unwrap_err();
                rejection(&error).expect("a rejection")
            }
        }
        Ending::Scoped(fail) => {
            let guard = Arc::clone(&load);
            let noted = Arc::clone(&admitted);
            let work = async move {
                *noted.lock().unwrap() = Some(Instant::now());
                let _running = guard.enter();
                tokio::time::sleep(run).await;
                if fail {
                    Err::<(), BoxError>("boom".into())
                } else {
                    Ok(())
                }
            };
            let scoped = routes.limit.scoped(&routes.metrics, series, work).await;
            match scoped {
                Ok(Ok(())) => Fate::Ended(Outcome::Ok),
                Ok(Err(_)) => Fate::Ended(Outcome::Error),
                Err(rejected) => Fate::Rejected(rejected.rejection()),
            }
        }
    };
    let admitted = *admitted.lock().unwrap();
    Record {
        series,
        arrived,
        admitted,
        fate,
        at: Instant::now(),
    }
}

/// The two layers of a schedule on `limit`, bounded as `bounds` say: `(verify, judge)`.
fn make_routes<A>(limit: A, metrics: &OperationMetrics, bounds: &Bounds) -> [MakeService; 2]
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send + 'static,
{
    let layer = ResourcesOperationLayer::with_limit(limit)
        .classifier(TimeoutClassifier::new())
        .metrics(metrics.clone());
    [
        make_layer(
            layer.clone().operation(VERIFY.0).executor(VERIFY.1),
            bounds,
            bounds.verify_timeout_ms,
        ),
        make_layer(
            layer.operation(JUDGE.0).executor(JUDGE.1),
            bounds,
            bounds.judge_timeout_ms,
        ),
    ]
}

/// Runs one schedule through a limit of `kind` on a fresh paused runtime and checks the books,
/// the sums, the live counts, the permits and the peak load; returns the books. `bounds` must
/// suit `kind` ([`Bounds::for_kind`]).
fn check(kind: Kind, capacity: usize, bounds: Bounds, ops: &[Op]) -> Result<Books, TestCaseError> {
    quiet_expected_panics();
    assert_eq!(
        bounds,
        bounds.for_kind(kind),
        "{kind:?} cannot bound its queue"
    );
    let telemetry = Telemetry::new();
    let limit = Shared::new(kind, capacity, bounds.max_queued);
    let metrics = &telemetry.metrics;
    let [verify, judge] = match &limit {
        Shared::Limit(limit) => make_routes(limit.clone(), metrics, &bounds),
        Shared::Semaphore(semaphore) => make_routes(Arc::clone(semaphore), metrics, &bounds),
        Shared::Pool(pool) => make_routes(pool.clone(), metrics, &bounds),
    };
    let routes = Routes {
        limit: limit.clone(),
        metrics: metrics.clone(),
        verify,
        judge,
    };
    let load = Arc::new(Load::default());

    let runtime = paused_runtime();
    let local = tokio::task::LocalSet::new();
    let records = local.block_on(&runtime, async {
        let tasks: Vec<_> = ops
            .iter()
            .map(|op| tokio::task::spawn_local(run(*op, routes.clone(), Arc::clone(&load))))
            .collect();
        tokio::time::timeout(NEVER, async {
            let mut records = Vec::new();
            for task in tasks {
                records.push(task.await.unwrap());
            }
            records
        })
        .await
        .expect("the schedule never finished")
    });

    check_limit(&limit, capacity, &load)?;
    let queue_timeouts = [
        (VERIFY, bounds.verify_timeout_ms),
        (JUDGE, bounds.judge_timeout_ms),
    ]
    .into_iter()
    .filter_map(|(series, timeout)| Some((series, ms(timeout?))))
    .collect();
    let measured = books_of(&records, &queue_timeouts)?;
    prop_assert_eq!(measured.books.asked_total(), ops.len() as u64);
    if bounds.max_queued.is_none() {
        prop_assert_eq!(measured.books.rejected_total(Rejection::QueueFull), 0);
    }
    check_metrics(&telemetry, &measured)?;
    Ok(measured.books)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_records_each_operation_once_as_admitted_with_its_wait_and_run_time_rejected_or_abandoned(
        kind in kind(),
        limit in 1usize..=4,
        bounds in bounds(),
        ops in proptest::collection::vec(op(), 1..=30),
    ) {
        let bounds = bounds.for_kind(kind);
        let books = check(kind, limit, bounds, &ops)?;
        if bounds == Bounds::default() {
            prop_assert_eq!(books.rejected.len(), 0, "unbounded waits were turned away");
        }
    }
}

/// The endings of the fixed schedules, each under contention.
const FIXED_ENDINGS: [Ending; 12] = [
    Ending::Ok,
    Ending::Err,
    Ending::Panic,
    Ending::SetTimeout,
    Ending::DropInFlight(3),
    Ending::GiveUpAfter(1),
    Ending::GiveUpAfter(30),
    Ending::TowerTimeout(2),
    Ending::TowerTimeout(30),
    Ending::ReadyUnused(4),
    Ending::Scoped(false),
    Ending::Scoped(true),
];

/// 36 operations, `spread` ms apart in groups of four.
fn fixed_schedule(spread: u64) -> Vec<Op> {
    (0..36)
        .map(|i| Op {
            arrival_ms: (i % 4) as u64 + spread * (i / 4) as u64,
            run_ms: 5 + (i % 3) as u64,
            ending: FIXED_ENDINGS[i % FIXED_ENDINGS.len()],
            judge: i % 2 == 1,
        })
        .collect()
}

/// One fixed schedule that exercises every ending under contention, as a plain test, through
/// each kind of limit.
#[test]
fn a_fixed_schedule_with_every_ending_balances_the_books_with_each_kind_of_limit() {
    for kind in [Kind::Limit, Kind::Semaphore, Kind::Pool] {
        let books = check(kind, 2, Bounds::default(), &fixed_schedule(0)).unwrap();
        assert!(
            books.abandoned_total() > 0,
            "{kind:?}: none abandoned: {books:?}"
        );
        assert!(
            books.admitted_total() > 0,
            "{kind:?}: none admitted: {books:?}"
        );
    }
}

/// The same schedule on a bounded queue, with a queue timeout on one layer: some are turned away
/// for a full queue, some for waiting too long, some are given up while they wait.
#[test]
fn a_fixed_schedule_on_a_bounded_queue_balances_the_books_by_reason() {
    let bounds = Bounds {
        max_queued: Some(4),
        verify_timeout_ms: Some(6),
        judge_timeout_ms: None,
    };
    let books = check(Kind::Limit, 2, bounds, &fixed_schedule(4)).unwrap();
    // The schedule covers every fate.
    for rejection in Rejection::ALL {
        assert!(
            books.rejected_total(*rejection) > 0,
            "no {rejection}: {books:?}"
        );
    }
    assert!(books.abandoned_total() > 0, "none abandoned: {books:?}");
    assert!(books.admitted_total() > 0, "none admitted: {books:?}");
}

/// A queue timeout on one layer, through each kind of limit: the semaphore and the pool cannot
/// bound their queues, yet their waits time out, are given up and are admitted by the same rules.
#[test]
fn a_fixed_schedule_with_a_queue_timeout_balances_the_books_with_each_kind_of_limit() {
    let bounds = Bounds {
        max_queued: None,
        verify_timeout_ms: Some(6),
        judge_timeout_ms: None,
    };
    for kind in [Kind::Limit, Kind::Semaphore, Kind::Pool] {
        let books = check(kind, 2, bounds, &fixed_schedule(4)).unwrap();
        assert!(
            books.rejected_total(Rejection::QueueTimeout) > 0,
            "{kind:?}: none timed out: {books:?}"
        );
        assert_eq!(books.rejected_total(Rejection::QueueFull), 0, "{kind:?}");
        assert!(
            books.abandoned_total() > 0,
            "{kind:?}: none abandoned: {books:?}"
        );
        assert!(
            books.admitted_total() > 0,
            "{kind:?}: none admitted: {books:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The body-end form
// ---------------------------------------------------------------------------------------------

/// A streamed response body, and what a body-end layer makes of it.
type Body = UnsyncBoxBody<Bytes, io::Error>;

/// The streaming service, and what a body-end layer makes of it.
type Streamer = BoxService<Request<Plan>, Response<Body>, io::Error>;

/// A body-end layer over a [`Streamer`], boxed.
type MakeStreamer = Arc<dyn Fn(Streamer) -> Streamer + Send + Sync>;

/// How a streamed operation ends.
#[derive(Clone, Copy, Debug)]
enum StreamEnding {
    /// The caller reads the body to its end.
    ReadToEnd,
    /// The body fails after its frames.
    Fail,
    /// The body ends with trailers of this `grpc-status`: over gRPC it decides, over HTTP the
    /// head did (`ok`).
    Trailers(&'static str),
    /// The body panics after its frames, polled in a task of its own.
    Panic,
    /// The body chooses `timeout` with `set_outcome` after its frames, then ends.
    SetTimeout,
    /// An error head: `500` and the frames over HTTP, a trailers-only `grpc-status` 13 over gRPC.
    HeadError,
    /// The service fails before any head, after one gap.
    ServiceError,
    /// The caller reads this many frames (at most all of them), waits this many ms, and drops
    /// the body.
    DropAfter(usize, u64),
    /// The caller gives up on the whole exchange this many ms after it arrived.
    GiveUpAfter(u64),
}

#[derive(Clone, Copy, Debug)]
struct StreamOp {
    arrival_ms: u64,
    frames: usize,
    /// Between two frames, before the first and before the end.
    gap_ms: u64,
    ending: StreamEnding,
    grpc: bool,
}

fn stream_ending() -> impl Strategy<Value = StreamEnding> {
    prop_oneof![
        2 => Just(StreamEnding::ReadToEnd),
        1 => Just(StreamEnding::Fail),
        1 => prop_oneof![Just("0"), Just("1"), Just("4"), Just("13")]
            .prop_map(StreamEnding::Trailers),
        1 => Just(StreamEnding::Panic),
        1 => Just(StreamEnding::SetTimeout),
        1 => Just(StreamEnding::HeadError),
        1 => Just(StreamEnding::ServiceError),
        1 => (0..6usize, 0..10u64).prop_map(|(read, wait)| StreamEnding::DropAfter(read, wait)),
        1 => (0..60u64).prop_map(StreamEnding::GiveUpAfter),
    ]
}

fn stream_op() -> impl Strategy<Value = StreamOp> {
    (0..40u64, 0..5usize, 0..6u64, stream_ending(), any::<bool>()).prop_map(
        |(arrival_ms, frames, gap_ms, ending, grpc)| StreamOp {
            arrival_ms,
            frames,
            gap_ms,
            ending,
            grpc,
        },
    )
}

/// The request of a streamed operation.
struct Plan {
    op: StreamOp,
    /// When the service was called: the operation's admission.
    admitted: Admission,
    /// Counts the service and then its body as running, until the body shows its end.
    load: Arc<Load>,
}

/// What the body has left to send.
struct Streaming {
    frames: usize,
    gap: Duration,
    ending: StreamEnding,
    /// Dropped before the body shows its end, so that the count never includes a body whose
    /// operation may have ended.
    running: Option<LoadGuard>,
}

fn stream_body(streaming: Streaming) -> Body {
    let frames = futures_util::stream::unfold(Some(streaming), |state| async move {
        let mut state = state?;
        tokio::time::sleep(state.gap).await;
        if state.frames > 0 {
            state.frames -= 1;
            return Some((Ok(Frame::data(Bytes::from_static(b"chunk"))), Some(state)));
        }
        drop(state.running.take());
        let last = match state.ending {
            StreamEnding::Fail => Err(io::Error::other("the body broke")),
            StreamEnding::Trailers(code) => {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static(code));
                Ok(Frame::trailers(trailers))
            }
            StreamEnding::Panic => panic!("{EXPECTED_PANIC}: the body broke"),
            StreamEnding::SetTimeout => {
                assert!(
                    set_outcome(Outcome::Timeout),
                    "set_outcome outside the body"
                );
                return None;
            }
            _ => return None,
        };
        Some((last, None))
    });
    StreamBody::new(frames).boxed_unsync()
}

/// The streaming service.
fn streamer(grpc: bool) -> Streamer {
    BoxService::new(service_fn(move |request: Request<Plan>| {
        let plan = request.into_body();
        *plan.admitted.lock().unwrap() = Some(Instant::now());
        let running = plan.load.enter();
        let op = plan.op;
        async move {
            let mut response = Response::new(Body::default());
            match op.ending {
                StreamEnding::ServiceError => {
                    tokio::time::sleep(ms(op.gap_ms)).await;
                    return Err(io::Error::other("the service failed"));
                }
                StreamEnding::HeadError if grpc => {
                    // Trailers-only: the head decides, and the empty body ends the operation.
                    response
                        .headers_mut()
                        .insert("grpc-status", HeaderValue::from_static("13"));
                    return Ok(response);
                }
                StreamEnding::HeadError => {
                    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                }
                _ => {}
            }
            if grpc {
                response
                    .headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
            }
            *response.body_mut() = stream_body(Streaming {
                frames: op.frames,
                gap: ms(op.gap_ms),
                ending: op.ending,
                running: Some(running),
            });
            Ok(response)
        }
    }))
}

fn body_end<L, B>(layer: L) -> MakeStreamer
where
    L: Layer<Streamer> + Send + Sync + 'static,
    L::Service: Service<Request<Plan>, Response = Response<B>, Error = io::Error> + Send + 'static,
    <L::Service as Service<Request<Plan>>>::Future: Send + 'static,
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

/// The outcome of a `grpc-status`, as the gRPC classifier reads it.
fn grpc_outcome(code: &str) -> Outcome {
    match code {
        "0" => Outcome::Ok,
        "1" => Outcome::Cancelled,
        "4" => Outcome::Timeout,
        _ => Outcome::Error,
    }
}

/// Reads `body` to its end, and returns the outcome of the operation that ended with it: at the
/// end of the stream, its trailers or its error.
async fn drain(op: &StreamOp, mut body: Body) -> Outcome {
    let mut data = 0;
    let outcome = loop {
        match body.frame().await {
            None => break Outcome::Ok,
            Some(Err(_)) => break Outcome::Error,
            Some(Ok(frame)) => match frame.into_trailers() {
                Ok(trailers) => {
                    let code = trailers["grpc-status"].to_str().unwrap().to_owned();
                    break if op.grpc {
                        grpc_outcome(&code)
                    } else {
                        Outcome::Ok
                    };
                }
                Err(_) => data += 1,
            },
        }
    };
    match op.ending {
        StreamEnding::HeadError if op.grpc => assert_eq!(data, 0),
        _ => assert_eq!(data, op.frames, "{op:?}"),
    }
    match op.ending {
        StreamEnding::Fail | StreamEnding::HeadError => Outcome::Error,
        StreamEnding::SetTimeout => Outcome::Timeout,
        _ => outcome,
    }
}

/// Runs one streamed operation and says what became of it.
async fn run_stream(
    op: StreamOp,
    http: MakeStreamer,
    grpc: MakeStreamer,
    load: Arc<Load>,
) -> Record {
    tokio::time::sleep(ms(op.arrival_ms)).await;
    let arrived = Instant::now();
    let series = if op.grpc { JUDGE } else { VERIFY };
    let make = if op.grpc { grpc } else { http };
    let admitted: Admission = Arc::default();
    let service = make(streamer(op.grpc));
    let request = Request::new(Plan {
        op,
        admitted: Arc::clone(&admitted),
        load,
    });
    let fate = match op.ending {
        StreamEnding::ServiceError => {
            let error = service.oneshot(request).await.unwrap_err();
            assert_eq!(error.to_string(), "the service failed");
            Fate::Ended(Outcome::Error)
        }
        StreamEnding::Panic => {
            let polled = tokio::task::spawn_local(async move {
                let body = service.oneshot(request).await.unwrap().into_body();
                drain(&op, body).await
            });
            let joined = polled.await.expect_err("the body panicked");
            assert!(joined.is_panic());
            Fate::Ended(Outcome::Crashed)
        }
        StreamEnding::DropAfter(read, wait) => {
            let mut body = service.oneshot(request).await.unwrap().into_body();
            for _ in 0..read.min(op.frames) {
                assert!(body.frame().await.unwrap().unwrap().is_data());
            }
            tokio::time::sleep(ms(wait)).await;
            drop(body);
            Fate::Ended(Outcome::Cancelled)
        }
        StreamEnding::GiveUpAfter(after) => {
            let whole = async {
                let response = service.oneshot(request).await.unwrap();
                drain(&op, response.into_body()).await
            };
            match tokio::time::timeout(ms(after), whole).await {
                Ok(outcome) => Fate::Ended(outcome),
                Err(_) if admitted.lock().unwrap().is_some() => Fate::Ended(Outcome::Cancelled),
                Err(_) => Fate::Abandoned,
            }
        }
        _ => {
            let response = service.oneshot(request).await.unwrap();
            Fate::Ended(drain(&op, response.into_body()).await)
        }
    };
    let admitted = *admitted.lock().unwrap();
    Record {
        series,
        arrived,
        admitted,
        fate,
        at: Instant::now(),
    }
}

/// Runs one schedule of streamed operations on a fresh paused runtime and checks the books, the
/// sums (each run ends when its body does), the live counts, the permits and the peak load.
fn check_streams(capacity: usize, ops: &[StreamOp]) -> Result<(), TestCaseError> {
    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let limit = Limit::new(capacity);
    let http = body_end(
        ResourcesOperationLayer::with_limit_for_http(limit.clone())
            .operation(VERIFY.0)
            .executor(VERIFY.1)
            .metrics(telemetry.metrics.clone())
            .until_body_end(),
    );
    let grpc = body_end(
        ResourcesOperationLayer::with_limit_for_grpc(limit.clone())
            .operation(JUDGE.0)
            .executor(JUDGE.1)
            .metrics(telemetry.metrics.clone())
            .until_body_end(),
    );
    let load = Arc::new(Load::default());

    let runtime = paused_runtime();
    let local = tokio::task::LocalSet::new();
    let records = local.block_on(&runtime, async {
        let tasks: Vec<_> = ops
            .iter()
            .map(|op| {
                let run = run_stream(*op, Arc::clone(&http), Arc::clone(&grpc), Arc::clone(&load));
                tokio::task::spawn_local(run)
            })
            .collect();
        tokio::time::timeout(NEVER, async {
            let mut records = Vec::new();
            for task in tasks {
                records.push(task.await.unwrap());
            }
            records
        })
        .await
        .expect("the schedule never finished")
    });

    check_limit(&Shared::Limit(limit), capacity, &load)?;
    let measured = books_of(&records, &BTreeMap::new())?;
    prop_assert_eq!(measured.books.asked_total(), ops.len() as u64);
    prop_assert_eq!(
        measured.books.rejected.len(),
        0,
        "nothing bounds these waits"
    );
    check_metrics(&telemetry, &measured)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_of_streamed_bodies_runs_each_operation_from_admission_to_the_end_of_its_body(
        limit in 1usize..=3,
        ops in proptest::collection::vec(stream_op(), 1..=24),
    ) {
        check_streams(limit, &ops)?;
    }
}

/// One fixed schedule of streamed operations with every ending, over both protocols.
#[test]
fn a_fixed_schedule_of_streamed_bodies_with_every_ending_balances_the_books() {
    let endings = [
        StreamEnding::ReadToEnd,
        StreamEnding::Fail,
        StreamEnding::Trailers("0"),
        StreamEnding::Trailers("4"),
        StreamEnding::Trailers("13"),
        StreamEnding::Panic,
        StreamEnding::SetTimeout,
        StreamEnding::HeadError,
        StreamEnding::ServiceError,
        StreamEnding::DropAfter(1, 3),
        StreamEnding::GiveUpAfter(2),
        StreamEnding::GiveUpAfter(12),
    ];
    let ops: Vec<StreamOp> = (0..48)
        .map(|i| StreamOp {
            arrival_ms: (i % 5) as u64,
            frames: i % 4,
            gap_ms: 1 + (i % 3) as u64,
            ending: endings[i % endings.len()],
            grpc: (i / endings.len()) % 2 == 1,
        })
        .collect();
    check_streams(2, &ops).unwrap();
}
