//! Shared by the reliability tests (`stress`, `properties`, `soak`, `cardinality`, `faults`):
//! the books the test side keeps of what became of each operation that asked for a permit
//! (admitted and ended with an outcome, rejected for a reason, or abandoned), read against what
//! the metrics exported, a concurrency gauge for the inner work, and a panic hook that keeps the
//! thousands of deliberate panics out of the output; and a limit of the tests' own, a [`Pool`].
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tower_resources_operation::limit::AcquireError;
use tower_resources_operation::metrics::{
    Capacity, ABANDONED_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::{
    Acquire, Executor, Operation, Outcome, Rejection, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT,
    EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_INSTRUMENT,
};

use super::{self as support, Telemetry};

/// Every deliberate panic of these tests carries this text; the hook below keeps them quiet.
pub const EXPECTED_PANIC: &str = "expected test panic";

/// What the crate's panic says when a limit was closed under its callers (a closed [`Limit`]'s
/// waiters and later callers end with it); the message also names the limit's type.
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
    /// waited, or whose limit failed under it.
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
    /// Its caller went away while it waited, or its limit failed under it.
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

    fn acquire(&self) -> impl Future<Output = Result<PoolPermit, AcquireError>> + Send {
        let pool = Arc::clone(&self.0);
        async move {
            let place = Arc::clone(&pool.places)
                .acquire_owned()
                .await
                .map_err(|_| AcquireError::closed())?;
            let resource = pool.free.lock().unwrap().pop();
            let Some(resource) = resource else {
                pool.violations.fetch_add(1, Ordering::SeqCst);
                return Err(AcquireError::failed(
                    "a place of the pool without a resource",
                ));
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
