//! Thousands of operations of every kind through shared limits on a multi-threaded runtime:
//! the books the test keeps of how each one ended match the metrics exactly, every permit comes
//! back, and the live counts return to 0.

mod reliability;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tower::util::BoxService;
use tower::{service_fn, Layer as _, ServiceBuilder, ServiceExt as _};

use reliability::{
    assert_books, assert_live_counts_zero, quiet_expected_panics, Books, Load, Rng, Series,
    EXPECTED_PANIC,
};
use support::Telemetry;
use tower_resources_operation::{
    set_outcome, Executor, Operation, OperationMetrics, Outcome, ResourcesOperationLayer,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A layer on a semaphore shared with other layers.
type SemaphoreLayer = ResourcesOperationLayer<
    tower_resources_operation::SharedClassifier<tower_resources_operation::TimeoutClassifier>,
    Arc<Semaphore>,
>;

/// The inner service every operation runs, whatever its kind.
type Inner = BoxService<Work, String, BoxError>;

/// A safety net so a lost permit fails the test instead of hanging it; not a performance bound.
const DEADLINE: Duration = Duration::from_secs(60);

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
    /// Marks `called` in `call` (so the test knows it was admitted), sleeps, answers `Ok`.
    Flagged(Arc<AtomicBool>, Duration),
}

/// The inner service; counts itself on `load` while it runs, when given one.
fn inner(load: Option<Arc<Load>>) -> Inner {
    BoxService::new(service_fn(move |work: Work| {
        let guard = load.as_ref().map(Load::enter);
        match &work {
            Work::PanicInCall => panic!("{EXPECTED_PANIC}: in call"),
            Work::Flagged(called, _) => called.store(true, Ordering::SeqCst),
            _ => {}
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
                Work::Flagged(_, run) => {
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

/// `layer` over `inner`, boxed.
///
/// Boxing the layered service keeps its concrete future type out of the spawned async blocks:
/// rustc erases the `'static` of `BoxError`'s trait object inside an async block's captured
/// types, and then cannot prove the classifier bound (`DefaultClassifier` needs `Err: 'static`)
/// that names the service's future type, so `tokio::spawn(async move { layered.oneshot(req) })`
/// fails with "higher-ranked lifetime error" (tower's own `Timeout` has the same problem).
fn boxed(layer: &SemaphoreLayer, inner: Inner) -> Inner {
    BoxService::new(layer.layer(inner))
}

/// One semaphore, the layers that share it (one per series), and the load of its inner work.
struct Limit {
    semaphore: Arc<Semaphore>,
    max: usize,
    layers: Vec<(Series, SemaphoreLayer)>,
    load: Arc<Load>,
}

impl Limit {
    fn new(max: usize, series: &[Series], metrics: &OperationMetrics) -> Self {
        let semaphore = Arc::new(Semaphore::new(max));
        let layers = series
            .iter()
            .map(|&(operation, executor)| {
                let layer = ResourcesOperationLayer::with_semaphore(Arc::clone(&semaphore))
                    .classifier(tower_resources_operation::TimeoutClassifier::new())
                    .operation(operation)
                    .executor(executor)
                    .metrics(metrics.clone());
                ((operation, executor), layer)
            })
            .collect();
        Self {
            semaphore,
            max,
            layers,
            load: Arc::default(),
        }
    }

    /// A layer of this limit, picked by `rng`, with its series.
    fn pick(&self, rng: &mut Rng) -> (Series, SemaphoreLayer) {
        self.layers[rng.below(self.layers.len() as u64) as usize].clone()
    }
}

/// Two limits, five series, one `OperationMetrics`.
fn limits(metrics: &OperationMetrics) -> Vec<Limit> {
    vec![
        Limit::new(
            3,
            &[
                (Operation::Verify, Executor::Subprocess),
                (Operation::Judge, Executor::Inline),
            ],
            metrics,
        ),
        Limit::new(
            2,
            &[
                (Operation::Tool, Executor::Thread),
                (Operation::Other, Executor::Process),
                (Operation::Verify, Executor::Thread),
            ],
            metrics,
        ),
    ]
}

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
    ReadyUnused,
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

/// Runs one operation of `kind` through `layer`, checks what the caller got, and returns the
/// outcome it must have been recorded with.
async fn run(kind: Kind, layer: SemaphoreLayer, load: Arc<Load>) -> Outcome {
    let service = || boxed(&layer, inner(Some(Arc::clone(&load))));
    match kind {
        Kind::Ok => {
            assert_eq!(service().oneshot(Work::Ok).await.unwrap(), "ok");
            Outcome::Ok
        }
        Kind::Err => {
            let error = service().oneshot(Work::Err).await.unwrap_err();
            assert_eq!(error.to_string(), "boom");
            Outcome::Error
        }
        Kind::PanicInCall | Kind::PanicInPoll => {
            let work = match kind {
                Kind::PanicInCall => Work::PanicInCall,
                _ => Work::PanicInPoll,
            };
            let joined = tokio::spawn(service().oneshot(work)).await;
            assert!(joined
                .expect_err("a panicking operation answered")
                .is_panic());
            Outcome::Crashed
        }
        Kind::SetTimeoutThenOk => {
            assert_eq!(
                service().oneshot(Work::SetTimeoutThenOk).await.unwrap(),
                "set"
            );
            Outcome::Timeout
        }
        Kind::SetOkThenErr => {
            let error = service().oneshot(Work::SetOkThenErr).await.unwrap_err();
            assert_eq!(error.to_string(), "boom");
            Outcome::Ok
        }
        Kind::TowerTimeout => {
            // The inner work never ends, so once admitted tower's timeout is its only end.
            let service = boxed(&layer, timed(Duration::from_millis(1)));
            let error = service.oneshot(Work::Hang(None)).await.unwrap_err();
            assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
            Outcome::Timeout
        }
        Kind::DropInFlight => {
            // Dropped only once the inner work has started, and the work never ends by itself.
            let (started_tx, started_rx) = oneshot::channel();
            let operation = service().oneshot(Work::Hang(Some(started_tx)));
            tokio::select! {
                biased;
                result = operation => panic!("a hanging operation finished: {result:?}"),
                started = started_rx => started.expect("the work was dropped before it started"),
            }
            Outcome::Cancelled
        }
        Kind::ReadyUnused => {
            // poll_ready takes the permit; the service is dropped without a call.
            let mut service = service();
            service.ready().await.unwrap();
            tokio::task::yield_now().await;
            drop(service);
            Outcome::Cancelled
        }
    }
}

/// Awaits `future`, failing the test if it takes longer than [`DEADLINE`].
async fn within<F: std::future::Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Every permit is back, the inner work never ran above the limit, and nothing is left running.
fn assert_limits_idle(limits: &[Limit]) {
    for limit in limits {
        assert_eq!(limit.semaphore.available_permits(), limit.max);
        assert!(
            limit.load.max() <= limit.max,
            "{} ran at once under a limit of {}",
            limit.load.max(),
            limit.max
        );
        assert_eq!(limit.load.running(), 0);
    }
}

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
        let (open_tx, open_rx) = watch::channel(false);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();
        let mut gates = Vec::new();
        for limit in &limits {
            for _ in 0..limit.max {
                let (series, layer) = limit.pick(&mut rng);
                let service = boxed(&layer, inner(Some(Arc::clone(&limit.load))));
                let work = Work::Gate {
                    started: started_tx.clone(),
                    open: open_rx.clone(),
                };
                gates.push((series, tokio::spawn(service.oneshot(work))));
            }
        }
        for _ in 0..gates.len() {
            within("a gate operation", started_rx.recv()).await;
        }
        for limit in &limits {
            assert_eq!(limit.semaphore.available_permits(), 0);
        }

        let mut drops = Vec::new();
        for _ in 0..QUEUE_DROPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (_, layer) = limit.pick(&mut rng);
            let service = boxed(&layer, inner(Some(Arc::clone(&limit.load))));
            drops.push(tokio::spawn(async move {
                let waited =
                    tokio::time::timeout(Duration::from_millis(1), service.oneshot(Work::Ok)).await;
                assert!(waited.is_err(), "got a permit of a full limit: {waited:?}");
            }));
        }

        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (series, layer) = limit.pick(&mut rng);
            let kind = KINDS[rng.below(KINDS.len() as u64) as usize];
            let load = Arc::clone(&limit.load);
            operations.push((series, tokio::spawn(run(kind, layer, load))));
        }

        for dropped in drops {
            within("a wait given up", dropped).await.unwrap();
            dropped_in_queue += 1;
        }
        open_tx.send(true).unwrap();
        for (series, gate) in gates {
            assert_eq!(
                within("a gate operation", gate).await.unwrap().unwrap(),
                "gate"
            );
            books.ended(series, Outcome::Ok);
        }
        for (series, operation) in operations {
            let outcome = within("an operation", operation).await.unwrap();
            books.ended(series, outcome);
        }
    }

    assert_limits_idle(&limits);
    for limit in &limits {
        // The gates filled each limit, so the work did run at the limit.
        assert_eq!(limit.load.max(), limit.max);
    }
    assert_eq!(dropped_in_queue, WAVES * QUEUE_DROPS_PER_WAVE);
    let operations = (WAVES * OPS_PER_WAVE) as u64;
    let gates = (WAVES * limits.iter().map(|l| l.max).sum::<usize>()) as u64;
    assert_eq!(books.admitted_total(), operations + gates);
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
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
        let (series, layer) = limit.pick(&mut rng);
        let load = Arc::clone(&limit.load);
        let run = Duration::from_micros(rng.below(2_000));
        let deadline = Duration::from_micros(rng.below(2_000));
        let called = Arc::new(AtomicBool::new(false));
        let work = Work::Flagged(Arc::clone(&called), run);
        // Arrivals spread over half a second keep the queue short enough that deadlines land
        // before admission, in flight and after the end alike (a few hundred of each).
        let arrival = Duration::from_micros(rng.below(500_000));
        operations.push((
            series,
            tokio::spawn(async move {
                tokio::time::sleep(arrival).await;
                if i % 2 == 0 {
                    // The caller gives up after `deadline`: before the permit, in flight, or
                    // not at all. `called` tells which (oneshot calls in the poll that admits).
                    let service = boxed(&layer, inner(Some(load)));
                    match tokio::time::timeout(deadline, service.oneshot(work)).await {
                        Ok(answer) => {
                            assert_eq!(answer.unwrap(), "ok");
                            Some(Outcome::Ok)
                        }
                        Err(_) if called.load(Ordering::SeqCst) => Some(Outcome::Cancelled),
                        Err(_) => None,
                    }
                } else {
                    // tower's timeout races the work; the answer tells which won.
                    let service = boxed(&layer, timed(deadline));
                    match service.oneshot(work).await {
                        Ok(answer) => {
                            assert_eq!(answer, "ok");
                            Some(Outcome::Ok)
                        }
                        Err(error) => {
                            assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
                            Some(Outcome::Timeout)
                        }
                    }
                }
            }),
        ));
    }

    let mut books = Books::default();
    let mut given_up_in_queue = 0;
    for (series, operation) in operations {
        match within("an operation", operation).await.unwrap() {
            Some(outcome) => books.ended(series, outcome),
            None => given_up_in_queue += 1,
        }
    }

    assert_limits_idle(&limits);
    assert_eq!(books.admitted_total() + given_up_in_queue, OPS as u64);
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}
