//! Limits that are user-defined `Acquire` implementations, written here as a user would: a
//! weighted semaphore, a pool of reusable resources whose permit hands the resource to the work,
//! a limit that never admits, one that fails, and one that admits slowly. Each is driven through
//! the layer and through `resources_operation`, and the crate's rules must hold with every one:
//! outcomes as the work ended, one queue and one duration sample per admitted operation, live
//! counts back to 0, turned-away and abandoned operations counted, no permit leaked, no hang.
//! Also: the crate's own limits (`Arc<Semaphore>`, `&Semaphore`, `&Limit`) in the scoped API, and
//! how a layer's service polls a limit (`poll_ready` pending, woken and ready once a permit is
//! released; a limit's failure answered as `unavailable`, or, under a layer that cannot answer,
//! a panic naming it).

mod support;

/// The example's two limits, [`Weighted`] and [`Sandboxes`], as a user would write them.
#[allow(dead_code)]
#[path = "../examples/limits.rs"]
mod limits;

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_test::{assert_pending, assert_ready_ok};
use tower::{service_fn, BoxError, Layer as _, ServiceExt as _};
use tower_test::mock;

use limits::{Checkout, Sandboxes, Weighted};
use support::{abandoned, live, panic_message, panic_of, settle, Telemetry, DEADLINE};
use tower_resources_operation::classify::DefaultClassifier;
use tower_resources_operation::limit::Capacity;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, LIMIT_INSTRUMENT,
    OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
    REJECTION_ATTRIBUTE,
};
use tower_resources_operation::protocol::RejectAsError;
use tower_resources_operation::{
    Acquire, Executor, Limit, Operation, OperationMetrics, Rejected, Rejection, ResourcesOperation,
    ResourcesOperationLayer,
};

// ---------------------------------------------------------------------------------------------
// The limits
// ---------------------------------------------------------------------------------------------

tokio::task_local! {
    /// The sandbox the current operation was handed, in the caller's task.
    static SANDBOX: Cell<Option<&'static str>>;
}

/// The example's pool of sandboxes, which also hands each checkout's sandbox to the work through
/// the caller's task-local [`SANDBOX`]: the layer and `resources_operation` hold the permit, the
/// work only runs inside it.
#[derive(Clone)]
struct HandsOver(Sandboxes);

impl HandsOver {
    fn hand_over(checkout: Checkout) -> Checkout {
        let _ = SANDBOX.try_with(|current| current.set(Some(checkout.sandbox())));
        checkout
    }

    /// The sandbox handed to the operation running in this task.
    fn current() -> Option<&'static str> {
        SANDBOX.try_with(Cell::get).ok().flatten()
    }
}

impl Acquire for HandsOver {
    type Permit = Checkout;

    fn acquire(&self) -> impl Future<Output = Result<Checkout, Rejected>> + Send {
        let checking_out = self.0.acquire();
        async move { checking_out.await.map(Self::hand_over) }
    }

    fn try_acquire(&self) -> Option<Result<Checkout, Rejected>> {
        let checked_out = self.0.try_acquire()?;
        Some(checked_out.map(Self::hand_over))
    }

    fn capacity(&self) -> Option<Capacity> {
        self.0.capacity()
    }
}

/// A limit that never admits anyone; it counts the waits it was asked for, those whose future
/// was dropped, and how often it was asked for a free place.
#[derive(Clone, Default)]
struct Never {
    asked: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
    tried: Arc<AtomicUsize>,
}

struct CountOnDrop(Arc<AtomicUsize>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl Never {
    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }

    fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }

    fn tried(&self) -> usize {
        self.tried.load(Ordering::SeqCst)
    }
}

impl Acquire for Never {
    type Permit = ();

    fn acquire(&self) -> impl Future<Output = Result<(), Rejected>> + Send {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let dropped = CountOnDrop(Arc::clone(&self.dropped));
        async move {
            let _dropped = dropped;
            std::future::pending::<Result<(), Rejected>>().await
        }
    }

    fn try_acquire(&self) -> Option<Result<(), Rejected>> {
        self.tried.fetch_add(1, Ordering::SeqCst);
        None
    }
}

/// A limit kept in a store it cannot reach: it fails, after `after`, with a detailed error (as
/// the fleet limit does: the store's address and the cause).
#[derive(Clone)]
struct Unreachable {
    after: Duration,
}

/// The detailed error of [`Unreachable`].
#[derive(Debug)]
struct StoreUnreachable {
    address: &'static str,
    cause: std::io::Error,
}

impl std::fmt::Display for StoreUnreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "store unreachable at {}", self.address)
    }
}

impl std::error::Error for StoreUnreachable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.cause)
    }
}

/// The limit's own error, found in `error`'s source: its address and its cause reach the
/// caller.
fn assert_keeps_the_limits_error(error: &Rejected) {
    use std::error::Error as _;
    let source = error.source().expect("the limit's error is the source");
    let store = source
        .downcast_ref::<StoreUnreachable>()
        .unwrap_or_else(|| panic!("not the limit's own error: {source}"));
    assert_eq!(store.address, "127.0.0.1:6390");
    assert_eq!(store.cause.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(error.to_string().contains("127.0.0.1:6390"), "{error}");
}

impl Acquire for Unreachable {
    type Permit = ();

    fn acquire(&self) -> impl Future<Output = Result<(), Rejected>> + Send {
        let after = self.after;
        async move {
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
            Err(Rejected::failed(StoreUnreachable {
                address: "127.0.0.1:6390",
                cause: std::io::ErrorKind::ConnectionRefused.into(),
            }))
        }
    }
}

/// A limit that admits slowly: each admission costs `delay` before it even asks its units (the
/// example's [`Weighted`], one unit per operation). `try_acquire` and `capacity` are left at
/// their defaults, `None`.
#[derive(Clone)]
struct Slow {
    units: Weighted,
    delay: Duration,
}

impl Slow {
    fn new(units: usize, delay_ms: u64) -> Self {
        Self {
            units: Weighted::new(units),
            delay: Duration::from_millis(delay_ms),
        }
    }
}

impl Acquire for Slow {
    type Permit = <Weighted as Acquire>::Permit;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        // The units' future asks for nothing until it is first polled, after the delay.
        let (asking, delay) = (self.units.acquire(), self.delay);
        async move {
            tokio::time::sleep(delay).await;
            asking.await
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Checks series `operation` after `ok` + `error` admitted operations: one queue and one
/// duration sample each, those outcomes, nothing turned away or abandoned, and nothing left
/// waiting or running.
fn assert_books(t: &Telemetry, operation: &str, ok: u64, error: u64) {
    let filter = [(OPERATION_ATTRIBUTE, operation)];
    assert_eq!(
        t.count(QUEUE_DURATION_INSTRUMENT, &filter),
        ok + error,
        "{operation}: one queue sample per admitted operation"
    );
    assert_eq!(
        t.count(DURATION_INSTRUMENT, &filter),
        ok + error,
        "{operation}: one duration sample per admitted operation"
    );
    let expected: BTreeMap<String, u64> = [("ok", ok), ("error", error)]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(outcome, n)| (outcome.to_owned(), n))
        .collect();
    assert_eq!(t.outcomes(&filter), expected, "{operation}: outcomes");
    assert_eq!(t.live_value(REJECTED_INSTRUMENT, &filter), 0, "{operation}");
    assert_eq!(
        t.live_value(ABANDONED_INSTRUMENT, &filter),
        0,
        "{operation}"
    );
    assert_eq!(t.live_value(QUEUED_INSTRUMENT, &filter), 0, "{operation}");
    assert_eq!(t.live_value(ACTIVE_INSTRUMENT, &filter), 0, "{operation}");
}

fn limit_of(t: &Telemetry, operation: &str) -> i64 {
    t.live_value(LIMIT_INSTRUMENT, &[(OPERATION_ATTRIBUTE, operation)])
}

/// The inner service of a layer whose limit admits no one.
fn not_called(_: ()) -> std::future::Ready<Result<(), BoxError>> {
    panic!("never admitted, never called")
}

/// Work that its limit never admits.
async fn never_run() {
    panic!("never admitted, never run")
}

/// Awaits every task: how many ended in an error.
async fn count_failed<T, E>(tasks: Vec<tokio::task::JoinHandle<Result<T, E>>>) -> u64 {
    let mut failed = 0;
    for task in tasks {
        failed += u64::from(task.await.unwrap().is_err());
    }
    failed
}

/// The most of something at once.
#[derive(Default)]
struct Peak(AtomicUsize);

impl Peak {
    fn saw(&self, now: usize) {
        self.0.fetch_max(now, Ordering::SeqCst);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------------------------
// A weighted limit
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_weighted_limit_keeps_its_units_through_the_layer_and_the_rules_hold() {
    let t = Telemetry::new();
    let units = Weighted::new(4);
    let peak = Arc::new(Peak::default());
    let work = {
        let (units, peak) = (units.clone(), Arc::clone(&peak));
        service_fn(move |job: u64| {
            peak.saw(units.in_use());
            async move {
                tokio::time::sleep(Duration::from_millis(10 + job % 7)).await;
                if job % 5 == 0 {
                    Err::<u64, BoxError>("job failed".into())
                } else {
                    Ok(job)
                }
            }
        })
    };
    let small = ResourcesOperationLayer::new(units.weighing(1))
        .operation(Operation::Tool)
        .metrics(t.metrics.clone())
        .layer(work.clone());
    let big = ResourcesOperationLayer::new(units.weighing(3))
        .operation(Operation::Tool)
        .metrics(t.metrics.clone())
        .layer(work);
    assert_eq!(
        limit_of(&t, "tool"),
        4,
        "two handles on one weighted limit report its one capacity once"
    );

    let tasks: Vec<_> = (1..=24u64)
        .map(|job| {
            if job % 3 == 0 {
                tokio::spawn(big.clone().oneshot(job))
            } else {
                tokio::spawn(small.clone().oneshot(job))
            }
        })
        .collect();
    let failed = count_failed(tasks).await;

    assert_eq!(peak.get(), 4, "the units were all used, and never more");
    assert_books(&t, "tool", 24 - failed, failed);
    assert_eq!(failed, 4);
    assert_eq!(units.in_use(), 0, "no unit leaked");
}

#[tokio::test(start_paused = true)]
async fn a_weighted_limit_keeps_its_units_through_resources_operation_and_the_rules_hold() {
    let t = Telemetry::new();
    let units = Weighted::new(4);
    let peak = Arc::new(Peak::default());
    let tasks: Vec<_> = (1..=24u64)
        .map(|job| {
            let limit = units.weighing(if job % 3 == 0 { 3 } else { 1 });
            let (metrics, units, peak) = (t.metrics.clone(), units.clone(), Arc::clone(&peak));
            tokio::spawn(async move {
                metrics
                    .resources_operation(limit, Operation::Judge, Executor::Inline, async {
                        peak.saw(units.in_use());
                        tokio::time::sleep(Duration::from_millis(10 + job % 7)).await;
                        if job % 5 == 0 {
                            Err::<u64, BoxError>("job failed".into())
                        } else {
                            Ok(job)
                        }
                    })
                    .await
                    .expect("never turned away")
            })
        })
        .collect();
    let failed = count_failed(tasks).await;
    assert_eq!(peak.get(), 4);
    assert_books(&t, "judge", 24 - failed, failed);
    assert_eq!(limit_of(&t, "judge"), 4);
    assert_eq!(units.in_use(), 0, "no unit leaked");
}

#[tokio::test(start_paused = true)]
async fn a_weighted_operation_waits_until_its_whole_weight_is_free() {
    let t = Telemetry::new();
    let units = Weighted::new(4);
    let held = units.weighing(2).try_acquire().unwrap().unwrap();
    let big = ResourcesOperationLayer::new(units.weighing(3))
        .operation(Operation::Verify)
        .metrics(t.metrics.clone())
        .layer(service_fn(|()| async { Ok::<_, BoxError>(()) }));
    let waiting = tokio::spawn(big.oneshot(()));
    settle().await;
    assert_eq!(live(&t), (1, 0), "two free units are not enough for three");
    tokio::time::sleep(Duration::from_millis(40)).await;
    drop(held);
    waiting.await.unwrap().unwrap();
    assert_eq!(t.sum(QUEUE_DURATION_INSTRUMENT, &[]), 40.0);
    assert_books(&t, "verify", 1, 0);
    assert_eq!(units.in_use(), 0);
}

// ---------------------------------------------------------------------------------------------
// A pool of reusable resources
// ---------------------------------------------------------------------------------------------

/// Runs in sandbox [`HandsOver::current`], which no other operation may hold meanwhile.
async fn use_sandbox(
    in_use: &Mutex<BTreeSet<&'static str>>,
    used: &Mutex<BTreeSet<&'static str>>,
    job: u64,
) -> Result<&'static str, BoxError> {
    let sandbox = HandsOver::current().expect("the permit handed a sandbox to the work");
    assert!(
        in_use.lock().unwrap().insert(sandbox),
        "sandbox {sandbox} handed to two operations at once"
    );
    used.lock().unwrap().insert(sandbox);
    tokio::time::sleep(Duration::from_millis(5 + job % 4)).await;
    in_use.lock().unwrap().remove(sandbox);
    if job % 4 == 0 {
        Err(format!("job {job} failed in sandbox {sandbox}").into())
    } else {
        Ok(sandbox)
    }
}

#[tokio::test(start_paused = true)]
async fn a_pool_hands_each_operation_a_sandbox_of_its_own_through_the_layer_and_gets_it_back() {
    let t = Telemetry::new();
    let pool = Sandboxes::new(&["a", "b"]);
    let in_use = Arc::new(Mutex::new(BTreeSet::new()));
    let used = Arc::new(Mutex::new(BTreeSet::new()));
    let service = ResourcesOperationLayer::new(HandsOver(pool.clone()))
        .operation(Operation::Tool)
        .executor(Executor::Subprocess)
        .metrics(t.metrics.clone())
        .layer(service_fn({
            let (in_use, used) = (Arc::clone(&in_use), Arc::clone(&used));
            move |job: u64| {
                let (in_use, used) = (Arc::clone(&in_use), Arc::clone(&used));
                async move { use_sandbox(&in_use, &used, job).await }
            }
        }));
    let tasks: Vec<_> = (1..=12u64)
        .map(|job| tokio::spawn(SANDBOX.scope(Cell::new(None), service.clone().oneshot(job))))
        .collect();
    let mut failed = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(sandbox) => assert!(["a", "b"].contains(&sandbox)),
            Err(_) => failed += 1,
        }
    }
    assert_eq!(failed, 3);
    assert_eq!(
        *used.lock().unwrap(),
        BTreeSet::from(["a", "b"]),
        "both sandboxes served"
    );
    assert_eq!(
        pool.free(),
        BTreeSet::from(["a", "b"]),
        "every sandbox is back"
    );
    assert_eq!(pool.places(), 2);
    assert_books(&t, "tool", 9, 3);
    assert_eq!(limit_of(&t, "tool"), 2);
}

#[tokio::test(start_paused = true)]
async fn a_pool_hands_each_operation_a_sandbox_of_its_own_through_resources_operation() {
    let t = Telemetry::new();
    let pool = HandsOver(Sandboxes::new(&["a", "b"]));
    let in_use = Arc::new(Mutex::new(BTreeSet::new()));
    let used = Arc::new(Mutex::new(BTreeSet::new()));
    let tasks: Vec<_> = (1..=12u64)
        .map(|job| {
            let (metrics, pool) = (t.metrics.clone(), pool.clone());
            let (in_use, used) = (Arc::clone(&in_use), Arc::clone(&used));
            tokio::spawn(SANDBOX.scope(Cell::new(None), async move {
                metrics
                    .resources_operation(&pool, Operation::Verify, Executor::Process, async {
                        use_sandbox(&in_use, &used, job).await
                    })
                    .await
                    .expect("never turned away")
            }))
        })
        .collect();
    let failed = count_failed(tasks).await;
    assert_eq!(*used.lock().unwrap(), BTreeSet::from(["a", "b"]));
    assert_eq!(
        pool.0.free(),
        BTreeSet::from(["a", "b"]),
        "every sandbox is back"
    );
    assert_eq!(pool.0.places(), 2);
    assert_books(&t, "verify", 12 - failed, failed);
    assert_eq!(failed, 3);
    assert_eq!(limit_of(&t, "verify"), 2);
}

/// `resources_operation_with` hands the permit itself to the work: the sandbox the checkout
/// holds, no task-local needed; it goes back to the pool once the work is done, or dropped.
#[tokio::test(start_paused = true)]
async fn resources_operation_with_hands_the_checkout_to_the_work_and_takes_it_back_after() {
    let t = Telemetry::new();
    let pool = Sandboxes::new(&["a"]);
    let seen = t
        .metrics
        .resources_operation_with(
            &pool,
            Operation::Tool,
            Executor::Process,
            async |checkout| {
                assert!(pool.free().is_empty(), "checked out while the work runs");
                Ok::<_, BoxError>(checkout.sandbox())
            },
        )
        .await
        .expect("never turned away")
        .unwrap();
    assert_eq!(seen, "a");
    assert_eq!(
        pool.free(),
        BTreeSet::from(["a"]),
        "back once the work is done"
    );

    let (started_tx, started) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn({
        let (metrics, pool) = (t.metrics.clone(), pool.clone());
        async move {
            metrics
                .resources_operation_with(&pool, Operation::Tool, Executor::Process, async |c| {
                    started_tx.send(c.sandbox()).unwrap();
                    std::future::pending::<Result<(), BoxError>>().await
                })
                .await
        }
    });
    assert_eq!(started.await.unwrap(), "a");
    holder.abort();
    assert!(holder.await.unwrap_err().is_cancelled());
    assert_eq!(
        pool.free(),
        BTreeSet::from(["a"]),
        "back when the work is dropped"
    );
    let outcomes = t.outcomes(&[(OPERATION_ATTRIBUTE, "tool")]);
    assert_eq!(
        outcomes,
        BTreeMap::from([("cancelled".to_owned(), 1), ("ok".to_owned(), 1)])
    );
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_pool_gets_its_sandbox_back_from_a_cancelled_operation() {
    let t = Telemetry::new();
    let pool = Sandboxes::new(&["a"]);
    let service = ResourcesOperationLayer::new(pool.clone())
        .metrics(t.metrics.clone())
        .layer(service_fn(|()| async {
            std::future::pending::<()>().await;
            Ok::<_, BoxError>(())
        }));
    let gave_up = tokio::time::timeout(Duration::from_millis(30), service.oneshot(())).await;
    assert!(gave_up.is_err());
    assert_eq!(pool.free(), BTreeSet::from(["a"]));
    assert_eq!(
        t.outcomes(&[]),
        BTreeMap::from([("cancelled".to_owned(), 1)])
    );
    assert_eq!(live(&t), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// A limit that never admits
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_limit_that_never_admits_is_answered_with_queue_timeout_by_a_layer_with_a_queue_timeout()
{
    let t = Telemetry::new();
    let never = Never::default();
    let service = ResourcesOperationLayer::new(never.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .protocol(RejectAsError)
        .queue_timeout(Duration::from_millis(250))
        .layer(service_fn(not_called));
    let error = tokio::time::timeout(DEADLINE, service.oneshot(()))
        .await
        .expect("no hang")
        .unwrap_err();
    assert_eq!(
        error.downcast_ref::<Rejected>().map(Rejected::rejection),
        Some(Rejection::QueueTimeout)
    );
    assert_eq!(
        t.live_value(
            REJECTED_INSTRUMENT,
            &[
                (OPERATION_ATTRIBUTE, "judge"),
                (REJECTION_ATTRIBUTE, "queue_timeout")
            ]
        ),
        1
    );
    assert_eq!(abandoned(&t, "judge"), 0);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(
        (never.asked(), never.dropped()),
        (1, 1),
        "the limit saw its wait given up"
    );
}

/// A waiting service asks its wait, not the limit: the limit is asked for a free place once per
/// operation, with metrics on or off, however often the wait is polled (a place freed while it
/// waits goes to the head of the queue, not to a re-poll).
#[tokio::test]
async fn a_waiting_operation_asks_the_limit_for_a_free_place_once_however_often_it_is_polled() {
    let t = Telemetry::new();
    for metrics in [OperationMetrics::disabled(), t.metrics.clone()] {
        let never = Never::default();
        let layer = ResourcesOperationLayer::new(never.clone()).metrics(metrics);
        let (mut waiting, _handle) = mock::spawn_layer::<(), (), _>(layer);
        for _ in 0..3 {
            assert_pending!(waiting.poll_ready());
        }
        assert_eq!(
            (never.tried(), never.asked()),
            (1, 1),
            "one look for a free place, then one wait"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_limit_that_never_admits_counts_a_caller_that_gives_up_as_abandoned_and_leaks_nothing() {
    let t = Telemetry::new();
    let never = Never::default();
    let layer = ResourcesOperationLayer::new(never.clone())
        .operation(Operation::Tool)
        .metrics(t.metrics.clone());

    // A tower caller that gives up on a pending poll_ready.
    let (mut waiting, _handle) = mock::spawn_layer::<(), (), _>(layer.clone());
    assert_pending!(waiting.poll_ready());
    assert_pending!(waiting.poll_ready());
    assert_eq!(live(&t), (1, 0));
    assert_eq!(
        (never.asked(), never.dropped()),
        (1, 0),
        "one wait, however often polled"
    );
    drop(waiting);
    assert_eq!((never.asked(), never.dropped()), (1, 1));
    assert_eq!(abandoned(&t, "tool"), 1);

    // A caller that times its request out.
    let service = layer.layer(service_fn(|()| async { Ok::<_, BoxError>(()) }));
    let gave_up = tokio::time::timeout(Duration::from_secs(5), service.oneshot(())).await;
    assert!(gave_up.is_err());
    assert_eq!((never.asked(), never.dropped()), (2, 2));
    assert_eq!(abandoned(&t, "tool"), 2);

    // A scoped caller that times out.
    let gave_up = tokio::time::timeout(
        Duration::from_secs(5),
        t.metrics
            .resources_operation(&never, Operation::Tool, Executor::Inline, never_run()),
    )
    .await;
    assert!(gave_up.is_err());
    assert_eq!((never.asked(), never.dropped()), (3, 3));
    assert_eq!(
        t.live_value(ABANDONED_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "tool")]),
        3
    );
    assert_eq!(live(&t), (0, 0));
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.live_value(REJECTED_INSTRUMENT, &[]), 0);
}

// ---------------------------------------------------------------------------------------------
// A limit that fails
// ---------------------------------------------------------------------------------------------

/// Checks a caller's panic: it names the limit's type and the cause.
fn assert_names_limit_and_cause(message: &str) {
    assert!(
        message.contains(std::any::type_name::<Unreachable>()),
        "names the limit's type: {message}"
    );
    assert!(
        message.contains("store unreachable"),
        "names the cause: {message}"
    );
}

async fn a_failing_limit_is_answered_unavailable_and_counted_rejected(after: Duration) {
    let t = Telemetry::new();
    let limit = Unreachable { after };

    // A layer that answers: the service's own error, made from `Rejected`.
    let service = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Verify)
        .metrics(t.metrics.clone())
        .protocol(RejectAsError)
        .layer(service_fn(not_called));
    let error = tokio::spawn(service.oneshot(()))
        .await
        .unwrap()
        .unwrap_err();
    let rejected = error.downcast_ref::<Rejected>().expect("a Rejected");
    assert_eq!(rejected.rejection(), Rejection::Unavailable);
    assert_keeps_the_limits_error(rejected);

    // The scoped API: `Err(Rejected)`, with the limit's error as its source.
    let metrics = t.metrics.clone();
    let scoped = tokio::spawn(async move {
        metrics
            .resources_operation(
                limit.clone(),
                Operation::Judge,
                Executor::Inline,
                never_run(),
            )
            .await
    });
    let scoped = scoped.await.unwrap().map(|_| ()).unwrap_err();
    assert_eq!(scoped, Rejected::new(Rejection::Unavailable));
    assert_keeps_the_limits_error(&scoped);

    for operation in ["verify", "judge"] {
        assert_eq!(
            t.live_value(
                REJECTED_INSTRUMENT,
                &[
                    (OPERATION_ATTRIBUTE, operation),
                    (REJECTION_ATTRIBUTE, "unavailable")
                ]
            ),
            1,
            "{operation}"
        );
        assert_eq!(abandoned(&t, operation), 0, "turned away, not abandoned");
    }
    assert_eq!(
        t.count(QUEUE_DURATION_INSTRUMENT, &[]),
        0,
        "no queue sample"
    );
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn a_limit_that_fails_at_once_is_answered_unavailable_and_counted_rejected() {
    a_failing_limit_is_answered_unavailable_and_counted_rejected(Duration::ZERO).await;
}

#[tokio::test(start_paused = true)]
async fn a_limit_that_fails_after_a_wait_is_answered_unavailable_and_counted_rejected() {
    a_failing_limit_is_answered_unavailable_and_counted_rejected(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn under_a_layer_that_cannot_answer_a_failing_limit_panics_the_caller_naming_its_type_and_cause(
) {
    let t = Telemetry::new();
    let service = ResourcesOperationLayer::new(Unreachable {
        after: Duration::ZERO,
    })
    .operation(Operation::Verify)
    .metrics(t.metrics.clone())
    .layer(service_fn(not_called));
    let panicked = panic_of("the caller", tokio::spawn(service.oneshot(()))).await;
    assert_names_limit_and_cause(&panicked);
    assert_eq!(
        t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "unavailable")]),
        1,
        "counted before the panic"
    );
    assert_eq!(live(&t), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// A limit that admits slowly
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_slow_limits_admission_time_is_queue_time_through_the_layer() {
    let t = Telemetry::new();
    let slow = Slow::new(1, 200);
    let service = ResourcesOperationLayer::new(slow.clone())
        .operation(Operation::Verify)
        .metrics(t.metrics.clone())
        .layer(service_fn(|()| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, BoxError>(())
        }));
    let first = tokio::spawn(service.clone().oneshot(()));
    let second = tokio::spawn(service.oneshot(()));
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();

    // Both pay the 200 ms admission; the second also waits for the first's 100 ms of work.
    let points = t.points(
        QUEUE_DURATION_INSTRUMENT,
        &[(OPERATION_ATTRIBUTE, "verify")],
    );
    assert_eq!(points.len(), 1);
    assert_eq!(points[0].count, 2);
    assert_eq!(points[0].min, Some(200.0));
    assert_eq!(points[0].max, Some(300.0));
    assert_eq!(
        t.sum(DURATION_INSTRUMENT, &[]),
        200.0,
        "run time starts at the permit"
    );
    assert_books(&t, "verify", 2, 0);
    assert_eq!(slow.units.in_use(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_limits_admission_time_is_queue_time_through_resources_operation() {
    let t = Telemetry::new();
    let slow = Slow::new(2, 150);
    let output = t
        .metrics
        .resources_operation(&slow, Operation::Tool, Executor::Thread, async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, BoxError>("done")
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(output, "done");
    assert_eq!(t.sum(QUEUE_DURATION_INSTRUMENT, &[]), 150.0);
    assert_eq!(t.sum(DURATION_INSTRUMENT, &[]), 50.0);
    assert_books(&t, "tool", 1, 0);
    assert_eq!(
        limit_of(&t, "tool"),
        0,
        "a limit that does not report a capacity has no limit series"
    );
    assert_eq!(slow.units.in_use(), 0);
}

// ---------------------------------------------------------------------------------------------
// The crate's own limits in the scoped API
// ---------------------------------------------------------------------------------------------

/// `output`, from a `verify` operation on `limit` run by `resources_operation`, whose work checks
/// that `free` places are left: none, it holds the only one.
async fn verify_holding<A: Acquire>(
    t: &Telemetry,
    limit: A,
    free: impl Fn() -> usize,
    output: u32,
) -> u32 {
    t.metrics
        .resources_operation(limit, Operation::Verify, Executor::Inline, async {
            assert_eq!(free(), 0, "held while the work runs");
            Ok::<_, BoxError>(output)
        })
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn arc_semaphore_ref_semaphore_and_ref_limit_work_with_resources_operation() {
    let t = Telemetry::new();
    let shared = Arc::new(Semaphore::new(1));
    let borrowed = Semaphore::new(1);
    let limit = Limit::new(1);

    let a = verify_holding(&t, Arc::clone(&shared), || shared.available_permits(), 1).await;
    let b = verify_holding(&t, &borrowed, || borrowed.available_permits(), 2).await;
    let c = verify_holding(&t, &limit, || limit.available(), 3).await;
    assert_eq!((a, b, c), (1, 2, 3));
    assert_eq!(
        (
            shared.available_permits(),
            borrowed.available_permits(),
            limit.available()
        ),
        (1, 1, 1)
    );
    assert_books(&t, "verify", 3, 0);
    assert_eq!(
        limit_of(&t, "verify"),
        1,
        "only the Limit reports a capacity"
    );

    // A user-defined limit by reference, and behind an `Arc`.
    let units = Weighted::new(2);
    let by_arc = Arc::new(units.weighing(2));
    t.metrics
        .resources_operation(&units, Operation::Judge, Executor::Inline, async {})
        .await
        .unwrap();
    t.metrics
        .resources_operation(
            Arc::clone(&by_arc),
            Operation::Judge,
            Executor::Inline,
            async {
                assert_eq!(units.in_use(), 2);
            },
        )
        .await
        .unwrap();
    assert_books(&t, "judge", 2, 0);
    assert_eq!(limit_of(&t, "judge"), 2, "one capacity, reached two ways");
    assert_eq!(units.in_use(), 0);
}

// ---------------------------------------------------------------------------------------------
// How a layer's service polls a limit
// ---------------------------------------------------------------------------------------------

/// A service of a layer on `limit` that records nothing, over a mock inner service.
type Quiet<L> = mock::Spawn<ResourcesOperation<mock::Mock<(), ()>, DefaultClassifier, L>>;

/// A layer on `limit` that records nothing, spawned over a mock inner service; the handle keeps
/// the inner service open.
fn spawn_quiet<L>(limit: L) -> (Quiet<L>, mock::Handle<(), ()>)
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    mock::spawn_layer(ResourcesOperationLayer::new(limit).metrics(OperationMetrics::disabled()))
}

#[tokio::test(flavor = "current_thread")]
async fn a_layers_service_is_pending_on_a_full_limit_then_woken_and_ready_once_a_permit_is_released(
) {
    let limit = Limit::new(1);
    let (mut service, _handle) = spawn_quiet(limit.clone());

    assert_ready_ok!(service.poll_ready());
    assert_eq!(limit.available(), 0);
    let first = service.call(());

    assert_pending!(service.poll_ready());
    assert_eq!(limit.queued(), 1, "the service waits in the limit's queue");
    assert!(!service.is_woken());

    drop(first);
    assert!(service.is_woken(), "the release wakes the waiting service");
    assert_ready_ok!(service.poll_ready());
    assert_eq!((limit.available(), limit.queued()), (0, 0));
    let second = service.call(());

    // It waits again; dropped while it waits, it gives up its place.
    assert_pending!(service.poll_ready());
    let mut clone = service.clone();
    assert_eq!(limit.queued(), 1, "a clone starts with no wait of its own");
    assert_pending!(clone.poll_ready());
    assert_eq!(limit.queued(), 2);
    drop(service);
    assert_eq!(limit.queued(), 1);
    drop(second);
    assert!(clone.is_woken());
    assert_ready_ok!(clone.poll_ready());
    drop(clone.call(()));
    assert_eq!((limit.available(), limit.queued()), (1, 0));
    assert_eq!(clone.get_ref().limit().capacity(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_layers_service_waits_on_a_user_defined_limit_and_panics_naming_it_when_it_fails() {
    let units = Weighted::new(3);
    let (mut service, _handle) = spawn_quiet(units.weighing(2));
    assert_ready_ok!(service.poll_ready());
    assert_eq!(units.in_use(), 2, "the operation holds its whole weight");
    let held = service.call(());
    assert_pending!(service.poll_ready(), "1 unit left of 3");
    drop(held);
    assert!(service.is_woken());
    assert_ready_ok!(service.poll_ready());
    drop(service.call(()));
    assert_eq!(units.in_use(), 0);

    let failing = Unreachable {
        after: Duration::ZERO,
    };
    let error = failing.acquire().await.unwrap_err();
    assert_eq!(
        error.rejection(),
        Rejection::Unavailable,
        "answered as unavailable"
    );
    assert!(error.is_failure(), "a failure, not a rule of the limit's");
    assert!(error.to_string().contains("store unreachable"), "{error}");
    assert!(std::error::Error::source(&error).is_some());

    // A layer's service reports it as the documented panic: the limit cannot admit any
    // operation, naming its type and the cause (not a rejection it could not answer).
    let (mut service, _handle) = spawn_quiet(failing);
    let panicked = catch_unwind(AssertUnwindSafe(|| service.poll_ready())).unwrap_err();
    let message = panic_message(&*panicked);
    assert_names_limit_and_cause(&message);
    assert!(message.contains("cannot admit any operation"), "{message}");
    assert!(!message.contains("turned an operation away"), "{message}");
}

#[test]
fn a_user_defined_limit_is_neither_rejecting_nor_reporting_by_default() {
    let never = Never::default();
    assert!(!never.may_reject());
    assert!(never.capacity().is_none());
    assert!(never.try_acquire().is_none());
}
