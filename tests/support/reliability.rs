//! Shared by the reliability tests (`stress`, `properties`, `soak`, `cardinality`, `faults`):
//! the books the test side keeps of what became of each operation that asked for a permit
//! (admitted and ended with an outcome, rejected for a reason, or abandoned), read against what
//! the metrics exported, a concurrency gauge for the inner work, and a panic hook that keeps the
//! thousands of deliberate panics out of the output; a limit of the tests' own, a [`Pool`]; and
//! the one driver that `stress` (thousands of operations on a multi-threaded runtime) and
//! `properties` (random schedules on paused time) both run operations with: every way an
//! operation can end, through layers and through `resources_operation`, on any kind of limit
//! ([`run`]), and every way a streamed body can end its operation ([`run_stream`]).
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::util::BoxService;
use tower::{service_fn, Layer, Service, ServiceExt as _};

use tower_resources_operation::classify::TimeoutClassifier;
use tower_resources_operation::limit::Capacity;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
    REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::protocol::RejectAsError;
use tower_resources_operation::{
    set_outcome, Acquire, AtBodyEnd, Executor, IntoLimit, Limit, Operation, OperationMetrics,
    Outcome, Rejected, Rejection, ResourcesOperationLayer,
};

use super::{self as support, Telemetry};

/// Every deliberate panic of these tests carries this text; the hook below keeps them quiet.
pub const EXPECTED_PANIC: &str = "expected test panic";

/// What the crate's panic says when a limit was closed under the callers of a layer that cannot
/// answer (a closed [`Limit`]'s waiters and later callers end with it there; elsewhere they are
/// turned away as `unavailable`); the message also names the limit's type.
///
/// [`Limit`]: tower_resources_operation::Limit
pub const LIMIT_CLOSED_PANIC: &str = "cannot admit any operation: the limit is closed";

/// Whether the hook also keeps [`LIMIT_CLOSED_PANIC`]s quiet.
static QUIET_CLOSED_LIMITS: AtomicBool = AtomicBool::new(false);

/// Installs (once per test binary) a panic hook that drops the report of panics whose message
/// contains [`EXPECTED_PANIC`] and hands every other panic to the default hook.
pub fn quiet_expected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = support::panic_message(info.payload());
            if message.contains(EXPECTED_PANIC)
                || (QUIET_CLOSED_LIMITS.load(Ordering::Relaxed)
                    && message.contains(LIMIT_CLOSED_PANIC))
            {
                return;
            }
            default(info);
        }));
    });
}

/// [`quiet_expected_panics`], and the panics of callers of a closed limit too: for a test that
/// closes a limit on purpose and checks each of those panics itself.
pub fn quiet_closed_limit_panics() {
    QUIET_CLOSED_LIMITS.store(true, Ordering::Relaxed);
    quiet_expected_panics();
}

/// One (operation, executor) series.
pub type Series = (Operation, Executor);

/// What became of the operations that asked for a permit, per series: how many were admitted,
/// how many of those ended with each outcome, how many were turned away for each reason, and how
/// many were abandoned (their caller went away while they waited, or their limit failed under
/// them).
///
/// The test side fills one from what each caller saw; [`Books::exported`] fills one from the
/// metrics. Both must be equal: nothing lost, nothing counted twice, nothing counted as
/// something else.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Books {
    /// Queue-duration samples per series: one per admitted operation.
    pub admitted: BTreeMap<Series, u64>,
    /// Duration samples per series and outcome: one per admitted operation, when it ended.
    pub ended: BTreeMap<(Operation, Executor, Outcome), u64>,
    /// `gym.resources.operation.rejected` per series and reason: one per operation turned away.
    pub rejected: BTreeMap<(Series, Rejection), u64>,
    /// `gym.resources.operation.abandoned` per series: one per operation given up while it
    /// waited, or after it got its permit but before it was called.
    pub abandoned: BTreeMap<Series, u64>,
}

impl Books {
    /// An operation of `series` was admitted and ended as `outcome`.
    pub fn ended(&mut self, series: Series, outcome: Outcome) {
        *self.admitted.entry(series).or_default() += 1;
        *self.ended.entry((series.0, series.1, outcome)).or_default() += 1;
    }

    /// An operation of `series` was turned away, for `rejection`.
    pub fn rejected(&mut self, series: Series, rejection: Rejection) {
        *self.rejected.entry((series, rejection)).or_default() += 1;
    }

    /// An operation of `series` was abandoned while it waited for its permit.
    pub fn abandoned(&mut self, series: Series) {
        *self.abandoned.entry(series).or_default() += 1;
    }

    /// Records what became of one operation of `series`.
    pub fn record(&mut self, series: Series, fate: Fate) {
        match fate {
            Fate::Ended(outcome) => self.ended(series, outcome),
            Fate::Rejected(rejection) => self.rejected(series, rejection),
            Fate::Abandoned => self.abandoned(series),
        }
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &Books) {
        for (series, n) in &other.admitted {
            *self.admitted.entry(*series).or_default() += n;
        }
        for (key, n) in &other.ended {
            *self.ended.entry(*key).or_default() += n;
        }
        for (key, n) in &other.rejected {
            *self.rejected.entry(*key).or_default() += n;
        }
        for (series, n) in &other.abandoned {
            *self.abandoned.entry(*series).or_default() += n;
        }
    }

    /// Operations that ended as `outcome`, over every series.
    pub fn outcome_total(&self, outcome: Outcome) -> u64 {
        self.ended
            .iter()
            .filter(|((_, _, o), _)| *o == outcome)
            .map(|(_, n)| n)
            .sum()
    }

    /// Admitted operations, over every series.
    pub fn admitted_total(&self) -> u64 {
        self.admitted.values().sum()
    }

    /// Operations turned away for `rejection`, over every series.
    pub fn rejected_total(&self, rejection: Rejection) -> u64 {
        self.rejected
            .iter()
            .filter(|((_, r), _)| *r == rejection)
            .map(|(_, n)| n)
            .sum()
    }

    /// Abandoned operations, over every series.
    pub fn abandoned_total(&self) -> u64 {
        self.abandoned.values().sum()
    }

    /// Operations that asked for a permit, over every series: admitted, rejected or abandoned.
    pub fn asked_total(&self) -> u64 {
        self.admitted_total() + self.rejected.values().sum::<u64>() + self.abandoned_total()
    }

    /// Operations of `series` that asked for a permit.
    pub fn asked(&self, series: Series) -> u64 {
        self.admitted.get(&series).copied().unwrap_or(0)
            + self
                .rejected
                .iter()
                .filter(|((s, _), _)| *s == series)
                .map(|(_, n)| n)
                .sum::<u64>()
            + self.abandoned.get(&series).copied().unwrap_or(0)
    }

    /// What the two histograms and the two counters exported, as books. Panics on an attribute
    /// value that is not one of the seed's strings, or a point without the expected attribute
    /// keys. Counters at 0 (a series that was never turned away) are left out, as the test side
    /// never writes a 0.
    pub fn exported(telemetry: &Telemetry) -> Books {
        let exported = telemetry.collect();
        let mut books = Books::default();
        for metric in &exported {
            match &metric.data {
                support::Data::Histogram(points) => {
                    for point in points {
                        if point.count == 0 {
                            continue;
                        }
                        let operation: Operation =
                            attribute(&point.attributes, OPERATION_ATTRIBUTE);
                        let executor: Executor = attribute(&point.attributes, EXECUTOR_ATTRIBUTE);
                        if metric.name == QUEUE_DURATION_INSTRUMENT {
                            assert_eq!(point.attributes.len(), 2, "{point:?}");
                            *books.admitted.entry((operation, executor)).or_default() +=
                                point.count;
                        } else if metric.name == DURATION_INSTRUMENT {
                            assert_eq!(point.attributes.len(), 3, "{point:?}");
                            let outcome: Outcome = attribute(&point.attributes, OUTCOME_ATTRIBUTE);
                            *books
                                .ended
                                .entry((operation, executor, outcome))
                                .or_default() += point.count;
                        }
                    }
                }
                support::Data::Sum { monotonic, points }
                    if metric.name == REJECTED_INSTRUMENT
                        || metric.name == ABANDONED_INSTRUMENT =>
                {
                    assert!(monotonic, "{} is a counter", metric.name);
                    for point in points {
                        assert!(point.value >= 0, "{} {point:?}", metric.name);
                        if point.value == 0 {
                            continue;
                        }
                        let count = point.value as u64;
                        let operation: Operation =
                            attribute(&point.attributes, OPERATION_ATTRIBUTE);
                        let executor: Executor = attribute(&point.attributes, EXECUTOR_ATTRIBUTE);
                        if metric.name == REJECTED_INSTRUMENT {
                            assert_eq!(point.attributes.len(), 3, "{point:?}");
                            let rejection: Rejection =
                                attribute(&point.attributes, REJECTION_ATTRIBUTE);
                            *books
                                .rejected
                                .entry(((operation, executor), rejection))
                                .or_default() += count;
                        } else {
                            assert_eq!(point.attributes.len(), 2, "{point:?}");
                            *books.abandoned.entry((operation, executor)).or_default() += count;
                        }
                    }
                }
                _ => {}
            }
        }
        books
    }
}

/// What became of one operation that asked for a permit: exactly one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fate {
    /// Admitted, then ended with this outcome.
    Ended(Outcome),
    /// Turned away without a permit, for this reason.
    Rejected(Rejection),
    /// Its caller went away while it waited.
    Abandoned,
}

/// The attribute `key` of a point, parsed; panics if it is missing or not one of NeMo Gym's strings.
fn attribute<T>(attributes: &support::Attributes, key: &str) -> T
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let value = attributes
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in {attributes:?}"));
    value
        .parse()
        .unwrap_or_else(|e| panic!("{key}={value:?} is not one of NeMo Gym's values: {e}"))
}

/// Asserts that the metrics' books are `expected`, exactly: admitted, ended by outcome,
/// rejected by reason and abandoned, per series.
pub fn assert_books(telemetry: &Telemetry, expected: &Books) {
    let exported = Books::exported(telemetry);
    assert_eq!(
        exported.ended, expected.ended,
        "duration samples per (operation, executor, outcome): exported (left) vs what the \
         operations did (right)"
    );
    assert_eq!(
        exported.admitted, expected.admitted,
        "queue-duration samples per (operation, executor): exported (left) vs admitted (right)"
    );
    assert_eq!(
        exported.rejected, expected.rejected,
        "rejections per ((operation, executor), reason): exported (left) vs turned away (right)"
    );
    assert_eq!(
        exported.abandoned, expected.abandoned,
        "abandoned waits per (operation, executor): exported (left) vs given up (right)"
    );
}

/// Every exported point of `queued` and `active`, as `(instrument, attributes, value)`.
pub fn live_points(telemetry: &Telemetry) -> Vec<(String, support::Attributes, i64)> {
    telemetry
        .collect()
        .into_iter()
        .filter(|m| m.name == QUEUED_INSTRUMENT || m.name == ACTIVE_INSTRUMENT)
        .flat_map(|m| match m.data {
            support::Data::Sum { points, .. } => points
                .into_iter()
                .map(|p| (m.name.clone(), p.attributes, p.value))
                .collect::<Vec<_>>(),
            other => panic!("{} is not an i64 sum: {other:?}", m.name),
        })
        .collect()
}

/// Asserts that every live count reads 0.
pub fn assert_live_counts_zero(telemetry: &Telemetry) {
    let points = live_points(telemetry);
    for (name, attributes, value) in &points {
        assert_eq!(*value, 0, "{name} {attributes:?} (all: {points:?})");
    }
}

/// How many inner services run now, and the most that ever ran at once.
#[derive(Debug, Default)]
pub struct Load {
    running: AtomicUsize,
    max: AtomicUsize,
}

impl Load {
    /// Counts one inner service as running until the guard drops.
    pub fn enter(self: &Arc<Self>) -> LoadGuard {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        LoadGuard(Arc::clone(self))
    }

    /// The most that ever ran at once.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    /// How many run now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

/// One running inner service of a [`Load`].
#[derive(Debug)]
pub struct LoadGuard(Arc<Load>);

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A small deterministic generator (xorshift64*), so a run's mix is the same every time.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A limit of the tests' own: a pool of `size` reusable resources, whose permit is one of them,
/// checked out, and returned to the pool when the permit drops. It only implements `acquire`,
/// so every operation on it goes through the trait's slow path.
#[derive(Clone)]
pub struct Pool(Arc<PoolState>);

struct PoolState {
    places: Arc<Semaphore>,
    free: Mutex<Vec<usize>>,
    lent: Vec<AtomicBool>,
    /// Resources handed out twice, or places with no resource: must stay 0.
    violations: AtomicUsize,
    capacity: Capacity,
}

/// A resource of a [`Pool`], checked out.
pub struct PoolPermit {
    pool: Arc<PoolState>,
    resource: usize,
    // Dropped after `drop` below has put the resource back, so the next holder of the place
    // finds a free resource.
    _place: OwnedSemaphorePermit,
}

impl Pool {
    pub fn new(size: usize) -> Self {
        Self(Arc::new(PoolState {
            places: Arc::new(Semaphore::new(size)),
            free: Mutex::new((0..size).collect()),
            lent: (0..size).map(|_| AtomicBool::new(false)).collect(),
            violations: AtomicUsize::new(0),
            capacity: Capacity::fixed(size),
        }))
    }

    /// Resources not checked out now.
    pub fn available(&self) -> usize {
        self.0.places.available_permits()
    }

    /// Every resource is back, and none was ever handed out twice.
    pub fn assert_all_back(&self) {
        let pool = &self.0;
        assert_eq!(
            pool.violations.load(Ordering::SeqCst),
            0,
            "the pool was misused"
        );
        assert_eq!(pool.free.lock().unwrap().len(), pool.lent.len());
        assert!(pool.lent.iter().all(|lent| !lent.load(Ordering::SeqCst)));
    }
}

impl Acquire for Pool {
    type Permit = PoolPermit;

    fn acquire(&self) -> impl Future<Output = Result<PoolPermit, Rejected>> + Send {
        let pool = Arc::clone(&self.0);
        async move {
            let place = Arc::clone(&pool.places)
                .acquire_owned()
                .await
                .map_err(|_| Rejected::closed())?;
            let resource = pool.free.lock().unwrap().pop();
            let Some(resource) = resource else {
                pool.violations.fetch_add(1, Ordering::SeqCst);
                return Err(Rejected::failed("a place of the pool without a resource"));
            };
            if pool.lent[resource].swap(true, Ordering::SeqCst) {
                pool.violations.fetch_add(1, Ordering::SeqCst);
            }
            Ok(PoolPermit {
                pool,
                resource,
                _place: place,
            })
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.0.capacity.clone())
    }
}

impl Drop for PoolPermit {
    fn drop(&mut self) {
        // A permit's drop must not panic: a misuse is counted, and asserted on at the end.
        if !self.pool.lent[self.resource].swap(false, Ordering::SeqCst) {
            self.pool.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.pool.free.lock().unwrap().push(self.resource);
    }
}

/// The attributes of `series`, to filter exported points with.
pub fn series_attributes((operation, executor): Series) -> [(&'static str, &'static str); 2] {
    [
        (OPERATION_ATTRIBUTE, operation.as_str()),
        (EXECUTOR_ATTRIBUTE, executor.as_str()),
    ]
}

/// What the observable instrument `instrument` (a live count, the limit gauge) reads for
/// `series`.
pub fn live_count(telemetry: &Telemetry, instrument: &str, series: Series) -> i64 {
    telemetry.live_value(instrument, &series_attributes(series))
}

// ---------------------------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------------------------

/// Runs for `duration` on the clock; a yield to the scheduler if it is 0.
pub async fn pause(duration: Duration) {
    if duration.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(duration).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The work of an operation, and the ways to a limit
// ---------------------------------------------------------------------------------------------

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inner service every operation runs, whatever its route; also what a layer makes of it.
pub type Inner = BoxService<Work, String, BoxError>;

/// A layer of some limit over an [`Inner`], boxed: layers of different limits, classifiers and
/// protocols have different types.
pub type MakeService = Arc<dyn Fn(Inner) -> Inner + Send + Sync>;

/// What the caller of one operation awaits, whichever way it reaches its limit.
pub type Answer = Pin<Box<dyn Future<Output = Result<String, BoxError>> + Send>>;

/// `resources_operation` on some limit, for some series, around a piece of work.
type ScopedCall = Arc<
    dyn Fn(
            Answer,
        )
            -> Pin<Box<dyn Future<Output = Result<Result<String, BoxError>, Rejected>> + Send>>
        + Send
        + Sync,
>;

/// When the operation got its permit, if it did: a layer first polls its inner service ready
/// once it holds its permit (and never for an operation it turned away), and
/// `resources_operation` runs its work once it holds it.
pub type Admission = Arc<Mutex<Option<Instant>>>;

fn admit(admission: &Admission) {
    admission.lock().unwrap().get_or_insert_with(Instant::now);
}

pub fn admitted_at(admission: &Admission) -> Option<Instant> {
    *admission.lock().unwrap()
}

/// What the inner service does with one request.
pub enum Work {
    /// Runs this long ([`pause`]), then ends as the [`Then`] says.
    Run(Duration, Then),
    /// Panics in `call`, before any future exists.
    PanicInCall,
    /// Says it started (if asked), then never finishes: only a drop or a timeout ends it.
    Hang(Option<oneshot::Sender<()>>),
    /// Says it started, then waits for the gate to open and answers `"gate"`.
    Gate {
        started: mpsc::UnboundedSender<()>,
        open: watch::Receiver<bool>,
    },
}

/// How a [`Work::Run`] ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    /// Answers `Ok("ok")`.
    Ok,
    /// Answers `Err("boom")`.
    Err,
    /// Panics.
    Panic,
    /// Chooses `timeout` with `set_outcome`, then answers `Ok("set")`.
    SetTimeout,
    /// Chooses `ok` with `set_outcome` before it runs, then answers `Err("boom")`: the choice
    /// holds across polls.
    SetOkThenErr,
}

/// The inner service; counts itself on `load` from its call until its future ends, when given
/// one.
pub fn inner(load: Option<Arc<Load>>) -> Inner {
    BoxService::new(service_fn(move |work: Work| {
        let guard = load.as_ref().map(Load::enter);
        if let Work::PanicInCall = &work {
            panic!("{EXPECTED_PANIC}: in call");
        }
        async move {
            let _guard = guard;
            match work {
                Work::Run(run, then) => {
                    if then == Then::SetOkThenErr {
                        assert!(set_outcome(Outcome::Ok), "set_outcome outside the work");
                    }
                    pause(run).await;
                    match then {
                        Then::Ok => Ok("ok".to_owned()),
                        Then::Err | Then::SetOkThenErr => Err::<_, BoxError>("boom".into()),
                        Then::Panic => panic!("{EXPECTED_PANIC}: in poll"),
                        Then::SetTimeout => {
                            assert!(
                                set_outcome(Outcome::Timeout),
                                "set_outcome outside the work"
                            );
                            Ok("set".to_owned())
                        }
                    }
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
                Work::PanicInCall => unreachable!(),
            }
        }
    }))
}

/// The inner service under tower's `Timeout` of `deadline`, counted on `load` around the
/// timeout: when the timeout fires, its future (and the work inside) is gone before the layer
/// outside sees the answer and gives the permit back, so the count never includes work whose
/// permit is back.
pub fn timed(deadline: Duration, load: Option<Arc<Load>>) -> Inner {
    let mut timeout = tower::timeout::Timeout::new(inner(None), deadline);
    BoxService::new(service_fn(move |work: Work| {
        let guard = load.as_ref().map(Load::enter);
        // The inner service is always ready: a `service_fn`.
        let answer = timeout.call(work);
        async move {
            let _guard = guard;
            answer.await
        }
    }))
}

/// Notes the [`Admission`] when the layer first polls it ready.
struct Probe {
    inner: Inner,
    admitted: Admission,
}

impl Service<Work> for Probe {
    type Response = String;
    type Error = BoxError;
    type Future = <Inner as Service<Work>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        admit(&self.admitted);
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, work: Work) -> Self::Future {
        self.inner.call(work)
    }
}

/// How the test reaches a limit: through a layer, or with `resources_operation`.
#[derive(Clone)]
pub enum Route {
    Layer(MakeService),
    Scoped(ScopedCall),
}

impl Route {
    /// One operation: `work` run by `inner`, through this route, with its admission noted. A
    /// rejection comes back as a `BoxError` holding [`Rejected`], whichever the route.
    pub fn serve(&self, inner: Inner, work: Work, admitted: &Admission) -> Answer {
        match self {
            Route::Layer(make) => Box::pin(layer_over(make, inner, admitted).oneshot(work)),
            Route::Scoped(scoped) => {
                let admitted = Arc::clone(admitted);
                let work: Answer = Box::pin(async move {
                    admit(&admitted);
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

/// `inner` under `make`, with its admission noted.
fn layer_over(make: &MakeService, inner: Inner, admitted: &Admission) -> Inner {
    make(BoxService::new(Probe {
        inner,
        admitted: Arc::clone(admitted),
    }))
}

/// `layer` as a [`Route`].
pub fn layered<L>(layer: L) -> Route
where
    L: Layer<Inner> + Send + Sync + 'static,
    L::Service: Service<Work, Response = String, Error = BoxError> + Send + 'static,
    <L::Service as Service<Work>>::Future: Send + 'static,
{
    Route::Layer(Arc::new(move |inner| BoxService::new(layer.layer(inner))))
}

/// How `resources_operation` is given its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// By value (a clone per operation).
    Owned,
    /// By reference (`&Limit`, `&Semaphore`, `&Pool`), borrowed inside the operation's future.
    Borrowed,
}

fn scoped_call<F, Fut>(call: F) -> Route
where
    F: Fn(Answer) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Result<String, BoxError>, Rejected>> + Send + 'static,
{
    Route::Scoped(Arc::new(move |work| Box::pin(call(work))))
}

/// `resources_operation` on `limit`, passed as `pass` says, for `series`, as a [`Route`].
pub fn scoped<A>(limit: A, series: Series, metrics: &OperationMetrics, pass: Pass) -> Route
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send + Sync,
{
    let metrics = metrics.clone();
    scoped_call(move |work| {
        let (limit, metrics) = (limit.clone(), metrics.clone());
        async move {
            let (operation, executor) = series;
            match pass {
                Pass::Owned => {
                    metrics
                        .resources_operation(limit, operation, executor, work)
                        .await
                }
                Pass::Borrowed => {
                    metrics
                        .resources_operation(&limit, operation, executor, work)
                        .await
                }
            }
        }
    })
}

/// `resources_operation` on a `&Semaphore` (its own `Acquire`, whose permit borrows it), for
/// `series`, as a [`Route`].
fn scoped_on_semaphore(
    semaphore: Arc<Semaphore>,
    series: Series,
    metrics: &OperationMetrics,
) -> Route {
    let metrics = metrics.clone();
    scoped_call(move |work| {
        let (semaphore, metrics) = (Arc::clone(&semaphore), metrics.clone());
        async move {
            metrics
                .resources_operation(&*semaphore, series.0, series.1, work)
                .await
        }
    })
}

/// A layer on `limit` (a number or any `Acquire`) for `series`, with tower's and tokio's
/// `Elapsed` as `timeout`.
pub fn layer_on<T: IntoLimit>(
    limit: T,
    series: Series,
    metrics: &OperationMetrics,
) -> ResourcesOperationLayer<TimeoutClassifier, T::Limit>
where
    T::Limit: Clone,
{
    ResourcesOperationLayer::new(limit)
        .classifier(TimeoutClassifier::new())
        .operation(series.0)
        .executor(series.1)
        .metrics(metrics.clone())
}

/// How a layer's operations wait for their limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waits {
    /// As long as it takes; the layer cannot answer a rejection (tower's semantics).
    Unbounded,
    /// As the limit says; the layer answers a rejection with the service's error.
    Answered,
    /// At most this long; the layer answers a rejection with the service's error.
    AtMost(Duration),
}

/// A layer on `limit` for `series` whose operations wait as `waits` says, as a [`Route`].
pub fn layer_route<A>(limit: A, series: Series, metrics: &OperationMetrics, waits: Waits) -> Route
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send + 'static,
{
    let layer = layer_on(limit, series, metrics);
    match waits {
        Waits::Unbounded => layered(layer),
        Waits::Answered => layered(layer.protocol(RejectAsError)),
        Waits::AtMost(timeout) => layered(layer.protocol(RejectAsError).queue_timeout(timeout)),
    }
}

// ---------------------------------------------------------------------------------------------
// The kinds of limit
// ---------------------------------------------------------------------------------------------

/// The kinds of [`AnyLimit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Limit,
    Semaphore,
    Pool,
}

/// Every [`LimitKind`].
pub const LIMIT_KINDS: [LimitKind; 3] = [LimitKind::Limit, LimitKind::Semaphore, LimitKind::Pool];

/// A limit of one kind or another.
#[derive(Clone)]
pub enum AnyLimit {
    /// The crate's `Limit`: the one kind whose queue can be bounded.
    Limit(Limit),
    /// A tokio `Semaphore`, shared as an `Arc`.
    Semaphore(Arc<Semaphore>),
    /// A [`Pool`] of the tests' own, which implements only `Acquire::acquire`: every operation
    /// on it takes the trait's slow path.
    Pool(Pool),
}

impl AnyLimit {
    /// A limit of `kind` of `capacity`, its queue bounded at `max_queued` (only a `Limit` can
    /// be).
    pub fn new(kind: LimitKind, capacity: usize, max_queued: Option<usize>) -> Self {
        match (kind, max_queued) {
            (LimitKind::Limit, Some(max_queued)) => {
                Self::Limit(Limit::with_max_queued(capacity, max_queued))
            }
            (LimitKind::Limit, None) => Self::Limit(Limit::new(capacity)),
            (_, Some(_)) => panic!("a {kind:?} cannot bound its queue"),
            (LimitKind::Semaphore, None) => Self::Semaphore(Arc::new(Semaphore::new(capacity))),
            (LimitKind::Pool, None) => Self::Pool(Pool::new(capacity)),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Limit(_) => "Limit",
            Self::Semaphore(_) => "Arc<Semaphore>",
            Self::Pool(_) => "Pool",
        }
    }

    /// Places free now.
    pub fn available(&self) -> usize {
        match self {
            Self::Limit(limit) => limit.available(),
            Self::Semaphore(semaphore) => semaphore.available_permits(),
            Self::Pool(pool) => pool.available(),
        }
    }

    /// A layer on this limit for `series`, as a [`Route`].
    pub fn layer(&self, series: Series, metrics: &OperationMetrics, waits: Waits) -> Route {
        match self {
            Self::Limit(limit) => layer_route(limit.clone(), series, metrics, waits),
            Self::Semaphore(semaphore) => {
                layer_route(Arc::clone(semaphore), series, metrics, waits)
            }
            Self::Pool(pool) => layer_route(pool.clone(), series, metrics, waits),
        }
    }

    /// `resources_operation` on this limit for `series`, as a [`Route`].
    pub fn scoped(&self, series: Series, metrics: &OperationMetrics, pass: Pass) -> Route {
        match (self, pass) {
            (Self::Limit(limit), _) => scoped(limit.clone(), series, metrics, pass),
            (Self::Semaphore(semaphore), Pass::Owned) => {
                scoped(Arc::clone(semaphore), series, metrics, pass)
            }
            (Self::Semaphore(semaphore), Pass::Borrowed) => {
                scoped_on_semaphore(Arc::clone(semaphore), series, metrics)
            }
            (Self::Pool(pool), _) => scoped(pool.clone(), series, metrics, pass),
        }
    }

    /// Every one of its `capacity` places is free, nothing waits for it, and (a pool) no
    /// resource was misused.
    pub fn assert_idle(&self, capacity: usize) {
        assert_eq!(self.available(), capacity, "{}: places back", self.name());
        match self {
            Self::Limit(limit) => assert_eq!(limit.queued(), 0, "Limit: nothing queued"),
            Self::Semaphore(_) => {}
            Self::Pool(pool) => pool.assert_all_back(),
        }
    }
}

/// One limit, the routes to it (one per series and way), and the load of the work under it.
pub struct Limited {
    pub limit: AnyLimit,
    /// The most that may run at once under it.
    pub capacity: usize,
    pub routes: Vec<(Series, Route)>,
    pub load: Arc<Load>,
}

impl Limited {
    pub fn new(limit: AnyLimit, capacity: usize, routes: Vec<(Series, Route)>) -> Self {
        Self {
            limit,
            capacity,
            routes,
            load: Arc::default(),
        }
    }

    /// A route of this limit, picked by `rng`, with its series.
    pub fn pick(&self, rng: &mut Rng) -> (Series, Route) {
        self.routes[rng.below(self.routes.len() as u64) as usize].clone()
    }

    /// One operation of `work` through `route` (one of this limit's), counted on this limit's
    /// load, with its admission noted: what its caller awaits.
    pub fn serve(&self, route: &Route, work: Work, admitted: &Admission) -> Answer {
        route.serve(inner(Some(Arc::clone(&self.load))), work, admitted)
    }

    /// One operation through `route` (one of this limit's), counted on this limit's load.
    pub fn run(&self, op: Op, route: Route) -> impl Future<Output = Ran> + Send + 'static {
        run(op, route, Arc::clone(&self.load))
    }

    /// Every place is back, the work under it never ran above its capacity, and none runs now.
    pub fn assert_idle(&self) {
        self.limit.assert_idle(self.capacity);
        assert!(
            self.load.max() <= self.capacity,
            "{}: {} ran at once under a limit of {}",
            self.limit.name(),
            self.load.max(),
            self.capacity
        );
        assert_eq!(self.load.running(), 0, "{}", self.limit.name());
    }
}

// ---------------------------------------------------------------------------------------------
// One operation, every way it can end
// ---------------------------------------------------------------------------------------------

/// How an operation is made to end; each has exactly one possible ending once admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The work runs, then answers `Ok`.
    Ok,
    /// The work runs, then answers `Err`.
    Err,
    /// The inner service panics in `call`.
    PanicInCall,
    /// The work runs, then panics while polled.
    PanicInPoll,
    /// The work runs, chooses `timeout` with `set_outcome`, and answers `Ok`.
    SetTimeout,
    /// The work chooses `ok` with `set_outcome`, runs, and answers `Err`.
    SetOkThenErr,
    /// The work never ends; the caller drops it this long after it started.
    DropInFlight(Duration),
    /// The caller gives up this long after it asked: in the queue (abandoned), in flight
    /// (cancelled), or never, if the work ended first.
    GiveUpAfter(Duration),
    /// tower's `Timeout` of this long, inside the limit, races the work.
    TowerTimeout(Duration),
    /// `poll_ready` takes the permit; the service is dropped unused this long later (a yield,
    /// for 0). Through `resources_operation`, which has no such step, it is [`Ending::Ok`].
    ReadyUnused(Duration),
}

/// A run time no timeout in these tests waits for.
pub const FOREVER: Duration = Duration::from_secs(3600);

/// One operation: how it ends, and how long its work runs.
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub ending: Ending,
    pub run: Duration,
}

impl Op {
    /// An operation whose work ends at once (after a yield).
    pub const fn new(ending: Ending) -> Self {
        Self {
            ending,
            run: Duration::ZERO,
        }
    }
}

/// What became of one operation, and when it was admitted, if it was.
#[derive(Clone, Copy, Debug)]
pub struct Ran {
    pub fate: Fate,
    pub admitted: Option<Instant>,
}

/// The rejection a caller got, as its fate; panics if `error` is not a rejection.
pub fn rejected(error: &BoxError) -> Fate {
    match error.downcast_ref::<Rejected>() {
        Some(rejected) => Fate::Rejected(rejected.rejection()),
        None => panic!("expected a rejection, got {error}"),
    }
}

/// A panic of the work itself (or its body) is `crashed`; any other (a closed limit's) goes on.
pub fn crashed(joined: tokio::task::JoinError) -> Fate {
    let payload = joined.into_panic();
    if support::panic_message(&*payload).contains(EXPECTED_PANIC) {
        Fate::Ended(Outcome::Crashed)
    } else {
        std::panic::resume_unwind(payload)
    }
}

/// What must have become of an operation whose work was to end as `then` and whose caller got
/// `answer`.
fn answered(then: Then, answer: Result<String, BoxError>) -> Fate {
    match answer {
        Err(error) if error.is::<Rejected>() => rejected(&error),
        Ok(answer) => match then {
            Then::Ok => {
                assert_eq!(answer, "ok");
                Fate::Ended(Outcome::Ok)
            }
            Then::SetTimeout => {
                assert_eq!(answer, "set");
                Fate::Ended(Outcome::Timeout)
            }
            then => panic!("work that was to end as {then:?} answered {answer:?}"),
        },
        Err(error) => {
            assert_eq!(error.to_string(), "boom");
            match then {
                Then::Err => Fate::Ended(Outcome::Error),
                Then::SetOkThenErr => Fate::Ended(Outcome::Ok),
                then => panic!("work that was to end as {then:?} failed: {error}"),
            }
        }
    }
}

/// Runs `op` through `route`, its work counted on `load`, checks what the caller got, and says
/// what must have become of it. A limit that fails under it panics through.
pub async fn run(op: Op, route: Route, load: Arc<Load>) -> Ran {
    let ending = match (op.ending, &route) {
        (Ending::ReadyUnused(_), Route::Scoped(_)) => Ending::Ok,
        (ending, _) => ending,
    };
    let admitted: Admission = Arc::default();
    let serve = |work| route.serve(inner(Some(Arc::clone(&load))), work, &admitted);
    let work = |then| Work::Run(op.run, then);
    let fate = match ending {
        Ending::Ok => answered(Then::Ok, serve(work(Then::Ok)).await),
        Ending::Err => answered(Then::Err, serve(work(Then::Err)).await),
        Ending::SetTimeout => answered(Then::SetTimeout, serve(work(Then::SetTimeout)).await),
        Ending::SetOkThenErr => answered(Then::SetOkThenErr, serve(work(Then::SetOkThenErr)).await),
        Ending::PanicInCall | Ending::PanicInPoll => {
            let work = match ending {
                Ending::PanicInCall => Work::PanicInCall,
                _ => work(Then::Panic),
            };
            match tokio::spawn(serve(work)).await {
                Ok(Ok(answer)) => panic!("a panicking operation answered {answer:?}"),
                Ok(Err(error)) => rejected(&error),
                Err(joined) => crashed(joined),
            }
        }
        Ending::TowerTimeout(deadline) => {
            let timed = timed(deadline, Some(Arc::clone(&load)));
            match route.serve(timed, work(Then::Ok), &admitted).await {
                Err(error) if error.is::<tower::timeout::error::Elapsed>() => {
                    Fate::Ended(Outcome::Timeout)
                }
                answer => answered(Then::Ok, answer),
            }
        }
        Ending::DropInFlight(after) => {
            // Dropped only once the work has started, and the work never ends by itself.
            let (started_tx, started_rx) = oneshot::channel();
            let mut answer = serve(Work::Hang(Some(started_tx)));
            tokio::select! {
                biased;
                answer = &mut answer => match answer {
                    Ok(answer) => panic!("a hanging operation answered {answer:?}"),
                    Err(error) => rejected(&error),
                },
                started = started_rx => {
                    started.expect("the work was dropped before it started");
                    if !after.is_zero() {
                        tokio::time::sleep(after).await;
                    }
                    drop(answer);
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
        Ending::GiveUpAfter(after) => {
            match tokio::time::timeout(after, serve(work(Then::Ok))).await {
                Ok(answer) => answered(Then::Ok, answer),
                Err(_) if admitted_at(&admitted).is_some() => Fate::Ended(Outcome::Cancelled),
                Err(_) => Fate::Abandoned,
            }
        }
        Ending::ReadyUnused(after) => {
            let Route::Layer(make) = &route else {
                unreachable!("a scoped operation has no poll_ready")
            };
            let mut service = layer_over(make, inner(Some(Arc::clone(&load))), &admitted);
            service.ready().await.unwrap();
            if admitted_at(&admitted).is_some() {
                // Its caller went away before it called: its work never began.
                pause(after).await;
                drop(service);
                Fate::Abandoned
            } else {
                // Turned away: `call` answers the rejection without the inner service.
                rejected(&service.call(work(Then::Ok)).await.unwrap_err())
            }
        }
    };
    Ran {
        // An abandoned operation has no admission in the books, whenever it got its permit.
        admitted: admitted_at(&admitted).filter(|_| fate != Fate::Abandoned),
        fate,
    }
}

// ---------------------------------------------------------------------------------------------
// The body-end form: one streamed operation, every way a body can end it
// ---------------------------------------------------------------------------------------------

/// The response body of the streaming service, and of what a body-end layer makes of it.
pub type Body = UnsyncBoxBody<Bytes, io::Error>;

/// The streaming service, and what a body-end layer makes of it.
pub type Streamer = BoxService<Request<Script>, Response<Body>, io::Error>;

/// A body-end layer over a [`Streamer`], boxed.
pub type MakeStreamer = Arc<dyn Fn(Streamer) -> Streamer + Send + Sync>;

/// How a streamed operation ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnding {
    /// The caller reads the body to its end: `ok`.
    ReadToEnd,
    /// The body fails after its frames: `error`.
    Fail,
    /// The body ends with trailers of this `grpc-status`: over gRPC they decide, over HTTP the
    /// head did (`ok`).
    Trailers(&'static str),
    /// The body panics after its frames, polled in a task of its own: `crashed`.
    Panic,
    /// The body chooses `timeout` with `set_outcome` after its frames, then ends.
    SetTimeout,
    /// An error head: `500` and the frames over HTTP, a trailers-only `grpc-status` 13 with no
    /// body over gRPC: `error`.
    HeadError,
    /// The service fails before any head: `error`.
    ServiceError,
    /// The caller reads this many frames (at most all of them), waits this long, and drops the
    /// body: `cancelled`.
    DropAfter(usize, Duration),
    /// The service says it started and never answers; the caller drops the response future:
    /// `cancelled`.
    DropBeforeHead,
    /// The caller gives up on the whole exchange this long after it asked: waiting
    /// (abandoned), before the end of the body (cancelled), or never (ok).
    GiveUpAfter(Duration),
}

/// One streamed operation: its body's data frames, the gap before each frame and before the
/// end, and how it ends.
#[derive(Clone, Copy, Debug)]
pub struct StreamOp {
    pub frames: usize,
    pub gap: Duration,
    pub ending: StreamEnding,
}

/// The request of the streaming service: what to do, and what the test learns back.
pub struct Script {
    pub op: StreamOp,
    /// When the service was called: the operation's admission.
    pub admitted: Admission,
    /// Counts the service and then its body as running, until the body shows its end.
    pub load: Arc<Load>,
    /// Said once called; then the body waits for the gate before its first frame.
    pub gate: Option<(mpsc::UnboundedSender<()>, watch::Receiver<bool>)>,
    /// For [`StreamEnding::DropBeforeHead`]: said once the service hangs.
    started: Option<oneshot::Sender<()>>,
}

impl Script {
    pub fn new(op: StreamOp, load: Arc<Load>) -> Self {
        Self {
            op,
            admitted: Arc::default(),
            load,
            gate: None,
            started: None,
        }
    }
}

/// What a body has left to stream.
struct Streaming {
    frames: usize,
    gap: Duration,
    ending: StreamEnding,
    gate: Option<watch::Receiver<bool>>,
    /// Dropped before the body shows its end, so that the count never includes a body whose
    /// operation may have ended.
    running: Option<LoadGuard>,
}

fn stream_body(streaming: Streaming) -> Body {
    let frames = futures_util::stream::unfold(Some(streaming), |state| async move {
        let mut state = state?;
        if let Some(mut gate) = state.gate.take() {
            gate.wait_for(|open| *open).await.expect("gate dropped");
        }
        pause(state.gap).await;
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

/// The streaming service, over HTTP or gRPC.
fn streamer(grpc: bool) -> Streamer {
    BoxService::new(service_fn(move |request: Request<Script>| {
        let script = request.into_body();
        admit(&script.admitted);
        let running = script.load.enter();
        let op = script.op;
        async move {
            let gate = script.gate.map(|(started, open)| {
                started.send(()).expect("the test stopped listening");
                open
            });
            if let Some(started) = script.started {
                let _running = running;
                let _ = started.send(());
                return std::future::pending().await;
            }
            let mut response = Response::new(Body::default());
            if grpc {
                response
                    .headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
            }
            match op.ending {
                StreamEnding::ServiceError => {
                    pause(op.gap).await;
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
            *response.body_mut() = stream_body(Streaming {
                frames: op.frames,
                gap: op.gap,
                ending: op.ending,
                gate,
                running: Some(running),
            });
            Ok(response)
        }
    }))
}

/// `layer` (over a `Limit`, a `QueueTimeout`...) tagged with `series`, reporting through
/// `metrics`, its operations ending with their response bodies.
pub fn until_body_end<C: Clone, L: Clone, P: Clone>(
    layer: ResourcesOperationLayer<C, L, P>,
    series: Series,
    metrics: &OperationMetrics,
) -> ResourcesOperationLayer<C, L, P, AtBodyEnd> {
    layer
        .operation(series.0)
        .executor(series.1)
        .metrics(metrics.clone())
        .until_body_end()
}

/// One body-end route: its series, its layer, whether it speaks gRPC, and why it may turn an
/// operation away, if it may.
#[derive(Clone)]
pub struct StreamRoute {
    pub series: Series,
    make: MakeStreamer,
    pub grpc: bool,
    pub rejects: Option<Rejection>,
}

impl StreamRoute {
    /// An HTTP body-end layer on `limit` for `series`, as a route.
    pub fn http(limit: &Limit, series: Series, metrics: &OperationMetrics) -> Self {
        let layer = ResourcesOperationLayer::new_for_http(limit.clone());
        Self::new(series, false, until_body_end(layer, series, metrics))
    }

    /// A gRPC body-end layer on `limit` for `series`, as a route.
    pub fn grpc(limit: &Limit, series: Series, metrics: &OperationMetrics) -> Self {
        let layer = ResourcesOperationLayer::new_for_grpc(limit.clone());
        Self::new(series, true, until_body_end(layer, series, metrics))
    }

    /// `layer` over the streaming service as a route for `series`.
    pub fn new<L, B>(series: Series, grpc: bool, layer: L) -> Self
    where
        L: Layer<Streamer> + Send + Sync + 'static,
        L::Service:
            Service<Request<Script>, Response = Response<B>, Error = io::Error> + Send + 'static,
        <L::Service as Service<Request<Script>>>::Future: Send + 'static,
        B: http_body::Body<Data = Bytes, Error = io::Error> + Send + 'static,
    {
        let make: MakeStreamer = Arc::new(move |inner| {
            BoxService::new(
                layer
                    .layer(inner)
                    .map_response(|response: Response<B>| response.map(BodyExt::boxed_unsync)),
            )
        });
        Self {
            series,
            make,
            grpc,
            rejects: None,
        }
    }

    /// The same route, whose layer turns operations away for `rejection`.
    pub fn rejecting(self, rejection: Rejection) -> Self {
        Self {
            rejects: Some(rejection),
            ..self
        }
    }

    /// The layered streaming service.
    pub fn service(&self) -> Streamer {
        (self.make)(streamer(self.grpc))
    }

    /// The fate of an answer turned away, if it was: `503` over HTTP, RESOURCE_EXHAUSTED over
    /// gRPC, without calling the service.
    fn turned_away(&self, response: &Response<Body>, admitted: &Admission) -> Option<Fate> {
        let rejected = if self.grpc {
            response.headers().get("grpc-status") == Some(&HeaderValue::from_static("8"))
        } else {
            response.status() == StatusCode::SERVICE_UNAVAILABLE
        };
        if !rejected {
            return None;
        }
        let rejection = self
            .rejects
            .unwrap_or_else(|| panic!("{:?} turns nothing away, yet turned one away", self.series));
        assert!(
            admitted_at(admitted).is_none(),
            "a rejected request reached the service"
        );
        Some(Fate::Rejected(rejection))
    }
}

/// The outcome of a `grpc-status`, as the gRPC classifier reads it.
pub fn grpc_outcome(code: &str) -> Outcome {
    match code {
        "0" => Outcome::Ok,
        "1" => Outcome::Cancelled,
        "4" => Outcome::Timeout,
        _ => Outcome::Error,
    }
}

/// How a body the caller read to its end ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    End,
    Trailers(String),
    Error,
}

/// Reads `body` to its end; returns how many data frames it sent, and how it ended.
pub async fn drain(body: &mut Body) -> (usize, Drained) {
    let mut data = 0;
    loop {
        match body.frame().await {
            None => return (data, Drained::End),
            Some(Err(_)) => return (data, Drained::Error),
            Some(Ok(frame)) => match frame.into_trailers() {
                Ok(trailers) => {
                    let code = trailers["grpc-status"].to_str().unwrap().to_owned();
                    assert!(body.frame().await.is_none(), "a frame after the trailers");
                    return (data, Drained::Trailers(code));
                }
                Err(_) => data += 1,
            },
        }
    }
}

/// Reads a body to its end, and returns the outcome of the operation it ended.
async fn read_to_end(route: &StreamRoute, op: &StreamOp, body: &mut Body) -> Outcome {
    let (data, drained) = drain(body).await;
    let frames = match op.ending {
        StreamEnding::HeadError if route.grpc => 0,
        _ => op.frames,
    };
    assert_eq!(data, frames, "{op:?}");
    match (op.ending, drained) {
        (StreamEnding::ReadToEnd | StreamEnding::GiveUpAfter(_), Drained::End) => Outcome::Ok,
        (StreamEnding::Fail, Drained::Error) => Outcome::Error,
        (StreamEnding::Trailers(code), Drained::Trailers(got)) => {
            assert_eq!(got, code);
            if route.grpc {
                grpc_outcome(code)
            } else {
                Outcome::Ok
            }
        }
        (StreamEnding::SetTimeout, Drained::End) => Outcome::Timeout,
        (StreamEnding::HeadError, Drained::End) => Outcome::Error,
        (ending, drained) => panic!("{ending:?} ended as {drained:?}"),
    }
}

/// Runs one streamed operation through `route`, its service and body counted on `load`;
/// returns what must have become of it.
pub async fn run_stream(route: StreamRoute, op: StreamOp, load: Arc<Load>) -> Ran {
    let service = route.service();
    let mut script = Script::new(op, load);
    let admitted = Arc::clone(&script.admitted);
    let (started_tx, started_rx) = oneshot::channel();
    if op.ending == StreamEnding::DropBeforeHead {
        script.started = Some(started_tx);
    }
    let request = Request::new(script);
    let fate = match op.ending {
        StreamEnding::ServiceError => match service.oneshot(request).await {
            Err(error) => {
                assert_eq!(error.to_string(), "the service failed");
                Fate::Ended(Outcome::Error)
            }
            Ok(response) => route
                .turned_away(&response, &admitted)
                .expect("the failing service answered"),
        },
        StreamEnding::Panic => {
            // The body is polled in a task of its own, which the panic ends.
            let route = route.clone();
            let admitted = Arc::clone(&admitted);
            let polled = tokio::spawn(async move {
                let response = service.oneshot(request).await.unwrap();
                if let Some(fate) = route.turned_away(&response, &admitted) {
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
        StreamEnding::DropAfter(read, wait) => {
            let response = service.oneshot(request).await.unwrap();
            match route.turned_away(&response, &admitted) {
                Some(fate) => fate,
                None => {
                    let mut body = response.into_body();
                    for _ in 0..read.min(op.frames) {
                        assert!(body.frame().await.unwrap().unwrap().is_data());
                    }
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                    drop(body);
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
        StreamEnding::DropBeforeHead => {
            let answer = service.oneshot(request);
            tokio::select! {
                biased;
                answer = answer => {
                    let response = answer.expect("a hanging service answered");
                    route
                        .turned_away(&response, &admitted)
                        .expect("a hanging service answered")
                }
                started = started_rx => {
                    started.expect("the service was dropped before it started");
                    Fate::Ended(Outcome::Cancelled)
                }
            }
        }
        _ => {
            let whole = async {
                let response = service.oneshot(request).await.unwrap();
                match route.turned_away(&response, &admitted) {
                    Some(fate) => fate,
                    None => Fate::Ended(read_to_end(&route, &op, &mut response.into_body()).await),
                }
            };
            match op.ending {
                StreamEnding::GiveUpAfter(after) => {
                    match tokio::time::timeout(after, whole).await {
                        Ok(fate) => fate,
                        Err(_) if admitted_at(&admitted).is_some() => {
                            Fate::Ended(Outcome::Cancelled)
                        }
                        Err(_) => Fate::Abandoned,
                    }
                }
                _ => whole.await,
            }
        }
    };
    Ran {
        fate,
        admitted: admitted_at(&admitted),
    }
}
